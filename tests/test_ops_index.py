"""Indexing and data movement, end to end: jnova.compile(f) equals jax.jit(f) on fresh random inputs.

Covers slice, split, concatenate, pad, rev, tile, dynamic_slice, dynamic_update_slice, gather (every
dimension-number form and mode), scatter (set/add/sub/mul/min/max, every mode), argmax/argmin and
cumulative reductions, plus the gradient of an embedding lookup with a take_along_axis
cross-entropy. Indices include negative, too large and (for scatter) duplicate ones. Every compile
uses fallback="error", so a missing rule fails instead of falling back; one compile serves several
random inputs of its signature. The seed is printed; JNOVA_TEST_SEED replays it.

Results are bit-exact (sign of zero included) except float sums and products, compared with
rtol 1e-6: XLA rewrites long cumulative sums into a different association order. Known difference,
not tested: 16-bit float cumsum/cumprod accumulate in f32 (nova.reduce), XLA rounds every step.
"""
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jnova

GATHER_MODES = ("clip", "fill", "promise_in_bounds")


@pytest.fixture
def rng():
    seed = int(os.environ.get("JNOVA_TEST_SEED") or np.random.SeedSequence().entropy % 2**31)
    print(f"seed = {seed} (replay with JNOVA_TEST_SEED={seed})")  # shown by pytest when the test fails
    return np.random.default_rng(seed)


def _data(rng, shape, dtype="float32"):
    """Random values of `dtype`: normals for floats (few exact ties), small ranges for integers."""
    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype == ml_dtypes.bfloat16 or dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100), shape, endpoint=True).astype(dtype)


def _indices(rng, shape, bound, dtype="int32", out_of_bounds=True):
    """Random indices in [0, bound), plus negative and too-large ones if `out_of_bounds`."""
    lo, hi = (-bound - 3, 2 * bound + 3) if out_of_bounds else (0, bound)
    if np.dtype(dtype).kind == "u":
        lo = 0
    return rng.integers(lo, hi, shape).astype(dtype)


def _same(got, want, rtol=None):
    assert len(jax.tree.leaves(got)) == len(jax.tree.leaves(want))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        if w.dtype == ml_dtypes.bfloat16:
            g, w = g.astype(np.float32), w.astype(np.float32)
        if rtol is None:  # exact, the sign of zero included
            np.testing.assert_array_equal(g, w)
            if w.dtype.kind == "f":
                numbers = ~np.isnan(w)
                np.testing.assert_array_equal(np.signbit(g[numbers]), np.signbit(w[numbers]))
        else:
            np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol)


def _check(f, *inputs, rtol=None):
    """f compiled by jnova equals f under jax.jit, for each argument tuple in `inputs`."""
    compiled = jnova.compile(f, fallback="error")
    for args in inputs:
        _same(compiled(*args), jax.jit(f)(*args), rtol)
    assert compiled.compile_count == 1


# --------------------------------------------------------------------------- static slices
@pytest.mark.parametrize("shape,index,dtype", [
    ((10, 7), (slice(None), slice(1, None)), "float32"),        # x[:, 1:]
    ((13, 1), (slice(None, 3), slice(None)), "int8"),           # a prefix
    ((5, 11, 2), (slice(1, 5, 2), slice(2, 11, 3), slice(1, 2)), "float32"),
    ((5, 11, 2), (slice(1, 5, 2), slice(2, 11, 3), slice(1, 2)), "bool"),
    ((7,), (slice(6, 7),), "uint32"),
])
def test_slice(rng, shape, index, dtype):
    _check(lambda x: x[index], (_data(rng, shape, dtype),))


@pytest.mark.parametrize("shape,sections,axis", [((6, 10), [1, 3], 1), ((7, 1, 3), 7, 0), ((2, 13), [0, 5, 5], 1)])
def test_split(rng, shape, sections, axis):
    _check(lambda x: jnp.split(x, sections, axis=axis), (_data(rng, shape),))


