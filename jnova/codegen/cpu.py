"""The CPU backend: linalg on tensors -> bufferization -> LLVM -> MLIR ExecutionEngine.

`compile_cpu_module` runs the upstream pass pipeline on a module of kernel functions (as written by
`linalg.lowering.kernel_to_linalg`) and JIT-compiles it; `CpuExecutable.run` calls one kernel on
NumPy arrays, writing into output arrays it allocates.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading

import numpy as np

from jnova.dialect.types import TensorType, numpy_dtype

log = logging.getLogger("jnova.codegen")

CPU_PIPELINE = (
    "builtin.module("
    "func.func(linalg-fuse-elementwise-ops, canonicalize, cse),"
    "one-shot-bufferize{bufferize-function-boundaries=0},"
    "func.func(buffer-hoisting, buffer-loop-hoisting),"
    "buffer-deallocation-pipeline,"
    "convert-linalg-to-loops, convert-scf-to-cf, expand-strided-metadata, lower-affine,"
    "arith-emulate-unsupported-floats{source-types=bf16 target-type=f32}, arith-expand{include-bf16=true},"
    "convert-math-to-llvm, convert-math-to-libm,"
    "finalize-memref-to-llvm, convert-arith-to-llvm, convert-cf-to-llvm, convert-func-to-llvm,"
    "convert-index-to-llvm, reconcile-unrealized-casts)"
)

_MLIR_LOCK = threading.Lock()  # an MLIR context is not shared across threads

# f32 -> bf16 (round to nearest even; NaN stays NaN), defined in every JIT-compiled module that has bf16
# values. The pipeline expands bf16 arithmetic into f32 and integer ops, but LLVM's x86 backend still
# narrows some bf16 values it holds in registers (constants, block arguments) through the runtime
# function __truncsfbf2, which a CPU without AVX512-BF16 has in no library (libgcc has it from GCC 13).
BF16_RUNTIME = """
  llvm.func @__truncsfbf2(%x: f32) -> bf16 {
    %bits = llvm.bitcast %x : f32 to i32
    %c16 = llvm.mlir.constant(16 : i32) : i32
    %c1 = llvm.mlir.constant(1 : i32) : i32
    %half = llvm.mlir.constant(32767 : i32) : i32
    %quiet = llvm.mlir.constant(64 : i32) : i32
    %abs_mask = llvm.mlir.constant(2147483647 : i32) : i32
    %inf = llvm.mlir.constant(2139095040 : i32) : i32
    %top = llvm.lshr %bits, %c16 : i32
    %odd = llvm.and %top, %c1 : i32
    %bias = llvm.add %half, %odd : i32
    %rounded = llvm.add %bits, %bias : i32
    %narrow = llvm.lshr %rounded, %c16 : i32
    %abs = llvm.and %bits, %abs_mask : i32
    %is_nan = llvm.icmp "ugt" %abs, %inf : i32
    %nan = llvm.or %top, %quiet : i32
    %chosen = llvm.select %is_nan, %nan, %narrow : i1, i32
    %short = llvm.trunc %chosen : i32 to i16
    %out = llvm.bitcast %short : i16 to bf16
    llvm.return %out : bf16
  }
"""


def with_bf16_runtime(module_text: str) -> str:
    """`module_text` (a builtin module) with BF16_RUNTIME added where it holds bf16 values."""
    if "bf16" not in module_text or "llvm.func @__truncsfbf2" in module_text:
        return module_text
    end = module_text.rstrip().rindex("}")
    return module_text[:end] + BF16_RUNTIME + module_text[end:]


class CpuExecutable:
    """A JIT-compiled module of kernels callable on NumPy arrays."""

    def __init__(self, engine, llvm_text: str):
        self.engine = engine
        self.llvm_text = llvm_text

    def run(self, name: str, inputs: list[np.ndarray], out_types: list[TensorType]) -> list[np.ndarray]:
        from mlir.runtime import get_ranked_memref_descriptor

        outs = [np.empty(t.shape, numpy_dtype(t.dtype)) for t in out_types]
        keep = [np.ascontiguousarray(x) for x in inputs] + outs
        descriptors = [get_ranked_memref_descriptor(_storage_view(x)) for x in keep]
        pointers = [ctypes.pointer(ctypes.pointer(d)) for d in descriptors]
        self.engine.invoke(name, *pointers)
        return outs


def _storage_view(x: np.ndarray) -> np.ndarray:
    """A view ctypes understands: bfloat16 and other exotic dtypes travel as same-width integers."""
    if x.dtype.kind in "biuf" and x.dtype.name != "bfloat16":
        return x
    return x.view(f"u{x.dtype.itemsize}")


def lower_to_llvm(module_text: str) -> str:
    """Run the CPU pass pipeline (in the isolated worker); returns the LLVM-dialect module text."""
    from jnova.codegen.worker import run_pipeline

    return run_pipeline("cpu", module_text, stage="lower_cpu")


def jit_llvm(llvm_text: str, opt_level: int | None = None) -> CpuExecutable:
    """JIT-compile an LLVM-dialect module with the MLIR ExecutionEngine.

    LLVM's optimizer costs about 20x more time than it saves on the test-sized steps the CPU backend
    runs (8 s vs 0.4 s to JIT a 2-layer GPT-2 step), so the default is 0; set JNOVA_CPU_OPT_LEVEL
    (0-3) for long CPU runs.
    """
    if opt_level is None:
        opt_level = int(os.environ.get("JNOVA_CPU_OPT_LEVEL", "0"))
    from mlir import ir
    from mlir.execution_engine import ExecutionEngine

    with _MLIR_LOCK, ir.Context():
        module = ir.Module.parse(with_bf16_runtime(llvm_text))
        engine = ExecutionEngine(module, opt_level=opt_level)
    return CpuExecutable(engine, llvm_text)
