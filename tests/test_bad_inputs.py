"""Bad input: what a jnova-compiled step does with it, next to what jax.jit does (docs/bad_inputs.md).

The rule: jnova gives jax.jit's result or a clear error (the same exception type as jax.jit where jax.jit
raises), never a silent wrong result or a crash. Values are compared with NaN and infinity positions
exact (difftest.compare.Tolerance).
"""
from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jnova
from jnova.runtime.cache import ARTIFACTS
from difftest.compare import Tolerance
from difftest.steps import leaf_errors

# rtol and atol (of each leaf's scale) of f32 arithmetic; the absolute floor is for the gradients here
# that are zero in exact arithmetic (of sum(softmax(x)), of sum(layer_norm(x))) and come out as rounding
F32_TOL = Tolerance(rtol=1e-5, atol=1e-6, floor=1e-6)


def assert_like_jit(fn, *args, tol=F32_TOL, **options):
    """jnova's results equal jax.jit's: same tree, dtypes, shapes, NaN/inf positions; values within tol."""
    got, want = jnova.compile(fn, **options)(*args), jax.jit(fn)(*args)
    errors = leaf_errors(got, want, tol)
    assert not errors, "\n".join(errors)
    return got, want


def xent_step(w, x, labels):
    """A softmax cross-entropy value_and_grad: gather, scatter-add, exp, log, max, sums."""
    return jax.value_and_grad(lambda w: optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean())(w)


W = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
X = np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)
LABELS = np.array([1, 3], np.int32)


# --------------------------------------------------------------------------- argument types
@pytest.mark.parametrize("bad", ["a string", b"bytes", object(), print, {1, 2}],
                         ids=["str", "bytes", "object", "function", "set"])
def test_non_array_argument_raises_type_error_like_jit(bad):
    with pytest.raises(TypeError):
        jax.jit(xent_step)(bad, X, LABELS)
    with pytest.raises(TypeError, match="argument w of xent_step is of type .*, not an array"):
        jnova.compile(xent_step)(bad, X, LABELS)


def test_none_argument_is_an_empty_pytree_like_jit():
    """None is a pytree with no leaves: passed where an array is used, the step's own code raises
    jax's TypeError in both; where it is not used, it is fine in both."""
    with pytest.raises(TypeError, match="NoneType"):
        jax.jit(xent_step)(None, X, LABELS)
    with pytest.raises(TypeError, match="NoneType"):
        jnova.compile(xent_step)(None, X, LABELS)
    assert_like_jit(lambda w, unused: xent_step(w, X, LABELS), W, None)


def test_list_argument_is_a_pytree_of_weak_scalars_like_jit():
    assert_like_jit(lambda xs, w: sum(x * w for x in xs), [1.0, 2, 3.5], W)


def test_wrong_number_of_arguments_raises_type_error():
    with pytest.raises(TypeError):
        jnova.compile(xent_step)(W, X)


# --------------------------------------------------------------------------- changed shapes, dtypes, trees
def test_changed_shapes_retrace_and_count_compiles_like_jit():
    fresh = lambda *args: xent_step(*args)  # noqa: E731  (jax.jit's cache is per function object)
    step, reference = jnova.compile(fresh), jax.jit(fresh)
    five = np.arange(5, dtype=np.int32) % 4
    batches = [(X, LABELS), (np.ones((5, 3), np.float32), five), (X[:1], LABELS[:1].copy()), (X, LABELS)]
    for x, labels in batches:
        errors = leaf_errors(step(W, x, labels), reference(W, x, labels), F32_TOL)
        assert not errors, errors
    assert step.compile_count == reference._cache_size() == 3
    assert len(step.stats()) == 3


def test_changed_dtypes_retrace_like_jit():
    def f(w, x):
        return jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)

    step = jnova.compile(f)
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
        w, x = W.astype(dtype), X.astype(dtype)
        tol = F32_TOL if dtype == np.float32 else Tolerance(rtol=2e-2, atol=2e-2)
        errors = leaf_errors(step(w, x), jax.jit(f)(w, x), tol)
        assert not errors, errors
    assert step.compile_count == 3


