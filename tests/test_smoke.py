"""End-to-end smoke test: an MLP training step compiled by jnova equals jax.jit's."""
import jax
import jax.numpy as jnp
import numpy as np

import jnova


def _loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def _step(params, x, y):
    loss, grads = jax.value_and_grad(_loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def test_mlp_sgd_step_matches_jit():
    k = jax.random.split(jax.random.key(np.random.randint(1 << 30)), 6)
    params = {"w1": jax.random.normal(k[0], (8, 16)), "b1": jax.random.normal(k[1], (16,)),
              "w2": jax.random.normal(k[2], (16, 4)), "b2": jax.random.normal(k[3], (4,))}
    x, y = jax.random.normal(k[4], (32, 8)), jax.random.normal(k[5], (32, 4))
    got = jnova.compile(_step)(params, x, y)
    want = jax.jit(_step)(params, x, y)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
