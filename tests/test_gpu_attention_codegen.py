"""Fused attention kernels without a GPU.

- Every forward kernel the configurator picks assembles with `ptxas -arch=sm_90a` without spills
  (registers printed) for GPT-2's shape and T=1000, bf16 and f32, head dims 64 and 128, causal or not,
  GQA, both layouts; the PTX uses the instructions the design names: wgmma (per warpgroup) for bf16 on
  the H200, mma.sync for f32 and for bf16 on a GPU without wgmma (the H200 with that feature removed).
- Numerics: the generated gpu.func runs on the CPU in `gpu_warp_interpreter` (all threads of a block in
  lockstep, mma.sync / wgmma / ldmatrix / shuffles after the PTX ISA) against float64 NumPy on small
  shapes that exercise the masks (T=77, 130: partial tiles; causal diagonals; GQA; bhtd), bf16 on both
  instructions; a kernel with a misplaced fragment word (mma.sync) or register word (wgmma) is caught.
- Operands read in place: q, k, v as row views of one fused projection's buffer (exactly its size, so a
  read past it faults) in the forward and both backward kernels, do from a wider buffer; T=77 and 70
  (partial tiles), GQA, both layouts; GPT-2's shape assembles without spills.
- The configurator: footprints with the driver's per-block reserve, refusals.
GPU numerics: tests/gpu/test_gpu_attention.py."""
import dataclasses

import numpy as np
import pytest

import jnova.codegen.gpu.attention as attention
import jnova.passes.configure.attention_tiles as attention_tiles
from helpers.gpu_warp_interpreter import BF16, KernelFault, run_kernel
from jnova.codegen.gpu.attention import attention_forward_module, build_attention_forward
from jnova.codegen.gpu.ptx import assemble_check, ptxas_path, to_ptx
from jnova.errors import LoweringError
from jnova.passes.configure.attention_tiles import (AttentionConfig, AttentionProblem, attention_refusal,
                                              choose_attention_tiles)
from jnova.runtime.target import KiB, get_target

H200 = get_target("h200")
H200_MMA_SYNC = dataclasses.replace(H200, features=H200.features - {"wgmma"})  # bf16 on mma.sync
INSTRUCTIONS = {"wgmma": H200, "mma.sync": H200_MMA_SYNC}
STEP_INSTRUCTION = "wgmma" if attention_tiles.WGMMA_BY_DEFAULT else "mma.sync"  # what a bf16 step runs on the H200
requires_ptxas = pytest.mark.skipif(ptxas_path() is None, reason="ptxas is not on PATH")

# (batch, q heads, kv heads, T, D, layout)
PTX_SHAPES = [(8, 12, 12, 1024, 64, "bthd"), (3, 4, 4, 1000, 64, "bhtd"), (2, 16, 16, 2048, 128, "bthd"),
              (1, 8, 2, 77, 128, "bthd"), (8, 8, 2, 1000, 128, "bhtd")]


def _ptx_cases():
    return [pytest.param(dtype, instruction, causal, *shape, id=f"{dtype}-{instruction}-{'causal' if causal else 'full'}-"
                         f"{shape[0]}x{shape[1]}:{shape[2]}x{shape[3]}x{shape[4]}-{shape[5]}")
            for dtype, instruction in (("bfloat16", "wgmma"), ("bfloat16", "mma.sync"), ("float32", "mma.sync"))
            for causal in (False, True) for shape in PTX_SHAPES]


def assert_instructions(ptx: str, dtype: str, instruction: str) -> None:
    """The products run on `instruction`: wgmma (m64nNk16 from shared memory and from registers, no
    mma.sync, no ldmatrix) or mma.sync (ldmatrix.trans only on 16-bit data, TF32 rounded to nearest)."""
    if instruction == "wgmma":
        assert "wgmma.mma_async.sync.aligned.m64n" in ptx and ".f32.bf16.bf16" in ptx
        assert "mma.sync" not in ptx and "ldmatrix" not in ptx
        return
    kind = "bf16.bf16" if dtype == "bfloat16" else "tf32.tf32"
    assert f"mma.sync.aligned.m16n8k{16 if dtype == 'bfloat16' else 8}.row.col.f32.{kind}.f32" in ptx
    assert "wgmma" not in ptx
    trans = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    assert trans == (dtype == "bfloat16")  # never .trans on 32-bit data
    if dtype == "float32":
        assert "cvt.rna.tf32.f32" in ptx


