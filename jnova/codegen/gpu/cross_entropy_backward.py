"""The softmax cross-entropy backward kernel: `nova.sce_backward` (reduction "none" or "sum") in one
pass over each row, reading the logits once and writing dlogits once, in the logits' dtype.

    g = dloss[row] ("none") or dloss ("sum"), and 0 where label == ignore_index
    per chunk of the row (row_stream.RowStream: 16-byte loads and stores, scalar ends):
        p = 2^((x - lse) log2 e)       (ex2.approx; x - lse is exact where p is near 1, so p - 1 is as
                                        accurate as exp(x - lse) - 1 in f32)
        dlogits = (p - [column == label]) g                  rounded once to the logits' dtype
Every thread reads its row's label, lse and g itself (one address per team: a broadcast from L1).
A "mean" is split into "sum" with dloss / count before kernels are formed
(`passes/split_sce_reductions.py`). Each element of dlogits is written by the thread that read its
logit, after reading it, so dlogits may take the logits' buffer (`KernelFamily.in_place`).
"""
from __future__ import annotations

from jnova.codegen.gpu.cross_entropy import LOG2E, _one_op_refusal, ignored, load_label
from jnova.codegen.gpu.emitter import GpuEmitter, GpuModule, flat_memref, gpu_module_text, kernel_params
from jnova.codegen.gpu.row_stream import RowStream, exp2, f32, load_f32, store_f32
from jnova.errors import LoweringError
from jnova.passes.configure.cross_entropy_rows import CrossEntropyRows, choose_cross_entropy_rows
from jnova.passes.plan import Kernel
from jnova.runtime.target import Target


def sce_backward_kernel_refusal(kernel: Kernel) -> str | None:
    """Why a plan kernel is not one nova.sce_backward op with reduction "none" or "sum", or None."""
    return _one_op_refusal(kernel, "nova.sce_backward", ("none", "sum"))


def build_sce_backward(kernel: Kernel, target: Target, schedule: CrossEntropyRows | None = None) -> GpuModule:
    reason = sce_backward_kernel_refusal(kernel)
    if reason:
        raise LoweringError(f"{kernel.name} is not a cross-entropy backward kernel: {reason}")
    op = kernel.ops[0]
    logits, labels, lse, dloss = op.operands
    (dlogits,) = op.results
    n, v = logits.type.shape
    sched = schedule or choose_cross_entropy_rows(n, v, logits.type.dtype, target)
    params, memrefs, (out,) = kernel_params(kernel.inputs, kernel.outputs)
    em = GpuEmitter()
    rows = RowStream(em, sched, guard_rows=True)
    label, raw = load_label(em, memrefs[labels], labels.type, rows.row)
    row_lse = em.op(f"memref.load {memrefs[lse]}[{rows.row}] : {flat_memref(lse.type)}")
    at = rows.row if op.attrs["reduction"] == "none" else em.index(0)
    g = em.op(f"memref.load {memrefs[dloss]}[{at}] : {flat_memref(dloss.type)}")
    if op.attrs["has_ignore"]:
        g = em.op(f"arith.select {ignored(em, raw, labels.type.dtype, op.attrs['ignore_index'])}, {f32(em, 0.0)}, "
                  f"{g} : f32")
    log2e, one = f32(em, LOG2E), f32(em, 1.0)
    label_at = em.op(f"arith.addi {rows.base}, {label} : index")  # the label's flat offset (outside the row: none)

    def chunk_gradient(chunk, xs: list[str]) -> None:
        lane_of_label = em.op(f"arith.subi {label_at}, {chunk.offset} : index")
        ds = []
        for i, x in enumerate(xs):
            p = exp2(em, em.op(f"arith.mulf {em.op(f'arith.subf {x}, {row_lse} : f32')}, {log2e} : f32"))
            hit = em.op(f"arith.cmpi eq, {lane_of_label}, {em.index(i)} : index")
            p = em.op(f"arith.select {hit}, {em.op(f'arith.subf {p}, {one} : f32')}, {p} : f32")
            ds.append(em.op(f"arith.mulf {p}, {g} : f32"))
        store_f32(em, ds, out, dlogits.type, chunk.offset)

    def update(state, chunks) -> list[str]:
        whole = [c for c in chunks if c.inside is None]  # all loads before any store: in flight together
        for chunk, xs in [(c, load_f32(em, memrefs[logits], logits.type, c.offset, c.lanes)) for c in whole]:
            chunk_gradient(chunk, xs)
        for chunk in chunks:
            if chunk.inside is not None:
                with em.region(f"scf.if {chunk.inside} {{"):
                    chunk_gradient(chunk, load_f32(em, memrefs[logits], logits.type, chunk.offset, chunk.lanes))
        return []

    rows.stream([], [], update)
    text = gpu_module_text(kernel.name, target, params, em.lines, sched.block)
    return GpuModule(kernel.name, text, (sched.grid, 1, 1), (sched.block, 1, 1), 0, str(sched))
