"""JAX primitives that stand for nova.attention and nova.attention_backward in a jaxpr.

`jnova.ops.attention` binds them (its custom VJP's forward binds `attention_p`, its backward
`attention_backward_p`), and capture converts each bind into the nova op of the same name
(`rules_attention.py`). Outside jnova (under plain `jax.jit`, or when XLA runs them) they evaluate
`reference_attention` / `reference_attention_backward`: the ops' definition (dialect/ops_attention.py)
in jax.numpy, in f32, the same arithmetic as jnova's generic decomposition.

Parameters of both: `causal`, `scale`, `layout` and `optional_operand` ("none", "bias" or "mask"),
the attributes of the nova ops; the optional bias or mask is the last operand.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import mlir

from jnova.dialect.ops_attention import MASKED_SCORE

attention_p = jex_core.Primitive("jnova_attention")
attention_p.multiple_results = True
attention_backward_p = jex_core.Primitive("jnova_attention_backward")
attention_backward_p.multiple_results = True


def _bhtd(x, layout):
    return jnp.swapaxes(x, 1, 2) if layout == "bthd" else x


def _probabilities(q, k, extra, *, causal, scale, layout, optional_operand):
    """(p [B, Hkv, G, Tq, Tk], lse [B, Hq, Tq], q5 [B, Hkv, G, Tq, D], k [B, Hkv, Tk, D], keep) in f32;
    keep: where scores are kept ([B, Hkv, G, Tq, Tk] bool), or None."""
    q, k = (_bhtd(x, layout).astype(jnp.float32) for x in (q, k))
    b, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    q5 = q.reshape(b, hkv, hq // hkv, tq, d)
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q5, k, precision="highest").reshape(b, hq, tq, tk) * jnp.float32(scale)
    keep = None
    if optional_operand == "bias":
        s = s + extra[0].astype(jnp.float32)
    elif optional_operand == "mask":
        keep = jnp.broadcast_to(extra[0], s.shape)
    if causal:
        tril = jnp.arange(tk)[None, :] <= jnp.arange(tq)[:, None]
        keep = tril if keep is None else keep & tril
    if keep is not None:
        s = jnp.where(keep, s, jnp.float32(MASKED_SCORE))
    m = s.max(-1, keepdims=True)
    e = jnp.exp(s - m)
    total = e.sum(-1, keepdims=True)
    lse = (m + jnp.log(total))[..., 0]
    shape5 = (b, hkv, hq // hkv, tq, tk)
    return (e / total).reshape(shape5), lse, q5, k, None if keep is None else jnp.broadcast_to(keep, s.shape).reshape(shape5)


def reference_attention(q, k, v, *extra, causal, scale, layout, optional_operand):
    """(o, lse) of nova.attention in jax.numpy."""
    p, lse, _, _, _ = _probabilities(q, k, extra, causal=causal, scale=scale, layout=layout,
                                  optional_operand=optional_operand)
    v32 = _bhtd(v, layout).astype(jnp.float32)
    o = jnp.einsum("bhgqk,bhkd->bhgqd", p, v32, precision="highest")
    o = o.reshape(o.shape[0], -1, o.shape[3], o.shape[4])
    return [_bhtd(o, layout).astype(q.dtype), lse]


def reference_attention_backward(q, k, v, o, lse, do, *extra, causal, scale, layout, optional_operand):
    """(dq, dk, dv) of nova.attention_backward in jax.numpy (the softmax recomputed from the scores)."""
    p, _, q5, k32, keep = _probabilities(q, k, extra, causal=causal, scale=scale, layout=layout,
                                   optional_operand=optional_operand)
    v32 = _bhtd(v, layout).astype(jnp.float32)
    do5 = _bhtd(do, layout).astype(jnp.float32).reshape(q5.shape)
    hi = "highest"
    dv = jnp.einsum("bhgqk,bhgqd->bhkd", p, do5, precision=hi)
    dp = jnp.einsum("bhgqd,bhkd->bhgqk", do5, v32, precision=hi)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True)) * jnp.float32(scale)
    if keep is not None:  # a masked score is a constant: no gradient (p is not 0 in a fully masked row)
        ds = jnp.where(keep, ds, 0.0)
    dq = jnp.einsum("bhgqk,bhkd->bhgqd", ds, k32, precision=hi)
    dq = dq.reshape(dq.shape[0], -1, dq.shape[3], dq.shape[4])
    dk = jnp.einsum("bhgqk,bhgqd->bhkd", ds, q5, precision=hi)
    return [_bhtd(dq, layout).astype(q.dtype), _bhtd(dk, layout).astype(k.dtype), _bhtd(dv, layout).astype(v.dtype)]


def _attention_abstract(q, k, v, *extra, causal, scale, layout, optional_operand):
    t_axis, h_axis = (1, 2) if layout == "bthd" else (2, 1)
    lse = jax.core.ShapedArray((q.shape[0], q.shape[h_axis], q.shape[t_axis]), jnp.float32)
    return [jax.core.ShapedArray(q.shape, q.dtype), lse]


def _backward_abstract(q, k, v, o, lse, do, *extra, **params):
    return [jax.core.ShapedArray(x.shape, x.dtype) for x in (q, k, v)]


for _p, _impl, _abstract in ((attention_p, reference_attention, _attention_abstract),
                             (attention_backward_p, reference_attention_backward, _backward_abstract)):
    _p.def_impl(_impl)
    _p.def_abstract_eval(_abstract)
    mlir.register_lowering(_p, mlir.lower_fun(_impl, multiple_results=True))
