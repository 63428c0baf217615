"""expand_attention: nova.attention and nova.attention_backward as generic nova ops.

`attention_decomposition(op)` gives the ops (matmul, reduce, exp, select, ...) that compute an
attention op's results by its definition (dialect/ops_attention.py), in f32 whatever the inputs'
type, with the softmax recomputed from the scores in the backward (so a fully masked row gets the
uniform probabilities the forward gave it, which its rounded lse cannot give back). It is the
generic path of every backend:

- `expand_refused_attention(func, refusal)` (a pipeline stage) replaces each attention op that the
  backend's `refusal(op)` refuses (it returns why, or None) by its decomposition before fusion, so
  jnova's ordinary kernels compute it; each refusal is logged (logger `jnova.passes`) with its reason;
- the CPU backend lowers an attention op it keeps as one kernel by lowering its decomposition inside
  that kernel (codegen/linalg/rules_attention.py): the scores live in the kernel only, the plan
  holds no B*H*Tq*Tk buffer;
- `nova_to_jax` evaluates an attention op as its decomposition's JAX ops.
"""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from jnova.dialect.ir import Func, Op, Value
from jnova.dialect.ops import OPS
from jnova.dialect.ops_attention import MASKED_SCORE, AttentionBackwardOp, AttentionOp
from jnova.dialect.types import TensorType, numpy_dtype

log = logging.getLogger("jnova.passes")

ATTENTION_OPS = ("nova.attention", "nova.attention_backward")
F32 = "float32"


class _Builder:
    """Appends generic nova ops to `ops`; each call returns the new op's (first) result."""

    def __init__(self):
        self.ops: list[Op] = []

    def __call__(self, name: str, operands, out: TensorType, **attrs) -> Value:
        op = OPS[name](list(operands), [out], attrs)
        self.ops.append(op)
        return op.results[0]

    def const(self, value: float, shape, dtype=F32) -> Value:
        scalar = self("nova.constant", [], TensorType((), dtype), value=np.array(value, numpy_dtype(dtype)))
        return self.broadcast(scalar, shape, ())

    def broadcast(self, x: Value, shape, dims) -> Value:
        t = TensorType(tuple(shape), x.type.dtype)
        return x if x.type == t and tuple(dims) == tuple(range(x.type.rank)) else self("nova.broadcast", [x], t, dims=tuple(dims))

    def f32(self, x: Value) -> Value:
        return x if x.type.dtype == F32 else self("nova.convert", [x], x.type.with_dtype(F32))

    def convert(self, x: Value, dtype: str) -> Value:
        return x if x.type.dtype == dtype else self("nova.convert", [x], x.type.with_dtype(dtype))

    def reshape(self, x: Value, shape) -> Value:
        return x if x.type.shape == tuple(shape) else self("nova.reshape", [x], TensorType(tuple(shape), x.type.dtype))

    def transpose(self, x: Value, perm) -> Value:
        if tuple(perm) == tuple(range(len(perm))):
            return x
        return self("nova.transpose", [x], TensorType(tuple(x.type.shape[p] for p in perm), x.type.dtype), perm=tuple(perm))

    def binary(self, name: str, x: Value, y: Value) -> Value:
        return self(f"nova.{name}", [x, y], x.type)

    def unary(self, name: str, x: Value) -> Value:
        return self(f"nova.{name}", [x], x.type)

    def reduce(self, kind: str, x: Value, dim: int) -> Value:
        shape = tuple(s for d, s in enumerate(x.type.shape) if d != dim)
        return self("nova.reduce", [x], TensorType(shape, x.type.dtype), kind=kind, dims=(dim,))

    def matmul(self, lhs: Value, rhs: Value, batch: int, lhs_contract, rhs_contract) -> Value:
        """dot_general over the first `batch` dims of both operands."""
        b = tuple(range(batch))
        lf = [d for d in range(lhs.type.rank) if d >= batch and d not in lhs_contract]
        rf = [d for d in range(rhs.type.rank) if d >= batch and d not in rhs_contract]
        shape = tuple(lhs.type.shape[d] for d in b) + tuple(lhs.type.shape[d] for d in lf) + tuple(rhs.type.shape[d] for d in rf)
        return self("nova.matmul", [lhs, rhs], TensorType(shape, F32), lhs_batch=b, rhs_batch=b,
                    lhs_contract=tuple(lhs_contract), rhs_contract=tuple(rhs_contract),
                    precision="default")  # as the attention kernels: TF32 for f32 operands on the GPU


def _to_bhtd(b: _Builder, x: Value, layout: str) -> Value:
    return b.f32(b.transpose(x, (0, 2, 1, 3)) if layout == "bthd" else x)


def _from_bhtd(b: _Builder, x: Value, layout: str, dtype: str) -> Value:
    x = b.convert(x, dtype)
    return b.transpose(x, (0, 2, 1, 3)) if layout == "bthd" else x


