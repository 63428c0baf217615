"""A two-layer MLP regression model and its SGD training step (plain JAX, parameters in a dict), and a
variant with a tanh hidden layer (`tanh_loss`, `tanh_sgd_step`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def init(key, d_in: int = 8, d_hidden: int = 32, d_out: int = 4) -> dict:
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {"w1": jax.random.normal(k1, (d_in, d_hidden)) / d_in**0.5, "b1": 0.1 * jax.random.normal(k2, (d_hidden,)),
            "w2": jax.random.normal(k3, (d_hidden, d_out)) / d_hidden**0.5, "b2": 0.1 * jax.random.normal(k4, (d_out,))}


def batch(key, n: int = 16, d_in: int = 8, d_out: int = 4):
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, (n, d_in)), jax.random.normal(ky, (n, d_out))


def loss(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jnp.mean((jnp.tanh(h) @ params["w2"] + params["b2"] - y) ** 2)


def sgd_step(params, x, y, lr=0.1):
    """One SGD step: (new params, loss). `lr` may be a Python scalar argument."""
    value, grads = jax.value_and_grad(loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), value


def tanh_loss(params, x, y):
    """The variant with a tanh hidden layer feeding the output layer directly."""
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def tanh_sgd_step(params, x, y, lr=0.1):
    """One SGD step of the tanh variant: (new params, loss)."""
    value, grads = jax.value_and_grad(tanh_loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), value
