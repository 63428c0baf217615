"""Reductions and dot_general compiled by jnova, checked against jax.jit.

Compiled with `fallback="error"`, compared with `jax.jit` on fresh random inputs (the seed is
printed). Integer and bool results, max/min and empty reductions are exact. Float sums, products
and contractions are summed in a different order than XLA's, so they are compared with the error
bound of that arithmetic: |jnova - jax.jit| <= rtol * (the same sum over absolute values), rtol 1e-5
for f32 accumulation, plus one ulp of the result type where the result is rounded to bf16/f16.
"""
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jnova

F32, BF16, F16 = np.float32, ml_dtypes.bfloat16, np.float16


@pytest.fixture
def rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"random seed {seed}")  # shown with a failure
    return np.random.default_rng(seed)


def compile_and_jit(f, *args):
    got = jnova.compile(f, fallback="error")(*args)
    want = jax.jit(f)(*args)
    return jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want)


def assert_exact(got, want, what=""):
    got, want = np.asarray(got), np.asarray(want)
    assert (got.dtype, got.shape) == (want.dtype, want.shape), what
    if got.dtype.kind == "f" or got.dtype in (BF16, F16):
        got, want = got.astype(np.float64), want.astype(np.float64)
        number = ~np.isnan(want)
        np.testing.assert_array_equal(np.signbit(got[number]), np.signbit(want[number]), err_msg=f"{what}: sign")
    np.testing.assert_array_equal(got, want, err_msg=what)


def assert_within(got, want, bound, what=""):
    """|got - want| <= bound elementwise, same dtype/shape, NaN and inf in the same places."""
    got, want = np.asarray(got), np.asarray(want)
    assert (got.dtype, got.shape) == (want.dtype, want.shape), what
    g, w = got.astype(np.float64), want.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"{what}: NaN positions")
    finite = np.isfinite(w)
    np.testing.assert_array_equal(g[~finite & ~np.isnan(w)], w[~finite & ~np.isnan(w)], err_msg=f"{what}: infinities")
    err = np.abs(g - w)[finite]
    bad = err > np.broadcast_to(bound, w.shape)[finite]
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} beyond the bound; worst error {err.max():.3g}"


def ulp(x, dtype):
    """One unit in the last place of each value of `x` in `dtype`."""
    x = np.abs(np.asarray(x, np.float64)).astype(dtype)
    return (np.nextafter(x.astype(F32), F32(np.inf)).astype(dtype).astype(np.float64) - x.astype(np.float64)
            if dtype in (BF16, F16) else np.spacing(x).astype(np.float64))


def axis_subsets(rank, rng, count):
    """`count` random non-empty axis subsets of a rank-`rank` array, always including all axes."""
    subsets = [c for r in range(1, rank + 1) for c in itertools.combinations(range(rank), r)]
    picked = [subsets[i] for i in rng.choice(len(subsets) - 1, count - 1, replace=False)]
    return picked + [tuple(range(rank))]


