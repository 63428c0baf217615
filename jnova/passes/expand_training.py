"""expand_training: nova.sce, nova.layernorm, nova.rmsnorm, nova.gelu (and their backwards) as
generic nova ops.

`training_decomposition(op)` gives the ops (reduce, exp, select, iota, ...) that compute the op's
results by its definition (dialect/ops_training.py), in f32 whatever the operands' type, each
normalization over rows of [R, C] (the leading dimensions flattened). It is the generic path of
every backend, as the attention ops' decomposition is (passes/expand_attention.py):

- `expand_refused_training(func, refusal)` (a pipeline stage) replaces each op that the backend's
  `refusal(op)` refuses (it returns why, or None) by its decomposition before fusion, so jnova's
  ordinary kernels (row reductions with their prologues and epilogues, elementwise kernels) compute
  it; each refusal is logged (logger `jnova.passes`) with its reason;
- the CPU backend lowers an op it keeps by lowering its decomposition in place (codegen/linalg/
  rules_training.py);
- `nova_to_jax` evaluates such an op as its decomposition's JAX ops.

The forms follow what JAX and Flax compute: LayerNorm's variance is E[x^2] - E[x]^2 clamped at 0
(Flax's fast variance), the log-sum-exp is shifted by the row maximum, GELU's tanh form uses
float32(sqrt(2/pi)) and 0.044715 as `jax.nn.gelu` does.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

from jnova.dialect.ir import Func, Op, Value
from jnova.dialect.ops_training import (GeluBackwardOp, GeluOp, LayerNormBackwardOp, LayerNormOp, RmsNormBackwardOp,
                                        RmsNormOp, SceBackwardOp, SceOp, TRAINING_OPS)
from jnova.dialect.types import TensorType
from jnova.passes.expand_attention import _Builder

log = logging.getLogger("jnova.passes")

F32 = "float32"
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715


class _Rows:
    """x in f32 and the row operations of a normalization over its last dimension, in x's own shape
    (no reshapes: the fusion pass sees the same row reductions the generic ops had)."""

    def __init__(self, b: _Builder, x: Value):
        self.b, self.shape = b, x.type.shape
        self.C = self.shape[-1]
        self.rows = self.shape[:-1]
        self.x = b.f32(x)

    def rows2(self, v: Value) -> Value:
        return self.b.f32(v)

    def rows1(self, v: Value) -> Value:
        return v

    def wide(self, v: Value) -> Value:          # rows -> x's shape
        return self.b.broadcast(v, self.shape, tuple(range(len(self.rows))))

    def param(self, p: Value) -> Value:         # [C] -> x's shape, f32
        return self.b.broadcast(self.b.f32(p), self.shape, (len(self.rows),))

    def mean_c(self, v: Value) -> Value:        # x's shape -> rows
        total = self.b("nova.reduce", [v], TensorType(self.rows, F32), kind="sum", dims=(len(self.rows),))
        return self.b.binary("div", total, self.b.const(float(self.C), self.rows))

    def col_sum(self, v: Value) -> Value:       # x's shape -> [C]
        return self.b("nova.reduce", [v], TensorType((self.C,), F32), kind="sum", dims=tuple(range(len(self.rows))))

    def back(self, v: Value, dtype: str) -> Value:
        return self.b.convert(v, dtype)

    def back_rows(self, v: Value) -> Value:
        return v


# --------------------------------------------------------------------------- cross-entropy
def _sce_common(b: _Builder, op):
    logits, labels = op.operands[0], op.operands[1]
    n, v = logits.type.shape
    x = b.f32(logits)
    ldt = labels.type.dtype
    cols = b("nova.iota", [], TensorType((n, v), ldt), dim=1)
    onehot = b("nova.compare", [cols, b.broadcast(labels, (n, v), (0,))], TensorType((n, v), "bool"), predicate="eq")
    keep = None
    if op.attrs["has_ignore"]:
        ignored = b.const(op.attrs["ignore_index"], (n,), ldt)
        keep = b("nova.compare", [labels, ignored], TensorType((n,), "bool"), predicate="ne")
    return x, onehot, keep, n, v


# nova.select(which, if_false, if_true), as lax.select_n
def _count(b: _Builder, keep: Value | None, n: int) -> Value:
    """How many rows are not ignored, f32 []."""
    if keep is None:
        return b.const(float(n), ())
    return b.reduce("sum", b("nova.convert", [keep], TensorType((n,), F32)), 0)


def _sce(b: _Builder, op: SceOp) -> list[Value]:
    x, onehot, keep, n, v = _sce_common(b, op)
    m = b.reduce("max", x, 1)
    e = b.unary("exp", b.binary("sub", x, b.broadcast(m, (n, v), (0,))))
    lse = b.binary("add", m, b.unary("log", b.reduce("sum", e, 1)))
    picked = b.reduce("sum", b("nova.select", [onehot, b.const(0.0, (n, v)), x], x.type), 1)
    loss = b.binary("sub", lse, picked)
    if keep is not None:
        loss = b("nova.select", [keep, b.const(0.0, (n,)), loss], loss.type)
    red = op.attrs["reduction"]
    if red != "none":
        loss = b.reduce("sum", loss, 0)
        if red == "mean":
            loss = b.binary("div", loss, _count(b, keep, n))
    return [loss, lse]


def _sce_backward(b: _Builder, op: SceBackwardOp) -> list[Value]:
    x, onehot, keep, n, v = _sce_common(b, op)
    lse, dloss = op.operands[2], op.operands[3]
    p = b.unary("exp", b.binary("sub", x, b.broadcast(lse, (n, v), (0,))))
    d = b.binary("sub", p, b("nova.convert", [onehot], TensorType((n, v), F32)))
    red = op.attrs["reduction"]
    g = dloss if red == "none" else b.broadcast(
        dloss if red == "sum" else b.binary("div", dloss, _count(b, keep, n)), (n,), ())
    if keep is not None:
        g = b("nova.select", [keep, b.const(0.0, (n,)), g], g.type)
    d = b.binary("mul", d, b.broadcast(g, (n, v), (0,)))
    return [b.convert(d, op.operands[0].type.dtype)]


# --------------------------------------------------------------------------- normalizations
def _params(op) -> dict[str, Value]:
    return dict(zip(op.param_names(), op.variadic_operands()))


def _layernorm(b: _Builder, op: LayerNormOp) -> list[Value]:
    r = _Rows(b, op.operands[0])
    p = _params(op)
    mean = r.mean_c(r.x)
    msq = r.mean_c(b.binary("mul", r.x, r.x))
    var = b.binary("max", b.const(0.0, r.rows), b.binary("sub", msq, b.binary("mul", mean, mean)))
    rstd = b.unary("rsqrt", b.binary("add", var, b.const(op.attrs["epsilon"], r.rows)))
    y = b.binary("mul", b.binary("sub", r.x, r.wide(mean)), r.wide(rstd))
    if "scale" in p:
        y = b.binary("mul", y, r.param(p["scale"]))
    if "bias" in p:
        y = b.binary("add", y, r.param(p["bias"]))
    return [r.back(y, op.results[0].type.dtype), r.back_rows(mean), r.back_rows(rstd)]


def _norm_dx(b: _Builder, r: _Rows, xhat: Value, dy: Value, rstd: Value, scale: Value | None,
             centered: bool) -> Value:
    """rstd * (g - mean_c(g) - xhat * mean_c(g * xhat)) with g = dy (* scale); no mean_c(g) for RMSNorm."""
    g = dy if scale is None else b.binary("mul", dy, r.param(scale))
    inner = b.binary("sub", g, b.binary("mul", xhat, r.wide(r.mean_c(b.binary("mul", g, xhat)))))
    if centered:
        inner = b.binary("sub", inner, r.wide(r.mean_c(g)))
    return b.binary("mul", inner, r.wide(rstd))


def _layernorm_backward(b: _Builder, op: LayerNormBackwardOp) -> list[Value]:
    r = _Rows(b, op.operands[0])
    mean, rstd = r.rows1(op.operands[1]), r.rows1(op.operands[2])
    dy = r.rows2(op.operands[3])
    scale = op.variadic_operands()[0] if op.attrs["has_scale"] else None
    xhat = b.binary("mul", b.binary("sub", r.x, r.wide(mean)), r.wide(rstd))
    out = [r.back(_norm_dx(b, r, xhat, dy, rstd, scale, True), op.operands[0].type.dtype)]
    if op.attrs["has_scale"]:
        out.append(r.col_sum(b.binary("mul", dy, xhat)))
    if op.attrs["has_bias"]:
        out.append(r.col_sum(dy))
    return out


def _rmsnorm(b: _Builder, op: RmsNormOp) -> list[Value]:
    r = _Rows(b, op.operands[0])
    p = _params(op)
    rstd = b.unary("rsqrt", b.binary("add", r.mean_c(b.binary("mul", r.x, r.x)),
                                     b.const(op.attrs["epsilon"], r.rows)))
    y = b.binary("mul", r.x, r.wide(rstd))
    if "scale" in p:
        y = b.binary("mul", y, r.param(p["scale"]))
    return [r.back(y, op.results[0].type.dtype), r.back_rows(rstd)]


def _rmsnorm_backward(b: _Builder, op: RmsNormBackwardOp) -> list[Value]:
    r = _Rows(b, op.operands[0])
    rstd = r.rows1(op.operands[1])
    dy = r.rows2(op.operands[2])
    scale = op.variadic_operands()[0] if op.attrs["has_scale"] else None
    xhat = b.binary("mul", r.x, r.wide(rstd))
    out = [r.back(_norm_dx(b, r, xhat, dy, rstd, scale, False), op.operands[0].type.dtype)]
    if op.attrs["has_scale"]:
        out.append(r.col_sum(b.binary("mul", dy, xhat)))
    return out


# --------------------------------------------------------------------------- GELU
def _phi(b: _Builder, x: Value, approximate: str) -> tuple[Value, Value | None]:
    """Phi(x) of the GELU form (f32, x's shape), and for the tanh form its tanh (the backward's)."""
    s = x.type.shape
    if approximate == "tanh":
        u = b.binary("mul", b.const(SQRT_2_OVER_PI, s), b.binary("add", x, b.binary(
            "mul", b.const(GELU_CUBIC, s), b.binary("mul", b.binary("mul", x, x), x))))
        t = b.unary("tanh", u)
        return b.binary("mul", b.const(0.5, s), b.binary("add", b.const(1.0, s), t)), t
    erf = b.unary("erf", b.binary("mul", x, b.const(1 / math.sqrt(2), s)))
    return b.binary("mul", b.const(0.5, s), b.binary("add", b.const(1.0, s), erf)), None


def _x_dphi(b: _Builder, x: Value, t: Value | None) -> Value:
    """x * Phi'(x): with the tanh form's t, 0.5 x (1 - t)(1 + t) sqrt(2/pi) (1 + 3 * 0.044715 x^2); else x * pdf(x)."""
    s = x.type.shape
    x2 = b.binary("mul", x, x)
    if t is not None:
        du = b.binary("mul", b.const(SQRT_2_OVER_PI, s), b.binary("add", b.const(1.0, s),
                                                                   b.binary("mul", b.const(3 * GELU_CUBIC, s), x2)))
        return b.binary("mul", b.binary("mul", b.const(0.5, s), x),
                        b.binary("mul", b.binary("mul", b.binary("sub", b.const(1.0, s), t),
                                                 b.binary("add", b.const(1.0, s), t)), du))
    density = b.binary("mul", b.const(1 / math.sqrt(2 * math.pi), s),
                       b.unary("exp", b.binary("mul", b.const(-0.5, s), x2)))
    return b.binary("mul", x, density)


def _gelu(b: _Builder, op: GeluOp) -> list[Value]:
    x = b.f32(op.operands[0])
    phi, _ = _phi(b, x, op.attrs["approximate"])
    return [b.convert(b.binary("mul", x, phi), op.results[0].type.dtype)]


def _gelu_backward(b: _Builder, op: GeluBackwardOp) -> list[Value]:
    x, dy = b.f32(op.operands[0]), b.f32(op.operands[1])
    phi, t = _phi(b, x, op.attrs["approximate"])
    return [b.convert(b.binary("mul", dy, b.binary("add", phi, _x_dphi(b, x, t))), op.results[0].type.dtype)]


_DECOMPOSE: dict[str, Callable] = {
    "nova.sce": _sce, "nova.sce_backward": _sce_backward, "nova.layernorm": _layernorm,
    "nova.layernorm_backward": _layernorm_backward, "nova.rmsnorm": _rmsnorm,
    "nova.rmsnorm_backward": _rmsnorm_backward, "nova.gelu": _gelu, "nova.gelu_backward": _gelu_backward,
}


def training_decomposition(op: Op) -> tuple[list[Op], list[Value]]:
    """Generic nova ops computing `op`'s results from its operands, and the values that are its results."""
    b = _Builder()
    results = _DECOMPOSE[op.name](b, op)
    return b.ops, results


