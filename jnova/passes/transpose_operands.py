"""transpose_operands: give a TF32 contraction K-major operands where a transpose kernel pays for itself.

wgmma reads TF32 operands only K-major (A as [M, K], B as [N, K]); the contraction kernel copies an
MN-major operand into its K-major shared-memory tile 4 bytes at a time, which slows the main loop by
up to half (`configure/contraction_time.TF32_LAYOUT_FRACTION`). A forward layer's weight (B as [K, N]: a few MB
read by a contraction of many GFLOP) or a weight gradient's activations are cheaper to transpose once,
in a kernel of their own, than 4 bytes at a time in every tile that reads them; with both operands
K-major the warp-specialized kernel can take the contraction. The Analytic Configurator
decides per operand (`configure/operand_transposes.choose_transposes`). The transposed operand keeps its
batch dims in front: [batch..., free..., contracting...]. One value transposed the same way for
several contractions is transposed once. GPU plan only.
"""
from __future__ import annotations

import logging

from jnova.dialect.ir import Func, Op
from jnova.dialect.ops import TransposeOp
from jnova.dialect.types import TensorType
from jnova.passes.configure.operand_transposes import choose_transposes, explain_transposes
from jnova.passes.configure.problem import contraction_problem

log = logging.getLogger("jnova.passes")


def transpose_operands(func: Func, target) -> int:
    """Rewrite in place; returns how many operands now come from a transpose."""
    ops, count, made = [], 0, {}
    for op in func.ops:
        problem = contraction_problem(op)[0] if op.name == "nova.matmul" else None
        choice = choose_transposes(problem, target) if problem is not None else (False, False)
        if any(choice) and log.isEnabledFor(logging.DEBUG):  # the explanation weighs every choice again
            log.debug("transpose_operands: %dx%dx%dx%d (%s)", problem.batch, problem.m, problem.n, problem.k,
                      explain_transposes(problem, target))
        for i, side in enumerate(("lhs", "rhs")):
            if choice[i]:
                ops += _k_major(op, i, side, made)
                count += 1
        ops.append(op)
    func.ops = ops
    log.debug("transpose_operands: %d contraction operands transposed", count)
    return count


def _k_major(op: Op, i: int, side: str, made: dict) -> list[Op]:
    """Make operand `i` of `op` ([batch..., contracting..., free...]) a transpose of it with the
    contracting dims last; returns the new op (none if that transpose exists already)."""
    v, batch, contract = op.operands[i], list(op.attrs[f"{side}_batch"]), list(op.attrs[f"{side}_contract"])
    free = [d for d in range(v.type.rank) if d not in batch and d not in contract]
    perm = tuple(batch + free + contract)
    new = []
    if (v, perm) not in made:
        t = TransposeOp([v], [TensorType(tuple(v.type.shape[d] for d in perm), v.type.dtype)], {"perm": perm},
                        loc=op.loc)
        made[(v, perm)] = t.results[0]
        new.append(t)
    op.operands[i] = made[(v, perm)]
    start = len(batch) + len(free)
    op.attrs[f"{side}_contract"] = tuple(range(start, start + len(contract)))
    return new
