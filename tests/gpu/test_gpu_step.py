"""Whole training steps compiled for the GPU match jax.jit on the GPU."""
import jax
import numpy as np
import pytest

import jnova
from models import tiny

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
def test_tiny_transformer_step_matches_jit(mixed_precision):
    step, params, state, ids = tiny.setup(batch=4, seq=65, d=64)
    compiled = jnova.compile(step, mixed_precision=mixed_precision)
    got = compiled(params, state, ids)
    stats = compiled.stats()[0]
    assert stats["backend"] == "gpu" and stats["kernels"] > stats["xla_groups"]
    with jax.default_matmul_precision("float32"):
        want = jax.jit(step)(params, state, ids)
    # jnova's contractions run in TF32 on the GPU (wgmma truncates the operands: u = 2**-10; XLA groups
    # follow jax's default GPU matmul precision, TF32 too), and bf16 demotes contraction operands
    rtol = 2e-2 if mixed_precision else 4 * 2.0**-10
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=rtol * (np.abs(np.asarray(b)).max() + 1e-6))
