"""Fused elementwise kernels: outputs of one shape, computed in registers from the kernel's inputs.

Every thread takes groups of `vector` consecutive elements (16-byte loads and stores of the widest
array where the shapes allow) in a grid-stride loop; the elements after the last whole group (fewer
than `vector`) are done one per thread after the loop. Ops of the kernel may be any elementwise op,
select, convert, iota, uniform constant or index remap (broadcast, reshape, transpose, slice,
reverse, pad, concatenate, dynamic slice, gather; see `evaluate.py` and `remaps.py`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jnova.codegen.gpu.emitter import GpuEmitter, GpuModule, global_thread, gpu_module_text, kernel_params
from jnova.codegen.gpu.evaluate import Evaluator, Point, reads_at_own_offsets, unsupported_op, widest_vector
from jnova.errors import LoweringError
from jnova.passes.plan import Kernel
from jnova.runtime.target import Target

BLOCK = 256  # threads per block
BLOCKS_PER_SM = 8  # grid cap: 2048 resident threads per SM (sm_80, sm_90) in blocks of 256


@dataclass(frozen=True)
class ElementwiseSchedule:
    vector: int  # elements per thread and step
    block: int
    grid: int

    def __str__(self) -> str:
        return f"elementwise(vector={self.vector}, block={self.block}, grid={self.grid})"


def elementwise_refusal(kernel: Kernel) -> str | None:
    """Why `kernel` is not an elementwise kernel, or None."""
    shapes = sorted({v.type.shape for v in kernel.outputs})
    if len(shapes) != 1:
        return f"its outputs have different shapes {shapes}"
    for op in kernel.ops:
        reason = unsupported_op(op)
        if reason:
            return reason
    return None


def choose_elementwise_schedule(kernel: Kernel, target: Target) -> ElementwiseSchedule:
    """16 bytes of the widest array per access; when every array is read at the output's own flat
    offsets (no broadcast of a non-uniform value, no iota, no data movement) groups may run across
    rows, otherwise the group must divide the innermost extent so it stays within a row."""
    out = kernel.outputs[0].type
    inner = None if reads_at_own_offsets(kernel.ops) else (out.shape[-1] if out.rank else 1)
    vector = widest_vector([v.type for v in kernel.inputs + kernel.outputs], inner)
    blocks = max(1, math.ceil(out.size // vector / BLOCK))
    return ElementwiseSchedule(vector, BLOCK, min(blocks, target.sm_count * BLOCKS_PER_SM))


def build_elementwise(kernel: Kernel, target: Target) -> GpuModule:
    reason = elementwise_refusal(kernel)
    if reason:
        raise LoweringError(f"{kernel.name} is not an elementwise kernel: {reason}")
    schedule = choose_elementwise_schedule(kernel, target)
    params, memrefs, outs = kernel_params(kernel.inputs, kernel.outputs)
    em = GpuEmitter()
    _, first = global_thread(em, schedule.block)
    grid_stride_outputs(em, kernel, memrefs, outs, first, schedule.vector, schedule.block)
    text = gpu_module_text(kernel.name, target, params, em.lines, schedule.block)
    return GpuModule(kernel.name, text, (schedule.grid, 1, 1), (schedule.block, 1, 1), 0, str(schedule))


def grid_stride_outputs(em: GpuEmitter, kernel: Kernel, memrefs: dict, outs: list[str], thread: str, vector: int,
                        block: int, threads: int | None = None) -> None:
    """The body of an elementwise kernel for the thread `thread` of `threads` (default: the whole
    grid's): a grid-stride loop over the outputs' groups of `vector` elements, then the elements after
    the last whole group (fewer than `vector`), one per thread."""
    shape, size = kernel.outputs[0].type.shape, kernel.outputs[0].type.size
    groups, tail = divmod(size, vector)
    if groups:
        stride = (em.index(threads) if threads is not None
                  else em.op(f"arith.muli {em.op('gpu.grid_dim x')}, {em.index(block)} : index"))
        g = em.fresh("g")
        with em.region(f"scf.for {g} = {thread} to {em.index(groups)} step {stride} {{"):
            start = em.op(f"arith.muli {g}, {em.index(vector)} : index")
            _store_outputs(em, kernel, memrefs, outs, Point(shape, vector, True, flat=start))
    if tail:
        in_tail = em.op(f"arith.cmpi ult, {thread}, {em.index(tail)} : index")
        with em.region(f"scf.if {in_tail} {{"):
            element = em.op(f"arith.addi {thread}, {em.index(groups * vector)} : index")
            _store_outputs(em, kernel, memrefs, outs, Point(shape, 1, True, flat=element))


def _store_outputs(em: GpuEmitter, kernel: Kernel, memrefs: dict, outs: list[str], point: Point) -> None:
    """Every output at `point`: all of them computed (every input read) before the first is stored, so an
    output may be written in place of an input (`Kernel.reuses`)."""
    evaluator = Evaluator(em, memrefs)  # one per region
    for v in kernel.outputs:
        evaluator.lanes(v, point)
    for v, mem in zip(kernel.outputs, outs):
        evaluator.store(v, mem, point)
