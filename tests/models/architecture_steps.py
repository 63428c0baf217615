"""Training steps of architectures users train, for tests/test_user_models.py (registered in
user_steps.STEPS, whose docstring says what a `UserStep` holds).

- `norms`: `nn.BatchNorm` (mutable batch_stats) in an MLP whose every op jnova compiles, `nn.GroupNorm`,
  `nn.SpectralNorm` (its power iteration's vectors also in batch_stats), `nn.WeightNorm`; LAMB;
- `t5_encoder`: T5's bucketed relative position bias and a padding mask, one layer with attention
  written out (`jnp.where` on the scores), one through `jax.nn.dot_product_attention(bias=, mask=)`
  with `nn.DenseGeneral` projections, RMS norms; Adafactor;
- `mlp_mixer`: token mixing by `swapaxes` around `nn.Dense`, `optax.smooth_labels`; Nesterov SGD;
- `vae`: the reparameterization trick from a PRNG key the step splits, a Bernoulli likelihood
  (`sigmoid_binary_cross_entropy`) and the Gaussian KL; Lion;
- `gnn`: message passing by gathers and `jax.ops.segment_sum` over an edge list, degree
  normalization, `segment_max` and mean pooling with an empty graph masked out; Nesterov SGD;
- `clip`: two towers, L2-normalized embeddings, a learnable log-temperature, the symmetric contrastive
  loss by `logsumexp` over both axes and `jnp.diagonal`; `clip_by_global_norm`,
  `add_decayed_weights` masked to matrices, Adam's scaling;
- `conv_transpose`: a decoder of `nn.ConvTranspose` (strided, and SAME-padded), MSE loss (the
  convolutions run as XLA fallback ops); SGD;
- `fnet`: FNet's Fourier token mixing (complex values: the FFTs and complex arithmetic are fallbacks);
- `switch_moe`: Switch-Transformer top-1 routing, each token's slot by `cumsum` of one-hots, a capacity
  limit, dispatch and combine by einsums, the load-balancing loss; AdamW;
- `linear_rnn`: a diagonal linear recurrence by `lax.associative_scan`; AdamW;
- `gp_regression`: a Gaussian process's marginal likelihood (Cholesky and triangular solves run as
  XLA fallback ops); Adam.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from models.user_step import UserStep, _labels, _normal, _with_grads


# --------------------------------------------------------------------------- normalization layers
class NormsNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.8)(nn.Dense(12)(x)))
        x = nn.swish(nn.GroupNorm(num_groups=3)(x.reshape(x.shape[0], 2, 6)))     # groups over (2, 6)
        x = nn.SpectralNorm(nn.Dense(10))(x.reshape(x.shape[0], -1), update_stats=train)
        x = nn.WeightNorm(nn.Dense(16))(x)
        return nn.Dense(3)(nn.GroupNorm(num_groups=2, use_bias=False)(x))   # (groups of 2 are ill-conditioned)


def norms(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    model, lr = NormsNet(), 1e-3
    x, y = _normal(rng, 6, 5), _labels(rng, 6, 3)
    variables = model.init(jax.random.key(seed), x, train=False)
    opt = optax.lamb(lr)

    def step(params, stats, opt_state, x, y):
        def loss(p):
            logits, new = model.apply({"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new["batch_stats"]

        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, value, grads

    params = variables["params"]
    return UserStep(step, (params, variables["batch_stats"], opt.init(params), x, y), 3, adam_lr=lr)


# --------------------------------------------------------------------------- T5 encoder
def relative_bucket(relative, buckets=8, max_distance=16):
    """T5's bidirectional relative-position buckets: exact for small distances, logarithmic beyond."""
    half = buckets // 2
    exact = half // 2
    distance = jnp.abs(relative)
    far = exact + (jnp.log(jnp.maximum(distance, 1) / exact) / np.log(max_distance / exact)
                   * (half - exact)).astype(jnp.int32)
    return (relative > 0).astype(jnp.int32) * half + jnp.where(distance < exact, distance, jnp.minimum(far, half - 1))


class T5LayerNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


