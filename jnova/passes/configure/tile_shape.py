"""The block tile of a contraction: which rung of `TILE_LADDER`, and which orientation within it.

Model. Arithmetic intensity AI = 2MNK / (MK + KN + MN) (FLOP per element), over the machine balance
point in FLOP per operand element, picks a rung (`RUNG_THRESHOLDS`); 16-bit operands and wgmma go one
rung up (half the shared memory per element; a warpgroup reads fewer shared-memory bytes per FLOP from
a larger tile: TF32 256x128 tiles measured 1.2-1.5x 128x128 on GPT-2 shapes). For mma.sync, from that
rung down, the first whose tiles make at least one full wave with `FILL_EFFICIENCY` of the SM slots
busy (waves = ceil(tiles / SMs)) wins, or, for a problem too small for any, the best fill; within a
rung the orientation with the better fill, then intensity, wins (`rank`). wgmma weighs every rung
instead: waves x tile area / the rung's measured relative efficiency (`WGMMA_TILE_EFFICIENCY`,
`wgmma_time`), so a partial wave of 256x128 tiles beats five waves of 64x64 ones. A schedule's
intensity uses tile-aware traffic (`score`: an operand panel that fits in L2 is read once, otherwise
once per pass the tiling makes over it); below the balance point (the memory side) the tile keeps its
size and gets twice the warps (`warp_grid`).
"""
from __future__ import annotations

import dataclasses
import math

from jnova.passes.configure.problem import OPERAND_BYTES, ContractionProblem
from jnova.runtime.target import Target