def test_float64_and_int64_numpy_arguments_are_canonicalized_like_jit():
    """Without jax_enable_x64, jax.jit passes float64 / int64 NumPy arrays as float32 / int32; jnova
    compiles them as such too (it used to trace them as float64 and fail in its verifier)."""
    step = jnova.compile(xent_step)
    got, want = assert_like_jit(xent_step, W.astype(np.float64), X.astype(np.float64), LABELS.astype(np.int64))
    assert all(a.dtype == np.float32 for a in jax.tree.leaves(got))
    step(W, X, LABELS)
    step(W.astype(np.float64), X, LABELS.astype(np.int64))
    assert step.compile_count == 1, "float64 and float32 arguments are one signature, as in jax.jit"


def test_changed_pytree_structure_retraces():
    def f(params, x):
        return sum(jnp.sum(x @ p) for p in jax.tree.leaves(params))

    step = jnova.compile(f)
    for params in ({"a": W}, {"a": W, "b": 2 * W}, [W, W, W]):
        assert_like_jit(f, params, X)
        step(params, X)
    assert step.compile_count == 3


def test_non_contiguous_numpy_views_like_jit():
    big = np.arange(48, dtype=np.float32).reshape(6, 8) / 48
    assert_like_jit(lambda w, x: xent_step(w, x, LABELS), big[::2, 1:8:2].T[:3].copy(order="F"), big[1:5:2, ::3])


# --------------------------------------------------------------------------- special values
NAN_INF_CASES = {
    "nan_in_matmul_input": lambda w, x: xent_step(w, x.at[0, 1].set(jnp.nan), LABELS),
    "inf_logit_softmax": lambda w, x: jax.value_and_grad(
        lambda w: jnp.sum(jax.nn.softmax((x @ w).at[1, 2].set(jnp.inf))))(w),
    "masked_logits_minus_inf": lambda w, x: jax.value_and_grad(
        lambda w: jnp.sum(jax.nn.log_softmax(jnp.where(jnp.arange(4) < 2, x @ w, -jnp.inf)) ** 2))(w),
    "relu_max_min_of_nan": lambda w, x: (jax.nn.relu(x.at[0, 0].set(jnp.nan)), jnp.max(x.at[1, 1].set(jnp.nan), axis=1),
                                        jnp.minimum(x, jnp.nan), jnp.argmax(x.at[0, 2].set(jnp.nan), axis=1)),
    "inf_minus_inf_and_zero_times_inf": lambda w, x: (x * jnp.inf - x * jnp.inf, (x - x) * jnp.inf, jnp.exp(x * 1e5)),
    "layer_norm_of_inf_row": lambda w, x: jax.value_and_grad(
        lambda x: jnp.sum((x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)))(
            x.at[0, 1].set(jnp.inf)),
    "log_of_zero_and_negative": lambda w, x: (jnp.log(jnp.abs(x) * 0.0), jnp.log(-jnp.abs(x) - 1),
                                              jnp.sqrt(-jnp.abs(x) - 1)),
    "overflow_to_inf_then_gradient": lambda w, x: jax.value_and_grad(lambda w: jnp.sum(jnp.exp((x @ w) * 100.0)))(w),
}


@pytest.mark.parametrize("case", sorted(NAN_INF_CASES))
def test_nan_and_inf_propagate_as_in_xla(case):
    got, _ = assert_like_jit(NAN_INF_CASES[case], W, X)
    assert any(not np.all(np.isfinite(np.asarray(a, np.float32))) for a in jax.tree.leaves(got)), "no special value reached"


