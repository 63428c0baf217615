"""fuse: group nova ops into fused kernels, and say why every refused fusion was refused.

Rules (the Nova report, section 4.1), applied to a fixpoint:
- producer/consumer fusion: a producer's group joins its consumer's group when every user of the
  producer's values is in that group (the report's single-use rule, generalised from one user op to
  one user kernel: nothing is computed twice); a value the step returns joins only an elementwise
  consumer, whose kernel then writes it as one more output at the same points (an optimizer's new
  moments and its parameter update: one kernel per parameter, not three);
- index remaps fuse like elementwise ops: each element of a broadcast, reshape, transpose, slice,
  reverse, pad, concatenate, dynamic_slice or gather reads one element of an operand at an index
  computed from its own, so a kernel reads its inputs through them ("rather than running a separate
  transpose operation, the compiler changes how it reads the data", section 4.2);
- a group computes each of its values at one point per element it writes: a producer does not join
  if a broadcast or gather would read it at many points, or two paths at different points (a value
  of one element is the exception: every point reads that element);
- ops without inputs (constants, iota) and the remaps that cost about one load per element (all of
  the above; a gather only where it reads whole rows of at least `MIN_GATHER_ROW` elements, an
  embedding lookup, so its index load is shared by a row) are copied into every group that reads
  them; they are a kernel of their own only where a reader cannot take a copy (a matmul, an op that
  is a kernel of its own) or where they are returned;
- no fusion into a contraction's body: a matmul's operands come from other kernels (a transposed or
  sliced operand is left for the matmul's operand layout);
- a contraction takes elementwise consumers over its output as its epilogue (bias, residual,
  activation), so linear + bias + residual (+ activation) is one kernel;
- a reduction takes elementwise producers over its input as a prologue and elementwise consumers
  over its output as an epilogue;
- scatter, dynamic_update_slice and fallbacks stay kernels (or XLA ops) of their own.
A group runs at the position of its last op: every other member is used only inside the group
(the copies of recomputed ops aside).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from jnova.dialect.ir import Func, Op, Value
from jnova.dialect.ops import ElementwiseOp

log = logging.getLogger("jnova.passes")

ELEMENTWISE_NAMES = {"nova.select", "nova.convert", "nova.bitcast", "nova.constant", "nova.iota"}
# each element reads one element of an operand, at an index computed from its own
REMAP_NAMES = {"nova.broadcast", "nova.reshape", "nova.transpose", "nova.slice", "nova.reverse", "nova.pad",
               "nova.concatenate", "nova.dynamic_slice", "nova.gather"}
# copied into each group that reads them: no inputs, or one load per element (gathers: see below)
REMATERIALIZABLE = {"nova.constant", "nova.iota"} | REMAP_NAMES - {"nova.gather"}
MIN_GATHER_ROW = 16  # a gather of whole rows at least this long is copied like a load
# what a contraction's epilogue may read its other inputs through (the matmul builder's epilogue)
EPILOGUE_COPIES = {"nova.constant", "nova.iota", "nova.broadcast", "nova.reshape"}
SCALAR_NAMES = {"nova.select", "nova.convert", "nova.bitcast"}


def kind_of(op: Op) -> str:
    if isinstance(op, ElementwiseOp) or op.name in ELEMENTWISE_NAMES or op.name in REMAP_NAMES:
        return "elementwise"
    if op.name == "nova.matmul":
        return "contraction"
    if op.name in ("nova.reduce", "nova.argreduce"):
        return "reduction"
    if op.name == "nova.fallback":
        return "fallback"
    return "other"


def recomputable(op: Op) -> bool:
    """Whether a copy of `op` in each group that reads it costs about one load per element."""
    if op.name != "nova.gather":
        return op.name in REMATERIALIZABLE
    a, x = op.attrs, op.operands[0].type
    inner = x.rank - 1  # a window of whole rows: one index load per row
    return (x.rank > 0 and inner not in a["collapsed_slice_dims"] + a["operand_batching_dims"]
            and a["slice_sizes"][inner] == x.shape[inner] >= MIN_GATHER_ROW)


def read_of(op: Op, i: int) -> str:
    """How `op` reads operand `i`: "same" (each element at the op's own row-major offset), "moved"
    (each element at most once, elsewhere) or "many" (an element for several of the op's elements)."""
    x, out = op.operands[i].type, op.results[0].type
    if op.name == "nova.reshape" or (op.name == "nova.broadcast" and x.size == out.size):
        return "same"
    if op.name in ("nova.broadcast", "nova.gather") or (op.name in ("nova.pad", "nova.dynamic_slice") and i > 0):
        return "many"  # replicated; data-dependent; a padding value or a start index read everywhere
    if op.name in REMAP_NAMES or op.name in ("nova.reduce", "nova.argreduce"):
        return "moved"
    return "same" if x.shape == out.shape else "many"  # a select's scalar predicate


@dataclass
class Group:
    """Ops compiled as one kernel, in program order. `anchor` is its matmul or reduction, if any."""

    ops: list[Op]
    kind: str
    anchor: Op | None = None

    @property
    def root(self) -> Op:
        return self.ops[-1]


@dataclass
class Fusion:
    groups: list[Group]
    refused: list[str] = field(default_factory=list)

    def kernel_count(self) -> int:
        return sum(g.kind != "fallback" for g in self.groups)


class _Groups:
    """Mutable grouping state: which group each (non-recomputed) op is in."""

    def __init__(self, func: Func):
        self.func = func
        self.order = {op: i for i, op in enumerate(func.ops)}
        self.users: dict = {}
        for op in func.ops:
            for v in op.operands:
                self.users.setdefault(v, set()).add(op)
        self.returned = set(func.returns)
        self.remat = {op for op in func.ops if recomputable(op) and not self._materialized(op)}
        self.group: dict[Op, int] = {}
        self.members: dict[int, set[Op]] = {}
        self.kind: dict[int, str] = {}
        self.anchor: dict[int, Op | None] = {}
        for i, op in enumerate(func.ops):
            if op in self.remat:
                continue
            self.group[op], self.members[i], self.kind[i] = i, {op}, kind_of(op)
            self.anchor[i] = op if self.kind[i] in ("contraction", "reduction") else None

    def _materialized(self, op: Op) -> bool:
        """Whether a recomputable op needs its own kernel: it is returned, or a reader cannot copy it."""
        return any(r in self.returned for r in op.results) or any(
            u.name == "nova.matmul" or kind_of(u) in ("other", "fallback") for r in op.results
            for u in self.users.get(r, ()))

    def readers(self, value) -> set[Op]:
        """The non-recomputed ops that read `value`, directly or through recomputed ops (those are
        copied into each reader's group, so the reader's group needs `value`)."""
        out, stack = set(), [value]
        while stack:
            for u in self.users.get(stack.pop(), ()):
                if u in self.remat:
                    stack.extend(u.results)
                else:
                    out.add(u)
        return out

    def producers(self, op: Op):
        """The non-recomputed ops whose values `op` reads, looking through recomputed ops."""
        stack, seen = list(op.operands), set()
        while stack:
            owner = stack.pop().owner
            if owner is None or owner in seen:
                continue
            seen.add(owner)
            if owner in self.remat:
                stack.extend(owner.operands)
            else:
                yield owner

    def refusal(self, producer: Op, consumer: Op) -> str | None:
        """Why the producer's group cannot join the consumer's group (None if it can)."""
        p, c = self.group[producer], self.group[consumer]
        pk, ck = self.kind[p], self.kind[c]
        if pk in ("other", "fallback") or ck in ("other", "fallback"):
            return f"{pk if pk in ('other', 'fallback') else ck} ops are kernels of their own"
        if consumer.name == "nova.matmul":
            if producer.name in REMAP_NAMES:  # see fuse.py's docstring
                return f"no fusion into a contraction's body (the {_name(producer)} could be the matmul's operand layout)"
            return "no fusion into a contraction's body"
        if pk != "elementwise" and ck != "elementwise":
            return f"a {pk} and a {ck} do not share a kernel"
        escaping = {u for op in self.members[p] for r in op.results for u in self.readers(r)
                    if u not in self.members[p]}
        outside = {u for u in escaping if self.group[u] != c}
        if outside:
            return f"{len(outside) + 1} user kernels (a producer fuses into its only user)"
        if (pk != "elementwise" or ck != "elementwise") and any(
                r in self.returned for op in self.members[p] for r in op.results):
            return "its result is returned (only an elementwise kernel writes it as an extra output)"
        return self.placement_refusal(self.members[p] | self.members[c])

    def placement_refusal(self, members: set[Op]) -> str | None:
        """Why `members` cannot be one group: walking back from what the group writes, every member
        must be reached at one point per element written (no broadcast or gather in between, no two
        paths that move it differently), and an anchor's result at the point of the group's output."""
        at: dict[Value, tuple] = {}
        copies: set[Op] = set()
        stack = [(r, (), None) for op in members for r in op.results
                 if r in self.returned or self.readers(r) - members]
        seen = set()
        while stack:
            item = stack.pop()
            v, path, via = item
            op = v.owner
            if item in seen or op is None or (op not in members and op not in self.remat):
                continue  # a kernel input: loaded, at any point
            seen.add(item)
            if op not in members:
                copies.add(op)
            elif via is not None and via.name == "nova.matmul":
                return "no fusion into a contraction's body"
            elif v.type.size == 1 and kind_of(op) == "elementwise":
                pass  # one element: every point reads the same one
            elif via is not None:
                return f"the {_name(via)} would read {_name(op)} at many points per element (it would be recomputed)"
            elif at.setdefault(v, path) != path:
                return f"{_name(op)} is read at two different points per element (it would be computed twice)"
            for i, x in enumerate(op.operands):
                how = "many" if op.name == "nova.matmul" else read_of(op, i)
                stack.append((x, path + ((op, i),) if how == "moved" else path, op if how == "many" and via is None else via))
        return self._anchor_refusal(members, at, copies)

    def _anchor_refusal(self, members: set[Op], at: dict, copies: set[Op]) -> str | None:
        anchor = next((op for op in members if kind_of(op) in ("contraction", "reduction")), None)
        if anchor is None:
            return None
        if at.get(anchor.results[0], ()) != ():
            return "the epilogue must iterate over the producer's output"
        if anchor.name != "nova.matmul":
            return None
        shape = anchor.results[0].type.shape
        for op in members - {anchor}:
            if not (isinstance(op, ElementwiseOp) or op.name in SCALAR_NAMES) or op.results[0].type.shape != shape:
                return "the epilogue must iterate over the producer's output"
        for op in copies - {anchor}:
            if op.name not in EPILOGUE_COPIES:
                return f"a contraction's epilogue reads its inputs elementwise or broadcast, not through a {_name(op)}"
        return None

    def merge(self, producer: Op, consumer: Op) -> None:
        p, c = self.group[producer], self.group[consumer]
        if self.kind[p] != "elementwise":
            self.kind[c], self.anchor[c] = self.kind[p], self.anchor[p]
        for op in self.members.pop(p):
            self.group[op] = c
            self.members[c].add(op)
        del self.kind[p], self.anchor[p]


def fuse(func: Func) -> Fusion:
    g = _Groups(func)
    changed = True
    while changed:
        changed = False
        for op in reversed(func.ops):
            if op not in g.group:
                continue
            for producer in g.producers(op):
                if g.group[producer] != g.group[op] and g.refusal(producer, op) is None:
                    g.merge(producer, op)
                    changed = True
    refused = sorted({f"cannot fuse {_name(p)} into {_name(op)}: {g.refusal(p, op)}"
                      for op in func.ops if op in g.group for p in g.producers(op)
                      if g.group[p] != g.group[op]})
    for reason in refused:
        log.debug("fuse: %s", reason)
    return Fusion(_with_copies(g), refused)


def _with_copies(g: _Groups) -> list[Group]:
    """Final groups in execution order, each with copies of the recomputed ops it reads."""
    groups = []
    for gid, members in g.members.items():
        ops = set(members)
        stack = [v.owner for op in members for v in op.operands]
        while stack:
            r = stack.pop()
            if r is not None and r in g.remat and r not in ops:
                ops.add(r)
                stack.extend(v.owner for v in r.operands)
        groups.append(Group(sorted(ops, key=g.order.__getitem__), g.kind[gid], g.anchor[gid]))
    groups.sort(key=lambda grp: g.order[grp.root])
    return groups


def _name(op: Op) -> str:
    return op.name.removeprefix("nova.")
