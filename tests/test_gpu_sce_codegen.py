"""The GPU's softmax cross-entropy kernels (nova.sce, nova.sce_backward) without a GPU.

- Every kernel the configurator schedules assembles with `ptxas -arch=sm_90a` within the register
  budget of its schedule's model, without spills, for GPT-2's loss (8192 x 50304) and awkward shapes
  (V = 50257, few rows, tiny V), and uses the instructions the design names (16-byte loads and
  stores, ex2.approx, NaN-propagating max, butterflies).
- Numerics: the generated gpu.func runs on the CPU in `gpu_warp_interpreter` (a block's threads in
  lockstep: shuffles, shared memory, masked branches) on fresh random inputs against float64 NumPy,
  with poisoned outputs: f32 and bf16 logits; V a multiple of the vector and the team (512), and not
  (1000, 1001, 1003, 50257, 13, 3, 1); teams of 1 to 512 threads (several rows per block, rows past
  the last, more threads than elements); parts of a row whose maxima differ by more than 80 (the
  rescaling merge); labels at the first and last class, outside [0, V), and ignored; dlogits written
  in place of the logits.
- Kernel formation: the loss head's ops (mean cross-entropy and its gradient) become the two row
  kernels and small reductions, and so does GPT-2's (the tiny model's step for the H200, with its
  row kernels run in the interpreter against jax.lax); the refusals say why.
GPU numerics: tests/gpu/test_gpu_sce.py."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnova
from helpers.cross_entropy import IGNORE, sce_reference
from helpers.gpu_emulation import gpu_plan, reference
from helpers.gpu_warp_interpreter import BF16, run_kernel
from helpers.kernels import requires_ptxas
from helpers.random_inputs import normal, values, values_for
from jnova.codegen.gpu.compile import KERNEL_FAMILIES, build_gpu_module, compile_gpu_kernel
from jnova.codegen.gpu.cross_entropy import build_sce, sce_kernel_refusal, sce_refusal
from jnova.codegen.gpu.cross_entropy_backward import build_sce_backward
from jnova.codegen.gpu.ptx import assemble_check
from jnova.dialect.ir import Func
from jnova.dialect.ops_training import layernorm_op, sce_backward_op, sce_op
from jnova.dialect.types import TensorType as T
from jnova.errors import LoweringError
from jnova.passes.configure.cross_entropy_rows import REGISTERS, choose_cross_entropy_rows
from jnova.passes.expand_training import expand_refused_training
from jnova.passes.form_kernels import form_plan
from jnova.passes.fuse import fuse
from jnova.passes.plan import Kernel
from jnova.passes.split_sce_reductions import split_sce_reductions
from jnova.primitives.backends import training_refusal
from jnova.runtime.target import get_target

H200 = get_target("h200")
NUMPY = {"float32": np.float32, "bfloat16": BF16}


def _forward_kernel(n, v, dtype, ignore=IGNORE, label_dtype="int32", outputs=(0, 1)) -> Kernel:
    f = Func("f", [T((n, v), dtype), T((n,), label_dtype)])
    op = f.add(sce_op(*f.args, reduction="none", ignore_index=ignore))
    return Kernel("sce_forward", [op], list(f.args), [op.results[i] for i in outputs])


def _backward_kernel(n, v, dtype, reduction="none", ignore=IGNORE) -> Kernel:
    dloss = T((n,) if reduction == "none" else (), "float32")
    f = Func("f", [T((n, v), dtype), T((n,), "int32"), T((n,), "float32"), dloss])
    op = f.add(sce_backward_op(*f.args, reduction=reduction, ignore_index=ignore))
    return Kernel("sce_backward", [op], list(f.args), list(op.results))


# -- PTX
PTX_CASES = [(8192, 50304, "bfloat16"), (8192, 50304, "float32"), (8192, 50257, "bfloat16"),
             (8192, 50257, "float32"), (16, 50304, "bfloat16"), (100, 1000, "float32"), (9, 13, "bfloat16")]


@requires_ptxas
@pytest.mark.parametrize("n,v,dtype", PTX_CASES, ids=[f"{n}x{v}-{d}" for n, v, d in PTX_CASES])
def test_forward_ptx_assembles_within_the_register_budget(n, v, dtype):
    kernel = _forward_kernel(n, v, dtype)
    launch = compile_gpu_kernel(kernel, H200)
    report = assemble_check(launch.ptx, H200.arch)
    print(f"{launch.schedule}: {report}")
    assert report.spills == 0 and report.stack_frame == 0 and report.registers <= REGISTERS, report.log
    sched = choose_cross_entropy_rows(n, v, dtype, H200)
    assert launch.schedule == str(sched) and launch.grid == (sched.grid, 1, 1) and launch.block == (sched.block, 1, 1)
    assert "ex2.approx.ftz.f32" in launch.ptx and "max.NaN.f32" in launch.ptx
    assert ("ld.global.v4" in launch.ptx) == (v >= sched.vector)
    assert ("shfl.sync.bfly" in launch.ptx) == (sched.team > 1)
    assert ("bar.sync" in launch.ptx) == (sched.team > 32)


@requires_ptxas
@pytest.mark.parametrize("reduction", ["none", "sum"])
@pytest.mark.parametrize("n,v,dtype", PTX_CASES, ids=[f"{n}x{v}-{d}" for n, v, d in PTX_CASES])
def test_backward_ptx_assembles_within_the_register_budget(n, v, dtype, reduction):
    launch = compile_gpu_kernel(_backward_kernel(n, v, dtype, reduction), H200)
    report = assemble_check(launch.ptx, H200.arch)
    print(f"{launch.schedule}: {report}")
    assert report.spills == 0 and report.stack_frame == 0 and report.registers <= REGISTERS, report.log
    assert "ex2.approx.ftz.f32" in launch.ptx and "shfl" not in launch.ptx and "bar.sync" not in launch.ptx
    if v >= 8:
        assert "ld.global.v4" in launch.ptx and "st.global.v4" in launch.ptx
    if dtype == "bfloat16":
        assert "cvt.rn.bf16x2.f32" in launch.ptx or v < 8


# -- numerics in the warp interpreter
def _logits(rng, n, v, dtype):
    """Standard normal * 3, with rows whose parts' maxima differ by more than 80: row 0's first third
    is 90 higher, row 1's last element 100 higher, row 2 is 90 lower throughout."""
    x = normal(rng, (n, v), "float32", scale=3.0)
    x[0, : max(1, v // 3)] += 90.0
    if n > 1:
        x[1, -1] += 100.0
    if n > 2:
        x[2] -= 90.0
    return x.astype(NUMPY[dtype])


def _labels(rng, n, v):
    """Uniform in [0, V), with the first and last class, ignored rows and labels outside [0, V)."""
    labels = values((n,), np.int32, rng, low=0, high=v)
    special = [0, v - 1, IGNORE, v + 5, -3, v - 1]
    labels[:min(n, len(special))] = special[:n]
    return labels


INTERPRETED = [  # (rows, classes, dtype, team)
    (6, 512, "float32", 32), (6, 512, "bfloat16", 16), (6, 1000, "float32", 64), (6, 1000, "bfloat16", 128),
    (7, 1001, "bfloat16", 32), (7, 1003, "float32", 256), (6, 50257, "bfloat16", 256), (6, 50257, "float32", 512),
    (9, 13, "bfloat16", 1), (9, 3, "float32", 2), (6, 1, "float32", 4), (6, 7, "bfloat16", 512), (33, 100, "float32", 8),
]


def _case_id(c):
    return f"{c[0]}x{c[1]}-{c[2]}-team{c[3]}"


@pytest.mark.parametrize("n,v,dtype,team", INTERPRETED, ids=[_case_id(c) for c in INTERPRETED])
def test_forward_numerics_in_the_warp_interpreter(n, v, dtype, team):
    rng = np.random.default_rng()
    x, labels = _logits(rng, n, v, dtype), _labels(rng, n, v)
    sched = choose_cross_entropy_rows(n, v, dtype, H200, team=team)
    module = build_sce(_forward_kernel(n, v, dtype), H200, sched)
    loss, lse = np.full(n, np.nan, np.float32), np.full(n, np.nan, np.float32)  # poisoned
    run_kernel(module.text, module.grid, module.block, 0, {"x": x, "labels": labels, "loss": loss, "lse": lse})
    want_lse, want_loss = sce_reference(x, labels)
    print(f"{sched}: max |lse error| {np.abs(lse - want_lse).max():.2e}, max |loss error| "
          f"{np.abs(loss - want_loss).max():.2e}")
    np.testing.assert_allclose(lse, want_lse, rtol=2e-6, atol=2e-5)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-6, atol=4e-5)
    assert (loss[labels == IGNORE] == 0).all()


def test_forward_writes_only_the_outputs_the_kernel_has():
    rng = np.random.default_rng()
    x, labels = _logits(rng, 5, 300, "float32"), _labels(rng, 5, 300)
    module = build_sce(_forward_kernel(5, 300, "float32", outputs=(1,)), H200)
    lse = np.full(5, np.nan, np.float32)
    run_kernel(module.text, module.grid, module.block, 0, {"x": x, "labels": labels, "lse": lse})
    np.testing.assert_allclose(lse, sce_reference(x, labels)[0], rtol=2e-6, atol=2e-5)


def _gradient(x, labels, lse, g):
    x = x.astype(np.float64)
    p = np.exp(x - lse.astype(np.float64)[:, None])
    inside = (labels >= 0) & (labels < x.shape[1])
    p[np.nonzero(inside)[0], labels[inside]] -= 1.0
    return p * np.where(labels == IGNORE, 0.0, g)[:, None]


@pytest.mark.parametrize("reduction", ["none", "sum"])
@pytest.mark.parametrize("n,v,dtype,team", INTERPRETED, ids=[_case_id(c) for c in INTERPRETED])
def test_backward_numerics_in_the_warp_interpreter(n, v, dtype, team, reduction):
    rng = np.random.default_rng()
    x, labels = _logits(rng, n, v, dtype), _labels(rng, n, v)
    lse = sce_reference(x, labels)[0].astype(np.float32)
    dloss = normal(rng, (n,) if reduction == "none" else (1,), "float32")
    sched = choose_cross_entropy_rows(n, v, dtype, H200, team=team)
    module = build_sce_backward(_backward_kernel(n, v, dtype, reduction), H200, sched)
    out = np.full((n, v), np.nan, NUMPY[dtype])
    run_kernel(module.text, module.grid, module.block, 0, {"x": x, "labels": labels, "lse": lse, "dloss": dloss,
                                                           "dlogits": out})
    g = np.broadcast_to(dloss, (n,))
    want = _gradient(x, labels, lse, g)
    print(f"{sched}: max |error| {np.abs(out.astype(np.float64) - want).max():.2e}")
    _assert_gradient_close(out, want, g, dtype)


def _assert_gradient_close(got, want, g, dtype):
    """f32: within 1e-5 of the value and a few f32 ulps of p (at most 1) times |g|, which is what
    rounding leaves of p - 1 where p is near 1, and flushed subnormals; bf16: one rounding more (half
    a bf16 ulp, 2^-9 relative)."""
    err = np.abs(got.astype(np.float64) - want)
    bound = (1e-5 if dtype == "float32" else 2.0**-8) * np.abs(want) + 4e-7 * np.abs(g)[:, None] + 1e-37
    at = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"{int((err > bound).sum())} elements differ, worst at {at}: {got[at]} vs {want[at]}"


def test_backward_in_place_of_the_logits():
    """dlogits written into the logits' buffer (reuse_buffers pairs them; the family is in place)."""
    rng = np.random.default_rng()
    n, v = 6, 1003
    x, labels = _logits(rng, n, v, "float32"), _labels(rng, n, v)
    lse = sce_reference(x, labels)[0].astype(np.float32)
    dloss = normal(rng, (n,), "float32")
    want = _gradient(x, labels, lse, dloss)
    module = build_sce_backward(_backward_kernel(n, v, "float32"), H200, choose_cross_entropy_rows(n, v, "float32", H200,
                                                                                                   team=32))
    run_kernel(module.text, module.grid, module.block, 0, {"x": x, "labels": labels, "lse": lse, "dloss": dloss,
                                                           "dlogits": x})
    _assert_gradient_close(x, want, dloss, "float32")
    assert KERNEL_FAMILIES.in_place(_backward_kernel(n, v, "float32")) and \
        not KERNEL_FAMILIES.in_place(_forward_kernel(n, v, "float32"))


def test_the_interpreter_catches_a_merge_without_rescaling(monkeypatch):
    """A team merge that adds the sums without rescaling them must give a wrong lse."""
    import jnova.codegen.gpu.cross_entropy as ce

    def naive(em, m1, s1, m2, s2, log2e):
        return em.op(f"arith.maximumf {m1}, {m2} : f32"), em.op(f"arith.addf {s1}, {s2} : f32")

    monkeypatch.setattr(ce, "merge", naive)
    rng = np.random.default_rng()
    x, labels = _logits(rng, 3, 1000, "float32"), _labels(rng, 3, 1000)
    module = build_sce(_forward_kernel(3, 1000, "float32"), H200, choose_cross_entropy_rows(3, 1000, "float32", H200,
                                                                                            team=64))
    loss, lse = np.full(3, np.nan, np.float32), np.full(3, np.nan, np.float32)
    run_kernel(module.text, module.grid, module.block, 0, {"x": x, "labels": labels, "loss": loss, "lse": lse})
    assert np.abs(lse - sce_reference(x, labels)[0]).max() > 1.0


# -- the configurator
def test_schedules_of_gpt2s_loss_follow_the_model():
    bf16 = choose_cross_entropy_rows(8192, 50304, "bfloat16", H200)
    f32 = choose_cross_entropy_rows(8192, 50304, "float32", H200)
    assert (bf16.vector, bf16.team, bf16.unroll, bf16.block, bf16.grid) == (8, 256, 4, 256, 8192)
    assert (f32.vector, f32.team, f32.unroll, f32.block, f32.grid) == (4, 512, 4, 512, 8192)
    # 16 groups per thread, rounded down to a power of two: 6288 / 256 and 12576 / 512 are 24.6
    assert 16 <= 50304 // 8 / bf16.team < 32 and 16 <= 50304 // 4 / f32.team < 32


def test_few_rows_get_bigger_teams_and_small_rows_share_blocks():
    few = choose_cross_entropy_rows(16, 50304, "bfloat16", H200)
    assert few.team == 1024 and few.grid == 16  # 16 x 256 threads would leave most SMs idle
    small = choose_cross_entropy_rows(1000, 13, "float32", H200)
    assert small.team == 1 and small.block == 128 and small.rows_per_block == 128 and small.grid == 8
    assert choose_cross_entropy_rows(8192, 50304, "bfloat16", get_target("rtx3060")).team == 256
    with pytest.raises(ValueError, match="power of two"):
        choose_cross_entropy_rows(8, 1000, "float32", H200, team=96)


# -- what the GPU takes, and kernel formation
def test_refusals_say_why():
    assert sce_refusal(_forward_kernel(4, 100, "float32").ops[0]) is None
    assert "float16" in sce_refusal(_forward_kernel(4, 100, "float16").ops[0])
    assert "cannot name each of 1000 classes" in sce_refusal(_forward_kernel(4, 1000, "float32", label_dtype="int8").ops[0])
    assert sce_refusal(_forward_kernel(4, 128, "float32", label_dtype="int8").ops[0]) is None
    f = Func("f", [T((4, 100), "float32"), T((4,), "int32")])
    mean = f.add(sce_op(*f.args, reduction="mean"))
    assert "split_sce_reductions" in sce_kernel_refusal(Kernel("k", [mean], list(f.args), [mean.results[0]]))
    assert "not cross-entropy: reduction 'mean'" in KERNEL_FAMILIES.accepts(Kernel("k", [mean], list(f.args), [mean.results[0]]))
    refusal = training_refusal("gpu", H200)
    assert refusal(mean) is None and "float16" in refusal(_forward_kernel(4, 100, "float16").ops[0])
    x = Func("g", [T((4, 8), "float32")])
    assert "no kernel family" in refusal(x.add(layernorm_op(x.args[0], epsilon=1e-5)))
    with pytest.raises(LoweringError, match="not a cross-entropy forward kernel"):
        build_sce(Kernel("k", [mean], list(f.args), [mean.results[0]]), H200)


def _loss_head(n, v, dtype, ignore):
    """The loss head as raised: mean cross-entropy of logits and its gradient from dloss."""
    f = Func("loss_head", [T((n, v), dtype), T((n,), "int32"), T((), "float32")])
    x, labels, dloss = f.args
    fwd = f.add(sce_op(x, labels, reduction="mean", ignore_index=ignore))
    bwd = f.add(sce_backward_op(x, labels, fwd.results[1], dloss, reduction="mean", ignore_index=ignore))
    f.returns = [fwd.results[0], bwd.results[0]]
    return f


@requires_ptxas
@pytest.mark.parametrize("ignore", [None, IGNORE])
def test_the_loss_head_becomes_two_row_kernels_and_small_reductions(ignore):
    """GPT-2's loss head (bf16 logits [8192, 50304]): the logits are read by two kernels, once each,
    and dlogits written once; the mean is a reduction over 8192 row losses. Every kernel assembles."""
    f = _loss_head(8192, 50304, "bfloat16", ignore)
    expand_refused_training(f, training_refusal("gpu", H200))
    split_sce_reductions(f)
    plan = form_plan(f, fuse(f).groups, True, KERNEL_FAMILIES)
    schedules = []
    for kernel in plan.kernels:
        launch = compile_gpu_kernel(kernel, H200)
        assert assemble_check(launch.ptx, H200.arch).spills == 0
        schedules.append(launch.schedule.split("(")[0])
        big = [v for v in kernel.inputs + kernel.outputs if v.type.size == 8192 * 50304]
        assert not big or [op.name for op in kernel.ops] in (["nova.sce"], ["nova.sce_backward"])
    print(schedules)
    assert schedules[0] == "sce_rows" and schedules[-1] == "sce_rows" and len(schedules) == (4 if ignore is None else 3)
    assert set(schedules[1:-1]) <= {"row_reduction", "row_program", "elementwise"}


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_gpt2_tiny_steps_loss_runs_as_the_two_row_kernels(dtype):
    """The GPT-2 example's tiny step for the H200: its loss and dlogits are the two cross-entropy
    kernels (bf16 logits read as they are), no other kernel reads a row of the vocabulary or writes an
    array of the logits' size but the LM head's contractions and dlogits; both row kernels of its
    plan, run in the interpreter on random inputs, equal their ops run by jax.lax."""
    gpt, params, tokens, vocab = _gpt2_tiny(dtype)

    def step(params, tokens, targets):
        return jax.value_and_grad(lambda p: gpt2_model().loss_fn(gpt, p, tokens, targets))(params)

    lowered = jnova.compile(step, target="h200").lower(params, tokens, tokens)
    launches = lowered.as_text("launches").splitlines()
    print("\n".join(launches))
    rows = [line for line in launches if "sce_rows(" in line]
    assert len(rows) == 2 and all(" x1 " in line and f"classes={vocab}," in line for line in rows)
    assert all(f"cols={vocab}," not in line for line in launches)  # no generic row reduction over the vocabulary
    logits_size = tokens.size * vocab
    steps = [s for s in lowered.executable.meta["plan"]["steps"] if "kernel" in s]
    wide = {name.split(" ")[0] for s in steps for (shape, _), name in zip(s["out_types"], s["made_by"])
            if np.prod(shape) == logits_size}
    # the LM head's product, its rounding to bf16 logits (flattened to rows), dlogits
    assert wide <= {"nova.matmul", "nova.convert", "nova.reshape", "nova.sce_backward"} and "nova.sce_backward" in wide
    text = lowered.as_text("nova")
    assert text.count('"nova.sce"') == 1 and text.count('"nova.sce_backward"') == 1
    backward = next(line for line in text.splitlines() if '"nova.sce_backward"' in line)
    want = f"tensor<{tokens.size}x{vocab}x{'bf16' if dtype else 'f32'}>"
    assert backward.split(" : (")[1].startswith(want) and backward.split(" -> ")[-1].startswith(want)  # bf16 rows

    _, plan = gpu_plan(step, params, tokens, tokens, target=H200, training_ops=True)
    rng = np.random.default_rng()
    checked = 0
    for kernel in plan.kernels:
        if [op.name for op in kernel.ops] not in (["nova.sce"], ["nova.sce_backward"]):
            continue
        module = build_gpu_module(kernel, H200)
        inputs = values_for([v.type for v in kernel.inputs], rng, low=0, high=vocab)
        want = [np.asarray(w) for w in reference(kernel)(*inputs)]
        outs = [np.full(w.shape, np.nan, w.dtype) for w in want]
        names = [f"in{i}" for i in range(len(inputs))] + [f"out{i}" for i in range(len(outs))]
        run_kernel(module.text, module.grid, module.block, 0, dict(zip(names, inputs + outs)))
        for got, w in zip(outs, want):
            tol = 2.0**-7 if w.dtype != np.float32 else 1e-5  # bf16: one rounding step apart at most
            np.testing.assert_allclose(got.astype(np.float64), w.astype(np.float64), rtol=tol, atol=tol * 1e-2)
        checked += 1
    assert checked == 2


def gpt2_model():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt2"))
    import model

    return model


def _gpt2_tiny(dtype):
    model = gpt2_model()
    rng = np.random.default_rng()
    vocab, t = 96, 16
    gpt = model.GPT(model.GPTConfig.tiny(vocab_size=vocab, dtype=jnp.bfloat16 if dtype else None))
    params = model.init_params(gpt, jax.random.key(int(rng.integers(1 << 30))), t)
    tokens = jnp.asarray(values((2, t), np.int32, rng, low=0, high=vocab))
    return gpt, params, tokens, vocab
