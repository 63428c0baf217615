"""A kernel that is one `nova.matmul` (plus a bias / residual epilogue) as the contraction builder's
problem: C[b,M,N] = A[b] @ B[b] (+ bias[N]) (+ residual[b,M,N]).

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
from jnova.runtime import launcher

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
    a_split_k = _split_k_lhs(lhs.rank, a["lhs_batch"], a["lhs_contract"])
    if a_split_k:  # A as [M..., S, K/S]: the batch splits K of a row-major A (the kernel reads it in place)
        a_layout, lfree = "row", list(range(a["lhs_batch"][0]))
    else:
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
        operand_dtype=lhs.dtype, out_dtype="float32", a_layout=a_layout, b_layout=b_layout, a_split_k=a_split_k)
    return problem, None


def _split_k_lhs(rank: int, batch, contract) -> bool:
    """Whether the lhs is [free..., S, K...] with one batch dim S between its free and contracting dims
    (a split-K view of a row-major A, `passes/split_contractions.py`)."""
    return (len(batch) == 1 and batch[0] >= 1 and bool(contract)
            and list(contract) == list(range(batch[0] + 1, rank)))


def epilogue_of(ops) -> tuple:
    """(MatmulEpilogue, (bias, residual, result)) when `ops` are one matmul and an epilogue the matmul
    kernels compute in registers: an optional reshape of its result, then `+ broadcast(bias)` over the
    last dim and/or `+ residual` (a value of the result's shape), all f32 adds; (None, reason)
    otherwise. A lone matmul has the empty epilogue."""
    from jnova.codegen.gpu.matmul_epilogue import ELEMENT, MatmulEpilogue

    matmuls = [op for op in ops if op.name == "nova.matmul"]
    if len(matmuls) != 1:
        return None, "not one nova.matmul (and an epilogue)"
    matmul, members = matmuls[0], set(ops)
    value, bias, residual, computed = matmul.results[0], None, None, {matmul}
    for op in ops:  # program order: the result's reshape, then its adds
        if op is matmul or (op.name in ("nova.broadcast", "nova.reshape") and op.operands[0] is not value):
            continue  # the bias's reshapes and broadcasts: taken where an add reads them
        if op.name == "nova.reshape" and value is matmul.results[0]:
            value = op.results[0]
            computed.add(op)
            continue
        if op.name != "nova.add" or value not in op.operands or op.results[0].type.dtype != "float32":
            return None, f"a {op.name.removeprefix('nova.')} in the epilogue (only bias and residual adds)"
        other = op.operands[1] if op.operands[0] is value else op.operands[0]
        if other.owner in members and other.owner.name == "nova.broadcast" and bias is None:
            bias, chain = _bias_vector(other.owner, members, value.type.shape)
            if bias is None:
                return None, "a broadcast that is not one bias over the last dim"
            computed |= chain
        elif other.owner not in members and residual is None and other.type.shape == value.type.shape:
            residual = other
        else:
            return None, "an addend that is neither a bias nor a residual of the result's shape"
        computed.add(op)
        value = op.results[0]
    if computed != members:
        return None, "ops the epilogue does not compute"
    _, rhs_free = matmul.free_dims()
    if bias is not None and bias.type.shape != (prod(matmul.operands[1].type.shape[d] for d in rhs_free),):
        return None, "a bias that is not one value per column of the contraction's result"
    for name, x in (("bias", bias), ("residual", residual)):
        if x is not None and x.type.dtype not in ELEMENT:
            return None, f"{name} of dtype {x.type.dtype}"
    epilogue = MatmulEpilogue(bias=bias.type.dtype if bias is not None else None,
                              residual=residual.type.dtype if residual is not None else None)
    return (epilogue, (bias, residual, value)), None


def _bias_vector(broadcast, members, shape) -> tuple:
    """(the [N] vector `broadcast` spreads over the last dim of `shape`, through broadcasts and
    reshapes of the group that only add or drop unit dims; those ops), or (None, ())."""
    n, v, chain = shape[-1], broadcast.results[0], set()
    while v.owner in members and v.owner.name in ("nova.broadcast", "nova.reshape"):
        op, x = v.owner, v.owner.operands[0]
        if x.type.shape[-1:] != (n,) or prod(x.type.shape[:-1]) != 1:  # [1, ..., 1, N]
            return None, ()
        if op.name == "nova.broadcast" and list(op.attrs["dims"])[-1] != v.type.rank - 1:
            return None, ()
        chain.add(op)
        v = x
    return (v, chain) if v.type.shape == (n,) else (None, ())


def contraction_refusal(kernel) -> str | None:
    """Why `kernel` is not a contraction (with a bias / residual epilogue) the matmul kernels
    compute, or None."""
    found, reason = epilogue_of(kernel.ops)
    if found is None:
        return reason
    op = next(o for o in kernel.ops if o.name == "nova.matmul")
    _, (bias, residual, out) = found
    expected = [*op.operands, *(x for x in (bias, residual) if x is not None)]
    if op.operands[0] is op.operands[1] or len(set(map(id, expected))) != len(expected) \
            or list(kernel.inputs) != expected:
        return "the operands, bias and residual are not distinct inputs in kernel parameter order"
    if list(kernel.outputs) != [out]:
        return "the kernel writes more than the epilogue's result"
    return contraction_problem(op)[1]


def build_contraction(kernel, target):
    from jnova.codegen.gpu.matmul import matmul_module  # it imports the module that imports this one

    op = next(o for o in kernel.ops if o.name == "nova.matmul")
    (epilogue, _), _ = epilogue_of(kernel.ops)
    problem, _ = contraction_problem(op)
    config = choose_tiles(problem, target, tensor_maps=launcher.tensor_maps_available())
    return matmul_module(problem, config, target, epilogue, kernel.name)