# --------------------------------------------------------------------------- reductions
def _monoid_reduce(x, axes, kind):
    """lax.reduce with the monoid JAX turns into reduce_<kind> (jnp.sum upcasts 16-bit floats first)."""
    op, init = {"sum": (lax.add, 0), "max": (lax.max, -np.inf), "min": (lax.min, np.inf), "prod": (lax.mul, 1),
                "and": (lax.bitwise_and, -1), "or": (lax.bitwise_or, 0), "xor": (lax.bitwise_xor, 0)}[kind]
    if kind == "and":
        init = ~np.zeros((), x.dtype)  # all ones
    if x.dtype == np.bool_:
        init = {"and": True, "or": False, "xor": False, "max": False, "min": True}[kind]
    elif np.issubdtype(x.dtype, np.integer) and kind in ("max", "min"):
        info = np.iinfo(x.dtype)
        init = info.min if kind == "max" else info.max
    return lax.reduce(x, np.array(init, x.dtype), op, axes)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_float_reductions_over_random_axes(rng, dtype):
    """max/min (with NaNs) exact; sum/prod within the bound of f32 accumulation.

    16-bit sums and products are compared with float64 NumPy, not with XLA: jnova accumulates them
    in f32 and rounds once, XLA's CPU code accumulates in bf16 (rounding every step of a tree of
    32-wide windows), measured 54% relative error for a sum of 5000 terms and 7.5% for a product of
    500. (jnp.sum/jnp.mean upcast to f32 themselves; those match XLA within the f32 bound.)
    """
    x = rng.standard_normal((3, 4, 5, 6)).astype(F32)
    x_nan = np.where(rng.random(x.shape) < 0.02, np.nan, x)
    inputs = {"x": x.astype(dtype), "x_nan": x_nan.astype(dtype), "x_prod": (1 + 0.1 * x).astype(dtype)}
    cases = {}  # name: (kind, axes, input)
    for axes in axis_subsets(4, rng, 5):
        for kind in ("sum", "prod", "max", "min"):
            cases[f"{kind}{axes}"] = (kind, axes, "x_prod" if kind == "prod" else "x")
            if kind in ("max", "min"):
                cases[f"{kind}{axes}_nan"] = (kind, axes, "x_nan")

    def step(inputs):
        out = {k: _monoid_reduce(inputs[name], axes, kind) for k, (kind, axes, name) in cases.items()}
        return out | {"jnp_sum": jnp.sum(inputs["x"], axis=(0, 2)), "jnp_mean": jnp.mean(inputs["x"], axis=3)}

    got, want = compile_and_jit(step, inputs)
    cases |= {"jnp_sum": ("sum", (0, 2), "x"), "jnp_mean": ("mean", (3,), "x")}
    for k, (kind, axes, name) in cases.items():
        if kind in ("max", "min"):
            assert_exact(got[k], want[k], k)
            continue
        v = inputs[name].astype(np.float64)
        reference, scale = {"sum": (v.sum(axes), np.abs(v).sum(axes)), "mean": (v.mean(axes), np.abs(v).mean(axes)),
                            "prod": (v.prod(axes), np.abs(v.prod(axes)) * v.size / v.prod(axes).size)}[kind]
        if dtype == F32 or k.startswith("jnp"):
            assert_within(got[k], want[k], 1e-5 * scale + (ulp(want[k], dtype) if dtype != F32 else 0), k)
        else:
            assert_within(got[k], reference.astype(dtype), 1e-5 * scale + ulp(reference, dtype), k)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.int8, np.bool_])
def test_integer_and_bool_reductions_exactly(rng, dtype):
    if dtype == np.bool_:
        x = rng.random((4, 3, 5)) < 0.7
        kinds = ("and", "or", "xor", "max", "min")
    else:
        info = np.iinfo(dtype)
        x = rng.integers(info.min, info.max, (4, 3, 5), endpoint=True).astype(dtype)  # sums and products wrap
        kinds = ("sum", "prod", "max", "min", "and", "or", "xor")
    axes = axis_subsets(3, rng, 4)
    got, want = compile_and_jit(lambda x: {f"{k}{a}": _monoid_reduce(x, a, k) for k in kinds for a in axes}, x)
    for k in got:
        assert_exact(got[k], want[k], k)


def test_jnp_reductions_on_bools_and_rank0_results(rng):
    b = rng.random((6, 5)) < 0.5
    x = rng.standard_normal((6, 5)).astype(F32)
    s = np.float32(rng.standard_normal())
    got, want = compile_and_jit(lambda b, x, s: {"all": jnp.all(b), "any": jnp.any(b, axis=0),
                                                 "count": jnp.sum(b, axis=1), "max_rank0": jnp.max(x),
                                                 "sum_of_scalar": jnp.sum(s), "all_x_pos": jnp.all(x > 0, axis=1)},
                                b, x, s)
    for k in got:
        assert_exact(got[k], want[k], k)


def test_reductions_over_an_empty_axis_give_the_identity():
    x, xi = np.zeros((3, 0, 2), F32), np.zeros((3, 0), np.int32)
    kinds = ("sum", "max", "min", "prod")
    got, want = compile_and_jit(lambda x, xi: {k: _monoid_reduce(x, (1,), k) for k in kinds}
                                | {f"i{k}": _monoid_reduce(xi, (1,), k) for k in kinds}, x, xi)
    for k in got:
        assert_exact(got[k], want[k], k)


def test_max_of_signed_zeros_is_positive_zero():
    x = np.array([[-0.0, 0.0, -0.0], [0.0, -0.0, -0.0]], F32)
    got, want = compile_and_jit(lambda x: (jnp.max(x, axis=1), jnp.min(x, axis=1)), x)
    assert_exact(got[0], want[0], "max")
    assert_exact(got[1], want[1], "min")