@pytest.mark.parametrize("shapes,axis,dtype", [
    ([(3, 4), (3, 1), (3, 0), (3, 7)], 1, "float32"),
    ([(3, 4), (3, 1), (3, 0), (3, 7)], 1, "bool"),
    ([(1, 5), (2, 5)], 0, "uint16"),
    ([(2, 3, 1)] * 3, 2, "float32"),
])
def test_concatenate(rng, shapes, axis, dtype):
    _check(lambda *xs: jnp.concatenate(xs, axis=axis), tuple(_data(rng, s, dtype) for s in shapes))


@pytest.mark.parametrize("shape,config,dtype", [
    ((4, 3), ((1, 2, 0), (0, 3, 0)), "float32"),             # jnp.pad
    ((5, 7), ((1, -2, 1), (-1, 3, 2)), "float32"),           # negative edges and interior padding
    ((5, 7), ((1, -2, 1), (-1, 3, 2)), "bool"),
    ((1, 6), ((-1, 1, 0), (2, -4, 3)), "int32"),             # a dimension cropped to nothing but padding
    ((3, 1, 2), ((0, 0, 2), (0, 0, 0), (-3, -2, 4)), "uint8"),
    ((0, 3), ((1, 1, 1), (0, 0, 0)), "float32"),             # padding an empty array
])
def test_pad(rng, shape, config, dtype):
    _check(lambda x, v: lax.pad(x, v, config), (_data(rng, shape, dtype), _data(rng, (), dtype)))


def test_jnp_pad_modes(rng):
    f = lambda x: (jnp.pad(x, ((2, 1), (0, 3))), jnp.pad(x, 2, mode="edge"), jnp.pad(x, (1, 2), mode="reflect"))
    _check(f, (_data(rng, (5, 3)),))


@pytest.mark.parametrize("shape,dims", [((5, 3), (0,)), ((2, 7, 1), (1, 2)), ((11,), (0,))])
def test_rev(rng, shape, dims):
    _check(lambda x: (lax.rev(x, dims), x[::-2]), (_data(rng, shape),))


@pytest.mark.parametrize("shape,reps", [((3, 1, 4), (2, 5, 1)), ((7,), (3,))])
def test_tile(rng, shape, reps):
    _check(lambda x: jnp.tile(x, reps), (_data(rng, shape),))


def test_numpy_indexing_forms(rng):
    """What jnp indexing and friends produce, compiled together."""
    def f(x, i, j, segments):
        return (x[i, :, j], x[..., None, 1:3], x[::2, ::-1, 1::3], x.at[:, 1:3].set(7.0), x.at[i, 2].add(1.0),
                jnp.roll(x, 2, axis=1), jnp.repeat(x, 2, axis=2), jnp.diagonal(x, axis1=0, axis2=2),
                jax.ops.segment_sum(x[:, 0], segments, 4))

    _check(f, *[(_data(rng, (6, 5, 4)), _indices(rng, (3,), 4), _indices(rng, (3,), 4),
                 _indices(rng, (6,), 4, out_of_bounds=False)) for _ in range(2)], rtol=1e-6)


def test_custom_scatter_combiner_falls_back(rng):
    """x.at[i].apply(f) carries its own update computation: it runs as an XLA op, or raises under "error"."""
    f = lambda x, i: x.at[i].apply(jnp.sin)
    x, i = _data(rng, (7,)), _indices(rng, (4,), 7)
    with pytest.raises(jnova.UnsupportedPrimitiveError, match="'scatter'"):
        jnova.compile(f, fallback="error")(x, i)
    with pytest.warns(UserWarning, match="'scatter' is not compiled"):
        got = jnova.compile(f)(x, i)
    _same(got, jax.jit(f)(x, i))


# --------------------------------------------------------------------------- dynamic slices
@pytest.mark.parametrize("shape,sizes,index_dtype", [
    ((10, 7), (2, 3), "int32"), ((10, 7), (2, 3), "uint8"), ((5, 1, 13), (5, 1, 4), "int8"), ((3,), (0,), "int32")])
def test_dynamic_slice(rng, shape, sizes, index_dtype):
    f = lambda x, *starts: lax.dynamic_slice(x, starts, sizes)
    inputs = [(_data(rng, shape), *(_indices(rng, (), n, index_dtype) for n in shape)) for _ in range(4)]
    _check(f, *inputs)


