"""A Llama-style decoder (RMSNorm, causal attention with rotary positions, SwiGLU MLP) and its AdamW step.

Plain JAX, parameters in a dict: used where the test is about the compiler, not the text.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax


def init(key, vocab: int = 61, d: int = 48, heads: int = 4, hidden: int = 96, layers: int = 2) -> dict:
    keys = iter(jax.random.split(key, 2 + 6 * layers))
    normal = lambda shape, fan_in: jax.random.normal(next(keys), shape) / fan_in**0.5  # noqa: E731
    params = {"embed": normal((vocab, d), 1.0) * 0.5, "head": normal((d, vocab), d), "norm": jnp.ones((d,))}
    for i in range(layers):
        params[f"layer_{i}"] = {"attn_norm": jnp.ones((d,)), "wqkv": normal((d, 3 * d), d), "wo": normal((d, d), d),
                                "mlp_norm": jnp.ones((d,)), "w_gate": normal((d, hidden), d),
                                "w_up": normal((d, hidden), d), "w_down": normal((hidden, d), hidden)}
    return params


def _rms_norm(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w


def _rotary(x):
    t, half = x.shape[1], x.shape[-1] // 2
    freqs = 1.0 / 10000 ** (jnp.arange(half) / half)
    angle = jnp.arange(t)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _layer(p, x, heads):
    b, t, d = x.shape
    q, k, v = jnp.split((_rms_norm(x, p["attn_norm"]) @ p["wqkv"]).reshape(b, t, 3 * heads, d // heads), 3, axis=2)
    q, k = _rotary(q), _rotary(k)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / (d // heads) ** 0.5
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e30)
    x = x + jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, d) @ p["wo"]
    h = _rms_norm(x, p["mlp_norm"])
    return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def loss(params, ids, heads: int = 4):
    x = params["embed"][ids[:, :-1]]
    for name in sorted(k for k in params if k.startswith("layer_")):
        x = _layer(params[name], x, heads)
    logits = _rms_norm(x, params["norm"]) @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def setup(batch: int = 3, seq: int = 23, seed=None, lr: float = 1e-3):
    """(step, params, opt_state, ids): an AdamW step returning (params, opt_state, loss)."""
    rng = np.random.default_rng(seed)
    params = init(jax.random.key(int(rng.integers(1 << 30))))
    ids = jnp.asarray(rng.integers(0, params["embed"].shape[0], (batch, seq)), jnp.int32)
    optimizer = optax.adamw(lr, weight_decay=0.1)

    def step(params, state, ids):
        value, grads = jax.value_and_grad(loss)(params, ids)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return step, params, optimizer.init(params), ids
