"""What a compiled GPU kernel is to the rest of jnova: its PTX and launch geometry (`GpuLaunch`).

Apart from the builders (compile.py), so that a step restored from the persistent cache, and the
kernel call's CUDA lowering, use launches without importing the code that builds them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuLaunch:
    """One compiled kernel: its PTX entry `name`, launch geometry and the gpu.module it came from.

    Parameters are the kernel's inputs then its outputs, one pointer each (16-byte aligned);
    `aliases` pairs (input index, output index) whose buffers XLA must make one (the output starts
    as a copy of the input: a scatter-add adds into it).
    """

    name: str
    ptx: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem_bytes: int  # dynamic shared memory
    compute_capability: int  # e.g. 90 (what jaxlib assembles the PTX for)
    schedule: str
    gpu_module: str
    aliases: tuple[tuple[int, int], ...] = ()

    @property
    def num_warps(self) -> int:
        return self.block[0] // 32
