"""Elementwise, conversion and layout primitives compiled by jnova, checked against jax.jit.

Every test compiles with `fallback="error"` (a primitive without a rule fails loudly) and compares
with `jax.jit` of the same function on fresh random inputs plus the special values XLA defines
(NaN, +-inf, +-0.0, out-of-range conversions, integer division by zero, oversized shifts). The seed
is printed, so a failure shows how to reproduce it.

Tolerances, in units in the last place (ulp) of the result's dtype:
  - exact (0 ulp, sign of zero included) for arithmetic, rounding, comparisons, conversions,
    integer and bit operations, select and data movement;
  - f32 transcendental functions: 16 ulp, i.e. rtol ~2e-6. Both sides are accurate; they use
    different approximations. Measured maxima against XLA's CPU code (|x| < 8): tanh 4, erf 5,
    expm1 5, log1p 3, logistic 2, exp2 5, sinh 9, cosh 9, erf_inv 2, asin/asinh/atanh 2, acosh 3,
    others 0-1;
  - bf16/f16: 1 ulp of the 16-bit type (both compute in f32 and round once, so the two f32
    results can straddle a rounding boundary).
Known differences from XLA, documented by tests of their own:
  - exp2, sinh, cosh of large |x| and erfc of large x: XLA's CPU approximations drift to 67 (exp2,
    |x| ~ 100), 24 (sinh/cosh, |x| > 20) and 64 (erfc, x ~ 9) ulp; jnova calls libm and stays within
    2 ulp of float64 NumPy/SciPy, which `test_transcendentals_are_accurate_over_wide_ranges` checks
    instead of XLA. erfc is compared with XLA on |x| <= 1.5 (measured 7 ulp).
  - denormals: XLA runs with flush-to-zero and denormals-are-zero, and jnova's kernels run inside
    XLA's host callback with the same mode; XLA's simplifier also folds `x * 1` before flushing.
    Inputs here avoid denormals; a denormal result flushes to zero on both sides.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import scipy.special
from jax import lax

import jnova

F32, BF16, F16 = np.float32, ml_dtypes.bfloat16, np.float16
FLOAT_SPECIALS = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, -2.5, 3e38, -3e38, 1.5e-38, -1e-7]


@pytest.fixture
def rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"random seed {seed}")  # shown with a failure
    return np.random.default_rng(seed)


def compile_and_jit(f, *args, **options):
    """(jnova's outputs, jax.jit's outputs) as pytrees of NumPy arrays."""
    got = jnova.compile(f, fallback="error", **options)(*args)
    want = jax.jit(f)(*args)
    return jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want)


def _ordered(x: np.ndarray) -> np.ndarray:
    """Float bit patterns mapped to integers that count ulps (both zeros map to 0)."""
    bits = x.view(f"int{8 * x.dtype.itemsize}").astype(np.int64)
    return np.where(bits < 0, -(bits & ((1 << (8 * x.dtype.itemsize - 1)) - 1)), bits)


def assert_close(got, want, ulps=0, what=""):
    """Same dtype, shape and NaN positions; finite values within `ulps` (0: bit-exact, signed zeros too)."""
    got, want = np.asarray(got), np.asarray(want)
    assert (got.dtype, got.shape) == (want.dtype, want.shape), what
    if got.dtype.kind not in "fV" and got.dtype not in (BF16, F16):
        bad = got != want
    else:
        nan_got, nan_want = np.isnan(got.astype(F32)), np.isnan(want.astype(F32))
        bad = (nan_got != nan_want) | (~nan_got & (np.abs(_ordered(got) - _ordered(want)) > ulps))
        if ulps == 0:
            bad |= ~nan_got & (np.signbit(got.astype(F32)) != np.signbit(want.astype(F32)))
    if bad.any():
        i = np.flatnonzero(bad.reshape(-1))[:5]
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} differ (tolerance {ulps} ulp); first at flat "
                             f"{i}: jnova {got.reshape(-1)[i]} vs jax.jit {want.reshape(-1)[i]}")


def assert_all_close(got: dict, want: dict, ulps):
    """Compare dicts of outputs; `ulps` is a number or a dict of per-key tolerances."""
    assert got.keys() == want.keys()
    errors = []
    for k in got:
        try:
            assert_close(got[k], want[k], ulps.get(k, 0) if isinstance(ulps, dict) else ulps, k)
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, "\n".join(errors)


def floats(rng, n, dtype, lo=-4.0, hi=0.9, specials=True):
    """Random floats of log-uniform magnitude 10**lo..10**hi, both signs, plus the special values."""
    x = rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(lo, hi, n)
    if specials:
        x = np.concatenate([x, FLOAT_SPECIALS])
    with np.errstate(over="ignore"):  # +-3e38 becomes +-inf in 16-bit types
        return x.astype(F32).astype(dtype)


# --------------------------------------------------------------------------- unary float
EXACT_UNARY = {
    "neg": lax.neg, "abs": lax.abs, "sign": lax.sign, "floor": lax.floor, "ceil": lax.ceil, "sqrt": lax.sqrt,
    "round_even": lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN),
    "round_away": lambda x: lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO),
    "is_finite": lax.is_finite, "square": lax.square,
}
TRANSCENDENTAL = {
    "exp": lax.exp, "exp2": lax.exp2, "expm1": lax.expm1, "log": lax.log, "log1p": lax.log1p, "tanh": lax.tanh,
    "logistic": lax.logistic, "erf": lax.erf, "rsqrt": lax.rsqrt, "cbrt": lax.cbrt,
    "sin": lax.sin, "cos": lax.cos, "tan": lax.tan, "atan": lax.atan, "sinh": lax.sinh, "cosh": lax.cosh,
    "asinh": lax.asinh,
}
UNIT_DOMAIN = {"asin": lax.asin, "acos": lax.acos, "atanh": lax.atanh, "erf_inv": lax.erf_inv, "erfc": lax.erfc}


def _unary_step(x, unit, above_one):
    out = {k: f(x) for k, f in (EXACT_UNARY | TRANSCENDENTAL).items()}
    out |= {k: f(unit) for k, f in UNIT_DOMAIN.items()}
    out["acosh"] = lax.acosh(above_one)
    return out


def _unary_inputs(rng, dtype):
    x = floats(rng, 500, dtype)
    unit = np.concatenate([rng.uniform(-1, 1, 200), [1.0, -1.0, 0.0, -0.0, 1.5, np.nan, 0.999]])
    above_one = np.concatenate([1 + 10.0 ** rng.uniform(-3, 3, 200), [1.0, 0.5, np.inf, np.nan]])
    return x, unit.astype(F32).astype(dtype), above_one.astype(F32).astype(dtype)


def test_float32_unary_ops_match_jit(rng):
    got, want = compile_and_jit(_unary_step, *_unary_inputs(rng, F32))
    assert_all_close(got, want, {k: 16 for k in got if k not in EXACT_UNARY})


# JAX lowers these to chains of ops in the 16-bit type (logistic is 1 / (1 + exp(-x)), chlo.acosh is
# log(x + sqrt(x^2 - 1)), ...), and XLA rounds each step; jnova computes in f32 and rounds once,
# which is the correctly rounded result on every input measured
CHAINED_16BIT = {"acosh": 2, "logistic": 2, "expm1": 2}


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_16bit_unary_ops_match_jit(rng, dtype):
    x, unit, above_one = _unary_inputs(rng, dtype)
    got, want = compile_and_jit(_unary_step, x, unit, above_one)
    # exp2: JAX lowers it as exp(x * log(2)) with log(2) rounded to the 16-bit type (0.691 in bf16),
    # 6-7 ulp off at |x| ~ 8; compared with float64 NumPy instead
    with np.errstate(over="ignore"):
        assert_close(got.pop("exp2"), np.exp2(x.astype(np.float64)).astype(F32).astype(dtype), 1, "exp2")
    want.pop("exp2")
    assert_all_close(got, want, {k: CHAINED_16BIT.get(k, 1) for k in got if k not in EXACT_UNARY})


WIDE_RANGE_REFERENCE = {  # name: (jax function, float64 reference, magnitudes 10**lo..10**hi)
    "exp2": (lax.exp2, np.exp2, -6, 2.05), "sinh": (lax.sinh, np.sinh, -6, 1.94), "cosh": (lax.cosh, np.cosh, -6, 1.94),
    "expm1": (lax.expm1, np.expm1, -9, 1.9),
    "log1p": (lambda x: lax.log1p(jnp.abs(x)), lambda x: np.log1p(np.abs(x)), -9, 30),
    "tanh": (lax.tanh, np.tanh, -6, 1), "erf": (lax.erf, scipy.special.erf, -6, 0.6),
    "erfc": (lax.erfc, scipy.special.erfc, -6, 1),
    "logistic": (lax.logistic, scipy.special.expit, -6, 1.9),
}


def test_transcendentals_are_accurate_over_wide_ranges(rng):
    """Where XLA's CPU approximations drift (exp2/sinh/cosh of large |x|), jnova is checked against
    float64 NumPy instead: within 3 ulp, excluding results that flush to zero as denormals."""
    xs = {k: floats(rng, 4000, F32, lo, hi, specials=False) for k, (_, _, lo, hi) in WIDE_RANGE_REFERENCE.items()}
    got = jnova.compile(lambda xs: {k: WIDE_RANGE_REFERENCE[k][0](x) for k, x in xs.items()}, fallback="error")(xs)
    for k, (_, reference, _, _) in WIDE_RANGE_REFERENCE.items():
        want = reference(xs[k].astype(np.float64))
        normal = ~(np.abs(want) < np.finfo(F32).tiny)
        with np.errstate(over="ignore"):
            assert_close(np.asarray(got[k])[normal], want.astype(F32)[normal], 3, k)


def test_expm1_and_log1p_keep_tiny_arguments():
    """MLIR's own lowering is exp(x) - 1 and log(1 + x), which returns 0 for |x| < 6e-8."""
    x = np.array([1e-10, -3e-9, 5.7e-8, 1e-5, -1e-5, 0.0, -0.0], F32)
    got, want = compile_and_jit(lambda x: (lax.expm1(x), lax.log1p(x)), x)
    assert_close(got[0], want[0], 1, "expm1")
    assert_close(got[1], want[1], 1, "log1p")
    np.testing.assert_array_equal(np.signbit(got[0]), np.signbit(x))


