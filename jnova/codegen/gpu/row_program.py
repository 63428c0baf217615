"""Row programs: several row reductions and the elementwise work between them, a row per team.

A softmax is max, exp(x - max), sum, divide; a LayerNorm is mean, the variance, then the normalized
row scaled and shifted. Each step reads a row statistic broadcast back along the row, which a fusion
group may not do (it would recompute the statistic at every element), so they were five and eight
kernels, each passing the whole array through memory. Here one team of threads owns a row: each
thread evaluates its slots of the row (`slots` groups of `vector` elements, fixed per thread, in
registers), the reductions run one after another (a fold over the thread's slots, then the team's
butterflies as in `reduction.py`), and each reduction's result is pinned for the rest of the program:
a broadcast of it along the row reads the team's register. Values are computed once per slot and
kept (the Evaluator's memo spans the whole straight-line program), so a row is read from memory once
and each output written once.

What may read a row statistic (or anything computed from one) is restricted so it is always this
row's: elementwise ops, reshapes that only add or drop size-1 dims, another of the program's
reductions, and broadcasts that map the statistic's dims onto the row dims of a full-row value
(`row_program_refusal`). A team of more than a warp combines through shared memory (a buffer per
reduction); threads of a row past the last (or slots past the row's end) compute on clamped indices
so every thread reaches every barrier, and do not store.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jnova.codegen.gpu.emitter import GpuEmitter, GpuModule, gpu_module_text, kernel_params, scalar_constant
from jnova.codegen.gpu.evaluate import Evaluator, Point, reads_at_own_offsets, unsupported_op, widest_vector
from jnova.codegen.gpu.reduction import MIN_BLOCK, WARP, _across_warps, _butterfly, sized, sized_dims
from jnova.codegen.linalg.emitter import compute_dtype, element
from jnova.errors import LoweringError
from jnova.codegen.linalg.rules_reduce import combine, reduce_init
from jnova.dialect.ops import BroadcastOp, ConvertOp, ElementwiseOp, ReduceOp, ReshapeOp, SelectOp
from jnova.passes.plan import Kernel
from jnova.runtime.target import Target

MAX_SLOTS = 8  # vector groups a thread holds per value: 32 f32 registers at 16-byte vectors
MAX_TEAM = 1024  # threads per block on every target


@dataclass(frozen=True)
class RowProgramSchedule:
    rows: int
    cols: int  # elements per row
    vector: int  # elements per slot
    team: int  # threads per row (a power of two)
    slots: int  # slots per thread: slot j of lane l is the row's group l + j * team
    block: int
    grid: int

    def __str__(self) -> str:
        return (f"row_program(rows={self.rows}, cols={self.cols}, vector={self.vector}, team={self.team}, "
                f"slots={self.slots}, block={self.block}, grid={self.grid})")


@dataclass(frozen=True)
class RowSplit:
    row: tuple[int, ...]  # the sized extents of a row statistic
    full: tuple[int, ...]  # the sized extents of a whole-row value: row dims, then the reduced ones


def row_reductions(kernel: Kernel) -> list[ReduceOp]:
    return [op for op in kernel.ops if isinstance(op, ReduceOp)]


def row_split(kernel: Kernel) -> RowSplit | str:
    """The rows the kernel's reductions share, or why they share none."""
    reduces = row_reductions(kernel)
    if not reduces:
        return "it has no reduction"
    splits = set()
    for r in reduces:
        shape = r.operands[0].type.shape
        long, reduced = sized_dims(shape, tuple(r.attrs["dims"]))
        if not reduced or reduced != long[len(long) - len(reduced):]:
            return f"a reduction over dims {tuple(r.attrs['dims'])} of {shape} is not over the innermost sized dims"
        splits.add(RowSplit(sized(shape)[:len(long) - len(reduced)], sized(shape)))
    if len(splits) != 1:
        return f"its reductions have different rows {sorted((s.row, s.full) for s in splits)}"
    return splits.pop()


