"""Whether a TF32 contraction's operands are copied K-major by a transpose kernel of their own first
(`passes/transpose_operands.py`), on wgmma targets.

wgmma reads TF32 operands K-major only, so the contraction kernel transposes an MN-major operand into
shared memory 4 bytes at a time, which slows its main loop (`contraction_time.TF32_LAYOUT_FRACTION`),
and the warp-specialized kernel takes TF32 only K-major. Model: an operand is transposed when its
DRAM round trip (`TRANSPOSE_DRAM_EFFICIENCY`, `TRANSPOSE_LAUNCH_S`) costs less than the main loop gains,
each layout timed with the kernel it would get, by at least `1 - TRANSPOSE_MIN_GAIN`, and its copy is at
most `TRANSPOSE_MAX_BYTES` (memory held until the contraction runs).
"""
from __future__ import annotations

import dataclasses

from jnova.passes.configure.contraction_time import contraction_seconds
from jnova.passes.configure.mma_instruction import mma_kind
from jnova.passes.configure.problem import ContractionProblem
from jnova.runtime.target import Target

# of the DRAM bandwidth, for a transpose kernel's read and write (H200, codegen/gpu/transpose.py:
# 3184 GB/s on 8192 x 3072 f32, 1277 GB/s on 4 x 2048 x 768, benchmarks/kernels.py)
TRANSPOSE_DRAM_EFFICIENCY = 0.5
TRANSPOSE_LAUNCH_S = 4e-6
TRANSPOSE_MAX_BYTES = 256 * 2**20
TRANSPOSE_MIN_GAIN = 0.9  # transposes must be estimated at most this fraction of the time without


def choose_transposes(problem: ContractionProblem, target: Target) -> tuple[bool, bool]:
    """Whether A and B are transposed into K-major copies before the contraction; each layout is
    timed with the kernel it would get (`contraction_time`)."""
    return best_transposes(transpose_times(problem, target))


def explain_transposes(problem: ContractionProblem, target: Target) -> str:
    """The estimated time of every choice `choose_transposes` weighed, for debug logs."""
    times = transpose_times(problem, target)
    chosen = best_transposes(times)
    return "; ".join(f"{'*' if option == chosen else ''}transpose A={option[0]} B={option[1]}: {t * 1e6:.1f} us"
                     for option, t in times.items())


def best_transposes(times: dict[tuple[bool, bool], float]) -> tuple[bool, bool]:
    best = min(times, key=lambda option: (times[option], sum(option)))
    return best if times[best] <= TRANSPOSE_MIN_GAIN * times[(False, False)] else (False, False)


def transpose_times(problem: ContractionProblem, target: Target) -> dict[tuple[bool, bool], float]:
    """Estimated seconds (main loop + transposes) of each allowed choice of operands to transpose:
    the main loop as `contraction_seconds` times it in the layouts that choice leaves (so K-major
    operands count with the warp-specialized kernel where it takes them)."""
    if problem.operand_dtype != "float32" or not target.has("wgmma"):
        return {(False, False): 0.0}
    mma = mma_kind(problem.operand_dtype, target, problem.precision)
    sizes = (problem.batch * problem.m * problem.k * 4, problem.batch * problem.k * problem.n * 4)
    can = (problem.a_layout == "col" and sizes[0] <= TRANSPOSE_MAX_BYTES,
           problem.b_layout == "row" and sizes[1] <= TRANSPOSE_MAX_BYTES)
    times = {}
    for option in ((False, False), (True, False), (False, True), (True, True)):
        if any(t and not c for t, c in zip(option, can)):
            continue
        layouts = ("row" if option[0] else problem.a_layout, "col" if option[1] else problem.b_layout)
        laid_out = dataclasses.replace(problem, a_layout=layouts[0], b_layout=layouts[1])
        seconds = contraction_seconds(laid_out, target, mma)
        for transposed, size in zip(option, sizes):
            if transposed:
                seconds += 2 * size / (TRANSPOSE_DRAM_EFFICIENCY * target.dram_bytes_per_s) + TRANSPOSE_LAUNCH_S
        times[option] = seconds
    return times
