"""Column reductions: one `nova.reduce` over the leading dims, with the fused ops around it.

The reduced value `x` is viewed as `rows` x `cols` (the reduced dims, then the kept ones, size-1 dims
anywhere; e.g. a bias gradient sums a [B, T, N] value over (0, 1): B*T rows of N columns). As in the
row builder (`reduction.py`), a prologue of elementwise ops is evaluated in registers as `x` is read, and the
kernel's outputs, all of the kept shape, apply an epilogue to the reduction's result.

Schedule: a block owns a tile of `col_threads` vector groups of columns (`vector` consecutive
columns each, 16-byte loads where the column count allows) and reads ALL rows of it. Its threads are
2-D: `tid = row_lane * col_threads + column thread`, so a warp's loads are `32 / col_threads` rows of
contiguous column segments of at least 32 bytes. Each thread folds every `row_lanes`-th row of its
group into `vector` registers; the threads then write their partial values to shared memory and, after
one barrier, the last row lane of each group folds the group's `row_lanes` partials in row-lane order
and applies the epilogue. Columns are split over as many blocks as keep segments >= 32 bytes, up to
`COLUMN_BLOCKS_PER_SM` blocks per SM; a reduction into fewer columns than that is split over its rows
first (`passes/split_reductions.py`). No atomics: every output element is written once, by one thread, so the outputs
need no initialisation. Accumulation is in f32 for 16-bit floats and max/min propagate NaN, as on the
CPU path (`rules_reduce.py`'s `reduce_init` and `combine`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jnova.codegen.gpu.emitter import (GpuEmitter, GpuModule, gpu_module_text, kernel_params, narrow_after_exchange,
                                       scalar_constant, widen_for_exchange)
from jnova.codegen.gpu.evaluate import Evaluator, Point, reads_at_own_offsets, widest_vector
from jnova.codegen.gpu.reduction import one_reduction_refusal, sized_dims, the_reduce
from jnova.codegen.linalg.emitter import compute_dtype, element
from jnova.errors import LoweringError
from jnova.codegen.linalg.rules_reduce import combine, reduce_init
from jnova.dialect.ops import ReduceOp
from jnova.dialect.types import bitwidth, itemsize
from jnova.passes.configure.reduction_split import COLUMN_BLOCKS_PER_SM
from jnova.passes.plan import Kernel
from jnova.runtime.target import Target

BLOCK = 256  # threads per block
MAX_COL_THREADS = 32  # a warp along the columns when there are enough column groups for every SM
MIN_SEGMENT_BYTES = 32  # a warp reads whole 32-byte sectors of each row
# Rows a thread reads per trip of its fold before folding them. One at a time, a column kernel of 4
# rows a thread (GPT-2's bias-gradient partials, [512, 12288] bf16) waited out four DRAM latencies and
# streamed 0.64 TB/s on the H200 (19.6 us, 49 launches a step). Reading 4 a trip (`rows_in_flight=4`,
# the same sums in the same order) is built and checked on the CPU but not yet measured on a GPU: the
# schedule keeps 1 until it is.
ROWS_IN_FLIGHT = 1


@dataclass(frozen=True)
class ColumnReductionSchedule:
    rows: int  # elements reduced per column
    cols: int  # columns (the kept elements)
    vector: int  # columns per load
    col_threads: int  # threads of a block along the columns (one vector group each)
    row_lanes: int  # threads of a block along the rows
    grid: int
    rows_in_flight: int = 1  # rows a thread reads per trip of its fold (at most the rows it has)

    @property
    def block(self) -> int:
        return self.col_threads * self.row_lanes

    def __str__(self) -> str:
        ahead = f", rows_in_flight={self.rows_in_flight}" if self.rows_in_flight > 1 else ""
        return (f"column_reduction(rows={self.rows}, cols={self.cols}, vector={self.vector}, "
                f"col_threads={self.col_threads}, row_lanes={self.row_lanes}, block={self.block}, grid={self.grid}"
                f"{ahead})")


def column_reduction_refusal(kernel: Kernel) -> str | None:
    """Why `kernel` is not a column reduction, or None."""
    def dims_refusal(reduce: ReduceOp) -> str | None:
        shape, dims = reduce.operands[0].type.shape, tuple(reduce.attrs["dims"])
        sized, reduced = sized_dims(shape, dims)
        if not reduced or reduced != sized[:len(reduced)] or len(reduced) == len(sized):
            return (f"it reduces dims {dims} of a rank-{len(shape)} value, not a proper prefix of them "
                    f"(size-1 dims aside)")
        if reduce.operands[0].type.dtype == "bool":  # ptxas spills the loop-carried predicates (any_3d, 4 lanes)
            return "it reduces bools (not supported yet: their accumulators spill)"
        return None

    return one_reduction_refusal(kernel, dims_refusal, "kept")


def choose_column_reduction_schedule(kernel: Kernel, target: Target) -> ColumnReductionSchedule:
    reduce = the_reduce(kernel)
    x = reduce.operands[0].type
    rows = math.prod(x.shape[d] for d in reduce.attrs["dims"])  # leading, size-1 dims aside
    cols = x.size // rows
    # vector groups never cross a row of `x`; they stay within its last dim unless every read is at
    # the reduced value's own offsets
    own_offsets = reads_at_own_offsets(op for op in kernel.ops if op is not reduce)
    types = [v.type for v in kernel.inputs]
    vector = widest_vector(types, cols if own_offsets else x.shape[-1])
    groups = cols // vector
    group_bytes = vector * max((itemsize(t.dtype) for t in types), default=4)
    min_col_threads = max(1, MIN_SEGMENT_BYTES // group_bytes)
    col_threads = MAX_COL_THREADS
    while col_threads > min_col_threads and math.ceil(groups / col_threads) < COLUMN_BLOCKS_PER_SM * target.sm_count:
        col_threads //= 2
    while col_threads > 1 and col_threads // 2 >= groups:  # no block of idle column threads
        col_threads //= 2
    row_lanes = BLOCK // col_threads
    return ColumnReductionSchedule(rows, cols, vector, col_threads, row_lanes, math.ceil(groups / col_threads),
                                   max(1, min(ROWS_IN_FLIGHT, math.ceil(rows / row_lanes))))


def build_column_reduction(kernel: Kernel, target: Target,
                           sched: ColumnReductionSchedule | None = None) -> GpuModule:
    """The kernel's gpu.module, with `sched` (default: `choose_column_reduction_schedule`)."""
    reason = column_reduction_refusal(kernel)
    if reason:
        raise LoweringError(f"{kernel.name} is not a column reduction: {reason}")
    sched = sched or choose_column_reduction_schedule(kernel, target)
    params, memrefs, outs = kernel_params(kernel.inputs, kernel.outputs)
    em = GpuEmitter()
    bid, tid = em.op("gpu.block_id x"), em.op("gpu.thread_id x")
    partials = em.fresh("partials")
    column_reduction_body(em, kernel, memrefs, outs, bid, tid, sched, partials)
    text = gpu_module_text(kernel.name, target, params, em.lines, sched.block, [partials_buffer(kernel, sched, partials)])
    return GpuModule(kernel.name, text, (sched.grid, 1, 1), (sched.block, 1, 1), 0, str(sched))


