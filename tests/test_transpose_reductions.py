"""transpose_reductions: a reduction over middle dims reads its operand transposed, so that the GPU's
row or column reduction kernels take it (it ran as XLA ops before)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnova
from helpers.gpu_emulation import check_plan_kernels
from helpers.nova_funcs import nova_func
from helpers.random_inputs import normal
from jnova.passes.transpose_reductions import transpose_reductions
from jnova.primitives.nova_to_jax import evaluate_ops
from jnova.runtime.target import PRESETS

H200 = PRESETS["h200"]

MIDDLE = {   # name: (function, operand shape, the kernel it becomes: one thread per row or column group, simulable)
    "repeat_backward": (lambda x: jnp.sum(jnp.tanh(x), axis=3), (3, 37, 2, 2, 64), "column_reduction"),
    "two_middle_dims": (lambda x: jnp.max(x, axis=(1, 3)), (3, 5, 2, 7, 8), "column_reduction"),
    "narrow_inner": (lambda x: jnp.sum(x * x, axis=(0, 2)), (3, 5, 2, 2), "row_reduction"),
    "size_1_dims_aside": (lambda x: jnp.min(x, axis=(0, 2)), (1, 5, 3, 1, 3), "row_reduction"),
}


@pytest.mark.parametrize("name", sorted(MIDDLE))
def test_middle_reductions_read_a_transpose_and_compute_the_same_values(name):
    fn, shape, _ = MIDDLE[name]
    x = normal(np.random.default_rng(), shape)
    func = nova_func(fn, x)
    want = jax.jit(evaluate_ops(func.ops, func.args, func.returns))(x)
    assert transpose_reductions(func) == 1
    func.verify()
    (reduce,) = [op for op in func.ops if op.name == "nova.reduce"]
    dims, rank = tuple(reduce.attrs["dims"]), len(shape)
    assert reduce.operands[0].owner.name == "nova.transpose"
    assert dims == tuple(range(len(dims))) or dims == tuple(range(rank - len(dims), rank))
    got = jax.jit(evaluate_ops(func.ops, func.args, func.returns))(x)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))   # the same values in the same order


def test_leading_and_innermost_reductions_are_left_alone():
    for fn, shape in ((lambda x: jnp.sum(x, axis=(0, 1)), (4, 5, 6)), (lambda x: jnp.sum(x, axis=-1), (4, 5, 6)),
                      (lambda x: jnp.sum(x, axis=(1, 3)), (4, 5, 1, 6)), (lambda x: jnp.sum(x, axis=1), (1, 5, 6))):
        assert transpose_reductions(nova_func(fn, normal(None, shape))) == 0


@pytest.mark.parametrize("name", sorted(MIDDLE))
def test_middle_reductions_are_gpu_kernels_that_simulate_correctly(name):
    fn, shape, family = MIDDLE[name]
    x = normal(np.random.default_rng(), shape)
    lowered = jnova.compile(fn, target="h200", fallback="error").lower(x)
    assert lowered.stats()["xla_groups"] == 0
    assert family in lowered.as_text("launches")
    simulated, problems = check_plan_kernels(fn, x, target=H200)
    assert simulated == 1 and not problems, problems


def test_grouped_query_attention_by_repeat_has_no_xla_group():
    """The backward pass of jnp.repeat over the heads (Llama's grouped-query attention as often written)."""
    def loss(k, q):
        return jnp.sum(jnp.tanh(jnp.repeat(k, 3, axis=2) * q))

    k, q = normal(None, (2, 5, 2, 16)), normal(None, (2, 5, 6, 16))
    lowered = jnova.compile(jax.grad(loss), target="h200", fallback="error").lower(k, q)
    assert lowered.stats()["xla_groups"] == 0
