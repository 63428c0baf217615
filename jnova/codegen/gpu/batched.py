"""Batched elementwise kernels: independent elementwise kernels launched as one (horizontal fusion).

An optimizer updates each parameter leaf in a kernel of its own, unless the update is the epilogue of
the leaf's gradient reduction (GPT-2 124M: the 50 weight matrices' updates; its 98 vectors' are
epilogues of column reductions). `form_kernels.batch_terminal_kernels` gathers such kernels, whose results only the step returns, into one `BatchedKernel`; this builder gives
each segment a contiguous range of the grid's blocks with the schedule it would have had alone
(`elementwise.choose_elementwise_schedule`): block `b` runs segment `i` when `b - first_i < blocks_i`
(one unsigned comparison per segment, uniform across the block). The kernel's parameters are every
segment's inputs (each once) and outputs.
"""
from __future__ import annotations

from jnova.codegen.gpu.elementwise import BLOCK, choose_elementwise_schedule, elementwise_refusal, grid_stride_outputs
from jnova.codegen.gpu.emitter import GpuEmitter, GpuModule, gpu_module_text, kernel_params
from jnova.codegen.linalg.lowering import LoweringError
from jnova.passes.form_kernels import Kernel
from jnova.runtime.target import Target


def batched_refusal(kernel: Kernel) -> str | None:
    """Why `kernel` is not a batch of elementwise kernels, or None."""
    segments = getattr(kernel, "segments", None)
    if not segments:
        return "it is not a batch of independent kernels"
    for s in segments:
        reason = elementwise_refusal(s)
        if reason:
            return f"segment {s.name}: {reason}"
    return None


def build_batched(kernel: Kernel, target: Target) -> GpuModule:
    reason = batched_refusal(kernel)
    if reason:
        raise LoweringError(f"{kernel.name} is not a batch of elementwise kernels: {reason}")
    params, memrefs, outs = kernel_params(kernel.inputs, kernel.outputs)
    out_of = dict(zip(kernel.outputs, outs))
    em = GpuEmitter()
    bid, tid = em.op("gpu.block_id x"), em.op("gpu.thread_id x")
    first, shown = 0, []
    for seg in kernel.segments:
        sched = choose_elementwise_schedule(seg, target)
        shown.append(f"{seg.outputs[0].type.size}:{sched.vector}x{sched.grid}")
        local = em.op(f"arith.subi {bid}, {em.index(first)} : index")  # wraps around below `first`
        mine = em.op(f"arith.cmpi ult, {local}, {em.index(sched.grid)} : index")
        with em.region(f"scf.if {mine} {{"):
            thread = em.op(f"arith.addi {em.op(f'arith.muli {local}, {em.index(BLOCK)} : index')}, {tid} : index")
            grid_stride_outputs(em, seg, memrefs, [out_of[v] for v in seg.outputs], thread, sched.vector, BLOCK,
                                sched.grid * BLOCK)
        first += sched.grid
    schedule = f"batched_elementwise(segments={len(kernel.segments)}, block={BLOCK}, grid={first}; " \
               f"size:vector x blocks {' '.join(shown)})"
    text = gpu_module_text(kernel.name, target, params, em.lines, BLOCK)
    return GpuModule(kernel.name, text, (first, 1, 1), (BLOCK, 1, 1), 0, schedule)

