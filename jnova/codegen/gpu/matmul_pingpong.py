"""The warp-specialized ping-pong contraction kernel (sm_90a, 16-bit operands).

A block of three warpgroups walks block tiles (persistent, one block per SM):

  producer   (warpgroup 0): for each of the block's tiles in turn, for each k-tile: wait until the
             ring stage is empty, copy A's and B's k-tile into it with cp.async, and have each
             thread's copies arrive on the stage's "full" mbarrier when they land
             (`cp.async.mbarrier.arrive.noinc`);
  consumers  (warpgroups 1 and 2): the block's tiles alternate between them. A consumer waits for
             each stage to be full, runs its wgmma over it, and once that wgmma group is done (one
             group kept in flight) arrives on the stage's "empty" mbarrier; after the last k-tile it
             stores its tile from registers (bias, residual, masked edges: `matmul_epilogue.py`).

Each consumer owns a config.block_m x config.block_n tile and its accumulators, so while one
consumer stores its tile the other's k-tiles, copied meanwhile, keep the tensor cores busy: the
stores of C overlap the main loop without a staging buffer. The consumers take turns (named
barriers): tile i's main loop starts once tile i - 1's has finished. Besides keeping the tensor
cores to one main loop at a time, this is what makes the parity waits sound: an mbarrier wait can
tell only the current phase from the one before, so no consumer may reach a stage's round r while
round r - 1 is still being filled, which a consumer that finished its tile early otherwise does. The ring holds `stages` k-tiles of one
consumer's tile; the global k-iteration `it` (the block's tile i, k-tile kt: it = i * k_tiles + kt)
picks stage it % stages and mbarrier phase (it / stages) % 2. Registers: `LAUNCH_REGS` a thread
for all three warpgroups; a consumer's 128 f32 accumulators and its addressing fit (ptxas reports no
spills), so no register moves between warpgroups (setmaxnreg) are needed.
"""
from __future__ import annotations

import dataclasses
import math

from jnova.codegen.gpu import matmul_wgmma
from jnova.codegen.gpu.matmul_epilogue import Context, MatmulEpilogue, store_fragments
from jnova.codegen.gpu.matmul_smem import ix_add

THREADS = 384  # a producer warpgroup and two consumer warpgroups
LAUNCH_REGS = 168  # 65536 registers / 384 threads, in whole multiples of 8 (a consumer fits, no spills)
BARRIER_BYTES = 8
TURN_BARRIER = 1  # named barriers 1 and 2 (0 is the block-wide one)


def smem_bytes(ring_bytes: int, stages: int) -> int:
    """The ring, then a full and an empty mbarrier per stage."""
    return ring_bytes + 2 * stages * BARRIER_BYTES


def emit(ctx: Context, epilogue: MatmulEpilogue, tiles_m: int, tiles_n: int, total: int, blocks: int,
         ring_bytes: int, tile_context) -> None:
    """The kernel body; `ctx` is the block's context (its threads and tid the whole block's),
    `tile_context(ctx, t)` the context of tile index t."""
    em, cfg, p = ctx.em, ctx.config, ctx.problem
    stages = cfg.stages
    k_tiles = math.ceil(p.k / cfg.block_k)
    base = em.op(f"memref.extract_aligned_pointer_as_index {ctx.smem} : "
                 f"memref<?xi8, #gpu.address_space<workgroup>> -> index")

    def barrier(kind: int, stage: str) -> str:  # kind 0: full, 1: empty
        ofs = ix_add(em, base, ring_bytes + kind * stages * BARRIER_BYTES, (stage, BARRIER_BYTES))
        as_i64 = em.op(f"arith.index_cast {ofs} : index to i64")
        as_i32 = em.op(f"arith.trunci {as_i64} : i64 to i32")
        return em.op(f"llvm.inttoptr {as_i32} : i32 to !llvm.ptr<3>")

    def stage_and_phase(it: str) -> tuple[str, str]:
        stage = em.op(f"arith.remui {it}, {em.index(stages)} : index")
        round_ = em.op(f"arith.divui {it}, {em.index(stages)} : index")
        phase = em.op(f"arith.remui {round_}, {em.index(2)} : index")
        return stage, em.op(f"arith.index_cast {phase} : index to i32")

    def wait(pointer: str, parity: str) -> None:
        em.line(f"nvvm.mbarrier.try_wait.parity {pointer}, {parity}, {em.i32(0x989680)} : !llvm.ptr<3>, i32, i32")

    tid = ctx.tid
    first = em.op(f"arith.cmpi eq, {tid}, {em.index(0)} : index")
    with em.region(f"scf.if {first} {{"):
        count = em.i32(128)
        for kind in (0, 1):
            for s in range(stages):
                em.line(f"nvvm.mbarrier.init {barrier(kind, em.index(s))}, {count} : !llvm.ptr<3>, i32")
    em.line("gpu.barrier")

    bid = em.op("gpu.block_id x")
    local = em.op(f"arith.subi {em.index(total + blocks - 1)}, {bid} : index")
    local = em.op(f"arith.divui {local}, {em.index(blocks)} : index")  # tiles of this block: bid, bid + blocks, ... < total
    role = em.op(f"arith.divui {tid}, {em.index(128)} : index")
    lane_tid = em.op(f"arith.remui {tid}, {em.index(128)} : index")
    producer = em.op(f"arith.cmpi eq, {role}, {em.index(0)} : index")
    with em.region(f"scf.if {producer} {{", "} else {"):
        i = em.fresh("i")
        with em.region(f"scf.for {i} = {em.index(0)} to {local} step {em.index(1)} {{"):
            t = ix_add(em, bid, (i, blocks))
            here = dataclasses.replace(tile_context(ctx, t), threads=128, tid=lane_tid)
            copiers = matmul_wgmma.copiers(here)
            for c in copiers:
                c.prepare(em, lane_tid)
            kt = em.fresh("kt")
            with em.region(f"scf.for {kt} = {em.index(0)} to {em.index(k_tiles)} step {em.index(1)} {{"):
                stage, phase = stage_and_phase(ix_add(em, (i, k_tiles), kt))
                wait(barrier(1, stage), em.op(f"arith.xori {phase}, {em.i32(1)} : i32"))
                for c in copiers:
                    c.issue(em, kt, em.op(f"arith.muli {stage}, {em.index(c.tile.mn * c.tile.bk)} : index"))
                em.line(f"nvvm.cp.async.mbarrier.arrive {barrier(0, stage)} {{noinc = true}} : !llvm.ptr<3>")
    em.depth += 1
    consumer = em.op(f"arith.subi {role}, {em.index(1)} : index")
    left = em.op(f"arith.subi {ix_add(em, local, 1)}, {consumer} : index")
    mine = em.op(f"arith.divui {left}, {em.index(2)} : index")  # ceil((local - consumer) / 2)
    # turns: consumer c's main loop over tile i > 0 starts once the other finished tile i - 1's
    # (named barrier TURN_BARRIER + c: the other's 128 threads arrive, c's 128 wait)
    mine_id = em.op(f"arith.index_cast {ix_add(em, consumer, TURN_BARRIER)} : index to i32")
    other_id = em.op(f"arith.index_cast {em.op(f'arith.subi {em.index(TURN_BARRIER + 1)}, {consumer} : index')} "
                     f": index to i32")
    pair = em.i32(256)
    j = em.fresh("j")
    with em.region(f"scf.for {j} = {em.index(0)} to {mine} step {em.index(1)} {{"):
        i = ix_add(em, (j, 2), consumer)
        here = dataclasses.replace(tile_context(ctx, ix_add(em, bid, (i, blocks))), threads=128, tid=lane_tid)
        with em.region(f"scf.if {em.op(f'arith.cmpi ugt, {i}, {em.index(0)} : index')} {{"):
            em.line(f"nvvm.barrier id = {mine_id} number_of_threads = {pair}")
        fragments = _consume(here, ix_add(em, (i, k_tiles)), k_tiles, barrier, stage_and_phase, wait)
        following = em.op(f"arith.cmpi ult, {ix_add(em, i, 1)}, {local} : index")
        with em.region(f"scf.if {following} {{"):  # the other consumer's turn
            em.line(f"nvvm.barrier.arrive id = {other_id} number_of_threads = {pair}")
        store_fragments(here, epilogue, fragments)
    em.depth -= 1
    em.line("}")


