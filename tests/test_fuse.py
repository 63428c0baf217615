"""Fusion grouping: kernel counts for canonical patterns, refusal reasons, numerics of the grouped plan."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jnova.passes.fuse import fuse
from helpers.fusion import fusion_of as _fusion, grouped_run as _grouped_run
from helpers.random_inputs import f32 as _f32


def test_linear_bias_gelu_is_one_kernel():
    func, fusion = _fusion(lambda x, w, b: jax.nn.gelu(x @ w + b), _f32(8, 16), _f32(16, 32), _f32(32))
    assert fusion.kernel_count() == 1
    (group,) = fusion.groups
    assert group.kind == "contraction" and {"nova.matmul", "nova.tanh", "nova.add"} <= {o.name for o in group.ops}


def test_linear_bias_residual_is_one_kernel():
    func, fusion = _fusion(lambda x, w, b, r: x @ w + b + r, _f32(8, 16), _f32(16, 32), _f32(32), _f32(8, 32))
    assert fusion.kernel_count() == 1


def test_no_fusion_into_a_contraction_body():
    func, fusion = _fusion(lambda x, w: jnp.tanh(x) @ w, _f32(8, 16), _f32(16, 4))
    assert fusion.kernel_count() == 2
    assert any("no fusion into a contraction's body" in r for r in fusion.refused)


def test_two_uses_are_refused_with_a_reason():
    func, fusion = _fusion(lambda x, y: (jnp.exp(x * y) + 1.0, jnp.exp(x * y) * 2.0), _f32(1024, 1024),
                           _f32(1024, 1024))
    # exp(x * y) has two user kernels after CSE; recomputing it would load two inputs (4 MiB each) in
    # each, more than writing it once and reading it twice: it is its own kernel, each consumer another
    assert fusion.kernel_count() == 3
    assert any(r.startswith("cannot fuse exp into") and "2 user kernels" in r for r in fusion.refused)


def test_a_value_cheaper_to_recompute_than_to_read_is_copied_into_each_reader():
    func, fusion = _fusion(lambda x: (jnp.exp(x) + 1.0, jnp.exp(x) * 2.0), _f32(1024, 1024))
    # each consumer loads x instead of exp(x): two loads instead of a write and two loads
    assert fusion.kernel_count() == 2
    assert all("nova.exp" in {o.name for o in g.ops} for g in fusion.groups)
    assert not fusion.refused


def test_softmax_rows_group_around_reductions():
    func, fusion = _fusion(lambda x: jax.nn.softmax(x, axis=-1), _f32(1024, 1024))
    kinds = [g.kind for g in fusion.groups]
    # max (with its epilogue), the sum of exp(x - max), the division recomputing exp(x - max) from x
    # and the row maxima (cheaper than writing it and reading it back)
    assert kinds == ["reduction", "reduction", "elementwise"]
    assert sum("nova.exp" in {o.name for o in g.ops} for g in fusion.groups) == 2


def test_elementwise_chain_is_one_kernel():
    func, fusion = _fusion(lambda x, y: jnp.tanh(x * 2.0 + y) - jnp.sin(y) ** 2, _f32(33, 7), _f32(33, 7))
    # y feeds two ops, but it is an argument: the whole chain is one kernel
    assert fusion.kernel_count() == 1


def _adam_leaf(p, g, m, v):
    """One parameter's Adam update: the new moments are returned and read by the update."""
    m = 0.9 * m + 0.1 * g
    v = 0.999 * v + 0.001 * g * g
    return p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), m, v


def test_returned_values_are_extra_outputs_of_their_elementwise_user():
    func, fusion = _fusion(_adam_leaf, *[_f32(768) for _ in range(4)])
    assert fusion.kernel_count() == 1
    (group,) = fusion.groups
    assert group.kind == "elementwise"


def test_returned_values_stay_out_of_reduction_kernels():
    """A reduction kernel writes values of its result's shape: a returned input-shaped value it
    reads stays in its own kernel."""
    func, fusion = _fusion(lambda x: (jnp.exp(x), jnp.exp(x).sum(-1)), _f32(16, 128))
    assert [g.kind for g in fusion.groups] == ["elementwise", "reduction"]
    assert any("only an elementwise kernel writes it" in r for r in fusion.refused)


@pytest.mark.parametrize("fn,shapes,kernels", [
    (lambda x, w, b, r: jax.nn.gelu(x @ w + b) + r, [(8, 16), (16, 32), (32,), (8, 32)], 1),
    (lambda x: jax.nn.softmax(x, axis=-1), [(16, 128)], 3),
    (lambda x, y: (jnp.exp(x) + y, jnp.exp(x) * y), [(64,), (64,)], 2),
    (lambda x, y: (jnp.exp(x * y) + 1.0, jnp.exp(x * y) * 2.0), [(64,), (64,)], 2),  # a launch saved
    (lambda x, w: (jnp.tanh(x) @ w).sum(0), [(8, 16), (16, 4)], 3),
    (_adam_leaf, [(300,), (300,), (300,), (300,)], 1),
])
def test_grouped_plan_matches_jit(fn, shapes, kernels):
    args = [_f32(*s) for s in shapes]
    got, count = _grouped_run(fn, *args)
    assert count == kernels
    want = jax.jit(fn)(*args)
    # f32 sums differ in their order: held to 1e-5 of each leaf's largest magnitude too (a column sum of
    # products can cancel to far below the terms it rounds at); NaNs (Adam's sqrt of a negative random
    # moment) must be where jax.jit's are
    scale = lambda b: float(np.nanmax(np.abs(b), initial=0.0))  # noqa: E731
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 + 1e-5 * scale(b)), got, want)


@pytest.mark.slow
def test_transformer_training_step_in_fused_plan_matches_jit():
    """A GPT-style step (attention, LayerNorm, GELU, tied embedding, SGD with momentum) run
    kernel-per-group. (AdamW would turn the key-bias gradient, which softmax's shift invariance
    makes zero up to rounding, into +-lr updates whose signs are rounding noise.)"""
    import jnova
    from models import tiny

    step, params, state, ids = tiny.setup()
    compiled = jnova.compile(step, kernels="fused")
    got = compiled(params, state, ids)
    want = jax.jit(step)(params, state, ids)
    assert compiled.stats()[0]["kernels"] > 50
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