def row_program_refusal(kernel: Kernel) -> str | None:
    """Why `kernel` is not a row program, or None."""
    split = row_split(kernel)
    if isinstance(split, str):
        return split
    reduces = set(row_reductions(kernel))
    for op in kernel.ops:
        reason = None if op in reduces else unsupported_op(op)
        if reason:
            return reason
    # values computed from a statistic: each element must read its own row's
    dependent = {r.results[0] for r in reduces}
    for op in kernel.ops:
        if op in reduces or not any(x in dependent for x in op.operands):
            continue
        reason = _row_read_refusal(op, split)
        if reason:
            return reason
        dependent.update(op.results)
    for v in kernel.outputs:
        if sized(v.type.shape) not in (split.row, split.full):
            return f"output {v.type} is neither a row statistic {split.row} nor a whole row {split.full}"
    cols = math.prod(split.full[len(split.row):])
    if math.ceil(cols / _vector(kernel, split)) > MAX_SLOTS * MAX_TEAM:
        return f"rows of {cols} elements do not fit a team's registers"
    return None


def _row_read_refusal(op, split: RowSplit) -> str | None:
    """Why `op`, reading a value computed from a row statistic, might read another row's."""
    out = op.results[0].type
    if isinstance(op, (ElementwiseOp, SelectOp, ConvertOp)):
        if any(x.type.shape != out.shape and x.type.size != 1 for x in op.operands):
            return f"'{op.name}' mixes shapes"
        return None
    if isinstance(op, ReshapeOp):
        x = op.operands[0].type
        return None if sized(x.shape) == sized(out.shape) else f"a reshape {x.shape} -> {out.shape} moves a row statistic"
    if isinstance(op, BroadcastOp):
        x, dims = op.operands[0].type, op.attrs["dims"]
        mapped = [dims[i] for i, n in enumerate(x.shape) if n != 1]
        out_sized = [d for d, n in enumerate(out.shape) if n != 1]
        if sized(x.shape) == split.row and sized(out.shape) == split.full:
            target = out_sized[:len(split.row)]
        elif sized(x.shape) == sized(out.shape):
            target = out_sized
        else:
            return f"a broadcast {x.shape} -> {out.shape} of a row statistic"
        return None if mapped == target else f"a broadcast {x.shape} -> {out.shape} along dims {dims} reads other rows"
    return f"'{op.name}' reads a row statistic at another row"


def _vector(kernel: Kernel, split: RowSplit) -> int:
    """16 bytes of the widest array, within a row; within the innermost dim too where an op's lanes
    must stay in it (broadcasts, iota, data movement)."""
    cols = math.prod(split.full[len(split.row):])
    reduces = set(row_reductions(kernel))
    inner = cols if reads_at_own_offsets(op for op in kernel.ops if op not in reduces) else math.gcd(cols, split.full[-1])
    return widest_vector([v.type for v in kernel.inputs + kernel.outputs], inner)


