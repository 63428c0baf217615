"""split_attention_backward: each `nova.attention_backward` the GPU's backward kernels take becomes
`nova.attention_dq` (dq and delta) followed by `nova.attention_dkdv` (dk and dv), so the GPU plan gives
each half a launch of its own (dialect/ops_attention_split.py). A backward op the kernels refuse
stays whole (expand_attention has already made it generic ops); the CPU never splits.
"""
from __future__ import annotations

import logging
from typing import Callable

from jnova.dialect.ir import Func, Op, Value
from jnova.dialect.ops_attention_split import AttentionDkdvOp, AttentionDqOp
from jnova.dialect.types import TensorType

log = logging.getLogger("jnova.passes")


def split_attention_backward(func: Func, accepts: Callable[[Op], bool]) -> int:
    """Split, in place, each nova.attention_backward op that `accepts(op)`; returns how many."""
    replace: dict[Value, Value] = {}
    ops: list[Op] = []
    count = 0
    for op in func.ops:
        op.operands = [replace.get(v, v) for v in op.operands]
        if op.name != "nova.attention_backward" or not accepts(op):
            ops.append(op)
            continue
        q, k, v, o, lse, do, *extra = op.operands
        d = op.dims()
        rows = TensorType((d["B"], d["Hq"], d["Tq"]), "float32")
        dq = AttentionDqOp([q, k, v, o, lse, do, *extra], [q.type, rows], dict(op.attrs), op.loc)
        dkdv = AttentionDkdvOp([q, k, v, lse, dq.results[1], do, *extra], [k.type, v.type], dict(op.attrs), op.loc)
        ops += [dq, dkdv]
        replace.update(zip(op.results, [dq.results[0], *dkdv.results]))
        count += 1
    func.ops = ops
    func.returns = [replace.get(v, v) for v in func.returns]
    if count:
        log.info("split_attention_backward: %d nova.attention_backward ops as attention_dq + attention_dkdv", count)
    return count