# --------------------------------------------------------------------------- dot_general
EINSUMS = ["ij,jk->ik", "bij,bjk->bik", "ibj,kjb->bik", "ijkl,jlm->ikm", "bijk,kbj->bi", "j,jk->k", "ij,j->i",
           "i,i->", "i,j->ij", "bi,bj->bij", "kb,bk->b", "ab,cd->abcd"]
SHAPES = {"i": 5, "j": 6, "k": 4, "l": 3, "m": 7, "b": 2, "a": 3, "c": 2, "d": 3}


def _operands(rng, spec, dtype):
    lhs, rhs = spec.split("->")[0].split(",")
    return [rng.standard_normal([SHAPES[c] for c in s]).astype(F32).astype(dtype) for s in (lhs, rhs)]


def _bound(spec, a, b, rtol):
    return rtol * np.einsum(spec, np.abs(a.astype(np.float64)), np.abs(b.astype(np.float64)))


def test_dot_general_f32_dimension_orders(rng):
    operands = {spec: _operands(rng, spec, F32) for spec in EINSUMS}
    direct = [rng.standard_normal((2, 3, 4)).astype(F32), rng.standard_normal((4, 5, 2)).astype(F32)]
    dims = (((2,), (0,)), ((0,), (2,)))  # batch dims lhs 0 / rhs 2, contracting lhs 2 / rhs 0

    def step(operands, direct):
        out = {spec: jnp.einsum(spec, *ab) for spec, ab in operands.items()}
        out["direct"] = lax.dot_general(*direct, dims)
        return out

    got, want = compile_and_jit(step, operands, direct)
    for spec in EINSUMS:
        assert_within(got[spec], want[spec], _bound(spec, *operands[spec], 1e-5), spec)
    assert_within(got["direct"], want["direct"], _bound("bik,kjb->bij", *direct, 1e-5), "direct")


def test_dot_general_16bit_and_preferred_element_type(rng):
    a, b = _operands(rng, "bij,bjk->bik", BF16)
    h, g = _operands(rng, "ij,jk->ik", F16)
    i8, f = rng.integers(-128, 128, (5, 6)).astype(np.int8), rng.standard_normal((6, 4)).astype(F32)

    def step(a, b, h, g, i8, f):
        return {"bf16_to_f32": lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32),
                "bf16": jnp.einsum("bij,bjk->bik", a, b), "f16": h @ g,
                "f16_to_f32": lax.dot(h, g, preferred_element_type=jnp.float32),
                "int8_x_bf16": lax.dot(i8, f.astype(jnp.bfloat16)), "bf16_x_f32": lax.dot(h.astype(jnp.bfloat16), f)}

    got, want = compile_and_jit(step, a, b, h, g, i8, f)
    f_bf16 = f.astype(BF16)
    assert_within(got["int8_x_bf16"], want["int8_x_bf16"],
                  ulp(want["int8_x_bf16"], BF16) + _bound("ij,jk->ik", i8, f_bf16, 1e-5), "int8_x_bf16")
    assert_within(got["bf16_x_f32"], want["bf16_x_f32"], _bound("ij,jk->ik", h.astype(BF16), f, 1e-5), "bf16_x_f32")
    assert_within(got["bf16_to_f32"], want["bf16_to_f32"], _bound("bij,bjk->bik", a, b, 1e-5), "bf16_to_f32")
    assert_within(got["f16_to_f32"], want["f16_to_f32"], _bound("ij,jk->ik", h, g, 1e-5), "f16_to_f32")
    # f32 accumulation, one rounding to the 16-bit type at the end
    assert_within(got["bf16"], want["bf16"], ulp(want["bf16"], BF16) + _bound("bij,bjk->bik", a, b, 1e-5), "bf16")
    assert_within(got["f16"], want["f16"], ulp(want["f16"], F16) + _bound("ij,jk->ik", h, g, 1e-5), "f16")


def test_dot_general_integers_exactly(rng):
    a = rng.integers(-2**31, 2**31, (3, 5, 4)).astype(np.int32)
    b = rng.integers(-2**31, 2**31, (3, 4, 2)).astype(np.int32)
    c, d = rng.integers(-128, 128, (6, 7)).astype(np.int8), rng.integers(-128, 128, (7, 3)).astype(np.int8)

    def step(a, b, c, d):
        return {"int32_wraps": jnp.einsum("bij,bjk->bik", a, b),
                "int8_to_int32": lax.dot(c, d, preferred_element_type=jnp.int32),
                "int8": lax.dot(c, d)}

    got, want = compile_and_jit(step, a, b, c, d)
    for k in got:
        assert_exact(got[k], want[k], k)
