"""The Hopper main loop: a cp.async ring of 128-byte-swizzled tiles feeding `wgmma.mma_async`.

Warpgroups: the config's warps_m x warps_n warps form (warps_m / 4) x warps_n warpgroups; each owns a
(block_m / groups_m) x (block_n / groups_n) piece of the block tile, as m64nNk16 (bf16, f16) or
m64nNk8 (TF32) instructions repeated along M (N = the piece's width, at most 256). All threads copy;
all warpgroups compute. TF32 operands are K-major in shared memory whatever their global layout
(the copies of an MN-major one transpose it: `matmul_smem.py`).

Pipeline with S stages (S >= 3): one wgmma group stays in flight, so the copy issued at iteration kt
(tile kt + S - 2) goes to the stage that held tile kt - 2, whose wgmma every warpgroup has waited
for before the barrier of iteration kt:

    prologue: copy tiles 0 .. S-3
    for kt:  cp.async.wait (tile kt landed) ; fence.proxy.async ; barrier
             copy tile kt + S - 2 ; commit
             wgmma.fence ; wgmma over tile kt (block_k / 16 steps x repeats) ; commit
             wgmma.wait 1
    wgmma.wait 0
With S = 2 nothing stays in flight (wgmma.wait 0 each iteration) and the copy runs one tile ahead.

Shared-memory matrix descriptors (PTX ISA "Matrix Descriptor Format"; CUTLASS make_gmma_desc) for
the 128-byte swizzle (layout type 1), all offsets in 16-byte units:
  K-major operand:  start + 32 B per k step (k16 of 16-bit, k8 of TF32) inside a panel; SBO = 1024
                    (8 rows of 128 B); LBO unused (1)
  MN-major operand: start + 16 rows x 128 B per k16 step (16-bit types only); SBO = 1024 (8 k-rows); LBO = the stride
                    between 64-element panels along M or N (one panel = block_k x 128 B)
Accumulator layout (PTX ISA, wgmma D fragment): value i of lane l in warp w of the warpgroup is
D[16w + l/4 + 8*((i/2)%2), 2*(l%4) + i%2 + 8*(i/4)].
"""
from __future__ import annotations

import math

from jnova.codegen.gpu.matmul_epilogue import Context, Fragment, batch_strides, copy_ahead, copy_tile
from jnova.codegen.gpu.matmul_smem import PANEL_BYTES, TileCopier, ix_add, ix_op
from jnova.errors import LoweringError

WGMMA_M = 64
SWIZZLE_128B = 1  # descriptor layout type (bits 62-63)
GROUP_ROWS_BYTES = 8 * PANEL_BYTES  # SBO: eight 128-byte rows, one swizzle atom


def SWIZZLES(problem, config):  # noqa: N802 (the family interface: the swizzle of the A and B tiles)
    return "rows8", "rows8"


def k_major_only(config) -> bool:
    """wgmma reads TF32 operands only K-major (PTX ISA: no transpose for .tf32); 16-bit ones either way."""
    return "tf32" in config.mma


def wgmma_type(tile) -> str:
    return "tf32" if tile.element == "f32" else tile.element


