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
    "arith-expand, convert-math-to-llvm, convert-math-to-libm,"
    "finalize-memref-to-llvm, convert-arith-to-llvm, convert-cf-to-llvm, convert-func-to-llvm,"
    "convert-index-to-llvm, reconcile-unrealized-casts)"
)

_MLIR_LOCK = threading.Lock()  # an MLIR context is not shared across threads


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
        module = ir.Module.parse(llvm_text)
        engine = ExecutionEngine(module, opt_level=opt_level)
    return CpuExecutable(engine, llvm_text)
