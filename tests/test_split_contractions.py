"""Split-K: a weight gradient whose tiles leave SMs idle becomes partial products over K and their sum
(configure/split_k.py, passes/split_contractions.py); a lone reshape is a view, not a kernel."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnova
from jnova.passes.configure.problem import contraction_problem
from jnova.passes.configure.operand_transposes import choose_transposes, explain_transposes
from jnova.passes.configure.problem import ContractionProblem
from jnova.passes.configure.split_k import SPLIT_K_MIN_GAIN, SPLIT_K_MIN_K, choose_split_k, explain_split_k, split_times
from jnova.passes.split_contractions import split_contractions
from jnova.primitives.nova_to_jax import evaluate_ops
from jnova.runtime.target import PRESETS
from helpers.nova_funcs import nova_func as _func
from helpers.random_inputs import f32 as _f32

H200, RTX3060 = PRESETS["h200"], PRESETS["rtx3060"]
H200_WITHOUT_TENSOR_MAPS = dataclasses.replace(H200, tensor_maps=False)  # jaxlib's kernel call: no TMA descriptors


def _weight_gradient(x, dy, w):
    """An SGD step on a weight: dW = x^T dy over batch and tokens (both operands MN-major)."""
    g = jnp.einsum("btm,btn->mn", x, dy)
    return w - 0.01 * g, jnp.sum(g * g)


def _problem(m, n, k, dtype="float32", a="col", b="row"):
    return ContractionProblem(m, n, k, operand_dtype=dtype, a_layout=a, b_layout=b)


def test_gpt2_weight_gradients_split_on_the_h200():
    """TF32 weight gradients of GPT-2 at 8 x 1024 tokens (A and B MN-major): 18-72 tiles of 256 x 128
    for 132 SMs on the wgmma kernel, so they are split. Where the warp-specialized kernel can run (tensor maps),
    each side is weighed as the operand-transpose decision would lay it out: both operands copied K-major, the ping-pong
    kernel takes all but 768 x 768 whole (2304 x 768: 212.5 us whole against 224.9 us in two)."""
    for m, n in ((768, 768), (2304, 768), (3072, 768), (768, 3072)):
        problem = _problem(m, n, 8192)
        assert choose_split_k(problem, H200_WITHOUT_TENSOR_MAPS) > 1, explain_split_k(problem, H200_WITHOUT_TENSOR_MAPS)
        assert (choose_split_k(problem, H200) > 1) == (m == n == 768), explain_split_k(problem, H200)
        if m * n > 768 * 768:
            assert choose_transposes(problem, H200) == (True, True), explain_transposes(problem, H200)
    # the LM head's 50257 x 768 gradient fills the SMs nine times over
    assert choose_split_k(_problem(50260, 768, 8192), H200) == 1


def test_a_long_tf32_k_is_weighed_after_the_operand_transposes_it_would_get():
    """The LM head's input gradient in TF32 (B, the embedding, as [K, N]): whole, B copied K-major
    and the ping-pong kernel (2132 us estimated) against two splits on the wgmma kernel; without tensor
    maps the split wins, as it did before the warp-specialized kernel took TF32."""
    problem = _problem(8192, 768, 50304, a="row", b="row")
    assert choose_split_k(problem, H200) == 1, explain_split_k(problem, H200)
    assert choose_transposes(problem, H200) == (False, True)
    assert choose_split_k(problem, H200_WITHOUT_TENSOR_MAPS) == 2, explain_split_k(problem, H200_WITHOUT_TENSOR_MAPS)


@pytest.mark.parametrize("problem, target", [
    (_problem(768, 768, 8192, a="row", b="col"), H200),    # B as [N, K]: S would not lead
    (_problem(768, 768, 8192, a="col", b="col"), H200),
    (dataclasses.replace(_problem(768, 768, 8192), batch=4), H200),  # batched already
    (_problem(768, 768, 8192), RTX3060),                   # mma.sync: the time model is wgmma's
    (_problem(768, 768, 768), H200),                       # K too short to split
    (_problem(8192, 8192, 8192), H200),                    # many waves already
])
def test_split_k_is_left_alone(problem, target):
    assert choose_split_k(problem, target) == 1


def test_split_k_needs_a_clear_estimated_gain():
    """A split is taken only when its estimate beats the unsplit one by 10%; the chosen one is the
    fastest estimate; every split divides K into parts of at least SPLIT_K_MIN_K."""
    for m, n, k in ((768, 768, 8192), (3072, 768, 8192), (768, 3072, 16384), (1024, 512, 4096)):
        for dtype in ("float32", "bfloat16"):
            times = dict(split_times(_problem(m, n, k, dtype), H200))
            chosen = choose_split_k(_problem(m, n, k, dtype), H200)
            assert all(k % s == 0 and k // s >= SPLIT_K_MIN_K for s in times)
            if chosen > 1:
                assert times[chosen] == min(times.values()) and times[chosen] <= SPLIT_K_MIN_GAIN * times[1]
            else:
                assert min(times.values()) > SPLIT_K_MIN_GAIN * times[1]


def test_split_rewrite_keeps_the_result():
    """The rewritten program (views, a batched matmul, a sum over the splits) computes the same
    values as jax.jit, evaluated op by op."""
    args = (_f32(8, 1024, 768), _f32(8, 1024, 768), _f32(768, 768))
    func = _func(_weight_gradient, *args)
    assert split_contractions(func, H200) == 1
    func.verify()
    names = [op.name for op in func.ops]
    assert names.count("nova.reshape") == 2 and names.count("nova.matmul") == 1
    (matmul,) = [op for op in func.ops if op.name == "nova.matmul"]
    problem, _ = contraction_problem(matmul)
    assert problem.batch == choose_split_k(_problem(768, 768, 8192), H200) and problem.k * problem.batch == 8192
    (total,) = [op for op in func.ops if op.name == "nova.reduce" and op.operands[0] is matmul.results[0]]
    assert total.attrs["kind"] == "sum" and tuple(total.attrs["dims"]) == (0,)
    got = jax.jit(evaluate_ops(func.ops, func.args, func.returns))(*args)
    want = jax.jit(_weight_gradient)(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-4 * float(np.abs(w).max()))


def test_small_contractions_and_k_major_b_are_not_split():
    func = _func(_weight_gradient, _f32(2, 64, 32), _f32(2, 64, 16), _f32(32, 16))
    assert split_contractions(func, H200) == 0
    nt = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())))  # noqa: E731  (B as [N, K])
    func = _func(nt, _f32(4096, 50304), _f32(768, 50304))
    assert split_contractions(func, H200) == 0


def test_long_k_with_a_row_major_splits_in_place(monkeypatch):
    """A as [M, K] with a long K (the LM head's input gradient over the vocabulary): A is viewed as
    [M, S, K/S], the kernels' problem reads it in place (a_split_k), and the values are unchanged.
    Where the warp-specialized kernel can run (tensor maps), it takes the long K whole (the warp-specialized kernel's
    time: 549.8 us against 693.7 us for four splits); jaxlib's kernel call splits it."""
    fn = lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32)  # noqa: E731
    args = (_f32(512, 50304).astype(jnp.bfloat16), _f32(50304, 768).astype(jnp.bfloat16))
    problem = _problem(4096, 768, 50304, "bfloat16", a="row")
    assert choose_split_k(problem, H200) == 1, explain_split_k(problem, H200)
    monkeypatch.setenv("JNOVA_LAUNCHER", "jaxlib")
    splits = choose_split_k(problem, H200_WITHOUT_TENSOR_MAPS)
    assert splits > 1 and (50304 // splits * 2) % 16 == 0, explain_split_k(problem, H200_WITHOUT_TENSOR_MAPS)
    func = _func(fn, *args)
    assert split_contractions(func, H200) == 1
    func.verify()
    (matmul,) = [op for op in func.ops if op.name == "nova.matmul"]
    p, reason = contraction_problem(matmul)
    assert reason is None and p.a_split_k and p.a_layout == "row" and p.batch * p.k == 50304
    got = jax.jit(evaluate_ops(func.ops, func.args, func.returns))(*args)
    want = jax.jit(fn)(*args)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want), rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_row_major_splits_keep_16_byte_aligned_slices():
    """f32 A of the padded GPT-2 vocabulary (50260 columns): only splits whose slices start 16-byte
    aligned are weighed."""
    times = dict(split_times(_problem(8192, 768, 50260, a="row"), H200))
    assert times and all(50260 // s * 4 % 16 == 0 for s in times if s > 1)


@pytest.mark.parametrize("launcher", ["jnova", "jaxlib"])
def test_gpu_plan_of_a_split_weight_gradient(monkeypatch, launcher):
    """Ahead of time for the H200: the batched contraction kernel and the sum as a column reduction.
    With tensor maps (jnova's launcher) the operand-transpose decision copies both operands of the partial products K-major,
    the reshapes folded into those transposes, and the ping-pong kernel takes them; through jaxlib's
    kernel call the operands' reshapes are views (no kernel, no XLA op) read by the wgmma kernel."""
    monkeypatch.setenv("JNOVA_LAUNCHER", launcher)
    tensor_maps = launcher == "jnova"
    args = (_f32(8, 1024, 768), _f32(8, 1024, 768), _f32(768, 768))
    lowered = jnova.compile(_weight_gradient, target="h200").lower(*args)
    stats = lowered.stats()
    launches = lowered.as_text("launches").splitlines()
    splits = choose_split_k(_problem(768, 768, 8192), dataclasses.replace(H200, tensor_maps=tensor_maps))
    assert splits > 1 and stats["xla_groups"] == 0, stats
    kernel = "tma-pingpong" if tensor_maps else "wgmma"
    assert any(f"matmul[{kernel}] {splits}x768x768x{8192 // splits}" in line for line in launches), launches
    assert any(f"column_reduction(rows={splits}," in line for line in launches), launches
    # each operand's reshape is a view, or folded into the transpose the operand-transpose decision makes of it
    part = dataclasses.replace(_problem(768, 768, 8192), batch=splits, k=8192 // splits)
    chosen = choose_transposes(part, dataclasses.replace(H200, tensor_maps=tensor_maps))
    assert chosen == (True, True) or not tensor_maps, explain_transposes(part, H200)
    transposes = sum(int(m.group(1)) for m in (re.match(r"kernel_\d+ x(\d+) transpose\(", line) for line in launches)
                     if m)
    assert transposes == sum(chosen) and stats["views"] == 2 - sum(chosen), (stats, launches)


def test_a_lone_reshape_is_a_view_on_the_cpu_too():
    """A reshape a matmul reads is a group of its own: a view step that XLA runs, with the same result."""
    fn = lambda x, w: (x.reshape(64, 32) @ w) * 2.0  # noqa: E731
    args = (_f32(8, 8, 32), _f32(32, 16))
    step = jnova.compile(fn, backend="cpu", kernels="fused")
    got = step(*args)
    assert step.stats()[0]["views"] == 1
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(fn)(*args)), rtol=1e-5, atol=1e-5)