class T5Encoder(nn.Module):
    vocab: int = 29
    d: int = 16
    heads: int = 2

    @nn.compact
    def __call__(self, ids, valid):
        b, t = ids.shape
        x = nn.Embed(self.vocab, self.d)(ids)
        pos = jnp.arange(t)
        bias = nn.Embed(8, self.heads)(relative_bucket(pos[None, :] - pos[:, None])).transpose(2, 0, 1)[None]
        mask = valid[:, None, None, :]
        # attention written out: scores [b, h, q, k]
        y = T5LayerNorm()(x)
        q, k, v = (nn.Dense(self.d, use_bias=False)(y).reshape(b, t, self.heads, -1) for _ in range(3))
        scores = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias, jnp.finfo(jnp.float32).min)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(b, t, self.d)
        x = x + nn.Dense(self.d, use_bias=False)(a)
        x = x + nn.Dense(self.d, use_bias=False)(nn.relu(nn.Dense(32, use_bias=False)(T5LayerNorm()(x))))
        # the same through jax.nn.dot_product_attention, the bias shared
        y = T5LayerNorm()(x)
        q, k, v = (nn.DenseGeneral((self.heads, self.d // self.heads), use_bias=False)(y) for _ in range(3))
        a = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask)
        x = T5LayerNorm()(x + nn.DenseGeneral(self.d, axis=(-2, -1), use_bias=False)(a))
        pooled = (x * valid[..., None]).sum(1) / valid.sum(1, keepdims=True)
        return nn.Dense(3)(pooled)


def t5_encoder(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    model, lr = T5Encoder(), 1e-2
    ids = jnp.asarray(rng.integers(0, model.vocab, (2, 10)), jnp.int32)
    valid = jnp.asarray(np.arange(10)[None] < np.array([[10], [7]]))
    y = _labels(rng, 2, 3)
    params = model.init(jax.random.key(seed), ids, valid)
    opt = optax.adafactor(lr)

    def loss(p, ids, valid, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, ids, valid), y).mean()

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), ids, valid, y), 2, adam_lr=lr)


# --------------------------------------------------------------------------- MLP-Mixer
class MixerBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x).swapaxes(1, 2)                                   # mix tokens
        x = x + nn.Dense(x.shape[1])(nn.gelu(nn.Dense(10)(y))).swapaxes(1, 2)
        return x + nn.Dense(x.shape[2])(nn.gelu(nn.Dense(20)(nn.LayerNorm()(x))))   # mix channels


class Mixer(nn.Module):
    @nn.compact
    def __call__(self, img):
        b = img.shape[0]
        patches = img.reshape(b, 4, 2, 4, 2, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, 16, 12)
        x = MixerBlock()(nn.Dense(12)(patches))
        return nn.Dense(4)(nn.LayerNorm()(x).mean(1))


def mlp_mixer(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    model = Mixer()
    x, y = _normal(rng, 2, 8, 8, 3), _labels(rng, 2, 4)
    params = model.init(jax.random.key(seed), x)
    opt = optax.sgd(0.05, momentum=0.9, nesterov=True)

    def loss(p, x, y):
        return optax.softmax_cross_entropy(model.apply(p, x), optax.smooth_labels(jax.nn.one_hot(y, 4), 0.2)).mean()

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), x, y), 2)


# --------------------------------------------------------------------------- VAE
class VAE(nn.Module):
    latent: int = 4

    @nn.compact
    def __call__(self, x, key):
        h = nn.relu(nn.Dense(16)(x))
        mean, logvar = nn.Dense(self.latent)(h), nn.Dense(self.latent)(h)
        z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape)
        return nn.Dense(x.shape[-1])(nn.relu(nn.Dense(16)(z))), mean, logvar


