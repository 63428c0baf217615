"""The TF32 main loop: a cp.async ring of swizzled tiles feeding `mma.sync m16n8k8` (f32 operands).

Warps: the config's warps_m x warps_n grid; each warp owns a (block_m / warps_m) x (block_n / warps_n)
piece of C as 16x8 MMA tiles. Pipeline with S stages, copies S - 1 tiles ahead:

    prologue: copy tiles 0 .. S-2
    for kt:  cp.async.wait (tile kt landed) ; barrier
             copy tile kt + S - 1 into the stage tile kt - 1 used ; commit
             for each k8 step: load A and B fragments from shared memory ; mma.sync

Fragments (PTX ISA, mma.m16n8k8 .tf32; g = lane / 4, t = lane % 4):
  A: a0 (g, t)  a1 (g+8, t)  a2 (g, t+4)  a3 (g+8, t+4)     B: b0 (k=t, n=g)  b1 (k=t+4, n=g)
  C: c0, c1 at (g, 2t), (g, 2t+1); c2, c3 at (g+8, 2t), (g+8, 2t+1)
A K-major tile (A as [M, K]) is read with ldmatrix.x4 (four 8x4 f32 blocks: each lane receives the
32-bit word (row g, word t) of each block, exactly a0..a3); a K-major B tile (B given as [N, K]) with
ldmatrix.x4 over two n8 tiles. MN-major tiles (B as [K, N], A given as [K, M]) would need
ldmatrix.trans, which moves 16-bit halves and is wrong for 32-bit data (report, Table 1): they are
read with 32-bit scalar loads, conflict-free under the `rows4x2` swizzle (lanes t = 0..3 read rows
whose chunks the swizzle moves apart by 2, lanes g = 0..7 two adjacent chunks). An N-major B whose
warp pieces are whole 64-column groups is read 16 bytes at a time instead, with N permuted inside
each group (`permutes_n`). Operands are rounded to TF32 (cvt.rna) in registers, as XLA does; with
`mma_sync_tf32x3_16x8x8` (precision "highest") each word is split there into a TF32 value and a TF32
remainder instead, and each k8 step issues three products per tile (`split_tf32.PRODUCTS`).
To save registers, every fragment address is a per-lane anchor plus a constant (`at` in
`_fragment_offsets`): the swizzle only sees rows modulo 4 or 8 and whole panels.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jnova.codegen.gpu.matmul_epilogue import Context, Fragment, batch_strides, copy_ahead, copy_tile
from jnova.codegen.gpu.matmul_smem import TileCopier, ix_add, ix_op
from jnova.codegen.gpu.split_tf32 import PRODUCTS, emit_round, emit_split
from jnova.errors import LoweringError

MMA_M, MMA_N, MMA_K = 16, 8, 8
ACC = "vector<2x2xf32>"


@dataclass(frozen=True)
class Vectors:
    """Element offsets of 16-byte fragment reads (the permuted N-major B path)."""

    offsets: tuple[str, ...]


def SWIZZLES(problem, config):  # noqa: N802 (the family interface: the swizzle of the A and B tiles)
    a = "rows8" if problem.a_layout == "row" else "rows4x2"
    if problem.b_layout == "col":
        return a, "rows8"
    return a, ("rows4x5" if permutes_n(config) else "rows4x2")


def k_major_only(config) -> bool:
    """The tiles keep the operands' layouts (MN-major ones are read with 32-bit scalar loads)."""
    return False


def permutes_n(config) -> bool:
    """Whether an N-major B is read 16 bytes at a time: in each group of 8 n8 tiles (64 columns), MMA
    column q of tile j computes C column 8q + j, so a lane's b0 words for the 8 tiles are 8 adjacent
    floats of one row (two 16-byte loads instead of eight scalar ones) and its accumulators hold 16
    adjacent columns. Needs the warp's columns to be whole groups of 64."""
    return config.block_n // config.warps_n % 64 == 0


def threads(problem, config) -> int:
    return 32 * config.num_warps


