"""transpose_reductions: a reduction over middle dims reads its operand transposed, so that its reduced
dims lead (a column reduction) or are innermost (a row reduction).

The GPU's reduction kernels take reduced dims that are the leading or the innermost dims of their
operand (size-1 dims aside). A reduction over dims in between, such as the backward pass of
`jnp.repeat(k, n, axis=2)` in grouped-query attention summing [B, T, KV, n, D] over the repeat axis,
had no kernel and ran as XLA ops. Reduced over a transpose of its operand instead, it is one of those
kernels: fusion takes the transpose as the index remap its reads go through (no data is moved
beforehand), together with any elementwise producer. The reduced dims are moved to the front when the
kept dims after them hold at least `MIN_INNER` elements (contiguous columns, read as vectors), else to
the end (each row's elements are then `inner` apart, and neighbouring rows are neighbours in memory).
The result type, and the order of the values combined in each output, are unchanged. GPU plans only.
"""
from __future__ import annotations

import logging
import math

from jnova.dialect.ir import Func, Op
from jnova.dialect.ops import ReduceOp, TransposeOp
from jnova.dialect.types import TensorType

log = logging.getLogger("jnova.passes")

MIN_INNER = 4  # kept elements after the reduced dims from which the column form reads them as vectors


def transpose_reductions(func: Func) -> int:
    """Rewrite in place; returns how many reductions now read a transposed operand."""
    ops, count = [], 0
    for op in func.ops:
        perm = _leading_or_innermost(op) if op.name == "nova.reduce" else None
        if perm is None:
            ops.append(op)
            continue
        x, dims = op.operands[0], tuple(sorted(op.attrs["dims"]))
        moved = TransposeOp([x], [TensorType(tuple(x.type.shape[d] for d in perm), x.type.dtype)], {"perm": perm},
                            loc=op.loc)
        first = perm.index(dims[0])
        reduce = ReduceOp([moved.results[0]], [r.type for r in op.results],
                          {"kind": op.attrs["kind"], "dims": tuple(range(first, first + len(dims)))}, loc=op.loc)
        old = op.results[0]
        old.owner, old.index = reduce, 0
        reduce.results[0] = old
        ops += [moved, reduce]
        count += 1
        log.debug("transpose_reductions: %s reduction of %s over dims %s reads it as %s", op.attrs["kind"], x.type,
                  dims, moved.results[0].type)
    func.ops = ops
    log.debug("transpose_reductions: %d reductions over middle dims transposed", count)
    return count


def _leading_or_innermost(op: Op) -> tuple[int, ...] | None:
    """The permutation that moves `op`'s reduced dims to the front or the end, or None where they are
    already the leading or the innermost sized dims."""
    shape, dims = op.operands[0].type.shape, tuple(sorted(op.attrs["dims"]))
    sized = [d for d, n in enumerate(shape) if n != 1]
    reduced = [d for d in sized if d in dims]
    if not reduced or reduced == sized[:len(reduced)] or reduced == sized[len(sized) - len(reduced):]:
        return None
    kept = [d for d in range(len(shape)) if d not in dims]
    inner = math.prod(shape[d] for d in kept if d > reduced[-1])
    return tuple(dims) + tuple(kept) if inner >= MIN_INNER else tuple(kept) + tuple(dims)
