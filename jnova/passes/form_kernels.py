"""Kernel formation: split the step's function into compiled kernels and fallback ops.

Each maximal run of compiled nova ops between fallback ops becomes one kernel; a kernel's inputs
are the values it reads from outside, its outputs the values read after it (or returned). The
result, a `Plan`, is what codegen compiles and the executor runs, in order.

The GPU plan is one kernel per fusion group, then two steps that need to know which kernels the
backend can build: neighbours merged into one kernel, and an optimizer's terminal kernels batched.
That knowledge reaches this pass through `KernelFamilies`, an object the pipeline hands in (the GPU
backend's is `codegen/gpu/compile.KERNEL_FAMILIES`): passes never import code generation.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from jnova.dialect.ir import Func, Op, Value
from jnova.dialect.ops import FallbackOp
from jnova.dialect.types import itemsize
from jnova.passes.plan import BatchedKernel, Kernel, Plan, View

MAX_BATCH_PARAMS = 256  # pointers per batched kernel: 2 KiB of the 4 KiB of kernel parameters
MAX_DELAYED_BYTES = 512 * 2**20  # memory a batch may keep alive past its members' own positions


class KernelFamilies(Protocol):
    """What a backend's kernel builders take, as kernel formation asks it."""

    def accepts(self, kernel: Kernel) -> str | None:
        """Why no kernel family takes `kernel`, or None when one does."""

    def mergeable(self, kernel: Kernel) -> bool:
        """Whether `merge_neighbours` may make `kernel` (groups merged) one kernel."""

    def batchable(self, kernel: Kernel) -> bool:
        """Whether `batch_terminal_kernels` may launch `kernel` in a batch with others."""

    def in_place(self, kernel: Kernel) -> bool:
        """Whether the kernel built for `kernel` may write an output into the buffer of an input it reads
        only at each element's own offset (`reuse_buffers`)."""

    def epilogue_refusal(self, ops: Sequence[Op]) -> str | None:
        """Why the contraction kernels do not compute `ops` (one matmul and what follows it) in
        registers, or None when they do."""


def form_plan(func: Func, groups, per_group: bool, families: KernelFamilies | None) -> Plan:
    """The step's plan. Not `per_group`: a kernel per run of ops between fallbacks (`form_kernels`).
    Per group without `families` (the CPU's fused plan): a kernel per fusion group. With the GPU's
    `families`: the epilogues its contraction kernels cannot take split off, neighbours that share
    rows merged, one kernel per group, and an optimizer's per-leaf updates launched in a few batches."""
    if not per_group:
        return form_kernels(func)
    if families is None:
        return kernels_from_fusion(func, groups)
    groups = merge_neighbours(func, split_contraction_epilogues(func, groups, families), families.mergeable)
    return batch_terminal_kernels(kernels_from_fusion(func, groups), families.batchable)


def form_kernels(func: Func) -> Plan:
    runs: list[list[Op] | Op] = []
    for op in func.ops:
        if isinstance(op, FallbackOp):
            runs.append(op)
        elif runs and isinstance(runs[-1], list):
            runs[-1].append(op)
        else:
            runs.append([op])
    # a value is live-out of a run if an op outside the run (or the return) reads it
    readers: dict[Value, set[int]] = {}
    for i, run in enumerate(runs):
        for op in run if isinstance(run, list) else [run]:
            for v in op.operands:
                readers.setdefault(v, set()).add(i)
    returned = set(func.returns)
    plan = Plan(func)
    for i, run in enumerate(runs):
        if not isinstance(run, list):
            plan.steps.append(run)
            continue
        defined = {r for op in run for r in op.results}
        inputs, seen = [], set()
        for op in run:
            for v in op.operands:
                if v not in defined and v not in seen:
                    seen.add(v)
                    inputs.append(v)
        outputs = [r for op in run for r in op.results
                   if r in returned or readers.get(r, set()) - {i}]
        if outputs:
            plan.steps.append(Kernel(f"kernel_{len(plan.kernels)}", run, inputs, outputs))
    return plan


def split_contraction_epilogues(func: Func, groups, families: KernelFamilies) -> list:
    """Each contraction group whose epilogue the contraction kernels do not compute (the GPU's add a
    bias and a residual in registers) as two: the matmul with the longest chain of conversions and
    views of its result the contraction kernel does compute (a rounding to bf16: the result crosses
    memory in 16 bits), then the rest of its epilogue as an elementwise group.

    The result goes through memory once more, but every other fusion stays.
    """
    from jnova.passes.fuse import Group

    returned = set(func.returns)
    out = []
    for g in groups:
        matmuls = [op for op in g.ops if op.name == "nova.matmul"]
        if g.kind != "contraction" or len(g.ops) == 1 or len(matmuls) != 1 or families.epilogue_refusal(g.ops) is None:
            out.append(g)
            continue
        head = _computed_head(matmuls[0], g.ops, families, returned)
        out.append(Group(head, "contraction", matmuls[0]))
        out.append(Group([op for op in g.ops if op not in head], "elementwise"))
    return out


