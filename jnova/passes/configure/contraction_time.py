"""The estimated main-loop time of a contraction on the kernel `choose_tiles` gives it: the model the
plan-level decisions (`operand_transposes`, `split_k`) weigh their options with.

Model: waves x one tile's FLOPs, at the tile rung's relative efficiency (`tile_shape.wgmma_time`, or
the warp-specialized kernel's time where it takes the contraction), at a fraction of one SM's
tensor-core peak that depends on the operands: TF32's on their layouts (`TF32_LAYOUT_FRACTION`: wgmma
reads TF32 operands K-major only, so an MN-major one is transposed into shared memory 4 bytes at a
time), 16-bit operands' on neither (`WGMMA_16BIT_PEAK_FRACTION`).
"""
from __future__ import annotations

from jnova.passes.configure.problem import ContractionProblem
from jnova.passes.configure.tile_schedule import decide
from jnova.passes.configure.tile_shape import tile_family, wgmma_time
from jnova.runtime.target import Target

# TF32 wgmma's main-loop rate by operand layouts (a_layout, b_layout), as a fraction of the tensor-core
# peak (H200, benchmarks/matmul_layouts.py, 256x128x32 tiles, 16384x3072x768 and 16384x768x3072:
# rc 254/291 TFLOP/s, rr 188/207, cc 166/172, cr 126/139 of 495)
TF32_LAYOUT_FRACTION = {("row", "col"): 0.55, ("row", "row"): 0.40, ("col", "col"): 0.34, ("col", "row"): 0.27}
# Fraction of the tensor-core peak a top-rung wgmma tile sustains with 16-bit operands, either layout
# (H200: GPT-2's bf16 weight gradients, 128x64 tiles, 322 TFLOP/s in 2.2 waves, ~0.53 at the top rung);
# TF32's depends on the layouts (TF32_LAYOUT_FRACTION)
WGMMA_16BIT_PEAK_FRACTION = 0.5


def contraction_seconds(problem: ContractionProblem, target: Target, mma: str) -> float:
    """The main loop's time of the tiles `choose_tiles` gives `problem`: waves x one tile's FLOPs at
    the rung's efficiency times the MN-major rate of one SM (the warp-specialized kernel's time where
    it takes the contraction: a long K it runs whole need not be split)."""
    d = decide(problem, target)
    if "tf32" in mma:  # the layouts' measured rates (MN-major operands are copied 4 bytes at a time)
        fraction = TF32_LAYOUT_FRACTION[(problem.a_layout, problem.b_layout)]
    else:
        fraction = WGMMA_16BIT_PEAK_FRACTION
    per_sm = target.peak_tensor_flops(problem.operand_dtype) / target.sm_count * fraction
    units = min(t for _, t in d.pingpong) if d.config.pingpong else wgmma_time(d.chosen, tile_family(problem, mma))
    return units * 2 * problem.k / per_sm
