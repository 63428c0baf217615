"""GPU code generation without a GPU: fused kernels -> gpu.module -> PTX, assembled by ptxas for the
h200 (sm_90a) and rtx3060 (sm_86) presets, no spills allowed. Elementwise kernels (and reductions of
one thread per row, which need no shuffles) also run on the CPU: the gpu.func body inside loops over
the grid's blocks and threads, with poisoned outputs, against jnp. The CUDA lowering of
`nova_kernel_p` is checked in the text of a step lowered for CUDA."""
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jnova.codegen.gpu.compile import build_gpu_module, compile_gpu_kernel
from jnova.codegen.gpu.ptx import assemble_check
from jnova.errors import LoweringError
from jnova.errors import CompileError
from jnova.runtime import launcher
from jnova.runtime.target import get_target
from helpers.gpu_emulation import assert_outputs_close, poisoned_like, simulate
from helpers.kernels import assert_assembles_without_spills, kernel_of, requires_ptxas
from helpers.random_inputs import rand

f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32


ELEMENTWISE = {
    "f32_chain_1000x77": (lambda x, y: jnp.tanh(x) * y + 1.0, [((1000, 77), f32), ((1000, 77), f32)]),
    "f32_33": (lambda x: jnp.exp(x) / (1 + jnp.abs(x)), [((33,), f32)]),
    "bf16_ops": (lambda x, y: x * y + x, [((1000, 77), bf16), ((1000, 77), bf16)]),
    "bf16_in_out_f32_math": (lambda x, y: (jax.nn.sigmoid(x.astype(f32)) * y.astype(f32)).astype(bf16),
                             [((4096,), bf16), ((4096,), bf16)]),
    "int32": (lambda a, b: (a * 3 + b) // 7 ^ (a >> 2), [((1000, 77), i32), ((1000, 77), i32)]),
    "bool_mask": (lambda x, y: jnp.where((x > 0) & (y < 0.5), x, -y), [((257, 33), f32), ((257, 33), f32)]),
    "bool_out": (lambda x, y: (x > y) | (x < -1), [((1000, 77), f32), ((1000, 77), f32)]),
    "broadcast_rows_cols": (lambda x, r, c: x * r[:, None] + c[None, :] + 2.0,
                            [((1000, 77), f32), ((1000,), f32), ((77,), f32)]),
    "broadcast_size1_dims": (lambda x, b: x + b, [((64, 1, 128), f32), ((1, 7, 1), f32)]),
    "iota": (lambda x: x + jnp.arange(128.0), [((33, 128), f32)]),
    "math": (lambda x: jnp.log1p(jnp.abs(x)) + jax.scipy.special.erf(x) + jnp.expm1(x)
             + jax.lax.erf_inv(jnp.tanh(x)) + jnp.round(x) * jnp.isfinite(x) + jnp.arctan2(x, 2.0) + x ** 3,
             [((1000,), f32)]),
    "two_outputs": (lambda x: (x * 2, jnp.sin(x) > 0), [((999,), f32)]),
}
REDUCTIONS = {
    "sum_exp_31": (lambda x: jnp.sum(jnp.exp(x - 1.0), axis=-1), [((64, 31), f32)]),
    "mean_bf16_1024": (lambda x: jnp.mean(x.astype(f32), axis=-1), [((64, 1024), bf16)]),
    "max_bf16_50304": (lambda x: jnp.max(x, axis=-1), [((16, 50304), bf16)]),
    "min_i32_rows_of_1": (lambda x: jnp.min(x, axis=-1), [((1000, 1), i32)]),
    "sum_3_cols": (lambda x: jnp.sum(x * x, axis=-1), [((1000, 3), f32)]),
    "sum_two_dims": (lambda x: jnp.sum(x * x, axis=(1, 2)), [((32, 4, 256), f32)]),
    "any_mask": (lambda x: jnp.any(x > 0, axis=-1), [((16, 1000), f32)]),
    "sum_with_bias": (lambda x, b: jnp.sum(x + b, axis=-1), [((128, 1024), f32), ((1024,), f32)]),
    "sum_unit_dims_1x64x768": (lambda x: jnp.sum(x * x, axis=(0, 2)), [((1, 64, 768), f32)]),
    "max_unit_last_64x48x1": (lambda x: jnp.max(x, axis=(1, 2)), [((64, 48, 1), f32)]),
    "broadcast_output_1x64x768": (lambda x, y: jnp.sum(x, axis=(0, 2))[None, :] * 2.0 - y, [((1, 64, 768), f32), ((1, 64), f32)]),
    "size_1_dims_only_1x32": (lambda x: jnp.sum(x * jnp.arange(32.0, dtype=f32), axis=0), [((1, 32), f32)]),  # rows of 1
}
CASES = {**ELEMENTWISE, **REDUCTIONS}


def case_kernel(name):
    fn, specs = CASES[name]
    args = [rand(shape, dtype, seed) for seed, (shape, dtype) in enumerate(specs)]
    return fn, args, *kernel_of(fn, *args)


@requires_ptxas
@pytest.mark.parametrize("target", ["h200", "rtx3060"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_ptx_assembles_without_spills(name, target):
    _, _, kernel, _ = case_kernel(name)
    assert_assembles_without_spills(kernel, target, name)


def test_16_byte_accesses_where_the_shapes_allow():
    _, _, kernel, _ = case_kernel("f32_chain_1000x77")
    ptx = compile_gpu_kernel(kernel, get_target("h200")).ptx
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    _, _, kernel, _ = case_kernel("mean_bf16_1024")
    assert "ld.global.v4.b32" in compile_gpu_kernel(kernel, get_target("h200")).ptx  # 8 bf16


BF16_MATH = re.compile(r"\b(add|sub|mul|fma|setp|max|min|neg|abs)(\.\w+)*\.bf16(x2)?\b")


def test_bf16_math_runs_in_f32_in_the_ptx():
    """No native bf16 arithmetic or comparison in the PTX of bf16 kernels (GpuEmitter.bf16_to_f32: ptxas
    of CUDA 13.0 miscompiled packed bf16 adds): the cummax program of that finding, a bf16 tanh-GELU with
    comparisons, a row reduction, a softmax, a normalization and a step with bf16 contraction operands."""
    from difftest.findings import CUMMAX_BF16, CUMMAX_BF16_SEED
    from difftest.program import Program
    from helpers.gpu_emulation import gpu_plan

    program = Program.parse(CUMMAX_BF16)
    plans = [gpu_plan(program.step(), *program.arguments(CUMMAX_BF16_SEED))[1].kernels]
    x = jnp.asarray(rand((64, 96), f32), bf16)
    plans.append(gpu_plan(lambda x, y: jnp.where(x > y, jax.nn.gelu(x), jnp.maximum(x, y) * y), x, x[::-1])[1].kernels)
    plans.append(gpu_plan(lambda x: jnp.sum(x * x, axis=-1, dtype=bf16), x)[1].kernels)
    plans.append(gpu_plan(lambda x, w, b: jnp.tanh(x @ w + b), x, x.T, x[:, 0])[1].kernels)
    plans.append(gpu_plan(lambda x: jax.nn.softmax(x, axis=-1), x)[1].kernels)  # row programs
    plans.append(gpu_plan(lambda x: (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5),
                          x)[1].kernels)
    for kernels in plans:
        checked = 0
        for kernel in kernels:
            try:
                ptx = compile_gpu_kernel(kernel, get_target("h200")).ptx
            except LoweringError:
                continue
            checked += 1
            assert not BF16_MATH.search(ptx), (kernel.name, BF16_MATH.search(ptx)[0])
        assert checked >= 1  # every program above has kernels in the check (fusion decides how many)


def test_row_reduction_uses_butterflies_and_shared_memory():
    _, _, kernel, _ = case_kernel("max_bf16_50304")
    module = build_gpu_module(kernel, get_target("h200"))
    assert "team=1024" in module.schedule
    assert module.text.count("gpu.shuffle xor") == 10 and "gpu.barrier" in module.text  # two 5-step butterflies


def test_row_reductions_skip_size_1_dims():
    from jnova.codegen.gpu.reduction import row_reduction_refusal

    for axes, shape in (((0, 2), (1, 64, 8)), ((1, 2), (64, 8, 1))):  # over size-1 dims only: a reshape
        kernel, _ = kernel_of(lambda x: jnp.sum(x, axis=axes), jnp.ones(shape))
        assert row_reduction_refusal(kernel) is None, (axes, shape)
        assert compile_gpu_kernel(kernel, get_target("h200")).schedule.startswith("row_reduction(rows=")
    kernel, _ = kernel_of(lambda x: jnp.sum(x, axis=1), jnp.ones((1, 64, 8)))  # kept sized dim after it
    assert "not the innermost" in row_reduction_refusal(kernel)


def test_kernels_no_builder_takes_are_refused_with_reasons():
    # attention's head-batched scores: batch dims that do not lead (no contraction kernel layout yet)
    kernel, _ = kernel_of(lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k), jnp.ones((2, 8, 4, 16)), jnp.ones((2, 8, 4, 16)))
    with pytest.raises(LoweringError, match="not contraction: lhs: batch dims do not lead.*not elementwise: 'nova.matmul'"):
        build_gpu_module(kernel, get_target("h200"))
    kernel, _ = kernel_of(lambda x: (jnp.sum(x, axis=1), jnp.max(x, axis=0)), jnp.ones((8, 8)))
    with pytest.raises(LoweringError, match=r"2 reductions.*not row program: a reduction over dims \(0,\)"):
        build_gpu_module(kernel, get_target("h200"))


@requires_ptxas
def test_ptxas_failure_keeps_the_ptx_and_the_command():
    with pytest.raises(CompileError) as info:
        assemble_check(".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry k() { bogus; }\n", "sm_90a")
    assert info.value.stage == "ptxas" and "ptxas" in info.value.repro and info.value.input_path.endswith(".ptx")


# --------------------------------------------------------------------------- the kernels, run on the CPU
SIMULATED = sorted(ELEMENTWISE) + ["min_i32_rows_of_1", "sum_3_cols", "size_1_dims_only_1x32"]


@pytest.mark.parametrize("name", SIMULATED)
def test_kernel_simulated_on_cpu_matches_jnp(name):
    fn, args, kernel, inputs = case_kernel(name)
    module = build_gpu_module(kernel, get_target("h200"))
    assert "gpu.shuffle" not in module.text and "gpu.barrier" not in module.text
    want = jax.tree.leaves(jax.jit(fn)(*args))
    outs = [poisoned_like(np.asarray(w)) for w in want]
    simulate(module, inputs, outs)
    assert_outputs_close(outs, want, rtol=2e-2 if name.startswith("bf16") else 2e-6, atol=1e-6)


# --------------------------------------------------------------------------- re-entry into JAX
def _fields(message: bytes) -> list[tuple[int, object]]:
    """(field number, value) pairs of a protobuf message: varints as ints, length-delimited as bytes."""
    out, i = [], 0
    while i < len(message):
        key, i = _read_varint(message, i)
        if key & 7 == 0:
            value, i = _read_varint(message, i)
        else:
            assert key & 7 == 2, f"unexpected wire type {key & 7}"
            n, i = _read_varint(message, i)
            value, i = message[i: i + n], i + n
        out.append((key >> 3, value))
    return out


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        value |= (data[i] & 0x7F) << shift
        shift, i = shift + 7, i + 1
        if not data[i - 1] & 0x80:
            return value, i


def _lowered_for_cuda(case: str):
    """(the kernel's launch, its number of buffers, the StableHLO text of a jitted call of it lowered
    for CUDA)."""
    from jnova.primitives.gpu_lowering import GpuKernelHandle, register_gpu_lowering
    from jnova.primitives.nova_kernel import nova_kernel_p

    register_gpu_lowering()
    fn, args, kernel, inputs = case_kernel(case)
    launch = compile_gpu_kernel(kernel, get_target("h200"))
    handle = GpuKernelHandle(launch, [v.type for v in kernel.outputs])
    lowered = jax.jit(lambda *xs: nova_kernel_p.bind(*xs, kernel=handle)).trace(*inputs)
    buffers = len(inputs) + len(kernel.outputs)
    return launch, buffers, lowered.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.skipif(launcher.compiler() is None, reason="no C compiler: jaxlib's kernel call is used")
def test_cuda_lowering_is_jnovas_launcher_with_the_kernel_registered():
    launch, _, text = _lowered_for_cuda("f32_chain_1000x77")
    assert "stablehlo.custom_call @jnova_launch" in text and "triton" not in text
    kernel_id = int(re.search(r"kernel_id = (\d+) : ui64", text).group(1))
    assert kernel_id == launcher.kernel_id(launch.name, launch.ptx) and launcher.load().is_registered(kernel_id)
    geometry = [int(v) for v in re.search(r"launch = dense<\[([\d, ]+)\]> : tensor<7xi64>", text).group(1).split(",")]
    assert geometry == [*launch.grid, *launch.block, launch.shared_mem_bytes]
    assert ".entry " + launch.name in launch.ptx  # the entry the launcher looks up


def test_cuda_lowering_is_the_ptx_kernel_call_with_jaxlib_launcher(monkeypatch):
    monkeypatch.setenv("JNOVA_LAUNCHER", "jaxlib")
    launch, buffers, text = _lowered_for_cuda("f32_chain_1000x77")
    assert "stablehlo.custom_call @triton_kernel_call_ffi" in text and 'name = "kernel_0"' in text
    opaque = re.search(r'opaque = "((?:[^"\\]|\\.)*)"', text).group(1)
    raw = re.sub(rb"\\([0-9A-Fa-f]{2})", lambda m: bytes([int(m.group(1), 16)]),
                 opaque.encode("latin-1").replace(b"\\\\", b"\\5C"))
    (call_field, call), (name_field, name) = _fields(zlib.decompress(raw))
    assert (call_field, name_field, name) == (1, 4, b"kernel_0")
    call = _fields(call)
    kernel_proto = dict(_fields(call[0][1]))
    assert kernel_proto[1] == b"kernel_0" and kernel_proto[2] == launch.num_warps and kernel_proto[6] == 90
    assert kernel_proto[4].decode() == launch.ptx and kernel_proto[10] == 1
    assert [v for f, v in call if f == 2] == [launch.grid[0]]
    assert len([v for f, v in call if f == 5]) == buffers  # one array parameter per buffer
