"""linalg lowerings of nova ops that move data: broadcast, reshape, transpose, iota, constant."""
from __future__ import annotations

import numpy as np

from jnova.codegen.linalg.emitter import affine_map, identity_map, tensor
from jnova.codegen.linalg.lowering import lowering
from jnova.dialect.ir import print_dense
from jnova.dialect.types import TensorType


@lowering("nova.broadcast")
def _broadcast(em, op, x):
    xt, out, dims = op.operands[0].type, op.results[0].type, op.attrs["dims"]
    # operand dim i reads result dim dims[i], or index 0 where it has size 1 and is stretched
    in_map = affine_map(out.rank, ["0" if xt.shape[i] == 1 and out.shape[d] != 1 else d for i, d in enumerate(dims)])
    return em.generic([(x, xt, in_map)], [(em.empty(out), out, identity_map(out.rank))], ["parallel"] * out.rank,
                      lambda s, a: a[0])[0]


def to_flat(em, x: str, t: TensorType) -> str:
    """Collapse (or expand a scalar) to a rank-1 tensor."""
    flat = TensorType((t.size,), t.dtype)
    if t.rank == 1:
        return x
    if t.rank == 0:
        return em.op(f"tensor.expand_shape {x} [] output_shape [1] : {tensor(t)} into {tensor(flat)}")
    return em.op(f"tensor.collapse_shape {x} [[{', '.join(map(str, range(t.rank)))}]] : {tensor(t)} into {tensor(flat)}")


def from_flat(em, x: str, t: TensorType) -> str:
    flat = TensorType((t.size,), t.dtype)
    if t.rank == 1:
        return x
    if t.rank == 0:
        return em.op(f"tensor.collapse_shape {x} [] : {tensor(flat)} into {tensor(t)}")
    return em.op(f"tensor.expand_shape {x} [[{', '.join(map(str, range(t.rank)))}]] "
                 f"output_shape [{', '.join(map(str, t.shape))}] : {tensor(flat)} into {tensor(t)}")


@lowering("nova.reshape")
def _reshape(em, op, x):
    xt, out = op.operands[0].type, op.results[0].type
    if xt.shape == out.shape:
        return x
    if xt.size == 0:
        return em.empty(out)
    return from_flat(em, to_flat(em, x, xt), out)


@lowering("nova.transpose")
def _transpose(em, op, x):
    xt, out, perm = op.operands[0].type, op.results[0].type, op.attrs["perm"]
    # result dim i is operand dim perm[i]: operand index d reads result dim inv[d]
    inv = [perm.index(d) for d in range(xt.rank)]
    return em.generic([(x, xt, affine_map(out.rank, inv))], [(em.empty(out), out, identity_map(out.rank))],
                      ["parallel"] * out.rank, lambda s, a: a[0])[0]


@lowering("nova.iota")
def _iota(em, op):
    out, dim = op.results[0].type, op.attrs["dim"]

    def body(s, args):
        i = s.op(f"arith.index_cast {s.index(dim)} : index to i64")
        return s.cast(i, "int64", out.dtype)

    return em.generic([], [(em.empty(out), out, identity_map(out.rank))], ["parallel"] * out.rank, body)[0]


@lowering("nova.constant")
def _constant(em, op):
    out = op.results[0].type
    value, printed = op.attrs["value"], out
    if out.dtype == "bool":  # bool tensors hold bytes in codegen
        value, printed = np.asarray(value).astype(np.int8), out.with_dtype("int8")
    text = print_dense(value, printed)
    # codegen spells unsigned (and bool) tensors with signless types
    text = text[: text.rindex(":")] + ": " + tensor(out)
    return em.op(f"arith.constant {text}")
