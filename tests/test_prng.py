"""Typed PRNG keys in and out of a compiled step: held as raw data, random ops run as XLA ops."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import jnova


def _dropout_step(w, x, key):
    key, sub = jax.random.split(key)

    def loss(w):
        h = jnp.tanh(x @ w)
        keep = jax.random.bernoulli(sub, 0.8, h.shape)
        return jnp.mean(jnp.where(keep, h / 0.8, 0.0) ** 2)

    value, grad = jax.value_and_grad(loss)(w)
    return w - 0.1 * grad, value, key


def test_step_with_dropout_takes_and_returns_a_key():
    rng = np.random.default_rng()
    w, x = rng.standard_normal((6, 5), np.float32), rng.standard_normal((4, 6), np.float32)
    key = jax.random.key(int(rng.integers(1 << 30)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = jnova.compile(_dropout_step)
        got = step(w, x, key)
    want = jax.jit(_dropout_step)(w, x, key)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    assert got[2].dtype == want[2].dtype  # a key comes back as a key
    np.testing.assert_array_equal(jax.random.key_data(got[2]), jax.random.key_data(want[2]))
    # and it feeds the next step
    again = step(got[0], x, got[2])
    np.testing.assert_allclose(again[1], jax.jit(_dropout_step)(want[0], x, want[2])[1], rtol=1e-5)


def test_key_operations_fall_back_with_one_warning_each():
    key = jax.random.key(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jnova.compile(lambda k: jax.random.normal(k, (3,)))(key)
    named = [str(w.message) for w in caught if "jnova" in str(w.message)]
    assert named and all("PRNG keys run as XLA ops" in m for m in named)