# --------------------------------------------------------------------------- binary float
BINARY = {"add": lax.add, "sub": lax.sub, "mul": lax.mul, "div": lax.div, "rem": lax.rem, "max": lax.max,
          "min": lax.min, "nextafter": lax.nextafter, "pow": lax.pow, "atan2": lax.atan2}


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
def test_float_binary_ops_match_jit(rng, dtype):
    special = np.array(FLOAT_SPECIALS[:7] + [2.0, 3.0], F32)
    a = np.concatenate([floats(rng, 400, dtype, specials=False), np.repeat(special, special.size).astype(dtype)])
    b = np.concatenate([floats(rng, 400, dtype, specials=False), np.tile(special, special.size).astype(dtype)])
    step = lambda a, b: {k: f(a, b) for k, f in BINARY.items()} | {"pow_abs": lax.pow(jnp.abs(a), b)}  # noqa: E731
    got, want = compile_and_jit(step, a, b)
    assert_all_close(got, want, {k: 16 if dtype == F32 else 1 for k in ("pow", "pow_abs", "atan2")})


def test_max_min_propagate_nan_and_order_signed_zeros():
    a = np.array([0.0, -0.0, np.nan, 1.0, np.nan, -np.inf, 3.0], F32)
    b = np.array([-0.0, 0.0, 1.0, np.nan, np.nan, np.nan, 3.0], F32)
    got, want = compile_and_jit(lambda a, b: (lax.max(a, b), lax.min(a, b), lax.max(b, a), lax.min(b, a)), a, b)
    for g, w in zip(got, want):
        assert_close(g, w)
    np.testing.assert_array_equal(np.signbit(got[0][:2]), [False, False])  # max(+-0) = +0, min = -0
    np.testing.assert_array_equal(np.signbit(got[1][:2]), [True, True])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_sign_of_zeros_nans_and_subnormals_is_jits_bit_for_bit(rng, dtype):
    """sign keeps NaN and a zero's sign; a subnormal, which XLA's CPU reads as zero, gives a signed zero
    (as jax.jit's), never the subnormal itself."""
    tiny = np.float32(np.finfo(np.float32).tiny)
    x = np.concatenate([[0.0, -0.0, np.nan, np.inf, -np.inf, tiny * 0.1, -tiny * 0.3, tiny, -2.5],
                        rng.standard_normal(16)]).astype(F32).astype(dtype)
    got, want = compile_and_jit(jnp.sign, x)
    np.testing.assert_array_equal(np.asarray(got, F32).view(np.uint32), np.asarray(want, F32).view(np.uint32))