def _computed_head(matmul: Op, ops, families: KernelFamilies, returned: set) -> list[Op]:
    """The matmul and the chain of narrowing conversions and reshapes of its result that the
    contraction kernel computes, each link read by the next alone (so the rest of the epilogue reads
    the chain's end, in fewer bytes than the matmul's f32 result)."""
    head, value = [matmul], matmul.results[0]
    while value not in returned:
        readers = [op for op in ops if value in op.operands]
        if len(readers) != 1 or readers[0].name not in ("nova.convert", "nova.reshape") \
                or (readers[0].name == "nova.convert"
                    and itemsize(readers[0].results[0].type.dtype) >= itemsize(value.type.dtype)) \
                or families.epilogue_refusal(head + readers) is not None:
            break
        head.append(readers[0])
        value = readers[0].results[0]
    return head


def merge_neighbours(func: Func, groups, accepts) -> list:
    """The GPU's second fusion step: each group joins the one before it when it reads a value that
    group computes (or an array it reads) and `accepts` takes the two as one kernel (`KernelFamilies.mergeable`; the GPU's: a row
    program, a row reduction or one elementwise kernel). Fusion keeps a value another kernel also reads out of its
    readers' groups; neighbours in execution order can share it in registers and still write it
    once, so the chains of a softmax (max, exp, sum, divide) and of a LayerNorm (mean, variance,
    normalize, scale) become one kernel each, as do elementwise chains whose every step the backward
    pass keeps (GELU's). Siblings (groups reading one array that neither computes) merge too: the
    array is read once. A value crosses from one group into the next only at its own point (the
    same element), through a reduction, or as a smaller value broadcast (a row statistic): a moved
    or replicated read of a computed value would recompute it."""
    from jnova.passes.fuse import Group, read_of

    order = {op: i for i, op in enumerate(func.ops)}
    returned = set(func.returns)
    members = [set(g.ops) for g in groups]
    readers = _group_readers(groups)

    def joins(ids: set[int], ops: set[Op], gi: int) -> bool:
        read = {v for op in ops for v in op.operands}
        connected = False
        for op in groups[gi].ops:  # its own ops and its copies of recomputed ones (either may be shared)
            for i, v in enumerate(op.operands):
                if v.owner is None or v.owner not in ops or v.owner in members[gi]:
                    connected |= v in read and v.type.size > 1 and (v.owner is None or v.owner not in ops)
                    continue
                connected = True
                small = v.type.size < op.results[0].type.size
                if not (read_of(op, i) == "same" or op.name == "nova.reduce"
                        or (op.name == "nova.broadcast" and small)):
                    return False
        if not connected:
            return False
        kernel_ops = sorted(ops | members[gi], key=order.__getitem__)
        inputs, outputs = _boundary(kernel_ops, ids | {gi}, members, readers, returned)
        return bool(outputs) and accepts(Kernel("merged", kernel_ops, inputs, outputs))

    out, ids, ops = [], set(), set()
    for gi, g in enumerate(groups):
        if ids and g.kind in ("elementwise", "reduction") and joins(ids, ops, gi):
            ids.add(gi)
            ops |= members[gi]
            continue
        if ids:
            out.append(_merged(groups, ids, ops, order, Group))
        ids, ops = ({gi}, set(members[gi])) if g.kind in ("elementwise", "reduction") else (set(), set())
        if not ids:
            out.append(g)
    if ids:
        out.append(_merged(groups, ids, ops, order, Group))
    return out


def _merged(groups, ids: set[int], ops: set[Op], order: dict, group_type):
    if len(ids) == 1:
        return groups[next(iter(ids))]
    anchor = next((groups[i].anchor for i in sorted(ids) if groups[i].anchor is not None), None)
    return group_type(sorted(ops, key=order.__getitem__), "reduction" if anchor is not None else "elementwise", anchor)


