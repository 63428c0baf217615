"""A kernel that is one `nova.matmul` (plus a bias / residual epilogue) as the contraction builder's
problem: C[b,M,N] = A[b] @ B[b] (+ bias[N]) (+ residual[b,M,N]).

Which matmuls are contractions the kernels take is the configurator's `contraction_problem`
(`passes/configure/problem.py`); it picks the tiles too (report, section 4.4).
"""
from __future__ import annotations

from math import prod

from jnova.passes.configure.problem import contraction_problem
from jnova.passes.configure.tile_schedule import choose_tiles


def epilogue_of(ops) -> tuple:
    """(MatmulEpilogue, (bias, residual, result)) when `ops` are one matmul and an epilogue the matmul
    kernels compute in registers: a reshape of its result, reshapes of the value that keep its last dim
    (views), and, in any order, `+
    broadcast(bias)` over the last dim, `+ residual` (a value of the result's shape), both f32 adds
    whose other operand may be a 16-bit input widened to f32, and conversions of the value between f32
    and bf16 / f16 (Flax's bf16 modules under excess precision: the contraction's f32 result rounded to
    bf16, widened for a bias add, rounded again; C is stored in the last one's dtype); (None, reason)
    otherwise. A lone matmul has the empty epilogue."""
    from jnova.codegen.gpu.matmul_epilogue import ELEMENT, MatmulEpilogue

    matmuls = [op for op in ops if op.name == "nova.matmul"]
    if len(matmuls) != 1:
        return None, "not one nova.matmul (and an epilogue)"
    matmul, members = matmuls[0], set(ops)
    value, bias, residual, computed, steps = matmul.results[0], None, None, {matmul}, []
    for op in ops:  # program order: the result's reshape, then its adds and conversions
        if op is matmul or (op.name in ("nova.broadcast", "nova.reshape", "nova.convert")
                            and op.operands[0] is not value):
            continue  # the bias's reshapes, broadcasts and widenings: taken where an add reads them
        if op.name == "nova.reshape" and (value is matmul.results[0]
                                          or op.results[0].type.shape[-1:] == value.type.shape[-1:]):
            value = op.results[0]  # a view of the value that keeps its rows: C's offsets are its offsets
            computed.add(op)
            continue
        if op.name == "nova.convert":
            if not _float_conversion(value.type.dtype, op.results[0].type.dtype):
                return None, f"a conversion from {value.type.dtype} to {op.results[0].type.dtype} in the epilogue"
            steps.append(f"to:{op.results[0].type.dtype}")
            computed.add(op)
            value = op.results[0]
            continue
        if op.name != "nova.add" or value not in op.operands or op.results[0].type.dtype != "float32":
            return None, f"a {op.name.removeprefix('nova.')} in the epilogue (only bias and residual adds, conversions)"
        other = op.operands[1] if op.operands[0] is value else op.operands[0]
        widened = _widened_input(other, members)
        vector, chain = (None, ())
        if other.owner in members and other.owner.name in ("nova.broadcast", "nova.convert") and bias is None:
            vector, chain = _bias_vector(other.owner, members, value.type.shape)
            if vector is None and widened is None:
                return None, "a broadcast that is not one bias over the last dim"
        if vector is not None:
            bias = vector
            computed |= chain
            steps.append("bias")
        elif other.owner not in members and residual is None and other.type.shape == value.type.shape:
            residual = other
            steps.append("residual")
        elif widened is not None and residual is None and other.type.shape == value.type.shape:
            residual = widened
            computed.add(other.owner)
            steps.append("residual")
        else:
            return None, "an addend that is neither a bias nor a residual of the result's shape"
        computed.add(op)
        value = op.results[0]
    if computed != members:
        return None, "ops the epilogue does not compute"
    _, rhs_free = matmul.free_dims()
    if bias is not None and bias.type.shape != (prod(matmul.operands[1].type.shape[d] for d in rhs_free),):
        return None, "a bias that is not one value per column of the contraction's result"
    for name, x in (("bias", bias), ("residual", residual), ("result", value)):
        if x is not None and x.type.dtype not in ELEMENT:
            return None, f"{name} of dtype {x.type.dtype}"
    epilogue = MatmulEpilogue(bias=bias.type.dtype if bias is not None else None,
                              residual=residual.type.dtype if residual is not None else None, steps=tuple(steps))
    return (epilogue, (bias, residual, value)), None


SIXTEEN_BIT = ("bfloat16", "float16")


def _float_conversion(src: str, dst: str) -> bool:
    """A rounding of f32 to a 16-bit float, or a widening of one to f32."""
    return (src == "float32" and dst in SIXTEEN_BIT) or (src in SIXTEEN_BIT and dst == "float32")


def _widened_input(v, members):
    """The 16-bit kernel input that `v` widens to f32 (a convert of the group), or None."""
    op = v.owner
    if op is None or op not in members or op.name != "nova.convert" or op.operands[0].owner in members:
        return None
    x = op.operands[0]
    return x if x.type.dtype in SIXTEEN_BIT and v.type.dtype == "float32" else None


def _bias_vector(broadcast, members, shape) -> tuple:
    """(the [N] vector `broadcast` spreads over the last dim of `shape`, through broadcasts and
    reshapes of the group that only add or drop unit dims and widenings of a 16-bit vector to f32;
    those ops), or (None, ())."""
    n, v, chain = shape[-1], broadcast.results[0], set()
    while v.owner in members and v.owner.name in ("nova.broadcast", "nova.reshape", "nova.convert"):
        op, x = v.owner, v.owner.operands[0]
        if op.name == "nova.convert":
            if not (x.type.dtype in SIXTEEN_BIT and v.type.dtype == "float32"):
                return None, ()
        elif x.type.shape[-1:] != (n,) or prod(x.type.shape[:-1]) != 1:  # [1, ..., 1, N]
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
    config = choose_tiles(problem, target)
    return matmul_module(problem, config, target, epilogue, kernel.name)
