"""GPT-2 in Flax (linen), written as a JAX user writes it: jnova compiles it unchanged.

Pre-LayerNorm transformer blocks, causal self-attention, GELU (tanh approximation, as in GPT-2),
learned position embeddings, and an LM head tied to the token embedding (`wte.attend`).
`GPTConfig.gpt2_124m()` is the original 124M-parameter model with its vocabulary of 50257 tokens padded
to 50304 embedding rows (a multiple of 64, as nanoGPT and the Nova report's Table 4 do; the extra rows
are never a target and learn to stay unlikely); `gpt2_124m(pad_vocab=False)` keeps 50257.
`GPTConfig.tiny()` is the few-hundred-thousand-parameter model the CPU checks use.

Two choices a Flax user makes are fields of the config:
- `dtype`: the modules' computation dtype, Flax's mixed precision. None computes in f32; "bfloat16"
  computes every layer in bf16 while parameters (and so the optimizer state) stay f32
  (`param_dtype`); the logits are cast to f32 for the loss, as Flax users do.
- `attention`: "manual" (softmax(QK^T / sqrt(d)) V written out with a causal mask), "xla"
  (`jax.nn.dot_product_attention`, XLA's implementation) or "cudnn" (the same call with
  `implementation="cudnn"`: cuDNN's fused attention, NVIDIA GPUs only, bf16 or fp16).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


GPT2_VOCAB = 50257             # token ids GPT-2's tokenizer produces
PADDED_VOCAB = 50304           # GPT2_VOCAB rounded up to a multiple of 64
ATTENTIONS = ("manual", "xla", "cudnn")
DTYPES = {"float32": None, "bfloat16": jnp.bfloat16}


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = GPT2_VOCAB   # rows of the token embedding (and columns of the logits)
    block_size: int = 1024     # longest sequence (rows of the position embedding)
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    dtype: Any = None          # the modules' computation dtype (None: f32); parameters are always f32
    attention: str = "xla"     # one of ATTENTIONS

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention {self.attention!r}: expected one of {ATTENTIONS}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")

    @classmethod
    def gpt2_124m(cls, pad_vocab: bool = True, **fields) -> "GPTConfig":
        return cls(vocab_size=PADDED_VOCAB if pad_vocab else GPT2_VOCAB, **fields)

    @classmethod
    def tiny(cls, vocab_size: int = GPT2_VOCAB, **fields) -> "GPTConfig":
        return cls(vocab_size=vocab_size, block_size=64, n_layer=2, n_head=4, d_model=64, **fields)

    def num_params(self) -> int:
        c, v = self.d_model, self.vocab_size
        per_block = 12 * c * c + 13 * c   # qkv + proj + 2-layer MLP (4x), biases, two LayerNorms
        return v * c + self.block_size * c + self.n_layer * per_block + 2 * c

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), as in the PaLM appendix: 6N + 12 L T C."""
        return 6 * self.num_params() + 12 * self.n_layer * seq_len * self.d_model


_init = nn.initializers.normal(stddev=0.02)


def check_attention(attention: str, dtype) -> None:
    """Raise a clear error where an attention implementation cannot run: cuDNN's needs an NVIDIA GPU
    and 16-bit inputs."""
    if attention != "cudnn":
        return
    if jax.default_backend() not in ("gpu", "cuda"):
        raise ValueError(f"attention 'cudnn' needs an NVIDIA GPU (cuDNN's fused attention); the default "
                         f"backend is {jax.default_backend()!r}: use attention 'manual' or 'xla' here")
    if dtype is None or jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError("attention 'cudnn' needs dtype bfloat16 or float16 (cuDNN's fused attention "
                         "takes 16-bit inputs); use attention 'xla' or 'manual' in float32")


def causal_attention(q, k, v, attention: str):
    """softmax(q k^T / sqrt(head_dim), causal) v for q, k, v [batch, seq, heads, head_dim]."""
    if attention == "manual":
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        seq = q.shape[1]
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal, scores.astype(jnp.float32), -jnp.inf)   # the softmax in f32, as in nanoGPT
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    implementation = "cudnn" if attention == "cudnn" else None
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


