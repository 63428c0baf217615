"""`choose_tiles`: a contraction's whole tile schedule, the configurator's decisions composed.

In order: the MMA instruction (`mma_instruction`), the block tile (`tile_shape`; a tile whose m is not
a multiple of wgmma's 64 takes mma.sync), its warps (`warp_grid`, twice as many on the memory side:
the chosen tiling's intensity under the balance point), the shared-memory pipeline (`pipeline_depth`),
then whether the warp-specialized kernel takes it instead (`warp_specialized`). `explain` prints the
numbers behind the choice, for debug logs.
"""
from __future__ import annotations

import dataclasses

from jnova.passes.configure.mma_instruction import mma_kind, mma_sync_form
from jnova.passes.configure.pipeline_depth import choose_pipeline
from jnova.passes.configure.problem import ContractionProblem
from jnova.passes.configure.tile_config import TileConfig
from jnova.passes.configure.tile_shape import Candidate, choose_block_tile, tile_family, wgmma_time
from jnova.passes.configure.warp_grid import warp_grid
from jnova.passes.configure.warp_specialized import choose_warp_specialized
from jnova.runtime.target import Target


@dataclasses.dataclass(frozen=True)
class Decision:
    ai: float
    balance: float  # FLOP per DRAM byte
    rung: int
    tried: tuple[Candidate, ...]
    chosen: Candidate
    memory_side: bool
    config: TileConfig
    time: float = 0.0  # the chosen block tile's wgmma_time, where the warp-specialized kernel was weighed
    pingpong: tuple = ()  # ((bm, bn), time) of the ping-pong tiles weighed (warp_specialized)


def choose_tiles(problem: ContractionProblem, target: Target) -> TileConfig:
    """The tile schedule for `problem` on `target`: the decisions of the module docstring, in order."""
    return decide(problem, target).config


def explain(problem: ContractionProblem, target: Target) -> str:
    """The numbers behind `choose_tiles(problem, target)`, for debug logs."""
    d = decide(problem, target)
    elem = problem.operand_bytes
    lines = [
        f"problem {problem.batch}x{problem.m}x{problem.n}x{problem.k} {problem.operand_dtype} on {target}",
        f"AI {d.ai:.0f} FLOP/elem; balance {d.balance:.1f} FLOP/B = {d.balance * elem:.0f} FLOP/elem "
        f"-> ratio {d.ai / (d.balance * elem):.2f}, rung {d.rung}",
    ]
    for c in d.tried:
        mark = "*" if c is d.chosen else " "
        lines.append(f" {mark} {c.block_m}x{c.block_n}: tiles={c.tiles} waves={c.waves} (on {target.sm_count} SMs) "
                     f"fill={c.fill:.2f} traffic={c.traffic / 1e6:.1f} MB intensity={c.intensity:.1f} FLOP/B")
    side = "memory side: more warps" if d.memory_side else "compute side"
    cfg = d.config
    for (bm, bn), time in d.pingpong:
        lines.append(f"   ping-pong {bm}x{bn}: {time:.0f} against {d.time:.0f} (tile area x tiles per SM / efficiency)")
    lines.append(f"{side}; smem {cfg.stage_bytes} B/stage x {cfg.stages} = {cfg.smem_bytes} B "
                 f"(limit {target.smem_per_block_optin} B/block)")
    lines.append(f"-> {cfg}")
    return "\n".join(lines)


def decide(problem: ContractionProblem, target: Target) -> Decision:
    """`choose_tiles`'s decision with the numbers behind it."""
    mma = mma_kind(problem.operand_dtype, target, problem.precision)
    balance = target.balance_point(problem.operand_dtype)
    ai = problem.arithmetic_intensity
    rung, tried, chosen = choose_block_tile(problem, target, mma)
    memory_side = chosen.intensity < balance
    if chosen.block_m % 64:  # wgmma's m is 64
        mma = mma_sync_form(mma)
    warps_m, warps_n = warp_grid(chosen.block_m, chosen.block_n, mma, memory_side, target)
    config = choose_pipeline(problem, chosen.block_m, chosen.block_n, warps_m, warps_n, mma, target)
    time = wgmma_time(chosen, tile_family(problem, mma)) if mma.startswith("wgmma") else 0.0
    pingpong, weighed = choose_warp_specialized(problem, target, mma, time)
    if not weighed:
        return Decision(ai, balance, rung, tried, chosen, memory_side, config)
    return Decision(ai, balance, rung, tried, chosen, memory_side, pingpong or config, time, weighed)
