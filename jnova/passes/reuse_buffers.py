"""reuse_buffers: let a kernel write an output into the buffer of an input that dies there.

XLA gives every custom call's result a buffer of its own unless the call says that the result may
take an operand's (input_output_aliases); then the result starts where the operand was, and XLA copies
the operand first only where something still reads it later. Without it, a kernel whose input dies
at it holds both at once, and a donated argument that the kernel updates (an optimizer's parameter or
moment, `donate_argnums`) cannot receive its new value: XLA keeps a copy of the argument beside it.

A pair (input, output) of a kernel is taken when:
- the kernel is the input's last reader and every other reader is one of its ancestors (the kernel
  reads, directly or through other steps, a value that reader computes), the step does not return
  the input, and it is computed by the step or is a donated argument. (XLA's copy insertion orders
  by data dependencies (on the CPU before it schedules): a reader that is no ancestor may run after
  the kernel overwrote the buffer, and XLA then keeps a copy. A parameter's readers in the forward and
  backward passes are no ancestors of its update: it would keep a copy of the parameter for the whole
  step, more than the output saves. A cross-entropy's backward reads the logits after the forward
  kernel that computed the statistics it reads: the logits' gradient takes the logits' buffer.
  Measured on the CPU, tests/test_reuse_buffers.py);
- the output has the input's shape and dtype;
- the kernel reads the input only at each element's own offset, with the element it writes there
  (`read_of` is "same" for every read of the input and of every value computed from it inside the
  kernel: no broadcast, transpose, reduction or gather of it, nor of its convert), so writing an
  element in place never overwrites one that is still to be read;
- for a donated argument, the output is the result jax.jit gives that argument's buffer (its
  donation pairs each result with the first donated argument of the same shape and dtype not yet
  taken): any other result would leave the argument's buffer to a copy;
- `accepts(kernel)` (the backend's builders write such a kernel in place: GPU elementwise kernels
  load every input of an element before they store its outputs; the CPU runs a kernel whole before
  writing its results).

The pairs go on the kernel (`Kernel.reuses`, plan_to_json's "reuses"), and the backends lower them
as the custom call's aliases.
"""
from __future__ import annotations

import logging
from collections import defaultdict, deque

from jnova.dialect.ir import Value
from jnova.dialect.types import itemsize
from jnova.passes.plan import AllReduceBucket, BatchedKernel, Kernel, Plan, View
from jnova.passes.fuse import read_of

log = logging.getLogger("jnova.passes")


def reuse_buffers(plan: Plan, donated: tuple[int, ...] = (), accepts=lambda kernel: True) -> int:
    """Set `reuses` on the plan's kernels in place; returns the bytes of outputs that take an input's buffer."""
    func = plan.func
    readers: dict[Value, set[int]] = defaultdict(set)
    for i, step in enumerate(plan.steps):
        for v in _inputs(step):
            readers[v].add(i)
    ancestors = _ancestors(plan.steps)
    viewed = {v for step in plan.steps if isinstance(step, View) for v in step.inputs}  # read later as the view
    sole_reader = {v: max(r) for v, r in readers.items()
                   if v not in viewed and all(ancestors[max(r)] >> j & 1 for j in r if j != max(r))}
    returned = set(func.returns)
    donated_args = {func.args[i] for i in donated if i < len(func.args)}
    receives = _donation_results(func, donated)  # donated argument -> the returned value jax puts in its buffer
    saved = 0
    for i, step in enumerate(plan.steps):
        if not isinstance(step, Kernel) or isinstance(step, View):
            continue
        segments = step.segments if isinstance(step, BatchedKernel) and step.segments else [step]
        pairs = []
        for seg in segments:
            if not accepts(seg):
                continue
            others = {v for s in segments if s is not seg for v in s.inputs}
            for a, b in _pairs(seg, i, sole_reader, returned, donated_args, receives, others):
                pairs.append((step.inputs.index(seg.inputs[a]), step.outputs.index(seg.outputs[b])))
        step.reuses = tuple(pairs)
        saved += sum(step.outputs[b].type.size * itemsize(step.outputs[b].type.dtype) for _, b in pairs)
    if saved:
        log.debug("reuse_buffers: %.1f MB of kernel outputs take a dying input's buffer in func @%s",
                  saved / 1e6, func.name)
    return saved


def _ancestors(steps) -> list[int]:
    """For each step, the steps it depends on through the values it reads (a bit set: bit j is step j)."""
    producer: dict[Value, int] = {}
    out = []
    for i, step in enumerate(steps):
        bits = 0
        for v in _inputs(step):
            j = producer.get(v)
            if j is not None:
                bits |= out[j] | (1 << j)
        out.append(bits)
        for v in _outputs(step):
            producer[v] = i
    return out


def _outputs(step) -> list[Value]:
    if isinstance(step, Kernel):
        return step.outputs
    return list(getattr(step, "results", ()))


def _inputs(step) -> list[Value]:
    if isinstance(step, Kernel):
        return step.inputs
    if isinstance(step, AllReduceBucket):
        return step.operands
    return step.operands


def _pairs(kernel: Kernel, position: int, sole_reader, returned, donated_args, receives, others) -> list[tuple[int, int]]:
    taken: set[int] = set()
    pairs = []
    for a, x in enumerate(kernel.inputs):
        if x in returned or x in others or sole_reader.get(x) != position:
            continue
        if x.owner is None and x not in donated_args:
            continue  # an argument jax.jit was not given: its buffer is the caller's
        if not _elementwise_in(kernel, x):
            continue
        for b, y in enumerate(kernel.outputs):
            if b in taken or y.type.shape != x.type.shape or y.type.dtype != x.type.dtype:
                continue
            if x in donated_args and receives.get(x) is not y:
                continue
            if x not in donated_args and y in receives.values():
                continue  # it belongs in a donated argument's buffer
            taken.add(b)
            pairs.append((a, b))
            break
    return pairs


def _elementwise_in(kernel: Kernel, x: Value) -> bool:
    """Whether each element the kernel computes from `x`, through any chain of its ops, reads `x` only at
    that element's own offset: every op on a path from `x` reads its operand that depends on `x` "same".
    (A convert of `x` read by a transpose writes elsewhere than it reads, as a transpose of `x` does.)"""
    derived = {x}
    for op in kernel.ops:
        reads = [k for k, v in enumerate(op.operands) if v in derived]
        if not reads:
            continue
        if any(read_of(op, k) != "same" for k in reads):  # a reduction reads "moved"
            return False
        derived.update(op.results)
    return True


def _donation_results(func, donated: tuple[int, ...]) -> dict[Value, Value]:
    """Each donated argument's result under jax.jit's donation: results in order, each taking the first
    donated argument of its shape and dtype not yet taken (jax's `_set_up_aliases`)."""
    free: dict[tuple, deque] = defaultdict(deque)
    for i in donated:
        if i < len(func.args):
            v = func.args[i]
            free[(v.type.shape, v.type.dtype)].append(v)
    out = {}
    for y in func.returns:
        queue = free.get((y.type.shape, y.type.dtype))
        if queue:
            out[queue.popleft()] = y
    return out