def main_loop(ctx: Context) -> list[Fragment]:
    em, cfg, p = ctx.em, ctx.config, ctx.problem
    wm, wn = cfg.block_m // cfg.warps_m, cfg.block_n // cfg.warps_n
    if wm % MMA_M or wn % MMA_N or cfg.block_k % MMA_K:
        raise LoweringError(f"mma.sync contraction with {cfg}: warp piece {wm}x{wn} or block_k={cfg.block_k} is not "
                            f"whole {MMA_M}x{MMA_N}x{MMA_K} MMA tiles")
    mt, nt = wm // MMA_M, wn // MMA_N
    k_tiles = math.ceil(p.k / cfg.block_k)
    ahead = cfg.stages - 1

    copiers = []
    a_stride, b_stride = batch_strides(p)
    for tile, ring, mn0, stride in ((ctx.a, ctx.a_ring, ctx.m0, a_stride), (ctx.b, ctx.b_ring, ctx.n0, b_stride)):
        src, src_type = ctx.memrefs[tile.name]
        batch_offset = em.op(f"arith.muli {ctx.batch}, {em.index(stride)} : index")
        copiers.append(TileCopier(tile, ctx.threads, src, src_type, ring, tile.memref(cfg.stages), batch_offset, mn0))
    for c in copiers:
        c.prepare(em, ctx.tid)
    warp = em.op(f"arith.divui {ctx.tid}, {em.index(32)} : index")
    lane = em.op(f"arith.remui {ctx.tid}, {em.index(32)} : index")
    m_base = em.op(f"arith.muli {em.op(f'arith.divui {warp}, {em.index(cfg.warps_n)} : index')}, {em.index(wm)} : index")
    n_base = em.op(f"arith.muli {em.op(f'arith.remui {warp}, {em.index(cfg.warps_n)} : index')}, {em.index(wn)} : index")
    a_reads = _fragment_offsets(ctx, ctx.a, m_base, lane, mt, "a")
    b_reads = _fragment_offsets(ctx, ctx.b, n_base, lane, nt, "b")

    copy_ahead(ctx, copiers, ahead, k_tiles)
    zero = em.op(f"arith.constant dense<0.0> : {ACC}")
    kt, accs = em.fresh("kt"), [em.fresh("acc") for _ in range(mt * nt)]
    result = em.fresh("accs")
    types = ", ".join([ACC] * len(accs))
    with em.region(f"{result}:{len(accs)} = scf.for {kt} = {em.index(0)} to {em.index(k_tiles)} step {em.index(1)} "
                   f"iter_args({', '.join(f'{a} = {zero}' for a in accs)}) -> ({types}) {{"):
        em.line(f"nvvm.cp.async.wait.group {ahead - 1}")
        em.line("gpu.barrier")
        copy_tile(ctx, copiers, em.op(f"arith.addi {kt}, {em.index(ahead)} : index"))
        stage = em.op(f"arith.remui {kt}, {em.index(cfg.stages)} : index")
        a_stage = em.op(f"arith.muli {stage}, {em.index(ctx.a.mn * ctx.a.bk)} : index")
        b_stage = em.op(f"arith.muli {stage}, {em.index(ctx.b.mn * ctx.b.bk)} : index")
        split = "tf32x3" in cfg.mma
        # split-TF32: the tensor cores sum one k-tile's products from zero, and the tile's sums join the
        # accumulators in an f32 add that rounds to nearest (split_tf32.py: why)
        new = [zero] * len(accs) if split else list(accs)
        for ks in range(cfg.block_k // MMA_K):
            a_frags = _load_a(ctx, a_reads[ks], a_stage, split)
            b_frags = _load_b(ctx, b_reads[ks], b_stage, nt, split)
            products = PRODUCTS if split else (("hi", "hi"),)
            for pa, pb in products:  # one product over all tiles, then the next: independent mma in flight
                for i in range(mt):
                    for j in range(nt):
                        a_frag, b_frag = a_frags[i][PART[pa]], b_frags[j][PART[pb]]
                        new[i * nt + j] = em.op(f"nvgpu.mma.sync({a_frag}, {b_frag}, {new[i * nt + j]}) "
                                                f"{{mmaShape = [{MMA_M}, {MMA_N}, {MMA_K}], tf32Enabled}} : "
                                                f"(vector<4x1xf32>, vector<2x1xf32>, {ACC}) -> {ACC}")
        if split:
            new = [em.op(f"arith.addf {acc}, {tile} : {ACC}") for acc, tile in zip(accs, new)]
        em.line(f"scf.yield {', '.join(new)} : {types}")
    em.line("nvvm.cp.async.wait.group 0")  # copies past the last tile must land before the block exits
    return _fragments(ctx, [f"{result}#{i}" for i in range(len(accs))], m_base, n_base, lane, mt, nt)


def _fragment_offsets(ctx: Context, tile, base: str, lane: str, tiles: int, operand: str) -> list:
    """Per k8 step: the element offsets (within a stage) this lane reads its fragments from.

    K-major tiles (ldmatrix): one lane address per x4 instruction, A per m16 tile, B per pair of n8
    tiles. MN-major tiles (scalar): the words (a0..a3) per m16 tile, or (b0, b1) per n8 tile.
    """
    em = ctx.em
    g = em.op(f"arith.divui {lane}, {em.index(4)} : index")
    t = em.op(f"arith.remui {lane}, {em.index(4)} : index")
    r8 = em.op(f"arith.remui {lane}, {em.index(8)} : index")
    q = em.op(f"arith.divui {lane}, {em.index(8)} : index")  # which 8x4 block this lane addresses

    anchors = {}

    def at(mn_terms, k_terms):
        """Offset of (base + sum(mn_terms), sum(k_terms)): computed once per lane-dependent part and
        constant remainder the swizzle does not see, then shifted by constants (no more registers)."""
        const_mn, const_k = (sum(x for x in terms if isinstance(x, int)) for terms in (mn_terms, k_terms))
        step_mn, step_k = tile.invariant_shift()
        rest_mn, rest_k = const_mn % step_mn, const_k % step_k
        key = (tuple(x for x in mn_terms if not isinstance(x, int)), rest_mn,
               tuple(x for x in k_terms if not isinstance(x, int)), rest_k)
        if key not in anchors:
            mn = em.op(f"arith.addi {base}, {_sum(em, [*key[0], rest_mn])} : index")
            byte = tile.byte_offset(em, mn, _sum(em, [*key[2], rest_k]))
            anchors[key] = em.op(f"arith.divui {byte}, {em.index(tile.elem_bytes)} : index")
        shift = tile.shift_bytes(const_mn - rest_mn, const_k - rest_k)
        return ix_add(em, anchors[key], shift // tile.elem_bytes)

    steps = []
    for ks in range(ctx.config.block_k // MMA_K):
        k0 = ks * MMA_K
        reads = []
        if tile.k_major and operand == "a":  # blocks: (rows 0-7, k 0-3) (rows 8-15, k 0-3) (rows 0-7, k 4-7) ...
            half = em.op(f"arith.remui {q}, {em.index(2)} : index")
            kq = em.op(f"arith.divui {q}, {em.index(2)} : index")
            for i in range(tiles):
                reads.append(at([r8, (half, 8), MMA_M * i], [k0, (kq, 4)]))
        elif tile.k_major:  # blocks: (n 0-7, k 0-3) (n 0-7, k 4-7) (n 8-15, k 0-3) (n 8-15, k 4-7)
            kq = em.op(f"arith.remui {q}, {em.index(2)} : index")
            second = em.op(f"arith.divui {q}, {em.index(2)} : index")
            for j in range(0, tiles, 2):
                reads.append(at([r8, (second, 8), MMA_N * j], [k0, (kq, 4)]))
        elif operand == "a":
            for i in range(tiles):
                reads.append(tuple(at([g, MMA_M * i + dm], [k0 + dk, t]) for dm, dk in ((0, 0), (8, 0), (0, 4), (8, 4))))
        elif permutes_n(ctx.config):  # per 64-column group: rows t and t + 4, columns 8g .. 8g + 7
            for group in range(tiles // 8):
                reads.append(Vectors(tuple(at([(g, 8), 64 * group + 4 * h], [k0 + dk, t])
                                           for dk in (0, 4) for h in (0, 1))))
        else:
            for j in range(tiles):
                reads.append(tuple(at([g, MMA_N * j], [k0 + dk, t]) for dk in (0, 4)))
        steps.append(reads)
    return steps


def _sum(em, terms) -> str:
    """The index sum of terms: SSA names, (SSA, constant factor) pairs, integers."""
    total = em.index(sum(x for x in terms if isinstance(x, int)))
    for x in terms:
        if isinstance(x, tuple):
            x = em.op(f"arith.muli {x[0]}, {em.index(x[1])} : index")
        if isinstance(x, str):
            total = em.op(f"arith.addi {total}, {x} : index")
    return total


PART = {"hi": 0, "lo": 1}


def _parts(em, words: list[str], split: bool) -> list[list[str]]:
    """[hi] (TF32-rounded words) or [hi, lo] (the split of `split_tf32`)."""
    return list(emit_split(em, words)) if split else [emit_round(em, words)]


def _load_a(ctx: Context, reads: list, stage: str, split: bool = False) -> list[tuple[str, ...]]:
    """The A fragments (vector<4x1xf32> of TF32 values) of one k8 step, one per m16 tile: (hi,) or
    (hi, lo) each."""
    em, ring, ring_type = ctx.em, ctx.a_ring, ctx.a.memref(ctx.config.stages)
    frags = []
    for read in reads:
        if isinstance(read, tuple):  # four scalar words
            words = [em.op(f"memref.load {ring}[{ix_add(em, stage, w)}] : {ring_type}") for w in read]
        else:
            words = _ldmatrix(em, ring, ring_type, ix_add(em, stage, read), 4)
        frags.append(tuple(em.op(f"vector.from_elements {', '.join(part)} : vector<4x1xf32>")
                           for part in _parts(em, words, split)))
    return frags


def _load_b(ctx: Context, reads: list, stage: str, nt: int, split: bool = False) -> list[tuple[str, ...]]:
    """The B fragments (vector<2x1xf32> of TF32 values) of one k8 step, one per n8 tile: (hi,) or
    (hi, lo) each."""
    em, ring, ring_type = ctx.em, ctx.b_ring, ctx.b.memref(ctx.config.stages)
    frags = []
    for j, read in enumerate(reads):
        if isinstance(read, Vectors):  # 4 x 4 words: b0 of 8 tiles (row t), then b1 (row t + 4)
            words = []
            for at in read.offsets:
                v = em.op(f"vector.load {ring}[{ix_add(em, stage, at)}] {{alignment = 16}} : {ring_type}, vector<4xf32>")
                words += [em.op(f"vector.extract {v}[{w}] : f32 from vector<4xf32>") for w in range(4)]
            parts = _parts(em, words, split)
            for jj in range(8):
                frags.append(tuple(em.op(f"vector.from_elements {p[jj]}, {p[8 + jj]} : vector<2x1xf32>")
                                   for p in parts))
            continue
        if isinstance(read, tuple):  # two scalar words
            words = [em.op(f"memref.load {ring}[{ix_add(em, stage, w)}] : {ring_type}") for w in read]
        else:  # one ldmatrix for two n8 tiles (for one at an odd end)
            words = _ldmatrix(em, ring, ring_type, ix_add(em, stage, read), 4 if 2 * j + 1 < nt else 2)
        parts = _parts(em, words, split)
        for w in range(0, len(words), 2):
            frags.append(tuple(em.op(f"vector.from_elements {p[w]}, {p[w + 1]} : vector<2x1xf32>") for p in parts))
    return frags


def _ldmatrix(em, ring: str, ring_type: str, at: str, count: int) -> list[str]:
    x = em.op(f"nvgpu.ldmatrix {ring}[{at}] {{numTiles = {count} : i32, transpose = false}} : {ring_type} "
              f"-> vector<{count}x1xf32>")
    return [em.op(f"vector.extract {x}[{w}, 0] : f32 from vector<{count}x1xf32>") for w in range(count)]


def _fragments(ctx: Context, accs: list[str], m_base: str, n_base: str, lane: str, mt: int, nt: int) -> list[Fragment]:
    em = ctx.em
    row = em.op(f"arith.addi {m_base}, {em.op(f'arith.divui {lane}, {em.index(4)} : index')} : index")
    if not ctx.b.k_major and permutes_n(ctx.config):  # c0 of tile j is C column 16t + j (c1: + 8)
        col = ix_add(em, n_base, (ix_op(em, "remui", lane, 4), 16))
        fragments = []
        for i in range(mt):
            for group in range(nt // 8):
                for half in range(2):
                    for which in range(2):
                        for jj in range(0, 8, 2):
                            pair = [em.op(f"vector.extract {accs[i * nt + 8 * group + jj + d]}[{half}, {which}] : "
                                          f"f32 from {ACC}") for d in (0, 1)]
                            fragments.append(Fragment((row, MMA_M * i + 8 * half), (col, 64 * group + 8 * which + jj),
                                                      tuple(pair)))
        return fragments
    col = ix_add(em, n_base, (ix_op(em, "remui", lane, 4), 2))
    fragments = []
    for i in range(mt):
        for j in range(nt):
            acc = accs[i * nt + j]
            for half in range(2):
                v0 = em.op(f"vector.extract {acc}[{half}, 0] : f32 from {ACC}")
                v1 = em.op(f"vector.extract {acc}[{half}, 1] : f32 from {ACC}")
                fragments.append(Fragment((row, MMA_M * i + 8 * half), (col, MMA_N * j), (v0, v1)))
    return fragments