def _consume(ctx: Context, it0: str, k_tiles: int, barrier, stage_and_phase, wait):
    """One consumer warpgroup's main loop over its tile: the accumulators as fragments."""
    em, cfg = ctx.em, ctx.config
    tm, tn = cfg.block_m, cfg.block_n
    reps = tm // matmul_wgmma.WGMMA_M
    acc_type = "!llvm.struct<(" + ", ".join(["f32"] * (tn // 2)) + ")>"
    zero_ix = em.index(0)
    desc_a, desc_b = matmul_wgmma.descriptor_bases(ctx, zero_ix, zero_ix, tm, tn)
    zero = em.op(f"llvm.mlir.zero : {acc_type}")
    kt, accs = em.fresh("kt"), [em.fresh("acc") for _ in range(reps)]
    result = em.fresh("accs")
    types = ", ".join([acc_type] * reps)
    with em.region(f"{result}:{reps} = scf.for {kt} = {em.index(0)} to {em.index(k_tiles)} step {em.index(1)} "
                   f"iter_args({', '.join(f'{a} = {zero}' for a in accs)}) -> ({types}) {{"):
        it = em.op(f"arith.addi {it0}, {kt} : index")
        stage, phase = stage_and_phase(it)
        wait(barrier(0, stage), phase)
        em.line("nvvm.fence.proxy {kind = #nvvm.proxy_kind<async.shared>, space = #nvvm.shared_space<cta>}")
        stage64 = em.op(f"arith.index_cast {stage} : index to i64")
        new = matmul_wgmma.wgmma_k_tile(ctx, desc_a, desc_b, stage64, accs, acc_type, tn, reps)
        em.line("nvvm.wgmma.commit.group.sync.aligned")
        em.line("nvvm.wgmma.wait.group.sync.aligned 1")
        started = em.op(f"arith.cmpi ugt, {kt}, {em.index(0)} : index")
        with em.region(f"scf.if {started} {{"):  # the previous k-tile's wgmma is done: its stage is free
            before, _ = stage_and_phase(em.op(f"arith.subi {it}, {em.index(1)} : index"))
            em.op(f"nvvm.mbarrier.arrive {barrier(1, before)} : !llvm.ptr<3> -> i64")
        em.line(f"scf.yield {', '.join(new)} : {types}")
    em.line("nvvm.wgmma.wait.group.sync.aligned 0")
    last, _ = stage_and_phase(em.op(f"arith.addi {it0}, {em.index(k_tiles - 1)} : index"))
    em.op(f"nvvm.mbarrier.arrive {barrier(1, last)} : !llvm.ptr<3> -> i64")
    zero_ix = em.index(0)
    return matmul_wgmma.fragments(ctx, [f"{result}#{r}" for r in range(reps)], acc_type, zero_ix, zero_ix, tm, tn)
