"""Fusion grouping: kernel counts for canonical patterns, refusal reasons, numerics of the grouped plan."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jnova.capture.to_nova import to_nova
from jnova.capture.trace import trace
from jnova.passes.canonicalize import canonicalize
from jnova.passes.cse import cse
from jnova.passes.dce import dce
from jnova.passes.fuse import fuse
from jnova.passes.form_kernels import kernels_from_fusion


def _fusion(fn, *args):
    program = to_nova(trace(fn, args, {}), fallback="error")
    func = program.func
    canonicalize(func)
    cse(func)
    dce(func)
    return func, fuse(func)


def _f32(*shape):
    return np.random.default_rng().standard_normal(shape, np.float32)


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
    # exp(x) * y reads two arrays: copied into both readers it would be read twice, so it is a kernel
    # of its own, each consumer another
    func, fusion = _fusion(lambda x, y: (jnp.exp(x) * y + 1.0, jnp.exp(x) * y * 2.0), _f32(64), _f32(64))
    assert fusion.kernel_count() == 3
    assert any(r.startswith("cannot fuse mul into") and "2 user kernels" in r for r in fusion.refused)


def test_a_producer_of_one_array_is_copied_into_each_reader():
    # exp(x) reads one array: each reader recomputes it from x (two kernels, nothing written twice)
    func, fusion = _fusion(lambda x: (jnp.exp(x) + 1.0, jnp.exp(x) * 2.0), _f32(64))
    assert fusion.kernel_count() == 2
    assert all(any(op.name == "nova.exp" for op in g.ops) for g in fusion.groups)
    got, count = _grouped_run(lambda x: (jnp.exp(x) + 1.0, jnp.exp(x) * 2.0), x := _f32(64))
    assert count == 2
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, (jnp.exp(x) + 1.0, jnp.exp(x) * 2.0))


def test_softmax_rows_group_around_reductions():
    func, fusion = _fusion(lambda x: jax.nn.softmax(x, axis=-1), _f32(16, 128))
    kinds = [g.kind for g in fusion.groups]
    # max (with its epilogue); its sum with exp(x - max) as the prologue; the division, recomputing
    # exp(x - max): exp(x - max) reads one array of its size (the row maximum is 128 times smaller),
    # so it is copied into both readers rather than written and read twice
    assert kinds == ["reduction", "reduction", "elementwise"]
    assert sum(op.name == "nova.exp" for g in fusion.groups for op in g.ops) == 2


def test_elementwise_chain_is_one_kernel():
    func, fusion = _fusion(lambda x, y: jnp.tanh(x * 2.0 + y) - jnp.sin(y) ** 2, _f32(33, 7), _f32(33, 7))
    # y feeds two ops, but it is an argument: the whole chain is one kernel
    assert fusion.kernel_count() == 1


def _grouped_run(fn, *args):
    """Run `fn` through the CPU backend with one kernel per fusion group (the GPU plan)."""
    import jnova

    step = jnova.compile(fn, backend="cpu", kernels="fused")
    return step(*args), step.stats()[0]["kernels"]


@pytest.mark.parametrize("fn,shapes,kernels", [
    (lambda x, w, b, r: jax.nn.gelu(x @ w + b) + r, [(8, 16), (16, 32), (32,), (8, 32)], 1),
    (lambda x: jax.nn.softmax(x, axis=-1), [(16, 128)], 3),
    (lambda x, y: (jnp.exp(x) + y, jnp.exp(x) * y), [(64,), (64,)], 2),
    (lambda x, w: (jnp.tanh(x) @ w).sum(0), [(8, 16), (16, 4)], 3),
])
def test_grouped_plan_matches_jit(fn, shapes, kernels):
    args = [_f32(*s) for s in shapes]
    got, count = _grouped_run(fn, *args)
    assert count == kernels
    want = jax.jit(fn)(*args)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


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


def test_a_mask_computed_from_iota_is_recomputed_in_each_reader():
    """A causal mask (iota, compare, broadcast over heads) read by two kernels is copied into both
    instead of being a kernel that writes a bool array the size of the scores; the plan still equals
    jax.jit (the fused CPU plan)."""
    def f(s, g):
        mask = jnp.tril(jnp.ones((16, 16), bool))[None]
        masked = jnp.where(mask, s, -1e9)
        return jax.nn.softmax(masked, axis=-1), jnp.where(mask, g, 0.0).sum(-1)

    s, g = _f32(4, 16, 16), _f32(4, 16, 16)
    func, fusion = _fusion(f, s, g)
    assert not [grp for grp in fusion.groups if any(v.type.dtype == "bool" for op in grp.ops[-1:] for v in op.results)]
    readers = [grp for grp in fusion.groups if any(op.name == "nova.iota" for op in grp.ops)]
    assert len(readers) >= 2
    got, _ = _grouped_run(f, s, g)
    want = jax.jit(f)(s, g)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


def test_masked_softmax_does_not_write_its_intermediates():
    """Attention's causal softmax over scores a matmul made: the masked scores and exp(s - max) read one
    array each, so they are recomputed in the max, the sum and the division instead of being written:
    three kernels after the matmul, each reading the scores once; the fused plan equals jax.jit."""
    def f(q, k):
        s = jnp.einsum("qd,kd->qk", q, k)
        mask = jnp.tril(jnp.ones((32, 32), bool))
        return jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)

    q, k = _f32(32, 8), _f32(32, 8)
    func, fusion = _fusion(f, q, k)
    kinds = [g.kind for g in fusion.groups]
    assert kinds == ["contraction", "reduction", "reduction", "elementwise"], kinds
    got, count = _grouped_run(f, q, k)
    assert count == 4
    np.testing.assert_allclose(got, jax.jit(f)(q, k), rtol=1e-5, atol=1e-7)
