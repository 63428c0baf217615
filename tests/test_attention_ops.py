"""jnova.ops.attention: a differentiable JAX function that jnova captures as nova.attention and
nova.attention_backward, computed on the CPU through the ops' decomposition.

Oracles: jax.jit of the same step (jnova.ops.attention evaluates its definition in jax.numpy there),
and, for that definition itself, a manual softmax attention under jax.jit with JAX's own AD.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnova
from helpers.attention import assert_no_score_buffer, assert_raised, compare_with_jit
from helpers.random_inputs import normal
from jnova.dialect.ir import Func, print_module
from jnova.dialect.ops_attention import attention_backward_op, attention_op
from jnova.dialect.types import TensorType
from jnova.passes.expand_attention import attention_decomposition
from jnova.primitives.nova_to_jax import evaluate_ops


def _manual(q, k, v, *, causal, scale, bias=None, mask=None, layout="bthd"):
    """Attention as users write it (f32, repeat for GQA), the oracle of the definition."""
    if layout == "bhtd":
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
    if bias is not None:
        s = s + bias
    keep = jnp.ones(s.shape, bool) if mask is None else jnp.broadcast_to(mask, s.shape)
    if causal:
        keep = keep & jnp.tril(jnp.ones(s.shape[-2:], bool))
    s = jnp.where(keep, s, -1e30)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v, precision="highest")
    return jnp.swapaxes(o, 1, 2) if layout == "bhtd" else o


CASES = [  # (B, Tq, Tk, Hq, Hkv, D, causal, optional, layout)
    (2, 16, 16, 4, 4, 8, True, None, "bthd"),
    (2, 16, 16, 4, 2, 8, False, None, "bthd"),
    (1, 12, 20, 4, 1, 16, False, "bias", "bhtd"),
    (2, 9, 9, 2, 2, 8, True, "mask", "bthd"),
]


def _inputs(rng, case, dtype="float32"):
    b, tq, tk, hq, hkv, d, causal, optional, layout = case
    qshape, kshape = ((b, tq, hq, d), (b, tk, hkv, d)) if layout == "bthd" else ((b, hq, tq, d), (b, hkv, tk, d))
    q, k, v = normal(rng, qshape, dtype), normal(rng, kshape, dtype), normal(rng, kshape, dtype)
    extra = {}
    if optional == "bias":
        extra["bias"] = normal(rng, (1, hq, tq, tk))
    elif optional == "mask":
        extra["mask"] = rng.random((b, 1, tq, tk)) < 0.7
    return q, k, v, extra


@pytest.mark.parametrize("case", CASES)
def test_definition_matches_manual_attention_and_its_ad(case):
    rng = np.random.default_rng()
    q, k, v, extra = _inputs(rng, case)
    causal, layout = case[6], case[8]
    w = normal(rng, q.shape)
    scale = 0.3

    def loss(attend):
        return lambda q, k, v: (attend(q, k, v, causal=causal, scale=scale, layout=layout, **extra) * w).sum()

    ours = jax.jit(jax.value_and_grad(loss(jnova.ops.attention), argnums=(0, 1, 2)))(q, k, v)
    theirs = jax.jit(jax.value_and_grad(loss(_manual), argnums=(0, 1, 2)))(q, k, v)
    # The loss is a sum of terms of both signs: its rounding scales with the sum of their magnitudes,
    # not with the (possibly cancelled) sum itself.
    terms = np.abs(np.asarray(_manual(q, k, v, causal=causal, scale=scale, layout=layout, **extra)) * w).sum()
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-7 * float(terms))
    for a, b in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(theirs[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES)
def test_training_step_compiles_to_attention_ops_and_matches_jit(case, dtype):
    rng = np.random.default_rng()
    q, k, v, extra = _inputs(rng, case, dtype)
    causal, layout = case[6], case[8]
    w = normal(rng, q.shape)

    def step(q, k, v):
        def loss(q, k, v):
            o = jnova.ops.attention(q, k, v, causal=causal, layout=layout, **extra)
            return (o.astype(jnp.float32) * w).sum()
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    lowered = compare_with_jit(step, q, k, v, dtype=dtype)
    assert_raised(lowered)
    b, tq, tk, hq = case[:4]
    assert_no_score_buffer(lowered, b * hq * tq * tk)


def test_fused_plan_gives_attention_kernels_of_their_own():
    rng = np.random.default_rng()
    q, k, v, _ = _inputs(rng, CASES[1])

    def step(q, k, v):
        return jax.grad(lambda q, k, v: jnp.tanh(jnova.ops.attention(q, k, v)).sum(), argnums=(0, 1, 2))(q, k, v)

    lowered = compare_with_jit(step, q, k, v, kernels="fused")
    linalg = lowered.as_text("linalg")
    kernels = [block for block in linalg.split("func.func @")[1:]]
    # the forward's kernel computes o and lse only (q, k, v in; o, lse out)
    assert any(block.count("%in") >= 3 and "xf32>" in block for block in kernels)
    assert lowered.stats()["kernels"] >= 3


def test_attention_inside_jax_jit_inside_jnova_compile():
    rng = np.random.default_rng()
    q, k, v, _ = _inputs(rng, CASES[0])
    inner = jax.jit(lambda q, k, v: jnova.ops.attention(q, k, v, causal=True))
    lowered = compare_with_jit(lambda q, k, v: jax.grad(lambda *a: inner(*a).sum(), argnums=(0, 1, 2))(q, k, v),
                               q, k, v)
    assert_raised(lowered)


def test_nova_to_jax_evaluates_the_ops_by_their_decomposition():
    rng = np.random.default_rng()
    b, t, h, d = 2, 8, 2, 4
    f = Func("f", [TensorType((b, h, t, d), "float32")] * 4)
    q, k, v, do = f.args
    fwd = f.add(attention_op(q, k, v, causal=True, scale=0.5, layout="bhtd"))
    bwd = f.add(attention_backward_op(q, k, v, *fwd.results, do, causal=True, scale=0.5, layout="bhtd"))
    f.returns = [*fwd.results, *bwd.results]
    f.verify()
    xs = [normal(rng, (b, h, t, d)) for _ in range(4)]
    got = evaluate_ops(f.ops, f.args, f.returns)(*xs)
    o, vjp = jax.vjp(lambda q, k, v: _manual(q, k, v, causal=True, scale=0.5, layout="bhtd"), *xs[:3])
    want = [o, *vjp(xs[3])]
    for a, w in zip([got[0], *got[2:]], want):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)
    s = np.einsum("bhqd,bhkd->bhqk", xs[0], xs[1]) * 0.5
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    np.testing.assert_allclose(got[1], np.log(np.exp(s).sum(-1)), rtol=1e-5, atol=1e-6)
    ops, _ = attention_decomposition(fwd)
    assert {"nova.matmul", "nova.exp", "nova.reduce"} <= {op.name for op in ops}
    print_module([f])


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
def test_nova_to_jax_evaluates_the_backward_halves_as_the_whole_backward(layout):
    """The GPU plan's nova.attention_dq and nova.attention_dkdv (split_attention_backward) evaluate to the
    whole backward's dq, dk, dv, and delta = rowsum(do * o): what kernel_check compares their kernels with."""
    from jnova.passes.split_attention_backward import split_attention_backward

    rng = np.random.default_rng()
    b, t, hq, hkv, d = 2, 8, 4, 2, 4
    qshape, kshape = ((b, t, hq, d), (b, t, hkv, d)) if layout == "bthd" else ((b, hq, t, d), (b, hkv, t, d))
    f = Func("f", [TensorType(qshape, "float32"), TensorType(kshape, "float32"), TensorType(kshape, "float32"),
                   TensorType(qshape, "float32")])
    q, k, v, do = f.args
    fwd = f.add(attention_op(q, k, v, causal=True, scale=0.5, layout=layout))
    bwd = f.add(attention_backward_op(q, k, v, *fwd.results, do, causal=True, scale=0.5, layout=layout))
    f.returns = [fwd.results[0], *bwd.results]
    xs = [normal(rng, x.type.shape) for x in f.args]
    whole = evaluate_ops(f.ops, f.args, f.returns)(*xs)
    assert split_attention_backward(f, lambda op: True) == 1
    assert [op.name for op in f.ops] == ["nova.attention", "nova.attention_dq", "nova.attention_dkdv"]
    f.returns = [*f.returns, f.ops[1].results[1]]
    halves = evaluate_ops(f.ops, f.args, f.returns)(*xs)
    for got, want in zip(halves[:4], whole):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    o, do_ = (np.asarray(x, np.float64) for x in (whole[0], xs[3]))
    delta = (o * do_).sum(-1)
    np.testing.assert_allclose(halves[4], np.swapaxes(delta, 1, 2) if layout == "bthd" else delta,
                               rtol=1e-5, atol=1e-6)