def partials_buffer(kernel: Kernel, sched: ColumnReductionSchedule, name: str) -> str:
    """The workgroup buffer of the block's partial values (`name : memref<...>`)."""
    return f"{name} : {_buffer_type(kernel, sched.block * sched.vector)}"


def partials_slot_type(kernel: Kernel) -> str:
    acc_dtype = compute_dtype(the_reduce(kernel).operands[0].type.dtype)
    return "i32" if acc_dtype == "bool" or bitwidth(acc_dtype) < 32 else element(acc_dtype)


def _buffer_type(kernel: Kernel, slots: int) -> str:
    return f"memref<{slots}x{partials_slot_type(kernel)}, #gpu.address_space<workgroup>>"


def column_reduction_body(em: GpuEmitter, kernel: Kernel, memrefs: dict, outs: list[str], bid: str, tid: str,
                          sched: ColumnReductionSchedule, partials: str, slots: int | None = None) -> None:
    """Block `bid` of the column reduction (`partials`: a workgroup buffer of at least block * vector
    slots, `slots` of them; several reductions launched as one share it, see `batched.py`)."""
    reduce = the_reduce(kernel)
    kind, x = reduce.attrs["kind"], reduce.operands[0]
    acc_dtype = compute_dtype(x.type.dtype)
    init = scalar_constant(em.scalar(), reduce_init(kind, acc_dtype), acc_dtype)
    column_thread = em.op(f"arith.remui {tid}, {em.index(sched.col_threads)} : index")
    row_lane = em.op(f"arith.divui {tid}, {em.index(sched.col_threads)} : index")
    group = em.op(f"arith.addi {em.op(f'arith.muli {bid}, {em.index(sched.col_threads)} : index')}, "
                  f"{column_thread} : index")
    valid = em.op(f"arith.cmpi ult, {group}, {em.index(sched.cols // sched.vector)} : index")
    column = em.op(f"arith.muli {group}, {em.index(sched.vector)} : index")
    rows = em.op(f"arith.select {valid}, {em.index(sched.rows)}, {em.index(0)} : index")

    # 1. each thread folds its rows of its column group (an invalid group has none)
    accs = _fold_rows(em, kind, acc_dtype, x, memrefs, init, row_lane, rows, column, sched)
    # 2. partials to shared memory; the group's last row lane folds them in row-lane order
    buffer = _buffer_type(kernel, slots or sched.block * sched.vector)
    accs = _across_row_lanes(em, kind, acc_dtype, accs, init, tid, column_thread, sched, partials, buffer)
    # 3. ... and applies the epilogue and stores the group's outputs
    last = em.op(f"arith.cmpi eq, {row_lane}, {em.index(sched.row_lanes - 1)} : index")
    with em.region(f"scf.if {em.op(f'arith.andi {valid}, {last} : i1')} {{"):
        result_type = reduce.results[0].type
        for lane, acc in enumerate(accs):
            result = em.scalar().cast(acc, acc_dtype, result_type.dtype)
            evaluator = Evaluator(em, memrefs, pinned={reduce.results[0]: result})
            offset = column if lane == 0 else em.op(f"arith.addi {column}, {em.index(lane)} : index")
            for v, mem in zip(kernel.outputs, outs):
                evaluator.store(v, mem, Point(v.type.shape, 1, True, flat=offset))