@pytest.mark.parametrize("shape,update,dtype,index_dtype", [
    ((10, 7), (2, 3), "float32", "int32"), ((10, 7), (2, 3), "bool", "uint8"), ((5, 1, 13), (5, 1, 4), "int16", "int8"),
    ((4, 3), (0, 3), "float32", "int32"), ((2,), (2,), "float32", "int32")])
def test_dynamic_update_slice(rng, shape, update, dtype, index_dtype):
    f = lambda x, u, *starts: lax.dynamic_update_slice(x, u, starts)
    inputs = [(_data(rng, shape, dtype), _data(rng, update, dtype), *(_indices(rng, (), n, index_dtype) for n in shape))
              for _ in range(4)]
    _check(f, *inputs)


def test_dynamic_slices_run_by_jax_clamp_their_starts(rng):
    """The nova ops run by jax.lax (GPU groups without a builder, and the tests' oracle) clamp their
    starts as the primitives do: jnp's wrapping of a negative start happened where the step was traced
    (a start of -9 in a dimension of 6 reaches the op as -3, which clamps to 0, not wraps to 3)."""
    from helpers.nova_funcs import nova_func
    from jnova.primitives.nova_to_jax import evaluate_ops

    f = lambda x, u, i, j: (lax.dynamic_slice(x, (i, j), (2, 3)), lax.dynamic_update_slice(x, u, (i, j)))
    x, u = _data(rng, (6, 5)), _data(rng, (2, 2))
    for i, j in ((-9, -7), (-8, 1), (2, -6), (-3, 3)):
        i, j = np.int32(i), np.int32(j)
        func = nova_func(f, x, u, i, j)
        got = jax.jit(evaluate_ops(func.ops, func.args, func.returns))(x, u, i, j)
        _same(tuple(got), jax.jit(f)(x, u, i, j))


# --------------------------------------------------------------------------- gather
@pytest.mark.parametrize("table,ids,dtype", [
    ((11, 4), (3, 5), "float32"), ((11, 4), (3, 5), "bfloat16"), ((1, 7), (6,), "int32"),
    ((13, 2, 3), (2, 1, 3), "uint8")])
def test_embedding_lookup(rng, table, ids, dtype):
    """jnp.take (fill mode), table[ids] (promise_in_bounds, clamps) and the other jnp.take modes."""
    f = lambda t, i: (jnp.take(t, i, axis=0), t[i], jnp.take(t, i, axis=0, mode="clip"),
                      jnp.take(t, i, axis=0, mode="wrap"), jnp.take(t, i, axis=0, fill_value=3))
    _check(f, *[(_data(rng, table, dtype), _indices(rng, ids, table[0])) for _ in range(3)])


@pytest.mark.parametrize("shape,axis", [((5, 7), -1), ((3, 1, 4), 1), ((2, 3, 5), 0)])
def test_take_along_axis(rng, shape, axis):
    idx_shape = tuple(1 if d == axis % len(shape) else n for d, n in enumerate(shape))
    f = lambda x, i: (jnp.take_along_axis(x, i, axis=axis), jnp.take_along_axis(x, i, axis=axis, mode="clip"))
    _check(f, *[(_data(rng, shape), _indices(rng, idx_shape, shape[axis])) for _ in range(3)])


def _dnums(offset_dims, collapsed, start_index_map, operand_batching=(), indices_batching=()):
    return lax.GatherDimensionNumbers(offset_dims=offset_dims, collapsed_slice_dims=collapsed,
                                      start_index_map=start_index_map, operand_batching_dims=operand_batching,
                                      start_indices_batching_dims=indices_batching)


# (operand shape, indices shape, dimension numbers, slice sizes): the general XLA forms
GATHER_FORMS = [
    ((7, 5, 3), (4, 2), _dnums((1, 2, 3), (), (0, 1)), (2, 3, 3)),               # windows, no collapsing
    ((11, 6), (2, 3, 1), _dnums((2,), (0,), (0,)), (1, 4)),                      # rows cut to a window
    ((6, 9), (5, 2), _dnums((), (0, 1), (1, 0)), (1, 1)),                        # start_index_map out of order
    ((4, 9, 3), (3, 4, 1), _dnums((2,), (1,), (1,), (0,), (1,)), (1, 1, 3)),     # a batching dim
    ((2, 5, 3, 7), (3, 2, 1), _dnums((1, 3), (2,), (2,), (0,), (1,)), (1, 2, 1, 7)),
    ((5, 3), (4, 0), _dnums((1, 2), (), ()), (5, 3)),                            # no index at all
]


