"""Whole GPU plans simulated on the CPU: every kernel of a step's GPU plan whose threads are independent
(elementwise and index-remap kernels) runs on the CPU (`gpu_emulation.simulate`) on random inputs with
poisoned outputs and must equal its own ops run by jax.lax. Random difftest programs (the GPU profile's
dimensions, so kernels span several blocks and vector groups) and the program of an open GPU finding."""
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import difftest
from difftest.findings import CUMMAX_BF16, CUMMAX_BF16_SEED
from difftest.generate import programs
from difftest.program import Program
from helpers.gpu_emulation import check_plan_kernels
from jnova.codegen.gpu import remaps
from jnova.runtime.target import get_target

TARGET = get_target("h200")
GPU_PROFILE = difftest.PROFILES["gpu"]
PROGRAMS = programs(max_ops=GPU_PROFILE.max_ops, dims=GPU_PROFILE.dims, max_elements=GPU_PROFILE.max_elements)
STATS = {"programs": 0, "simulated": 0}


@settings(**difftest.settings_for(40, phases=(Phase.explicit, Phase.generate)))  # shrinking takes minutes
@given(program=PROGRAMS, seed=st.integers(0, 2**31 - 1))
def random_program_kernels_match_lax(program, seed):
    params, data = program.arguments(seed)
    simulated, problems = check_plan_kernels(program.step(), params, data, target=TARGET, seed=seed)
    STATS["programs"] += 1
    STATS["simulated"] += simulated
    assert not problems, program.source() + "\n" + "\n".join(problems)


def test_random_programs_gpu_kernels_simulated_match_lax():
    """Every simulated kernel of each random program matches jax.lax, and the programs had kernels to
    simulate (at least one a program on average: a check that simulates nothing cannot fail)."""
    STATS.update(programs=0, simulated=0)
    random_program_kernels_match_lax()
    assert STATS["simulated"] >= STATS["programs"] > 0, STATS


def test_cummax_program_of_the_gpu_finding_simulates_right():
    """The program that failed on an H200 (difftest/findings.py): every one of its simulated kernels
    (strided slices, interior and negative pads, concatenations in bf16) is right on the CPU, so the
    index arithmetic is not what went wrong there."""
    program = Program.parse(CUMMAX_BF16)
    params, data = program.arguments(CUMMAX_BF16_SEED)
    simulated, problems = check_plan_kernels(program.step(), params, data, target=TARGET)
    assert simulated >= 14 and not problems, problems


def test_a_wrong_slice_start_is_caught(monkeypatch):
    """The check can fail: slices that forget their start read the wrong elements."""
    def forgetful(ev, op, p):
        reads = [remaps._times(ev.em, c, s) for c, s in zip(ev.coords(p), op.attrs["strides"])]
        return ev.read(op.operands[0], reads, p.lanes)

    monkeypatch.setitem(remaps._RULES, remaps.SliceOp, forgetful)
    x = np.random.default_rng(0).standard_normal((9, 40)).astype(np.float32)
    simulated, problems = check_plan_kernels(lambda x: jnp.tanh(x[2:, 3::2]), x, target=TARGET)
    assert simulated == 1 and problems and "differ" in problems[0]


def test_tiny_transformer_step_gpu_kernels_simulated_match_lax():
    """Every simulable kernel of a whole GPT-style training step (attention, LayerNorm, GELU, tied
    embedding, SGD with momentum): 44 of its plan's 105 kernels, the elementwise, data-movement,
    one-thread-per-row reduction kernels and the row programs (softmax, LayerNorm forward and
    backward, run with a thread per row) a real model's GPU plan launches."""
    from models import tiny

    step, params, state, ids = tiny.setup()
    simulated, problems = check_plan_kernels(step, params, state, ids, target=TARGET, seed=7)
    assert simulated >= 40 and not problems, problems
