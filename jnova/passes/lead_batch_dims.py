"""lead_batch_dims: a contraction operand whose dims the GPU's contraction kernels cannot read in place
is transposed to [batch..., free..., contracting...] (or [batch..., contracting..., free...]).

The contraction kernels read each operand as a batch of matrices: batch dims first, then the free
and the contracting dims as two contiguous runs (`configure/problem.contraction_problem`). An einsum
like "bthd,bshd->bhts" (attention scores in the [B, T, H, D] layout, written out) has its batch dims
b and h apart, so its matmul had no kernel and ran as XLA ops. Transposing the operand (a kernel of
its own: a contraction does not read through a remap) makes it one the kernels take; the matmul's
result is unchanged (batch dims, then the lhs's free dims, then the rhs's, each in order). The free
and contracting runs keep the order they had (free first if the operand's first free dim came before
its first contracting dim). A value transposed the same way for several contractions is transposed
once. Done only where the transposed contraction is one the kernels take. GPU plans only.
"""
from __future__ import annotations

import logging

from jnova.dialect.ir import Func, Op
from jnova.dialect.ops import TransposeOp
from jnova.dialect.types import TensorType
from jnova.passes.configure.problem import contraction_problem

log = logging.getLogger("jnova.passes")


def lead_batch_dims(func: Func) -> int:
    """Rewrite in place; returns how many operands now come from a transpose."""
    ops, count, made = [], 0, {}
    for op in func.ops:
        if op.name == "nova.matmul" and contraction_problem(op)[0] is None:
            new, attrs = _transposed(op)
            before_operands, before_attrs = list(op.operands), dict(op.attrs)
            op.operands, op.attrs = [t.results[0] if t is not None else v for t, v in zip(new, op.operands)], attrs
            if contraction_problem(op)[0] is None:  # another reason: leave it as it was
                op.operands, op.attrs = before_operands, before_attrs
            else:
                for i, t in enumerate(new):
                    if t is None:
                        continue
                    key = (before_operands[i], t.attrs["perm"])
                    if key not in made:
                        made[key] = t
                        ops.append(t)
                    op.operands[i] = made[key].results[0]
                    count += 1
                log.debug("lead_batch_dims: %s operands of a contraction into %s transposed",
                          sum(t is not None for t in new), op.results[0].type)
        ops.append(op)
    func.ops = ops
    log.debug("lead_batch_dims: %d contraction operands transposed", count)
    return count


def _transposed(op: Op):
    """([transpose of lhs or None, transpose of rhs or None], the matmul's attributes on them)."""
    attrs, new = dict(op.attrs), []
    for i, side in enumerate(("lhs", "rhs")):
        v = op.operands[i]
        batch, contract = list(op.attrs[f"{side}_batch"]), list(op.attrs[f"{side}_contract"])
        free = [d for d in range(v.type.rank) if d not in batch and d not in contract]
        free_first = not contract or (free and free[0] < contract[0])
        perm = tuple(batch + (free + contract if free_first else contract + free))
        if perm == tuple(range(v.type.rank)):
            new.append(None)
            continue
        new.append(TransposeOp([v], [TensorType(tuple(v.type.shape[d] for d in perm), v.type.dtype)], {"perm": perm},
                               loc=op.loc))
        nb = len(batch)
        start = nb + (len(free) if free_first else 0)
        attrs[f"{side}_batch"] = tuple(range(nb))
        attrs[f"{side}_contract"] = tuple(range(start, start + len(contract)))
    return new, attrs
