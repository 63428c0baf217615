"""What a compiled GPU kernel is to the rest of jnova: its PTX and launch geometry (`GpuLaunch`).

Apart from the builders (compile.py), so that a step restored from the persistent cache, and the
kernel call's CUDA lowering, use launches without importing the code that builds them.
"""
from __future__ import annotations

from dataclasses import dataclass

# CUtensorMapDataType of the element types a tensor map describes
TENSOR_MAP_DTYPES = {"uint8": 0, "uint16": 1, "uint32": 2, "int32": 3, "float16": 6, "float32": 7, "bfloat16": 9}
TENSOR_MAP_MAX_RANK = 5
TENSOR_MAP_SWIZZLE = {None: 0, 32: 1, 64: 2, 128: 3}  # CUtensorMapSwizzle, by bytes


@dataclass(frozen=True)
class TensorMap:
    """A TMA descriptor (CUtensorMap) the launcher builds at each launch from a buffer's address and
    passes by value as kernel parameter `param` (PTX `.param .align 64 .b8 [128]`, read by
    cp.async.bulk.tensor). A kernel's maps are its last parameters, after the buffers it declares (a
    call may have more buffers: an aliased result's is its operand's). Dimensions innermost first;
    `strides` are the byte strides of dimensions 1..rank-1 (multiples of 16); `box` the elements one
    copy moves per dimension."""

    buffer: int  # index among the call's buffers (operands then results)
    param: int  # the kernel parameter it is passed as
    dtype: str
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: int | None = 128  # bytes; None for none

    def __post_init__(self):
        rank = len(self.dims)
        problems = []
        if self.dtype not in TENSOR_MAP_DTYPES:
            problems.append(f"dtype {self.dtype}")
        if not 1 <= rank <= TENSOR_MAP_MAX_RANK or len(self.strides) != rank - 1 or len(self.box) != rank:
            problems.append(f"rank {rank} with {len(self.strides)} strides and a {len(self.box)}-d box")
        if any(s % 16 for s in self.strides):
            problems.append(f"strides {self.strides} (multiples of 16 bytes)")
        if any(not 1 <= b <= 256 for b in self.box):
            problems.append(f"box {self.box} (1 to 256 elements a dimension)")
        if self.swizzle not in TENSOR_MAP_SWIZZLE:
            problems.append(f"swizzle {self.swizzle}")
        if problems:
            raise ValueError("tensor map: " + "; ".join(problems))

    def words(self) -> list[int]:
        """The launcher's registration form: buffer, param, dtype, rank, swizzle, dims[5], strides[4], box[5]."""
        pad = lambda xs, n: list(xs) + [0] * (n - len(xs))
        r = TENSOR_MAP_MAX_RANK
        return [self.buffer, self.param, TENSOR_MAP_DTYPES[self.dtype], len(self.dims),
                TENSOR_MAP_SWIZZLE[self.swizzle], *pad(self.dims, r), *pad(self.strides, r - 1), *pad(self.box, r)]

    def to_json(self) -> dict:
        return {"buffer": self.buffer, "param": self.param, "dtype": self.dtype, "dims": list(self.dims),
                "strides": list(self.strides), "box": list(self.box), "swizzle": self.swizzle}

    @classmethod
    def from_json(cls, d: dict) -> "TensorMap":
        return cls(d["buffer"], d["param"], d["dtype"], tuple(d["dims"]), tuple(d["strides"]), tuple(d["box"]),
                   d["swizzle"])


@dataclass(frozen=True)
class GpuLaunch:
    """One compiled kernel: its PTX entry `name`, launch geometry and the gpu.module it came from.

    Parameters are the kernel's inputs then its outputs, one pointer each (16-byte aligned), then
    one CUtensorMap by value per entry of `tensor_maps` (only jnova's launcher builds those);
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
    tensor_maps: tuple[TensorMap, ...] = ()

    @property
    def num_warps(self) -> int:
        return self.block[0] // 32
