"""Mismatches with jax.jit found by differential testing (tests/test_differential.py, test_bad_inputs.py,
test_model_zoo.py), each minimized to the smallest step that showed it, with what was wrong and where it
was fixed. Every test compiles with fallback="error" and compares with jax.jit on the same arguments.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jnova
from difftest.compare import Tolerance
from difftest.steps import leaf_errors

F32 = Tolerance(rtol=1e-6, atol=1e-6)


def assert_like_jit(fn, *args, tol=F32):
    got, want = jnova.compile(fn, fallback="error")(*args), jax.jit(fn)(*args)
    errors = leaf_errors(got, want, tol)
    assert not errors, "\n".join(errors)
    return got


def test_product_without_contracting_dims_feeding_a_reduction():
    """A dot_general with no contracting dimensions (here a scalar times a vector, as JAX's transpose of
    `mul` writes it) became an all-parallel linalg.generic that read its zero-filled init; MLIR's
    elementwise fusion fused it into the consumer reduction with that init turned into an output
    re-read across the reduction loop, so row i summed i + 1 times: [15, 28, 36, 36, 25] for
    [15, 14, 12, 9, 5]. Fixed in codegen/linalg/rules_reduce.py: such a product does not read its init.
    Found as the gradient of a bf16 cumsum (the transposed cumsum is this masked reduction)."""
    def f(a, s):
        y = lax.dot_general(a, s, (((), ()), ((), ())))
        return jnp.sum(jnp.broadcast_to(y[None, :], (5, 5)) * jnp.tri(5).T, axis=1)

    got = assert_like_jit(f, np.float32(1.0), np.arange(1.0, 6.0, dtype=np.float32))
    np.testing.assert_array_equal(got, [15, 14, 12, 9, 5])


def test_gradient_of_bf16_cumsum():
    """The generator's original find: d/dx vdot(cumsum(x), s) for bf16 x is a reverse cumsum of s."""
    f = jax.grad(lambda x, s: jnp.vdot(jnp.cumsum(x).astype(jnp.float32), s))
    got = assert_like_jit(f, jnp.arange(5, dtype=jnp.bfloat16), np.arange(1.0, 6.0, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(got, np.float32), [15, 14, 12, 9, 5])


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_stack_and_its_gradient(axis):
    """jnp.stack is a primitive (`stack`) since JAX 0.10, and its transpose `unstack`: neither had a
    rule, so fallback="error" refused any step using jnp.stack. Rules added in capture/rules_index.py
    (reshape each input to a unit dim + concatenate; slices + reshapes)."""
    def f(a, b):
        return jax.value_and_grad(lambda a: jnp.sum(jnp.stack([a, b * 2, jnp.tanh(a)], axis=axis) ** 2))(a)

    a, b = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)
    assert_like_jit(f, a, b)


def test_attention_on_bf16_with_its_dot_algorithm():
    """jax.nn.dot_product_attention on bf16 queries asks its contractions for
    precision=DotAlgorithmPreset.BF16_BF16_F32 (bf16 operands, f32 accumulation: what jnova computes;
    XLA's CPU backend leaves an f32 operand of it in f32 too). The rule refused every algorithm but
    DEFAULT. Fixed in capture/rules_reduce.py: the presets whose meaning is "each operand in its own type,
    f32 accumulation" are accepted for the operand types they list."""
    q = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 4, 8)), jnp.bfloat16)
    f = jax.grad(lambda q, k: jax.nn.dot_product_attention(q, k, q, is_causal=True).astype(jnp.float32).sum(),
                 argnums=(0, 1))
    assert_like_jit(f, q, q * 2, tol=Tolerance(rtol=2**-7, atol=2**-7))


def test_other_dot_algorithms_are_still_refused():
    f = lambda a, b: lax.dot(a, b, precision=lax.DotAlgorithmPreset.F16_F16_F16)  # noqa: E731
    with pytest.raises(NotImplementedError, match="precision=F16_F16_F16"):
        jnova.compile(f, fallback="error")(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32))


def test_float64_numpy_argument_without_x64():
    """jax.jit passes a float64 NumPy array as float32 when x64 is off; jnova traced it as float64 (from
    the array's own dtype) and its verifier failed on the f32 ops the jaxpr then had ("result has
    element type float32, expected float64"). Fixed in capture/trace.py: arguments get the canonical
    dtype, as in jax.jit."""
    f = jax.value_and_grad(lambda x, y: jnp.sum(jnp.tanh(x) * y))
    got = assert_like_jit(f, np.ones((3, 4), np.float64), np.ones((3, 4), np.float32))
    assert all(a.dtype == np.float32 for a in jax.tree.leaves(got))


def test_contraction_overflowing_f32_gives_nan_as_in_xla():
    """CPU contractions and sums of f32 accumulate in f64 (for accuracy). A partial sum past the f32
    range then stayed finite where XLA's f32 accumulator (exact products added with FMA) became inf:
    -2 * 2.1e38 + 0.4 * inf gave inf in jnova and NaN in XLA. Fixed in codegen/linalg/rules_reduce.py:
    the f64 accumulator becomes +-inf wherever an f32 one would overflow. Found by the bad-input test of
    a gradient through an exp that overflows."""
    i = np.array([[np.inf, 2.1028593e38], [2.1028468e38, np.inf]], np.float32)
    b = np.array([[-2.0], [0.4]], np.float32)
    got = assert_like_jit(lambda i, b: lax.dot_general(i, b, (((0,), (0,)), ((), ()))), i, b)
    assert np.isnan(got[1, 0]) and got[0, 0] == -np.inf


def test_sum_overflowing_f32_partway_gives_inf_as_in_xla():
    x = np.array([3e38, 3e38, -3e38, -3e38], np.float32)
    assert_like_jit(lambda x: (jnp.sum(x), jnp.sum(x[:3]), jnp.sum(x.astype(ml_dtypes.bfloat16).astype(jnp.float32))), x)
