"""lead_batch_dims: contraction operands the GPU's kernels cannot read in place are transposed so that
the contraction is one they take (it ran as XLA ops before)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnova
from helpers.gpu_emulation import check_plan_kernels
from helpers.nova_funcs import nova_func
from helpers.random_inputs import normal
from jnova.passes.configure.problem import contraction_problem
from jnova.passes.lead_batch_dims import lead_batch_dims
from jnova.primitives.nova_to_jax import evaluate_ops
from jnova.runtime.target import PRESETS

H200 = PRESETS["h200"]

EINSUMS = {   # name: (equation, lhs shape, rhs shape)
    "scores_in_bthd": ("bthd,bshd->bhts", (2, 5, 3, 16), (2, 7, 3, 16)),
    "values_in_bthd": ("bhts,bshd->bthd", (2, 3, 5, 7), (2, 7, 3, 16)),
    "batch_last": ("ikb,kjb->bij", (6, 8, 3), (8, 5, 3)),
}


@pytest.mark.parametrize("name", sorted(EINSUMS))
def test_transposed_operands_make_a_kernel_contraction_with_the_same_values(name):
    equation, a_shape, b_shape = EINSUMS[name]
    rng = np.random.default_rng()
    a, b = normal(rng, a_shape), normal(rng, b_shape)
    func = nova_func(lambda a, b: jnp.einsum(equation, a, b), a, b)
    (matmul,) = [op for op in func.ops if op.name == "nova.matmul"]
    assert contraction_problem(matmul)[0] is None   # as captured, no kernel takes it
    want = jax.jit(evaluate_ops(func.ops, func.args, func.returns))(a, b)
    assert lead_batch_dims(func) >= 1
    func.verify()
    assert contraction_problem(matmul)[0] is not None
    got = jax.jit(evaluate_ops(func.ops, func.args, func.returns))(a, b)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)  # XLA's order of
    # the products may follow the operands' layout


def test_contractions_the_kernels_take_are_left_alone():
    func = nova_func(lambda a, b: (a @ b, jnp.einsum("bij,bjk->bik", a[None], b[None])),
                     normal(None, (6, 8)), normal(None, (8, 5)))
    assert lead_batch_dims(func) == 0


def test_attention_written_in_the_bthd_layout_has_no_xla_group():
    """Scores and their gradients by einsum over [B, T, H, D] (heads repeated for grouped-query
    attention), for an H200: every kernel is a generated one, and the transposes simulate correctly."""
    def loss(k, q):
        return jnp.sum(jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, 3, axis=2)) ** 2)

    rng = np.random.default_rng()
    k, q = normal(rng, (2, 5, 2, 16)), normal(rng, (2, 5, 6, 16))
    step = jax.value_and_grad(loss, argnums=(0, 1))
    lowered = jnova.compile(step, target="h200", fallback="error").lower(k, q)
    assert lowered.stats()["xla_groups"] == 0
    simulated, problems = check_plan_kernels(step, k, q, target=H200)
    assert simulated and not problems, problems
