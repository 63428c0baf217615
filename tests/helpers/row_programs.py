"""Functions whose kernels are row programs (softmax, LayerNorm and their gradients), with argument
specs and tolerances: built on the CPU (tests/test_row_programs.py) and run on a GPU (tests/gpu)."""
import jax
import jax.numpy as jnp

f32, bf16 = jnp.float32, jnp.bfloat16


def causal_softmax(x):
    t = x.shape[-1]
    mask = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    return jax.nn.softmax(jnp.where(mask, x * 0.125, -jnp.inf), axis=-1)


def layer_norm(x, w, b):
    mean = x.mean(-1, keepdims=True)
    var = jnp.mean(jnp.square(x), -1, keepdims=True) - jnp.square(mean)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * w + b


def layer_norm_grad(x, w, b, g):
    return jax.grad(lambda x: jnp.sum(layer_norm(x, w, b) * g))(x)


def log_softmax_and_lse(x):  # outputs in program order (the kernel's)
    lse = jax.nn.logsumexp(x, axis=-1)
    return lse, x - lse[:, None]


ROW_PROGRAMS = {  # (fn, arg specs, rtol); schedules: a warp per row, partial slots, several warps per row
    "softmax_f32_96x1024": (lambda x: jax.nn.softmax(x, axis=-1), [((96, 1024), f32)], 1e-5),
    "causal_softmax_2x3x64x64": (causal_softmax, [((2, 3, 64, 64), f32)], 1e-5),
    "softmax_bf16_77x100": (lambda x: jax.nn.softmax(x, axis=-1), [((77, 100), bf16)], 1e-2),
    "softmax_f32_9x4096": (lambda x: jax.nn.softmax(x, axis=-1), [((9, 4096), f32)], 1e-5),
    "layer_norm_33x768": (layer_norm, [((33, 768), f32), ((768,), f32), ((768,), f32)], 1e-5),
    "layer_norm_grad_1x17x768": (layer_norm_grad, [((1, 17, 768), f32), ((768,), f32), ((768,), f32),
                                                   ((1, 17, 768), f32)], 1e-4),
    "log_softmax_and_lse_50x333": (log_softmax_and_lse, [((50, 333), f32)], 1e-5),
}
