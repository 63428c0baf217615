"""A kernel that is one `nova.matmul` as the contraction builder's problem: C[b,M,N] = A[b] @ B[b].

`nova.matmul` has general dot_general dimension numbers; the kernels take A as [M,K] or [K,M] and
B as [K,N] or [N,K] with leading batch dims. A matmul fits when its batch dims lead (in order) on
both sides and its free and contracting dims are each contiguous runs (several dims flatten into
one: the weight gradient contracts over batch and sequence together). The configurator picks
the tiles (report, section 4.4).
"""
from __future__ import annotations

from math import prod

from jnova.dialect.ir import Op
from jnova.passes.configure_tiles import ContractionProblem, choose_tiles

OPERAND_DTYPES = ("float32", "bfloat16", "float16")


def _run(dims) -> bool:
    return list(dims) == list(range(dims[0], dims[0] + len(dims))) if dims else False


def _side(rank: int, batch, contract, free_first_layout: str, contract_first_layout: str):
    """(layout, free dims) of one operand, or a reason it does not fit."""
    nb = len(batch)
    if list(batch) != list(range(nb)):
        return None, "batch dims do not lead"
    free = [d for d in range(nb, rank) if d not in contract]
    if not free:
        return free_first_layout, free  # refused by the caller: a matrix-vector product
    if not _run(list(contract)) or not _run(free):
        return None, "free or contracting dims are not contiguous runs in order"
    return (free_first_layout if free[0] < contract[0] else contract_first_layout), free


def contraction_problem(op: Op):
    """(ContractionProblem, None) for a matmul the kernels take, or (None, reason)."""
    a = op.attrs
    lhs, rhs, out = op.operands[0].type, op.operands[1].type, op.results[0].type
    if lhs.dtype != rhs.dtype or lhs.dtype not in OPERAND_DTYPES:
        return None, f"operands {lhs.dtype} x {rhs.dtype}"
    if out.dtype != "float32":
        return None, f"result {out.dtype} (the kernels write f32)"
    if not a["lhs_contract"]:
        return None, "no contracting dimension (an outer product)"
    if list(a["lhs_contract"]) != sorted(a["lhs_contract"]) or list(a["rhs_contract"]) != sorted(a["rhs_contract"]):
        return None, "contracting dims in a different order on the two sides"
    a_layout, lfree = _side(lhs.rank, a["lhs_batch"], a["lhs_contract"], "row", "col")
    if a_layout is None:
        return None, f"lhs: {lfree}"
    b_layout, rfree = _side(rhs.rank, a["rhs_batch"], a["rhs_contract"], "col", "row")
    if b_layout is None:
        return None, f"rhs: {rfree}"
    if not lfree or not rfree:
        return None, "a side without free dims (a matrix-vector product)"
    problem = ContractionProblem(
        m=prod(lhs.shape[d] for d in lfree), n=prod(rhs.shape[d] for d in rfree),
        k=prod(lhs.shape[d] for d in a["lhs_contract"]), batch=prod(lhs.shape[d] for d in a["lhs_batch"]),
        operand_dtype=lhs.dtype, out_dtype="float32", a_layout=a_layout, b_layout=b_layout)
    return problem, None


def contraction_refusal(kernel) -> str | None:
    """Why `kernel` is not a single contraction the matmul kernels compute, or None."""
    if len(kernel.ops) != 1 or kernel.ops[0].name != "nova.matmul":
        return "not a single nova.matmul"
    op = kernel.ops[0]
    if op.operands[0] is op.operands[1] or [v for v in kernel.inputs] != list(op.operands):
        return "the two operands are one value"
    return contraction_problem(op)[1]


def build_contraction(kernel, target):
    from jnova.codegen.gpu.matmul import matmul_module  # it imports the module that imports this one

    problem, _ = contraction_problem(kernel.ops[0])
    return matmul_module(problem, choose_tiles(problem, target), target, None, kernel.name)
