"""Scatter-add kernels: a `nova.scatter` of kind 'add' (embedding and one-hot gradients) with atomics.

The kernel's output shares its buffer with the scatter's operand (`GpuModule.aliases`, XLA's
input_output_aliases): XLA copies the operand into the output buffer first where the operand is
still needed elsewhere (the scatter's copy kernel), so the kernel only adds the updates. Each thread
takes update elements in a grid-stride loop, finds the element it adds to with the CPU lowering's
rules (`rules_index.py`: windows clamped in mode 'clip', dropped whole otherwise) and adds with
`memref.atomic_rmw`. Updates to one element land in no fixed order, as in XLA's GPU scatter, so
float sums may differ from a sequential sum in the last bits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jnova.codegen.gpu.elementwise import BLOCK, BLOCKS_PER_SM
from jnova.codegen.gpu.emitter import GpuEmitter, GpuModule, flat_memref, global_thread, gpu_module_text, kernel_params
from jnova.codegen.gpu.evaluate import Evaluator, Point
from jnova.codegen.linalg.emitter import element
from jnova.errors import LoweringError
from jnova.codegen.index_arith import all_of, clamp, in_range, window_at
from jnova.dialect.ops import ScatterOp
from jnova.dialect.types import UNSIGNED_DTYPES
from jnova.passes.plan import Kernel
from jnova.runtime.target import Target

ATOMIC_ADD = {"float32": "addf", "int32": "addi", "uint32": "addi", "int64": "addi", "uint64": "addi"}


@dataclass(frozen=True)
class ScatterSchedule:
    updates: int  # update elements, one per thread and step
    block: int
    grid: int

    def __str__(self) -> str:
        return f"scatter_add(updates={self.updates}, block={self.block}, grid={self.grid})"


def scatter_refusal(kernel: Kernel) -> str | None:
    """Why `kernel` is not a scatter-add kernel, or None."""
    if len(kernel.ops) != 1 or not isinstance(kernel.ops[0], ScatterOp):
        return "it is not a single scatter"
    op = kernel.ops[0]
    if op.attrs["kind"] != "add":
        return f"a scatter of kind '{op.attrs['kind']}' (only 'add' has atomics here)"
    if op.results[0].type.dtype not in ATOMIC_ADD:
        return f"no atomic add of {op.results[0].type.dtype} (expected one of {sorted(ATOMIC_ADD)})"
    if op.operands[0] in op.operands[1:]:
        return "its operand is also its indices or updates"
    return None


def build_scatter_add(kernel: Kernel, target: Target) -> GpuModule:
    reason = scatter_refusal(kernel)
    if reason:
        raise LoweringError(f"{kernel.name} is not a scatter-add kernel: {reason}")
    (op,) = kernel.ops
    x, indices, updates = op.operands
    blocks = max(1, math.ceil(updates.type.size / BLOCK))
    sched = ScatterSchedule(updates.type.size, BLOCK, min(blocks, target.sm_count * BLOCKS_PER_SM))
    params, memrefs, (out,) = kernel_params(kernel.inputs, kernel.outputs)
    em = GpuEmitter()
    _, first = global_thread(em, sched.block)
    if updates.type.size:
        stride = em.op(f"arith.muli {em.op('gpu.grid_dim x')}, {em.index(sched.block)} : index")
        u = em.fresh("u")
        with em.region(f"scf.for {u} = {first} to {em.index(updates.type.size)} step {stride} {{"):
            _add_one(em, op, Evaluator(em, memrefs), out, Point(updates.type.shape, 1, True, flat=u))
    text = gpu_module_text(kernel.name, target, params, em.lines, sched.block)
    aliases = ((kernel.inputs.index(x), 0),)
    return GpuModule(kernel.name, text, (sched.grid, 1, 1), (sched.block, 1, 1), 0, str(sched), aliases)


def _add_one(em: GpuEmitter, op: ScatterOp, ev: Evaluator, out: str, u: Point) -> None:
    """out[target of update element u] += updates[u], unless its window is out of range (mode fill)."""
    a, (x, indices, updates) = op.attrs, op.operands
    xt, it, ut = x.type, indices.type, updates.type
    s = em.scalar()
    coords = ev.coords(u)
    batch = [c for d, c in enumerate(coords) if d not in a["update_window_dims"]]
    window_dims = [d for d in range(xt.rank) if d not in a["inserted_window_dims"] + a["operand_batching_dims"]]
    window = [1] * xt.rank
    for d, w in zip(window_dims, a["update_window_dims"]):
        window[d] = ut.shape[w]
    start, valid = {}, []
    for k, d in enumerate(a["scatter_dims_to_operand_dims"]):  # as rules_index's scatter
        raw = ev.read(indices, batch + [em.index(k)])[0]
        if it.dtype not in ("int64", "uint64"):
            ext = "extui" if it.dtype in UNSIGNED_DTYPES else "extsi"
            raw = s.op(f"arith.{ext} {raw} : {element(it.dtype)} to i64")
        start[d] = clamp(s, raw, xt.shape[d] - window[d], it.dtype in UNSIGNED_DTYPES)
        if a["mode"] != "clip":
            valid.append(in_range(s, raw, xt.shape[d] - window[d]))
    for d, bd in zip(a["operand_batching_dims"], a["scatter_indices_batching_dims"]):
        start[d] = batch[bd]
    offsets = dict(zip(window_dims, [coords[w] for w in a["update_window_dims"]]))
    at = ev.flat(Point(xt.shape, 1, True, coords=window_at(s, xt.rank, start, offsets)))
    value = ev.lanes(updates, u)[0]
    rmw = f"memref.atomic_rmw {ATOMIC_ADD[xt.dtype]} {value}, {out}[{at}] : ({element(xt.dtype)}, {flat_memref(xt)}) -> {element(xt.dtype)}"
    if not valid:
        em.op(rmw)
        return
    with em.region(f"scf.if {all_of(s, valid)} {{"):
        em.op(rmw)
