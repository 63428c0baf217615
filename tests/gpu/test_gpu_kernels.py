"""GPU kernels on the GPU (`pytest -m gpu`, run by scripts/gpu_run.sh): each kernel family against
jnp on fresh random inputs, launched through `nova_kernel_p`'s CUDA lowering inside `jax.jit`.

Outputs are poisoned: each result aliases a donated operand that differs from the expected value in
every element (NaN where a float is expected, expected + 1 for integers, the negation for bools),
so an element the kernel does not write fails the comparison."""
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from helpers.gpu_launch import TARGET, poisoned_like, run_kernel  # noqa: E402  (skips without a GPU)
from helpers.kernels import kernel_of  # noqa: E402
from helpers.random_inputs import rand
from helpers.row_programs import ROW_PROGRAMS  # noqa: E402
from jnova.codegen.gpu.compile import compile_gpu_kernel  # noqa: E402
from jnova.primitives import gpu_lowering  # noqa: E402
from jnova.primitives.gpu_lowering import GpuKernelHandle  # noqa: E402
from jnova.primitives.nova_kernel import nova_kernel_p  # noqa: E402
from jnova.runtime import jax_internals  # noqa: E402

f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32


def check(fn, specs, rtol, atol=0.0, seed=None):
    rng = np.random.default_rng(seed)
    args = [rand(shape, dtype, rng) for shape, dtype in specs]
    kernel, inputs = kernel_of(fn, *args)
    launch = compile_gpu_kernel(kernel, TARGET)
    want = jax.tree.leaves(jax.jit(fn)(*args))
    got = run_kernel(launch, kernel, inputs, [poisoned_like(w) for w in want])
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        g, w = np.asarray(g), np.asarray(w)
        if w.dtype == jnp.bfloat16:
            g, w = g.astype(np.float32), w.astype(np.float32)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=launch.schedule)
    return launch