def test_pow_with_integer_exponent_array(rng):
    x = floats(rng, 200, F32, -1, 0.5)
    y = rng.integers(-4, 5, x.size).astype(np.int32)
    got, want = compile_and_jit(lax.pow, x, y)
    assert_close(got, want, 16)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_integer_pow_of_floats(rng, dtype):
    x = floats(rng, 300, dtype, -1.5, 0.7)
    exponents = (-3, -2, -1, 0, 1, 2, 3, 5, 8)
    powers = lambda x: {n: lax.integer_pow(x, n) for n in exponents}  # noqa: E731
    got, want = compile_and_jit(powers, x, excess_precision=False)
    # JAX lowers integer_pow to repeated squaring in x's dtype; without excess precision jnova multiplies
    # in the same order and rounds each bf16 product, so the results are bit-identical
    assert_all_close(got, want, 0)
    if dtype == BF16:  # by default the products stay f32 inside the kernel (excess precision, as XLA's
        fine, _ = compile_and_jit(powers, x)  # GPU keeps them): at least as close to the exact powers
        exact = {n: np.asarray(x, np.float64) ** n for n in exponents}
        for n in exponents:
            finite = np.isfinite(exact[n]) & (np.abs(exact[n]) < 1e30) & np.isfinite(np.asarray(want[n], np.float64))
            err = lambda r: (np.abs(np.asarray(r[n], np.float64) - exact[n]) / np.maximum(np.abs(exact[n]), 1e-30))[finite]  # noqa: E731,B023
            assert err(fine).mean() <= err(want).mean() * 1.01 + 1e-9, n


