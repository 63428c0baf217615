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
from helpers.gpu_emulation import check_plan_kernels, gpu_plan
from jnova.passes.configure.reduction_split import (COLUMN_BLOCKS_PER_SM, MIN_PART, MIN_PART_ROWS, MIN_SPLIT_COLS,
                                                    choose_column_splits, choose_reduction_splits, column_blocks)
from jnova.codegen.gpu.compile import build_gpu_module
from jnova.errors import LoweringError
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


# -- column reductions: over leading dims into few columns

@pytest.mark.parametrize("rows, cols, item", [(8192, 768, 2), (8192, 3072, 2), (8192, 2304, 2), (8192, 768, 4),
                                              (1 << 16, 2, 4), (6 * 1000, 50, 4)])
def test_few_columns_over_many_rows_are_split_to_fill_the_sms(rows, cols, item):
    """A bias gradient (B*T rows of 768 bf16 columns) gives the column kernel 48 blocks: split into P
    partial reductions of rows / P rows, P * cols columns give it the blocks of every SM."""
    splits = choose_column_splits(rows, cols, item, H200)
    assert splits > 1 and rows % splits == 0 and rows // splits >= MIN_PART_ROWS
    assert column_blocks(splits * cols, item) >= COLUMN_BLOCKS_PER_SM * H200.sm_count or rows // splits < 2 * MIN_PART_ROWS


@pytest.mark.parametrize("rows, cols, item", [(4, 589824, 4), (8, 786432, 4), (64, 768, 2), (8191, 768, 2), (256, 16, 4)])
def test_columns_that_fill_the_gpu_few_rows_and_prime_row_counts_stay_whole(rows, cols, item):
    assert choose_column_splits(rows, cols, item, H200) == 1


def _bias_grad(dy):
    return jnp.sum(dy, axis=(0, 1))


def _column_max(x):
    return jnp.max(x, axis=0)


@pytest.mark.parametrize("fn, shape, dtype", [(_bias_grad, (8, 1024, 768), "bfloat16"),
                                              (_bias_grad, (4, 512, 96), "float32"),
                                              (_column_max, (1 << 14, 3), "float32"),
                                              (lambda x: jnp.sum(x, axis=0), (1 << 16, 2), "float32")])
def test_the_column_split_program_computes_the_same_values(fn, shape, dtype):
    rng = np.random.default_rng()
    x = normal(rng, shape, dtype)
    func = nova_func(fn, x)
    assert split_reductions(func, H200) == 1
    func.verify()
    reduces = [op for op in func.ops if op.name == "nova.reduce"]
    assert len(reduces) == 2 and all(op.attrs["dims"] == (0,) for op in reduces)
    assert reduces[0].results[0].type.size > reduces[1].results[0].type.size  # P * cols partials, then cols
    got = np.asarray(jax.jit(evaluate_ops(func.ops, func.args, func.returns))(x)[0], np.float64)
    exact = np.asarray(fn(jnp.asarray(np.asarray(x, np.float64) if dtype == "float32" else x.astype(np.float32))),
                       np.float64)
    if dtype == "bfloat16":  # accumulated in f32 and rounded once
        assert reduces[0].operands[0].type.dtype == "float32"
        np.testing.assert_allclose(got, np.asarray(exact.astype(ml_dtypes.bfloat16), np.float64), rtol=8e-3)
    else:
        np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5 * np.sqrt(shape[0]))


def test_reductions_over_leading_dims_into_many_columns_are_left_alone():
    func = nova_func(lambda x: jnp.sum(x, axis=0), normal(None, (8, 1 << 18)))
    assert split_reductions(func, H200) == 0


def _dense_step(w, b, x):
    return jax.grad(lambda w, b: jnp.sum(jnp.tanh((x @ w + b).astype(jnp.float32))), argnums=(0, 1))(w, b)


def test_a_bias_gradient_on_the_h200_is_read_by_every_sm_and_its_kernels_simulate():
    """The bias gradient of a bf16 Dense layer over 4096 rows: two column reductions, the first over
    P * 768 columns with at least COLUMN_BLOCKS_PER_SM blocks per SM; each simulated equals lax."""
    rng = np.random.default_rng()
    w, b, x = normal(rng, (256, 768), "bfloat16"), normal(rng, (768,), "bfloat16"), normal(rng, (4096, 256), "bfloat16")
    kernels = gpu_plan(_dense_step, w, b, x, target=H200)[1].kernels
    grids = [int(m.group(1)) for k in kernels
             for m in re.finditer(r"column_reduction\(rows=\d+, cols=\d+, .*grid=(\d+)\)", _schedule(k))]
    assert grids and max(grids) >= COLUMN_BLOCKS_PER_SM * H200.sm_count, grids
    simulated, problems = check_plan_kernels(_dense_step, w, b, x, target=H200)
    assert simulated >= 2 and not problems, problems


def _schedule(kernel) -> str:
    try:
        return build_gpu_module(kernel, H200).schedule
    except LoweringError:
        return ""


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
