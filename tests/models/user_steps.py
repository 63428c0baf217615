"""Training steps as JAX / Flax / optax users write them, for tests/test_user_models.py.

Each builder takes a seed and returns a `UserStep`: the step, its arguments, how many of its leading
results are state fed back into the next step, and what the step's optimizer does to the parameters
(`adam_lr`: Adam-style updates move a parameter whose gradient is at the rounding floor by up to
+-lr with a sign rounding decides, so such steps hold their parameters to 2 lr; the gradients and the
optimizer's moments, which every step returns or carries, are held to f32 tolerance). Every step
returns its gradients, so a comparison tells the backward pass from the update.

- `vit`: patches by reshape, learned positional embedding, pre-LN blocks of
  `nn.MultiHeadDotProductAttention` and a GELU MLP, mean pooling, classification head; SGD + momentum
  (`dtype=jnp.bfloat16`: Flax's bf16 compute over f32 parameters);
- `convnet`: uint8 images, `nn.Conv`, `nn.BatchNorm` in training mode (mutable batch_stats), max and
  average pooling; SGD + momentum (the convolutions and poolings run as XLA fallback ops);
- `lstm`: `nn.OptimizedLSTMCell` under `nn.scan`, Adam (the scan runs as a fallback op);
- `llama`: RMSNorm, RoPE, SwiGLU, grouped-query attention by `jnp.repeat` into
  `jax.nn.dot_product_attention` with a causal and padding mask, `nn.remat` blocks, the embedding
  tied to the LM head, a padding-masked loss; `clip_by_global_norm` + AdamW on a warmup-cosine schedule;
- `moe`: top-2 routing with `jax.lax.top_k`, expert weights gathered per token, a load-balancing term
  by scatter-add, the label's log-probability by `jnp.take_along_axis`; AdamW;
- `dropout_mlp`: odd widths (23, 37, 1000, 13), `nn.Dropout` from a PRNG key the step splits, label
  smoothing; AdamW on a linear schedule;
- `control_flow`: batch 1, `lax.cond` and `lax.fori_loop` in the loss, a `lax.while_loop` on the
  gradients, a None leaf in the parameters, a static argument, `optax.MultiSteps`;
- `train_state`: flax's `TrainState.apply_gradients`, its Python-int step count and a learning rate
  computed from it returned as metrics (weakly typed, as jax.jit returns them);
- `int8_features`: uint8 token ids and int8 features, a 1000-way head, batch 1;

and the steps of architecture_steps.py (normalization layers, a T5 encoder, an MLP-Mixer, a VAE, a
graph network, CLIP, transposed convolutions, FNet, Switch routing, a linear recurrence, a Gaussian
process) and technique_steps.py (gradient accumulation, remat policies and custom_vjp, bf16
parameters, an EMA teacher, fp8 fake quantization, DP-SGD, a gradient penalty, f16 loss scaling,
masked labels).
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax import lax

from models.architecture_steps import ARCHITECTURE_STEPS
from models.technique_steps import TECHNIQUE_STEPS
from models.user_step import UserStep, _normal, _with_grads


# --------------------------------------------------------------------------- ViT
class ViTBlock(nn.Module):
    heads: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(dtype=self.dtype)(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype)(h, h)
        h = nn.Dense(2 * x.shape[-1], dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
        return x + nn.Dense(x.shape[-1], dtype=self.dtype)(nn.gelu(h))


class ViT(nn.Module):
    d: int = 24
    patch: int = 4
    classes: int = 10
    layers: int = 1
    dtype: Any = jnp.float32   # Flax's compute dtype (bf16: f32 parameters cast where they are used)

    @nn.compact
    def __call__(self, img):
        b, hh, ww, c = img.shape
        p = self.patch
        x = img.reshape(b, hh // p, p, ww // p, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, p * p * c)
        x = nn.Dense(self.d, dtype=self.dtype)(x)
        x = x + self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], self.d)).astype(self.dtype)
        for _ in range(self.layers):
            x = ViTBlock(heads=3, dtype=self.dtype)(x)
        logits = nn.Dense(self.classes, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x).mean(axis=1))
        return logits.astype(jnp.float32)


def vit(seed: int, dtype=jnp.float32) -> UserStep:
    rng = np.random.default_rng(seed)
    model, opt = ViT(dtype=dtype), optax.sgd(0.05, momentum=0.9)
    x, y = _normal(rng, 2, 12, 12, 3), jnp.asarray(rng.integers(0, 10, (2,)), jnp.int32)
    params = model.init(jax.random.key(seed), x)

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), x, y), 2)


# --------------------------------------------------------------------------- ConvNet with BatchNorm
class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = x.astype(jnp.float32) / 255.0
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Conv(6, (3, 3))(x)))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.Conv(8, (3, 3), padding="VALID")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def convnet(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    model, opt = ConvNet(), optax.sgd(0.05, momentum=0.9)
    x = jnp.asarray(rng.integers(0, 256, (4, 14, 14, 1)), jnp.uint8)
    y = jnp.asarray(rng.integers(0, 10, (4,)), jnp.int32)
    variables = model.init(jax.random.key(seed), x, train=False)

    def step(params, stats, opt_state, x, y):
        def loss(p):
            logits, new = model.apply({"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
            return optax.softmax_cross_entropy(logits, jax.nn.one_hot(y, 10)).mean(), new["batch_stats"]

        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, value, grads

    params = variables["params"]
    return UserStep(step, (params, variables["batch_stats"], opt.init(params), x, y), 3,
                    fallbacks=("conv_general_dilated", "reduce_window_max", "reduce_window_sum",
                               "select_and_scatter_add"))


# --------------------------------------------------------------------------- LSTM under nn.scan
class LSTMClassifier(nn.Module):
    hidden: int = 12

    @nn.compact
    def __call__(self, x):
        cell = nn.scan(nn.OptimizedLSTMCell, variable_broadcast="params", split_rngs={"params": False},
                       in_axes=1, out_axes=1)(self.hidden)
        carry = (jnp.zeros((x.shape[0], self.hidden)), jnp.zeros((x.shape[0], self.hidden)))
        _, ys = cell(carry, x)
        return nn.Dense(3)(ys[:, -1])


def lstm(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    model, lr = LSTMClassifier(), 1e-2
    opt = optax.adam(lr)
    x, y = _normal(rng, 3, 7, 5), jnp.asarray(rng.integers(0, 3, (3,)), jnp.int32)
    params = model.init(jax.random.key(seed), x)

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), x, y), 2, adam_lr=lr, fallbacks=("scan",))


# --------------------------------------------------------------------------- Llama-style decoder
class LlamaBlock(nn.Module):
    heads: int = 4
    kv_heads: int = 2

    @nn.compact
    def __call__(self, x, mask):
        b, t, d = x.shape
        hd = d // self.heads
        y = nn.RMSNorm()(x)
        q = nn.Dense(d, use_bias=False)(y).reshape(b, t, self.heads, hd)
        k = nn.Dense(self.kv_heads * hd, use_bias=False)(y).reshape(b, t, self.kv_heads, hd)
        v = nn.Dense(self.kv_heads * hd, use_bias=False)(y).reshape(b, t, self.kv_heads, hd)
        angles = jnp.arange(t)[:, None] / 10000 ** (jnp.arange(0, hd, 2) / hd)[None]
        cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]

        def rotate(z):
            z1, z2 = z[..., ::2], z[..., 1::2]
            return jnp.stack([z1 * cos - z2 * sin, z1 * sin + z2 * cos], -1).reshape(z.shape)

        q, k = rotate(q), rotate(k)
        k, v = (jnp.repeat(z, self.heads // self.kv_heads, axis=2) for z in (k, v))
        a = jax.nn.dot_product_attention(q, k, v, mask=mask).reshape(b, t, d)
        x = x + nn.Dense(d, use_bias=False)(a)
        y = nn.RMSNorm()(x)
        gate, up = nn.Dense(40, use_bias=False)(y), nn.Dense(40, use_bias=False)(y)
        return x + nn.Dense(d, use_bias=False)(nn.silu(gate) * up)


class Llama(nn.Module):
    vocab: int = 37
    d: int = 24
    layers: int = 1

    @nn.compact
    def __call__(self, ids, valid):
        embed = nn.Embed(self.vocab, self.d)
        x, t = embed(ids), ids.shape[1]
        mask = jnp.tril(jnp.ones((t, t), bool))[None, None] & valid[:, None, None, :]
        for _ in range(self.layers):
            x = nn.remat(LlamaBlock)()(x, mask)
        return embed.attend(nn.RMSNorm()(x))


def llama(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    model, lr = Llama(), 1e-3
    ids = jnp.asarray(rng.integers(0, model.vocab, (2, 9)), jnp.int32)
    valid = jnp.asarray(np.arange(9)[None] < np.array([[9], [6]]))
    params = model.init(jax.random.key(seed), ids[:, :-1], valid[:, :-1])
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(optax.warmup_cosine_decay_schedule(lr / 10, lr, 2, 10), weight_decay=0.1))

    def loss(p, ids, valid):
        logits = model.apply(p, ids[:, :-1], valid[:, :-1])
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])
        weight = valid[:, 1:].astype(jnp.float32)
        return (per_token * weight).sum() / weight.sum()

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), ids, valid), 2, adam_lr=lr)


# --------------------------------------------------------------------------- mixture of experts
def moe(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    d, experts, hidden, tokens, lr = 12, 4, 20, 15, 1e-3
    params = {"router": _normal(rng, d, experts, scale=0.3), "w1": _normal(rng, experts, d, hidden, scale=0.3),
              "w2": _normal(rng, experts, hidden, d, scale=0.3), "head": _normal(rng, d, 5, scale=0.3)}
    x, y = _normal(rng, tokens, d), jnp.asarray(rng.integers(0, 5, (tokens,)), jnp.int32)
    opt = optax.adamw(lr)

    def loss(p, x, y):
        probs = jax.nn.softmax(x @ p["router"], -1)
        weight, expert = lax.top_k(probs, 2)
        weight = weight / weight.sum(-1, keepdims=True)
        h = jax.nn.gelu(jnp.einsum("nd,nkdh->nkh", x, p["w1"][expert]))
        out = (jnp.einsum("nkh,nkhd->nkd", h, p["w2"][expert]) * weight[..., None]).sum(1)
        load = jnp.zeros((experts,)).at[expert.reshape(-1)].add(1.0)
        balance = (load / load.sum() * probs.mean(0)).sum() * experts
        log_probs = jax.nn.log_softmax((x + out) @ p["head"])
        return -jnp.take_along_axis(log_probs, y[:, None], axis=1).mean() + 0.01 * balance

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), x, y), 2, adam_lr=lr, fallbacks=("top_k",))


# --------------------------------------------------------------------------- dropout, label smoothing
class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dropout(0.3, deterministic=not train)(nn.relu(nn.Dense(37)(x)))
        x = nn.Dropout(0.1, deterministic=not train)(jnp.tanh(nn.Dense(1000)(x)))
        return nn.Dense(13)(x)


def dropout_mlp(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    model, lr = DropoutMLP(), 1e-3
    x, y = _normal(rng, 5, 23), jnp.asarray(rng.integers(0, 13, (5,)), jnp.int32)
    params = model.init(jax.random.key(seed), x, False)
    opt = optax.adamw(optax.linear_schedule(lr, lr / 10, 5), weight_decay=0.01)

    def step(params, opt_state, key, x, y):
        key, dropout_key = jax.random.split(key)

        def loss(p):
            logits = model.apply(p, x, True, rngs={"dropout": dropout_key})
            return optax.softmax_cross_entropy(logits, optax.smooth_labels(jax.nn.one_hot(y, 13), 0.1)).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key, value, grads

    return UserStep(step, (params, opt.init(params), jax.random.key(seed), x, y), 3, adam_lr=lr,
                    fallbacks=("random_split", "slice", "squeeze", "random_fold_in", "random_bits"))


# --------------------------------------------------------------------------- control flow and odd pytrees
def control_flow(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    params = {"w": _normal(rng, 6, 4), "b": jnp.zeros((4,)), "unused": None}
    x, y = _normal(rng, 1, 6), _normal(rng, 1, 4)
    opt = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)

    def step(params, opt_state, x, y, power):
        def loss(p):
            h = x @ p["w"] + p["b"]
            h = lax.cond(h.sum() > 0, jnp.tanh, lambda z: z * 0.5, h)
            h = lax.fori_loop(0, 3, lambda i, z: z * 0.9 + 0.01 * i, h)
            return jnp.mean(jnp.abs(h - y) ** power)

        value, grads = jax.value_and_grad(loss)(params)
        grads = lax.while_loop(lambda g: optax.tree.norm(g) > 1.0, lambda g: jax.tree.map(lambda t: t / 2, g), grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads

    return UserStep(step, (params, opt.init(params), x, y, 3), 2, options={"static_argnums": (4,)},
                    fallbacks=("cond", "scan", "while"))


def train_state_metrics(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.relu(nn.Dense(16)(x)))

    model, lr = MLP(), 1e-3
    x, y = _normal(rng, 4, 5), jnp.asarray(rng.integers(0, 3, (4,)), jnp.int32)
    state = train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(seed), x),
                                          tx=optax.adamw(lr))

    def step(state, x, y):
        def loss(p):
            return optax.softmax_cross_entropy_with_integer_labels(state.apply_fn(p, x), y).mean()

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), {"loss": value, "step": state.step, "lr": lr * state.step}, grads

    return UserStep(step, (state, x, y), 1, adam_lr=lr)


def int8_features(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    params = {"embed": _normal(rng, 256, 19, scale=0.1), "scale": jnp.ones((19,)), "w": _normal(rng, 19, 1000, scale=0.1)}
    tokens = jnp.asarray(rng.integers(0, 256, (1, 37)), jnp.uint8)
    features = jnp.asarray(rng.integers(-128, 128, (1, 19)), jnp.int8)
    y = jnp.asarray(rng.integers(0, 1000, (1,)), jnp.int32)
    opt, lr = optax.adamw(1e-3), 1e-3

    def loss(p, tokens, features, y):
        h = p["embed"][tokens.astype(jnp.int32)].mean(1) * p["scale"] + features.astype(jnp.float32) / 128
        return optax.softmax_cross_entropy_with_integer_labels(jax.nn.relu(h) @ p["w"], y).mean()

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), tokens, features, y), 2, adam_lr=lr)


STEPS: dict[str, Callable[[int], UserStep]] = {
    "vit": vit, "convnet": convnet, "lstm": lstm, "llama": llama, "moe": moe, "dropout_mlp": dropout_mlp,
    "control_flow": control_flow, "train_state": train_state_metrics, "int8_features": int8_features,
    **ARCHITECTURE_STEPS, **TECHNIQUE_STEPS,
}
