"""Data movement on the GPU (`pytest -m gpu`): kernels that read through transposes, slices, reversals,
pads, concatenations, dynamic slices and gathers, at GPT-2 124M shapes and awkward ones, against jnp on
fresh random inputs with poisoned outputs (see test_gpu_kernels.py); scatter-add kernels with their
output aliased to the operand; and small steps compiled by jnova.compile (fused plan) against jax.jit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from helpers.gpu_launch import TARGET, poisoned_like, run_kernel  # skips without a GPU
from helpers.kernels import kernel_of
from helpers.random_inputs import rand

from jnova.codegen.gpu.compile import compile_gpu_kernel
from jnova.primitives.gpu_lowering import GpuKernelHandle
from jnova.primitives.nova_kernel import nova_kernel_p

pytestmark = pytest.mark.gpu
f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
B, T, C, H = 8, 1024, 768, 12  # GPT-2 124M


def _rows(mode):
    """x[i[..., 0]] += u[...] for whole rows of x (the embedding gradient's form)."""
    def scatter(x, i, u):
        dn = lax.ScatterDimensionNumbers(update_window_dims=(u.ndim - 1,), inserted_window_dims=(0,),
                                         scatter_dims_to_operand_dims=(0,))
        return lax.scatter_add(x, i, u, dn, mode=mode)
    return scatter


def _one_hot(x, i, u):
    dn = lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(1,), scatter_dims_to_operand_dims=(1,),
                                     operand_batching_dims=(0,), scatter_indices_batching_dims=(0,))
    return lax.scatter_add(x, i, u, dn, mode="fill")


