"""Fused attention kernels on the GPU (`pytest -m gpu`): o and lse of `build_attention_forward`, and dq,
dk, dv of the backward kernels (`attention_backward.py`: dQ with delta, then dK/dV, fed the forward
kernel's o and lse), against a float32 reference (XLA, HIGHEST precision; its VJP) on fresh random inputs, for the shapes (B, H, T, D) in
(8, 12, 1024, 64), (2, 16, 2048, 128), (3, 4, 1000, 64), (1, 8, 77, 128) and GQA 8:2, causal and not,
bf16 (on wgmma where the GPU has it, and on mma.sync) and f32, both layouts.

Launch: through `nova_kernel_p`'s CUDA lowering (jaxlib's PTX kernel call) inside `jax.jit`. Both
outputs are poisoned: they alias donated NaN-filled operands, so an element the kernel does not write
fails the comparison. Kernels are compiled up front in parallel processes."""
import concurrent.futures
import dataclasses
import multiprocessing
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.gpu_launch import TARGET  # skips this module without a GPU; registers the CUDA lowering

from jnova.codegen.gpu.attention import build_attention_forward
from jnova.codegen.gpu.attention_backward import build_attention_dkdv, build_attention_dq
from jnova.dialect.types import TensorType
from jnova.passes.configure.attention_tiles import AttentionProblem, choose_attention_tiles
from jnova.primitives.gpu_lowering import GpuKernelHandle
from jnova.primitives.nova_kernel import nova_kernel_p

pytestmark = pytest.mark.gpu
# relative error in norm: bf16 inputs, P and o rounded to bf16; TF32 operands (rounded, 2^-11)
TOLERANCE = {"bfloat16": 2e-2, "float32": 3e-3}
LSE_TOLERANCE = {"bfloat16": 2e-2, "float32": 3e-3}  # absolute, natural log


def _cases():
    """(problem, instruction): bf16 on wgmma (where the GPU has it) and on mma.sync, f32 on mma.sync."""
    cases = []
    for dtype, instruction in (("bfloat16", "wgmma"), ("bfloat16", "mma.sync"), ("float32", "mma.sync")):
        if instruction == "wgmma" and not TARGET.has("wgmma"):
            continue
        for causal in (False, True):
            for b, hq, hkv, t, d, layout in ((8, 12, 12, 1024, 64, "bthd"), (2, 16, 16, 2048, 128, "bthd"),
                                             (3, 4, 4, 1000, 64, "bhtd"), (1, 8, 8, 77, 128, "bthd"),
                                             (2, 8, 2, 1000, 64, "bthd"), (1, 8, 2, 300, 128, "bhtd")):
                cases.append((AttentionProblem(b, hq, hkv, t, t, d, dtype, causal, layout=layout), instruction))
    return cases


CASES = _cases()


def _case_id(case) -> str:
    p, instruction = case
    return (f"{p.dtype}-{instruction}-{'causal' if p.causal else 'full'}-{p.batch}x{p.q_heads}:{p.kv_heads}x"
            f"{p.q_len}x{p.head_dim}-{p.layout}")


def _build(case):
    p, instruction = case
    wgmma = instruction == "wgmma"
    target = TARGET if instruction == "wgmma" else dataclasses.replace(TARGET, features=TARGET.features - {"wgmma"})
    forward = choose_attention_tiles(p, target, wgmma=wgmma)
    backward = choose_attention_tiles(p, target, backward=True, wgmma=wgmma)
    if wgmma and backward.mma != "wgmma":  # head dim 128 on the configurator's register budget: its tiles, on wgmma
        backward = dataclasses.replace(backward, mma="wgmma")
    return (build_attention_forward(p, forward, TARGET),
            build_attention_dq(p, backward, TARGET), build_attention_dkdv(p, backward, TARGET))


@pytest.fixture(scope="module")
def kernels():
    context = multiprocessing.get_context("spawn")  # never fork a process that holds a CUDA context
    with concurrent.futures.ProcessPoolExecutor(min(len(CASES), os.cpu_count() or 1, 16), mp_context=context) as pool:
        futures = [pool.submit(_build, case) for case in CASES]
        return [f.exception() or f.result() for f in futures]


def shapes(p: AttentionProblem):
    def shape(heads, length):
        return (p.batch, length, heads, p.head_dim) if p.layout == "bthd" else (p.batch, heads, length, p.head_dim)
    return shape(p.q_heads, p.q_len), shape(p.kv_heads, p.kv_len)


def inputs(p: AttentionProblem, key):
    q_shape, kv_shape = shapes(p)
    kq, kk, kv = jax.random.split(key, 3)
    dtype = jnp.dtype(p.dtype)
    return (jax.random.normal(kq, q_shape, dtype), jax.random.normal(kk, kv_shape, dtype),
            jax.random.normal(kv, kv_shape, dtype))


