"""bf16 on the CPU backend without native bf16 instructions: the __truncsfbf2 that jnova defines in
every JIT-compiled module holding bf16 values (LLVM's x86 backend calls it for some narrowings, and
libgcc before GCC 13 has none), checked bit for bit against ml_dtypes' rounding."""
import ctypes

import ml_dtypes
import numpy as np

from jnova.codegen.cpu import BF16_RUNTIME, with_bf16_runtime

CALLER = """
module {
  llvm.func @_mlir_ciface_narrow(%src: !llvm.ptr, %dst: !llvm.ptr, %n: i64) {
    %c0 = llvm.mlir.constant(0 : i64) : i64
    %c1 = llvm.mlir.constant(1 : i64) : i64
    llvm.br ^loop(%c0 : i64)
  ^loop(%i: i64):
    %done = llvm.icmp "sge" %i, %n : i64
    llvm.cond_br %done, ^exit, ^body
  ^body:
    %p = llvm.getelementptr %src[%i] : (!llvm.ptr, i64) -> !llvm.ptr, f32
    %x = llvm.load %p : !llvm.ptr -> f32
    %y = llvm.call @__truncsfbf2(%x) : (f32) -> bf16
    %q = llvm.getelementptr %dst[%i] : (!llvm.ptr, i64) -> !llvm.ptr, bf16
    llvm.store %y, %q : bf16, !llvm.ptr
    %next = llvm.add %i, %c1 : i64
    llvm.br ^loop(%next : i64)
  ^exit:
    llvm.return
  }
}
"""


def test_truncation_rounds_to_nearest_even_like_ml_dtypes():
    from mlir import ir
    from mlir.execution_engine import ExecutionEngine

    rng = np.random.default_rng()
    specials = np.array([0.0, -0.0, 1.0, -1.5, np.inf, -np.inf, np.nan, -np.nan, 3.4e38, -3.4e38, 1e-40,
                         -1e-45, 65504.0], np.float32)
    ties = (np.arange(1 << 16, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # exactly halfway
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([specials, ties, bits, rng.standard_normal(10_000).astype(np.float32)])
    out = np.zeros(x.shape, np.uint16)
    with ir.Context():
        engine = ExecutionEngine(ir.Module.parse(with_bf16_runtime(CALLER)), opt_level=0)
    engine.invoke("narrow", ctypes.pointer(ctypes.c_void_p(x.ctypes.data)),  # packed: pointers to the arguments
                  ctypes.pointer(ctypes.c_void_p(out.ctypes.data)), ctypes.pointer(ctypes.c_int64(x.size)))
    want = x.astype(ml_dtypes.bfloat16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(out[~nan], want[~nan].view(np.uint16))
    got_nan = out[nan].view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.isnan(got_nan).all()
    assert ((out[nan] >> 15) == (x[nan].view(np.uint32) >> 31)).all()  # the sign is kept


def test_runtime_is_added_only_where_bf16_is_held():
    assert with_bf16_runtime("module {\n}") == "module {\n}"
    added = with_bf16_runtime("module {\n  %x: bf16\n}")
    assert added.count("@__truncsfbf2") == 1 and added.rstrip().endswith("}")
    assert with_bf16_runtime(added) == added
    assert "llvm.func @__truncsfbf2(%x: f32) -> bf16" in BF16_RUNTIME
