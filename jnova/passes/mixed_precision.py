"""mixed-precision: demote the operands of contractions to bfloat16.

An f32 x f32 -> f32 `nova.matmul` becomes convert(lhs) x convert(rhs) -> f32: operands are rounded to
bf16, products accumulate in f32, and everything else (elementwise ops, normalizations, reductions, the
optimizer) stays in f32. The configurator then sees 2-byte operands.

Which contractions, by their `precision`: those the program asks for in "bfloat16" always (JAX's
`jax.default_matmul_precision("bfloat16")`); with `mixed_precision="bf16"` also the "default" ones.
A "highest" contraction is never demoted: the program asked for f32 accuracy there.
"""
from __future__ import annotations

import logging

from jnova.dialect.ir import Func
from jnova.dialect.ops import ConvertOp

log = logging.getLogger("jnova.passes")


def demote_contractions(func: Func, dtype: str = "bfloat16", precisions: tuple[str, ...] = ("default", "bfloat16")) -> int:
    """Rewrite in place the f32 contractions whose precision is in `precisions`; returns how many."""
    ops, count = [], 0
    converted = {}  # one convert per value, shared by every contraction that reads it
    for op in func.ops:
        if op.name == "nova.matmul" and op.attrs["precision"] in precisions \
                and all(v.type.dtype == "float32" for v in op.operands) and op.results[0].type.dtype == "float32":
            new_operands = []
            for v in op.operands:
                if v not in converted:
                    cast = ConvertOp([v], [v.type.with_dtype(dtype)], loc=op.loc)
                    ops.append(cast)
                    converted[v] = cast.results[0]
                new_operands.append(converted[v])
            op.operands = new_operands
            count += 1
        ops.append(op)
    func.ops = ops
    log.debug("mixed-precision: %d contractions take %s operands", count, dtype)
    return count
