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
segment's inputs (each once) and outputs.
"""
from __future__ import annotations

from jnova.codegen.gpu import column_reduction as column
from jnova.codegen.gpu.elementwise import BLOCK, choose_elementwise_schedule, elementwise_refusal, grid_stride_outputs
from jnova.codegen.gpu.emitter import GpuEmitter, GpuModule, gpu_module_text, kernel_params
from jnova.codegen.linalg.lowering import LoweringError
from jnova.passes.form_kernels import Kernel
from jnova.runtime.target import Target

assert column.BLOCK == BLOCK, "segments of both families share the launch's block size"


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
    out_of = dict(zip(kernel.outputs, outs))
    em = GpuEmitter()
    bid, tid = em.op("gpu.block_id x"), em.op("gpu.thread_id x")
    reductions = {id(s): column.choose_column_reduction_schedule(s, target) for s in kernel.segments
                  if elementwise_refusal(s)}
    slots: dict[str, int] = {}  # per slot type: the most partial values a column segment's block keeps
    for s in kernel.segments:
        if id(s) in reductions:
            slot_type, sched = column.partials_slot_type(s), reductions[id(s)]
            slots[slot_type] = max(slots.get(slot_type, 0), sched.block * sched.vector)
    buffers = {t: em.fresh("partials") for t in slots}
    first, shown = 0, []
    for seg in kernel.segments:
        csched = reductions.get(id(seg))
        sched = csched or choose_elementwise_schedule(seg, target)
        shown.append(f"{seg.outputs[0].type.size}:{'c' if csched else ''}{sched.vector}x{sched.grid}")
        local = em.op(f"arith.subi {bid}, {em.index(first)} : index")  # wraps around below `first`
        mine = em.op(f"arith.cmpi ult, {local}, {em.index(sched.grid)} : index")
        with em.region(f"scf.if {mine} {{"):
            seg_outs = [out_of[v] for v in seg.outputs]
            if csched:
                slot_type = column.partials_slot_type(seg)
                column.column_reduction_body(em, seg, memrefs, seg_outs, local, tid, csched, buffers[slot_type],
                                             slots[slot_type])
            else:
                thread = em.op(f"arith.addi {em.op(f'arith.muli {local}, {em.index(BLOCK)} : index')}, {tid} : index")
                grid_stride_outputs(em, seg, memrefs, seg_outs, thread, sched.vector, BLOCK, sched.grid * BLOCK)
        first += sched.grid
    schedule = f"batched_elementwise(segments={len(kernel.segments)}, block={BLOCK}, grid={first}; " \
               f"size:vector x blocks, c: column reduction {' '.join(shown)})"
    workgroup = [f"{buffers[t]} : memref<{n}x{t}, #gpu.address_space<workgroup>>" for t, n in slots.items()]
    text = gpu_module_text(kernel.name, target, params, em.lines, BLOCK, workgroup)
    return GpuModule(kernel.name, text, (first, 1, 1), (BLOCK, 1, 1), 0, schedule)