# --------------------------------------------------------------------------- integers and bools
INT_UNARY = {"neg": lax.neg, "abs": lax.abs, "sign": lax.sign, "not": lax.bitwise_not, "square": lax.square,
             "popcount": lax.population_count, "clz": lax.clz, "pow0": lambda x: lax.integer_pow(x, 0),
             "pow1": lambda x: lax.integer_pow(x, 1), "pow3": lambda x: lax.integer_pow(x, 3),
             "pow5": lambda x: lax.integer_pow(x, 5)}
INT_BINARY = {"add": lax.add, "sub": lax.sub, "mul": lax.mul, "div": lax.div, "rem": lax.rem, "max": lax.max,
              "min": lax.min, "and": lax.bitwise_and, "or": lax.bitwise_or, "xor": lax.bitwise_xor,
              "eq": lax.eq, "ne": lax.ne, "lt": lax.lt, "le": lax.le, "gt": lax.gt, "ge": lax.ge}
SHIFTS = {"shl": lax.shift_left, "shr_logical": lax.shift_right_logical, "shr_arithmetic": lax.shift_right_arithmetic}


def _integers(rng, dtype, n):
    info = np.iinfo(dtype)
    edges = np.array([info.min, info.max, 0, 1, -1 if info.min < 0 else 2, info.min + 1, 7], dtype=np.int64)
    x = np.concatenate([rng.integers(info.min, info.max, n, endpoint=True), rng.integers(-20, 20, n), edges])
    return np.clip(x, info.min, info.max).astype(dtype)


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8, np.uint32])
def test_integer_ops_match_jit_exactly(rng, dtype):
    bits = np.iinfo(dtype).bits
    a = _integers(rng, dtype, 300)
    b = rng.permutation(a)
    b[:20] = 0  # division and remainder by zero
    shift = rng.integers(-2, bits + 3, a.size).astype(np.int64).astype(dtype)  # includes >= bit width
    if np.iinfo(dtype).min < 0:
        a[-3], b[-3] = np.iinfo(dtype).min, -1  # INT_MIN / -1
    ops = {k: f for k, f in INT_UNARY.items() if not (k == "abs" and np.iinfo(dtype).min == 0)}  # JAX: no unsigned abs

    def step(a, b, shift):
        out = {k: f(a) for k, f in ops.items()}
        out |= {k: f(a, b) for k, f in INT_BINARY.items()}
        return out | {k: f(a, shift) for k, f in SHIFTS.items()}

    got, want = compile_and_jit(step, a, b, shift)
    assert_all_close(got, want, 0)


