"""The warps of a block tile.

mma.sync: 64x32 warp tiles, at least 4 warps (64 f32 accumulators a thread; 64x64 warp tiles, 128
accumulators, left too few registers for the fragments of the TF32 kernels: ptxas spilled up to 2 KiB
on GPT-2's LM-head backward). wgmma: one warpgroup per 128x128 of the tile, at least two for TF32 (an
MN-major TF32 operand is copied 4 bytes at a time, so more threads copy). On the memory side twice as
many, when the smaller warp tiles stay whole MMA tiles and fit the registers (`REGS_OVERHEAD`).
"""
from __future__ import annotations

from jnova.runtime.target import Target

MAX_WARPS = 16
# registers per thread beyond the accumulators (fragments, addresses, loop state): 124-180 measured
# with ptxas on the TF32 kernels for 64 accumulators a thread
REGS_OVERHEAD = 160


def warp_grid(bm: int, bn: int, mma: str, memory_side: bool, target: Target) -> tuple[int, int]:
    """Warp grid: 64x32 warp tiles (at least 4 warps) for mma.sync, one warpgroup per 128x128 for wgmma
    (at least two for TF32);
    twice as many on the memory side when the smaller warp tiles stay whole MMA tiles and fit registers."""
    if mma.startswith("wgmma"):
        groups = max(1, bm * bn // (128 * 128))
        if "tf32" in mma:  # at least two warpgroups (while each keeps 64 rows): an MN-major TF32 operand
            groups = max(groups, min(2, bm // 64))  # is copied 4 bytes at a time, so more threads copy
        grid = _warpgroup_grid(bm, bn, groups)
        if memory_side and groups < MAX_WARPS // 4:
            wider = _warpgroup_grid(bm, bn, 2 * groups)
            grid = wider if _fits_registers(bm, bn, wider, target) else grid
        return grid
    # 64x32 warp tiles: 64 f32 accumulators a thread. 64x64 ones (128) left too few registers for
    # the fragments of the TF32 kernels: ptxas spilled up to 2 KiB on GPT-2's LM-head backward
    grid = (max(1, bm // 64), max(1, bn // 32))
    while grid[0] * grid[1] < 4:
        grid = _split_warp_tile(bm, bn, grid)
    if memory_side:
        more = _split_warp_tile(bm, bn, grid)
        if bm // more[0] >= 16 and bn // more[1] >= 16 and _fits_registers(bm, bn, more, target):
            grid = more
    return grid


def _split_warp_tile(bm: int, bn: int, grid: tuple[int, int]) -> tuple[int, int]:
    """Twice the warps, halving the longer side of the warp tile (m on ties)."""
    wm, wn = grid
    return (wm * 2, wn) if bm // wm >= bn // wn else (wm, wn * 2)


def _warpgroup_grid(bm: int, bn: int, groups: int) -> tuple[int, int]:
    """Warpgroups along m while each keeps at least wgmma's 64 rows, the rest along n; in warps."""
    groups_m = min(groups, bm // 64)
    groups_n = groups // groups_m
    return 4 * groups_m, groups_n


def _fits_registers(bm: int, bn: int, warps: tuple[int, int], target: Target) -> bool:
    threads = 32 * warps[0] * warps[1]
    per_thread = bm * bn // threads + REGS_OVERHEAD  # FP32 accumulators + overhead
    if bn // warps[1] < 8 or warps[0] * warps[1] > MAX_WARPS or threads > target.max_threads_per_block:
        return False
    return per_thread <= 255 and per_thread * threads <= target.regs_per_block