@pytest.mark.parametrize("form", range(len(GATHER_FORMS)))
def test_gather_general(rng, form):
    shape, ishape, dn, sizes = GATHER_FORMS[form]
    index_dtype = ("int32", "uint32", "int8")[form % 3]

    def f(x, i):
        return tuple(lax.gather(x, i, dn, sizes, mode=m) for m in GATHER_MODES) + (
            lax.gather(x, i, dn, sizes, mode="fill", fill_value=-2.5),)

    bound = min(shape[d] for d in dn.start_index_map) if dn.start_index_map else 1
    _check(f, *[(_data(rng, shape), _index_batch(rng, shape, ishape, dn.operand_batching_dims,
                                                  dn.start_indices_batching_dims, bound, index_dtype))
                for _ in range(3)])


def _index_batch(rng, shape, ishape, operand_batching, indices_batching, bound, dtype):
    """Random indices; XLA needs indices batching dims to match the operand's, which they do here by shape."""
    for o, i in zip(operand_batching, indices_batching):
        assert shape[o] == ishape[i]
    return _indices(rng, ishape, bound, dtype)


# --------------------------------------------------------------------------- scatter
def _scatter_all(x, i, u, dn, mode):
    """Every scatter primitive at once: set, add, sub, mul, min, max."""
    kw = dict(dimension_numbers=dn, mode=mode)
    return (lax.scatter(x, i, u, **kw), lax.scatter_add(x, i, u, **kw), lax.scatter_sub(x, i, u, **kw),
            lax.scatter_mul(x, i, u, **kw), lax.scatter_min(x, i, u, **kw), lax.scatter_max(x, i, u, **kw))


def _scatter_dnums(g):
    return lax.ScatterDimensionNumbers(update_window_dims=g.offset_dims, inserted_window_dims=g.collapsed_slice_dims,
                                       scatter_dims_to_operand_dims=g.start_index_map,
                                       operand_batching_dims=g.operand_batching_dims,
                                       scatter_indices_batching_dims=g.start_indices_batching_dims)


@pytest.mark.parametrize("form", range(len(GATHER_FORMS)))
@pytest.mark.parametrize("mode", GATHER_MODES)
def test_scatter_general(rng, form, mode):
    """The transposes of the gather forms, with out-of-bounds and (a few) duplicate indices."""
    shape, ishape, dn, sizes = GATHER_FORMS[form]
    gathered = jax.eval_shape(lambda x, i: lax.gather(x, i, dn, sizes), jnp.zeros(shape), jnp.zeros(ishape, jnp.int32))
    updates = gathered.shape
    bound = min(shape[d] for d in dn.start_index_map) if dn.start_index_map else 1
    f = lambda x, i, u: _scatter_all(x, i, u, _scatter_dnums(dn), mode)
    _check(f, *[(_data(rng, shape), _indices(rng, ishape, bound), _data(rng, updates)) for _ in range(2)])


@pytest.mark.parametrize("table,ids,dtype", [
    ((11, 4), (3, 5), "float32"), ((11, 4), (3, 5), "bfloat16"), ((1, 3), (7,), "float16"), ((1, 3), (7,), "int32"),
    ((5,), (2, 13), "uint8"), ((5,), (2, 13), "bool")])
def test_scatter_at(rng, table, ids, dtype):
    """x.at[ids].add/set/... with duplicate, negative and out-of-bounds ids; 16-bit floats round per update."""
    def f(x, i, u):
        outs = (x.at[i].set(u), x.at[i].min(u), x.at[i].max(u), x.at[i].set(u, mode="promise_in_bounds"),
                x.at[i].max(u, mode="clip"))
        if dtype == "bool":  # jnp has no add or mul on bools
            return outs
        return outs + (x.at[i].add(u), x.at[i].add(u, mode="clip"), x.at[i].mul(u))

    update_shape = ids + table[1:]
    _check(f, *[(_data(rng, table, dtype), _indices(rng, ids, table[0]), _data(rng, update_shape, dtype))
                for _ in range(3)])


