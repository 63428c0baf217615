"""A schedule's shared-memory pipeline: block_k, stages and swizzle.

block_k is one 128-byte row of K; the deepest of `STAGES` (4, 3, 2) that fits the per-block opt-in
shared memory wins, halving block_k (down to the MMA's k) only when even 2 stages do not fit. The
swizzle is the widest XOR swizzle (128/64/32 bytes) dividing both shared-memory tiles' row width. A
kernel's split_k stays 1 (fused epilogues need the whole K sum; larger values come only from overrides).
"""
from __future__ import annotations

from jnova.passes.configure.problem import ContractionProblem
from jnova.passes.configure.tile_config import SWIZZLES, TileConfig
from jnova.runtime.target import Target

STAGES = (4, 3, 2)


def choose_pipeline(problem: ContractionProblem, bm: int, bn: int, wm: int, wn: int, mma: str,
              target: Target) -> TileConfig:
    """The config with block_k a 128-byte row of K and the deepest of `STAGES` that fits the per-block
    opt-in shared memory; block_k halves (down to the MMA's k) only when even 2 stages do not fit."""
    block_k = 128 // problem.operand_bytes
    min_k = 8 if "tf32" in mma else 16
    while block_k >= min_k:
        swizzle = choose_swizzle(problem, bm, bn, block_k)
        for stages in STAGES:
            config = TileConfig(bm, bn, block_k, wm, wn, stages, mma, swizzle)
            if config.smem_bytes <= target.smem_per_block_optin:
                return config
        block_k //= 2
    raise ValueError(f"a {bm}x{bn} tile does not fit {target.name}'s {target.smem_per_block_optin} bytes of "
                     f"shared memory per block even with {STAGES[-1]} stages of k={min_k}")


def choose_swizzle(problem: ContractionProblem, bm: int, bn: int, bk: int) -> int:
    """Widest XOR swizzle (128/64/32 bytes) dividing both smem tiles' contiguous row width."""
    elem = problem.operand_bytes
    a_row = (bk if problem.a_layout == "row" else bm) * elem
    b_row = (bn if problem.b_layout == "row" else bk) * elem
    return next(s for s in SWIZZLES if a_row % s == 0 and b_row % s == 0)
