"""Whether a wgmma contraction runs on the warp-specialized TMA kernel, and with which consumer tile.

The kernel (`codegen/gpu/matmul_tma.py`) is a persistent block of a TMA producer and two consumer
warpgroups that take tiles in turn, so one stores its tile while the other computes. Model: each SM
works through ceil(tiles / SMs) consumer tiles; that count x tile area / the tile's measured efficiency
(`PINGPONG_TILE_EFFICIENCY`, in `tile_shape.wgmma_time`'s units) against the time of the block tile
`tile_shape` chose picks it. It needs wgmma, a target with TMA whose kernels may take tensor maps
(`Target.tensor_maps`: jnova's launcher builds them, jaxlib's call does not), rows of A and B in whole
16-byte units (TMA strides), no split-K slices of A, and TF32 operands both K-major (the TMA copies land
as they are; `operand_transposes` decides the copies before).
"""
from __future__ import annotations

import math

from jnova.passes.configure.problem import ContractionProblem
from jnova.passes.configure.tile_config import TileConfig
from jnova.runtime.target import Target

# The warp-specialized ping-pong kernel's consumer tiles, their throughput relative to the block tile's
# top rung (the 256x128 tile of two warpgroups = 1.0) in the same precision. H200, benchmarks/matmul.py
# --variants on the six GPT-2 shapes, 4 stages:
# - bf16 (2026-12-01, C stored from registers): 128x192 1.08-1.31 (median 1.2), 192x128 0.9-1.22,
#   128x128 1.03-1.23; with TMA stores of C 128x192 ran 1.3-1.4 on the K = 768 shapes;
# - TF32, both operands K-major (2026-12-01, TMA stores): 128x192 1.06-1.34 (median
#   1.24), 192x128 1.06-1.30, 128x128 0.99-1.19.
# One table serves both. A consumer holds its tile's f32 accumulators: 192 registers at most.
PINGPONG_TILE_EFFICIENCY = {(128, 192): 1.2, (192, 128): 1.1, (128, 128): 1.08}
PINGPONG_STAGES = 4  # 4 stages measured at or above 5 and 6 on those shapes
PINGPONG_K_TILE_BYTES = 128  # a k-tile is one 128-byte swizzle panel: block_k 64 (16-bit), 32 (TF32)


def choose_warp_specialized(problem: ContractionProblem, target: Target, mma: str,
                            time: float) -> tuple[TileConfig | None, tuple]:
    """(the warp-specialized kernel's config, or None to keep the block tile; ((bm, bn), time) of each
    consumer tile weighed) for `problem` on `mma`, against `time`, the chosen block tile's
    `wgmma_time`; nothing is weighed where the kernel cannot run."""
    if not (mma.startswith("wgmma") and target.tensor_maps and target.has("tma") and pingpong_refusal(problem) is None):
        return None, ()
    weighed = tuple(((bm, bn), pingpong_time(problem, target, bm, bn)) for bm, bn in PINGPONG_TILE_EFFICIENCY)
    (bm, bn), best = min(weighed, key=lambda w: w[1])
    if best < time:
        block_k = PINGPONG_K_TILE_BYTES // problem.operand_bytes
        pingpong = TileConfig(bm, bn, block_k, 4, 1, PINGPONG_STAGES, mma, 128, pingpong=True)
        if pingpong.smem_bytes <= target.smem_per_block_optin:
            return pingpong, weighed
    return None, weighed


def pingpong_refusal(problem: ContractionProblem) -> str | None:
    """Why the warp-specialized kernel cannot take `problem`, or None: TMA strides are whole 16-byte units, and
    its producer copies whole operands, not split-K slices of A (`matmul_tma.refusal` adds the
    config's conditions)."""
    p, problems = problem, []
    if p.operand_bytes == 4 and (p.a_layout, p.b_layout) != ("row", "col"):
        problems.append("TF32 operands that are not both K-major (wgmma does not transpose them; "
                        "the operand transposes may copy them K-major first)")
    if p.a_split_k:
        problems.append("split-K slices of A")
    inner = {"A": p.k if p.a_layout == "row" else p.m, "B": p.k if p.b_layout == "col" else p.n}
    for name, extent in inner.items():
        if extent * p.operand_bytes % 16:
            problems.append(f"rows of {name} of {extent} elements (TMA strides are multiples of 16 bytes)")
    return "; ".join(problems) or None


def pingpong_time(problem: ContractionProblem, target: Target, bm: int, bn: int) -> float:
    """Consumer tiles per SM x tile area / efficiency, in `tile_shape.wgmma_time`'s units."""
    tiles = problem.batch * math.ceil(problem.m / bm) * math.ceil(problem.n / bn)
    return math.ceil(tiles / target.sm_count) * bm * bn / PINGPONG_TILE_EFFICIENCY[(bm, bn)]