# name -> (function, [(shape, dtype)], {argument index: (low, high) of random integer indices}, rtol)
REMAPS = {
    "head_split_scale": (lambda x: x.reshape(B, T, H, C // H).transpose(0, 2, 1, 3) * 0.125,
                         [((B, T, C), f32)], {}, 1e-6),
    "head_merge_bf16": (lambda x: x.transpose(0, 2, 1, 3).reshape(B, T, C), [((B, H, T, C // H), bf16)], {}, 0),
    "qkv_slice": (lambda x: x.reshape(B, T, 3 * H, C // H)[:, :, H:2 * H] * 2, [((B, T, 3 * C), f32)], {}, 1e-6),
    "weight_transpose": (lambda g, m: g.T * 0.1 + m, [((C, 4 * C), f32), ((4 * C, C), f32)], {}, 1e-6),
    "transpose_awkward": (lambda x: jnp.tanh(x).T, [((1000, 77), f32)], {}, 1e-6),
    "slice_shifted": (lambda x: x[:, 1:] * 2, [((1000, 65), f32)], {}, 1e-6),
    "slice_strided": (lambda x: x[1::2, ::3] + 1, [((999, 301), f32)], {}, 1e-6),
    "reverse": (lambda x, y: jnp.flip(x, (0, 1)) * y, [((513, 256), f32), ((513, 256), f32)], {}, 1e-6),
    "pad_rows": (lambda x: jnp.pad(x, ((1, 2), (0, 0)), constant_values=-3.0) + 1, [((1000, 128), f32)], {}, 1e-6),
    "pad_interior_negative": (lambda x: lax.pad(x, 0.5, ((1, -1, 1), (-2, 2, 0))) - 1, [((333, 77), f32)], {}, 1e-6),
    "concat_qkv_grads": (lambda q, k, v: jnp.concatenate([q, k * 2, v], axis=-1),
                         [((B, T, C), f32), ((B, T, C), f32), ((B, T, C), f32)], {}, 1e-6),
    "concat_unaligned": (lambda x, y: jnp.concatenate([x, jnp.exp(y)], axis=1), [((1000, 5), f32), ((1000, 3), f32)],
                         {}, 1e-6),
    "dynamic_slice_clamped": (lambda x, i: lax.dynamic_slice(x, (i, 3), (100, 50)) * 2, [((1000, 77), f32), ((), i32)],
                              {1: (900, 2000)}, 1e-6),
    "dynamic_slice_rows": (lambda x, i: lax.dynamic_slice(x, (i, 0), (T, C)) + 1, [((2048, C), f32), ((), i32)],
                           {1: (0, 1024)}, 1e-6),
    "embedding_plus_positions": (
        lambda wte, wpe, ids: jnp.take(wte, ids, axis=0, mode="fill", fill_value=jnp.nan) + wpe[None],
        [((50257, C), f32), ((T, C), f32), ((B, T), i32)], {2: (0, 50257)}, 1e-6),
    "embedding_out_of_range": (lambda w, ids: jnp.take(w, ids, axis=0, mode="fill", fill_value=-7.0),
                               [((1000, 64), bf16), ((333, 3), i32)], {1: (-1200, 1200)}, 0),
    "take_along_axis": (lambda x, idx: jnp.take_along_axis(x, idx, axis=1), [((B * T, 512), f32), ((B * T, 1), i32)],
                        {1: (0, 512)}, 0),
    "sum_through_transpose": (lambda x: jnp.sum(x.T, axis=-1), [((64, 3000), f32)], {}, 1e-5),
}
SCATTERS = {
    "embedding_grad": (_rows("fill"), [((50257, C), f32), ((B, T, 1), i32), ((B, T, C), f32)], {1: (0, 50257)}),
    "position_grad_clip": (_rows("clip"), [((T, C), f32), ((T, 1), i32), ((T, C), f32)], {1: (-5, T + 5)}),
    "one_hot_grad": (_one_hot, [((B * T, 50257), f32), ((B * T, 1), i32), ((B * T,), f32)], {1: (-3, 50260)}),
    "int32": (_rows("fill"), [((1000, 3), i32), ((77, 5, 1), i32), ((77, 5, 3), i32)], {1: (-10, 1010)}),
}


def _args(specs, index_ranges, seed):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.integers(*index_ranges[k], shape), dtype) if k in index_ranges else rand(shape, dtype, rng)
            for k, (shape, dtype) in enumerate(specs)]


@pytest.mark.parametrize("name", sorted(REMAPS))
def test_remap_kernel_matches_jnp(name):
    fn, specs, index_ranges, rtol = REMAPS[name]
    args = _args(specs, index_ranges, seed=None)
    kernel, inputs = kernel_of(fn, *args)
    launch = compile_gpu_kernel(kernel, TARGET)
    want = jax.tree.leaves(jax.jit(fn)(*args))
    got = run_kernel(launch, kernel, inputs, [poisoned_like(w) for w in want])
    for g, w in zip(got, want):
        g, w = np.asarray(g).astype(np.float32), np.asarray(w).astype(np.float32)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-5 if rtol else 0, err_msg=launch.schedule)


@pytest.mark.parametrize("name", sorted(SCATTERS))
def test_scatter_add_kernel_matches_jnp(name):
    """The output aliases the operand (random, not zeros): XLA copies it in, the kernel adds."""
    fn, specs, index_ranges = SCATTERS[name]
    args = _args(specs, index_ranges, seed=None)
    kernel, inputs = kernel_of(fn, *args)
    assert [op.name for op in kernel.ops] == ["nova.scatter"]
    launch = compile_gpu_kernel(kernel, TARGET)
    handle = GpuKernelHandle(launch, [v.type for v in kernel.outputs], aliases=launch.aliases)
    (got,) = jax.jit(lambda *xs: nova_kernel_p.bind(*xs, kernel=handle))(*inputs)
    want = jax.jit(fn)(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=launch.schedule)
    np.testing.assert_array_equal(np.asarray(inputs[0]), np.asarray(args[0]))  # the operand itself is intact


STEPS = {  # whole functions through jnova.compile (one kernel per fusion group, aliases from the plan)
    "embedding_forward_and_backward": (
        lambda wte, wpe, ids: jax.grad(lambda w, p: jnp.sum(jnp.tanh(w[ids] + p[None]) ** 2), argnums=(0, 1))(wte, wpe),
        [((50257, C), f32), ((T, C), f32), ((B, T), i32)], {2: (0, 50257)}),
    "attention_layout": (
        lambda x: x.reshape(B, T, 3, H, C // H).transpose(2, 0, 3, 1, 4)[1].transpose(0, 2, 1, 3).reshape(B, T, C) * 2,
        [((B, T, 3 * C), f32)], {}),
}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_fused_step_matches_jit(name):
    import jnova

    fn, specs, index_ranges = STEPS[name]
    args = _args(specs, index_ranges, seed=None)
    compiled = jnova.compile(fn)
    got = compiled(*args)
    assert compiled.stats()[0]["backend"] == "gpu"
    want = jax.jit(fn)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