@requires_ptxas
@pytest.mark.parametrize("dtype,instruction,causal,batch,hq,hkv,t,d,layout", _ptx_cases())
def test_forward_ptx_assembles_without_spills(dtype, instruction, causal, batch, hq, hkv, t, d, layout):
    problem = AttentionProblem(batch, hq, hkv, t, t, d, dtype, causal, layout=layout)
    target = INSTRUCTIONS[instruction]
    config = choose_attention_tiles(problem, target, wgmma=instruction == "wgmma")
    assert config.mma == instruction
    kernel = build_attention_forward(problem, config, target)
    report = assemble_check(kernel.ptx, target.arch)
    print(f"{kernel.schedule}: {report}")
    assert report.spills == 0 and report.stack_frame == 0, report.log
    assert kernel.shared_mem_bytes == config.smem_bytes(problem) <= target.smem_per_block_optin
    assert kernel.grid == (-(-t // config.block_m), hq, batch) and kernel.block == (config.threads, 1, 1)
    assert kernel.ptx.count(".param .u64 .ptr") == 5
    assert "ex2.approx.ftz.f32" in kernel.ptx and "cp.async.cg.shared.global" in kernel.ptx
    assert "shfl.sync.bfly" in kernel.ptx
    assert_instructions(kernel.ptx, dtype, instruction)


def _reference(p: AttentionProblem, q, k, v):
    if p.layout == "bthd":
        q, k, v = (np.swapaxes(x, 1, 2) for x in (q, k, v))
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    k, v = np.repeat(k, p.group, axis=1), np.repeat(v, p.group, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * p.softmax_scale
    if p.causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    o = np.einsum("bhqk,bhkd->bhqd", e / e.sum(-1, keepdims=True), v)
    return (np.swapaxes(o, 1, 2) if p.layout == "bthd" else o), m[..., 0] + np.log(e.sum(-1))


def _interpret(p: AttentionProblem, seed: int, config: AttentionConfig | None = None):
    rng = np.random.default_rng(seed)
    dtype = BF16 if p.dtype == "bfloat16" else np.float32

    def shape(heads, length):
        return (p.batch, length, heads, p.head_dim) if p.layout == "bthd" else (p.batch, heads, length, p.head_dim)

    q = rng.standard_normal(shape(p.q_heads, p.q_len)).astype(dtype)
    k = rng.standard_normal(shape(p.kv_heads, p.kv_len)).astype(dtype)
    v = rng.standard_normal(shape(p.kv_heads, p.kv_len)).astype(dtype)
    o = np.full(q.shape, np.nan, dtype)  # poisoned: every element must be written
    lse = np.full((p.batch, p.q_heads, p.q_len), np.nan, np.float32)
    module = attention_forward_module(p, config or choose_attention_tiles(p, H200), H200)
    run_kernel(module.text, module.grid, module.block, module.shared_mem_bytes,
               {"q": q, "k": k, "v": v, "o": o, "lse": lse})
    want_o, want_lse = _reference(p, q, k, v)
    return np.asarray(o, np.float64), lse, want_o, want_lse


# relative error in norm: bf16 P and output rounding; TF32 operands
TOLERANCE = {"bfloat16": 1e-2, "float32": 2e-3}

INTERPRETED = [  # (batch, q heads, kv heads, T, D, dtype, causal, layout)
    (1, 1, 1, 77, 64, "bfloat16", False, "bthd"),
    (1, 1, 1, 77, 64, "bfloat16", True, "bthd"),
    (1, 2, 2, 130, 64, "bfloat16", True, "bhtd"),
    (1, 2, 1, 70, 128, "bfloat16", True, "bthd"),
    (1, 1, 1, 77, 64, "float32", False, "bthd"),
    (2, 2, 1, 130, 64, "float32", True, "bhtd"),
    (1, 2, 1, 40, 128, "float32", True, "bthd"),
]


def _configured(p: AttentionProblem, instruction: str, backward: bool = False) -> AttentionConfig:
    """The configurator's tiles for `p` on `instruction` (wgmma: its wgmma tiles, whatever the default)."""
    config = choose_attention_tiles(p, INSTRUCTIONS[instruction], backward=backward, wgmma=instruction == "wgmma")
    if config.mma != instruction:  # head dim 128's backward on the register budget: mma.sync's tiles on wgmma
        config = dataclasses.replace(choose_attention_tiles(p, H200_MMA_SYNC, backward=backward), mma=instruction)
    return config


def _with_instructions(cases):
    """Each case with the instructions its dtype runs on (bf16: wgmma and mma.sync; f32: mma.sync)."""
    return [pytest.param(c, i, id=f"{c[5]}-{i}-{'causal' if c[6] else 'full'}-{c[0]}x{c[1]}:{c[2]}x{c[3]}x{c[4]}-{c[7]}")
            for c in cases for i in (("wgmma", "mma.sync") if c[5] == "bfloat16" else ("mma.sync",))]


@pytest.mark.parametrize("case,instruction", _with_instructions(INTERPRETED))
def test_forward_numerics_in_the_warp_interpreter(case, instruction):
    batch, hq, hkv, t, d, dtype, causal, layout = case
    p = AttentionProblem(batch, hq, hkv, t, t, d, dtype, causal, layout=layout)
    config = choose_attention_tiles(p, INSTRUCTIONS[instruction], wgmma=instruction == "wgmma")
    assert config.mma == instruction
    o, lse, want_o, want_lse = _interpret(p, seed=hash(case) % 1000, config=config)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    error = np.linalg.norm(o - want_o) / np.linalg.norm(want_o)
    print(f"{p}: relative error of o {error:.2e}, max |lse error| {np.abs(lse - want_lse).max():.2e}")
    assert error < TOLERANCE[dtype]
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=2e-3 if dtype == "float32" else 1e-4)


def test_forward_numerics_with_32_key_tiles():
    """block_n = 32 (the f32 D=128 seed) on a D=64 problem: 3 key tiles, the last partial and causal."""
    p = AttentionProblem(1, 1, 1, 70, 70, 64, "float32", True)
    o, lse, want_o, want_lse = _interpret(p, 5, AttentionConfig(64, 32, 4, 2))
    assert np.linalg.norm(o - want_o) / np.linalg.norm(want_o) < TOLERANCE["float32"]


@pytest.mark.parametrize("dtype,instruction", [("bfloat16", "mma.sync"), ("float32", "mma.sync"), ("bfloat16", "wgmma")])
def test_the_interpreter_catches_a_misplaced_fragment(monkeypatch, dtype, instruction):
    """mma.sync: the B fragment's two words swapped in every mma.sync; wgmma: the A operand's register
    words of rows g and g + 8 swapped in every register-A wgmma. The interpreter's result must be wrong."""
    import jnova.codegen.gpu.attention_wgmma as attention_wgmma

    if instruction == "mma.sync":
        right = attention.mma
        monkeypatch.setattr(attention, "mma", lambda em, a, b, c, bf16: right(em, a, b[::-1], c, bf16))
    else:
        right = attention_wgmma.wgmma_rs
        monkeypatch.setattr(attention_wgmma, "wgmma_rs",
                            lambda em, a, desc, acc, scale, n: right(em, [a[1], a[0], a[3], a[2]], desc, acc, scale, n))
    p = AttentionProblem(1, 1, 1, 40, 40, 64, dtype, False)
    config = choose_attention_tiles(p, INSTRUCTIONS[instruction], wgmma=instruction == "wgmma")
    assert config.mma == instruction
    o, _, want_o, _ = _interpret(p, 3, config)
    assert np.linalg.norm(o - want_o) / np.linalg.norm(want_o) > 10 * TOLERANCE[dtype]


def test_the_interpreter_catches_an_access_out_of_bounds():
    text = """module attributes {gpu.container_module} {
gpu.module @k_module {
  gpu.func @k(%a: memref<4xf32>) kernel {
    %t = gpu.thread_id x
    %x = memref.load %a[%t] : memref<4xf32>
    gpu.return
  }
}
}"""
    with pytest.raises(KernelFault, match="out of bounds"):
        run_kernel(text, (1, 1, 1), (32, 1, 1), 0, {"a": np.ones(4, np.float32)})


# -- the configurator

def test_footprint_counts_the_driver_reserve():
    p = AttentionProblem(8, 12, 12, 1024, 1024, 64, "bfloat16", True)
    config = choose_attention_tiles(p, H200_MMA_SYNC)
    assert config == AttentionConfig(64, 64, 4, 2)
    assert config.smem_bytes(p) == 64 * 64 * 2 + 2 * 2 * 64 * 64 * 2 == 40 * KiB
    assert H200.smem_reserved_per_block == 1 * KiB
    assert config.blocks_per_sm(p, H200) == 228 // 41 == 5  # 228 // 40 would be 5 too
    # a footprint of exactly half an SM fits twice only without the reserve
    assert H200.blocks_per_sm_by_smem(114 * KiB) == 1 and H200.smem_per_sm // (114 * KiB) == 2


def test_f32_head_dim_128_takes_32_key_tiles_to_keep_two_blocks_per_sm():
    p = AttentionProblem(4, 16, 16, 2048, 2048, 128, "float32", True)
    config = choose_attention_tiles(p, H200)
    assert AttentionConfig(64, 64, 4, 2).blocks_per_sm(p, H200) == 1  # 160 KiB
    assert config == AttentionConfig(64, 32, 4, 2) and config.blocks_per_sm(p, H200) == 2  # 96 KiB + 1 KiB, twice


def test_bf16_on_the_h200_takes_wgmma_tiles_whose_accumulators_fit():
    """Warpgroups of 64 rows, two per block; the widest score tile within the register budget: GPT-2's
    head dim 64 forward 128 keys a tile, backward 64; head dim 128 backward 32 (its dK and dV take 128
    registers a thread); f32 and a GPU without wgmma keep mma.sync."""
    from jnova.passes.configure.attention_tiles import WGMMA_ACCUMULATOR_REGISTERS, WGMMA_BY_DEFAULT

    def choices(d, dtype="bfloat16", target=H200):
        p = AttentionProblem(8, 12, 12, 1024, 1024, d, dtype, True)
        return (choose_attention_tiles(p, target, wgmma=True),
                choose_attention_tiles(p, target, backward=True, wgmma=True))
    assert choices(64) == (AttentionConfig(128, 128, 8, 2, "wgmma"), AttentionConfig(128, 64, 8, 2, "wgmma"))
    assert choices(128) == (AttentionConfig(128, 128, 8, 2, "wgmma"), AttentionConfig(128, 32, 8, 2, "wgmma"))
    p = AttentionProblem(8, 12, 12, 1024, 1024, 128, "bfloat16", True)
    assert AttentionConfig(128, 64, 8, 2, "wgmma").accumulator_registers(p, backward=True) > WGMMA_ACCUMULATOR_REGISTERS
    assert all(c.mma == "mma.sync" for c in choices(64, "float32") + choices(64, target=H200_MMA_SYNC))
    assert all(c.mma == "mma.sync" for c in choices(64, target=get_target("rtx6000ada")))
    p = AttentionProblem(8, 12, 12, 1024, 1024, 64, "bfloat16", True)
    assert choose_attention_tiles(p, H200).mma == ("wgmma" if WGMMA_BY_DEFAULT else "mma.sync")


def test_choices_are_deterministic():
    p = AttentionProblem(2, 16, 4, 2048, 2048, 128, "bfloat16", False, layout="bhtd")
    assert {choose_attention_tiles(p, H200) for _ in range(3)} == {choose_attention_tiles(p, H200)}


@pytest.mark.parametrize("change,reason", [
    (dict(head_dim=96), "head dim 96"),
    (dict(dtype="float16"), "dtype float16"),
    (dict(bias=True), "bias"),
    (dict(mask=True), "mask"),
    (dict(kv_heads=3), "kv heads do not divide"),
    (dict(kv_len=512), "causal attention with 1024 queries and 512 keys"),
    (dict(scale=-0.5), "positive scale"),
    (dict(layout="tbhd"), "layout"),
])
def test_refusals_say_why(change, reason):
    base = dict(batch=2, q_heads=10, kv_heads=2, q_len=1024, kv_len=1024, head_dim=64, dtype="bfloat16", causal=True)
    p = AttentionProblem(**{**base, **change})
    assert reason in attention_refusal(p, H200)
    with pytest.raises(ValueError, match="no attention kernel"):
        choose_attention_tiles(p, H200)
    with pytest.raises(LoweringError, match="cannot build an attention kernel"):
        attention_forward_module(p, AttentionConfig(), H200)


def test_a_config_the_kernel_cannot_run_is_refused():
    p = AttentionProblem(1, 1, 1, 128, 128, 64)
    with pytest.raises(LoweringError, match="16 query rows"):
        attention_forward_module(p, AttentionConfig(block_m=128, warps=4), H200)
    assert "bf16 tensor cores" not in (attention_refusal(p, get_target("rtx3060")) or "")


def test_parameters_follow_the_plan_kernel():
    """q is k (one input parameter for both), outputs in another order: the roles map to parameters."""
    p = AttentionProblem(1, 2, 2, 70, 70, 64, "bfloat16", True)
    module = attention_forward_module(p, choose_attention_tiles(p, H200), H200, "shared_qk",
                                      inputs=(("q", "k"), ("v",)), outputs=("lse", "o"))
    rng = np.random.default_rng(11)
    qk = rng.standard_normal((1, 70, 2, 64)).astype(BF16)
    v = rng.standard_normal((1, 70, 2, 64)).astype(BF16)
    lse, o = np.full((1, 2, 70), np.nan, np.float32), np.full(qk.shape, np.nan, BF16)
    run_kernel(module.text, module.grid, module.block, module.shared_mem_bytes, {"qk": qk, "v": v, "lse": lse, "o": o})
    want_o, want_lse = _reference(p, qk, qk, v)
    assert np.linalg.norm(np.asarray(o, np.float64) - want_o) / np.linalg.norm(want_o) < TOLERANCE["bfloat16"]
    np.testing.assert_allclose(lse, want_lse, atol=1e-4, rtol=0)


def test_jnova_compile_for_the_h200_runs_attention_as_the_fused_kernel():
    """Ahead of time for the H200: nova.attention becomes the fused forward kernel and its backward the
    dQ and dK/dV kernels; a head dim the kernels refuse (96) takes the generic path."""
    import jax
    import jax.numpy as jnp
    import jnova

    q = jnp.ones((2, 130, 4, 64), jnp.bfloat16)
    launches = jnova.compile(lambda q, k, v: jnova.ops.attention(q, k, v, causal=True), target="h200") \
        .lower(q, q, q).as_text("launches")
    assert launches.count(f"attention[fwd {STEP_INSTRUCTION} bf16] attention 2x4x130x64 bfloat16 bthd causal") == 1, launches
    assert "matmul" not in launches

    q96 = jnp.ones((2, 130, 4, 96), jnp.bfloat16)
    launches = jnova.compile(lambda q, k, v: jnova.ops.attention(q, k, v), target="h200") \
        .lower(q96, q96, q96).as_text("launches")
    assert "attention[" not in launches and "matmul" in launches

    def loss(q, k, v):
        return jnp.sum(jnova.ops.attention(q, k, v, causal=True).astype(jnp.float32) ** 2)
    k, v = jnp.full_like(q, 2), jnp.full_like(q, 3)
    lowered = jnova.compile(jax.grad(loss, argnums=(0, 1, 2)), target="h200").lower(q, k, v)
    launches = lowered.as_text("launches")
    for kind in ("fwd", "dq", "dkdv"):  # the backward as its two kernels
        assert launches.count(f"attention[{kind} {STEP_INSTRUCTION} bf16] attention 2x4x130x64 bfloat16 bthd causal") == 1, launches
    assert "matmul" not in launches
    nova = lowered.as_text("nova")
    assert '"nova.attention_dq"' in nova and '"nova.attention_dkdv"' in nova and '"nova.attention_backward"' not in nova

    # the same step differentiating q against itself: the backward's operands are not distinct
    launches = jnova.compile(jax.grad(lambda x: loss(x, x, x)), target="h200").lower(q).as_text("launches")
    assert "attention[fwd" in launches and "attention[dq" not in launches and "matmul" in launches


# -- the backward kernels (dQ; dK and dV)

from jnova.codegen.gpu.attention_backward import (attention_dkdv_module, attention_dq_module,  # noqa: E402
                                                  build_attention_dkdv, build_attention_dq)

BACKWARD_PTX_SHAPES = [(8, 12, 12, 1024, 64, "bthd"), (3, 4, 4, 1000, 64, "bhtd"), (2, 16, 16, 2048, 128, "bthd"),
                       (8, 8, 2, 1000, 128, "bhtd")]


@requires_ptxas
@pytest.mark.parametrize("dtype,instruction,causal,batch,hq,hkv,t,d,layout", [
    pytest.param(dtype, instruction, causal, *s,
                 id=f"{dtype}-{instruction}-{'causal' if causal else 'full'}-{s[0]}x{s[1]}:{s[2]}x{s[3]}x{s[4]}-{s[5]}")
    for dtype, instruction in (("bfloat16", "wgmma"), ("bfloat16", "mma.sync"), ("float32", "mma.sync"))
    for causal in (False, True) for s in BACKWARD_PTX_SHAPES])
def test_backward_ptx_assembles_without_spills(dtype, instruction, causal, batch, hq, hkv, t, d, layout):
    problem = AttentionProblem(batch, hq, hkv, t, t, d, dtype, causal, layout=layout)
    target = INSTRUCTIONS[instruction]
    config = choose_attention_tiles(problem, target, backward=True, wgmma=instruction == "wgmma")
    assert config.mma == instruction
    for build in (build_attention_dq, build_attention_dkdv):
        kernel = build(problem, config, target)
        report = assemble_check(kernel.ptx, target.arch)
        print(f"{kernel.schedule}: {report}")
        assert report.spills == 0 and report.stack_frame == 0, report.log
        assert kernel.shared_mem_bytes == config.backward_smem_bytes(problem) <= target.smem_per_block_optin
        assert kernel.ptx.count(".param .u64 .ptr") == 8
        assert "ex2.approx.ftz.f32" in kernel.ptx
        assert_instructions(kernel.ptx, dtype, instruction)


def _backward_reference(p: AttentionProblem, q, k, v, do):
    """o, lse, delta, dq, dk, dv in float64 (o, dq, dk, dv in the problem's layout)."""
    swap = (lambda x: np.swapaxes(x, 1, 2)) if p.layout == "bthd" else (lambda x: x)
    q, k, v, do = (np.asarray(swap(x), np.float64) for x in (q, k, v, do))
    kr, vr = np.repeat(k, p.group, 1), np.repeat(v, p.group, 1)
    s = np.einsum("bhqd,bhkd->bhqk", q, kr) * p.softmax_scale
    if p.causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    prob = e / e.sum(-1, keepdims=True)
    o = prob @ vr
    delta = (do * o).sum(-1)
    ds = prob * (do @ np.swapaxes(vr, -1, -2) - delta[..., None])
    dq = ds @ kr * p.softmax_scale
    dk = np.einsum("bhqk,bhqd->bhkd", ds, q) * p.softmax_scale
    dv = np.einsum("bhqk,bhqd->bhkd", prob, do)
    b, _, t, d = dk.shape
    dk, dv = (x.reshape(b, p.kv_heads, p.group, t, d).sum(2) for x in (dk, dv))
    return swap(o), (m[..., 0] + np.log(e.sum(-1))), delta, swap(dq), swap(dk), swap(dv)


BACKWARD_INTERPRETED = [  # (batch, q heads, kv heads, T, D, dtype, causal, layout)
    (1, 1, 1, 77, 64, "bfloat16", True, "bthd"),
    (1, 1, 1, 77, 64, "float32", False, "bthd"),
    (1, 2, 1, 70, 128, "bfloat16", True, "bhtd"),
    (1, 2, 1, 40, 128, "float32", True, "bthd"),
]


@pytest.mark.parametrize("case,instruction", _with_instructions(BACKWARD_INTERPRETED))
def test_backward_numerics_in_the_warp_interpreter(case, instruction):
    batch, hq, hkv, t, d, dtype, causal, layout = case
    p = AttentionProblem(batch, hq, hkv, t, t, d, dtype, causal, layout=layout)
    config = _configured(p, instruction, backward=True)
    rng = np.random.default_rng(sum(case[:5]))
    dt = BF16 if dtype == "bfloat16" else np.float32

    def shape(heads):
        return (batch, t, heads, d) if layout == "bthd" else (batch, heads, t, d)
    q, k, v, do = (rng.standard_normal(shape(h)).astype(dt) for h in (hq, hkv, hkv, hq))
    o, lse, delta, dq, dk, dv = _backward_reference(p, q, k, v, do)
    o, lse = o.astype(dt), lse.astype(np.float32)
    got = {"dq": np.full(q.shape, np.nan, dt), "delta": np.full(lse.shape, np.nan, np.float32),
           "dk": np.full(k.shape, np.nan, dt), "dv": np.full(k.shape, np.nan, dt)}
    module = attention_dq_module(p, config, H200)
    run_kernel(module.text, module.grid, module.block, module.shared_mem_bytes,
               dict(q=q, k=k, v=v, o=o, lse=lse, do=do, dq=got["dq"], delta=got["delta"]))
    module = attention_dkdv_module(p, config, H200)
    run_kernel(module.text, module.grid, module.block, module.shared_mem_bytes,
               dict(q=q, k=k, v=v, lse=lse, delta=got["delta"], do=do, dk=got["dk"], dv=got["dv"]))
    want_delta = (np.asarray(do, np.float64) * np.asarray(o, np.float64)).sum(-1)  # from the rounded o it is given
    np.testing.assert_allclose(got["delta"], want_delta.swapaxes(1, 2) if layout == "bthd" else want_delta,
                               rtol=1e-4, atol=1e-4)
    for name, want in (("dq", dq), ("dk", dk), ("dv", dv)):
        error = np.linalg.norm(np.asarray(got[name], np.float64) - want) / np.linalg.norm(want)
        print(f"{p}: relative error of {name} {error:.2e}")
        assert not np.isnan(np.asarray(got[name], np.float32)).any() and error < TOLERANCE[dtype], name


def test_backward_tiles_keep_two_blocks_per_sm_where_they_can():
    p = AttentionProblem(8, 12, 12, 1024, 1024, 128, "bfloat16", True)
    config = choose_attention_tiles(p, H200_MMA_SYNC, backward=True)
    assert config.backward_smem_bytes(p) == 2 * 64 * 256 + 2 * (2 * 64 * 256 + 2 * 64 * 4) == 97 * KiB
    assert config.blocks_per_sm(p, H200, backward=True) == 228 // 98 == 2


def test_split_attention_backward_gives_the_two_halves():
    import jax.numpy as jnp
    import jnova
    from jnova.dialect.ops_attention_split import AttentionDkdvOp, AttentionDqOp
    from jnova.passes.split_attention_backward import split_attention_backward

    def loss(q, k, v):
        return jnp.sum(jnova.ops.attention(q, k, v, causal=True) ** 2)
    import jax
    from helpers.nova_funcs import nova_func

    x = np.ones((1, 70, 2, 64), np.float32)
    func = nova_func(jax.grad(loss, argnums=(0, 1, 2)), x, x + 1, x + 2)
    assert split_attention_backward(func, lambda op: False) == 0
    assert split_attention_backward(func, lambda op: True) == 1
    names = [op.name for op in func.ops]
    assert "nova.attention_backward" not in names
    dq, dkdv = (next(op for op in func.ops if isinstance(op, cls)) for cls in (AttentionDqOp, AttentionDkdvOp))
    assert names.index(dq.name) < names.index(dkdv.name) and dkdv.operands[4] is dq.results[1]
    func.verify()


def test_a_backward_half_writes_only_the_outputs_the_plan_reads():
    """dk unused (only dv read): the dK/dV kernel has one output parameter, and dv is still right."""
    p = AttentionProblem(1, 1, 1, 40, 40, 64, "float32", True)
    config = choose_attention_tiles(p, H200, backward=True)
    module = attention_dkdv_module(p, config, H200, "dv_only", writes=("dv",))
    assert module.text.count("memref<2560xf32> {llvm.align") == 5  # q, k, v, do and dv; no dk
    rng = np.random.default_rng(21)
    q, k, v, do = (rng.standard_normal((1, 40, 1, 64)).astype(np.float32) for _ in range(4))
    o, lse, delta, _, _, dv = _backward_reference(p, q, k, v, do)
    got = np.full(k.shape, np.nan, np.float32)
    run_kernel(module.text, module.grid, module.block, module.shared_mem_bytes,
               dict(q=q, k=k, v=v, lse=lse.astype(np.float32), delta=delta.astype(np.float32), do=do, dv=got))
    assert np.linalg.norm(got - dv) / np.linalg.norm(dv) < TOLERANCE["float32"]


# -- operands read in place: q, k, v as slices of one fused projection's buffer

from jnova.codegen.gpu.attention_operands import RowView  # noqa: E402

VIEWED = [  # (batch, q heads, kv heads, T, D, dtype, causal, layout)
    (2, 2, 1, 77, 64, "bfloat16", True, "bthd"),
    (1, 2, 2, 77, 64, "float32", False, "bhtd"),
    (1, 4, 2, 70, 128, "bfloat16", True, "bhtd"),
]


def _fused_projection(p: AttentionProblem, rng, dt):
    """A [B, T, (Hq + 2 Hkv) D] buffer, q, k and v (copies, in the problem's layout) as its three column
    slices, and their views in it."""
    d, hq, hkv = p.head_dim, p.q_heads, p.kv_heads
    width = (hq + 2 * hkv) * d
    qkv = rng.standard_normal((p.batch, p.q_len, width)).astype(dt)
    views, parts = {}, {}
    for role, first, heads in (("q", 0, hq), ("k", hq, hkv), ("v", hq + hkv, hkv)):
        part = qkv[..., first * d:(first + heads) * d].reshape(p.batch, p.q_len, heads, d)
        parts[role] = np.ascontiguousarray(part if p.layout == "bthd" else part.swapaxes(1, 2))
        views[role] = RowView(first * d, p.q_len * width, d, width)
    return qkv, parts, views


@pytest.mark.parametrize("case,instruction", _with_instructions(VIEWED))
def test_forward_reads_q_k_v_in_place_from_one_buffer(case, instruction):
    """One input parameter, the whole projection buffer (exactly its size: a read past it faults)."""
    batch, hq, hkv, t, d, dtype, causal, layout = case
    p = AttentionProblem(batch, hq, hkv, t, t, d, dtype, causal, layout=layout)
    dt = BF16 if dtype == "bfloat16" else np.float32
    qkv, parts, views = _fused_projection(p, np.random.default_rng(), dt)
    module = attention_forward_module(p, _configured(p, instruction), H200, "fused_qkv", inputs=(("q", "k", "v"),),
                                      views=views, input_sizes=(qkv.size,))
    assert module.text.count(f"memref<{qkv.size}x{'bf16' if dtype == 'bfloat16' else 'f32'}> {{llvm.align") == 1
    o = np.full(parts["q"].shape, np.nan, dt)
    lse = np.full((batch, hq, t), np.nan, np.float32)
    run_kernel(module.text, module.grid, module.block, module.shared_mem_bytes, {"qkv": qkv, "o": o, "lse": lse})
    want_o, want_lse = _reference(p, parts["q"], parts["k"], parts["v"])
    error = np.linalg.norm(np.asarray(o, np.float64) - want_o) / np.linalg.norm(want_o)
    assert not np.isnan(np.asarray(o, np.float32)).any() and error < TOLERANCE[dtype], error
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=2e-3 if dtype == "float32" else 1e-4)


@pytest.mark.parametrize("case,instruction", _with_instructions(VIEWED))
def test_backward_reads_q_k_v_and_do_in_place(case, instruction):
    """dQ and dK/dV kernels reading q, k, v from one projection buffer and do from the second half of a
    wider buffer (offset and row stride of its own); o and lse in their own layouts."""
    batch, hq, hkv, t, d, dtype, causal, layout = case
    p = AttentionProblem(batch, hq, hkv, t, t, d, dtype, causal, layout=layout)
    config = _configured(p, instruction, backward=True)
    dt = BF16 if dtype == "bfloat16" else np.float32
    rng = np.random.default_rng()
    qkv, parts, views = _fused_projection(p, rng, dt)
    wide = rng.standard_normal((batch, t, 2 * hq * d)).astype(dt)
    do = wide[..., hq * d:].reshape(batch, t, hq, d)
    do = np.ascontiguousarray(do if layout == "bthd" else do.swapaxes(1, 2))
    views["do"] = RowView(hq * d, t * 2 * hq * d, d, 2 * hq * d)
    o, lse, delta, dq, dk, dv = _backward_reference(p, parts["q"], parts["k"], parts["v"], do)
    o, lse = o.astype(dt), lse.astype(np.float32)
    got = {"dq": np.full(parts["q"].shape, np.nan, dt), "delta": np.full(lse.shape, np.nan, np.float32),
           "dk": np.full(parts["k"].shape, np.nan, dt), "dv": np.full(parts["k"].shape, np.nan, dt)}
    module = attention_dq_module(p, config, H200, "dq_in_place", inputs=(("q", "k", "v"), ("o",), ("lse",), ("do",)),
                                 views=views, input_sizes=(qkv.size, o.size, lse.size, wide.size))
    run_kernel(module.text, module.grid, module.block, module.shared_mem_bytes,
               dict(qkv=qkv, o=o, lse=lse, do=wide, dq=got["dq"], delta=got["delta"]))
    module = attention_dkdv_module(p, config, H200, "dkdv_in_place",
                                   inputs=(("do",), ("lse",), ("q", "k", "v"), ("delta",)), views=views,
                                   input_sizes=(wide.size, lse.size, qkv.size, lse.size))
    run_kernel(module.text, module.grid, module.block, module.shared_mem_bytes,
               dict(do=wide, lse=lse, qkv=qkv, delta=got["delta"], dk=got["dk"], dv=got["dv"]))
    for name, want in (("dq", dq), ("dk", dk), ("dv", dv)):
        error = np.linalg.norm(np.asarray(got[name], np.float64) - want) / np.linalg.norm(want)
        print(f"{p}: relative error of {name} {error:.2e}")
        assert not np.isnan(np.asarray(got[name], np.float32)).any() and error < TOLERANCE[dtype], name


@requires_ptxas
@pytest.mark.parametrize("dtype,instruction", [("bfloat16", "wgmma"), ("bfloat16", "mma.sync"), ("float32", "mma.sync")])
def test_kernels_reading_in_place_assemble_without_spills(dtype, instruction):
    """GPT-2's shape, q, k, v as views of its [B, T, 3 C] projection: forward, dQ and dK/dV."""
    p = AttentionProblem(8, 12, 12, 1024, 1024, 64, dtype, True)
    width, size = 3 * 12 * 64, 8 * 1024 * 3 * 12 * 64
    views = {r: RowView(i * 12 * 64, 1024 * width, 64, width) for i, r in enumerate("qkv")}
    modules = [attention_forward_module(p, _configured(p, instruction), H200, "fwd", (("q", "k", "v"),),
                                        views=views, input_sizes=(size,))]
    config = _configured(p, instruction, backward=True)
    modules.append(attention_dq_module(p, config, H200, "dq", inputs=(("q", "k", "v"), ("o",), ("lse",), ("do",)),
                                       views=views, input_sizes=(size, size // 3, 8 * 12 * 1024, size // 3)))
    modules.append(attention_dkdv_module(p, config, H200, "dkdv",
                                         inputs=(("q", "k", "v"), ("lse",), ("delta",), ("do",)), views=views,
                                         input_sizes=(size, 8 * 12 * 1024, 8 * 12 * 1024, size // 3)))
    for module in modules:
        ptx = to_ptx(module.text)
        report = assemble_check(ptx, H200.arch)
        print(f"{module.schedule}: {report}")
        assert report.spills == 0 and report.stack_frame == 0, report.log
        assert ptx.count(".param .u64 .ptr") == (3 if module.name == "fwd" else 6)


@pytest.mark.parametrize("case,instruction", _with_instructions(VIEWED))
def test_dkdv_writes_the_concatenation_of_the_gradients(case, instruction):
    """The dK/dV kernel writes dk and dv into their columns of the [B, T, (Hq + 2 Hkv) D] gradient of a
    fused projection and copies dq (an input) into the first ones: the whole buffer, poisoned before,
    is the concatenation; q, k, v are read in place from the projection as in the step."""
    from jnova.codegen.gpu.attention_operands import Concatenation

    batch, hq, hkv, t, d, dtype, causal, layout = case
    p = AttentionProblem(batch, hq, hkv, t, t, d, dtype, causal, layout=layout)
    config = _configured(p, instruction, backward=True)
    dt = BF16 if dtype == "bfloat16" else np.float32
    rng = np.random.default_rng()
    qkv, parts, views = _fused_projection(p, rng, dt)
    do = rng.standard_normal(parts["q"].shape).astype(dt)
    o, lse, delta, dq, dk, dv = _backward_reference(p, parts["q"], parts["k"], parts["v"], do)
    dq = dq.astype(dt)  # the dQ kernel's output, which this kernel copies
    width = qkv.shape[-1]
    grad_views = {"dk": RowView(hq * d, t * width, d, width), "dv": RowView((hq + hkv) * d, t * width, d, width)}
    dq_strides = (t * width, width, d, 1) if layout == "bthd" else (t * width, d, width, 1)
    concatenation = Concatenation(qkv.size, grad_views, ((4, dq.shape, 0, dq_strides),), frozenset())
    module = attention_dkdv_module(p, config, H200, "dkdv_concatenated",
                                   inputs=(("q", "k", "v"), ("lse",), ("delta",), ("do",), ("part0",)), views=views,
                                   input_sizes=(qkv.size, lse.size, lse.size, do.size, dq.size),
                                   concatenation=concatenation)
    got = np.full(qkv.shape, np.nan, dt)
    run_kernel(module.text, module.grid, module.block, module.shared_mem_bytes,
               dict(qkv=qkv, lse=lse.astype(np.float32), delta=delta.astype(np.float32), do=do, dq=dq, grad=got))
    as_bthd = (lambda x: x) if layout == "bthd" else (lambda x: x.swapaxes(1, 2))
    got = np.asarray(got, np.float64).reshape(batch, t, hq + 2 * hkv, d)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[:, :, :hq], as_bthd(np.asarray(dq, np.float64)))  # copied exactly
    for name, want, heads in (("dk", dk, slice(hq, hq + hkv)), ("dv", dv, slice(hq + hkv, None))):
        error = np.linalg.norm(got[:, :, heads] - as_bthd(want)) / np.linalg.norm(want)
        assert error < TOLERANCE[dtype], (name, error)


@requires_ptxas
@pytest.mark.parametrize("dtype,instruction", [("bfloat16", "wgmma"), ("bfloat16", "mma.sync"), ("float32", "mma.sync")])
def test_dkdv_writing_the_concatenation_assembles_without_spills(dtype, instruction):
    from jnova.codegen.gpu.attention_operands import Concatenation

    p = AttentionProblem(8, 12, 12, 1024, 1024, 64, dtype, True)
    width, size, rows = 3 * 768, 8 * 1024 * 3 * 768, 8 * 12 * 1024
    views = {r: RowView(i * 768, 1024 * width, 64, width) for i, r in enumerate(("q", "k", "v"))}
    concatenation = Concatenation(size, {"dk": views["k"], "dv": views["v"]},
                                  ((4, (8, 1024, 12, 64), 0, (1024 * width, width, 64, 1)),), frozenset())
    module = attention_dkdv_module(p, _configured(p, instruction, backward=True), H200, "dkdv",
                                   inputs=(("q", "k", "v"), ("lse",), ("delta",), ("do",), ("part0",)), views=views,
                                   input_sizes=(size, rows, rows, size // 3, size // 3), concatenation=concatenation)
    ptx = to_ptx(module.text)
    report = assemble_check(ptx, H200.arch)
    print(f"{module.schedule}: {report}")
    assert report.spills == 0 and report.stack_frame == 0, report.log
    assert ptx.count(".param .u64 .ptr") == 6