def test_fully_masked_rows_attend_uniformly():
    rng = np.random.default_rng()
    q, k, v = (normal(rng, (1, 4, 2, 8)) for _ in range(3))
    mask = np.ones((1, 1, 4, 4), bool)
    mask[..., 2, :] = False  # query 2 sees no key
    step = jnova.compile(lambda q, k, v: jnova.ops.attention(q, k, v, mask=mask))
    o = np.asarray(step(q, k, v))
    np.testing.assert_allclose(o[0, 2], v[0].mean(0), rtol=1e-5, atol=1e-6)
    assert np.isfinite(o).all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(layout="tbhd"), "layout='tbhd'"),
    (dict(causal=True, k_len=6), "causal attention needs as many queries (4) as keys (6)"),
    (dict(k_heads=3), "expected a divisor of q's 2"),
    (dict(bias=np.zeros((1, 2, 4, 3), np.float32)), "bias has shape (1, 2, 4, 3)"),
    (dict(bias=np.zeros((1, 1, 4, 4)), mask=np.ones((1, 1, 4, 4), bool)), "a bias or a mask, not both"),
])
def test_bad_arguments_are_named(kwargs, message):
    k_len, k_heads = kwargs.pop("k_len", 4), kwargs.pop("k_heads", 2)
    q = np.ones((1, 4, 2, 8), np.float32)
    k = np.ones((1, k_len, k_heads, 8), np.float32)
    with pytest.raises(ValueError) as e:
        jnova.ops.attention(q, k, k, **kwargs)
    assert message in str(e.value)
