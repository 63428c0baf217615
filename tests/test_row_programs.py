"""Row programs (`codegen/gpu/row_program.py`) and the merge of neighbouring groups that forms them
(`form_kernels.merge_neighbours`): softmax and LayerNorm, forward and backward, as one kernel each.

On the CPU a row program is simulated with a team of one thread per row (`gpu_emulation`; the same
program text, without the butterflies), with poisoned outputs, against jax.jit; its real schedule (a
warp or more per row) is assembled by ptxas here and run on the GPU by tests/gpu/test_gpu_kernels.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.gpu_emulation import assert_outputs_close, check_plan_kernels, gpu_plan, poisoned_like, simulate
from jnova.codegen.gpu.compile import build_gpu_module
from jnova.codegen.gpu.row_program import build_row_program, choose_row_program_schedule, row_program_refusal
from jnova.errors import LoweringError
from jnova.runtime.target import get_target
from helpers.row_programs import ROW_PROGRAMS, layer_norm
from helpers.kernels import assert_assembles_without_spills, kernel_of, requires_ptxas
from helpers.random_inputs import rand

TARGET = get_target("h200")
f32, bf16 = jnp.float32, jnp.bfloat16


def case(name, seed=0):
    fn, specs, rtol = ROW_PROGRAMS[name]
    args = [rand(shape, dtype, seed + i) for i, (shape, dtype) in enumerate(specs)]
    kernel, inputs = kernel_of(fn, *args)
    return fn, args, kernel, inputs, rtol


@pytest.mark.parametrize("name", sorted(ROW_PROGRAMS))
def test_row_program_simulated_matches_jax(name):
    fn, args, kernel, inputs, rtol = case(name)
    assert row_program_refusal(kernel) is None
    assert build_gpu_module(kernel, TARGET).schedule.startswith("row_program(")
    module = build_row_program(kernel, TARGET, team=1)
    want = jax.tree.leaves(jax.jit(fn)(*args))
    outs = [poisoned_like(np.asarray(w)) for w in want]
    simulate(module, inputs, outs)
    assert_outputs_close(outs, want, rtol=rtol, atol=rtol, err_msg=module.schedule)


@requires_ptxas
@pytest.mark.parametrize("target", ["h200", "rtx3060"])
@pytest.mark.parametrize("name", sorted(ROW_PROGRAMS))
def test_row_program_assembles_without_spills(name, target):
    _, _, kernel, _, _ = case(name)
    launch = assert_assembles_without_spills(kernel, target, name, max_registers=128)
    assert "gpu.shuffle xor" in launch.gpu_module or "team=1," in launch.schedule


def test_schedules_hold_a_row_in_at_most_eight_slots_per_thread():
    def sched(name):
        return choose_row_program_schedule(case(name)[2], TARGET)

    s = sched("softmax_f32_96x1024")  # 256 groups of 4: a warp, 8 slots, 4 rows per block
    assert (s.vector, s.team, s.slots, s.block, s.grid) == (4, 32, 8, 128, 24)
    s = sched("softmax_bf16_77x100")  # 25 groups of 4: 4 threads, the 7th slot past the row for 3 of them
    assert (s.vector, s.team, s.slots, s.grid) == (4, 4, 7, 3)
    s = sched("softmax_f32_9x4096")  # 4 warps per row: combined through shared memory
    assert (s.team, s.slots, s.block, s.grid) == (128, 8, 128, 9)
    assert "gpu.barrier" in build_gpu_module(case("softmax_f32_9x4096")[2], TARGET).text


def test_statistics_read_at_another_row_are_refused():
    x = rand((64, 64), f32)
    kernel, _ = kernel_of(lambda x: x - jnp.max(x, axis=-1)[None, :], x)  # broadcast along the other dim
    assert "reads other rows" in row_program_refusal(kernel)
    kernel, _ = kernel_of(lambda x: (x - jnp.max(x, axis=-1, keepdims=True))[:, ::-1].T, x)
    assert "reads a row statistic at another row" in row_program_refusal(kernel)
    kernel, _ = kernel_of(lambda x: (jnp.sum(x, axis=-1), jnp.max(x, axis=0)), x)
    assert "not over the innermost sized dims" in row_program_refusal(kernel)
    kernel, _ = kernel_of(lambda x: jax.nn.softmax(x, axis=-1), rand((2, 50304), f32))  # the vocabulary
    assert "do not fit" in row_program_refusal(kernel)
    with pytest.raises(LoweringError, match="not a row program"):
        build_row_program(kernel, TARGET)


def test_softmax_and_layer_norm_are_one_kernel_forward_and_backward():
    x, w, b, g = rand((4, 16, 256), f32, 0), rand((256,), f32, 1), rand((256,), f32, 2), rand((4, 16, 256), f32, 3)
    (kernel,) = gpu_plan(lambda x: jax.nn.softmax(x, axis=-1), x)[1].kernels
    assert len([op for op in kernel.ops if op.name == "nova.reduce"]) == 2
    (kernel,) = gpu_plan(layer_norm, x, w, b)[1].kernels
    assert build_gpu_module(kernel, TARGET).schedule.startswith("row_program(")
    # forward and backward: a row program each (the backward's row reductions and the input's gradient);
    # the scale's and shift's gradients are column reductions (sums over the rows), returned: one batch.
    # The normalized input they and the row program read is recomputed in each from x and the row
    # statistics, not written by a kernel of its own
    kernels = gpu_plan(jax.grad(lambda x, w, b: jnp.sum(layer_norm(x, w, b) * g), (0, 1, 2)), x, w, b)[1].kernels
    schedules = sorted(build_gpu_module(k, TARGET).schedule.split("(")[0] for k in kernels)
    assert schedules == ["batched_elementwise", "row_program", "row_program"]


def test_tiny_transformer_plans_row_programs_that_simulate_right():
    """The merged plan of a GPT-style step: every softmax and LayerNorm is a row program, and every
    simulable kernel (row programs with a thread per row) matches jax.lax on random inputs."""
    from models import tiny

    step, params, state, ids = tiny.setup()
    plan = gpu_plan(step, params, state, ids)[1]
    programs = [k for k in plan.kernels if not row_program_refusal(k)
                and build_gpu_module(k, TARGET).schedule.startswith("row_program(")]
    exps = [k for k in programs if any(op.name == "nova.exp" for op in k.ops)]
    assert len(programs) >= 8 and exps, [k.name for k in programs]
    simulated, problems = check_plan_kernels(step, params, state, ids, target=TARGET, seed=3)
    assert simulated >= len(programs) and not problems, problems


def test_a_wrong_statistic_is_caught(monkeypatch):
    """The check can fail: a team whose threads do not combine their values pins a part of the row's
    statistic (a team of 4 without butterflies has no shuffles, so it simulates)."""
    from jnova.codegen.gpu import row_program

    monkeypatch.setattr(row_program, "_butterfly", lambda em, kind, dtype, acc, lanes: acc)
    fn, args, kernel, inputs, rtol = case("softmax_f32_96x1024")
    module = build_row_program(kernel, TARGET, team=4)  # without butterflies each thread sees a quarter row
    outs = [poisoned_like(np.asarray(w)) for w in jax.tree.leaves(jax.jit(fn)(*args))]
    simulate(module, inputs, outs)
    with pytest.raises(AssertionError):
        assert_outputs_close(outs, jax.tree.leaves(jax.jit(fn)(*args)), rtol=rtol, atol=rtol)
