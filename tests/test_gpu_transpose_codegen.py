"""The tiled transpose builder: which transposes it takes, its kernels emulated on the CPU against
jax.lax with poisoned outputs, and ptxas on them."""
import numpy as np
import pytest

import jax.numpy as jnp
from helpers.gpu_emulation import check_kernel, gpu_plan
from jnova.codegen.gpu.compile import build_gpu_module, compile_gpu_kernel
from jnova.codegen.gpu.ptx import assemble_check, ptxas_path
from jnova.codegen.gpu.transpose import transpose_refusal, transpose_view
from jnova.runtime.target import PRESETS

H200 = PRESETS["h200"]

CASES = {  # name: (function, argument shape, dtype, (batch, rows, cols))
    "matrix": (lambda x: x.T, (192, 320), np.float32, (1, 192, 320)),
    "ragged_tiles": (lambda x: x.T, (100, 36), np.float32, (1, 100, 36)),
    "batched": (lambda x: x.transpose(0, 2, 1), (3, 68, 132), np.float32, (3, 68, 132)),
    "dim_groups": (lambda x: x.transpose(2, 3, 0, 1), (4, 8, 12, 20), np.float32, (1, 32, 240)),
    "batch_and_groups": (lambda x: x.transpose(0, 3, 1, 2), (2, 8, 12, 16), np.int32, (2, 96, 16)),
    "split_k_view": (lambda x: x.reshape(4, 96, 40).transpose(0, 2, 1), (8, 48, 40), np.float32, (4, 96, 40)),
}


def _kernel(fn, shape, dtype):
    x = np.zeros(shape, dtype)
    _, plan = gpu_plan(fn, x)
    (kernel,) = plan.kernels
    return kernel


@pytest.mark.parametrize("name", sorted(CASES))
def test_tiled_transpose_matches_lax(name):
    fn, shape, dtype, view = CASES[name]
    kernel = _kernel(fn, shape, dtype)
    assert transpose_view(kernel) == view and transpose_refusal(kernel) is None
    assert build_gpu_module(kernel, H200).schedule.startswith("transpose(")
    simulated, problems = check_kernel(kernel, H200, np.random.default_rng(0))
    assert simulated and not problems, problems


@pytest.mark.parametrize("fn, shape, dtype, reason", [
    (lambda x: x.T, (30, 64), np.float32, "not whole 16-byte vectors"),      # 30 rows
    (lambda x: x.T, (64, 64), jnp.bfloat16, "4-byte only"),
    (lambda x: x.transpose(1, 0, 2), (8, 16, 32), np.float32, "two trailing groups"),
    (lambda x: x.T * 2.0, (64, 64), np.float32, "two trailing groups"),     # fused with its consumer
])
def test_other_transposes_are_left_to_the_elementwise_builder(fn, shape, dtype, reason):
    kernel = _kernel(fn, shape, dtype)
    assert reason in transpose_refusal(kernel)
    assert not build_gpu_module(kernel, H200).schedule.startswith("transpose(")


@pytest.mark.skipif(ptxas_path() is None, reason="ptxas not installed")
def test_tiled_transpose_assembles_for_sm90a_and_sm86():
    kernel = _kernel(lambda x: x.T, (8192, 3072), np.float32)
    for target in (H200, PRESETS["rtx3060"]):
        report = assemble_check(compile_gpu_kernel(kernel, target).ptx, target.arch)
        assert report.spills == 0, report


def test_the_barrier_matters_in_the_emulation():
    """Run as one pass of threads (the barrier ignored), a thread reads tile elements other threads
    have not loaded yet: the emulation that runs the phases in order is what makes it exact."""
    from helpers.gpu_emulation import poisoned_like, simulate_in_phases, simulate_with_shared_memory

    kernel = _kernel(lambda x: x.T, (128, 64), np.float32)
    module = build_gpu_module(kernel, H200)
    x = np.random.default_rng(2).standard_normal((128, 64)).astype(np.float32)
    for run, exact in ((simulate_in_phases, True), (simulate_with_shared_memory, False)):
        out = poisoned_like(x.T.copy())
        run(module, [x], [out])
        assert np.array_equal(out, x.T) == exact