TILE_LADDER = (((64, 64),), ((128, 64), (64, 128)), ((128, 128),), ((256, 128), (128, 256)))
RUNG_THRESHOLDS = (1.0, 2.0, 3.0)  # AI / balance (both per operand element) at which rungs 1, 2, 3 start
FILL_EFFICIENCY = 0.75  # useful fraction of the SM slots over all waves for a rung to be accepted
MMA_SYNC_MAX_RUNG = 2  # 128x128: 8 warps of 64x32 warp tiles
# One SM's throughput on a wgmma tile of each rung, relative to the top rung's (H200, GPT-2 shapes,
# benchmarks/matmul.py --variants, 2026-11-30): TF32 128x64 0.67-0.75, 128x128 0.63-0.75, 64x64 ~0.4
# (MN-major TF32 operands are copied 4 bytes at a time). bf16, measured again with the bulk-copy
# epilogue (2026-12-01, 4096x768x3072 and 4096x768x50304): 128x64 0.49-0.58, 128x128 0.83-0.87 (it was
# 0.78-1.03 and 0.8-1.05 with stores from registers); 64x64 scaled down with 128x64.
WGMMA_TILE_EFFICIENCY = {"tf32": (0.4, 0.7, 0.68, 1.0), "16-bit": (0.35, 0.6, 0.85, 1.0),
                         # TF32 with both operands MN-major (weight gradients; both copied 4 bytes at a
                         # time): 128x64 tiles ran GPT-2's at ~70 TFLOP/s per full wave, 256x128 ones 126-139
                         "tf32-mn": (0.3, 0.55, 0.68, 1.0)}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One block tile with the numbers that score it."""

    block_m: int
    block_n: int
    tiles: int
    waves: int
    fill: float  # useful output area / (waves * SMs * tile area)
    traffic: int  # DRAM bytes, tile-aware
    intensity: float  # FLOP / traffic byte


def score(problem: ContractionProblem, target: Target, bm: int, bn: int) -> Candidate:
    """Waves, fill and tile-aware DRAM traffic of a bm x bn block tiling."""
    m, n, k, elem = problem.m, problem.n, problem.k, problem.operand_bytes
    tiles_m, tiles_n = math.ceil(m / bm), math.ceil(n / bn)
    tiles = problem.batch * tiles_m * tiles_n
    waves = math.ceil(tiles / target.sm_count)
    fill = problem.batch * m * n / (waves * target.sm_count * bm * bn)
    # An A panel (bm x K) is reused by the tiles_n tiles of its row if it stays in L2, else each reads it.
    a_passes = 1 if bm * k * elem <= target.l2_bytes else tiles_n
    b_passes = 1 if k * bn * elem <= target.l2_bytes else tiles_m
    per_batch = (m * k * a_passes + k * n * b_passes) * elem + m * n * OPERAND_BYTES[problem.out_dtype]
    traffic = problem.batch * per_batch
    return Candidate(bm, bn, tiles, waves, fill, traffic, problem.flops / traffic)


def rank(problem: ContractionProblem, c: Candidate, mma: str = "") -> tuple:
    """Orientation order within a rung: fill, then (TF32 wgmma) fewer elements of MN-major operands
    per k row, which are transposed by 4-byte copies, then intensity, then the long tile side along
    the long dim."""
    along_long_side = (c.block_m >= c.block_n) == (problem.m >= problem.n)
    transposed = 0
    if "wgmma_tf32" in mma:
        transposed = (c.block_m if problem.a_layout == "col" else 0) + (c.block_n if problem.b_layout == "row" else 0)
    return (round(c.fill, 6), -transposed, round(c.intensity, 6), along_long_side)


def choose_block_tile(problem: ContractionProblem, target: Target, mma: str) -> tuple[int, tuple[Candidate, ...], Candidate]:
    """(rung, the best tiling of each rung weighed, the chosen one) for `problem` on `mma`."""
    elem = problem.operand_bytes
    balance = target.balance_point(problem.operand_dtype)
    ai = problem.arithmetic_intensity
    rung = sum(ai / (balance * elem) >= t for t in RUNG_THRESHOLDS)
    if elem == 2 or mma.startswith("wgmma"):  # half the smem per element; or wgmma, whose shared-memory
        rung = min(rung + 1, len(TILE_LADDER) - 1)  # reads per FLOP fall as the tile grows (TF32 measured)
    top = rung
    if mma.startswith("mma_sync"):  # 256-wide tiles: accumulators beyond 8 warps' registers (measured spills)
        top = min(rung, MMA_SYNC_MAX_RUNG)
    tried, chosen = [], None
    for r in range(top, -1, -1):
        best = max((score(problem, target, bm, bn) for bm, bn in TILE_LADDER[r]),
                   key=lambda c: rank(problem, c, mma))
        tried.append(best)
        if mma.startswith("wgmma"):
            continue  # all rungs are weighed below
        if best.tiles >= target.sm_count and best.fill >= FILL_EFFICIENCY:
            chosen = best
            break
    if mma.startswith("wgmma"):
        chosen = min(tried, key=lambda c: wgmma_time(c, tile_family(problem, mma)))
    elif chosen is None:  # too small for a full wave at any rung: the best fill (larger tile on ties)
        chosen = max(tried, key=lambda c: (round(c.fill, 6), c.block_m * c.block_n))
    return rung, tuple(tried), chosen


def tile_family(problem: ContractionProblem, mma: str) -> str:
    """The row of `WGMMA_TILE_EFFICIENCY` for `problem` on `mma`."""
    if "tf32" not in mma:
        return "16-bit"
    return "tf32-mn" if (problem.a_layout, problem.b_layout) == ("col", "row") else "tf32"


def wgmma_time(c: Candidate, family: str) -> float:
    """A wgmma tiling's time, in units of one SM's time on a top-rung tile area: waves x tile area /
    the rung's relative efficiency. A small tile finishes sooner but computes slower (fewer FLOP per
    shared-memory byte, more copy work per FLOP), so a partial wave of large tiles can win."""
    rung = next(i for i, tiles in enumerate(TILE_LADDER) if (c.block_m, c.block_n) in tiles)
    return c.waves * c.block_m * c.block_n / WGMMA_TILE_EFFICIENCY[family][rung]
