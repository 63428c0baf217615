"""Operations users call explicitly: `jnova.ops.attention`.

`attention` is an ordinary differentiable JAX function (a custom VJP), usable under `jax.jit`,
`jax.grad` and inside a function `jnova.compile` compiles; jnova captures its forward as one
`nova.attention` op and its backward as one `nova.attention_backward` op. Outside jnova it computes
the same definition with jax.numpy (scores in f32).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jnova.capture.attention_primitives import attention_backward_p, attention_p
from jnova.dialect.ops_attention import ATTENTION_DTYPES, LAYOUTS, head_axes

__all__ = ["attention"]


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, bias=None, mask=None,
              layout: str = "bthd"):
    """Scaled dot-product attention, softmax(scale * q k^T + bias, masked) v.

    q: [B, Tq, Hq, D] (layout "bthd", as `jax.nn.dot_product_attention` takes it) or [B, Hq, Tq, D]
    ("bhtd"); k and v: [B, Tk, Hkv, D] (or [B, Hkv, Tk, D]) of q's dtype (float32, bfloat16 or
    float16), Hkv dividing Hq (grouped-query attention: q head h reads kv head h // (Hq // Hkv)).
    causal: query i attends to keys j <= i (needs Tq == Tk). scale: defaults to 1 / sqrt(D).
    bias: an additive float array broadcastable to [B, Hq, Tq, Tk] (each dimension 1 or full, in that
    order in both layouts); it is treated as a constant: it gets no gradient. mask: a bool array of
    the same form, True where a score is kept. At most one of bias and mask.

    Masked scores are -1e30 (finite), so a query whose every key is masked attends uniformly to all
    keys. Returns o, of q's shape and dtype.
    """
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    if layout not in LAYOUTS:
        raise ValueError(f"jnova.ops.attention: layout={layout!r}, expected one of {LAYOUTS}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"jnova.ops.attention: {name} has shape {x.shape}, expected 4 dimensions "
                             f"({'[B, T, H, D]' if layout == 'bthd' else '[B, H, T, D]'} for layout {layout!r})")
        if x.dtype.name not in ATTENTION_DTYPES or x.dtype != q.dtype:
            raise ValueError(f"jnova.ops.attention: {name} has dtype {x.dtype}, expected q's dtype, one of "
                             f"{ATTENTION_DTYPES}")
    t_axis, h_axis = head_axes(layout)
    hq, hkv, tq, tk = q.shape[h_axis], k.shape[h_axis], q.shape[t_axis], k.shape[t_axis]
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"jnova.ops.attention: k {k.shape} and v {v.shape} must have one shape, with q's "
                         f"batch and head dim ({q.shape})")
    if hq % hkv:
        raise ValueError(f"jnova.ops.attention: k and v have {hkv} heads, expected a divisor of q's {hq}")
    if causal and tq != tk:
        raise ValueError(f"jnova.ops.attention: causal attention needs as many queries ({tq}) as keys ({tk})")
    if bias is not None and mask is not None:
        raise ValueError("jnova.ops.attention: pass a bias or a mask, not both")
    extra, kind = [], "none"
    full = (q.shape[0], hq, tq, tk)
    for name, x in (("bias", bias), ("mask", mask)):
        if x is None:
            continue
        x = jnp.asarray(x)
        if x.ndim < 4:
            x = x.reshape((1,) * (4 - x.ndim) + x.shape)
        if x.ndim != 4 or any(s not in (1, f) for s, f in zip(x.shape, full)):
            raise ValueError(f"jnova.ops.attention: {name} has shape {x.shape}, expected one broadcastable to "
                             f"[B, Hq, Tq, Tk] = {list(full)} (each dimension 1 or full)")
        if name == "mask":
            x = x.astype(bool)
        elif x.dtype.name not in ATTENTION_DTYPES:
            raise ValueError(f"jnova.ops.attention: bias has dtype {x.dtype}, expected a float type")
        extra, kind = [x], name
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    return _attention(bool(causal), scale, layout, kind)(q, k, v, *extra)


@functools.lru_cache(maxsize=None)
def _attention(causal: bool, scale: float, layout: str, kind: str):
    params = {"causal": causal, "scale": scale, "layout": layout, "optional_operand": kind}

    @jax.custom_vjp
    def attend(q, k, v, *extra):
        return attention_p.bind(q, k, v, *extra, **params)[0]

    def forward(q, k, v, *extra):
        o, lse = attention_p.bind(q, k, v, *extra, **params)
        return o, (q, k, v, o, lse, extra)

    def backward(saved, do):
        q, k, v, o, lse, extra = saved
        dq, dk, dv = attention_backward_p.bind(q, k, v, o, lse, do, *extra, **params)
        return (dq, dk, dv, *(_no_gradient(x) for x in extra))

    attend.defvjp(forward, backward)
    return attend


def _no_gradient(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros(x.shape, x.dtype)
    return np.zeros(x.shape, jax.dtypes.float0)