def test_bool_ops_match_jit(rng):
    a, b = rng.random(64) < 0.5, rng.random(64) < 0.5
    ops = {"not": lambda a, b: ~a, "and": lax.bitwise_and, "or": lax.bitwise_or, "xor": lax.bitwise_xor,
           "max": lax.max, "min": lax.min, "eq": lax.eq, "ne": lax.ne, "lt": lax.lt, "ge": lax.ge,
           "add_any": lambda a, b: jax.grad(lambda x: (x * a + x * b).sum())(a.astype(F32)) > 0}
    got, want = compile_and_jit(lambda a, b: {k: f(a, b) for k, f in ops.items()}, a, b)
    assert_all_close(got, want, 0)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_float_comparisons_with_nan(rng, dtype):
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0], F32)
    a = np.concatenate([floats(rng, 100, dtype, specials=False), np.repeat(special, 6).astype(dtype)])
    b = np.concatenate([floats(rng, 100, dtype, specials=False), np.tile(special, 6).astype(dtype)])
    b[:20] = a[:20]
    ops = {"eq": lax.eq, "ne": lax.ne, "lt": lax.lt, "le": lax.le, "gt": lax.gt, "ge": lax.ge}
    got, want = compile_and_jit(lambda a, b: {k: f(a, b) for k, f in ops.items()}, a, b)
    assert_all_close(got, want, 0)


# --------------------------------------------------------------------------- select, clamp
def test_select_n_with_bool_int_and_scalar_predicates(rng):
    cases_f = [rng.standard_normal((5, 7)).astype(F32) for _ in range(4)]
    cases_i = [rng.integers(-100, 100, (5, 7)).astype(np.int8) for _ in range(3)]
    pred = rng.random((5, 7)) < 0.5
    which = rng.integers(0, 4, (5, 7)).astype(np.int32)
    which3 = rng.integers(0, 3, (5, 7)).astype(np.int32)

    def step(pred, which, which3, cases_f, cases_i):
        return {"bool": lax.select_n(pred, cases_f[0], cases_f[1]),
                "int32_4": lax.select_n(which, *cases_f),
                "int32_3_int8": lax.select_n(which3, *cases_i),
                "bf16": lax.select_n(pred, cases_f[2].astype(jnp.bfloat16), cases_f[3].astype(jnp.bfloat16)),
                "scalar_pred": lax.select_n(pred[0, 0], cases_f[0], cases_f[1]),
                "scalar_which": lax.select_n(which[1, 1], *cases_f),
                "one_case": lax.select_n(pred, cases_f[0]),
                "where": jnp.where(cases_f[0] > 0, cases_f[1], 0.0)}

    got, want = compile_and_jit(step, pred, which, which3, cases_f, cases_i)
    assert_all_close(got, want, 0)


