"""Whether a contraction is split into S partial products over K (`passes/split_contractions.py`), on
wgmma targets.

A contraction with B as [K, N] (K leading) whose tiles leave SMs idle (a weight gradient, A as
[K, M]; or a long K with A as [M, K]) is split into S partial products over K/S each (a batched
contraction, then a sum). Model: S from 1..`SPLIT_K_MAX` (K/S at least `SPLIT_K_MIN_K`, A's slices
16-byte aligned) minimizing the main-loop time of the kernel each side would get (`contraction_time`;
in TF32 after the transposes `operand_transposes` would choose for that side) plus the partial
products' DRAM traffic (`SPLIT_K_DRAM_EFFICIENCY`) and the sum's launch (`SPLIT_K_SUM_LAUNCH_S`), taken
if it saves at least `1 - SPLIT_K_MIN_GAIN` of the unsplit time.
"""
from __future__ import annotations

import dataclasses

from jnova.passes.configure.contraction_time import contraction_seconds
from jnova.passes.configure.mma_instruction import mma_kind
from jnova.passes.configure.operand_transposes import best_transposes, transpose_times
from jnova.passes.configure.problem import OPERAND_BYTES, ContractionProblem
from jnova.runtime.target import Target

SPLIT_K_MAX = 16
SPLIT_K_MIN_K = 512  # contracting elements per partial product: the pipeline's fill and drain amortized
SPLIT_K_SUM_LAUNCH_S = 4e-6  # the sum over the partial products, when it is a kernel of its own
SPLIT_K_MIN_GAIN = 0.9  # a split must be estimated at most this fraction of the unsplit time
SPLIT_K_DRAM_EFFICIENCY = 0.7  # of the DRAM bandwidth, writing and summing the partial products


def choose_split_k(problem: ContractionProblem, target: Target) -> int:
    """How many partial products over K a contraction is split into; 1 = not split. Each side is
    timed with the kernel it would get (`contraction_time`)."""
    return best_split(split_times(problem, target))


def explain_split_k(problem: ContractionProblem, target: Target) -> str:
    """The estimated time of every split `choose_split_k` weighed, for debug logs."""
    times = split_times(problem, target)
    best = best_split(times)
    return "; ".join(f"{'*' if s == best else ''}S={s}: {t * 1e6:.1f} us" for s, t in times)


def best_split(times: list[tuple[int, float]]) -> int:
    """The fastest split, if it saves at least `1 - SPLIT_K_MIN_GAIN` of the unsplit time (the model's
    error is larger than a few percent; a split costs memory and a kernel)."""
    split, seconds = min(times, key=lambda st: (st[1], st[0]))
    return split if seconds <= SPLIT_K_MIN_GAIN * times[0][1] else 1


def split_times(problem: ContractionProblem, target: Target) -> list[tuple[int, float]]:
    """(S, estimated seconds) for S = 1 and every split allowed (module docstring)."""
    mma = mma_kind(problem.operand_dtype, target, problem.precision)
    if not (mma.startswith("wgmma") and problem.batch == 1 and problem.b_layout == "row"):
        return [(1, 0.0)]  # no split to weigh: no time model needed
    whole = [(1, planned_seconds(problem, target, mma))]
    partial_bytes = problem.m * problem.n * OPERAND_BYTES[problem.out_dtype]
    for s in range(2, SPLIT_K_MAX + 1):
        if problem.k % s or problem.k // s < SPLIT_K_MIN_K:
            continue
        if problem.a_layout == "row" and problem.k // s * problem.operand_bytes % 16:
            continue  # A's slices must start 16-byte aligned, as its rows do
        part = dataclasses.replace(problem, batch=s, k=problem.k // s, a_split_k=problem.a_layout == "row")
        # the partial products are written and read back once more than the result would be
        extra = 2 * s * partial_bytes / (SPLIT_K_DRAM_EFFICIENCY * target.dram_bytes_per_s) + SPLIT_K_SUM_LAUNCH_S
        whole.append((s, planned_seconds(part, target, mma) + extra))
    return whole


def planned_seconds(problem: ContractionProblem, target: Target, mma: str) -> float:
    """The contraction's time as the plan will run it: in TF32, after the transposes `operand_transposes`
    chooses for it (their DRAM round trips included), so a split is weighed against the whole contraction
    with K-major operands on the kernel it would then get, and the other way round."""
    times = transpose_times(problem, target)
    if len(times) == 1:  # no transposes to weigh (16-bit operands, or no wgmma)
        return contraction_seconds(problem, target, mma)
    return times[best_transposes(times)]