def test_denormals_flush_to_zero_as_in_xla_up_to_its_simplifier():
    """XLA's CPU code runs with flush-to-zero and denormals-are-zero, and jnova's kernels inside it too:
    arithmetic on subnormals gives the same results. Where XLA's simplifier removes an operation (x * 1),
    XLA passes a subnormal input through unchanged while jnova computes the operation and flushes it:
    the two differ by less than the smallest normal float32 (1.2e-38)."""
    x = np.array([1.0, 3e-39, -2e-39, 1e-30, 0.0], np.float32)
    assert_like_jit(lambda x, s: (x * s) * 1e30, x, np.float32(1e-10))
    got, want = jnova.compile(lambda x: x * 1.0 + 0.0)(x), jax.jit(lambda x: x * 1.0 + 0.0)(x)
    assert np.max(np.abs(np.asarray(got) - np.asarray(want))) < np.finfo(np.float32).tiny


@pytest.mark.parametrize("labels", [[4, 0], [-1, 2], [2**31 - 1, -(2**31)]], ids=["past_end", "negative", "extremes"])
def test_out_of_range_labels_behave_as_in_xla(labels):
    """optax's cross-entropy gathers the label's logit with take_along_axis: out of range, XLA's gather
    in 'fill' mode yields NaN (and its scatter-add in the backward pass drops the update); jnova too."""
    assert_like_jit(xent_step, W, X, np.array(labels, np.int32))


# --------------------------------------------------------------------------- zero-size dimensions
ZERO_SIZE_CASES = {
    "empty_batch_mean_is_nan": (xent_step, (W, np.ones((0, 3), np.float32), np.zeros((0,), np.int32))),
    "empty_contraction_is_zero": (lambda w, x: jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w),
                                  (np.ones((0, 4), np.float32), np.ones((2, 0), np.float32))),
    "no_classes": (xent_step, (np.ones((3, 0), np.float32), X, LABELS)),
    "max_over_empty_axis_is_minus_inf": (
        lambda x: (jnp.max(x, axis=0, initial=-jnp.inf), jnp.min(x, axis=0, initial=jnp.inf), jnp.prod(x, axis=0),
                   jnp.sum(x, axis=0)),
        (np.ones((0, 3), np.float32),)),
    "concatenate_and_slice_with_empty_pieces": (
        lambda x, e: (jnp.concatenate([e, x, e], axis=0), x[1:1], jnp.cumsum(e, axis=0), jnp.pad(e, ((1, 1), (0, 0)))),
        (X, np.ones((0, 3), np.float32))),
    "layer_norm_over_empty_features": (
        lambda x: jax.value_and_grad(lambda x: jnp.sum((x - x.mean(-1, keepdims=True)) * 2.0))(x),
        (np.ones((4, 0), np.float32),)),
}


def test_max_of_an_empty_axis_without_initial_raises_like_jit():
    for compile_ in (jax.jit, jnova.compile):
        with pytest.raises(ValueError, match="zero-size array to reduction operation max"):
            compile_(lambda x: jnp.max(x, axis=0))(np.ones((0, 3), np.float32))


@pytest.mark.parametrize("case", sorted(ZERO_SIZE_CASES))
def test_zero_size_dimensions_like_jit(case):
    fn, args = ZERO_SIZE_CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # mean of empty slice, in NumPy's checks
        assert_like_jit(fn, *args)


@pytest.mark.parametrize("case", sorted(ZERO_SIZE_CASES))
def test_zero_size_dimensions_compile_for_the_gpu(case):
    """The GPU plan has no kernel with an empty loop to schedule: reductions and contractions over an
    empty dimension fold to their identity, empty results to empty constants."""
    fn, args = ZERO_SIZE_CASES[case]
    jnova.compile(fn, target="h200", fallback="error").lower(*args).as_text("launches")


# --------------------------------------------------------------------------- more than 2**32 elements
# 2**32 + 2**17 elements (16 GiB of f32, never allocated): beyond what 32-bit indices reach, so that no
# compiler may prove a narrower index type safe
BIG = jax.ShapeDtypeStruct((2**17, 2**15 + 1), jnp.float32)