ELEMENTWISE = {
    "f32_chain_1000x77": (lambda x, y: jnp.tanh(x) * y + 1.0, [((1000, 77), f32), ((1000, 77), f32)], 1e-5),
    "f32_flat_4M_plus_3": (lambda x, y: x * 0.9 + y * 0.1, [((4 * 2**20 + 3,), f32), ((4 * 2**20 + 3,), f32)], 1e-5),
    "f32_33": (lambda x: jnp.exp(x) / (1 + jnp.abs(x)), [((33,), f32)], 1e-5),
    "bf16_ops": (lambda x, y: x * y + x, [((1000, 77), bf16), ((1000, 77), bf16)], 1e-2),
    "bf16_in_out_f32_math": (lambda x, y: (jax.nn.sigmoid(x.astype(f32)) * y.astype(f32)).astype(bf16),
                             [((8191, 128), bf16), ((8191, 128), bf16)], 1e-2),
    "int32": (lambda a, b: (a * 3 + b) // 7 ^ (a >> 2), [((1000, 77), i32), ((1000, 77), i32)], 0),
    "bool_mask": (lambda x, y: jnp.where((x > 0) & (y < 0.5), x, -y), [((257, 33), f32), ((257, 33), f32)], 0),
    "bool_out": (lambda x, y: (x > y) | (x < -1), [((1000, 77), f32), ((1000, 77), f32)], 0),
    "broadcast_rows_cols": (lambda x, r, c: x * r[:, None] + c[None, :] + 2.0,
                            [((1000, 77), f32), ((1000,), f32), ((77,), f32)], 1e-5),
    "broadcast_rows_cols_aligned": (lambda x, r, c: x * r[:, None] + c[None, :],
                                    [((512, 256), bf16), ((512,), bf16), ((256,), bf16)], 1e-2),
    "broadcast_size1_dims": (lambda x, b: x + b, [((64, 1, 128), f32), ((1, 7, 1), f32)], 1e-5),
    "iota": (lambda x: x + jnp.arange(128.0), [((33, 128), f32)], 1e-5),
    "math": (lambda x: jnp.log1p(jnp.abs(x)) + jax.scipy.special.erf(x) + jnp.expm1(x)
             + jax.lax.erf_inv(jnp.tanh(x)) + jnp.round(x) * jnp.isfinite(x) + jnp.arctan2(x, 2.0) + x ** 3,
             [((100003,), f32)], 1e-4),
    "two_outputs": (lambda x: (x * 2, jnp.sin(x) > 0), [((999,), f32)], 1e-5),
}
REDUCTIONS = {
    "sum_exp_31": (lambda x: jnp.sum(jnp.exp(x - 1.0), axis=-1), [((4096, 31), f32)], 1e-5),
    "mean_bf16_1024": (lambda x: jnp.mean(x.astype(f32), axis=-1), [((4096, 1024), bf16)], 1e-5),
    "max_bf16_50304": (lambda x: jnp.max(x, axis=-1), [((64, 50304), bf16)], 0),
    "sum_f32_50304": (lambda x: jnp.sum(x, axis=-1), [((64, 50304), f32)], 1e-4),
    "min_i32_rows_of_1": (lambda x: jnp.min(x, axis=-1), [((1000, 1), i32)], 0),
    "sum_3_cols": (lambda x: jnp.sum(x * x, axis=-1), [((1000, 3), f32)], 1e-6),
    "sum_two_dims": (lambda x: jnp.sum(x * x, axis=(1, 2)), [((32, 4, 256), f32)], 1e-5),
    "any_mask": (lambda x: jnp.any(x > 0, axis=-1), [((16, 1000), f32)], 0),
    "sum_with_bias_odd_rows": (lambda x, b: jnp.sum(x + b, axis=-1), [((129, 1024), f32), ((1024,), f32)], 1e-5),
    # size-1 dims among the reduced and kept ones (batch 1): still rows of the innermost sized dims
    "sum_unit_dims_1x64x768": (lambda x: jnp.sum(x * x, axis=(0, 2)), [((1, 64, 768), f32)], 1e-5),
    "max_unit_last_64x48x1": (lambda x: jnp.max(x, axis=(1, 2)), [((64, 48, 1), f32)], 0),
    "size_1_dims_only_1x32": (lambda x: jnp.sum(x * jnp.arange(32.0, dtype=f32), axis=0), [((1, 32), f32)], 1e-6),
    "broadcast_output_1x64x768": (lambda x, y: jnp.sum(x, axis=(0, 2))[None, :] * 2.0 - y, [((1, 64, 768), f32), ((1, 64), f32)], 1e-5),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise_kernel_matches_jnp(name):
    fn, specs, rtol = ELEMENTWISE[name]
    check(fn, specs, rtol, atol=1e-5 if rtol else 0)


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_row_reduction_kernel_matches_jnp(name):
    fn, specs, rtol = REDUCTIONS[name]
    cols = specs[0][0][-1] if name != "sum_two_dims" else 1024
    check(fn, specs, rtol, atol=1e-5 * cols ** 0.5)


@pytest.mark.parametrize("name", sorted(ROW_PROGRAMS))
def test_row_program_kernel_matches_jnp(name):
    """Softmax, LayerNorm and its gradient, log-softmax: a warp per row, partial slots, rows past the
    grid's last, several warps per row (tests/test_row_programs.py simulates them on the CPU)."""
    fn, specs, rtol = ROW_PROGRAMS[name]
    launch = check(fn, specs, rtol, atol=rtol)
    assert launch.schedule.startswith("row_program(")


TRANSPOSES = {
    "weight_768x3072": (lambda x: x.T, [((768, 3072), f32)]),
    "ragged_100x36": (lambda x: x.T, [((100, 36), f32)]),
    "split_k_view_8x1024x768": (lambda x: x.reshape(4, 2048, 768).transpose(0, 2, 1), [((8, 1024, 768), f32)]),
    "int32_dim_groups": (lambda x: x.transpose(2, 3, 0, 1), [((4, 8, 12, 20), i32)]),
}


@pytest.mark.parametrize("name", sorted(TRANSPOSES))
def test_tiled_transpose_kernel_matches_jnp(name):
    """The tiled transpose (shared-memory tile, 16-byte accesses): exact, ragged tiles included."""
    fn, specs = TRANSPOSES[name]
    launch = check(fn, specs, 0)
    assert launch.schedule.startswith("transpose(")


def test_launch_without_poison_inside_a_jitted_step():
    rng = np.random.default_rng()
    x, y = rand((1000, 77), f32, rng), rand((1000, 77), f32, rng)
    kernel, inputs = kernel_of(lambda a, b: jnp.tanh(a) * b, x, y)
    assert inputs[0] is x and inputs[1] is y
    handle = GpuKernelHandle(compile_gpu_kernel(kernel, TARGET), [v.type for v in kernel.outputs])

    @jax.jit
    def step(a, b):  # XLA ops around the kernel, its result used twice
        (out,) = nova_kernel_p.bind(a * 2, b, kernel=handle)
        return out.sum(), out + 1

    terms = np.tanh(np.asarray(x, np.float64) * 2) * np.asarray(y, np.float64)
    for _ in range(2):
        total, plus = step(x, y)
        np.testing.assert_allclose(plus, jnp.tanh(x * 2) * y + 1, rtol=1e-5, atol=1e-5)
        # terms of both signs can cancel to a sum far below their magnitudes: the f32 sum's error is
        # bounded by the rounding of those magnitudes, not by the sum
        np.testing.assert_allclose(total, terms.sum(), rtol=1e-5, atol=8 * 2.0**-24 * np.abs(terms).sum())


def test_hand_encoded_kernel_call_equals_jaxlibs_and_launches(monkeypatch):
    rng = np.random.default_rng()
    x = rand((4099,), f32, rng)
    kernel, inputs = kernel_of(lambda a: jnp.exp(a) - 1, x)
    launch = compile_gpu_kernel(kernel, TARGET)
    triton = jax_internals.gpu_triton()
    assert triton is not None, "a CUDA jaxlib should have TritonKernel"
    ours = gpu_lowering._encode_kernel_call(launch, 3)
    theirs = gpu_lowering.kernel_call_proto(launch, 3)
    print("hand-encoded", len(ours), "bytes; jaxlib", len(theirs), "bytes; equal:", ours == theirs)
    monkeypatch.setattr(jax_internals, "gpu_triton", lambda: None)  # force the hand-written protobuf
    monkeypatch.setenv("JNOVA_LAUNCHER", "jaxlib")  # launch through jaxlib's kernel call
    assert zlib.compress(gpu_lowering.kernel_call_proto(launch, 3)) == zlib.compress(ours)
    poison = [jnp.full(x.shape, jnp.nan, f32)]
    (got,) = run_kernel(launch, kernel, inputs, poison)
    np.testing.assert_allclose(got, jnp.exp(x) - 1, rtol=1e-5, atol=1e-5)
    assert ours == theirs, "hand-encoded protobuf differs from jaxlib's (it still launched correctly)"


def test_both_launchers_give_the_same_results(monkeypatch):
    """jnova's launcher (the default, used by every other test here) and jaxlib's PTX kernel call
    launch the same kernel, with the same aliased poison buffers, to the same bits."""
    rng = np.random.default_rng()
    x, y = rand((3001, 77), f32, rng), rand((3001, 77), f32, rng)
    kernel, inputs = kernel_of(lambda a, b: (jnp.tanh(a) * b, a - b), x, y)
    launch = compile_gpu_kernel(kernel, TARGET)
    results = {}
    for name in ("jnova", "jaxlib"):
        monkeypatch.setenv("JNOVA_LAUNCHER", name)
        handle = GpuKernelHandle(launch, [v.type for v in kernel.outputs])
        hlo = jax.jit(lambda *xs: nova_kernel_p.bind(*xs, kernel=handle)).lower(*inputs).as_text()
        assert ("jnova_launch" in hlo) == (name == "jnova")
        results[name] = run_kernel(launch, kernel, inputs, [jnp.full(x.shape, jnp.nan, f32) for _ in range(2)])
    for a, b in zip(results["jnova"], results["jaxlib"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(results["jnova"][0], jnp.tanh(x) * y, rtol=1e-5, atol=1e-6)