def choose_row_program_schedule(kernel: Kernel, target: Target, team: int | None = None) -> RowProgramSchedule:
    """The smallest power-of-two team holding the row in at most `MAX_SLOTS` slots per thread
    (`team` overrides it: the tests run teams of one thread on the CPU)."""
    split = row_split(kernel)
    rows, cols = math.prod(split.row), math.prod(split.full[len(split.row):])
    vector = _vector(kernel, split)
    groups = cols // vector
    if team is None:
        team = min(target.max_threads_per_block, MAX_TEAM, 1 << max(0, math.ceil(math.log2(math.ceil(groups / MAX_SLOTS)))))
    slots = math.ceil(groups / team)
    if slots > MAX_SLOTS and team >= target.max_threads_per_block:
        raise LoweringError(f"{kernel.name}: rows of {cols} elements do not fit a team's registers")
    block = max(team, MIN_BLOCK)
    return RowProgramSchedule(rows, cols, vector, team, slots, block, max(1, math.ceil(rows / (block // team))))


def build_row_program(kernel: Kernel, target: Target, team: int | None = None) -> GpuModule:
    reason = row_program_refusal(kernel)
    if reason:
        raise LoweringError(f"{kernel.name} is not a row program: {reason}")
    sched = choose_row_program_schedule(kernel, target, team)
    params, memrefs, outs = kernel_params(kernel.inputs, kernel.outputs)
    em = GpuEmitter()
    groups = sched.cols // sched.vector

    tid = em.op("gpu.thread_id x")
    rows_per_block = sched.block // sched.team
    lane = tid if rows_per_block == 1 else em.op(f"arith.remui {tid}, {em.index(sched.team)} : index")
    row = em.op("gpu.block_id x")
    if rows_per_block > 1:
        row = em.op(f"arith.addi {em.op(f'arith.muli {row}, {em.index(rows_per_block)} : index')}, "
                    f"{em.op(f'arith.divui {tid}, {em.index(sched.team)} : index')} : index")
    valid = em.op(f"arith.cmpi ult, {row}, {em.index(sched.rows)} : index")
    row = em.op(f"arith.select {valid}, {row}, {em.index(sched.rows - 1)} : index")  # past the last: the last
    base = em.op(f"arith.muli {row}, {em.index(sched.cols)} : index")

    in_row, starts = [], []  # per slot: whether it lies in the row (None: always), its first element
    for j in range(sched.slots):
        g = em.op(f"arith.addi {lane}, {em.index(j * sched.team)} : index") if j else lane
        inside = None
        if (j + 1) * sched.team > groups:  # the row ends inside this slot's range of lanes
            inside = em.op(f"arith.cmpi ult, {g}, {em.index(groups)} : index")
            g = em.op(f"arith.select {inside}, {g}, {em.index(groups - 1)} : index")
        in_row.append(inside)
        starts.append(em.op(f"arith.addi {base}, {em.op(f'arith.muli {g}, {em.index(sched.vector)} : index')} : index"))
    points: dict[tuple, Point] = {}  # one Point per (shape, slot): the memo keys values by point

    def at(shape, j) -> Point:
        if (shape, j) not in points:
            points[shape, j] = Point(shape, sched.vector, True, flat=starts[j])
        return points[shape, j]

    ev = Evaluator(em, memrefs, pinned={})
    workgroup = []
    for r in row_reductions(kernel):  # in program order: a later one may read an earlier one's result
        kind, x = r.attrs["kind"], r.operands[0]
        acc_dtype = compute_dtype(x.type.dtype)
        init = scalar_constant(em.scalar(), reduce_init(kind, acc_dtype), acc_dtype)
        acc = init
        for j in range(sched.slots):
            s = em.scalar()
            values = [s.cast(v, x.type.dtype, acc_dtype) for v in ev.lanes(x, at(x.type.shape, j))]
            while len(values) > 1:
                values = [combine(s, kind, acc_dtype, *values[i:i + 2]) if i + 1 < len(values) else values[i]
                          for i in range(0, len(values), 2)]
            part = values[0]
            if in_row[j] is not None:
                part = em.op(f"arith.select {in_row[j]}, {part}, {init} : {element(acc_dtype)}")
            acc = combine(em.scalar(), kind, acc_dtype, acc, part)
        acc = _butterfly(em, kind, acc_dtype, acc, min(sched.team, WARP))
        if sched.team > WARP:
            acc, buffers = _across_warps(em, kind, acc_dtype, acc, tid, sched)
            workgroup += buffers
        ev.pinned[r.results[0]] = em.scalar().cast(acc, acc_dtype, r.results[0].type.dtype)

    split = row_split(kernel)
    stores = []
    for v, mem in zip(kernel.outputs, outs):
        if sized(v.type.shape) == split.full and split.full != split.row:
            for j in range(sched.slots):
                p = at(v.type.shape, j)
                ev.lanes(v, p)  # computed here, outside the branch: later slots reuse the registers
                stores.append((v, mem, p, in_row[j]))
        else:  # a row statistic: the team's first thread stores it
            p = Point(v.type.shape, 1, True, flat=row)
            ev.lanes(v, p)
            stores.append((v, mem, p, "leader"))
    leader = em.op(f"arith.cmpi eq, {lane}, {em.index(0)} : index")
    for v, mem, p, inside in stores:
        cond = valid if inside is None else em.op(f"arith.andi {valid}, {leader if inside == 'leader' else inside} : i1")
        with em.region(f"scf.if {cond} {{"):
            ev.store(v, mem, p)
    text = gpu_module_text(kernel.name, target, params, em.lines, sched.block, workgroup)
    return GpuModule(kernel.name, text, (sched.grid, 1, 1), (sched.block, 1, 1), 0, str(sched))