def big_step(x):
    return jnp.sum(jnp.tanh(x) * 2.0, axis=0), jax.nn.softmax(x, axis=0), x * 3.0


def test_more_than_2_32_elements_compile_with_64_bit_indexing_on_the_cpu():
    """lower() compiles without allocating; the kernels index with `index`, 64-bit on the host: the LLVM
    code has no 32-bit integer arithmetic or truncation (its only i32 values are float bit patterns)."""
    lowered = jnova.compile(big_step).lower(BIG)
    assert "131072x32769xf32" in lowered.as_text("linalg")
    assert not re.search(r"llvm\.(add|sub|mul|udiv|sdiv|urem|srem|trunc)\b[^\n]*\bi32\b", lowered.as_text("llvm"))


def test_more_than_2_32_elements_compile_with_64_bit_indexing_for_the_gpu():
    """Ahead of time for an H200: the PTX does its index arithmetic in 64 bits (no 32-bit multiply, no
    index truncated to 32 bits). tests/gpu/test_gpu_differential.py runs such a size on the GPU."""
    ptx = jnova.compile(big_step, target="h200").lower(BIG).as_text("ptx")
    assert ptx and not re.search(r"\b((mul|mad)\.lo\.[su]32|cvt\.u32\.u64)\b", ptx)


# --------------------------------------------------------------------------- using a compiled step wrongly
def test_transforming_a_compiled_step_raises_or_works_like_jit():
    step = jnova.compile(lambda w: jnp.sum(jnp.tanh(X @ w)))
    assert np.allclose(jax.jit(step)(W), jax.jit(lambda w: jnp.sum(jnp.tanh(X @ w)))(W), rtol=1e-6)
    with pytest.raises(TypeError, match="apply jax.grad / jax.value_and_grad before jnova.compile"):
        jax.grad(step)(W)
    with pytest.raises(TypeError, match="apply jax.vmap before jnova.compile"):
        jax.vmap(step)(np.stack([W, W]))


def test_reusing_a_donated_argument_raises_like_jit():
    step = jnova.compile(lambda a: a * 2, donate_argnums=0)
    a = jnp.ones(4)
    step(a)
    with pytest.raises(ValueError, match="deleted or donated"):
        step(a)
    assert step.compile_count == 1
    np.testing.assert_array_equal(np.asarray(step(jnp.full(4, 3.0))), np.full(4, 6.0))  # fresh arguments run


def test_an_op_the_cpu_has_no_code_for_runs_as_xla_ops_with_a_warning(tmp_path, monkeypatch):
    """float64 erf_inv (jax.random.normal's under x64): the CPU lowering has only the single-precision
    approximation. Its kernel runs as XLA ops, as on the GPU, with a warning at the user's line, and the
    step restored from the persistent cache runs it the same way. It used to be a CompileError."""
    def f(key, x):
        return jnp.sum(jax.random.normal(key, (64,)) * x) + jnp.sum(jax.lax.erf_inv(jnp.tanh(x)))

    monkeypatch.setenv("JNOVA_CACHE_DIR", str(tmp_path))
    with jax.enable_x64(True):
        key, x = jax.random.key(np.random.default_rng().integers(1 << 30)), jnp.linspace(-1.0, 1.0, 64)
        want = jax.jit(f)(key, x)
        for kernels in ("auto", "fused"):
            with pytest.warns(UserWarning, match="erf_inv on float64") as caught:
                got = jnova.compile(f, kernels=kernels)(key, x)
            assert any(w.filename == __file__ for w in caught if "erf_inv" in str(w.message))
            assert got.dtype == want.dtype == jnp.float64
            np.testing.assert_allclose(got, want, rtol=1e-12)
        ARTIFACTS.clear()
        restored = jnova.compile(f)
        np.testing.assert_allclose(restored(key, x), want, rtol=1e-12)
        assert restored.stats()[0]["cache_hit"] == "disk"
