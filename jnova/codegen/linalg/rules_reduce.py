"""linalg lowerings of reductions and contractions."""
from __future__ import annotations

import numpy as np

from jnova.codegen.linalg.emitter import affine_map, compute_dtype, element
from jnova.codegen.linalg.lowering import lowering
from jnova.errors import LoweringError
from jnova.dialect.types import FLOAT_DTYPES, UNSIGNED_DTYPES


def reduce_init(kind: str, dtype: str):
    """The identity of a reduction `kind` on `dtype`."""
    if kind == "sum" or kind == "or" or kind == "xor":
        return False if dtype == "bool" else 0
    if kind == "prod":
        return True if dtype == "bool" else 1
    if kind == "and":
        return True if dtype == "bool" else -1
    if dtype == "bool":
        return kind == "min"
    if dtype in FLOAT_DTYPES:
        return -np.inf if kind == "max" else np.inf
    info = np.iinfo(dtype)
    return int(info.min if kind == "max" else info.max)


def combine(s, kind: str, dtype: str, acc: str, x: str) -> str:
    """acc (+) x for a reduction `kind` in `dtype` (max/min: NaN-propagating, -0.0 < +0.0, like XLA)."""
    e = element(dtype)
    if dtype in FLOAT_DTYPES and kind in ("max", "min"):
        return s.float_max_min(kind, acc, x, dtype)
    if dtype in FLOAT_DTYPES:
        name = {"sum": "arith.addf", "prod": "arith.mulf"}.get(kind)
    elif dtype == "bool":
        name = {"sum": "arith.ori", "or": "arith.ori", "max": "arith.ori", "prod": "arith.andi", "and": "arith.andi",
                "min": "arith.andi", "xor": "arith.xori"}.get(kind)
    else:
        u = dtype in UNSIGNED_DTYPES
        name = {"sum": "arith.addi", "prod": "arith.muli", "max": "arith.maxui" if u else "arith.maxsi",
                "min": "arith.minui" if u else "arith.minsi", "and": "arith.andi", "or": "arith.ori",
                "xor": "arith.xori"}.get(kind)
    if name is None:
        raise LoweringError(f"reduction '{kind}' on {dtype}")
    return s.op(f"{name} {acc}, {x} : {e}")


# |x| from which round-to-nearest gives f32 infinity: the largest f32 plus half its ulp
F32_OVERFLOW = (2 - 2.0**-24) * 2.0**127


def f32_overflow(s, total: str) -> str:
    """An f64 running sum that stands for an f32 one: past the f32 range it becomes +-inf, as the f32
    accumulator would (XLA's CPU dot adds exact products with FMA into an f32 accumulator). Later terms
    then see the infinity: -2 * 2.1e38 + inf is -inf + inf = NaN, as in XLA, not the f64 sum's inf."""
    magnitude, limit = s.op(f"math.absf {total} : f64"), s.const(F32_OVERFLOW, "float64")
    inf = s.const(np.inf, "float64")
    big = s.op(f"arith.cmpf oge, {magnitude}, {limit} : f64")
    return s.op(f"arith.select {big}, {s.op(f'arith.mulf {total}, {inf} : f64')}, {total} : f64")


@lowering("nova.reduce")
def _reduce(em, op, x):
    xt, out = op.operands[0].type, op.results[0].type
    kind, dims = op.attrs["kind"], op.attrs["dims"]
    # 16-bit floats accumulate in f32; f32 sums in f64: one long sequential loop in f32 loses
    # ~sqrt(n) ulps (XLA's CPU sums in blocks), in f64 the sum is exact to the final rounding
    acc_dtype = "float64" if kind == "sum" and xt.dtype == "float32" else compute_dtype(xt.dtype)
    acc_t = out.with_dtype(acc_dtype)
    init = em.filled(acc_t, reduce_init(kind, acc_dtype))
    kept = [d for d in range(xt.rank) if d not in dims]
    iters = ["reduction" if d in dims else "parallel" for d in range(xt.rank)]

    def body(s, a):
        total = combine(s, kind, acc_dtype, a[1], s.cast(a[0], xt.dtype, acc_dtype))
        return f32_overflow(s, total) if acc_dtype == "float64" and out.dtype == "float32" else total

    acc = em.generic([(x, xt, affine_map(xt.rank, list(range(xt.rank))))],
                     [(init, acc_t, affine_map(xt.rank, kept))], iters, body)[0]
    if acc_dtype == out.dtype:
        return acc
    return em.map_elementwise([(acc, acc_t)], out, lambda s, a: s.cast(a[0], acc_dtype, out.dtype))


@lowering("nova.matmul")
def _matmul(em, op, lhs, rhs):
    a = op.attrs
    lt, rt, out = op.operands[0].type, op.operands[1].type, op.results[0].type
    lf, rf = op.free_dims()
    nb, nl, nr, nc = len(a["lhs_batch"]), len(lf), len(rf), len(a["lhs_contract"])
    rank = nb + nl + nr + nc  # iteration space: batch, lhs free, rhs free, contracting
    lmap, rmap = [None] * lt.rank, [None] * rt.rank
    for i, (ld, rd) in enumerate(zip(a["lhs_batch"], a["rhs_batch"])):
        lmap[ld], rmap[rd] = i, i
    for i, d in enumerate(lf):
        lmap[d] = nb + i
    for i, d in enumerate(rf):
        rmap[d] = nb + nl + i
    for i, (ld, rd) in enumerate(zip(a["lhs_contract"], a["rhs_contract"])):
        lmap[ld], rmap[rd] = nb + nl + nr + i, nb + nl + nr + i
    acc_dtype = "float32" if out.dtype in ("float16", "bfloat16") else out.dtype
    if lt.dtype == "float64" or out.dtype in ("float32", "float64"):
        acc_dtype = "float64"  # as for sums: exact to the final rounding, however long K is
    acc_t = out.with_dtype(acc_dtype)
    e = element(acc_dtype)
    mul, add = ("arith.mulf", "arith.addf") if acc_dtype in FLOAT_DTYPES else ("arith.muli", "arith.addi")
    # Without contracting dimensions (an outer or elementwise product) the generic is all-parallel and
    # must not read its init: MLIR's elementwise fusion would fuse such a producer into a reduction
    # consumer with the init turned into an output read back across the reduction loop (a running sum).
    # x * y is also what XLA computes there (0 + -0.0 would lose the sign of a negative zero).
    init = em.filled(acc_t, 0) if nc else em.empty(acc_t)

    def body(s, args):
        x, y = s.cast(args[0], lt.dtype, acc_dtype), s.cast(args[1], rt.dtype, acc_dtype)
        product = s.op(f"{mul} {x}, {y} : {e}")
        if not nc:
            return product
        total = s.op(f"{add} {args[2]}, {product} : {e}")
        return f32_overflow(s, total) if acc_dtype == "float64" and out.dtype == "float32" else total

    iters = ["parallel"] * (nb + nl + nr) + ["reduction"] * nc
    acc = em.generic([(lhs, lt, affine_map(rank, lmap)), (rhs, rt, affine_map(rank, rmap))],
                     [(init, acc_t, affine_map(rank, list(range(nb + nl + nr))))], iters, body)[0]
    if acc_dtype == out.dtype:
        return acc
    return em.map_elementwise([(acc, acc_t)], out, lambda s, a_: s.cast(a_[0], acc_dtype, out.dtype))
