"""End-to-end smoke test: an MLP training step compiled by jnova equals jax.jit's."""
import jax
import numpy as np

import jnova
from models import fresh_seed, mlp


def test_mlp_sgd_step_matches_jit():
    seed = fresh_seed()
    params = mlp.init(jax.random.key(seed), d_in=8, d_hidden=16, d_out=4)
    x, y = mlp.batch(jax.random.key(seed + 1), n=32, d_in=8, d_out=4)
    got = jnova.compile(mlp.tanh_sgd_step)(params, x, y)
    want = jax.jit(mlp.tanh_sgd_step)(params, x, y)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
