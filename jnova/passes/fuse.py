"""fuse: group nova ops into fused kernels, and say why every refused fusion was refused.

Rules (the Nova report, section 4.1), applied to a fixpoint:
- producer/consumer fusion over one index space: a producer's group joins its consumer's group
  when every user of the producer's values is in that group (the report's single-use rule,
  generalised from one user op to one user kernel: nothing is computed twice) and no value of it
  is returned;
- ops without inputs (constants, iota) and broadcasts are index remaps: they are copied into every
  group that reads them (and get a kernel of their own only if some other kernel needs the value);
- no fusion into a contraction's body: a matmul's operands come from other kernels;
- a contraction takes elementwise consumers over its output as its epilogue (bias, residual,
  activation), so linear + bias + residual (+ activation) is one kernel;
- a reduction takes elementwise producers over its input as a prologue and elementwise consumers
  over its output as an epilogue;
- data movement, gather/scatter and fallbacks stay kernels (or XLA ops) of their own.
A group runs at the position of its last op: every other member is used only inside the group.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from jnova.dialect.ir import Func, Op
from jnova.dialect.ops import ElementwiseOp

log = logging.getLogger("jnova.passes")

ELEMENTWISE_NAMES = {"nova.select", "nova.convert", "nova.broadcast", "nova.constant", "nova.iota"}
REMATERIALIZABLE = {"nova.constant", "nova.iota", "nova.broadcast"}


def kind_of(op: Op) -> str:
    if isinstance(op, ElementwiseOp) or op.name in ELEMENTWISE_NAMES:
        return "elementwise"
    if op.name == "nova.matmul":
        return "contraction"
    if op.name in ("nova.reduce", "nova.argreduce"):
        return "reduction"
    if op.name == "nova.fallback":
        return "fallback"
    return "other"


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
        self.group: dict[Op, int] = {}
        self.members: dict[int, set[Op]] = {}
        self.kind: dict[int, str] = {}
        self.anchor: dict[int, Op | None] = {}
        for i, op in enumerate(func.ops):
            if op.name in REMATERIALIZABLE:
                continue
            self.group[op], self.members[i], self.kind[i] = i, {op}, kind_of(op)
            self.anchor[i] = op if self.kind[i] in ("contraction", "reduction") else None

    def readers(self, value) -> set[Op]:
        """The non-recomputed ops that read `value`, directly or through constants/broadcasts
        (those are copied into each reader's group, so the reader's group needs `value`)."""
        out, stack = set(), [value]
        while stack:
            for u in self.users.get(stack.pop(), ()):
                if u.name in REMATERIALIZABLE:
                    stack.extend(u.results)
                else:
                    out.add(u)
        return out

    def space(self, gid: int):
        """The shape elementwise members of a group iterate over (a reduction has two: in, out)."""
        anchor = self.anchor[gid]
        if anchor is None:
            return {max(self.members[gid], key=self.order.__getitem__).results[0].type.shape}
        if self.kind[gid] == "reduction":
            return {anchor.operands[0].type.shape, anchor.results[0].type.shape}
        return {anchor.results[0].type.shape}

    def refusal(self, producer: Op, consumer: Op) -> str | None:
        """Why the producer's group cannot join the consumer's group (None if it can)."""
        p, c = self.group[producer], self.group[consumer]
        pk, ck = self.kind[p], self.kind[c]
        if pk in ("other", "fallback") or ck in ("other", "fallback"):
            return f"{pk if pk in ('other', 'fallback') else ck} ops are kernels of their own"
        if consumer.name == "nova.matmul":
            return "no fusion into a contraction's body"
        if pk != "elementwise" and ck != "elementwise":
            return f"a {pk} and a {ck} do not share a kernel"
        escaping = {u for op in self.members[p] for r in op.results for u in self.readers(r)
                    if u not in self.members[p]}
        outside = {u for u in escaping if self.group[u] != c}
        if outside:
            return f"{len(outside) + 1} user kernels (a producer fuses into its only user)"
        if any(r in self.returned for op in self.members[p] for r in op.results):
            return "its result is returned"
        if pk == "elementwise":
            shapes = {op.results[0].type.shape for op in self.members[p]}
            if not shapes <= self.space(c):
                return f"different index space ({sorted(shapes)[0]} vs {sorted(self.space(c))[0]})"
            return None
        # a contraction or reduction producer takes the elementwise consumer group as its epilogue
        out_shape = self.anchor[p].results[0].type.shape
        shapes = {op.results[0].type.shape for op in self.members[c]}
        if shapes != {out_shape}:
            return "the epilogue must iterate over the producer's output"
        return None

    def merge(self, producer: Op, consumer: Op) -> None:
        p, c = self.group[producer], self.group[consumer]
        if self.kind[p] != "elementwise":
            self.kind[c], self.anchor[c] = self.kind[p], self.anchor[p]
        for op in self.members.pop(p):
            self.group[op] = c
            self.members[c].add(op)
        del self.kind[p], self.anchor[p]


def _producers(op: Op):
    """The non-recomputed ops whose values `op` reads, looking through constants and broadcasts."""
    stack, seen = list(op.operands), set()
    while stack:
        owner = stack.pop().owner
        if owner is None or owner in seen:
            continue
        seen.add(owner)
        if owner.name in REMATERIALIZABLE:
            stack.extend(owner.operands)
        else:
            yield owner


def fuse(func: Func) -> Fusion:
    g = _Groups(func)
    changed = True
    while changed:
        changed = False
        for op in reversed(func.ops):
            if op not in g.group:
                continue
            for producer in _producers(op):
                if g.group[producer] != g.group[op] and g.refusal(producer, op) is None:
                    g.merge(producer, op)
                    changed = True
    refused = sorted({f"cannot fuse {_name(p)} into {_name(op)}: {g.refusal(p, op)}"
                      for op in func.ops if op in g.group for p in _producers(op)
                      if g.group[p] != g.group[op]})
    for reason in refused:
        log.debug("fuse: %s", reason)
    return Fusion(_with_copies(g), refused)


def _with_copies(g: _Groups) -> list[Group]:
    """Final groups in execution order, each with copies of the constants/broadcasts it reads.

    A recomputed op gets a kernel of its own when its value is returned, read by a kernel that does
    not fuse (data movement), or is a matmul operand (no fusion into a contraction's body).
    """
    groups, alone = [], set()
    for gid, members in g.members.items():
        ops = set(members)
        stack = [(op, v.owner) for op in members for v in op.operands
                 if v.owner is not None and v.owner.name in REMATERIALIZABLE]
        while stack:
            reader, r = stack.pop()
            if r in ops:
                continue
            if g.kind[gid] in ("other", "fallback") or reader.name == "nova.matmul":
                alone.add(r)
                continue
            ops.add(r)
            stack.extend((r, v.owner) for v in r.operands if v.owner is not None and v.owner.name in REMATERIALIZABLE)
        groups.append(Group(sorted(ops, key=g.order.__getitem__), g.kind[gid], g.anchor[gid]))
    for op in g.func.ops:
        if op.name in REMATERIALIZABLE and (op in alone or any(r in g.returned for r in op.results)):
            groups.append(Group([op], "elementwise"))
    groups.sort(key=lambda grp: g.order[grp.root])
    return groups


def _name(op: Op) -> str:
    return op.name.removeprefix("nova.")
