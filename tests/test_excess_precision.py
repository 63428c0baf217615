"""Excess precision as XLA's default: a bf16 value rounded and widened again inside a kernel stays f32.

Each test compares jnova's distance from the f32 result with jax.jit's on the same inputs; with the
option off (or XLA's flag off) jnova computes what jax.jit does with `xla_allow_excess_precision` false.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnova
from jnova.capture.to_nova import to_nova
from jnova.capture.trace import trace
from jnova.options import Options
from jnova.passes.excess_precision import fold_rounding_pairs, widen_16bit_arithmetic
from jnova.passes.plan import Kernel
from helpers.random_inputs import values
from helpers import float64_forms

STRICT = {"xla_allow_excess_precision": False}


def _bf16(*shapes, scale=1.0):
    rng = np.random.default_rng()
    return [jnp.asarray(values(s, jnp.bfloat16, rng, scale=scale)) for s in shapes]


def _error(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max())


def _f32_reference(fn, args):
    """fn on the same (bf16-valued) inputs in f32: the result excess precision approaches."""
    return np.asarray(fn(*[np.asarray(a, np.float32) for a in args]), np.float64)


# each program, its input shapes and scale, and the same program in float64 NumPy (the exact result of
# the bf16 inputs, up to f64 rounding: an f32 reference's own rounding, as large as XLA's error, would
# count a compiler that sums more accurately than f32 as wrong)
CASES = {
    "sum_of_matmul_f32": (lambda x, w: jnp.sum(x @ w, dtype=jnp.float32), ((8, 32), (32, 32)), 1.0,
                          lambda x, w: np.sum(x @ w)),
    "sum_of_matmul": (lambda x, w: jnp.sum(x @ w), ((8, 32), (32, 32)), 1.0, lambda x, w: np.sum(x @ w)),
    "mean_of_tanh": (lambda x: jnp.mean(jnp.tanh(x)), ((64, 64),), 1.0, lambda x: np.mean(np.tanh(x))),
    "softmax": (lambda s: jax.nn.softmax(s), ((8, 64),), 3.0, float64_forms.softmax),
    "log_softmax": (lambda s: jax.nn.log_softmax(s), ((8, 64),), 3.0, float64_forms.log_softmax),
}


@pytest.mark.parametrize("name", CASES)
def test_bf16_program_is_as_close_to_f32_as_jit(name):
    fn, shapes, scale, exact = CASES[name]
    args = _bf16(*shapes, scale=scale)
    want = exact(*[np.asarray(a, np.float64) for a in args])
    ours, xla = _error(jnova.compile(fn)(*args), want), _error(jax.jit(fn)(*args), want)
    f32_roundoff = 2.0**-20 * max(1.0, np.abs(want).max())  # f32's last bits of the result
    assert ours <= 1.5 * xla + f32_roundoff, (ours, xla)


def test_without_excess_precision_jnova_computes_what_strict_xla_does():
    fn, shapes = CASES["sum_of_matmul_f32"][:2]
    x, w = _bf16(*shapes)
    want = _f32_reference(fn, (x, w))
    kept = jnova.compile(fn)(x, w)
    for strict in (jnova.compile(fn, excess_precision=False), jnova.compile(fn, xla_options=STRICT)):
        got = strict(x, w)
        np.testing.assert_allclose(got, jax.jit(fn, compiler_options=STRICT)(x, w), rtol=1e-6)
        # every product rounded to bf16 before the sum: far from f32, where the kept form is close
        assert _error(got, want) > 20 * _error(kept, want) + 1e-6


def test_a_returned_bf16_value_stays_rounded():
    def fn(x):
        y = jnp.tanh(x)
        return y, jnp.sum(y, dtype=jnp.float32)

    (x,) = _bf16((32, 48))
    (y, total), (want_y, want_total) = jnova.compile(fn)(x), jax.jit(fn)(x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want_y, np.float32))
    exact = np.sum(np.tanh(np.asarray(x, np.float64)))
    assert abs(float(total) - exact) <= 1.5 * abs(float(want_total) - exact) + 1e-4


def test_rounding_stays_where_the_value_leaves_the_kernel():
    """The pair folds when both conversions are in one kernel, and not when the bf16 value crosses."""
    (x,) = _bf16((4, 8))
    func = to_nova(trace(lambda x: jnp.sum(jnp.exp(x), dtype=jnp.float32), (x,), {})).func
    widen_16bit_arithmetic(func)
    ops = list(func.ops)
    narrow = next(op for op in ops if op.name == "nova.convert" and op.results[0].type.dtype == "bfloat16")
    split = ops.index(narrow) + 1
    apart = [Kernel("k0", ops[:split], [], [narrow.results[0]]), Kernel("k1", ops[split:], [narrow.results[0]],
                                                                          list(func.returns))]
    assert fold_rounding_pairs(func, apart) == 0
    together = [Kernel("k", list(func.ops), [], list(func.returns))]
    assert fold_rounding_pairs(func, together) == 1
    assert "nova.convert" not in [op.name for op in together[0].ops if op.results[0].type.dtype == "bfloat16"]


def test_xla_flag_where_the_user_set_it_turns_excess_precision_off(monkeypatch):
    assert Options.excess_precision_default(None, None) is True
    assert Options.excess_precision_default(None, STRICT) is False
    assert Options.excess_precision_default(True, STRICT) is True  # jnova's own option wins
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1 --xla_allow_excess_precision=false")
    assert jnova.compile(lambda x: x).options.excess_precision is False
    monkeypatch.setenv("XLA_FLAGS", "--xla_allow_excess_precision=true")
    assert jnova.compile(lambda x: x).options.excess_precision is True
    with pytest.raises(TypeError, match="excess_precision must be a bool"):
        jnova.compile(lambda x: x, excess_precision="yes")