def test_tf32_operands_are_transposed_where_the_configurator_says():
    """The operand-transpose decision: a forward layer's weight (B as [K, N]) is transposed into a K-major copy for TF32 on
    wgmma; bf16 operands (wgmma reads them MN-major) and mma.sync targets keep their layouts."""
    assert choose_transposes(_problem(8192, 3072, 768, a="row", b="row"), H200) == (False, True)
    assert choose_transposes(_problem(8192, 768, 3072, a="row", b="col"), H200) == (False, False)
    assert choose_transposes(_problem(8192, 3072, 768, "bfloat16", a="row", b="row"), H200) == (False, False)
    assert choose_transposes(_problem(8192, 3072, 768, a="row", b="row"), RTX3060) == (False, False)
    assert choose_transposes(_problem(512, 512, 512, a="row", b="row"), H200) == (False, False)
    # a copy larger than TRANSPOSE_MAX_BYTES is not made (the LM head's 8192 x 50257 logits gradient)
    assert choose_transposes(_problem(50260, 768, 8192), H200)[0] is False


def test_transpose_rewrite_keeps_the_result():
    from jnova.passes.transpose_operands import transpose_operands

    def fn(x, w, v):  # w is read by two contractions the same way: one transpose
        return jnp.tanh(x @ w) @ v, (x * 2.0) @ w

    args = (_f32(8192, 768), _f32(768, 2048), _f32(2048, 768))
    func = _func(fn, *args)
    assert transpose_operands(func, H200) >= 2
    func.verify()
    transposes = [op for op in func.ops if op.name == "nova.transpose"]
    assert sum(t.operands[0] is func.args[1] for t in transposes) == 1
    for op in func.ops:
        if op.name == "nova.matmul":
            assert contraction_problem(op)[0].b_layout == "col"
    got = jax.jit(evaluate_ops(func.ops, func.args, func.returns))(*args)
    want = jax.jit(fn)(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4 * float(np.abs(w).max()))


