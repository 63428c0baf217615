"""GPU code generation for data movement, without a GPU: kernels that read through transposes, slices,
reversals, pads, concatenations, dynamic slices and gathers, and scatter-add kernels, as PTX that ptxas
assembles for sm_90a and sm_86 without spills, and run on the CPU (the gpu.func body inside loops over
blocks and threads, `gpu_emulation.simulate`) with poisoned outputs against jnp."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jnova.codegen.gpu.compile import build_gpu_module, compile_gpu_kernel
from jnova.runtime.target import get_target
from helpers.gpu_emulation import aligned, assert_outputs_close, poisoned_like, simulate
from helpers.kernels import assert_assembles_without_spills, kernel_of, requires_ptxas
from helpers.random_inputs import rand

f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32


def _scatter_rows(mode):
    dn = lax.ScatterDimensionNumbers(update_window_dims=(2,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,))
    return lambda x, i, u: lax.scatter_add(x, i, u, dn, mode=mode)


def _scatter_one_hot(x, i, u):  # the cross-entropy gradient's form: one element per row
    dn = lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(1,), scatter_dims_to_operand_dims=(1,),
                                     operand_batching_dims=(0,), scatter_indices_batching_dims=(0,))
    return lax.scatter_add(x, i, u, dn, mode="fill")


# name -> (function, [(shape, dtype)], {argument index: (low, high) of random integer indices})
REMAPS = {
    "head_split_f32": (lambda x: x.reshape(2, 16, 4, 8).transpose(0, 2, 1, 3) * 0.125, [((2, 16, 32), f32)], {}),
    "head_merge_bf16": (lambda x, y: x.transpose(0, 2, 1, 3).reshape(2, 16, 64) + y,
                        [((2, 4, 16, 16), bf16), ((2, 16, 64), bf16)], {}),
    "transpose_2d": (lambda x: x.T + 1, [((33, 17), f32)], {}),
    "slice_shifted": (lambda x: x[:, 1:] * 2, [((7, 65), f32)], {}),
    "slice_aligned_qkv": (lambda x: x.reshape(4, 3, 32)[:, 1] * x[:, 64:], [((4, 96), f32)], {}),
    "slice_strided": (lambda x: jnp.cos(x)[1::2, ::3] + 1, [((10, 31), f32)], {}),
    "reverse_both": (lambda x, y: jnp.flip(x, (0, 1)) * y, [((9, 64), f32), ((9, 64), f32)], {}),
    "pad_rows": (lambda x: jnp.pad(jnp.tanh(x), ((1, 2), (0, 0)), constant_values=-3.0), [((6, 16), f32)], {}),
    "pad_interior_negative": (lambda x: lax.pad(x * 3, 0.5, ((1, -1, 1), (-2, 2, 0))) - 1, [((5, 7), f32)], {}),
    "concat_inner_aligned": (lambda x, y: jnp.concatenate([jnp.exp(x), y], axis=1) * 2,
                             [((5, 8), f32), ((5, 4), f32)], {}),
    "concat_inner_unaligned": (lambda x, y, z: jnp.concatenate([x, y, z], axis=1), [((5, 5), f32), ((5, 3), f32),
                                                                                  ((5, 2), f32)], {}),
    "concat_outer_int": (lambda x, y: jnp.concatenate([x, y * 2], axis=0), [((3, 8), i32), ((2, 8), i32)], {}),
    "bool_transpose": (lambda x, y: (x > 0).T & (y < 0), [((12, 20), f32), ((20, 12), f32)], {}),
    "dynamic_slice_clamped": (lambda x, i: lax.dynamic_slice(jnp.exp(x), (i, 2), (4, 5)) * 2,
                              [((10, 8), f32), ((), i32)], {1: (-5, 15)}),
    "dynamic_slice_rows": (lambda x, i: lax.dynamic_slice(x, (i, 0), (3, 16)) + 1, [((10, 16), f32), ((), i32)],
                           {1: (0, 12)}),
    "gather_embedding_fill": (lambda w, ids: jnp.take(w, ids, axis=0, mode="fill", fill_value=-7.0) + 1,
                              [((50, 16), f32), ((3, 7), i32)], {1: (-60, 60)}),
    "gather_embedding_clip_bf16": (lambda w, p, ids: jnp.take(w, ids, axis=0, mode="clip") + p[None],
                                   [((50, 32), bf16), ((7, 32), bf16), ((3, 7), i32)], {2: (-5, 55)}),
    "gather_along_axis": (lambda x, idx: jnp.take_along_axis(x, idx, axis=1) * 2, [((6, 9), f32), ((6, 4), i32)],
                          {1: (0, 9)}),
    "sum_through_transpose": (lambda x: jnp.sum(jnp.exp(x).T, axis=-1), [((3, 40), f32)], {}),
}
SCATTERS = {
    "scatter_embedding_fill": (_scatter_rows("fill"), [((50, 16), f32), ((3, 7, 1), i32), ((3, 7, 16), f32)],
                               {1: (-3, 53)}),
    "scatter_embedding_clip": (_scatter_rows("clip"), [((50, 16), f32), ((3, 7, 1), i32), ((3, 7, 16), f32)],
                               {1: (-3, 53)}),
    "scatter_one_hot": (_scatter_one_hot, [((6, 9), f32), ((6, 1), i32), ((6,), f32)], {1: (-2, 11)}),
    "scatter_int32": (_scatter_rows("fill"), [((10, 3), i32), ((4, 5, 1), i32), ((4, 5, 3), i32)], {1: (0, 10)}),
}
CASES = {**REMAPS, **SCATTERS}


def case_args(name, seed=0):
    fn, specs, index_ranges = CASES[name]
    rng = np.random.default_rng(seed)
    args = []
    for k, (shape, dtype) in enumerate(specs):
        if k in index_ranges:
            args.append(jnp.asarray(rng.integers(*index_ranges[k], shape), dtype))
        else:
            args.append(rand(shape, dtype, seed + k))
    return fn, args


def case_kernel(name):
    fn, args = case_args(name)
    return (fn, args, *kernel_of(fn, *args))


@requires_ptxas
@pytest.mark.parametrize("target", ["h200", "rtx3060"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_ptx_assembles_without_spills(name, target):
    _, _, kernel, _ = case_kernel(name)
    assert_assembles_without_spills(kernel, target, name)


@pytest.mark.parametrize("name", sorted(REMAPS))
def test_remap_kernel_simulated_on_cpu_matches_jnp(name):
    fn, args, kernel, inputs = case_kernel(name)
    module = build_gpu_module(kernel, get_target("h200"))
    want = [np.asarray(w) for w in jax.tree.leaves(jax.jit(fn)(*args))]
    outs = [poisoned_like(w) for w in want]
    simulate(module, inputs, outs)
    assert_outputs_close(outs, want, rtol=1e-2 if "bf16" in name else 2e-6, atol=1e-6, err_msg=module.schedule)


@pytest.mark.parametrize("name", sorted(SCATTERS))
def test_scatter_add_simulated_on_cpu_matches_jnp(name):
    """The output buffer starts as the operand (what XLA's aliasing guarantees); the kernel adds."""
    fn, args, kernel, inputs = case_kernel(name)
    assert [op.name for op in kernel.ops] == ["nova.scatter"]
    module = build_gpu_module(kernel, get_target("h200"))
    assert module.aliases == ((0, 0),) and "memref.atomic_rmw" in module.text
    out = aligned(np.asarray(args[0]))
    simulate(module, inputs, [out])
    np.testing.assert_allclose(out, np.asarray(jax.jit(fn)(*args)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,access", [("head_split_f32", "ld.global.v4.b32"), ("head_merge_bf16", "ld.global.v4.b32"),
                                         ("slice_aligned_qkv", "ld.global.v4.b32"),
                                         ("reverse_both", "ld.global.v4.b32"), ("pad_rows", "ld.global.v4.b32"),
                                         ("concat_inner_aligned", "ld.global.v4.b32"),
                                         ("gather_embedding_fill", "ld.global.v4.b32"),
                                         ("dynamic_slice_rows", "ld.global.v4.b32")])
def test_vector_reads_where_the_innermost_dim_stays_contiguous(name, access):
    _, _, kernel, _ = case_kernel(name)
    assert access in compile_gpu_kernel(kernel, get_target("h200")).ptx


def test_scalar_reads_where_it_does_not():
    for name in ("transpose_2d", "slice_shifted", "concat_inner_unaligned"):
        _, _, kernel, _ = case_kernel(name)
        module = build_gpu_module(kernel, get_target("h200"))
        assert "vector.load" not in module.text and "memref.load" in module.text, name
