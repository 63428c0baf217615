"""f32-accurate contractions on TF32 tensor cores: each operand split into a TF32 value and a remainder.

    x = hi + lo,  hi = tf32(x),  lo = tf32(x - hi)      (tf32: round to 10 mantissa bits, cvt.rna)
    a @ b ~ a_lo @ b_hi + a_hi @ b_lo + a_hi @ b_hi       (products of TF32 values are exact in f32)

`x - hi` is exact in f32 (its 13 low bits), so `hi + lo` keeps 21 of x's 24 bits; the dropped
a_lo @ b_lo term is below f32's rounding. Each product accumulates in f32 on the tensor cores; the small
terms go first so they are not lost against the large partial sum. The tensor cores add into their
accumulator rounding toward zero, so a sum carried through all of K on them loses up to an ulp per
k8 step, always in the same direction: measured on the H200, an error growing linearly with K (3.5e-4
at K = 50304 against XLA's precision=HIGHEST, benchmarks/results/h200-matmul-2026-12-03-0d63239.md).
So the kernels let the tensor cores sum one k-tile (block_k of K) from zero and add each tile's sums
into the accumulators with an f32 add, which rounds to nearest (as Ootomo and Yokota recover FP32
accuracy from tensor cores, 2022). The one-directional rounding then stays inside a tile: it costs
a few ulps of that tile's own sum, not of the running total, so the relative error no longer grows with
K (and where tiles' sums differ in sign, their errors partly cancel). This is what XLA calls the
TF32_TF32_F32_X3 algorithm. Why split TF32 rather than bf16 (bf16x6 for f32 accuracy) or FFMA: TF32
tensor cores run at 8x the H200's f32 FFMA rate (495 vs 67 TFLOP/s dense), so three products leave
room for mma.sync's lower utilisation and the split's ALU work, where six bf16 products would need 12
cvt/sub per word pair and FFMA caps the kernel at cuBLAS's SGEMM (what XLA runs for HIGHEST);
`benchmarks/matmul.py --tag highest` measures it against XLA.

`split` (NumPy) is the decomposition the kernels compute, for tests and for emulating the kernels;
`emit_split` writes it into a kernel (codegen/gpu/matmul_mma.py).
"""
from __future__ import annotations

import numpy as np

# (A part, B part) of each product, in the order they accumulate
PRODUCTS = (("lo", "hi"), ("hi", "lo"), ("hi", "hi"))


def round_tf32(x: np.ndarray) -> np.ndarray:
    """PTX's cvt.rna.tf32.f32: f32 rounded to 10 mantissa bits, nearest with ties away from zero (NaN
    and infinities unchanged); the result is an f32 whose 13 low bits are zero."""
    x = np.asarray(x, np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(np.isfinite(x), rounded, x)


def split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo): TF32 values with hi + lo = x to 21 bits."""
    x = np.asarray(x, np.float32)
    hi = round_tf32(x)
    return hi, round_tf32(x - hi)


def matmul_tf32x3(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[M, K] @ [K, N] as the split kernels compute it, with every product and sum in f32."""
    parts = {"a": split(a), "b": split(b)}
    pick = {"hi": 0, "lo": 1}
    out = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for pa, pb in PRODUCTS:
        out = out + parts["a"][pick[pa]] @ parts["b"][pick[pb]]
    return out


def emit_split(em, words: list[str]) -> tuple[list[str], list[str]]:
    """The hi and lo parts (f32 SSA values holding TF32 bits) of f32 SSA values `words`."""
    hi, lo = [], []
    for w in words:
        h = _cvt_rna(em, w)
        hi.append(h)
        lo.append(_cvt_rna(em, em.op(f"arith.subf {w}, {h} : f32")))
    return hi, lo


def emit_round(em, words: list[str]) -> list[str]:
    """The words rounded to TF32 (the one-product kernels)."""
    return [_cvt_rna(em, w) for w in words]


def _cvt_rna(em, w: str) -> str:
    bits = em.op(f"nvvm.convert.float.to.tf32 {w} {{rnd = #nvvm.fp_rnd_mode<rna>}}")
    return em.op(f"arith.bitcast {bits} : i32 to f32")