def warpgroups(problem, config) -> tuple[int, int]:
    """The warpgroup grid: the config's (warps_m / 4) x warps_n when its pieces are wgmma shapes, else
    the same number of warpgroups arranged otherwise, else fewer (a 64x64 tile of an N-major B takes
    one warpgroup: 32-column pieces are not a whole 64-element swizzle panel)."""
    n_major_b = problem.b_layout == "row" and not k_major_only(config)  # an N-major tile in shared memory
    groups = max(1, config.warps_m // 4) * config.warps_n
    while groups >= 1:
        for gm in range(groups, 0, -1):
            gn = groups // gm
            if gm * gn != groups or config.block_m % (gm * WGMMA_M) or config.block_n % gn:
                continue
            tn = config.block_n // gn
            if tn % 8 == 0 and tn <= 256 and not (n_major_b and tn % 64):
                return gm, gn
        groups //= 2
    raise LoweringError(f"wgmma contraction with {config}: no warpgroup grid splits a {config.block_m}x"
                        f"{config.block_n} tile into m64 x n(<=256{', multiple of 64' if n_major_b else ''}) pieces")


def threads(problem, config) -> int:
    gm, gn = warpgroups(problem, config)
    return 128 * gm * gn


def ahead(config) -> int:
    """k-tiles copied ahead of the one computed (one wgmma group stays in flight with 3+ stages)."""
    return config.stages - 1 - (1 if config.stages >= 3 else 0)


def prefetch(ctx: Context) -> None:
    """The pipeline's prologue for the block tile of `ctx`: its first k-tiles, as `ahead` groups. A
    persistent kernel issues it for the next tile before storing the current one (`matmul.py`)."""
    tile_copiers = copiers(ctx)
    for c in tile_copiers:
        c.prepare(ctx.em, ctx.tid)
    copy_ahead(ctx, tile_copiers, ahead(ctx.config), math.ceil(ctx.problem.k / ctx.config.block_k))


def main_loop(ctx: Context, prefetched: bool = False) -> list[Fragment]:
    """The block tile's accumulators; with `prefetched` its prologue copies were issued already."""
    em, cfg, p = ctx.em, ctx.config, ctx.problem
    groups_m, groups_n = warpgroups(p, cfg)
    tm, tn = cfg.block_m // groups_m, cfg.block_n // groups_n
    _check(ctx, tm, tn)
    reps = tm // WGMMA_M
    keep = 1 if cfg.stages >= 3 else 0
    copied_ahead = ahead(cfg)
    k_tiles = math.ceil(p.k / cfg.block_k)
    acc_type = "!llvm.struct<(" + ", ".join(["f32"] * (tn // 2)) + ")>"

    tile_copiers = copiers(ctx)
    for c in tile_copiers:
        c.prepare(em, ctx.tid)
    wg = em.op(f"arith.divui {ctx.tid}, {em.index(128)} : index")
    wg_m = em.op(f"arith.divui {wg}, {em.index(groups_n)} : index")
    wg_n = em.op(f"arith.remui {wg}, {em.index(groups_n)} : index")
    desc_a, desc_b = descriptor_bases(ctx, wg_m, wg_n, tm, tn)

    if not prefetched:
        copy_ahead(ctx, tile_copiers, copied_ahead, k_tiles)
    zero = em.op(f"llvm.mlir.zero : {acc_type}")
    kt, accs = em.fresh("kt"), [em.fresh("acc") for _ in range(reps)]
    result = em.fresh("accs")
    iter_args = ", ".join(f"{a} = {zero}" for a in accs)
    types = ", ".join([acc_type] * reps)
    with em.region(f"{result}:{reps} = scf.for {kt} = {em.index(0)} to {em.index(k_tiles)} step {em.index(1)} "
                   f"iter_args({iter_args}) -> ({types}) {{"):
        if copied_ahead:
            em.line(f"nvvm.cp.async.wait.group {copied_ahead - 1}")
        em.line("nvvm.fence.proxy {kind = #nvvm.proxy_kind<async.shared>, space = #nvvm.shared_space<cta>}")
        em.line("gpu.barrier")
        if copied_ahead:
            copy_tile(ctx, tile_copiers, em.op(f"arith.addi {kt}, {em.index(copied_ahead)} : index"))
        else:  # two stages: copy this tile now, wait for it
            copy_tile(ctx, tile_copiers, kt)
            em.line("nvvm.cp.async.wait.group 0")
            em.line("nvvm.fence.proxy {kind = #nvvm.proxy_kind<async.shared>, space = #nvvm.shared_space<cta>}")
            em.line("gpu.barrier")
        stage = em.op(f"arith.index_cast {em.op(f'arith.remui {kt}, {em.index(cfg.stages)} : index')} : index to i64")
        new = wgmma_k_tile(ctx, desc_a, desc_b, stage, accs, acc_type, tn, reps)
        em.line("nvvm.wgmma.commit.group.sync.aligned")
        em.line(f"nvvm.wgmma.wait.group.sync.aligned {keep}")
        em.line(f"scf.yield {', '.join(new)} : {types}")
    em.line("nvvm.wgmma.wait.group.sync.aligned 0")
    em.line("nvvm.cp.async.wait.group 0")  # copies past the last tile must land before the block exits
    return fragments(ctx, [f"{result}#{r}" for r in range(reps)], acc_type, wg_m, wg_n, tm, tn)


def wgmma_k_tile(ctx: Context, desc_a: str, desc_b: str, stage: str, accs: list[str], acc_type: str, tn: int,
                 reps: int, first: bool = False) -> list[str]:
    """The warpgroup's wgmmas over one k-tile in ring stage `stage` (i64), after a wgmma.fence: the
    new accumulators (not committed). `first`: the tile's first k-tile, whose first step ignores
    `accs` (scale-d 0: no registers to zero, nothing for the wgmmas to wait on)."""
    em, cfg = ctx.em, ctx.config
    em.line("nvvm.wgmma.fence.aligned")
    new = list(accs)
    for j in range(cfg.block_k // cfg.mma_k):
        db = _descriptor(ctx, desc_b, stage, ctx.b.bytes, _b_offset(ctx, j, tn))
        for r in range(reps):
            da = _descriptor(ctx, desc_a, stage, ctx.a.bytes, _a_offset(ctx, j, r))
            new[r] = em.op(f"nvvm.wgmma.mma_async {da}, {db}, {new[r]}, #nvvm.shape<m = {WGMMA_M}, n = {tn}, "
                           f"k = {cfg.mma_k}>, D [<f32>, #nvvm.wgmma_scale_out<{'zero' if first and j == 0 else 'one'}>, "
                           f"<wrapped>], "
                           f"A [<{wgmma_type(ctx.a)}>, #nvvm.wgmma_scale_in<one>, <{'row' if ctx.a.k_major else 'col'}>], "
                           f"B [<{wgmma_type(ctx.b)}>, #nvvm.wgmma_scale_in<one>, <{'col' if ctx.b.k_major else 'row'}>] "
                           f": {acc_type} -> {acc_type}")
    return new


def _check(ctx: Context, tm: int, tn: int) -> None:
    cfg = ctx.config
    problems = []
    if tm % WGMMA_M:
        problems.append(f"warpgroups need {WGMMA_M}-row pieces (piece {tm}x{tn})")
    if tn % 8 or tn > 256 or (not ctx.b.k_major and tn % 64):
        problems.append(f"a warpgroup's {tn} columns are not a wgmma N (a multiple of 8, at most 256, "
                        f"of 64 when B is N-major)")
    if cfg.block_k % cfg.mma_k:
        problems.append(f"block_k={cfg.block_k} is not a multiple of {cfg.mma_k}")
    if problems:
        raise LoweringError(f"wgmma contraction with {cfg}: " + "; ".join(problems))


def copiers(ctx: Context) -> list[TileCopier]:
    em, p = ctx.em, ctx.problem
    out = []
    a_stride, b_stride = batch_strides(p)
    for tile, ring, mn0, stride, size in ((ctx.a, ctx.a_ring, ctx.m0, a_stride, p.m * p.k),
                                          (ctx.b, ctx.b_ring, ctx.n0, b_stride, p.k * p.n)):
        src, src_type = ctx.memrefs[tile.name]
        batch_offset = em.op(f"arith.muli {ctx.batch}, {em.index(stride)} : index")
        out.append(TileCopier(tile, ctx.threads, src, src_type, ring, tile.memref(ctx.config.stages),
                          batch_offset, mn0, p.batch * size))
    return out


def descriptor_bases(ctx: Context, wg_m: str, wg_n: str, tm: int, tn: int) -> tuple[str, str]:
    """i64 descriptors of this warpgroup's first A and B piece in stage 0 (start address, LBO, SBO,
    swizzle); per-step descriptors add 16-byte units to the start address field."""
    em, a, b = ctx.em, ctx.a, ctx.b
    base = em.op(f"memref.extract_aligned_pointer_as_index {ctx.smem} : memref<?xi8, #gpu.address_space<workgroup>> -> index")
    if a.k_major:  # rows of 128 B: the warpgroup's first row
        a_ofs = em.op(f"arith.muli {wg_m}, {em.index(tm * PANEL_BYTES)} : index")
    else:  # 64-column panels of block_k rows: the warpgroup's first panel
        a_ofs = em.op(f"arith.muli {wg_m}, {em.index(tm // a.panel_elems * a.panel_bytes)} : index")
    if b.k_major:
        b_ofs = em.op(f"arith.muli {wg_n}, {em.index(tn * PANEL_BYTES)} : index")
    else:
        b_ofs = em.op(f"arith.muli {wg_n}, {em.index(tn // b.panel_elems * b.panel_bytes)} : index")
    b_ofs = em.op(f"arith.addi {b_ofs}, {em.index(ctx.a_ring_bytes)} : index")
    bases = []
    for tile, ofs in ((a, a_ofs), (b, b_ofs)):
        addr = em.op(f"arith.index_cast {em.op(f'arith.addi {base}, {ofs} : index')} : index to i64")
        lbo, sbo = k_major_offsets(tile) if tile.k_major else mn_major_offsets(tile)
        bits = ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (SWIZZLE_128B << 62)
        bits = bits - (1 << 64) if bits >= 1 << 63 else bits  # as a signed i64 constant
        field = em.op(f"arith.andi {em.op(f'arith.shrui {addr}, {_i64(em, 4)} : i64')}, {_i64(em, 0x3FFF)} : i64")
        bases.append(em.op(f"arith.ori {field}, {_i64(em, bits)} : i64"))
    return bases[0], bases[1]


def k_major_offsets(tile) -> tuple[int, int]:
    """(LBO, SBO) in bytes of a K-major 128-byte-swizzled operand: LBO is unused (one 16-byte unit,
    as CUTLASS writes it), SBO steps over eight 128-byte rows of M or N."""
    return 16, GROUP_ROWS_BYTES


def mn_major_offsets(tile) -> tuple[int, int]:
    """(LBO, SBO) in bytes of an MN-major 128-byte-swizzled operand: LBO steps from one 64-element
    panel of M or N to the next, SBO over eight 128-byte rows of K."""
    return tile.panel_bytes, GROUP_ROWS_BYTES


def _i64(em, value: int) -> str:
    return em.op(f"arith.constant {value} : i64")


def _a_offset(ctx: Context, j: int, r: int) -> int:
    """Bytes from the warpgroup's A piece to k step `j` (of the MMA's k) of repeat `r`, within one stage."""
    a = ctx.a
    k = j * ctx.config.mma_k
    if a.k_major:
        return (k // a.panel_elems) * a.panel_bytes + r * WGMMA_M * PANEL_BYTES + (k % a.panel_elems) * a.elem_bytes
    return r * WGMMA_M // a.panel_elems * a.panel_bytes + k * PANEL_BYTES


def _b_offset(ctx: Context, j: int, tn: int) -> int:
    b = ctx.b
    k = j * ctx.config.mma_k
    if b.k_major:
        return (k // b.panel_elems) * b.panel_bytes + (k % b.panel_elems) * b.elem_bytes
    return k * PANEL_BYTES


def _descriptor(ctx: Context, base: str, stage: str, stage_bytes: int, offset: int) -> str:
    em = ctx.em
    stage_units = em.op(f"arith.muli {stage}, {_i64(em, stage_bytes >> 4)} : i64")
    return em.op(f"arith.addi {em.op(f'arith.addi {base}, {stage_units} : i64')}, {_i64(em, offset >> 4)} : i64")


def fragments(ctx: Context, accs: list[str], acc_type: str, wg_m: str, wg_n: str, tm: int, tn: int) -> list[Fragment]:
    em = ctx.em
    lane = em.op(f"arith.remui {ctx.tid}, {em.index(32)} : index")
    warp = em.op(f"arith.remui {em.op(f'arith.divui {ctx.tid}, {em.index(32)} : index')}, {em.index(4)} : index")
    row = ix_add(em, (wg_m, tm), (warp, 16), ix_op(em, "divui", lane, 4))
    col = ix_add(em, (wg_n, tn), (ix_op(em, "remui", lane, 4), 2))
    fragments = []
    for r, acc in enumerate(accs):
        for i in range(0, tn // 2, 2):
            v0 = em.op(f"llvm.extractvalue {acc}[{i}] : {acc_type}")
            v1 = em.op(f"llvm.extractvalue {acc}[{i + 1}] : {acc_type}")
            fragments.append(Fragment((row, WGMMA_M * r + 8 * ((i // 2) % 2)), (col, 8 * (i // 4)), (v0, v1)))
    return fragments
