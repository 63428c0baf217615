"""Row reductions: one `nova.reduce` over the innermost dims, with the fused ops around it.

The reduced value may be computed from the inputs by elementwise ops (a prologue, evaluated in
registers as the row is read), and the kernel's outputs, all of the row shape, may apply elementwise
ops to the reduction's result (an epilogue, e.g. a mean's division). A team of `team` threads
(a power of two) owns a row: each thread folds groups of `vector` consecutive elements (16-byte loads
where the row length allows), then the team combines its partial values with `gpu.shuffle xor`
butterflies, and, for teams of several warps, through a shared-memory slot per warp and a second
butterfly. Accumulation is in f32 for 16-bit floats, as on the CPU path (`rules_reduce.py`), whose
`reduce_init` and `combine` give the identity and the combining op.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jnova.codegen.gpu.emitter import (GpuEmitter, GpuModule, gpu_module_text, kernel_params, narrow_after_exchange,
                                       scalar_constant, widen_for_exchange)
from jnova.codegen.gpu.evaluate import Evaluator, Point, reads_at_own_offsets, unsupported_op, widest_vector
from jnova.codegen.linalg.emitter import compute_dtype, element
from jnova.errors import LoweringError
from jnova.codegen.linalg.rules_reduce import combine, reduce_init
from jnova.dialect.ops import ReduceOp
from jnova.dialect.types import bitwidth
from jnova.passes.plan import Kernel
from jnova.runtime.target import Target

WARP = 32
MIN_BLOCK = 128  # small teams share a block of at least this many threads (several rows per block)
GROUPS_PER_THREAD = 4  # team size: about this many vector groups of the row per thread


@dataclass(frozen=True)
class RowReductionSchedule:
    rows: int
    cols: int  # elements reduced per row
    vector: int  # elements per load
    team: int  # threads per row
    block: int
    grid: int

    def __str__(self) -> str:
        return (f"row_reduction(rows={self.rows}, cols={self.cols}, vector={self.vector}, team={self.team}, "
                f"block={self.block}, grid={self.grid})")


def row_reduction_refusal(kernel: Kernel) -> str | None:
    """Why `kernel` is not a row reduction, or None."""
    def dims_refusal(reduce: ReduceOp) -> str | None:
        shape, dims = reduce.operands[0].type.shape, tuple(reduce.attrs["dims"])
        sized, reduced = sized_dims(shape, dims)
        if reduced != sized[len(sized) - len(reduced):]:
            return f"it reduces dims {dims} of a rank-{len(shape)} value, not the innermost ones (size-1 dims aside)"
        return None

    return one_reduction_refusal(kernel, dims_refusal, "row")


def sized(shape) -> tuple[int, ...]:
    """The extents of `shape` longer than 1 (shapes equal up to size-1 dims share every flat offset)."""
    return tuple(n for n in shape if n != 1)


def sized_dims(shape, dims) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the dims of `shape` longer than 1, those of them in `dims`). Size-1 dims do not move any
    element's flat offset, so a reduction is a row (column) reduction when its reduced sized dims are
    the innermost (leading) sized dims: [1, T, C] summed over (0, 2) is T rows of C, over (1,) T rows
    of C columns."""
    long = tuple(d for d, n in enumerate(shape) if n != 1)
    return long, tuple(d for d in long if d in dims)


def one_reduction_refusal(kernel: Kernel, dims_refusal, shape_name: str) -> str | None:
    """What both reduction kernels require: one `nova.reduce` whose dims `dims_refusal` accepts, every
    output of its result's (`shape_name`) shape, and every other op computable in registers."""
    reduces = [op for op in kernel.ops if isinstance(op, ReduceOp)]
    if len(reduces) != 1:
        return f"it has {len(reduces)} reductions, expected 1"
    (reduce,) = reduces
    reason = dims_refusal(reduce)
    if reason:
        return reason
    shape = reduce.results[0].type.shape
    for v in kernel.outputs:
        if sized(v.type.shape) != sized(shape):
            return f"output {v.type} does not have the {shape_name} shape {shape} (size-1 dims aside)"
    for op in kernel.ops:
        reason = None if op is reduce else unsupported_op(op)
        if reason:
            return reason
    return None


