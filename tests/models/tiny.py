"""A tiny GPT-style training step (attention, LayerNorm, GELU, tied embedding) with random tokens.

Self-contained (no data packages): used where the test is about the compiler, not the text.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


class Block(nn.Module):
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        qkv = nn.Dense(3 * d)(nn.LayerNorm()(x)).reshape(b, t, 3, self.heads, d // self.heads)
        a = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
        x = x + nn.Dense(d)(a.reshape(b, t, d))
        return x + nn.Dense(d)(nn.gelu(nn.Dense(4 * d)(nn.LayerNorm()(x))))


class Tiny(nn.Module):
    vocab: int = 97
    d: int = 32
    layers: int = 2

    @nn.compact
    def __call__(self, ids):
        emb = nn.Embed(self.vocab, self.d)
        x = emb(ids)
        for _ in range(self.layers):
            x = Block()(x)
        return emb.attend(nn.LayerNorm()(x))


def make_step(model, optimizer):
    def step(params, state, ids):
        def loss(p):
            logits = model.apply(p, ids[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return step


def setup(batch=2, seq=17, seed=None, optimizer=None, **config):
    """(step, params, opt_state, ids) for a fresh random model and batch."""
    rng = np.random.default_rng(seed)
    model = Tiny(**config)
    ids = jnp.asarray(rng.integers(0, model.vocab, (batch, seq)), jnp.int32)
    params = model.init(jax.random.key(int(rng.integers(1 << 30))), ids[:, :-1])
    optimizer = optimizer or optax.sgd(0.1, momentum=0.9)
    return make_step(model, optimizer), params, optimizer.init(params), ids