class _Scores:
    """The softmax of the scaled, biased, masked scores, as [B, Hkv, G, Tq, Tk] (G = Hq / Hkv)."""

    def __init__(self, b: _Builder, op: AttentionOp | AttentionBackwardOp):
        d, a = op.dims(), op.attrs
        self.B, self.Hq, self.Hkv, self.Tq, self.Tk, self.D = d["B"], d["Hq"], d["Hkv"], d["Tq"], d["Tk"], d["D"]
        self.G = self.Hq // self.Hkv
        layout = a["layout"]
        q, k, v = (_to_bhtd(b, x, layout) for x in op.operands[:3])
        self.q5 = b.reshape(q, (self.B, self.Hkv, self.G, self.Tq, self.D))
        self.k, self.v = k, v
        full = (self.B, self.Hq, self.Tq, self.Tk)
        s = b.reshape(b.matmul(self.q5, k, 2, (4,), (3,)), full)  # [B, Hkv, G, Tq, Tk] -> [B, Hq, Tq, Tk]
        s = b.binary("mul", s, b.const(a["scale"], full))
        if op.bias is not None:
            s = b.binary("add", s, b.broadcast(b.f32(op.bias), full, range(4)))
        keep = None
        if op.mask is not None:
            keep = b.broadcast(op.mask, full, range(4))
        if a["causal"]:
            rows = b("nova.iota", [], TensorType((self.Tq, self.Tk), "int32"), dim=0)
            cols = b("nova.iota", [], TensorType((self.Tq, self.Tk), "int32"), dim=1)
            tril = b.broadcast(b("nova.compare", [cols, rows], TensorType((self.Tq, self.Tk), "bool"), predicate="le"),
                               full, (2, 3))
            keep = tril if keep is None else b.binary("and", keep, tril)
        if keep is not None:
            s = b("nova.select", [keep, b.const(MASKED_SCORE, full), s], s.type)
        self.keep5 = None if keep is None else b.reshape(keep, (self.B, self.Hkv, self.G, self.Tq, self.Tk))
        rows = (self.B, self.Hq, self.Tq)
        m = b.reduce("max", s, 3)
        e = b.unary("exp", b.binary("sub", s, b.broadcast(m, full, (0, 1, 2))))
        total = b.reduce("sum", e, 3)
        self.lse = b.binary("add", m, b.unary("log", total))
        p = b.binary("div", e, b.broadcast(total, full, (0, 1, 2)))
        self.p5 = b.reshape(p, (self.B, self.Hkv, self.G, self.Tq, self.Tk))
        self.rows = rows


def attention_decomposition(op: Op) -> tuple[list[Op], list[Value]]:
    """Generic nova ops computing `op`'s results from its operands, and the values that are its results."""
    b = _Builder()
    sc = _Scores(b, op)
    layout, dtype = op.attrs["layout"], op.operands[0].type.dtype
    if isinstance(op, AttentionOp):
        o = b.matmul(sc.p5, sc.v, 2, (4,), (2,))  # [B, Hkv, G, Tq, D]
        o = _from_bhtd(b, b.reshape(o, (sc.B, sc.Hq, sc.Tq, sc.D)), layout, dtype)
        return b.ops, [o, sc.lse]
    do5 = b.reshape(_to_bhtd(b, op.operands[5], layout), (sc.B, sc.Hkv, sc.G, sc.Tq, sc.D))
    dv = b.matmul(sc.p5, do5, 2, (2, 3), (2, 3))  # [B, Hkv, Tk, D]
    dp = b.matmul(do5, sc.v, 2, (4,), (3,))  # [B, Hkv, G, Tq, Tk]
    shape5 = dp.type.shape
    delta = b.reduce("sum", b.binary("mul", sc.p5, dp), 4)  # [B, Hkv, G, Tq]: rowsum(P * dP) = rowsum(dO * O)
    ds = b.binary("mul", sc.p5, b.binary("sub", dp, b.broadcast(delta, shape5, (0, 1, 2, 3))))
    ds = b.binary("mul", ds, b.const(op.attrs["scale"], shape5))
    if sc.keep5 is not None:  # a masked score is a constant: no gradient (p is not 0 in a fully masked row)
        ds = b("nova.select", [sc.keep5, b.const(0.0, shape5), ds], ds.type)
    dq = b.matmul(ds, sc.k, 2, (4,), (2,))  # [B, Hkv, G, Tq, D]
    dk = b.matmul(ds, sc.q5, 2, (2, 3), (2, 3))  # [B, Hkv, Tk, D]
    dq = _from_bhtd(b, b.reshape(dq, (sc.B, sc.Hq, sc.Tq, sc.D)), layout, dtype)
    return b.ops, [dq, _from_bhtd(b, dk, layout, dtype), _from_bhtd(b, dv, layout, dtype)]


def expand_refused_attention(func: Func, refusal: Callable[[Op], str | None]) -> int:
    """Replace, in place, each attention op that `refusal` refuses by its decomposition; returns how many."""
    replace: dict[Value, Value] = {}
    ops: list[Op] = []
    count = 0
    for op in func.ops:
        op.operands = [replace.get(v, v) for v in op.operands]
        why = refusal(op) if op.name in ATTENTION_OPS else None
        if why is None:
            ops.append(op)
            continue
        log.info("expand_attention: %s %s runs as generic nova ops: %s", op.name, _shape_text(op), why)
        new_ops, results = attention_decomposition(op)
        ops += new_ops
        replace.update(zip(op.results, results))
        count += 1
    func.ops = ops
    func.returns = [replace.get(v, v) for v in func.returns]
    return count


def _shape_text(op: Op) -> str:
    d = op.dims()
    return (f"(B={d['B']}, Hq={d['Hq']}, Hkv={d['Hkv']}, Tq={d['Tq']}, Tk={d['Tk']}, D={d['D']}, "
            f"{op.operands[0].type.dtype}, {op.attrs['layout']}, causal={op.attrs['causal']}, "
            f"{op.attrs['optional_operand']})")
