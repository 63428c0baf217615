"""The warp-specialized ping-pong contraction kernel fed by TMA (sm_90a; 16-bit operands in either
layout, TF32 operands both K-major).

A block of three warpgroups walks block tiles (persistent, one block per SM):

  producer   (warpgroup 0, one thread): for each of the block's tiles in turn, for each k-tile:
             wait until the ring stage is empty, announce its bytes on the stage's "full" mbarrier
             (`mbarrier.arrive.expect_tx`) and copy A's and B's k-tile into it with
             `cp.async.bulk.tensor` (the Tensor Memory Accelerator: one instruction per operand, or
             per 64-element panel of an MN-major operand); the copies complete the transaction;
  consumers  (warpgroups 1 and 2): the block's tiles alternate between them. A consumer waits for
             each stage to be full, runs its wgmma over it, and once that wgmma group is done (one
             group kept in flight) arrives on the stage's "empty" mbarrier; after the last k-tile it
             stores its tile: 128 bytes of each row at a time (32 f32 or 64 bf16 columns, rounded
             on the way, bias added) into shared memory and out by TMA stores (`_ChunkStores`), or,
             where the epilogue adds a residual, from registers (`matmul_epilogue.store_fragments`).

Each consumer owns a config.block_m x config.block_n tile and its accumulators, so while one consumer
stores its tile the other's k-tiles keep the tensor cores busy. The consumers take turns (named barriers): tile i's main loop starts
once tile i - 1's has finished. Besides keeping the tensor cores to one main loop at a time, this is
what makes the parity waits sound: an mbarrier wait tells only the current phase from the one before,
so no consumer may reach a stage's round r while round r - 1 is still being filled. The ring holds
`stages` k-tiles of one consumer's tile; the block's k-iteration `it` (its tile i, k-tile kt:
it = i * k_tiles + kt) picks stage it % stages and mbarrier phase (it / stages) % 2.

The TMA descriptors (`launch.TensorMap`, one per operand) describe A and B in global memory with
the 128-byte swizzle that the wgmma descriptors read (`matmul_wgmma.py`): a box is one 128-byte-wide
panel of the tile, so the copies land exactly in the layout of `matmul_smem.OperandTile`. Past an
edge of M, N or K the TMA unit writes zeros, and still counts the whole box's bytes. jnova's launcher
builds the descriptors from the buffers' addresses at each launch; they reach the kernel by value
(`__grid_constant__`, `ptx.by_value_tensor_maps`).

Why this kernel exists: the bf16 contractions with K = 768 of GPT-2 write an f32 C of 200 MB or more.
Blocks of the one-tile-per-block kernel run in lockstep, so every SM stores at once and nothing
computes meanwhile (mainloop alone 627 TFLOP/s on the H200, 451 with the stores). A cp.async
producer could not feed one consumer at the tensor cores' rate (298-342 TFLOP/s, kept in the history
at 3663c8f); a TMA producer is one thread issuing two to four instructions per k-tile. Measured on
the H200 (16384x3072x768 bf16, XLA 645-670 TFLOP/s): 380-400 TFLOP/s while ptxas serialized the
wgmmas (a branch on the thread id around the consumers: `_warp_uniform`), 490-525 with the consumers'
8-byte stores from registers, 635 with the TMA stores (each warp's stores from registers touch 8 rows
of C, and they slowed the other consumer's main loop; the TMA unit writes whole rows).
"""
from __future__ import annotations

import dataclasses
import math

from jnova.codegen.gpu import matmul_wgmma
from jnova.codegen.gpu.launch import TensorMap
from jnova.codegen.gpu.matmul_epilogue import (BYTES, ELEMENT, Context, MatmulEpilogue, add_loaded, batch_strides,
                                               convert, pointer, store_fragments)
from jnova.codegen.gpu.matmul_smem import PANEL_BYTES, ix_add, ix_op
from jnova.passes.configure.warp_specialized import pingpong_refusal