def vae(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    model, lr = VAE(), 1e-3
    x = jnp.asarray(rng.random((6, 10)) > 0.5, jnp.float32)
    params = model.init(jax.random.key(seed), x, jax.random.key(0))
    opt = optax.lion(lr)

    def step(params, opt_state, key, x):
        key, sample_key = jax.random.split(key)

        def loss(p):
            logits, mean, logvar = model.apply(p, x, sample_key)
            kl = -0.5 * jnp.sum(1 + logvar - mean**2 - jnp.exp(logvar), -1)
            return (optax.sigmoid_binary_cross_entropy(logits, x).sum(-1) + kl).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key, value, grads

    return UserStep(step, (params, opt.init(params), jax.random.key(seed), x), 3, adam_lr=lr,
                    fallbacks=("random_split", "slice", "squeeze", "random_bits"))


# --------------------------------------------------------------------------- graph network
def gnn(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    nodes, edges, d, graphs = 9, 20, 6, 3           # the third graph has no nodes
    params = {"w_msg": _normal(rng, d, d, scale=0.4), "w_self": _normal(rng, d, d, scale=0.4),
              "w2": _normal(rng, d, d, scale=0.4), "b": jnp.zeros((d,)), "head": _normal(rng, d, 3, scale=0.4)}
    x = _normal(rng, nodes, d)
    senders, receivers = (jnp.asarray(rng.integers(0, nodes, (edges,)), jnp.int32) for _ in range(2))
    graph_of = jnp.asarray(np.repeat([0, 1], [5, 4]), jnp.int32)
    y = _labels(rng, graphs, 3)
    opt = optax.sgd(0.05, momentum=0.9, nesterov=True)

    def loss(p, x, senders, receivers, graph_of, y):
        degree = jax.ops.segment_sum(jnp.ones((edges,)), receivers, nodes)
        h = x
        for w in ("w_msg", "w2"):
            messages = jax.ops.segment_sum(h[senders] @ p[w], receivers, num_segments=nodes)
            h = jax.nn.relu(messages / jnp.maximum(degree, 1)[:, None] + h @ p["w_self"] + p["b"])
        top = jax.ops.segment_max(h, graph_of, num_segments=graphs)          # -inf for the empty graph
        count = jax.ops.segment_sum(jnp.ones((nodes,)), graph_of, graphs)
        mean = jax.ops.segment_sum(h, graph_of, graphs) / jnp.maximum(count, 1)[:, None]
        pooled = jnp.where(jnp.isfinite(top), top, 0.0) + mean
        return optax.softmax_cross_entropy_with_integer_labels(pooled @ p["head"], y).mean()

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), x, senders, receivers, graph_of, y), 2)


# --------------------------------------------------------------------------- CLIP
def clip(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    lr = 1e-3
    params = {"img": {"w1": _normal(rng, 10, 16, scale=0.3), "w2": _normal(rng, 16, 8, scale=0.3)},
              "txt": {"w1": _normal(rng, 7, 16, scale=0.3), "w2": _normal(rng, 16, 8, scale=0.3)},
              "log_temp": jnp.asarray(np.log(1 / 0.07), jnp.float32)}
    images, texts = _normal(rng, 6, 10), _normal(rng, 6, 7)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.add_decayed_weights(1e-2, mask=jax.tree.map(lambda p: p.ndim > 1, params)),
                      optax.scale_by_adam(), optax.scale(-lr))

    def tower(p, x):
        e = jnp.tanh(x @ p["w1"]) @ p["w2"]
        return e / jnp.linalg.norm(e, axis=-1, keepdims=True)

    def loss(p, images, texts):
        logits = tower(p["img"], images) @ tower(p["txt"], texts).T * jnp.exp(p["log_temp"])
        diag = jnp.diagonal(logits)
        return ((jax.nn.logsumexp(logits, 0) - diag).mean() + (jax.nn.logsumexp(logits, 1) - diag).mean()) / 2

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), images, texts), 2, adam_lr=lr)


# --------------------------------------------------------------------------- transposed convolutions
class Decoder(nn.Module):
    @nn.compact
    def __call__(self, z):
        x = nn.Dense(4 * 4 * 3)(z).reshape(z.shape[0], 4, 4, 3)
        x = nn.relu(nn.ConvTranspose(4, (3, 3), strides=(2, 2))(x))
        return nn.ConvTranspose(1, (3, 3), padding="SAME")(x)


def conv_transpose(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    model = Decoder()
    z, target = _normal(rng, 2, 5), _normal(rng, 2, 8, 8, 1)
    params = model.init(jax.random.key(seed), z)
    opt = optax.sgd(0.01)

    def loss(p, z, target):
        return jnp.mean((model.apply(p, z) - target) ** 2)

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), z, target), 2,
                    fallbacks=("conv_general_dilated",))


# --------------------------------------------------------------------------- FNet
def fnet(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    params = {"w_in": _normal(rng, 5, 8, scale=0.4), "w1": _normal(rng, 8, 16, scale=0.3),
              "w2": _normal(rng, 16, 8, scale=0.3), "head": _normal(rng, 8, 3, scale=0.3)}
    x, y = _normal(rng, 2, 6, 5), _labels(rng, 2, 3)
    opt = optax.sgd(0.05, momentum=0.9, nesterov=True)

    def loss(p, x, y):
        h = x @ p["w_in"]
        h = h + jnp.fft.fft(jnp.fft.fft(h, axis=-1), axis=-2).real / np.sqrt(h.shape[1] * h.shape[2])
        h = h + jax.nn.gelu(h @ p["w1"]) @ p["w2"]
        return optax.softmax_cross_entropy_with_integer_labels(h.mean(1) @ p["head"], y).mean()

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), x, y), 2,
                    fallbacks=("complex", "convert_element_type", "fft", "real", "transpose"))


