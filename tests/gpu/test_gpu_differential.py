"""Differential testing on the GPU: at least 1000 random training programs (difftest's generator, the `gpu`
profile: dimensions up to 128 so that kernels span several thread blocks), each compiled by jnova for the
GPU and compared with jax.jit on the GPU, leaf by leaf (loss, outputs, gradients).

XLA runs f32 contractions as TF32 on a GPU by default, and so do jnova's tensor-core kernels: the
reference runs under `jax.default_matmul_precision("float32")`, and programs with a contraction get
TF32's unit roundoff in their tolerance (difftest/compare.py). The programs are split into SHARDS
tests with fixed seeds of their own, so that `pytest -n <workers>` spreads them over the host's cores
(compilation is CPU work); each shard's programs are the same on every run. With JNOVA_DIFF_REPORT set
to a file, every shard appends one JSON line: programs run, kernels, XLA groups, worst tolerance ratio.

Run on the GPU machine:  pytest -m gpu -n 14 tests/gpu/test_gpu_differential.py
"""
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, seed, settings
from hypothesis import strategies as st

import difftest
from difftest import compare
from difftest.findings import CUMMAX_BF16, CUMMAX_BF16_SEED
from difftest.generate import programs

import helpers.gpu_launch  # noqa: F401  (skips this module without a GPU; registers the CUDA lowering)

pytestmark = pytest.mark.gpu
BACKEND = "gpu"

PROFILE = difftest.profile(default="gpu")
SHARDS = 100
PER_SHARD = -(-PROFILE.gpu // SHARDS)   # SHARDS * PER_SHARD >= PROFILE.gpu >= 1000 (in every profile)
# device time is scarce: a failing example is reported as found (its source and a rerun script are in the
# message), not shrunk; minimize it on the CPU or in a later GPU run
NO_SHRINKING = (Phase.explicit, Phase.reuse, Phase.generate)
PROGRAMS = programs(max_ops=PROFILE.max_ops, dims=PROFILE.dims, max_elements=PROFILE.max_elements)


def _report(record: dict) -> None:
    path = os.environ.get("JNOVA_DIFF_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


@pytest.mark.parametrize("shard", range(SHARDS))
def test_random_programs_on_the_gpu_match_jit(shard):
    assert SHARDS * PER_SHARD >= 1000
    counts = {"shard": shard, "programs": 0, "kernels": 0, "xla_groups": 0, "failed": 0}
    start = time.perf_counter()

    @seed(20261130 + shard)
    @settings(**difftest.settings_for(PER_SHARD, derandomize=False, phases=NO_SHRINKING))
    @given(program=PROGRAMS, data_seed=st.integers(0, 2**31 - 1))
    def check(program, data_seed):
        counts["programs"] += 1
        try:
            outcome = compare.check(program, data_seed, backend=BACKEND)
        except Exception:
            counts["failed"] += 1
            raise
        counts["kernels"] += outcome.stats["kernels"]
        counts["xla_groups"] += outcome.stats["xla_groups"]

    try:
        check()
    finally:
        counts["seconds"] = round(time.perf_counter() - start, 1)
        _report(counts)


def test_more_than_2_31_elements_on_the_gpu():
    """An elementwise kernel and a reduction over 2**31 + 65539 int8 elements (2 GiB): the last element,
    past any 32-bit index, is read and written."""
    n = 2**31 + 2**16 + 3
    # no `.at[-1]`: without x64 JAX converts the index to int32, and -1 + n overflows (nothing is set)
    x = jnp.concatenate([jnp.zeros((n - 1,), jnp.int8), jnp.full((1,), 7, jnp.int8)])

    def f(x):
        return x * 2 + 1, jnp.max(x)

    import jnova

    assert int(jax.jit(f)(x)[1]) == 7  # the input is what the test means
    doubled, top = jnova.compile(f, backend=BACKEND)(x)
    assert int(top) == 7
    first, last = jax.jit(lambda d: (d[:4], d[n - 4:]))(doubled)  # static slices (eager ones index in int32)
    np.testing.assert_array_equal(np.asarray(last), [1, 1, 1, 15])
    np.testing.assert_array_equal(np.asarray(first), [1, 1, 1, 1])
    want = jax.jit(f)(x)[0]
    assert bool(jnp.all(doubled == want))


# --------------------------------------------------------------------------- GPU findings
def test_cummax_of_bf16_then_slices_on_the_gpu():
    """Found by the first GPU run (H200, 2026-11-30, shard 36): jnova's GPU step gave outs[0][0, 2] = 0.0757
    where jax.jit gives -0.0459. Not jnova's index arithmetic (its kernels simulate right on the CPU,
    tests/test_gpu_simulated_plans.py) but ptxas: packing the bf16 adds LLVM had formed into
    HADD2.BF16_V2, its register allocation overwrote a live value (see GpuEmitter.bf16_to_f32)."""
    from difftest.program import Program

    outcome = compare.run(Program.parse(CUMMAX_BF16), CUMMAX_BF16_SEED, backend=BACKEND)
    assert not outcome.mismatches, outcome.mismatches


def test_cummax_program_kernel_by_kernel_on_the_gpu():
    """How the finding above was located: the program's GPU plan run one kernel at a time (each launched
    alone under jax.jit, its outputs poisoned), every kernel's outputs compared with its ops run by
    jax.lax on the same GPU inputs."""
    from helpers.gpu_emulation import differences, gpu_plan, reference
    from helpers.gpu_launch import TARGET, poisoned_like, run_kernel

    from difftest.program import Program
    from jnova.codegen.gpu.compile import compile_gpu_kernel
    from jnova.passes.plan import Kernel

    program = Program.parse(CUMMAX_BF16)
    step = program.step()
    params, data = program.arguments(CUMMAX_BF16_SEED)
    nova, plan = gpu_plan(step, params, data)
    flat = jax.tree.leaves((params, data)) + list(nova.const_args)
    env = {v: jnp.asarray(x) for v, x in zip(nova.func.args, flat)}
    problems = []
    for s in plan.steps:
        assert isinstance(s, Kernel), s
        ins = [env[v] for v in s.inputs]
        want = reference(s)(*ins)  # op by op, each result rounded to its type
        try:
            launch = compile_gpu_kernel(s, TARGET)
        except Exception:  # no builder: the plan runs it as XLA ops
            got = want
        else:
            got = run_kernel(launch, s, ins, poison=[poisoned_like(w) for w in want])
            problems += differences(s, got, want, launch.schedule)
        env.update(zip(s.outputs, got))
    assert not problems, "\n".join(problems)