THREADS = 384  # a producer warpgroup and two consumer warpgroups
LAUNCH_REGS = 168  # 65536 registers / 384 threads, in whole multiples of 8
PRODUCER_REGS, CONSUMER_REGS = 40, 232  # after setmaxnreg: 128 x 40 + 256 x 232 = 384 x 168
MAX_ACCUMULATORS = 192  # f32 accumulators a consumer thread holds (128x192 tiles: no spills; 128x256 spilled 5 KB)
BARRIER_BYTES = 8
TURN_BARRIER = 1  # named barriers 1 and 2 (0 is the block-wide one)
CONSUMER_BARRIER = 3  # named barriers 3 and 4: one consumer's own threads
WAIT_TICKS = 0x989680  # try_wait's suspend-time hint (what CUTLASS passes)
CHUNK_BYTES = 128  # of each row of C per TMA store: one 128-byte swizzled row per tile row
CHUNK_COLUMNS = CHUNK_BYTES // 4  # f32 columns of C per TMA store (64 of a 16-bit C)
SWIZZLE_ALIGN = 1024  # a 128-byte-swizzled buffer starts on a whole swizzle pattern


def staging_offset(ring_bytes: int, stages: int) -> int:
    """Where the staging buffers start: after the ring and its mbarriers (a full and an empty per stage)."""
    end = ring_bytes + 2 * stages * BARRIER_BYTES
    return -(-end // SWIZZLE_ALIGN) * SWIZZLE_ALIGN


def chunk_bytes(config) -> int:
    return config.block_m * CHUNK_BYTES


def chunk_columns(epilogue) -> int:
    """Columns of C per TMA store: 128 bytes of the dtype C is stored in."""
    return CHUNK_BYTES // BYTES[epilogue.out]


def smem_bytes(ring_bytes: int, stages: int, config=None) -> int:
    """The ring, a full and an empty mbarrier per stage, and (given `config`: C leaves by TMA) two
    staging buffers of CHUNK_COLUMNS columns of C per consumer."""
    if config is None:
        return ring_bytes + 2 * stages * BARRIER_BYTES
    return staging_offset(ring_bytes, stages) + 4 * chunk_bytes(config)


def stores_by_tma(problem, epilogue) -> bool:
    """C leaves through TMA when its rows are whole 16-byte units (a tensor map's strides) and the
    epilogue loads no residual: with the residual's loads (a pair per fragment, issued together by
    ptxas beside 192 accumulators) the staged form spilled 16-28 B on GPT-2's projections, the
    stores from registers did not. Bias and conversions are applied on the way into shared memory."""
    return problem.n * BYTES[epilogue.out] % 16 == 0 and "residual" not in epilogue.steps


def refusal(problem, config) -> str | None:
    """Why this kernel cannot compute `problem` with `config`, or None."""
    p, problems = problem, []
    if not config.is_wgmma:
        problems.append("it takes wgmma operands")
    elif "tf32" in config.mma and (p.a_layout, p.b_layout) != ("row", "col"):
        problems.append("TF32 operands must both be K-major (a=row b=col): wgmma does not transpose them, "
                        "and the TMA copies land as they are")
    if (config.warps_m, config.warps_n) != (4, 1):
        problems.append("a consumer is one warpgroup (warps=4x1)")
    panel = PANEL_BYTES // config.operand_bytes
    if config.block_k != panel:
        problems.append(f"block_k={config.block_k}: a k-tile is one 128-byte panel ({panel} elements)")
    if config.block_m % 64 or config.block_n % 64 or config.block_m > 256 or config.block_n > 256:
        problems.append(f"{config.block_m}x{config.block_n} tiles (multiples of 64, at most 256)")
    elif config.block_m * config.block_n // 128 > MAX_ACCUMULATORS:
        problems.append(f"{config.block_m}x{config.block_n} tiles: {config.block_m * config.block_n // 128} "
                        f"accumulators a consumer thread, at most {MAX_ACCUMULATORS}")
    if pingpong_refusal(p):
        problems.append(pingpong_refusal(p))
    return "; ".join(problems) or None


def tensor_maps(problem, config, first_param: int) -> tuple[TensorMap, TensorMap]:
    """The descriptors of A (buffer 0) and B (buffer 1), passed as kernel parameters `first_param` and
    the next one: innermost dimension first, the batch last where there is one. A box is one panel:
    128 bytes of K by the tile's rows (K-major), or 128 bytes of M or N by block_k rows of K
    (MN-major, 16-bit only, one copy per panel)."""
    p = problem
    elem = p.operand_bytes
    a_stride, b_stride = batch_strides(p)
    out = []
    for buffer, (k_major, mn, tile_mn, stride) in enumerate((
            (p.a_layout == "row", p.m, config.block_m, a_stride),
            (p.b_layout == "col", p.n, config.block_n, b_stride))):
        inner, outer = (p.k, mn) if k_major else (mn, p.k)
        box = (PANEL_BYTES // elem, tile_mn if k_major else config.block_k)
        dims, strides = (inner, outer), (inner * elem,)
        if p.batch > 1:
            dims, strides, box = dims + (p.batch,), strides + (stride * elem,), box + (1,)
        out.append(TensorMap(buffer, first_param + buffer, p.operand_dtype, dims, strides, box, 128))
    return out[0], out[1]


def c_tensor_map(problem, config, buffer: int, param: int, dtype: str = "float32") -> TensorMap:
    """The descriptor of C ([batch, M, N] in `dtype`) for TMA stores of 128-byte x block_m boxes
    (parts of a box outside C are not written)."""
    p, elem = problem, BYTES[dtype]
    dims, strides, box = (p.n, p.m), (p.n * elem,), (CHUNK_BYTES // elem, config.block_m)
    if p.batch > 1:
        dims, strides, box = dims + (p.batch,), strides + (p.m * p.n * elem,), box + (1,)
    return TensorMap(buffer, param, dtype, dims, strides, box, 128)


def emit(ctx: Context, epilogue: MatmulEpilogue, tiles_m: int, tiles_n: int, total: int, blocks: int,
         ring_bytes: int, tile_context, maps: tuple[str, ...]) -> None:
    """The kernel body; `ctx` is the block's context (its threads and tid the whole block's),
    `tile_context(ctx, t)` the context of tile index t, `maps` the SSA names of the A and B
    descriptors, and of C's where C leaves by TMA (generic pointers to the by-value parameters)."""
    em, cfg, p = ctx.em, ctx.config, ctx.problem
    stages = cfg.stages
    k_tiles = math.ceil(p.k / cfg.block_k)
    base = em.op(f"memref.extract_aligned_pointer_as_index {ctx.smem} : "
                 f"memref<?xi8, #gpu.address_space<workgroup>> -> index")

    def shared_i32(offset) -> str:
        as_i64 = em.op(f"arith.index_cast {ix_add(em, base, *offset)} : index to i64")
        return em.op(f"arith.trunci {as_i64} : i64 to i32")

    def barrier(kind: int, stage: str) -> str:  # kind 0: full, 1: empty
        address = shared_i32((ring_bytes + kind * stages * BARRIER_BYTES, (stage, BARRIER_BYTES)))
        return em.op(f"llvm.inttoptr {address} : i32 to !llvm.ptr<3>")

    def stage_and_phase(it: str) -> tuple[str, str]:
        stage = em.op(f"arith.remui {it}, {em.index(stages)} : index")
        round_ = em.op(f"arith.divui {it}, {em.index(stages)} : index")
        phase = em.op(f"arith.remui {round_}, {em.index(2)} : index")
        return stage, em.op(f"arith.index_cast {phase} : index to i32")

    def wait(pointer: str, parity: str) -> None:
        em.line(f"nvvm.mbarrier.try_wait.parity {pointer}, {parity}, {em.i32(WAIT_TICKS)} : !llvm.ptr<3>, i32, i32")

    tid = ctx.tid
    first = em.op(f"arith.cmpi eq, {tid}, {em.index(0)} : index")
    with em.region(f"scf.if {first} {{"):
        for kind, count in ((0, 1), (1, 1)):  # full: the producer's arrival (+ bytes); empty: a consumer's
            for s in range(stages):
                em.line(f"nvvm.mbarrier.init {barrier(kind, em.index(s))}, {em.i32(count)} : !llvm.ptr<3>, i32")
        em.line("nvvm.fence.mbarrier.init")  # the initialized barriers, visible to the TMA unit
    em.line("gpu.barrier")

    bid = em.op("gpu.block_id x")
    local = em.op(f"arith.subi {em.index(total + blocks - 1)}, {bid} : index")
    local = em.op(f"arith.divui {local}, {em.index(blocks)} : index")  # tiles of this block: bid, bid + blocks, ... < total
    role = _warp_uniform(em, em.op(f"arith.divui {tid}, {em.index(128)} : index"))
    lane_tid = em.op(f"arith.remui {tid}, {em.index(128)} : index")
    with em.region(f"scf.if {em.op(f'arith.cmpi eq, {role}, {em.index(0)} : index')} {{", "} else {"):
        em.line(f"nvvm.setmaxregister decrease {PRODUCER_REGS}")
        with em.region(f"scf.if {em.op(f'arith.cmpi eq, {tid}, {em.index(0)} : index')} {{"):
            _produce(ctx, bid, local, blocks, k_tiles, ring_bytes, maps, tile_context, barrier, stage_and_phase,
                     wait, shared_i32)
    em.depth += 1
    em.line(f"nvvm.setmaxregister increase {CONSUMER_REGS}")
    stores = None
    if len(maps) > 2:
        stores = _ChunkStores(maps[2], ix_add(em, base, staging_offset(ring_bytes, stages)), epilogue)
    _consumers(ctx, epilogue, bid, local, blocks, k_tiles, role, lane_tid, tile_context, barrier,
               stage_and_phase, wait, stores)
    em.depth -= 1
    em.line("}")


def _warp_uniform(em, value: str) -> str:
    """`value` (an index equal across each warp) as lane 0 of the warp has it: ptxas then knows it is
    warp-uniform. A wgmma under a branch on a value it cannot prove uniform is serialized (ptxas
    C7520: "compiler-inserted WG.AR in divergent path"), which halved the consumers' rate."""
    as_i32 = em.op(f"arith.index_cast {value} : index to i32")
    shuffled = em.fresh("uniform")
    em.line(f"{shuffled}, {em.fresh('ok')} = gpu.shuffle idx {as_i32}, {em.i32(0)}, {em.i32(32)} : i32")
    return em.op(f"arith.index_cast {shuffled} : i32 to index")


def _produce(ctx, bid, local, blocks, k_tiles, ring_bytes, maps, tile_context, barrier, stage_and_phase, wait,
             shared_i32) -> None:
    """Thread 0: every k-tile of the block's tiles, in order, into the ring."""
    em, cfg, p = ctx.em, ctx.config, ctx.problem
    stage_bytes = ctx.a.bytes + ctx.b.bytes
    i = em.fresh("i")
    with em.region(f"scf.for {i} = {em.index(0)} to {local} step {em.index(1)} {{"):
        here = tile_context(ctx, ix_add(em, bid, (i, blocks)))
        as_i32 = lambda x: em.op(f"arith.index_cast {x} : index to i32")
        m0, n0, batch = as_i32(here.m0), as_i32(here.n0), as_i32(here.batch)
        kt = em.fresh("kt")
        with em.region(f"scf.for {kt} = {em.index(0)} to {em.index(k_tiles)} step {em.index(1)} {{"):
            stage, phase = stage_and_phase(ix_add(em, (i, k_tiles), kt))
            wait(barrier(1, stage), em.op(f"arith.xori {phase}, {em.i32(1)} : i32"))
            full = barrier(0, stage)
            em.line(f"nvvm.mbarrier.arrive.expect_tx {full}, {em.i32(stage_bytes)} : !llvm.ptr<3>, i32")
            k0 = as_i32(em.op(f"arith.muli {kt}, {em.index(cfg.block_k)} : index"))
            for tile, ring_offset, mn0, k_major, tensor_map in (
                    (ctx.a, 0, m0, p.a_layout == "row", maps[0]),
                    (ctx.b, ctx.a_ring_bytes, n0, p.b_layout == "col", maps[1])):
                stage_base = (ring_offset, (stage, tile.bytes))
                panels = [(0, (k0, mn0))] if k_major else [
                    (q * tile.panel_bytes, (em.op(f"arith.addi {mn0}, {em.i32(tile.panel_elems * q)} : i32"), k0))
                    for q in range(tile.mn // tile.panel_elems)]
                for offset, coords in panels:
                    dst = em.op(f"llvm.inttoptr {shared_i32((*stage_base, offset))} : i32 to !llvm.ptr<3>")
                    dst = em.op(f"llvm.addrspacecast {dst} : !llvm.ptr<3> to !llvm.ptr<7>")
                    box = ", ".join([*coords, batch] if p.batch > 1 else coords)
                    em.line(f"nvvm.cp.async.bulk.tensor.shared.cluster.global {dst}, {tensor_map}, {full}, "
                            f"box[{box}] : !llvm.ptr<7>, !llvm.ptr")


def _consumers(ctx, epilogue, bid, local, blocks, k_tiles, role, lane_tid, tile_context, barrier, stage_and_phase,
               wait, stores) -> None:
    """Warpgroups 1 and 2: tiles 0, 2, 4 ... and 1, 3, 5 ... of the block, in turns."""
    em = ctx.em
    consumer = em.op(f"arith.subi {role}, {em.index(1)} : index")
    signals = em.op(f"arith.cmpi eq, {lane_tid}, {em.index(0)} : index")
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
        def hand_over():  # the other consumer's turn, once this one's last wgmmas are issued
            following = em.op(f"arith.cmpi ult, {ix_add(em, i, 1)}, {local} : index")
            with em.region(f"scf.if {following} {{"):
                em.line(f"nvvm.barrier.arrive id = {other_id} number_of_threads = {pair}")

        fragments = _consume(here, ix_add(em, (i, k_tiles)), k_tiles, barrier, stage_and_phase, wait, hand_over)
        if stores is None:
            store_fragments(here, epilogue, fragments)
        else:
            stores.emit(here, fragments, consumer, signals)
    if stores is not None:
        with em.region(f"scf.if {signals} {{"):  # the last stores have read shared memory: the block may exit
            em.line("nvvm.cp.async.bulk.wait_group 0 {read}")


def _consume(ctx: Context, it0: str, k_tiles: int, barrier, stage_and_phase, wait, hand_over):
    """One consumer warpgroup's main loop over its tile: the accumulators as fragments. `hand_over()`
    is emitted once the last wgmmas are issued, before they are waited for (the other consumer's
    wgmmas then queue behind them: the tensor cores do not drain between tiles)."""
    em, cfg = ctx.em, ctx.config
    tm, tn = cfg.block_m, cfg.block_n
    reps = tm // matmul_wgmma.WGMMA_M
    acc_type = "!llvm.struct<(" + ", ".join(["f32"] * (tn // 2)) + ")>"
    zero_ix = em.index(0)
    desc_a, desc_b = matmul_wgmma.descriptor_bases(ctx, zero_ix, zero_ix, tm, tn)
    signals = em.op(f"arith.cmpi eq, {ctx.tid}, {em.index(0)} : index")  # the warpgroup's signalling thread

    def k_tile(kt: str, accs: list[str], first: bool) -> list[str]:
        it = em.op(f"arith.addi {it0}, {kt} : index")
        stage, phase = stage_and_phase(it)
        wait(barrier(0, stage), phase)
        stage64 = em.op(f"arith.index_cast {stage} : index to i64")
        new = matmul_wgmma.wgmma_k_tile(ctx, desc_a, desc_b, stage64, accs, acc_type, tn, reps, first=first)
        em.line("nvvm.wgmma.commit.group.sync.aligned")
        em.line("nvvm.wgmma.wait.group.sync.aligned 1")
        if not first:
            with em.region(f"scf.if {signals} {{"):
                # the previous k-tile's wgmma is done: its stage is free (one arrival for the warpgroup)
                before, _ = stage_and_phase(em.op(f"arith.subi {it}, {em.index(1)} : index"))
                em.op(f"nvvm.mbarrier.arrive {barrier(1, before)} : !llvm.ptr<3> -> i64")
        return new

    undefined = em.op(f"llvm.mlir.undef : {acc_type}")
    accs = k_tile(em.index(0), [undefined] * reps, first=True)  # scale-d 0: the undefined values are not read
    kt, carried = em.fresh("kt"), [em.fresh("acc") for _ in range(reps)]
    result = em.fresh("accs")
    types = ", ".join([acc_type] * reps)
    with em.region(f"{result}:{reps} = scf.for {kt} = {em.index(1)} to {em.index(k_tiles)} step {em.index(1)} "
                   f"iter_args({', '.join(f'{c} = {a}' for c, a in zip(carried, accs))}) -> ({types}) {{"):
        em.line(f"scf.yield {', '.join(k_tile(kt, carried, first=False))} : {types}")
    hand_over()
    em.line("nvvm.wgmma.wait.group.sync.aligned 0")
    with em.region(f"scf.if {signals} {{"):
        last, _ = stage_and_phase(em.op(f"arith.addi {it0}, {em.index(k_tiles - 1)} : index"))
        em.op(f"nvvm.mbarrier.arrive {barrier(1, last)} : !llvm.ptr<3> -> i64")
    return matmul_wgmma.fragments(ctx, [f"{result}#{r}" for r in range(reps)], acc_type, zero_ix, zero_ix, tm, tn)


@dataclasses.dataclass(frozen=True)
class _ChunkStores:
    """C through shared memory and TMA stores, 128 bytes of each row at a time (32 f32 columns, 64
    16-bit ones). Each consumer has two staging buffers (block_m rows of 128 bytes, 16-byte chunks
    XOR-swizzled by row as the C descriptor's 128-byte swizzle reads them), used in turn: before a
    buffer is written again its last store must have read it (`cp.async.bulk.wait_group.read 1` by the
    thread that issued it, then the consumer's named barrier). The epilogue's conversions happen in
    registers on the way. Writing accumulator fragments this way is free of bank conflicts beyond the
    wavefronts a warp's bytes need (two of f32 pairs, one of 16-bit pairs); the TMA unit then writes
    whole 128-byte rows of C and skips what lies outside it (edge tiles), so no store is masked. Only
    for epilogues without residual (`stores_by_tma`)."""

    tensor_map: str
    base: str  # the staging buffers' shared-memory address (index)
    epilogue: MatmulEpilogue

    def _value(self, ctx: Context, f) -> str:
        """The fragment's pair as C stores it: bias added, conversions applied. The bias loads are
        clamped into the array where tiles cross its end (an edge tile's pairs past N read the last
        one; the TMA store does not write them), so none is masked."""
        em, p, cfg = ctx.em, ctx.problem, ctx.config
        value = em.op(f"vector.from_elements {f.values[0]}, {f.values[1]} : vector<2xf32>")
        e = "f32"
        for step in self.epilogue.steps:
            if step == "bias":
                col = ix_add(em, ctx.n0, f.col[0], f.col[1])
                if p.n % cfg.block_n:  # n is even (rows of C are whole 16-byte units): the last pair starts at n - 2
                    col = em.op(f"arith.minui {col}, {em.index(p.n - 2)} : index")
                value = add_loaded(ctx, step, self.epilogue.bias, col, value, None, 2 * BYTES[self.epilogue.bias])
            else:
                assert step != "residual", "a residual epilogue stores from registers (stores_by_tma)"
                value, e = convert(em, step, value, e)
        return value

    def emit(self, ctx: Context, fragments, consumer: str, signals: str) -> None:
        em, cfg, p = ctx.em, ctx.config, ctx.problem
        chunk, columns = chunk_bytes(cfg), chunk_columns(self.epilogue)
        out = ELEMENT[self.epilogue.out]
        barrier_id = em.op(f"arith.index_cast {ix_add(em, consumer, CONSUMER_BARRIER)} : index to i32")
        mine = ix_add(em, self.base, (consumer, 2 * chunk))
        lane = em.op(f"arith.remui {ctx.tid}, {em.index(32)} : index")
        as_i32 = lambda x: em.op(f"arith.index_cast {x} : index to i32")
        # a fragment of lane l holds columns 2 (l % 4) + {0, 1} (plus a constant k, a multiple of 8) of
        # row l / 4 (mod 8): bytes 2 e (l % 4) + e k of a 128-byte row of e-byte elements, whose 16-byte
        # chunks are swizzled by XOR with the row. In 32-bit shared addresses: the buffers start on 1024
        # bytes and rows are 128 apart, so the lane's part (below 32 bytes) and e k (a multiple of 32, or
        # of 16 for 16-bit C) share no bits and the row's XOR touches only bits 4-6; per fragment one XOR
        # by e k, the rest immediate offsets. The lane's address passes an opaque move: LLVM would
        # otherwise hoist it, and the per-fragment XORs, out of the tile loop, and those registers, live
        # across the main loop beside 192 accumulators, spilled (60 B with 2-3 k-tiles, ptxas)
        elem = BYTES[self.epilogue.out]
        row = fragments[0].row[0]  # the SSA part of every fragment's row (matmul_wgmma.fragments)
        unswizzled = ix_add(em, mine, (row, 128), ix_op(em, "muli", ix_op(em, "remui", lane, 4), 2 * elem))
        lane_at = em.op(f"arith.xori {as_i32(unswizzled)}, "
                        f"{as_i32(ix_op(em, 'muli', ix_op(em, 'divui', lane, 4), 16))} : i32")
        lane_at = em.op(f'llvm.inline_asm has_side_effects "mov.b32 $0, $1;", "=r,r" {lane_at} : (i32) -> i32')

        def address(f, buffer_offset: int, k: int) -> str:
            assert f.row[0] == row, "the fragments of a tile share their row base"
            at = em.op(f"arith.xori {lane_at}, {em.i32(k * elem)} : i32") if k else lane_at
            at = em.op(f"arith.addi {at}, {em.i32(f.row[1] * 128 + buffer_offset)} : i32")
            return em.op(f"llvm.inttoptr {at} : i32 to !llvm.ptr<3>")
        m0, batch = as_i32(ctx.m0), as_i32(ctx.batch)
        for q in range(-(-cfg.block_n // columns)):
            buffer = ix_add(em, mine, (q % 2) * chunk)
            with em.region(f"scf.if {signals} {{"):  # this buffer's previous store has read it
                em.line("nvvm.cp.async.bulk.wait_group 1 {read}")
            em.line(f"nvvm.barrier id = {barrier_id} number_of_threads = {em.i32(128)}")
            for f in fragments:
                k = f.col[1] - q * columns
                if not 0 <= k < columns:
                    continue
                value = self._value(ctx, f)
                at = address(f, (q % 2) * chunk, k)
                em.line(f"llvm.store {value}, {at} {{alignment = {2 * elem} : i64}} : "
                        f"vector<2x{out}>, !llvm.ptr<3>")
            em.line("nvvm.fence.proxy {kind = #nvvm.proxy_kind<async.shared>, space = #nvvm.shared_space<cta>}")
            em.line(f"nvvm.barrier id = {barrier_id} number_of_threads = {em.i32(128)}")
            with em.region(f"scf.if {signals} {{"):
                n0 = as_i32(ix_add(em, ctx.n0, q * columns))
                box = ", ".join([n0, m0, batch] if p.batch > 1 else [n0, m0])
                em.line(f"nvvm.cp.async.bulk.tensor.global.shared.cta {self.tensor_map}, {pointer(em, buffer, '3')}, "
                        f"box[{box}] : !llvm.ptr, !llvm.ptr<3>")
                em.line("nvvm.cp.async.bulk.commit.group")
