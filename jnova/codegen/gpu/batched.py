"""Batched kernels: independent kernels launched as one (horizontal fusion).

An optimizer updates each parameter leaf in a kernel of its own: an elementwise kernel for a weight
matrix, the epilogue of the gradient's column reduction for a bias or a normalization's scale (GPT-2
124M: 50 and 98 of them). `form_kernels.batch_terminal_kernels` gathers such kernels, whose results only
the step returns, into one `BatchedKernel`; this builder gives each segment a contiguous range of the
grid's blocks with the schedule it would have had alone (`elementwise.choose_elementwise_schedule`,
`column_reduction.choose_column_reduction_schedule`; both use blocks of 256 threads): block `b` runs
segment `i` when `b - first_i < blocks_i` (one unsigned comparison per segment, uniform across the
block, so a column reduction's barrier is reached by the whole block). Column reductions share one
shared-memory buffer per slot type (a block runs one segment). The kernel's parameters are every
segment's inputs (each once) and outputs. Segments that would be the same code but for their arrays
share one body: block `b` of such a class runs member `b // blocks`, whose arrays `arith.select`s pick.
"""
from __future__ import annotations

from jnova.codegen.gpu import column_reduction as column
from jnova.codegen.gpu.elementwise import (BLOCK, build_elementwise, choose_elementwise_schedule, elementwise_refusal,
                                          grid_stride_outputs)
from jnova.codegen.gpu.emitter import GpuEmitter, GpuModule, flat_memref, gpu_module_text, kernel_params
from jnova.errors import LoweringError
from jnova.passes.plan import Kernel
from jnova.runtime.target import Target

assert column.BLOCK == BLOCK, "segments of both families share the launch's block size"
# segments per shared body: with three or more, ptxas (CUDA 13.0, sm_90a) spills a register in two of
# GPT-2 124M's batches (a 4-byte spill at 48 registers); with two it does not (tests/test_gpu_aot.py)
MAX_SHARED = 2


def batched_refusal(kernel: Kernel) -> str | None:
    """Why `kernel` is not a batch of elementwise kernels and column reductions, or None."""
    segments = getattr(kernel, "segments", None)
    if not segments:
        return "it is not a batch of independent kernels"
    for s in segments:
        reason = elementwise_refusal(s)
        if reason and column.column_reduction_refusal(s):
            return f"segment {s.name}: {reason}"
    return None


def build_batched(kernel: Kernel, target: Target) -> GpuModule:
    reason = batched_refusal(kernel)
    if reason:
        raise LoweringError(f"{kernel.name} is not a batch of elementwise kernels and column reductions: {reason}")
    params, memrefs, outs = kernel_params(kernel.inputs, kernel.outputs)
    mem_of = {**memrefs, **dict(zip(kernel.outputs, outs))}
    em = GpuEmitter()
    bid, tid = em.op("gpu.block_id x"), em.op("gpu.thread_id x")
    classes = _classes(kernel.segments, target)
    slots: dict[str, int] = {}  # per slot type: the most partial values a column segment's block keeps
    for rep, _, sched in classes:
        if isinstance(sched, column.ColumnReductionSchedule):
            slot_type = column.partials_slot_type(rep)
            slots[slot_type] = max(slots.get(slot_type, 0), sched.block * sched.vector)
    buffers = {t: em.fresh("partials") for t in slots}
    first, shown = 0, []
    for rep, members, sched in classes:
        reduction = isinstance(sched, column.ColumnReductionSchedule)
        shown.append(f"{len(members)}x{rep.outputs[0].type.size}:{'c' if reduction else ''}{sched.vector}x{sched.grid}")
        local = em.op(f"arith.subi {bid}, {em.index(first)} : index")  # wraps around below `first`
        mine = em.op(f"arith.cmpi ult, {local}, {em.index(sched.grid * len(members))} : index")
        with em.region(f"scf.if {mine} {{"):
            block, names = _member_arrays(em, rep, members, local, sched.grid, mem_of)
            seg_memrefs = dict(zip(rep.inputs, names))
            seg_outs = names[len(rep.inputs):]
            if reduction:
                slot_type = column.partials_slot_type(rep)
                column.column_reduction_body(em, rep, seg_memrefs, seg_outs, block, tid, sched, buffers[slot_type],
                                             slots[slot_type])
            else:
                thread = em.op(f"arith.addi {em.op(f'arith.muli {block}, {em.index(BLOCK)} : index')}, {tid} : index")
                grid_stride_outputs(em, rep, seg_memrefs, seg_outs, thread, sched.vector, BLOCK, sched.grid * BLOCK)
        first += sched.grid * len(members)
    schedule = f"batched_elementwise(segments={len(kernel.segments)}, block={BLOCK}, grid={first}; " \
               f"count x size:vector x blocks, c: column reduction {' '.join(shown)})"
    workgroup = [f"{buffers[t]} : memref<{n}x{t}, #gpu.address_space<workgroup>>" for t, n in slots.items()]
    text = gpu_module_text(kernel.name, target, params, em.lines, BLOCK, workgroup)
    return GpuModule(kernel.name, text, (first, 1, 1), (BLOCK, 1, 1), 0, schedule)


def _classes(segments: list[Kernel], target: Target) -> list[tuple[Kernel, list[Kernel], object]]:
    """Segments whose kernels would be the same code but for their arrays (an optimizer's update of
    each layer's bias), as (the first, up to `MAX_SHARED` of them, their schedule): one body serves
    them, so the batch's PTX, and ptxas's time on it, grow more slowly than its segments."""
    classes: dict[str, tuple[Kernel, list[Kernel], object]] = {}
    for seg in segments:
        if elementwise_refusal(seg) is None:
            sched, body = choose_elementwise_schedule(seg, target), build_elementwise(seg, target).text
        else:
            sched, body = column.choose_column_reduction_schedule(seg, target), column.build_column_reduction(seg, target).text
        key = body.replace(seg.name, "@kernel")
        classes.setdefault(key, (seg, [], sched))[1].append(seg)
    return [(members[i], members[i:i + MAX_SHARED], sched) for _, members, sched in classes.values()
            for i in range(0, len(members), MAX_SHARED)]


def _member_arrays(em: GpuEmitter, rep: Kernel, members: list[Kernel], local: str, grid: int,
                   mem_of: dict) -> tuple[str, list[str]]:
    """(the block's index within its member, the member's arrays in `rep`'s parameter order): member
    `local // grid` of the class, its arrays picked by `arith.select`s."""
    if len(members) == 1:
        return local, [mem_of[v] for v in rep.inputs + rep.outputs]
    n = em.index(grid)
    member, block = em.op(f"arith.divui {local}, {n} : index"), em.op(f"arith.remui {local}, {n} : index")
    names = []
    for j, v in enumerate(rep.inputs + rep.outputs):
        name = mem_of[v]
        for k, other in enumerate(members[1:], start=1):
            w = (other.inputs + other.outputs)[j]
            if mem_of[w] != name:
                is_k = em.op(f"arith.cmpi eq, {member}, {em.index(k)} : index")
                name = em.op(f"arith.select {is_k}, {mem_of[w]}, {name} : {flat_memref(v.type)}")
        names.append(name)
    return block, names