def test_clamp_with_scalar_and_array_bounds(rng):
    x = floats(rng, 200, F32, -2, 1)
    lo, hi = -rng.random(x.size).astype(F32), rng.random(x.size).astype(F32)
    lo[:3] = np.nan
    xi = rng.integers(-50, 50, 64).astype(np.int32)
    got, want = compile_and_jit(lambda x, lo, hi, xi: (lax.clamp(-0.5, x, 0.5), lax.clamp(lo, x, hi),
                                                       lax.clamp(np.int32(-7), xi, np.int32(9)),
                                                       jnp.clip(x.astype(jnp.bfloat16), -1, 2)), x, lo, hi, xi)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, 0, f"output {i}")


# --------------------------------------------------------------------------- conversions
CONVERT_DTYPES = {"f32": F32, "bf16": BF16, "f16": F16, "i32": np.int32, "i8": np.int8, "u8": np.uint8,
                  "u32": np.uint32, "bool": np.bool_}
CONVERT_FLOATS = [np.nan, np.inf, -np.inf, -0.0, 0.0, 0.4, 0.5, 0.6, -0.5, -0.7, 1.5, 2.5, -1.5, 127.5, 128.0,
                  -128.5, -129.0, 255.5, 256.0, 300.0, -300.0, 65504.0, 65520.0, 70000.0, 2147483520.0,
                  2147483648.0, -2147483648.0, -2147483904.0, 4294967040.0, 4294967296.0, 1e10, -1e10, 3e38]


def _convert_inputs(rng, src):
    dtype = CONVERT_DTYPES[src]
    if src == "bool":
        return rng.random(64) < 0.5
    if np.dtype(dtype).kind in "iu":
        x = _integers(rng, dtype, 100)
        # 2**24 + 2**16 + 1: XLA converts integers to bf16 through f32, rounding twice (to 2**24)
        return np.concatenate([x, [2**24 + 2**16 + 1, 2**24 + 2**17 - 1]]).astype(dtype) if x.itemsize == 4 else x
    x = np.concatenate([rng.standard_normal(100) * 10.0 ** rng.uniform(-2, 10, 100), CONVERT_FLOATS])
    with np.errstate(over="ignore"):
        return x.astype(F32).astype(dtype)


@pytest.mark.parametrize("src", list(CONVERT_DTYPES))
def test_convert_element_type_matches_jit_exactly(rng, src):
    """NaN -> 0, saturation at the integer range, truncation toward zero, negative -> unsigned, ..."""
    x = _convert_inputs(rng, src)
    got, want = compile_and_jit(
        lambda x: {k: lax.convert_element_type(x, d) for k, d in CONVERT_DTYPES.items() if k != src}, x)
    assert_all_close(got, want, 0)


@pytest.mark.parametrize("exponent_bits,mantissa_bits", [(8, 7), (5, 10), (8, 3), (4, 0), (2, 1)])
def test_reduce_precision_matches_jit(rng, exponent_bits, mantissa_bits):
    x = np.concatenate([floats(rng, 300, F32, -8, 8), [65520.0, 65504.0, 6e-5, 1e-4]]).astype(F32)
    narrow = (min(exponent_bits, 8), min(mantissa_bits, 7))  # also from bf16
    got, want = compile_and_jit(lambda x: (lax.reduce_precision(x, exponent_bits, mantissa_bits),
                                           lax.reduce_precision(x.astype(jnp.bfloat16), *narrow)), x)
    assert_close(got[0], want[0], 0, "f32")
    assert_close(got[1], want[1], 0, "bf16")