def _fold_rows(em: GpuEmitter, kind: str, dtype: str, x, memrefs, init: str, row_lane: str, rows: str,
               column: str, sched: ColumnReductionSchedule) -> list[str]:
    """`vector` registers: this thread's rows (`row_lane`, `row_lane + row_lanes`, ...) of its columns,
    folded in that order, `sched.rows_in_flight` rows a trip: their loads do not wait for each other's
    folds (a row past the end is read at the last row and not folded)."""
    n = sched.vector
    ahead = sched.rows_in_flight
    wide_init, e = widen_for_exchange(em.scalar(), init, dtype)
    accs, args, r = [em.fresh("acc") for _ in range(n)], [em.fresh("a") for _ in range(n)], em.fresh("r")
    inits = ", ".join(f"{a} = {wide_init}" for a in args)
    last_row = em.op(f"arith.subi {rows}, {em.index(1)} : index") if ahead > 1 else None
    with em.region(f"{', '.join(accs)} = scf.for {r} = {row_lane} to {rows} step {em.index(sched.row_lanes * ahead)} "
                   f"iter_args({inits}) -> ({', '.join([e] * n)}) {{"):
        s = em.scalar()
        reads = []
        for k in range(ahead):
            row = r if k == 0 else em.op(f"arith.addi {r}, {em.index(k * sched.row_lanes)} : index")
            inside = em.op(f"arith.cmpi ult, {row}, {rows} : index") if k else None
            at = row if k == 0 else em.op(f"arith.minui {row}, {last_row} : index")
            start = em.op(f"arith.addi {em.op(f'arith.muli {at}, {em.index(sched.cols)} : index')}, {column} : index")
            values = Evaluator(em, memrefs).lanes(x, Point(x.type.shape, n, True, flat=start))
            reads.append((inside, values))
        folded = [narrow_after_exchange(s, a, dtype) for a in args]
        for inside, values in reads:
            new = [combine(s, kind, dtype, f, s.cast(v, x.type.dtype, dtype)) for f, v in zip(folded, values)]
            if inside is not None:
                t = element(dtype)
                new = [em.op(f"arith.select {inside}, {a}, {b} : {t}") for a, b in zip(new, folded)]
            folded = new
        em.line(f"scf.yield {', '.join(widen_for_exchange(s, f, dtype)[0] for f in folded)} : {', '.join([e] * n)}")
    return [narrow_after_exchange(em.scalar(), a, dtype) for a in accs]


def _across_row_lanes(em: GpuEmitter, kind: str, dtype: str, accs: list[str], init: str, tid: str,
                      column_thread: str, sched: ColumnReductionSchedule, partials: str, buffer: str) -> list[str]:
    """Every thread stores its partials at slot `tid * vector + lane`; after a barrier each thread
    folds its column group's slots over the row lanes (only the last row lane's result is used: it is
    the thread that runs last when the kernel is emulated one thread after another)."""
    n = sched.vector
    wide_init, slot_type = widen_for_exchange(em.scalar(), init, dtype)
    base = em.op(f"arith.muli {tid}, {em.index(n)} : index")
    for lane, acc in enumerate(accs):
        slot = base if lane == 0 else em.op(f"arith.addi {base}, {em.index(lane)} : index")
        em.line(f"memref.store {widen_for_exchange(em.scalar(), acc, dtype)[0]}, {partials}[{slot}] : {buffer}")
    em.line("gpu.barrier")
    out, args, r = [em.fresh("sum") for _ in range(n)], [em.fresh("a") for _ in range(n)], em.fresh("lane")
    inits = ", ".join(f"{a} = {wide_init}" for a in args)
    with em.region(f"{', '.join(out)} = scf.for {r} = {em.index(0)} to {em.index(sched.row_lanes)} "
                   f"step {em.index(1)} iter_args({inits}) -> ({', '.join([slot_type] * n)}) {{"):
        thread = em.op(f"arith.addi {em.op(f'arith.muli {r}, {em.index(sched.col_threads)} : index')}, "
                       f"{column_thread} : index")
        first = em.op(f"arith.muli {thread}, {em.index(n)} : index")
        s, folded = em.scalar(), []
        for lane, a in enumerate(args):
            slot = first if lane == 0 else em.op(f"arith.addi {first}, {em.index(lane)} : index")
            value = narrow_after_exchange(s, em.op(f"memref.load {partials}[{slot}] : {buffer}"), dtype)
            folded.append(combine(s, kind, dtype, narrow_after_exchange(s, a, dtype), value))
        em.line(f"scf.yield {', '.join(widen_for_exchange(s, f, dtype)[0] for f in folded)} : "
                f"{', '.join([slot_type] * n)}")
    return [narrow_after_exchange(em.scalar(), a, dtype) for a in out]
