"""Column reductions on the GPU (`pytest -m gpu`): the cases of test_gpu_column_reduction_codegen.py
(bias and LayerNorm-weight gradients at GPT-2 124M shapes, bf16, a fused prologue and epilogue,
max with NaN) against jnp on fresh random inputs, with poisoned outputs (see test_gpu_kernels.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jnova.codegen.gpu.compile import compile_gpu_kernel
from helpers.gpu_launch import TARGET, poisoned_like, run_kernel  # skips without a GPU
from helpers.kernels import kernel_of
from helpers.random_inputs import rand

pytestmark = pytest.mark.gpu
f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32

CASES = {
    "bias_grad_8x1024x768": (lambda x: jnp.sum(x, axis=(0, 1)), [((8, 1024, 768), f32)]),
    "sum_4096x768": (lambda x: jnp.sum(x, axis=0), [((4096, 768), f32)]),
    "sum_3x5x7": (lambda x: jnp.sum(x, axis=(0, 1)), [((3, 5, 7), f32)]),
    "bf16_bias_grad_8x1024x768": (lambda x: jnp.sum(x, axis=(0, 1)), [((8, 1024, 768), bf16)]),
    "prologue_epilogue": (lambda x, y: jnp.sum(x * y, axis=0) * 0.5, [((512, 384), f32), ((512, 384), f32)]),
    "layernorm_weight_grad_bf16": (lambda g, xhat: jnp.sum(g.astype(f32) * xhat.astype(f32), axis=(0, 1)),
                                   [((8, 1024, 768), bf16), ((8, 1024, 768), bf16)]),
    "max_nan": (lambda x: jnp.max(x, axis=0), [((300, 40), f32)]),
    "min_i32_keep_2d": (lambda x: jnp.min(x, axis=0), [((33, 6, 10), i32)]),
    # size-1 dims anywhere (batch 1): the sized reduced dims lead the sized ones
    "sum_unit_batch_1x64x768": (lambda x: jnp.sum(x, axis=1), [((1, 64, 768), f32)]),
    "sum_unit_dims_1x33x1x40": (lambda x: jnp.sum(x * 2.0, axis=(1, 2)), [((1, 33, 1, 40), f32)]),
    "reshaped_output_1x64x96": (lambda x, b: jnp.sum(x, axis=1).reshape(96) * 0.5 + b, [((1, 64, 96), f32), ((96,), f32)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_column_reduction_matches_jnp(name):
    fn, specs = CASES[name]
    rng = np.random.default_rng(0)
    args = [rand(shape, dtype, rng) for shape, dtype in specs]
    if name == "max_nan":
        args = [x.at[::7, 3].set(jnp.nan).at[5, ::3].set(jnp.nan) for x in args]
    kernel, inputs = kernel_of(fn, *args)
    launch = compile_gpu_kernel(kernel, TARGET)
    assert launch.schedule.startswith("column_reduction("), launch.schedule
    want = jax.tree.leaves(jax.jit(fn)(*args))
    if name == "max_nan":  # NaN-propagating, as rules_reduce.py defines max
        want = [jnp.asarray(np.max(np.asarray(args[0]), axis=0))]
    got = run_kernel(launch, kernel, inputs, [poisoned_like(w) for w in want])
    tol = 2e-2 if "bf16" in name else 1e-5
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        g, w = np.asarray(g), np.asarray(w)
        if w.dtype == jnp.bfloat16:
            g, w = g.astype(np.float32), w.astype(np.float32)
        np.testing.assert_allclose(g, w, rtol=tol, atol=1e-3 if "bf16" in name else 1e-3, err_msg=launch.schedule)
