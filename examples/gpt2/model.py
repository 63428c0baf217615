"""GPT-2 in Flax (linen), written as a JAX user writes it: jnova compiles it unchanged.

Pre-LayerNorm transformer blocks, causal self-attention through `jax.nn.dot_product_attention`,
GELU (tanh approximation, as in GPT-2), learned position embeddings, and an LM head tied to the
token embedding (`wte.attend`). `GPTConfig.gpt2_124m()` is the original 124M-parameter model;
`GPTConfig.tiny()` is the few-hundred-thousand-parameter model the CPU checks use.
"""
from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024     # longest sequence (rows of the position embedding)
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768

    @classmethod
    def gpt2_124m(cls) -> "GPTConfig":
        return cls()

    @classmethod
    def tiny(cls, vocab_size: int = 50257) -> "GPTConfig":
        return cls(vocab_size=vocab_size, block_size=64, n_layer=2, n_head=4, d_model=64)

    def num_params(self) -> int:
        c, v = self.d_model, self.vocab_size
        per_block = 12 * c * c + 13 * c   # qkv + proj + 2-layer MLP (4x), biases, two LayerNorms
        return v * c + self.block_size * c + self.n_layer * per_block + 2 * c

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), as in the PaLM appendix: 6N + 12 L T C."""
        return 6 * self.num_params() + 12 * self.n_layer * seq_len * self.d_model


_init = nn.initializers.normal(stddev=0.02)


class CausalSelfAttention(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x):
        batch, seq, d_model = x.shape
        heads = self.config.n_head
        qkv = nn.Dense(3 * d_model, kernel_init=_init, name="c_attn")(x)
        q, k, v = jnp.split(qkv.reshape(batch, seq, 3 * heads, d_model // heads), 3, axis=2)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)   # [batch, seq, heads, head_dim]
        proj_init = nn.initializers.normal(stddev=0.02 / (2 * self.config.n_layer) ** 0.5)
        return nn.Dense(d_model, kernel_init=proj_init, name="c_proj")(y.reshape(batch, seq, d_model))


class MLP(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x):
        d_model = self.config.d_model
        h = nn.gelu(nn.Dense(4 * d_model, kernel_init=_init, name="c_fc")(x), approximate=True)
        proj_init = nn.initializers.normal(stddev=0.02 / (2 * self.config.n_layer) ** 0.5)
        return nn.Dense(d_model, kernel_init=proj_init, name="c_proj")(h)


class Block(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x):
        x = x + CausalSelfAttention(self.config, name="attn")(nn.LayerNorm(epsilon=1e-5, name="ln_1")(x))
        return x + MLP(self.config, name="mlp")(nn.LayerNorm(epsilon=1e-5, name="ln_2")(x))


class GPT(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.config
        wte = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=_init, name="wte")
        wpe = nn.Embed(cfg.block_size, cfg.d_model, embedding_init=nn.initializers.normal(stddev=0.01), name="wpe")
        x = wte(tokens) + wpe(jnp.arange(tokens.shape[1]))[None]
        for i in range(cfg.n_layer):
            x = Block(cfg, name=f"h_{i}")(x)
        x = nn.LayerNorm(epsilon=1e-5, name="ln_f")(x)
        return wte.attend(x)   # weight tying: the LM head is the token embedding


def loss_fn(model: GPT, params, tokens, targets):
    """Mean next-token cross-entropy."""
    logits = model.apply({"params": params}, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_optimizer(learning_rate: float = 6e-4, weight_decay: float = 0.1):
    """AdamW as in GPT-2/3 training (no decay on biases and LayerNorm scales)."""
    def decay_mask(params):
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    return optax.adamw(learning_rate, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay, mask=decay_mask)


def make_train_step(model: GPT, optimizer):
    """One training step: loss, gradients and the AdamW update, as one function to compile."""
    def train_step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, tokens, targets))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def init_params(model: GPT, key, seq_len: int):
    return model.init(key, jnp.zeros((1, seq_len), jnp.int32))["params"]