def test_split_and_transposed_plan_kernels_simulate_exactly():
    """The H200 plan of an SGD step on a split weight gradient and a transposed dense layer: every
    kernel the CPU can emulate (tiled transposes, the sums over the splits with their epilogues, the
    elementwise updates) matches jax.lax on random inputs with poisoned outputs."""
    from helpers.gpu_emulation import check_plan_kernels, gpu_plan

    def step(x, dy, w, v):
        g = jnp.einsum("btm,btn->mn", x, dy)
        return w - 0.01 * g, jnp.tanh(x.reshape(-1, 768) @ v)

    args = (_f32(8, 1024, 768), _f32(8, 1024, 768), _f32(768, 768), _f32(768, 3072))
    _, plan = gpu_plan(step, *args, target=H200)
    schedules = [compile_schedule(k) for k in plan.kernels]
    assert any(s.startswith("transpose(") for s in schedules), schedules
    assert any("column_reduction(rows=16" in s or "column reduction 1x589824" in s for s in schedules), schedules
    simulated, problems = check_plan_kernels(step, *args, target=H200)
    assert simulated >= 2 and not problems, problems  # the transpose and the batch (sum + tanh)


def compile_schedule(kernel) -> str:
    from jnova.codegen.gpu.compile import build_gpu_module

    return build_gpu_module(kernel, H200).schedule