def expand_refused_training(func: Func, refusal: Callable[[Op], str | None]) -> int:
    """Replace, in place, each training op that `refusal` refuses by its decomposition; returns how many."""
    replace: dict[Value, Value] = {}
    ops: list[Op] = []
    added: set[Op] = set()
    count = 0
    for op in func.ops:
        op.operands = [replace.get(v, v) for v in op.operands]
        why = refusal(op) if op.name in TRAINING_OPS else None
        if why is None:
            ops.append(op)
            continue
        log.info("expand_training: %s on %s runs as generic nova ops: %s", op.name, op.operands[0].type, why)
        new_ops, results = training_decomposition(op)
        ops += new_ops
        added.update(new_ops)
        replace.update(zip(op.results, results))
        count += 1
    func.returns = [replace.get(v, v) for v in func.returns]
    func.ops = _without_unread(ops, set(func.returns), added)
    return count


def _without_unread(ops: list[Op], returned: set[Value], added: set[Op]) -> list[Op]:
    """`ops` less the decomposition ops nothing reads (a forward's backward-only values, the lse of a
    loss whose gradient is not taken)."""
    read = set(returned)
    kept = []
    for op in reversed(ops):
        if op in added and not any(r in read for r in op.results):
            continue
        kept.append(op)
        read.update(op.operands)
    return kept[::-1]