class CausalSelfAttention(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        batch, seq, d_model = x.shape
        heads = cfg.n_head
        qkv = nn.Dense(3 * d_model, kernel_init=_init, dtype=cfg.dtype, name="c_attn")(x)
        q, k, v = jnp.split(qkv.reshape(batch, seq, 3 * heads, d_model // heads), 3, axis=2)
        y = causal_attention(q, k, v, cfg.attention)   # [batch, seq, heads, head_dim]
        proj_init = nn.initializers.normal(stddev=0.02 / (2 * cfg.n_layer) ** 0.5)
        return nn.Dense(d_model, kernel_init=proj_init, dtype=cfg.dtype, name="c_proj")(y.reshape(batch, seq, d_model))


class MLP(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x):
        d_model, dtype = self.config.d_model, self.config.dtype
        h = nn.gelu(nn.Dense(4 * d_model, kernel_init=_init, dtype=dtype, name="c_fc")(x), approximate=True)
        proj_init = nn.initializers.normal(stddev=0.02 / (2 * self.config.n_layer) ** 0.5)
        return nn.Dense(d_model, kernel_init=proj_init, dtype=dtype, name="c_proj")(h)


class Block(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x):
        dtype = self.config.dtype
        x = x + CausalSelfAttention(self.config, name="attn")(nn.LayerNorm(epsilon=1e-5, dtype=dtype, name="ln_1")(x))
        return x + MLP(self.config, name="mlp")(nn.LayerNorm(epsilon=1e-5, dtype=dtype, name="ln_2")(x))


class GPT(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.config
        check_attention(cfg.attention, cfg.dtype)
        wte = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=_init, dtype=cfg.dtype, name="wte")
        wpe = nn.Embed(cfg.block_size, cfg.d_model, embedding_init=nn.initializers.normal(stddev=0.01),
                       dtype=cfg.dtype, name="wpe")
        x = wte(tokens) + wpe(jnp.arange(tokens.shape[1]))[None]
        for i in range(cfg.n_layer):
            x = Block(cfg, name=f"h_{i}")(x)
        x = nn.LayerNorm(epsilon=1e-5, dtype=cfg.dtype, name="ln_f")(x)
        return wte.attend(x)   # weight tying: the LM head is the token embedding (in `dtype`)


def loss_fn(model: GPT, params, tokens, targets):
    """Mean next-token cross-entropy."""
    logits = model.apply({"params": params}, tokens).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def lr_schedule(max_lr: float = 6e-4, min_lr: float = 6e-5, warmup_steps: int = 0, total_steps: int = 1):
    """Linear warmup from 0 to `max_lr` over `warmup_steps`, then cosine decay to `min_lr` at `total_steps`."""
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"warmup_steps {warmup_steps} must be in [0, total_steps {total_steps})")
    return optax.warmup_cosine_decay_schedule(0.0, max_lr, warmup_steps, total_steps, end_value=min_lr)


def make_optimizer(learning_rate=6e-4, weight_decay: float = 0.1, clip_norm: float | None = None):
    """AdamW as in GPT-2/3 training (no decay on biases and LayerNorm scales), after clipping the
    gradients' global norm to `clip_norm` when given. `learning_rate` is a number or an optax
    schedule (`lr_schedule`); the schedule's step count lives in the optimizer state."""
    def decay_mask(params):
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    adamw = optax.adamw(learning_rate, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay, mask=decay_mask)
    return adamw if clip_norm is None else optax.chain(optax.clip_by_global_norm(clip_norm), adamw)


def make_train_step(model: GPT, optimizer):
    """One training step: loss, gradients and the AdamW update, as one function to compile."""
    def train_step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, tokens, targets))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def make_accumulation_steps(model: GPT, optimizer, micro_batches: int):
    """Gradient accumulation as two steps to compile: `grad_step(params, grad_sum, tokens, targets)
    -> (grad_sum + grads, loss)` once per micro-batch, then `update_step(params, opt_state, grad_sum)
    -> (params, opt_state)` with the mean gradient. Only one micro-batch's activations
    are alive at a time, which is what accumulation is for."""
    def grad_step(params, grad_sum, tokens, targets):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, tokens, targets))(params)
        return jax.tree.map(jnp.add, grad_sum, grads), loss

    def update_step(params, opt_state, grad_sum):
        grads = jax.tree.map(lambda g: g / micro_batches, grad_sum)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return grad_step, update_step


def init_params(model: GPT, key, seq_len: int):
    return model.init(key, jnp.zeros((1, seq_len), jnp.int32))["params"]


def generate(model: GPT, params, prompt: list[int], new_tokens: int, key, top_k: int = 50,
             temperature: float = 1.0, samples: int = 1, vocab: int = GPT2_VOCAB):
    """Sample `new_tokens` tokens after `prompt` (top-k sampling), `samples` sequences at once; returns
    [samples, len(prompt) + new_tokens] token ids. One forward shape throughout (a window of
    `len(prompt) + new_tokens` positions; the causal mask makes the unfilled positions irrelevant),
    so it compiles once. Ids at and past `vocab` (the padding rows of the embedding) are never drawn."""
    length = len(prompt) + new_tokens
    if not prompt or length > model.config.block_size:
        raise ValueError(f"prompt of {len(prompt)} tokens + {new_tokens} new: must be 1..{model.config.block_size}")
    top_k = min(top_k, vocab)

    @jax.jit
    def next_token(params, tokens, position, key):
        logits = model.apply({"params": params}, tokens)[:, position, :vocab].astype(jnp.float32) / temperature
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
        return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)

    tokens = jnp.zeros((samples, length), jnp.int32).at[:, :len(prompt)].set(jnp.asarray(prompt, jnp.int32))
    for position in range(len(prompt) - 1, length - 1):
        key, sub = jax.random.split(key)
        tokens = tokens.at[:, position + 1].set(next_token(params, tokens, position, sub))
    return np.asarray(tokens)
