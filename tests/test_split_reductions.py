"""split_reductions: reductions into fewer rows than the GPU has SMs, as partial reductions."""
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jnova
from helpers.nova_funcs import nova_func
from helpers.random_inputs import normal
from jnova.passes.configure.reduction_split import MIN_PART, MIN_SPLIT_COLS, choose_reduction_splits
from jnova.passes.split_reductions import split_reductions
from jnova.primitives.nova_to_jax import evaluate_ops
from jnova.runtime.target import PRESETS

H200 = PRESETS["h200"]


@pytest.mark.parametrize("rows, cols", [(1, 50304 * 768), (1, 2304 * 768), (12, 768 * 768), (3, 7 * 4096 * 5)])
def test_few_long_rows_are_split_to_fill_the_sms(rows, cols):
    splits = choose_reduction_splits(rows, cols, H200)
    assert splits > 1 and cols % splits == 0 and cols // splits >= MIN_PART
    assert rows * splits >= H200.sm_count or cols // splits < 2 * MIN_PART


@pytest.mark.parametrize("rows, cols", [(H200.sm_count, 1 << 20), (8192, 50304), (1, 8192), (1, MIN_SPLIT_COLS - 1),
                                        (1, 1_000_003)])   # enough rows; a short row; a prime length
def test_rows_that_fill_the_gpu_short_rows_and_prime_lengths_stay_whole(rows, cols):
    assert choose_reduction_splits(rows, cols, H200) == 1


def _sum_of_squares(g):
    return jnp.sum(g * g)


def _row_max(x):
    return jnp.max(x, axis=(1, 2))


@pytest.mark.parametrize("fn, shape, dtype", [(_sum_of_squares, (2304, 768), "float32"),
                                              (_row_max, (3, 512, 1024), "float32"),
                                              (_sum_of_squares, (1024, 96), "bfloat16"),
                                              (lambda x: jnp.prod(x, axis=-1), (2, 65536), "float32")])
def test_the_split_program_computes_the_same_values(fn, shape, dtype):
    rng = np.random.default_rng()
    x = normal(rng, shape, dtype)
    if fn not in (_sum_of_squares, _row_max):  # a product of many factors near 1
        x = (1 + 1e-4 * normal(rng, shape)).astype(np.float32)
    func = nova_func(fn, x)
    assert split_reductions(func, H200) == 1
    func.verify()
    reduces = [op for op in func.ops if op.name == "nova.reduce"]
    assert len(reduces) == 2 and reduces[0].operands[0].owner.name == "nova.reshape"
    got = np.asarray(jax.jit(evaluate_ops(func.ops, func.args, func.returns))(x)[0], np.float64)
    exact = np.asarray(fn(jnp.asarray(np.asarray(x, np.float64) if dtype == "float32" else x.astype(np.float32))),
                       np.float64)
    if dtype == "bfloat16":  # accumulated in f32 and rounded once, as the unsplit reduction does
        assert reduces[0].operands[0].type.dtype == "float32"
        np.testing.assert_allclose(got, np.asarray(exact.astype(ml_dtypes.bfloat16), np.float64), rtol=8e-3)
    else:
        np.testing.assert_allclose(got, exact, rtol=1e-5)


def test_reductions_over_leading_dims_are_left_alone():
    func = nova_func(lambda x: jnp.sum(x, axis=0), normal(None, (1 << 16, 2)))
    assert split_reductions(func, H200) == 0


def _clipped_sgd(params, x):
    grads = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) @ p["v"]))(params)
    grads, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def test_global_norm_clipping_on_the_h200_reads_each_gradient_with_every_sm():
    """optax.clip_by_global_norm's sum of squares of each gradient: a reduction into one value, a row
    reduction of one block before the split, now partial reductions over at least the SM count."""
    rng = np.random.default_rng()
    params = {"w": normal(rng, (2048, 1024)), "v": normal(rng, (1024, 4))}
    launches = jnova.compile(_clipped_sgd, target="h200").lower(params, normal(rng, (64, 2048))).as_text("launches")
    shapes = [(int(m.group(1)), int(m.group(2))) for m in re.finditer(r"row_reduction\(rows=(\d+), cols=(\d+)", launches)]
    assert shapes, launches
    assert all(rows >= H200.sm_count or cols < MIN_SPLIT_COLS for rows, cols in shapes), shapes
    splits = choose_reduction_splits(1, 2048 * 1024, H200)
    assert (splits, 2048 * 1024 // splits) in shapes and (1, splits) in shapes, shapes


def test_a_clipped_step_on_the_cpu_still_equals_jax_jit():
    rng = np.random.default_rng()
    params = {"w": normal(rng, (256, 128)), "v": normal(rng, (128, 4))}
    x = normal(rng, (16, 256))
    got = jnova.compile(_clipped_sgd)(params, x)
    want = jax.jit(_clipped_sgd)(params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
