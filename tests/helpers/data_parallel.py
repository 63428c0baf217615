"""Data-parallel steps and problems the data-parallel tests share (CPU host devices and GPUs)."""
import jax
import jax.numpy as jnp
import numpy as np


def loss(w, x, y):
    return jnp.mean((jnp.tanh(x @ w["a"] + w["b"]) - y) ** 2)


def sgd_step(w, x, y):
    """One data-parallel SGD step: gradients averaged over the mesh axis "d"."""
    value, grads = jax.value_and_grad(loss)(w, x, y)
    grads = jax.lax.pmean(grads, "d")
    return jax.tree.map(lambda p, g: p - 0.1 * g, w, grads), jax.lax.pmean(value, "d")


def problem(rng, devices: int):
    w = {"a": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
         "b": jnp.asarray(rng.standard_normal(8), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((8 * devices, 16)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((8 * devices, 8)), jnp.float32)
    return w, x, y


def assert_trees_close(got, want, rtol=1e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=rtol * np.abs(np.asarray(b)).max())


def mlp_sgd_step(w, x, y):
    """Four parameters of different sizes; gradients averaged by an explicit pmean after the backward."""
    def mlp_loss(w):
        h = jnp.tanh(x @ w["a"] + w["b"])
        return jnp.mean((h @ w["c"] + w["d"] - y) ** 2)

    value, grads = jax.value_and_grad(mlp_loss)(w)
    grads = jax.lax.pmean(grads, "d")
    return jax.tree.map(lambda p, g: p - 0.1 * g, w, grads), jax.lax.pmean(value, "d")


def mlp_problem(rng, devices: int):
    w = {"a": rng.standard_normal((16, 32)), "b": rng.standard_normal(32), "c": rng.standard_normal((32, 8)),
         "d": rng.standard_normal(8)}
    x, y = rng.standard_normal((8 * devices, 16)), rng.standard_normal((8 * devices, 8))
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), (w, x, y))