def the_reduce(kernel: Kernel) -> ReduceOp:
    return next(op for op in kernel.ops if isinstance(op, ReduceOp))


def choose_row_reduction_schedule(kernel: Kernel, target: Target) -> RowReductionSchedule:
    reduce = the_reduce(kernel)
    x, row = reduce.operands[0].type, reduce.results[0].type
    cols = math.prod(x.shape[d] for d in reduce.attrs["dims"])
    # vector groups never cross rows: they divide the row, and the last dim too unless every read is
    # at the reduced value's own offsets (a row of size-1 dims only lies across a longer kept last dim)
    own_offsets = reads_at_own_offsets(op for op in kernel.ops if op is not reduce)
    vector = widest_vector([v.type for v in kernel.inputs], cols if own_offsets else math.gcd(cols, x.shape[-1]))
    groups = cols // vector
    team = min(target.max_threads_per_block, 1 << max(0, math.ceil(math.log2(max(1, groups / GROUPS_PER_THREAD)))))
    block = max(team, MIN_BLOCK)
    grid = max(1, math.ceil(row.size / (block // team)))
    return RowReductionSchedule(row.size, cols, vector, team, block, grid)


def build_row_reduction(kernel: Kernel, target: Target) -> GpuModule:
    reason = row_reduction_refusal(kernel)
    if reason:
        raise LoweringError(f"{kernel.name} is not a row reduction: {reason}")
    sched = choose_row_reduction_schedule(kernel, target)
    reduce = the_reduce(kernel)
    kind, x = reduce.attrs["kind"], reduce.operands[0]
    acc_dtype = compute_dtype(x.type.dtype)
    params, memrefs, outs = kernel_params(kernel.inputs, kernel.outputs)
    em = GpuEmitter()
    s = em.scalar()
    init = scalar_constant(s, reduce_init(kind, acc_dtype), acc_dtype)

    bid, tid = em.op("gpu.block_id x"), em.op("gpu.thread_id x")
    rows_per_block = sched.block // sched.team
    team_lane = tid if rows_per_block == 1 else em.op(f"arith.remui {tid}, {em.index(sched.team)} : index")
    row = bid
    if rows_per_block > 1:
        team = em.op(f"arith.divui {tid}, {em.index(sched.team)} : index")
        row = em.op(f"arith.addi {em.op(f'arith.muli {bid}, {em.index(rows_per_block)} : index')}, {team} : index")
    valid = em.op(f"arith.cmpi ult, {row}, {em.index(sched.rows)} : index")
    groups = em.op(f"arith.select {valid}, {em.index(sched.cols // sched.vector)}, {em.index(0)} : index")

    # 1. each thread folds its groups of the row (an invalid row has none)
    acc, a, k, e = em.fresh("acc"), em.fresh("a"), em.fresh("k"), element(acc_dtype)
    with em.region(f"{acc} = scf.for {k} = {team_lane} to {groups} step {em.index(sched.team)} "
                   f"iter_args({a} = {init}) -> ({e}) {{"):
        column = em.op(f"arith.muli {k}, {em.index(sched.vector)} : index")
        start = em.op(f"arith.addi {em.op(f'arith.muli {row}, {em.index(sched.cols)} : index')}, {column} : index")
        values = Evaluator(em, memrefs).lanes(x, Point(x.type.shape, sched.vector, True, flat=start))
        s = em.scalar()
        values = [s.cast(v, x.type.dtype, acc_dtype) for v in values]
        while len(values) > 1:  # a tree over the lanes, then into the running value
            values = [combine(s, kind, acc_dtype, *values[i:i + 2]) if i + 1 < len(values) else values[i]
                      for i in range(0, len(values), 2)]
        em.line(f"scf.yield {combine(s, kind, acc_dtype, a, values[0])} : {e}")

    # 2. the team combines its threads' values
    acc = _butterfly(em, kind, acc_dtype, acc, min(sched.team, WARP))
    workgroup = []
    if sched.team > WARP:
        acc, workgroup = _across_warps(em, kind, acc_dtype, acc, tid, sched)

    # 3. the team's first thread applies the epilogue and stores the row's outputs
    leader = em.op(f"arith.cmpi eq, {team_lane}, {em.index(0)} : index")
    with em.region(f"scf.if {em.op(f'arith.andi {valid}, {leader} : i1')} {{"):
        result = em.scalar().cast(acc, acc_dtype, reduce.results[0].type.dtype)
        evaluator = Evaluator(em, memrefs, pinned={reduce.results[0]: result})
        for v, mem in zip(kernel.outputs, outs):  # each output at the row's offset in its own shape
            evaluator.store(v, mem, Point(v.type.shape, 1, True, flat=row))
    text = gpu_module_text(kernel.name, target, params, em.lines, sched.block, workgroup)
    return GpuModule(kernel.name, text, (sched.grid, 1, 1), (sched.block, 1, 1), 0, str(sched))


def _shuffle_xor(em: GpuEmitter, x: str, dtype: str, offset: int) -> str:
    s = em.scalar()
    wide, wide_type = widen_for_exchange(s, x, dtype)
    shuffled = em.fresh("shfl")
    em.line(f"{shuffled}, {em.fresh('ok')} = gpu.shuffle xor {wide}, {em.i32(offset)}, {em.i32(WARP)} : {wide_type}")
    return narrow_after_exchange(s, shuffled, dtype)


def _butterfly(em: GpuEmitter, kind: str, dtype: str, acc: str, lanes: int) -> str:
    """Combine `acc` over aligned groups of `lanes` lanes of a warp; every lane ends with the result."""
    offset = lanes // 2
    while offset:
        acc = combine(em.scalar(), kind, dtype, acc, _shuffle_xor(em, acc, dtype, offset))
        offset //= 2
    return acc


def _across_warps(em: GpuEmitter, kind: str, dtype: str, acc: str, tid: str,
                  sched) -> tuple[str, list[str]]:
    """Teams of several warps: each warp's lane 0 writes its value to shared memory, then lane l of
    every warp of the team reads the value of the team's warp l mod (warps per team) and a second
    butterfly over that many lanes combines them: every thread of the team ends with the result."""
    warps = sched.team // WARP
    slot_type = "i32" if dtype == "bool" or bitwidth(dtype) < 32 else element(dtype)
    partials = em.fresh("partials")
    buffer = f"memref<{sched.block // WARP}x{slot_type}, #gpu.address_space<workgroup>>"
    lane = em.op(f"arith.remui {tid}, {em.index(WARP)} : index")
    warp = em.op(f"arith.divui {tid}, {em.index(WARP)} : index")
    with em.region(f"scf.if {em.op(f'arith.cmpi eq, {lane}, {em.index(0)} : index')} {{"):
        em.line(f"memref.store {widen_for_exchange(em.scalar(), acc, dtype)[0]}, {partials}[{warp}] : {buffer}")
    em.line("gpu.barrier")
    first_warp = em.op(f"arith.muli {em.op(f'arith.divui {tid}, {em.index(sched.team)} : index')}, "
                       f"{em.index(warps)} : index")
    slot = em.op(f"arith.addi {first_warp}, {em.op(f'arith.remui {lane}, {em.index(warps)} : index')} : index")
    value = narrow_after_exchange(em.scalar(), em.op(f"memref.load {partials}[{slot}] : {buffer}"), dtype)
    return _butterfly(em, kind, dtype, value, warps), [f"{partials} : {buffer}"]
