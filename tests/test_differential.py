"""Differential testing against XLA: random training programs compiled by jnova equal jax.jit's results.

Each example is a program from `difftest.generate.programs()` (elementwise chains with broadcasting,
reductions over random axes, dot_general / einsum with batch and contracting dimensions in any order,
softmax, layer norm, RMS norm, cross-entropy, attention, embeddings, slicing, concatenation, layout
changes, f32 and bf16 mixed), wrapped in `jax.value_and_grad` and run with jnova (`fallback="error"`:
every primitive must compile) and with `jax.jit` on the same random arguments. Every result leaf (loss,
forward outputs, gradients) is compared within the tolerance of the arithmetic the program uses
(`difftest.compare`). A failure prints the program's source and a script that reruns it.

The examples are derandomized (the same ones on every run); their number comes from the profile in
JNOVA_DIFF_PROFILE (`difftest.PROFILES`: `ci` by default, `long` for a soak run).
"""
from __future__ import annotations

import collections

import jax
import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import difftest
from difftest import compare
from difftest.generate import OPS, programs

PROFILE = difftest.profile()
PROGRAMS = programs(max_ops=PROFILE.max_ops, dims=PROFILE.dims, max_elements=PROFILE.max_elements)
SEEDS = st.integers(0, 2**31 - 1)


@settings(**difftest.settings_for(PROFILE.cpu))
@given(program=PROGRAMS, seed=SEEDS)
def test_random_program_matches_jit(program, seed):
    outcome = compare.check(program, seed)
    assert outcome.stats["fallbacks"] == []


@settings(**difftest.settings_for(PROFILE.fused))
@given(program=PROGRAMS, seed=SEEDS)
def test_random_program_with_fused_kernels_matches_jit(program, seed):
    """kernels="fused": one kernel per fusion group, the GPU's plan, checked numerically on the CPU."""
    outcome = compare.check(program, seed, kernels="fused")
    assert outcome.stats["kernels"] >= 1


# --------------------------------------------------------------------------- the generator itself
GENERATED: list = []


@settings(**difftest.settings_for(300, phases=[Phase.generate]))
@given(program=PROGRAMS)
def _generate(program):
    GENERATED.append(program)


@pytest.fixture(scope="module")
def generated():
    if not GENERATED:
        _generate()
    return GENERATED


def test_generator_records_the_shapes_jax_computes(generated):
    for program in generated:
        program.check_shapes()


def test_generator_uses_every_operation_and_awkward_shapes(generated):
    kinds = collections.Counter(k for p in generated for k in p.kinds)
    missing = {op.__name__ for op in OPS} - set(kinds)
    assert not missing, f"operations never generated: {missing}"
    shapes = [s.shape for p in generated for s in p.stmts]
    assert any(1 in shape for shape in shapes) and any({7, 13} & set(shape) for shape in shapes)
    assert any(p.has_bf16 for p in generated) and any(not p.has_bf16 for p in generated)
    assert any(len(p.stmts) >= 6 for p in generated)


def test_comparison_catches_a_wrong_element(generated):
    """The tolerance is not vacuous: one element of one gradient off by 1% of the leaf's scale fails
    (f32 programs; every leaf whose rounding noise is below that)."""
    program = next(p for p in generated if not p.has_bf16 and len(p.params) >= 1 and len(p.stmts) >= 3)
    params, data = program.arguments(0)
    want = jax.jit(program.step())(params, data)
    noise = compare.rounding_noise(program, jax.jit(program.step()), params, data, want)
    (_, _), grads = want
    name = program.params[0].name
    wrong = np.array(grads[name], np.float32, copy=True)
    scale = np.max(np.abs(wrong))
    wrong.reshape(-1)[wrong.size // 2] += 0.01 * scale
    got = (want[0], {**grads, name: wrong})
    tol = compare.tolerance(program)
    leaf = len(jax.tree.leaves(want[0])) + sorted(grads).index(name)
    if compare.NOISE_FACTOR * noise[leaf] < 0.005 * scale:
        assert compare.compare(got, want, tol, noise), "a 1% error in a gradient passed"
    assert not compare.compare(want, want, tol, noise)