def reference(p: AttentionProblem, q, k, v):
    """o (f32, q's layout) and lse (f32 [B, Hq, Tq]) in float32 at HIGHEST precision."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    if p.layout == "bthd":
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    k, v = jnp.repeat(k, p.group, axis=1), jnp.repeat(v, p.group, axis=1)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest") * p.softmax_scale
    if p.causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    o = jnp.einsum("bhqk,bhkd->bhqd", jnp.exp(s - lse[..., None]), v, precision="highest")
    return (jnp.swapaxes(o, 1, 2) if p.layout == "bthd" else o), lse


def forward_call(kernel, p: AttentionProblem):
    """jit(q, k, v) -> (o, lse) launching `kernel` on NaN-poisoned, donated output buffers."""
    q_shape, _ = shapes(p)
    o_type, lse_type = TensorType(q_shape, p.dtype), TensorType((p.batch, p.q_heads, p.q_len), "float32")
    handle = GpuKernelHandle(kernel.launch(), [o_type, lse_type], aliases=((3, 0), (4, 1)))

    def call(q, k, v):
        o = jnp.full(o_type.shape, jnp.nan, jnp.dtype(p.dtype))
        lse = jnp.full(lse_type.shape, jnp.nan, jnp.float32)
        return tuple(nova_kernel_p.bind(q, k, v, o, lse, kernel=handle))
    return jax.jit(call)


def _error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(np.nan_to_num(got, nan=1e30) - want) / np.linalg.norm(want))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(p) for p in CASES])
def test_attention_forward_matches_float32(kernels, index):
    (p, _), kernel = CASES[index], kernels[index]
    if isinstance(kernel, BaseException):
        raise kernel
    kernel = kernel[0]
    q, k, v = inputs(p, jax.random.PRNGKey(100 + index))
    o, lse = forward_call(kernel, p)(q, k, v)
    want_o, want_lse = reference(p, q, k, v)
    o_err = _error(o, want_o)
    lse_err = float(np.nanmax(np.abs(np.asarray(lse) - np.asarray(want_lse)))) if not np.isnan(lse).any() else np.inf
    print(f"{kernel.schedule}: relative error of o {o_err:.2e}, max |lse error| {lse_err:.2e}")
    assert not np.isnan(np.asarray(o, np.float32)).any(), "o has unwritten (NaN) elements"
    assert not np.isnan(np.asarray(lse)).any(), "lse has unwritten (NaN) elements"
    assert o_err < TOLERANCE[p.dtype]
    assert lse_err < LSE_TOLERANCE[p.dtype]


def backward_calls(dq_kernel, dkdv_kernel, p: AttentionProblem):
    """jit(q, k, v, o, lse, do) -> (dq, dk, dv, delta): the two kernels on NaN-poisoned, donated outputs."""
    q_shape, kv_shape = shapes(p)
    q_type, kv_type = TensorType(q_shape, p.dtype), TensorType(kv_shape, p.dtype)
    rows = TensorType((p.batch, p.q_heads, p.q_len), "float32")
    dq_handle = GpuKernelHandle(dq_kernel.launch(), [q_type, rows], aliases=((6, 0), (7, 1)))
    dkdv_handle = GpuKernelHandle(dkdv_kernel.launch(), [kv_type, kv_type], aliases=((6, 0), (7, 1)))

    def poison(t):
        return jnp.full(t.shape, jnp.nan, jnp.dtype(t.dtype))

    def call(q, k, v, o, lse, do):
        dq, delta = nova_kernel_p.bind(q, k, v, o, lse, do, poison(q_type), poison(rows), kernel=dq_handle)
        dk, dv = nova_kernel_p.bind(q, k, v, lse, delta, do, poison(kv_type), poison(kv_type), kernel=dkdv_handle)
        return dq, dk, dv, delta
    return jax.jit(call)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(p) for p in CASES])
def test_attention_backward_matches_float32(kernels, index):
    (p, _), built = CASES[index], kernels[index]
    if isinstance(built, BaseException):
        raise built
    forward, dq_kernel, dkdv_kernel = built
    q, k, v = inputs(p, jax.random.PRNGKey(500 + index))
    do = jax.random.normal(jax.random.PRNGKey(900 + index), q.shape, q.dtype)
    o, lse = forward_call(forward, p)(q, k, v)
    dq, dk, dv, delta = backward_calls(dq_kernel, dkdv_kernel, p)(q, k, v, o, lse, do)
    _, pullback = jax.vjp(lambda q, k, v: reference(p, q, k, v)[0], *(x.astype(jnp.float32) for x in (q, k, v)))
    want = pullback(do.astype(jnp.float32))
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert not np.isnan(np.asarray(got, np.float32)).any(), f"{name} has unwritten (NaN) elements"
        error = _error(got, ref)
        print(f"{dq_kernel.schedule} / {dkdv_kernel.schedule}: relative error of {name} {error:.2e}")
        assert error < TOLERANCE[p.dtype], name
    assert not np.isnan(np.asarray(delta)).any()


def test_a_fused_projection_read_and_written_in_place_matches_jit():
    """GPT-2's attention block at T=77 (partial tiles) in bf16: q, k, v split from one [B, T, 3C]
    projection, which the forward, dQ and dK/dV kernels read in place, and the dK/dV kernel writing the
    concatenated gradient of the projection (dq copied in); the step's gradients against jax.jit's."""
    import jnova
    from helpers.attention import compare_with_jit

    b, t, h, d = 2, 77, 4, 64
    c = h * d

    def loss(x, w):
        q, k, v = jnp.split((x @ w).reshape(b, t, 3 * h, d), 3, axis=2)
        return jnp.sum(jnova.ops.attention(q, k, v, causal=True).astype(jnp.float32) ** 2)
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((b, t, c)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((c, 3 * c)) / np.sqrt(c), jnp.bfloat16)
    lowered = compare_with_jit(jax.grad(loss, argnums=(0, 1)), x, w, dtype="bfloat16")
    gpu = lowered.as_text("gpu")
    assert f"%q_k_v: memref<{b * t * 3 * c}xbf16>" in gpu and f"%concatenation: memref<{b * t * 3 * c}xbf16>" in gpu