def kernels_from_fusion(func: Func, groups) -> Plan:
    """One kernel per fusion group (the GPU plan); fallback ops stay XLA ops.

    A value is a kernel output when some op outside the group reads it without having its own copy
    of the defining op (constants and broadcasts are recomputed per group), or when it is returned.
    """
    returned = set(func.returns)
    members = [set(g.ops) for g in groups]
    readers = _group_readers(groups)
    plan = Plan(func)
    for gi, g in enumerate(groups):
        if g.kind == "fallback":
            plan.steps.append(g.ops[0])
            continue
        inputs, outputs = _boundary(g.ops, {gi}, members, readers, returned)
        if g.kind == "contraction":  # the contraction kernel's parameter order: A, B, then the bias it
            matmul = next(op for op in g.ops if op.name == "nova.matmul")  # broadcasts, then the rest
            bias = {op.operands[0] for op in g.ops if op.name == "nova.broadcast"}
            inputs.sort(key=lambda v: (matmul.operands.index(v) if v in matmul.operands else 2 + (v not in bias)))
        if outputs and len(g.ops) == 1 and g.ops[0].name == "nova.reshape":
            plan.steps.append(View(f"view_{len(plan.steps)}", g.ops, inputs, outputs))
        elif outputs:
            plan.steps.append(Kernel(f"kernel_{len(plan.kernels)}", g.ops, inputs, outputs))
    return plan


def _group_readers(groups) -> dict[Value, set[int]]:
    """The groups (by index) whose ops read each value."""
    readers: dict[Value, set[int]] = {}
    for gi, g in enumerate(groups):
        for op in g.ops:
            for v in op.operands:
                readers.setdefault(v, set()).add(gi)
    return readers


def _boundary(ops: list[Op], ids: set[int], members: list[set[Op]], readers, returned) -> tuple[list, list]:
    """(inputs, outputs) of a kernel of `ops` (the groups `ids`): an output is returned, or read by
    another group without its own copy of the defining op (constants and broadcasts are recomputed)."""
    defined = {r for op in ops for r in op.results}
    inputs = list(dict.fromkeys(v for op in ops for v in op.operands if v not in defined))
    outputs = [r for op in ops for r in op.results
               if r in returned or any(gj not in ids and op not in members[gj] for gj in readers.get(r, ()))]
    return inputs, outputs


def batch_terminal_kernels(plan: Plan, batchable, max_params: int = MAX_BATCH_PARAMS,
                           max_delayed_bytes: int = MAX_DELAYED_BYTES) -> Plan:
    """The plan with its terminal kernels that `batchable` accepts launched in batches (horizontal
    fusion): a kernel is terminal when the step returns its outputs and no other step reads them (an
    optimizer's per-leaf update), so no terminal kernel reads what another writes and each batch may run
    where its last member ran, later than the others (their inputs are ready earlier). Batches take
    kernels in plan order up to `max_params` parameters, and while the inputs whose last reader is an
    earlier member (their buffers live until the batch runs) total at most `max_delayed_bytes`; a batch
    of one stays a plain kernel."""
    returned = set(plan.func.returns)
    inputs_of = [step.inputs if isinstance(step, Kernel) else step.operands for step in plan.steps]
    read = {v for vs in inputs_of for v in vs}
    last_reader = {v: i for i, vs in enumerate(inputs_of) for v in vs}
    position = {id(step): i for i, step in enumerate(plan.steps)}

    def dying_bytes(k: Kernel) -> int:  # what delaying `k` keeps alive (the step's arguments live throughout)
        return sum(v.type.size * itemsize(v.type.dtype) for v in set(k.inputs)
                   if v.owner is not None and last_reader[v] == position[id(k)])

    candidates = [s for s in plan.kernels if s.outputs and batchable(s)
                  and all(v in returned and v not in read for v in s.outputs)]
    batches, current, params, delayed = [], [], set(), 0
    for k in candidates:
        own = set(k.inputs) | set(k.outputs)
        if current and (len(params | own) > max_params or delayed + dying_bytes(current[-1]) > max_delayed_bytes):
            batches.append(current)
            current, params, delayed = [], set(), 0
        if current:
            delayed += dying_bytes(current[-1])
        current.append(k)
        params |= own
    batches.append(current)
    at_last = {id(b[-1]): b for b in batches if len(b) > 1}
    moved = {id(k) for b in at_last.values() for k in b}
    out = Plan(plan.func)
    for step in plan.steps:
        if id(step) in at_last:
            b = at_last[id(step)]
            out.steps.append(BatchedKernel(
                f"{b[-1].name}_batch{len(b)}", [op for k in b for op in k.ops],
                list(dict.fromkeys(v for k in b for v in k.inputs)), [v for k in b for v in k.outputs], segments=b))
        elif id(step) not in moved:
            out.steps.append(step)
    return out
