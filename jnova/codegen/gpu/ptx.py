"""gpu.module -> PTX, and the ptxas check of the result.

`to_ptx` runs, in the isolated MLIR worker (`codegen/worker.py`):
  "gpu"      the NVVM lowering of shared/notes/mlir-gpu-codegen.md: nvgpu/scf/affine/gpu ops to the
             LLVM and NVVM dialects with bare-pointer kernel arguments; math ops libdevice does not
             cover (ctpop, ctlz) go to LLVM intrinsics afterwards;
  (fix)      dynamic shared memory becomes an external, 1024-byte aligned `.extern .shared` array
             (the lowering makes it a 1-byte static variable);
  "gpu-isa"  gpu-module-to-binary{format=isa}: the NVPTX backend, libdevice linked in.
The chip and PTX features come from the module's `#nvvm.target` attribute (what `nvvm-attach-target`
would add), written by the kernel builder from the Target.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

from jnova.codegen.worker import run_pipeline
from jnova.errors import CompileError

GPU_TO_NVVM = (
    "builtin.module(gpu.module("
    "convert-nvgpu-to-nvvm, convert-scf-to-cf, expand-strided-metadata, lower-affine, convert-nvvm-to-llvm,"
    "convert-gpu-to-nvvm{use-bare-ptr-memref-call-conv=1},"
    "convert-math-to-llvm, convert-arith-to-llvm, canonicalize, cse, reconcile-unrealized-casts))"
)
GPU_TO_ISA = "builtin.module(gpu-module-to-binary{format=isa})"

_DYNAMIC_SHARED = re.compile(r"llvm\.mlir\.global internal (@__dynamic_shmem__\d+\(\)) "
                             r"\{addr_space = 3 : i32, alignment = \d+ : i64")
_ASSEMBLY = re.compile(r'assembly = "((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(\\|[0-9A-Fa-f]{2})")


def to_ptx(module_text: str) -> str:
    """The PTX of a module holding one `gpu.module` (raises CompileError naming the failed stage)."""
    llvm = run_pipeline("gpu", module_text, stage="lower_gpu")
    llvm = by_value_tensor_maps(extern_dynamic_shared_memory(llvm))
    binary = run_pipeline("gpu-isa", llvm, stage="gpu_to_ptx")
    found = _ASSEMBLY.search(binary)
    if found is None:
        raise CompileError("gpu_to_ptx", "gpu-module-to-binary produced no PTX assembly")
    # MLIR prints a string with `\\` for a backslash and `\XX` (hex) for every other special byte
    return _ESCAPE.sub(lambda m: "\\" if m.group(1) == "\\" else chr(int(m.group(1), 16)), found.group(1))


def extern_dynamic_shared_memory(llvm_text: str) -> str:
    """`.extern .shared .align 1024 .b8 name[]` for gpu.dynamic_shared_memory (else 1 byte is reserved)."""
    return _DYNAMIC_SHARED.sub(r"llvm.mlir.global external \1 {addr_space = 3 : i32, alignment = 1024 : i64",
                               llvm_text)


TENSOR_MAP_ALIGN = 64  # the `llvm.align` that marks a gpu.func argument as a by-value tensor map
_TENSOR_MAP_ARG = f"!llvm.ptr {{llvm.align = {TENSOR_MAP_ALIGN} : i64}}"


def by_value_tensor_maps(llvm_text: str) -> str:
    """Kernel arguments `!llvm.ptr {llvm.align = 64}` become by-value 128-byte CUtensorMaps
    (`.param .align 64 .b8 [128]`) whose generic address the kernel reads (`cvta.param`), as CUDA's
    `__grid_constant__ const CUtensorMap`: gpu.func takes neither `llvm.byval` nor
    `nvvm.grid_constant`, which only a kernel's llvm.func may carry, so they are added after
    gpu-to-nvvm. Memref arguments are 16-byte aligned and unchanged."""
    return llvm_text.replace(_TENSOR_MAP_ARG, f"!llvm.ptr {{llvm.align = {TENSOR_MAP_ALIGN} : i64, "
                                              f"llvm.byval = !llvm.array<128 x i8>, nvvm.grid_constant}}")


@dataclass(frozen=True)
class PtxasReport:
    """What `ptxas -v` says about the kernel(s) of one PTX module (the worst kernel where several)."""

    arch: str
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack_frame: int  # bytes
    shared_bytes: int  # static shared memory
    log: str

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    def __str__(self) -> str:
        return (f"{self.arch}: {self.registers} registers, {self.spill_stores} B spill stores, "
                f"{self.spill_loads} B spill loads, {self.shared_bytes} B static smem")


def ptxas_path() -> str | None:
    return shutil.which("ptxas")


def assemble_check(ptx: str, arch: str) -> PtxasReport | None:
    """Assemble `ptx` for `arch` (e.g. "sm_90a") with ptxas; None when ptxas is not on PATH.

    On failure raises CompileError(stage "ptxas") with the PTX saved and the command that reruns it.
    """
    ptxas = ptxas_path()
    if ptxas is None:
        return None
    from jnova.runtime.dump import failure_path

    path = failure_path("ptxas", ".ptx")  # kept only if ptxas fails
    with open(path, "w") as f:
        f.write(ptx)
    command = [ptxas, f"-arch={arch}", "-v", path, "-o", os.devnull]
    done = subprocess.run(command, capture_output=True, text=True)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise CompileError("ptxas", log, path, " ".join(command))
    os.unlink(path)
    return _parse_report(arch, log)


def _parse_report(arch: str, log: str) -> PtxasReport:
    def worst(pattern: str) -> int:
        return max((int(n) for n in re.findall(pattern, log)), default=0)

    return PtxasReport(arch, registers=worst(r"Used (\d+) registers"),
                       spill_stores=worst(r"(\d+) bytes spill stores"), spill_loads=worst(r"(\d+) bytes spill loads"),
                       stack_frame=worst(r"(\d+) bytes stack frame"), shared_bytes=worst(r"(\d+) bytes smem"),
                       log=log)


if __name__ == "__main__":  # python -m jnova.codegen.gpu.ptx MODULE.mlir  -> PTX on stdout
    with open(sys.argv[1]) as f:
        print(to_ptx(f.read()))
