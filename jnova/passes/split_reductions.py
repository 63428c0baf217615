"""split_reductions: a reduction into fewer rows than the GPU has SMs as partial reductions, then a
reduction of the partial results.

`x` reduced over its innermost dims into R rows of C elements becomes `x` viewed as [R..., P, C/P]
(a reshape of contiguous innermost dims: no data moves), reduced over its last dim into [R..., P]
partial results, which a second reduction over P takes to the original result. The first reduction
keeps every elementwise producer as its prologue (fusion sees the reshape as an index remap), so a
sum of squares still reads its operand once. Sums and products of 16-bit floats accumulate in f32 in
one reduction (`codegen/gpu/reduction.py`, as on the CPU); split, their operand is widened to f32
(inside the first reduction's prologue), the partial results stay f32 and the result is rounded to
the operand type once, so the split keeps that arithmetic: only the order of the f32 additions changes.

A reduction over leading dims into a few columns (a bias gradient: [B, T, N] summed over B and T into
N values) is split the other way: `x` of R rows and C columns is viewed as [R / P, P * C] (a contiguous
reshape), column-reduced into P * C partial results (P times the column kernel's blocks), which a
second column reduction over [P, C] takes to the result, widened and rounded as above.

The Analytic Configurator chooses P (`configure/reduction_split.choose_reduction_splits` and
`choose_column_splits`); GPU plans only.
"""
from __future__ import annotations

import logging
import math

from jnova.dialect.ir import Func, Op
from jnova.dialect.ops import ConvertOp, ReduceOp, ReshapeOp
from jnova.dialect.types import TensorType
from jnova.dialect.types import itemsize
from jnova.passes.configure.reduction_split import choose_column_splits, choose_reduction_splits

log = logging.getLogger("jnova.passes")

WIDENED = ("bfloat16", "float16")  # sums and products of these accumulate in f32
ACCUMULATING = ("sum", "prod")


def split_reductions(func: Func, target) -> int:
    """Rewrite in place; returns how many reductions were split."""
    ops, count = [], 0
    for op in func.ops:
        if op.name != "nova.reduce":
            ops.append(op)
            continue
        x = op.operands[0]
        if (splits := _splits(op, target)) > 1:
            log.debug("split_reductions: %s reduction of %s into %d rows, in %d partial reductions each",
                      op.attrs["kind"], x.type, op.results[0].type.size if op.results[0].type.shape else 1, splits)
            ops += _split(op, splits)
        elif (splits := _column_splits(op, target)) > 1:
            log.debug("split_reductions: %s reduction of %s into %d columns, in %d partial reductions each",
                      op.attrs["kind"], x.type, op.results[0].type.size, splits)
            ops += _split_columns(op, splits)
        else:
            ops.append(op)
            continue
        count += 1
    func.ops = ops
    log.debug("split_reductions: %d reductions split", count)
    return count


def _innermost(op: Op) -> bool:
    rank, dims = op.operands[0].type.rank, tuple(sorted(op.attrs["dims"]))
    return bool(dims) and dims == tuple(range(rank - len(dims), rank))


def _leading(op: Op) -> bool:
    """Whether `op` reduces a proper prefix of its operand's dims (a column reduction)."""
    rank, dims = op.operands[0].type.rank, tuple(sorted(op.attrs["dims"]))
    return bool(dims) and dims == tuple(range(len(dims))) and len(dims) < rank


def _splits(op: Op, target) -> int:
    if not _innermost(op):
        return 1
    x = op.operands[0].type
    cols = math.prod(x.shape[d] for d in op.attrs["dims"])
    rows = x.size // cols if cols else 0
    return choose_reduction_splits(rows, cols, target) if rows else 1


def _split(op: Op, splits: int) -> list[Op]:
    """The ops replacing `op`: the view as [rows..., splits, cols / splits] (in f32 for a 16-bit sum or
    product), the partial reduction, the reduction of the partial results, and the rounding back;
    the last takes over `op`'s result value (its readers are unchanged)."""
    x, old, kind = op.operands[0], op.results[0], op.attrs["kind"]
    kept = old.type.shape
    cols = math.prod(x.type.shape[d] for d in op.attrs["dims"])
    widen = kind in ACCUMULATING and x.type.dtype in WIDENED
    dtype = "float32" if widen else x.type.dtype
    new: list[Op] = []
    if widen:
        new.append(ConvertOp([x], [TensorType(x.type.shape, dtype)], {}, loc=op.loc))
        x = new[-1].results[0]
    view = ReshapeOp([x], [TensorType(kept + (splits, cols // splits), dtype)], {}, loc=op.loc)
    partial = ReduceOp([view.results[0]], [TensorType(kept + (splits,), dtype)], {"kind": kind, "dims": (len(kept) + 1,)},
                       loc=op.loc)
    total = ReduceOp([partial.results[0]], [TensorType(kept, dtype)], {"kind": kind, "dims": (len(kept),)}, loc=op.loc)
    new += [view, partial, total]
    last = total
    if widen:
        last = ConvertOp([total.results[0]], [old.type], {}, loc=op.loc)
        new.append(last)
    old.owner, old.index = last, 0
    last.results[0] = old
    return new


def _column_splits(op: Op, target) -> int:
    if not _leading(op) or op.attrs["kind"] not in ACCUMULATING + ("max", "min"):
        return 1
    x = op.operands[0].type
    rows = math.prod(x.shape[d] for d in op.attrs["dims"])
    cols = x.size // rows if rows else 0
    # the kernel may read a 16-bit value that its prologue widens: count its columns as 16-bit loads
    return choose_column_splits(rows, cols, min(itemsize(x.dtype), 2), target) if cols else 1


def _split_columns(op: Op, splits: int) -> list[Op]:
    """The ops replacing the column reduction `op`: the view as [rows / splits, splits * cols] (in f32
    for a 16-bit sum or product), its column reduction into splits * cols partial results, their view
    as [splits, cols], the column reduction of those, its reshape to the kept shape and the rounding
    back; the last takes over `op`'s result value."""
    x, old, kind = op.operands[0], op.results[0], op.attrs["kind"]
    rows = math.prod(x.type.shape[d] for d in op.attrs["dims"])
    cols = x.type.size // rows
    widen = kind in ACCUMULATING and x.type.dtype in WIDENED
    dtype = "float32" if widen else x.type.dtype
    new: list[Op] = []
    if widen:
        new.append(ConvertOp([x], [TensorType(x.type.shape, dtype)], {}, loc=op.loc))
        x = new[-1].results[0]
    view = ReshapeOp([x], [TensorType((rows // splits, splits * cols), dtype)], {}, loc=op.loc)
    partial = ReduceOp([view.results[0]], [TensorType((splits * cols,), dtype)], {"kind": kind, "dims": (0,)},
                       loc=op.loc)
    parts = ReshapeOp([partial.results[0]], [TensorType((splits, cols), dtype)], {}, loc=op.loc)
    total = ReduceOp([parts.results[0]], [TensorType((cols,), dtype)], {"kind": kind, "dims": (0,)}, loc=op.loc)
    kept = ReshapeOp([total.results[0]], [TensorType(old.type.shape, dtype)], {}, loc=op.loc)
    new += [view, partial, parts, total, kept]
    last = kept
    if widen:
        last = ConvertOp([kept.results[0]], [old.type], {}, loc=op.loc)
        new.append(last)
    old.owner, old.index = last, 0
    last.results[0] = old
    return new