def test_scatter_updates_one_buffer_in_place(rng):
    """The scatter loop nest stores into one buffer; nothing needs MLIR's strided-copy runtime library."""
    f = jax.grad(lambda t, i: (jnp.take(t, i, axis=0) ** 2).sum())
    lowered = jnova.compile(f, fallback="error").lower(_data(rng, (11, 4)), _indices(rng, (3, 5), 11))
    assert "tensor.insert " in lowered.as_text("linalg")
    assert "memrefCopy" not in lowered.as_text("llvm")


def test_scatter_add_many_duplicates(rng):
    """All updates land on few rows, in XLA's order: f32 sums match exactly."""
    x, u = _data(rng, (3, 17)), _data(rng, (40, 17))
    _check(lambda x, i, u: x.at[i].add(u), (x, rng.integers(0, 3, (40,)).astype(np.int32), u))


# --------------------------------------------------------------------------- argmax / argmin
@pytest.mark.parametrize("shape,axis,dtype", [
    ((4, 7), 1, "float32"), ((13,), 0, "float32"), ((3, 1, 5), 0, "bfloat16"), ((2, 3, 1), 2, "float32"),
    ((4, 7), 0, "int8"), ((5, 3), 1, "uint16"), ((3, 5), 1, "bool")])
def test_argmax_argmin(rng, shape, axis, dtype):
    f = lambda x: (jnp.argmax(x, axis), jnp.argmin(x, axis), lax.argmax(x, axis, jnp.uint8),
                   lax.argmin(x, axis, jnp.int16))

    def sample():
        x = _data(rng, shape, dtype)
        if dtype in ("float32", "bfloat16"):
            x = np.round(x * 2).astype(dtype)  # ties, and -0.0 next to 0.0
            x[rng.random(shape) < 0.15] = np.nan
            x[rng.random(shape) < 0.1] = -np.inf
        return (x,)

    _check(f, *[sample() for _ in range(3)])


# --------------------------------------------------------------------------- cumulative reductions
@pytest.mark.parametrize("shape,axis", [((5, 7), 1), ((13,), 0), ((3, 1, 4), 0)])
@pytest.mark.parametrize("reverse", [False, True])
def test_cumulative_float(rng, shape, axis, reverse):
    f = lambda x: (lax.cumsum(x, axis, reverse), lax.cumprod(x, axis, reverse), lax.cummax(x, axis, reverse),
                   lax.cummin(x, axis, reverse))
    _check(f, (_data(rng, shape),), rtol=1e-6)


@pytest.mark.parametrize("dtype", ["int32", "uint8"])
def test_cumulative_int(rng, dtype):
    f = lambda x: (jnp.cumsum(x, 1, dtype=dtype), lax.cumprod(x, 0), lax.cummax(x, 1, True), lax.cummin(x, 0))
    _check(f, (_data(rng, (4, 6), dtype),))


# --------------------------------------------------------------------------- a training-step shape
def test_embedding_cross_entropy_grad(rng):
    """value_and_grad of an nn.Embed lookup + optax integer-label cross-entropy (take_along_axis)."""
    import flax.linen as nn
    import optax

    vocab, dim = 17, 6

    class Model(nn.Module):
        @nn.compact
        def __call__(self, ids):
            return nn.Dense(vocab)(nn.Embed(vocab, dim)(ids))

    model = Model()
    ids = rng.integers(0, vocab, (3, 5)).astype(np.int32)
    params = model.init(jax.random.key(int(rng.integers(1 << 30))), ids)

    def loss(params, ids, labels):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, ids), labels).mean()

    f = jax.value_and_grad(loss)
    tokens = lambda: rng.integers(0, vocab, (3, 5)).astype(np.int32)
    _check(f, *[(params, tokens(), tokens()) for _ in range(2)], rtol=1e-5)