# --------------------------------------------------------------------------- Switch-Transformer routing
def switch_moe(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    d, experts, hidden, tokens, capacity, lr = 8, 3, 12, 10, 4, 1e-3
    params = {"router": _normal(rng, d, experts, scale=0.5), "w1": _normal(rng, experts, d, hidden, scale=0.3),
              "w2": _normal(rng, experts, hidden, d, scale=0.3), "head": _normal(rng, d, 4, scale=0.3)}
    x, y = _normal(rng, tokens, d), _labels(rng, tokens, 4)
    opt = optax.adamw(lr)

    def loss(p, x, y):
        probs = jax.nn.softmax(x @ p["router"])
        choice = jax.nn.one_hot(jnp.argmax(probs, -1), experts)
        slot = ((jnp.cumsum(choice, axis=0) - 1) * choice).astype(jnp.int32)
        kept = choice * (slot < capacity)
        dispatch = kept[..., None] * jax.nn.one_hot(slot, capacity)            # [tokens, experts, capacity]
        expert_in = jnp.einsum("tec,td->ecd", dispatch, x)
        expert_out = jnp.einsum("ech,ehd->ecd", jax.nn.relu(jnp.einsum("ecd,edh->ech", expert_in, p["w1"])), p["w2"])
        out = jnp.einsum("tec,ecd->td", dispatch * (probs * kept)[..., None], expert_out)
        balance = experts * jnp.sum(choice.mean(0) * probs.mean(0))
        return optax.softmax_cross_entropy_with_integer_labels((x + out) @ p["head"], y).mean() + 0.01 * balance

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), x, y), 2, adam_lr=lr)


# --------------------------------------------------------------------------- linear recurrence
def linear_rnn(seed: int) -> UserStep:
    rng = np.random.default_rng(seed)
    lr = 1e-3
    params = {"w_in": _normal(rng, 4, 6, scale=0.4), "decay": _normal(rng, 6, scale=0.3),
              "head": _normal(rng, 6, 2, scale=0.4)}
    x, y = _normal(rng, 2, 9, 4), _labels(rng, 2, 2)
    opt = optax.adamw(lr)

    def loss(p, x, y):
        u = x @ p["w_in"]
        a = jnp.broadcast_to(jax.nn.sigmoid(p["decay"]), u.shape)

        def compose(earlier, later):     # h = a * h_prev + u, composed over a span of steps
            return earlier[0] * later[0], later[0] * earlier[1] + later[1]

        _, h = lax.associative_scan(compose, (a, u), axis=1)
        return optax.softmax_cross_entropy_with_integer_labels(h[:, -1] @ p["head"], y).mean()

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), x, y), 2, adam_lr=lr)


# --------------------------------------------------------------------------- Gaussian process
def gp_regression(seed: int) -> UserStep:
    """The marginal likelihood of a GP on learned features: Cholesky and triangular solves (XLA's)."""
    rng = np.random.default_rng(seed)
    lr, n = 1e-2, 7
    params = {"log_length": jnp.float32(0.1), "log_noise": jnp.float32(-1.0), "w": _normal(rng, 3, 3, scale=0.5)}
    x, y = _normal(rng, n, 3), _normal(rng, n)
    opt = optax.adam(lr)

    def loss(p, x, y):
        z = x @ p["w"]
        d2 = ((z[:, None] - z[None]) ** 2).sum(-1)
        k = jnp.exp(-0.5 * d2 / jnp.exp(2 * p["log_length"])) + (jnp.exp(p["log_noise"]) + 1e-3) * jnp.eye(n)
        chol = jnp.linalg.cholesky(k)
        alpha = jax.scipy.linalg.cho_solve((chol, True), y)
        return 0.5 * y @ alpha + jnp.log(jnp.diagonal(chol)).sum()

    return UserStep(_with_grads(loss, opt), (params, opt.init(params), x, y), 2, adam_lr=lr,
                    fallbacks=("cholesky", "triangular_solve"))


ARCHITECTURE_STEPS = {
    "norms": norms, "t5_encoder": t5_encoder, "mlp_mixer": mlp_mixer, "vae": vae, "gnn": gnn, "clip": clip,
    "conv_transpose": conv_transpose, "fnet": fnet, "switch_moe": switch_moe, "linear_rnn": linear_rnn,
    "gp_regression": gp_regression,
}
