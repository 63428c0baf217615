"""split_sce_reductions: a cross-entropy's mean or sum over rows as a reduction of its own, so that the
GPU's cross-entropy kernels (one pass over each row) compute rows only.

    loss, lse = nova.sce(x, labels) {reduction = mean | sum}
 -> l, lse = nova.sce(x, labels) {reduction = none};  loss = sum_n l[n]  (/ count for mean)

    dx = nova.sce_backward(x, labels, lse, dloss) {reduction = mean}
 -> dx = nova.sce_backward(x, labels, lse, dloss / count) {reduction = sum}

where count is N, or the number of rows whose label is not ignore_index, computed once per labels
array: exactly the definitions of dialect/ops_training.py (the forward's row losses are 0 in ignored
rows, the backward's gradient is 0 there in both forms). The sum over rows is then an ordinary
`nova.reduce` (the GPU's row-reduction kernel, with the division in its epilogue), the division of
dloss a scalar op. A backward with reduction "sum" or "none" and a forward with "none" stay as they
are; the CPU never splits (its kernel computes the whole op).
"""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from jnova.dialect.ir import Func, Op, Value
from jnova.dialect.ops_training import SceBackwardOp, SceOp
from jnova.dialect.types import TensorType
from jnova.passes.expand_attention import _Builder

log = logging.getLogger("jnova.passes")

F32 = "float32"


def split_sce_reductions(func: Func, accepts: Callable[[Op], bool] = lambda op: True) -> int:
    """Split, in place, the reduction off each nova.sce (mean, sum) and nova.sce_backward (mean) that
    `accepts(op)`; returns how many ops were split."""
    replace: dict[Value, Value] = {}
    counts: dict[tuple, Value] = {}  # (labels, ignore_index) -> rows not ignored, f32 []
    ops: list[Op] = []
    split = 0
    for op in func.ops:
        op.operands = [replace.get(v, v) for v in op.operands]
        red = op.attrs.get("reduction")
        if not (op.name == "nova.sce" and red in ("mean", "sum") or op.name == "nova.sce_backward" and red == "mean") \
                or not accepts(op):
            ops.append(op)
            continue
        b = _Builder()
        attrs = dict(op.attrs)
        if op.name == "nova.sce":
            logits, labels = op.operands
            rows = SceOp([logits, labels], [TensorType(labels.type.shape, F32), op.results[1].type],
                         {**attrs, "reduction": "none"}, op.loc)
            b.ops.append(rows)
            loss = b.reduce("sum", rows.results[0], 0)
            if red == "mean":
                loss = b.binary("div", loss, _count(b, counts, op))
            replace.update({op.results[0]: loss, op.results[1]: rows.results[1]})
        else:
            logits, labels, lse, dloss = op.operands
            scaled = b.binary("div", dloss, _count(b, counts, op))
            backward = SceBackwardOp([logits, labels, lse, scaled], [op.results[0].type], {**attrs, "reduction": "sum"},
                                     op.loc)
            b.ops.append(backward)
            replace[op.results[0]] = backward.results[0]
        for new in b.ops:
            new.loc = op.loc
        ops += b.ops
        split += 1
    func.ops = ops
    func.returns = [replace.get(v, v) for v in func.returns]
    if split:
        log.info("split_sce_reductions: %d cross-entropy ops compute rows, their mean or sum a reduction of its own",
                 split)
    return split


def _count(b: _Builder, counts: dict, op: Op) -> Value:
    """The mean's divisor, f32 []: N, or the rows whose label is not ignore_index (shared by every op on
    the same labels)."""
    labels = op.operands[1]
    n = labels.type.shape[0]
    if not op.attrs["has_ignore"]:
        return b("nova.constant", [], TensorType((), F32), value=np.array(float(n), np.float32))
    key = (labels, op.attrs["ignore_index"])
    if key not in counts:
        ignored = b.const(op.attrs["ignore_index"], (n,), labels.type.dtype)
        keep = b("nova.compare", [labels, ignored], TensorType((n,), "bool"), predicate="ne")
        counts[key] = b.reduce("sum", b("nova.convert", [keep], TensorType((n,), F32)), 0)
    return counts[key]
