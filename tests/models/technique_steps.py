"""Training steps of techniques users train with, for tests/test_user_models.py (registered in
user_steps.STEPS, whose docstring says what a `UserStep` holds).

- `grad_accum`: gradients accumulated over micro-batches by `lax.scan` and by `lax.fori_loop` with
  `dynamic_slice` (both run as XLA fallback ops); AdamW;
- `remat_policy`: `nn.remat` with `dots_with_no_batch_dims_saveable` and `nothing_saveable`,
  `jax.checkpoint(policy=checkpoint_dots)` around the model, a `jax.custom_vjp` straight-through
  rounding; Adafactor;
- `bf16_lm`: bf16 parameters and activations, the embedding table tied to the output projection, bf16
  AdamW moments (held to bf16's tolerance);
- `byol`: a student against an EMA teacher (`stop_gradient`, `optax.incremental_update`), cosine
  similarity, `optax.inject_hyperparams` (the learning rate in the optimizer state, returned);
- `fp8_ste`: fp8 fake quantization of inputs, weights and activations by a `custom_vjp` with a
  straight-through gradient (the fp8 conversions are fallbacks);
- `dp_sgd`: per-example gradients (`vmap` of `grad`), clipped, summed and noised; SGD;
- `wgan_gp`: a WGAN critic's gradient penalty (a gradient of a gradient); Adam;
- `fp16_loss_scale`: f16 activations, dynamic loss scaling, the update skipped where a gradient is
  not finite; SGD + momentum (held to f16's tolerance);
- `masked_labels`: labels of -1 masked out by `labels >= 0`, jax.nn's other activations, a norm
  penalty; AdamW.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from models.user_step import UserStep, _labels, _normal, _with_grads

BF16_RTOL = 2e-2   # two roundings to bf16 (2**-8 each) of a value or of its leaf's largest
F16_RTOL = 1e-2    # f16 products rounded (2**-11) over a few layers


# --------------------------------------------------------------------------- gradient accumulation
def grad_accum(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    micro, per, lr = 3, 4, 1e-3
    params = {"w1": _normal(rng, 8, 12, scale=0.3), "b1": jnp.zeros((12,)), "w2": _normal(rng, 12, 5, scale=0.3)}
    x, y = _normal(rng, micro * per, 8), _labels(rng, micro * per, 5)
    opt = optax.adamw(lr)

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"], y).mean()

    def step(params, opt_state, x, y):
        def accumulate(total, batch):
            return jax.tree.map(jnp.add, total, jax.value_and_grad(loss)(params, *batch)), None

        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
        (value, grads), _ = lax.scan(accumulate, zero, (x.reshape(micro, per, -1), y.reshape(micro, per)))
        value, grads = jax.tree.map(lambda t: t / micro, (value, grads))

        def add_micro_batch(i, total):
            batch = (lax.dynamic_slice_in_dim(x, i * per, per), lax.dynamic_slice_in_dim(y, i * per, per))
            return jax.tree.map(jnp.add, total, jax.grad(loss)(params, *batch))

        looped = lax.fori_loop(0, micro, add_micro_batch, jax.tree.map(jnp.zeros_like, params))
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads, jax.tree.map(lambda t: t / micro, looped)

    return UserStep(step, (params, opt.init(params), x, y), 2, adam_lr=lr, fallbacks=("scan",))


# --------------------------------------------------------------------------- remat policies, custom_vjp
@jax.custom_vjp
def straight_through_round(x):
    return jnp.round(x * 4) / 4


straight_through_round.defvjp(lambda x: (straight_through_round(x), None), lambda _, g: (g,))


class RematBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(24)(nn.LayerNorm()(x)))
        return x + nn.Dense(x.shape[-1])(straight_through_round(h))


class RematNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(12)(x)
        x = nn.remat(RematBlock, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)()(x)
        x = nn.remat(RematBlock, policy=jax.checkpoint_policies.nothing_saveable)()(x)
        return nn.Dense(4)(x)


def remat_policy(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    model, lr = RematNet(), 1e-3
    x, y = _normal(rng, 5, 9), _labels(rng, 5, 4)
    params = model.init(jax.random.key(seed), x)
    opt = optax.adafactor(lr)

    def loss(p, x, y):
        logits = jax.checkpoint(model.apply, policy=jax.checkpoint_policies.checkpoint_dots)(p, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), x, y), 2, adam_lr=lr)


# --------------------------------------------------------------------------- bf16 parameters, tied embedding
class Bf16LM(nn.Module):
    vocab: int = 31
    d: int = 16

    @nn.compact
    def __call__(self, ids):
        bf16 = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        embed = nn.Embed(self.vocab, self.d, **bf16)
        x = embed(ids)
        x = x + nn.Dense(self.d, **bf16)(nn.gelu(nn.Dense(32, **bf16)(nn.LayerNorm(**bf16)(x))))
        return embed.attend(x).astype(jnp.float32)


def bf16_lm(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    model, lr = Bf16LM(), 1e-2
    ids = jnp.asarray(rng.integers(0, model.vocab, (2, 8)), jnp.int32)
    params = model.init(jax.random.key(seed), ids)
    opt = optax.adamw(lr, mu_dtype=jnp.bfloat16)

    def loss(p, ids):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, ids[:, :-1]), ids[:, 1:]).mean()

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), ids), 2, adam_lr=lr,
                    rtol=BF16_RTOL, scale_atol=BF16_RTOL)


# --------------------------------------------------------------------------- EMA teacher
class SmallNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(6)(nn.gelu(nn.Dense(14)(x)))


def byol(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    model, lr = SmallNet(), 1e-3
    x, noise = _normal(rng, 5, 7), _normal(rng, 5, 7, scale=0.1)
    params = model.init(jax.random.key(seed), x)
    opt = optax.inject_hyperparams(optax.adamw)(learning_rate=optax.cosine_decay_schedule(lr, 10), weight_decay=1e-2)

    def step(params, teacher, opt_state, x, noise):
        def loss(p):
            target = lax.stop_gradient(model.apply(teacher, x - noise))
            return 2 - 2 * optax.cosine_similarity(model.apply(p, x + noise), target).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        teacher = optax.incremental_update(params, teacher, 0.01)
        return params, teacher, opt_state, value, grads, opt_state.hyperparams["learning_rate"]

    teacher = jax.tree.map(lambda p: p * 0.9, params)
    # the loss 2 - 2 cos(s, t) cancels where cos is near 1: it rounds at the scale of its terms (2), eight
    # f32 ulps (2**-23) of the cosine, whatever its own size
    return UserStep(step, (params, teacher, opt.init(params), x, noise), 3, adam_lr=lr, atol={3: 2.0 * 2.0**-20})


# --------------------------------------------------------------------------- fp8 fake quantization
@jax.custom_vjp
def fp8_fake_quant(x):
    return x.astype(jnp.float8_e4m3fn).astype(x.dtype)


fp8_fake_quant.defvjp(lambda x: (fp8_fake_quant(x), None), lambda _, g: (g,))


def fp8_ste(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    params = {"w1": _normal(rng, 9, 12, scale=0.3), "w2": _normal(rng, 12, 4, scale=0.3)}
    x, y = _normal(rng, 6, 9), _labels(rng, 6, 4)
    opt = optax.sgd(0.1)

    def loss(p, x, y):
        h = jax.nn.relu(fp8_fake_quant(x) @ fp8_fake_quant(p["w1"]))
        return optax.softmax_cross_entropy_with_integer_labels(fp8_fake_quant(h) @ p["w2"], y).mean()

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), x, y), 2, fallbacks=("convert_element_type",))


# --------------------------------------------------------------------------- DP-SGD
def dp_sgd(seed: int) -> UserStep:
    """Per-example gradients by `jax.vmap(jax.grad)`, each clipped to norm 1, summed, noised from keys."""
    rng = np.random.default_rng(seed)
    params = {"w1": _normal(rng, 6, 10, scale=0.4), "b1": jnp.zeros((10,)), "w2": _normal(rng, 10, 3, scale=0.4)}
    x, y = _normal(rng, 7, 6), _labels(rng, 7, 3)
    opt = optax.sgd(0.1)

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"], y).mean()

    def step(params, opt_state, key, x, y):
        key, noise_key = jax.random.split(key)
        per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, x[:, None], y[:, None])
        norms = jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, 1) for g in jax.tree.leaves(per_example)))
        factor = jnp.minimum(1.0, 1.0 / (norms + 1e-6))
        clipped = jax.tree.map(lambda g: (g * factor.reshape((-1,) + (1,) * (g.ndim - 1))).sum(0), per_example)
        leaves, tree = jax.tree.flatten(clipped)
        keys = jax.random.split(noise_key, len(leaves))
        noised = tree.unflatten([(g + 0.1 * jax.random.normal(k, g.shape)) / x.shape[0] for g, k in zip(leaves, keys)])
        updates, opt_state = opt.update(noised, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key, norms, noised

    return UserStep(step, (params, opt.init(params), jax.random.key(seed), x, y), 3,
                    fallbacks=("random_split", "slice", "squeeze", "random_bits"))


# --------------------------------------------------------------------------- gradient penalty
def wgan_gp(seed: int) -> UserStep:
    """A WGAN critic's step with the gradient penalty: the gradient of a gradient's norm."""
    rng = np.random.default_rng(seed)
    lr = 1e-3
    params = {"w1": _normal(rng, 5, 12, scale=0.4), "b1": jnp.zeros((12,)), "w2": _normal(rng, 12, 1, scale=0.4)}
    real, fake = _normal(rng, 6, 5), _normal(rng, 6, 5)
    mix = jnp.asarray(rng.random((6, 1)), jnp.float32)
    opt = optax.adam(lr, b1=0.5, b2=0.9)

    def critic(p, x):
        return (jax.nn.leaky_relu(x @ p["w1"] + p["b1"], 0.2) @ p["w2"])[..., 0]

    def loss(p, real, fake, mix):
        between = mix * real + (1 - mix) * fake
        g = jax.grad(lambda z: critic(p, z).sum())(between)
        penalty = ((jnp.sqrt((g**2).sum(-1) + 1e-12) - 1) ** 2).mean()
        return critic(p, fake).mean() - critic(p, real).mean() + 10 * penalty

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), real, fake, mix), 2, adam_lr=lr)


# --------------------------------------------------------------------------- f16 with dynamic loss scaling
def fp16_loss_scale(seed: int) -> UserStep:
    """f16 activations, the loss scaled and the gradients unscaled, the update skipped (`jnp.where` over
    the parameters and the optimizer state) and the scale halved where a gradient is not finite."""
    rng = np.random.default_rng(seed)
    params = {"w1": _normal(rng, 8, 16, scale=0.3), "w2": _normal(rng, 16, 4, scale=0.3)}
    x, y = _normal(rng, 5, 8), _labels(rng, 5, 4)
    opt = optax.sgd(0.05, momentum=0.9)

    def loss(p, x, y, scale):
        h = jax.nn.gelu(x.astype(jnp.float16) @ p["w1"].astype(jnp.float16))
        logits = (h @ p["w2"].astype(jnp.float16)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * scale

    def step(params, opt_state, scale, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y, scale)
        grads = jax.tree.map(lambda g: g / scale, grads)
        finite = jnp.all(jnp.array([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
        updates, new_state = opt.update(grads, opt_state, params)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)   # noqa: E731
        params, opt_state = keep(optax.apply_updates(params, updates), params), keep(new_state, opt_state)
        return params, opt_state, jnp.where(finite, scale * 2, scale / 2), value / scale, grads

    return UserStep(step, (params, opt.init(params), jnp.float32(2.0**10), x, y), 3, rtol=F16_RTOL, scale_atol=F16_RTOL)


# --------------------------------------------------------------------------- masked labels, activations
def masked_labels(seed: int) -> UserStep:
    """Labels of -1 masked out by `labels >= 0` (one-hot rows of zeros, the mean over the rows kept),
    jax.nn's other activations, a squared-norm penalty by `optax.tree.norm`."""
    rng = np.random.default_rng(seed)
    lr = 1e-3
    params = {"w": _normal(rng, 6, 24, scale=0.5), "head": _normal(rng, 12, 5, scale=0.4)}
    x = _normal(rng, 8, 6)
    y = jnp.asarray(np.where(rng.random(8) < 0.3, -1, rng.integers(0, 5, 8)), jnp.int32)
    opt = optax.adamw(lr)

    def loss(p, x, y):
        a, b, c, d = jnp.split(x @ p["w"], 4, -1)
        h = jnp.concatenate([jax.nn.elu(a) + jax.nn.selu(b), jax.nn.softplus(c) * jax.nn.mish(d)], -1)
        h = jax.nn.glu(jnp.concatenate([h, jax.nn.hard_tanh(h)], -1)) + jax.nn.celu(h) + jax.nn.log_sigmoid(h)
        rows = -(jax.nn.one_hot(y, 5) * jax.nn.log_softmax(h @ p["head"])).sum(-1)
        kept = y >= 0
        return jnp.sum(rows * kept) / jnp.maximum(kept.sum(), 1) + 1e-3 * optax.tree.norm(p, squared=True)

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), x, y), 2, adam_lr=lr)


TECHNIQUE_STEPS = {
    "grad_accum": grad_accum, "remat_policy": remat_policy, "bf16_lm": bf16_lm, "byol": byol, "fp8_ste": fp8_ste,
    "dp_sgd": dp_sgd, "wgan_gp": wgan_gp, "fp16_loss_scale": fp16_loss_scale, "masked_labels": masked_labels,
}
