"""Fusion through data movement: transposes, slices, pads, concatenations, reversals, dynamic slices and
gathers are index remaps that fuse like elementwise ops. Kernel counts and refusal reasons for canonical
patterns, and numerics of the grouped plan (one CPU kernel per fusion group) against jax.jit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jnova.passes.form_kernels import kernels_from_fusion
from helpers.fusion import fusion_of as _fusion, grouped_run as _grouped_run
from helpers.random_inputs import f32 as _f32


def _ids(shape, high, seed=0):
    return np.random.default_rng(seed).integers(0, high, shape).astype(np.int32)


def _refused(fusion, text):
    return [r for r in fusion.refused if text in r]


# (function, argument makers, kernels of the fused plan)
PATTERNS = {
    "attention_head_split_then_scale": (
        lambda x: x.reshape(2, 16, 4, 8).transpose(0, 2, 1, 3) * 0.125, [lambda: _f32(2, 16, 32)], 1),
    "shifted_slice_times_two": (lambda x: x[:, 1:] * 2, [lambda: _f32(7, 65)], 1),
    "embedding_lookup_plus_positions": (
        lambda wte, wpe, ids: jnp.take(wte, ids, axis=0, mode="clip") + jnp.take(wpe, jnp.arange(16), axis=0, mode="clip")[None],
        [lambda: _f32(50, 32), lambda: _f32(16, 32), lambda: _ids((4, 16), 50)], 1),
    "producer_through_transpose": (lambda x, y: jnp.exp(x).T + y, [lambda: _f32(12, 20), lambda: _f32(20, 12)], 1),
    "concatenate_of_computed_values": (
        lambda x, y: jnp.concatenate([jnp.exp(x), jnp.sin(y)], axis=1) * 2, [lambda: _f32(5, 8), lambda: _f32(5, 3)], 1),
    "pad_of_a_producer": (lambda x: jnp.pad(jnp.tanh(x), ((1, 2), (0, 3))) + 1, [lambda: _f32(6, 9)], 1),
    "interior_and_negative_pad": (
        lambda x: lax.pad(x * 3, 0.5, ((1, -1, 1), (-2, 2, 0))) - 1, [lambda: _f32(5, 7)], 1),
    "reverse_times": (lambda x, y: jnp.flip(x, (0, 1)) * y, [lambda: _f32(9, 16), lambda: _f32(9, 16)], 1),
    "strided_slice": (lambda x: jnp.cos(x)[1::2, ::3] + 1, [lambda: _f32(10, 31)], 1),
    "dynamic_slice_clamped": (
        lambda x, i: lax.dynamic_slice(jnp.exp(x), (i, 2), (4, 5)) * 2, [lambda: _f32(10, 8), lambda: np.int32(9)], 1),
    "reduction_through_a_transpose": (lambda x: jnp.sum(jnp.exp(x).T, axis=-1), [lambda: _f32(24, 40)], 1),
    "copied_remap_for_two_readers": (
        lambda x: (x.T * 2, jnp.sum(x.T + 1, axis=-1)), [lambda: _f32(8, 12)], 2),
    "point_read_twice_is_refused": (lambda x: jnp.exp(x) + jnp.exp(x).T, [lambda: _f32(8, 8)], 2),
    "broadcast_of_a_producer_is_refused": (lambda x, y: jnp.exp(x)[:, None] * y, [lambda: _f32(8), lambda: _f32(8, 5)], 2),
    "transpose_into_matmul": (lambda x, w: jnp.exp(x).T @ w, [lambda: _f32(16, 8), lambda: _f32(16, 4)], 2),
    "transposed_residual_leaves_the_epilogue": (
        lambda x, w, r: x @ w + r.T, [lambda: _f32(8, 16), lambda: _f32(16, 12), lambda: _f32(12, 8)], 2),
    "bias_reshape_stays_in_the_epilogue": (
        lambda x, w, b: x @ w + b.reshape(1, -1), [lambda: _f32(8, 16), lambda: _f32(16, 12), lambda: _f32(12)], 1),
    "embedding_gradient_scatter": (
        lambda g, ids: jnp.zeros((50, 32)).at[ids].add(g, mode="drop") * 0.5,
        [lambda: _f32(4, 16, 32), lambda: _ids((4, 16), 60)], 4),  # zeros, index wrap, scatter, scale
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_kernel_count(name):
    fn, makers, kernels = PATTERNS[name]
    func, fusion = _fusion(fn, *[m() for m in makers])
    assert fusion.kernel_count() == kernels, fusion.refused


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_grouped_plan_matches_jit(name):
    fn, makers, kernels = PATTERNS[name]
    args = [m() for m in makers]
    got, count = _grouped_run(fn, *args)
    assert count == kernels
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, jax.jit(fn)(*args))


def test_refusals_name_the_reason():
    _, fusion = _fusion(PATTERNS["point_read_twice_is_refused"][0], _f32(8, 8))
    assert _refused(fusion, "exp is read at two different points per element")
    _, fusion = _fusion(PATTERNS["broadcast_of_a_producer_is_refused"][0], _f32(8), _f32(8, 5))
    assert _refused(fusion, "the broadcast would read exp at many points per element")
    _, fusion = _fusion(PATTERNS["transpose_into_matmul"][0], _f32(16, 8), _f32(16, 4))
    assert _refused(fusion, "no fusion into a contraction's body (the transpose could be the matmul's operand layout)")
    _, fusion = _fusion(PATTERNS["transposed_residual_leaves_the_epilogue"][0], _f32(8, 16), _f32(16, 12), _f32(12, 8))
    assert _refused(fusion, "a contraction's epilogue reads its inputs elementwise or broadcast, not through a transpose")


def test_gather_with_computed_indices_keeps_them_in_their_own_kernel():
    """Each index is read once per element of its window: computing it there would repeat the work."""
    _, fusion = _fusion(lambda w, ids: w[ids % 50] * 2, _f32(50, 32), _ids((4, 16), 100))
    assert fusion.kernel_count() == 2
    assert _refused(fusion, "the gather would read select at many points per element")  # jnp's index wrap


def test_remapped_group_has_one_output_and_recomputed_ops_are_never_exported():
    """A constant read by a scatter (a kernel of its own) and by other groups: the zeros it is
    broadcast into get their own kernel with a copy of the constant, no group exports the constant."""
    fn = lambda g, ids, x: (jnp.zeros((50, 32)).at[ids].add(g), jnp.maximum(x, 0.0))
    func, fusion = _fusion(fn, _f32(4, 16, 32), _ids((4, 16), 50), _f32(8, 32))
    plan = kernels_from_fusion(func, fusion.groups)
    for kernel in plan.kernels:
        assert len(kernel.outputs) == 1, [o.name for o in kernel.ops]
        assert kernel.outputs[0].owner is kernel.ops[-1]
