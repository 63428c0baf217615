"""Models of the model zoo (tests/test_model_zoo.py), each with a training step that also returns its
gradients (so that a comparison can tell the backward pass from the optimizer update):

- `Llama`: a Llama-style decoder in flax.linen (RMSNorm, SwiGLU, rotary position embeddings,
  grouped-query causal attention, no biases, untied LM head); `dtype` is the compute dtype (bf16 with
  the f32 parameters as master weights: Flax casts each parameter to `dtype` where it is used), and
  `scan_layers` puts the blocks under `nn.scan` (one stacked set of block parameters);
- `scanned_mlp_loss`: a residual MLP whose layers are applied by `lax.scan` over stacked weights.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from helpers.random_inputs import rand


def wide(dtype):
    """The dtype of statistics, softmax and loss: f32, or f64 in a model computed in f64 (the reference
    the bf16 model's rounding noise is measured against)."""
    return jnp.promote_types(dtype, jnp.float32)


class RMSNorm(nn.Module):
    dtype: Any = jnp.float32
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x32 = x.astype(wide(self.dtype))   # the statistics in f32, as Llama's reference code does
        y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale).astype(self.dtype)


def rope(x, theta: float = 10000.0):
    """Rotary position embedding of x (batch, time, heads, head_dim): pairs (i, i + d/2) rotated by
    position * theta**(-2i/d), computed in f32."""
    t, d, dtype = x.shape[1], x.shape[-1], wide(x.dtype)
    freqs = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=dtype) / d)
    angles = jnp.arange(t, dtype=dtype)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(dtype), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class Attention(nn.Module):
    n_heads: int
    n_kv_heads: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        _, t, d_model = x.shape
        head_dim = d_model // self.n_heads
        dense = partial(nn.DenseGeneral, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32)
        q = rope(dense((self.n_heads, head_dim), name="wq")(x))
        k = rope(dense((self.n_kv_heads, head_dim), name="wk")(x))
        v = dense((self.n_kv_heads, head_dim), name="wv")(x)
        group = self.n_heads // self.n_kv_heads   # grouped-query attention: each kv head serves `group` q heads
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(wide(self.dtype)) / math.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((t, t), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return dense(d_model, axis=(-2, -1), name="wo")(out)


class SwiGLU(nn.Module):
    hidden: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        dense = partial(nn.Dense, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32)
        return dense(x.shape[-1], name="w2")(nn.silu(dense(self.hidden, name="w1")(x)) * dense(self.hidden, name="w3")(x))


class Block(nn.Module):
    n_heads: int
    n_kv_heads: int
    hidden: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, _=None):
        x = x + Attention(self.n_heads, self.n_kv_heads, self.dtype)(RMSNorm(self.dtype)(x))
        x = x + SwiGLU(self.hidden, self.dtype)(RMSNorm(self.dtype)(x))
        return x, None


class Llama(nn.Module):
    vocab: int = 61
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden: int = 48
    dtype: Any = jnp.float32
    scan_layers: bool = False

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab, self.d_model, dtype=self.dtype, param_dtype=jnp.float32)(ids)
        if self.scan_layers:
            blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.n_layers)
            x, _ = blocks(self.n_heads, self.n_kv_heads, self.hidden, self.dtype, name="blocks")(x, None)
        else:
            for i in range(self.n_layers):
                x, _ = Block(self.n_heads, self.n_kv_heads, self.hidden, self.dtype, name=f"block_{i}")(x)
        x = RMSNorm(self.dtype)(x)
        return nn.Dense(self.vocab, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32, name="lm_head")(x)


def language_model_step(model: nn.Module, optimizer):
    """(params, opt_state, ids) -> (params, opt_state, loss, grads): next-token cross-entropy in f32
    (f64 for a model computed in f64)."""

    def step(params, opt_state, ids):
        def loss_fn(p):
            logits = model.apply(p, ids[:, :-1]).astype(wide(model.dtype))
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return step


def llama_setup(seed: int, batch: int = 2, seq: int = 10, **config):
    """(model, params, ids) for a fresh random model and batch of token ids."""
    rng = np.random.default_rng(seed)
    model = Llama(**config)
    ids = jnp.asarray(rng.integers(0, model.vocab, (batch, seq)), jnp.int32)
    params = model.init(jax.random.key(int(rng.integers(1 << 30))), ids[:, :-1])
    return model, params, ids


# --------------------------------------------------------------------------- lax.scan over layers
def scanned_mlp_init(seed: int, layers: int = 3, d: int = 16, d_in: int = 8, d_out: int = 5) -> dict:
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rand(shape, jnp.float32, rng)  # noqa: E731
    return {"w_in": normal(d_in, d) / d_in**0.5, "w": normal(layers, d, d) / d**0.5, "b": 0.1 * normal(layers, d),
            "w_out": normal(d, d_out) / d**0.5}


def scanned_mlp_loss(params, x, y):
    """A residual tanh MLP: h <- h + tanh(h @ w[l] + b[l]) for each layer l, by lax.scan."""
    def layer(h, wb):
        w, b = wb
        return h + jnp.tanh(h @ w + b), None

    h, _ = lax.scan(layer, x @ params["w_in"], (params["w"], params["b"]))
    return jnp.mean((h @ params["w_out"] - y) ** 2)


def supervised_step(loss_fn, optimizer):
    """(params, opt_state, x, y) -> (params, opt_state, loss, grads)."""

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return step
