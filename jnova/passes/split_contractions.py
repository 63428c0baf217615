"""split_contractions: split a contraction whose tiles leave SMs idle into partial products over K.

A weight gradient (dW = X^T @ dY) contracts over the tokens: its M x N output is a few dozen large
tiles (GPT-2's 768 x 768 projection: 18 tiles of 256 x 128 for an H200's 132 SMs) while K is long
(8192 tokens). Its contracting dims lead both operands (A as [K, M], B as [K, N]), so viewing them
as [S, K/S] is a reshape of leading dims that moves no data (XLA makes it a bitcast). The matmul
becomes a batched one over S, each batch a partial product over K/S, and a sum over S gives the
result. An A with K contiguous ([M, K]: a long K, such as the LM head's input gradient over a
50257-word vocabulary) is viewed as [M, S, K/S]; its batch dim does not lead, and the contraction
kernels read such an A in place (`ContractionProblem.a_split_k`: its slices are K/S columns apart).
The sum is a column reduction, into which the result's elementwise consumers fuse as they fused into
the matmul (an optimizer's update, a bias add). It is the same math reordered: partial sums of K/S
terms, added S at a time.

The Analytic Configurator chooses S (`configure/split_k.choose_split_k`); GPU plan only.
"""
from __future__ import annotations

import logging

from jnova.dialect.ir import Func, Op
from jnova.dialect.ops import MatmulOp, ReduceOp, ReshapeOp
from jnova.dialect.types import TensorType
from jnova.passes.configure.problem import contraction_problem
from jnova.passes.configure.split_k import choose_split_k, explain_split_k

log = logging.getLogger("jnova.passes")


def split_contractions(func: Func, target) -> int:
    """Rewrite in place; returns how many contractions were split."""
    ops, count = [], 0
    for op in func.ops:
        problem = contraction_problem(op)[0] if op.name == "nova.matmul" else None
        splits = choose_split_k(problem, target) if problem is not None else 1
        if splits == 1:
            ops.append(op)
            continue
        if log.isEnabledFor(logging.DEBUG):  # the explanation weighs every split again
            log.debug("split_contractions: %dx%dx%d %s into %d (%s)", problem.m, problem.n, problem.k,
                      problem.operand_dtype, splits, explain_split_k(problem, target))
        ops += _split(op, splits, problem.k, problem.a_layout)
        count += 1
    func.ops = ops
    log.debug("split_contractions: %d contractions split along K", count)
    return count


def _split(op: Op, splits: int, k: int, a_layout: str) -> list[Op]:
    """The ops replacing `op` (no batch dims; B as [K..., N...]; A as [K..., M...] or [M..., K...]): a
    view of B as [splits, k / splits, N...] and of A as [splits, k / splits, M...] or
    [M..., splits, k / splits] (the contraction kernels read that one in place: the slices are k / splits
    columns apart), the batched matmul, and the sum over the splits, which takes over `op`'s result value
    (its readers are unchanged)."""
    lhs, rhs = op.operands
    nk = len(op.attrs["lhs_contract"])
    part = (splits, k // splits)
    if a_layout == "col":
        lhs_shape, lhs_dims = part + lhs.type.shape[nk:], {"lhs_batch": (0,), "lhs_contract": (1,)}
    else:
        free = lhs.type.shape[:lhs.type.rank - nk]
        lhs_shape, lhs_dims = free + part, {"lhs_batch": (len(free),), "lhs_contract": (len(free) + 1,)}
    new, operands = [], []
    for v, shape in ((lhs, lhs_shape), (rhs, part + rhs.type.shape[nk:])):
        view = ReshapeOp([v], [TensorType(shape, v.type.dtype)], {}, loc=op.loc)
        new.append(view)
        operands.append(view.results[0])
    old = op.results[0]
    partial = MatmulOp(operands, [TensorType((splits,) + old.type.shape, old.type.dtype)],
                       {**lhs_dims, "rhs_batch": (0,), "rhs_contract": (1,),
                        "precision": op.attrs["precision"]}, loc=op.loc)
    total = ReduceOp([partial.results[0]], [old.type], {"kind": "sum", "dims": (0,)}, loc=op.loc)
    old.owner, old.index = total, 0
    total.results[0] = old
    return new + [partial, total]