# --------------------------------------------------------------------------- data movement
def test_broadcast_reshape_transpose_squeeze_expand_dims(rng):
    x = rng.standard_normal((2, 1, 3)).astype(F32)
    s = np.float32(rng.standard_normal())
    b = (rng.random((4, 1)) < 0.5)

    def step(x, s, b):
        return {"stretch": lax.broadcast_in_dim(x, (2, 5, 3), (0, 1, 2)),
                "new_dims": lax.broadcast_in_dim(x, (4, 2, 6, 3, 2), (1, 2, 3)),
                "scalar": lax.broadcast_in_dim(s, (3, 2), ()),
                "bool": jnp.broadcast_to(b, (3, 4, 5)),
                "reshape": x.reshape(3, 2), "to_rank0": x[:1, :, :1].reshape(()), "from_rank0": s.reshape(1, 1, 1),
                "reshape_order_f": jnp.reshape(x, (3, 2), order="F"),
                "reshape_dimensions": lax.reshape(x, (3, 1, 2), dimensions=(2, 0, 1)),
                "empty": jnp.zeros((0, 3), F32).reshape(3, 0, 2) + 1.0,
                "empty_broadcast": lax.broadcast_in_dim(x, (2, 0, 3), (0, 1, 2)),
                "transpose": lax.transpose(x, (2, 0, 1)), "transpose_back": lax.transpose(x * 2, (1, 2, 0)),
                "squeeze": lax.squeeze(x, (1,)), "expand_dims": lax.expand_dims(x, (0, 3)),
                "bf16_transpose": lax.transpose(x.astype(jnp.bfloat16), (1, 2, 0))}

    got, want = compile_and_jit(step, x, s, b)
    assert_all_close(got, want, 0)


def test_iota_for_int_and_float_dtypes():
    dtypes = {"i32": np.int32, "i8": np.int8, "u8": np.uint8, "u32": np.uint32, "f32": F32, "bf16": BF16, "f16": F16}

    def step():
        out = {f"{k}_0": lax.iota(d, 300 if k not in ("i8",) else 100) for k, d in dtypes.items()}
        return out | {f"{k}_2d": lax.broadcasted_iota(d, (3, 260, 2), 1) for k, d in dtypes.items()}

    got = jax.tree.map(np.asarray, jnova.compile(step, fallback="error")())
    want = jax.tree.map(np.asarray, jax.jit(step)())
    assert_all_close(got, want, 0)


def test_bitcast_convert_type_same_width():
    import jnova

    rng = np.random.default_rng()
    x = rng.standard_normal((5, 7)).astype(np.float32)

    def f(x):
        bits = jax.lax.bitcast_convert_type(x, jnp.int32)
        back = jax.lax.bitcast_convert_type(bits ^ 1, jnp.float32)
        return bits, back, jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)

    got = jnova.compile(f, fallback="error")(x)
    for a, b in zip(got, jax.jit(f)(x)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_random_bits_inside_a_step_compile():
    """jax.random.uniform bitcasts random bits to floats (dropout masks, initializers)."""
    import jnova

    def f(x, key):
        return x * jax.random.uniform(key, x.shape)

    x = np.random.default_rng().standard_normal((4, 9)).astype(np.float32)
    key = jax.random.key(int(np.random.default_rng().integers(1 << 30)))
    np.testing.assert_array_equal(jnova.compile(f)(x, key), jax.jit(f)(x, key))


@pytest.mark.skipif(not hasattr(jax.lax, "one_minus_square"), reason="jax < 0.11 has no one_minus_square")
def test_one_minus_square():
    import jnova

    x = np.random.default_rng().uniform(-1, 1, (7, 5)).astype(np.float32)
    f = jax.lax.one_minus_square
    np.testing.assert_allclose(jnova.compile(f, fallback="error")(x), jax.jit(f)(x), rtol=2e-7, atol=1e-7)
