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
- a value another kernel reads is recomputed there instead of crossing memory (as XLA's fusion
  duplicates a cheap producer into its consumers) when that moves fewer bytes: its elementwise
  expression back to the kernel's inputs (`MAX_RECOMPUTED_OPS` ops at most, no reduction or matmul in
  it) is copied into every reader, each reader loads the expression's inputs it does not load yet
  instead of the value, and the value is never written (`_Groups.recompute_cheap_values`). A
  LayerNorm's centred and normalized input, saved for the backward in f32, become the 16-bit input and
  two row statistics;
- ops without inputs (constants, iota), elementwise ops computed from those alone (constant
  expressions: a coefficient rounded to bf16, a mask comparing iotas) and the remaps that cost about
  one load per element (all of the above; a gather only where it reads whole rows of at least
  `MIN_GATHER_ROW` elements, an embedding lookup, so its index load is shared by a row; a widening of
  bf16 or f16 to f32, so a value rounded to 16 bits crosses between kernels in 16 bits) are copied
  into every group that reads them; they are a kernel of their own only where a reader cannot take a copy (a matmul, an op that
  is a kernel of its own) or where they are returned;
- no fusion into a contraction's body: a matmul's operands come from other kernels (a transposed or
  sliced operand is left for the matmul's operand layout);
- a contraction takes elementwise consumers over its output as its epilogue (bias, residual,
  activation), so linear + bias + residual (+ activation) is one kernel;
- a reduction takes elementwise producers over its input as a prologue and elementwise consumers
  over its output as an epilogue;
- scatter, dynamic_update_slice, attention (forward and backward: the flash-attention kernels read
  q, k, v and write o, lse, or the gradients, keeping the scores on chip) and fallbacks stay kernels
  (or XLA ops) of their own.
A group runs at the position of its last op: every other member is used only inside the group
(the copies of recomputed ops aside).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from jnova.dialect.ir import Func, Op, Value
from jnova.dialect.ops import ElementwiseOp
from jnova.dialect.types import itemsize
from jnova.passes import TRACE

log = logging.getLogger("jnova.passes")

ELEMENTWISE_NAMES = {"nova.select", "nova.convert", "nova.bitcast", "nova.constant", "nova.iota"}
# each element reads one element of an operand, at an index computed from its own
REMAP_NAMES = {"nova.broadcast", "nova.reshape", "nova.transpose", "nova.slice", "nova.reverse", "nova.pad",
               "nova.concatenate", "nova.dynamic_slice", "nova.gather"}
# copied into each group that reads them: no inputs, or one load per element (gathers: see below)
REMATERIALIZABLE = {"nova.constant", "nova.iota"} | REMAP_NAMES - {"nova.gather"}
WIDENED_FLOATS = ("bfloat16", "float16")
MIN_GATHER_ROW = 16  # a gather of whole rows at least this long is copied like a load
# what a contraction's epilogue may read its other inputs through (the matmul builder's epilogue)
EPILOGUE_COPIES = {"nova.constant", "nova.iota", "nova.broadcast", "nova.reshape"}
SCALAR_NAMES = {"nova.select", "nova.convert", "nova.bitcast"}
# kinds whose ops are kernels (or XLA ops) of their own: nothing fuses into or out of them
OWN_KERNEL_KINDS = ("other", "fallback", "attention")
MAX_RECOMPUTED_OPS = 16  # the longest expression copied into a reader instead of read from memory
# what a kernel launch costs, in bytes moved in the same time (a few microseconds of a GPU's ~3 TB/s,
# taken low): recomputing a group's every value in its readers saves its launch
LAUNCH_BYTES = 2**20


def kind_of(op: Op) -> str:
    if isinstance(op, ElementwiseOp) or op.name in ELEMENTWISE_NAMES or op.name in REMAP_NAMES:
        return "elementwise"
    if op.name == "nova.matmul":
        return "contraction"
    if op.name in ("nova.reduce", "nova.argreduce"):
        return "reduction"
    if op.name == "nova.fallback":
        return "fallback"
    if op.name in ("nova.attention", "nova.attention_backward", "nova.attention_dq", "nova.attention_dkdv"):
        return "attention"
    return "other"


def widens(op: Op) -> bool:
    """Whether `op` converts a 16-bit float to f32 (exactly: a load of the narrow value is cheaper
    than a load of the wide one)."""
    return op.name == "nova.convert" and op.operands[0].type.dtype in WIDENED_FLOATS \
        and op.results[0].type.dtype == "float32"


def recomputable(op: Op) -> bool:
    """Whether a copy of `op` in each group that reads it costs about one load per element."""
    if widens(op):
        return True
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
        self.input_free: set[Op] = set()  # ops computed from constants and iota alone
        self.remat |= self._constant_expressions()
        self.group: dict[Op, int] = {}
        self.members: dict[int, set[Op]] = {}
        self.kind: dict[int, str] = {}
        self.anchor: dict[int, Op | None] = {}
        for i, op in enumerate(func.ops):
            if op in self.remat:
                continue
            self.group[op], self.members[i], self.kind[i] = i, {op}, kind_of(op)
            self.anchor[i] = op if self.kind[i] in ("contraction", "reduction") else None

    def _constant_expressions(self) -> set[Op]:
        """Elementwise ops computed from constants and iota alone (through index remaps and other such
        ops): copied into each group that reads them, like the constants themselves (GELU's
        coefficients rounded to bf16 and widened, a causal mask comparing two iotas), never a tensor
        in memory. Where one is returned or a reader cannot copy it, it is a kernel of its own."""
        free, found = self.input_free, set()
        for op in self.func.ops:
            if op.name in ("nova.constant", "nova.iota"):
                free.add(op)
            elif kind_of(op) == "elementwise" and op.operands and all(v.owner in free for v in op.operands):
                free.add(op)
                if not recomputable(op) and not self._materialized(op):
                    found.add(op)
        return found

    def _materialized(self, op: Op) -> bool:
        """Whether a recomputable op needs its own kernel: it is returned, or a reader cannot copy it."""
        return any(r in self.returned for r in op.results) or any(
            u.name == "nova.matmul" or kind_of(u) in OWN_KERNEL_KINDS for r in op.results
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
        if pk in OWN_KERNEL_KINDS or ck in OWN_KERNEL_KINDS:
            return f"{pk if pk in OWN_KERNEL_KINDS else ck} ops are kernels of their own"
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
        out = anchor.results[0].type
        for op in members - {anchor}:  # elementwise over the result, or views of it that keep its rows
            t = op.results[0].type     # (a conversion of the result's reshape: its elements in C's order)
            if not (isinstance(op, ElementwiseOp) or op.name in SCALAR_NAMES or op.name == "nova.reshape") \
                    or t.size != out.size or (t.shape[-1:] != out.shape[-1:] and not self._converts_result(op, anchor)):
                return "the epilogue must iterate over the producer's output"
        for op in copies - {anchor}:
            if op.name not in EPILOGUE_COPIES and not widens(op) and op not in self.input_free:
                return f"a contraction's epilogue reads its inputs elementwise or broadcast, not through a {_name(op)}"
        return None

    def recompute_cheap_values(self) -> bool:
        """Turn the values that are cheaper to recompute in their reader kernels than to write and read
        back into recomputed ops (see the module docstring); True if any was. Candidates are taken from
        the last op back, so an expression is judged whole before its parts."""
        changed = False
        for op in reversed(self.func.ops):
            if op in self.group and self._crosses_kernels(op):
                cone = self._recomputable_cone(op)
                if cone is not None and self._recomputing_saves_bytes(cone):
                    for member in cone:
                        gid = self.group.pop(member)
                        self.members[gid].discard(member)
                        if not self.members[gid]:
                            del self.members[gid], self.kind[gid], self.anchor[gid]
                    self.remat |= cone
                    log.log(TRACE, "fuse: %s recomputed where it is read (%d ops)", _name(op), len(cone))
                    changed = True
        return changed

    def _crosses_kernels(self, op: Op) -> bool:
        return any(self.group[u] != self.group[op] for r in op.results for u in self.readers(r))

    def _recomputable_cone(self, op: Op) -> set[Op] | None:
        """The elementwise ops of `op`'s group that compute it from the group's inputs, if every one
        of them may be copied into each group that reads it (None otherwise)."""
        cone, stack = set(), [op]
        while stack:
            o = stack.pop()
            if o in cone:
                continue
            if not self._copyable(o):
                return None
            cone.add(o)
            if len(cone) > MAX_RECOMPUTED_OPS:
                return None
            stack.extend(v.owner for v in o.operands
                         if v.owner is not None and self.group.get(v.owner) == self.group[op])
        return cone

    def _copyable(self, op: Op) -> bool:
        """Whether copies of `op` in its readers' groups compute what the op's own group computed: an
        elementwise op of one result, not returned, each reader taking it at its own point (no
        broadcast, gather or transpose would compute it at many or other points), none of them a matmul or a kernel of its own
        (a contraction's epilogue reads its inputs through loads and broadcasts only)."""
        if not (isinstance(op, ElementwiseOp) or op.name in SCALAR_NAMES) or len(op.results) != 1:
            return False
        if op.results[0] in self.returned or self._materialized(op):
            return False
        stack = [op.results[0]]
        while stack:
            v = stack.pop()
            for u in self.users.get(v, ()):
                if any(read_of(u, i) != "same" and u.name not in ("nova.reduce", "nova.argreduce")
                       for i, x in enumerate(u.operands) if x is v):  # a reduction reads each element once
                    return False  # read at another point (moved) or at many: computed more than once per element
                if u in self.remat:
                    stack.extend(u.results)
                elif self.group[u] != self.group[op] and self.kind[self.group[u]] not in ("elementwise", "reduction"):
                    return False
        return True

    def _recomputing_saves_bytes(self, cone: set[Op]) -> bool:
        """Whether the cone's values that other groups read cost more to write and read back than
        the loads of the cone's inputs that those groups do not make yet (and, where the cone is
        its whole group, a kernel launch)."""
        inside = {r for o in cone for r in o.results}
        leaves = {v for o in cone for v in o.operands if v not in inside}
        loads: set = set()  # the values each cone input reaches through recomputed ops (it is loaded at those)
        stack = list(leaves)
        while stack:
            v = stack.pop()
            if v.owner is not None and v.owner in self.remat and v.owner not in cone:
                stack.extend(v.owner.operands)
            elif v.owner is None or v.owner not in self.input_free:
                loads.add(v)
        crossing = [o for o in cone if self._crosses_kernels(o)]
        readers = {self.group[u] for o in crossing for u in self.readers(o.results[0])} - {self.group[next(iter(cone))]}
        materialized = sum(_bytes(o.results[0]) * (1 + len({self.group[u] for u in self.readers(o.results[0])}
                                                          - {self.group[o]})) for o in crossing)
        recomputed = sum(_bytes(v) for gid in readers for v in loads - self._loaded_by(gid))
        if self.members[self.group[next(iter(cone))]] <= cone:
            materialized += LAUNCH_BYTES  # the group is nothing but the cone: no kernel of its own
        return recomputed <= materialized

    def _loaded_by(self, gid: int) -> set:
        """The values the group reads from memory (its members' operands that it does not compute)."""
        members = self.members[gid]
        out, stack = set(), [v for op in members for v in op.operands]
        while stack:
            v = stack.pop()
            if v.owner is not None and v.owner in members:
                continue
            if v.owner is not None and v.owner in self.remat:
                stack.extend(v.owner.operands)
            else:
                out.add(v)
        return out

    def _converts_result(self, op: Op, anchor: Op) -> bool:
        """Whether `op` is a float conversion of the anchor's result read through reshape copies."""
        if op.name != "nova.convert":
            return False
        v = op.operands[0]
        while v.owner is not None and v.owner in self.remat and v.owner.name == "nova.reshape":
            v = v.owner.operands[0]
        return v is anchor.results[0]

    def narrow_contraction_results(self) -> bool:
        """A contraction whose result is rounded to 16 bits by its only reader, a conversion in another
        group (an epilogue the contraction kernel cannot take: GELU's backward), takes the conversion
        into its kernel, so the result crosses memory in 16 bits; True if any did."""
        changed = False
        for gid in [gid for gid, anchor in self.anchor.items() if anchor is not None and anchor.name == "nova.matmul"]:
            if gid not in self.members:
                continue
            out = [r for op in self.members[gid] for r in op.results if r in self.returned or self.readers(r) - self.members[gid]]
            if len(out) != 1 or out[0] in self.returned:
                continue
            readers = self.readers(out[0])
            reader = next(iter(readers)) if len(readers) == 1 else None
            if reader is None or reader.name != "nova.convert" \
                    or reader.results[0].type.dtype not in WIDENED_FLOATS or out[0].type.dtype != "float32":
                continue
            other = self.group[reader]
            if other == gid or self.kind[other] not in ("elementwise", "reduction") \
                    or self.placement_refusal(self.members[gid] | {reader}) is not None:
                continue
            self.members[other].discard(reader)
            if not self.members[other]:
                del self.members[other], self.kind[other], self.anchor[other]
            self.members[gid].add(reader)
            self.group[reader] = gid
            changed = True
        return changed

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
    _merge_to_fixpoint(g)
    if g.recompute_cheap_values():  # fewer values between kernels: more producers have one user kernel
        _merge_to_fixpoint(g)
    g.narrow_contraction_results()
    refused = sorted({f"cannot fuse {_name(p)} into {_name(op)}: {g.refusal(p, op)}"
                      for op in func.ops if op in g.group for p in g.producers(op)
                      if g.group[p] != g.group[op]})
    for reason in refused:
        log.log(TRACE, "fuse: %s", reason)
    return Fusion(_with_copies(g), refused)


def _merge_to_fixpoint(g: _Groups) -> None:
    changed = True
    while changed:
        changed = False
        for op in reversed(g.func.ops):
            if op not in g.group:
                continue
            for producer in g.producers(op):
                if g.group[producer] != g.group[op] and g.refusal(producer, op) is None:
                    g.merge(producer, op)
                    changed = True


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


def _bytes(v: Value) -> int:
    return v.type.size * itemsize(v.type.dtype)


def _name(op: Op) -> str:
    return op.name.removeprefix("nova.")
