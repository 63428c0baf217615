"""Column reductions (`codegen/gpu/column_reduction.py`) without a GPU: PTX through ptxas for sm_90a
(no spills), and the gpu.func emulated on the CPU (`gpu_emulation.simulate`, one thread after
another; the shared-memory buffer becomes a parameter and the barrier is dropped, which is sound
because the thread that folds the partials is the last of its block) with poisoned outputs against
jax.jit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jnova.codegen.gpu.column_reduction import (build_column_reduction, choose_column_reduction_schedule,
                                               column_reduction_refusal)
from jnova.codegen.gpu.compile import build_gpu_module, compile_gpu_kernel
from jnova.runtime.target import get_target
from helpers.gpu_emulation import assert_outputs_close, poisoned_like, simulate_with_shared_memory
from helpers.kernels import assert_assembles_without_spills, kernel_of, requires_ptxas
from helpers.random_inputs import rand

f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32


def _with_nans(x):
    """NaNs in some columns (one per 7 rows of column 3, every 3rd column of row 5)."""
    return x.at[::7, 3].set(jnp.nan).at[5, ::3].set(jnp.nan)


CASES = {
    "bias_grad_8x1024x768": (lambda x: jnp.sum(x, axis=(0, 1)), [((8, 1024, 768), f32)]),
    "sum_4096x768": (lambda x: jnp.sum(x, axis=0), [((4096, 768), f32)]),
    "sum_3x5x7": (lambda x: jnp.sum(x, axis=(0, 1)), [((3, 5, 7), f32)]),
    "bf16_sum_8x128x768": (lambda x: jnp.sum(x, axis=(0, 1)), [((8, 128, 768), bf16)]),
    "prologue_epilogue": (lambda x, y: jnp.sum(x * y, axis=0) * 0.5, [((512, 384), f32), ((512, 384), f32)]),
    "layernorm_weight_grad_bf16": (lambda g, xhat: jnp.sum(g.astype(f32) * xhat.astype(f32), axis=(0, 1)),
                                   [((4, 256, 768), bf16), ((4, 256, 768), bf16)]),
    "max_nan": (lambda x: jnp.max(x, axis=0), [((300, 40), f32)]),
    "sum_1000x768_last_trip_partial": (lambda x: jnp.sum(x, axis=0), [((1000, 768), f32)]),
    "min_i32_keep_2d": (lambda x: jnp.min(x, axis=0), [((33, 6, 10), i32)]),
    # size-1 dims anywhere (batch 1): the sized reduced dims lead the sized ones
    "sum_unit_batch_1x64x768": (lambda x: jnp.sum(x, axis=1), [((1, 64, 768), f32)]),
    "sum_unit_dims_1x33x1x40": (lambda x: jnp.sum(x * 2.0, axis=(1, 2)), [((1, 33, 1, 40), f32)]),
    "reshaped_output_1x64x96": (lambda x, b: jnp.sum(x, axis=1).reshape(96) * 0.5 + b, [((1, 64, 96), f32), ((96,), f32)]),
}


def case_kernel(name):
    fn, specs = CASES[name]
    args = [rand(shape, dtype, seed) for seed, (shape, dtype) in enumerate(specs)]
    if "nan" in name:
        args = [_with_nans(x) for x in args]
    return fn, args, *kernel_of(fn, *args)


def test_only_leading_dims_are_column_reductions():
    kernel, _ = kernel_of(lambda x: jnp.sum(x, axis=(0, 1)), jnp.ones((2, 3, 4)))
    assert column_reduction_refusal(kernel) is None
    kernel, _ = kernel_of(lambda x: jnp.sum(x, axis=1), jnp.ones((2, 3, 4)))
    assert "not a proper prefix" in column_reduction_refusal(kernel)
    kernel, _ = kernel_of(lambda x: jnp.sum(x, axis=1), jnp.ones((1, 3, 4)))  # size-1 dims aside
    assert column_reduction_refusal(kernel) is None
    kernel, _ = kernel_of(lambda x: jnp.sum(x, axis=(0, 2)), jnp.ones((1, 3, 4)))  # a row reduction
    assert "not a proper prefix" in column_reduction_refusal(kernel)
    kernel, _ = kernel_of(lambda x: jnp.any(x > 1.0, axis=0), jnp.ones((50, 4, 5)))
    assert "reduces bools" in column_reduction_refusal(kernel)


@requires_ptxas
@pytest.mark.parametrize("name", sorted(CASES))
def test_ptx_assembles_without_spills(name):
    _, _, kernel, _ = case_kernel(name)
    launch = assert_assembles_without_spills(kernel, "h200", name)
    assert launch.schedule.startswith("column_reduction(")


def test_schedule_reads_16_bytes_and_spreads_columns_over_blocks():
    _, _, kernel, _ = case_kernel("sum_4096x768")
    launch = compile_gpu_kernel(kernel, get_target("h200"))
    assert "vector=4" in launch.schedule and "ld.global.v4" in launch.ptx
    assert launch.grid[0] * launch.block[0] >= 768 // 4 and launch.block[0] % 32 == 0
    _, _, kernel, _ = case_kernel("bf16_sum_8x128x768")
    assert "vector=8" in compile_gpu_kernel(kernel, get_target("h200")).schedule


def _module(kernel, rows_in_flight: int):
    """The kernel's gpu.module with the configurator's schedule, reading `rows_in_flight` rows a trip."""
    h200 = get_target("h200")
    sched = choose_column_reduction_schedule(kernel, h200)
    ahead = max(1, min(rows_in_flight, -(-sched.rows // sched.row_lanes)))
    return build_column_reduction(kernel, h200, dataclasses.replace(sched, rows_in_flight=ahead))


def test_threads_read_four_rows_before_folding_them():
    """With rows_in_flight=4 each thread's fold has four rows' loads per trip (none waits for another
    row's fold); a thread with fewer rows reads only those; the configurator's schedule reads one (the
    kernel as it was, until four is measured on a GPU)."""
    for name, rows_each in (("sum_4096x768", 4), ("sum_3x5x7", 1)):
        _, _, kernel, _ = case_kernel(name)
        text = _module(kernel, 4).text
        assert text.count("vector.load") + text.count("memref.load %in") == rows_each, name
        default = build_gpu_module(kernel, get_target("h200"))
        assert default.text.count("vector.load") + default.text.count("memref.load %in") == 1
        assert "rows_in_flight" not in default.schedule


@pytest.mark.parametrize("rows_in_flight", [1, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_simulated_on_cpu_matches_jit(name, rows_in_flight):
    fn, args, kernel, inputs = case_kernel(name)
    module = _module(kernel, rows_in_flight)
    assert module.schedule.startswith("column_reduction(") and "gpu.shuffle" not in module.text
    want = jax.tree.leaves(jax.jit(fn)(*args))
    if name == "max_nan":  # NumPy propagates NaN as rules_reduce.py does (this jax.jit on CPU drops it)
        want = [np.max(np.asarray(args[0]), axis=0)]
    outs = [poisoned_like(np.asarray(w)) for w in want]
    simulate_with_shared_memory(module, inputs, outs)
    bf16 = "bf16" in name
    assert_outputs_close(outs, want, rtol=2e-2 if bf16 else 1e-5, atol=1e-3 if bf16 else 1e-4)
    if name == "max_nan":
        assert np.isnan(outs[0]).sum() == np.isnan(np.asarray(want[0])).sum() > 0
