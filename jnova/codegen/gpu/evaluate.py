"""A fused kernel's values at an index, computed in registers: the core both kernel builders share.

Evaluation runs backwards from what a kernel stores: an input is a load, an elementwise op applies
its linalg lowering rule to its operands' registers (see `emitter.GpuEmitter`), a broadcast or a
reshape evaluates its operand at the corresponding index, iota reads the index, a uniform constant
is a register, and the data-movement ops (transpose, slice, reverse, pad, concatenate, dynamic
slice, gather) evaluate their operand where the output element reads it (`remaps.py`). Values of a
smaller shape reached through broadcasts are recomputed where needed (the same trade XLA's loop
fusion makes; fusion keeps anything heavier than a load out of such places).

A `Point` says where: `lanes` consecutive elements (row-major) of a value, from flat offset `flat`;
`contiguous=False` means every lane is the same element (a value broadcast along the lanes). A
contiguous point of several lanes always starts at a multiple of its lane count, so its elements are
one aligned vector access. Each (value, point) is computed once per `Evaluator`, and an evaluator
serves one region of the kernel (a loop body, a tail branch), so every register it reuses dominates;
`branch` gives each side of an `scf.if` a child evaluator that also sees its parent's registers.
"""
from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass

import numpy as np

from jnova.codegen.gpu.emitter import ARG_ALIGN, GpuEmitter, flat_memref, is_splat, scalar_constant
from jnova.codegen.gpu.remaps import REMAP_OPS, evaluate_remap
from jnova.codegen.linalg.emitter import element, storage
from jnova.codegen.linalg.lowering import LOWERINGS
from jnova.errors import LoweringError
from jnova.dialect.ir import Op, Value
from jnova.dialect.ops import BroadcastOp, ConstantOp, ConvertOp, ElementwiseOp, IotaOp, ReshapeOp, SelectOp
from jnova.dialect.types import TensorType, itemsize

# Ops a register-level kernel computes (besides one reduction in the row-reduction kernel).
INDEX_OPS = (BroadcastOp, ReshapeOp, IotaOp, ConstantOp, *REMAP_OPS)
SCALAR_OPS = (ElementwiseOp, SelectOp, ConvertOp)


def unsupported_op(op: Op) -> str | None:
    """Why `op` cannot be evaluated in registers, or None if it can."""
    if isinstance(op, ConstantOp) and not is_splat(op.attrs["value"]):
        return f"'{op.name}' of shape {op.results[0].type.shape} is not uniform (pass it as a kernel input)"
    if isinstance(op, INDEX_OPS) or isinstance(op, SCALAR_OPS):
        return None
    return f"'{op.name}' is not an elementwise, index remap, iota or constant op"


def reads_at_own_offsets(ops) -> bool:
    """Whether every op reads its operands at its own row-major offsets, so vector lanes may run
    across rows (otherwise they must stay within the innermost dimension)."""
    for op in ops:
        if isinstance(op, (IotaOp, *REMAP_OPS)):
            return False
        if isinstance(op, BroadcastOp):
            x, out = op.operands[0].type, op.results[0].type
            if x.size != 1 and x.shape != out.shape:
                return False
    return True


@dataclass(eq=False)
class Point:
    shape: tuple[int, ...]
    lanes: int = 1
    contiguous: bool = True
    flat: str | None = None  # index SSA name of the first element's row-major offset
    coords: list[str] | None = None  # index SSA names of the first element's coordinates


class Evaluator:
    """Registers of kernel values at points. `memrefs` names the kernel's input arguments; `pinned`
    gives registers for values computed elsewhere (a reduction's result), valid at single-lane points."""

    def __init__(self, em: GpuEmitter, memrefs: dict[Value, str], pinned: dict[Value, str] | None = None):
        self.em = em
        self.memrefs = memrefs
        self.pinned = pinned or {}
        self.memo: dict[tuple[Value, Point], list[str]] = {}
        self.derived: dict[tuple[object, Point], Point] = {}  # (op or operand, point) -> its operand's point
        self.splits: dict[Point, list[Point]] = {}
        self.uniforms: dict[tuple[int, ...], Point] = {}

    def child(self) -> "Evaluator":
        """An evaluator for a region nested in this one's: it reuses this one's registers."""
        ev = Evaluator(self.em, self.memrefs, self.pinned)
        ev.memo, ev.derived = ChainMap({}, self.memo), ChainMap({}, self.derived)
        ev.splits, ev.uniforms = ChainMap({}, self.splits), ChainMap({}, self.uniforms)
        return ev

    def branch(self, cond: str, dtype: str, lanes: int, then, other) -> list[str]:
        """`lanes` registers of `dtype` from an `scf.if cond`: `then(ev)` / `other(ev)` return each
        side's registers, computed with a child evaluator of that side."""
        em, types = self.em, ", ".join([element(dtype)] * lanes)
        names = [em.fresh("r") for _ in range(lanes)]
        em.line(f"{', '.join(names)} = scf.if {cond} -> ({types}) {{")
        for side, build in (("} else {", then), ("}", other)):
            em.depth += 1
            em.line(f"scf.yield {', '.join(build(self.child()))} : {types}")
            em.depth -= 1
            em.line(side)
        return names

    def read(self, x: Value, coords: list[str], lanes: int = 1) -> list[str]:
        """`x` at the element with `coords` (and the `lanes` - 1 after it, along its innermost dim)."""
        return self.lanes(x, Point(x.type.shape, lanes, True, coords=list(coords)))

    # -- index arithmetic
    def flat(self, p: Point) -> str:
        if p.flat is None:
            em, terms, stride = self.em, [], 1
            for c, size in reversed(list(zip(p.coords, p.shape))):
                if size != 1:
                    terms.append(c if stride == 1 else em.op(f"arith.muli {c}, {em.index(stride)} : index"))
                stride *= size
            p.flat = terms[0] if terms else em.index(0)
            for t in terms[1:]:
                p.flat = em.op(f"arith.addi {p.flat}, {t} : index")
        return p.flat

    def coords(self, p: Point) -> list[str]:
        if p.coords is None:
            em, rest, coords = self.em, self.flat(p), []
            inner = [d for d, size in enumerate(p.shape) if size != 1]
            for d in reversed(range(len(p.shape))):
                size = p.shape[d]
                if size == 1:
                    coords.append(em.index(0))
                elif d == inner[0]:  # the outermost non-trivial dim takes what is left
                    coords.append(rest)
                else:
                    n = em.index(size)
                    coords.append(em.op(f"arith.remui {rest}, {n} : index"))
                    rest = em.op(f"arith.divui {rest}, {n} : index")
            p.coords = coords[::-1]
        return p.coords

    def split(self, p: Point) -> list[Point]:
        """The single-lane points of a contiguous point (with their coordinates where the lanes lie
        in one row: the lane number is then added to the innermost coordinate)."""
        if p not in self.splits:
            em, base = self.em, self.flat(p)
            in_row = p.shape and p.shape[-1] % p.lanes == 0
            coords = self.coords(p) if in_row else None
            points = [Point(p.shape, 1, True, flat=base, coords=coords)]
            for i in range(1, p.lanes):
                one = em.index(i)
                flat = em.op(f"arith.addi {base}, {one} : index")
                lane_coords = coords[:-1] + [em.op(f"arith.addi {coords[-1]}, {one} : index")] if in_row else None
                points.append(Point(p.shape, 1, True, flat=flat, coords=lane_coords))
            self.splits[p] = points
        return self.splits[p]

    def first_lane(self, p: Point) -> Point:
        """A single-lane point at the first element of `p`."""
        return Point(p.shape, 1, True, flat=p.flat, coords=p.coords)

    def uniform(self, shape: tuple[int, ...], lanes: int) -> Point:
        """The one element of a size-1 value, seen by every lane."""
        if lanes != 1:
            return Point(shape, lanes, False, coords=[self.em.index(0)] * len(shape))
        if shape not in self.uniforms:  # complete now: a child region may use it
            zero = self.em.index(0)
            self.uniforms[shape] = Point(shape, 1, False, flat=zero, coords=[zero] * len(shape))
        return self.uniforms[shape]

    # -- values
    def lanes(self, v: Value, p: Point) -> list[str]:
        """The registers of `v` at the `p.lanes` elements of point `p` (one name per lane)."""
        if v.type.shape != p.shape:
            raise LoweringError(f"internal: value {v.type} evaluated at a point of shape {p.shape}")
        if (v, p) not in self.memo:
            self.memo[v, p] = self._compute(v, p)
        return self.memo[v, p]

    def _compute(self, v: Value, p: Point) -> list[str]:
        if v in self.pinned:
            if p.lanes != 1:
                raise LoweringError("internal: a pinned value read at several lanes")
            return [self.pinned[v]]
        op = v.owner
        if op is None or v in self.memrefs:  # a kernel input: load it, never recompute its producer
            return self._load(v, p)
        if p.lanes > 1 and p.contiguous and self._needs_split(op, p):
            return [self.lanes(v, q)[0] for q in self.split(p)]
        if isinstance(op, BroadcastOp):
            return self._replicate(self.lanes(op.operands[0], self._broadcast_point(op, p)), p.lanes)
        if isinstance(op, ReshapeOp):
            q = self.derived.get((op, p)) or Point(op.operands[0].type.shape, p.lanes, p.contiguous, flat=self.flat(p))
            self.derived[op, p] = q
            return self.lanes(op.operands[0], q)
        if isinstance(op, REMAP_OPS):
            return evaluate_remap(self, op, p)
        if isinstance(op, IotaOp):
            return self._iota(op, p)
        if isinstance(op, ConstantOp):
            value = np.asarray(op.attrs["value"]).reshape(-1)[0]
            return [scalar_constant(self.em.scalar(), value, v.type.dtype)] * p.lanes
        if isinstance(op, SCALAR_OPS):
            return self._elementwise(op, p)
        raise LoweringError(unsupported_op(op) or f"'{op.name}' cannot be evaluated in registers")

    def _needs_split(self, op: Op, p: Point) -> bool:
        """A broadcast or iota whose lanes may cross a row of its result is evaluated lane by lane."""
        if isinstance(op, BroadcastOp):
            xt = op.operands[0].type
            if xt.size == 1 or xt.shape == p.shape:
                return False
        elif not isinstance(op, IotaOp):
            return False
        return not p.shape or p.shape[-1] % p.lanes != 0

    def _replicate(self, values: list[str], lanes: int) -> list[str]:
        return values * lanes if len(values) == 1 else values

    def _broadcast_point(self, op: BroadcastOp, p: Point) -> Point:
        xt, out, dims = op.operands[0].type, op.results[0].type, op.attrs["dims"]
        key = (op, p)
        if key not in self.derived:
            if xt.size == 1:
                q = self.uniform(xt.shape, 1)
            elif xt.shape == out.shape:
                q = p
            else:
                coords = self.coords(p)
                mapped = [coords[d] if xt.shape[i] != 1 else self.em.index(0) for i, d in enumerate(dims)]
                along_lanes = p.lanes > 1 and p.contiguous and dims[-1] == out.rank - 1 and xt.shape[-1] != 1
                q = Point(xt.shape, p.lanes if along_lanes else 1, along_lanes, coords=mapped)
            self.derived[key] = q
        return self.derived[key]

    def _iota(self, op: IotaOp, p: Point) -> list[str]:
        em, t, dim = self.em, op.results[0].type, op.attrs["dim"]
        s = em.scalar()
        base = self.coords(p)[dim] if t.rank else em.index(0)
        moving = p.contiguous and p.lanes > 1 and dim == t.rank - 1
        out = []
        for lane in range(p.lanes if moving else 1):
            i = base if lane == 0 else em.op(f"arith.addi {base}, {em.index(lane)} : index")
            out.append(s.cast(em.op(f"arith.index_cast {i} : index to i64"), "int64", t.dtype))
        return self._replicate(out, p.lanes)

    def _elementwise(self, op: Op, p: Point) -> list[str]:
        rule = LOWERINGS.get(op.name)
        if rule is None:
            raise LoweringError(f"no lowering rule for '{op.name}'")
        operands = []
        for x in op.operands:  # only a select's predicate may differ in shape (a scalar)
            if x.type.shape == p.shape:
                q = p
            else:
                q = self.derived.get((x, p)) or self.uniform(x.type.shape, 1)
                self.derived[x, p] = q
            operands.append(self._replicate(self.lanes(x, q), p.lanes))
        if all(len(set(lane_values)) == 1 for lane_values in operands):
            return [self._rule(rule, op, [xs[0] for xs in operands])] * p.lanes  # the same element on every lane
        return [self._rule(rule, op, [xs[lane] for xs in operands]) for lane in range(p.lanes)]

    def _rule(self, rule, op: Op, args: list[str]) -> str:
        out = rule(self.em, op, *args)
        return out if isinstance(out, str) else out[0]

    # -- memory
    def _load(self, v: Value, p: Point) -> list[str]:
        em, t = self.em, v.type
        st, mem = storage(t.dtype), self.memrefs[v]
        if p.lanes > 1 and p.contiguous:
            vec = f"vector<{p.lanes}x{st}>"
            loaded = em.op(f"vector.load {mem}[{self.flat(p)}] {{alignment = {vector_alignment(t, p.lanes)}}} : "
                           f"{flat_memref(t)}, {vec}")
            values = [em.op(f"vector.extract {loaded}[{lane}] : {st} from {vec}") for lane in range(p.lanes)]
        else:
            values = [em.op(f"memref.load {mem}[{self.flat(p)}] : {flat_memref(t)}")]
        if t.dtype == "bool":
            values = [em.op(f"arith.trunci {x} : i8 to i1") for x in values]
        return self._replicate(values, p.lanes)

    def store(self, v: Value, mem: str, p: Point) -> None:
        """Write `v` at the (contiguous) point `p` of the output `mem`."""
        em, t = self.em, v.type
        values, st = self.lanes(v, p), storage(t.dtype)
        if t.dtype == "bool":
            values = [em.op(f"arith.extui {x} : i1 to i8") for x in values]
        if p.lanes == 1:
            em.line(f"memref.store {values[0]}, {mem}[{self.flat(p)}] : {flat_memref(t)}")
            return
        vec = f"vector<{p.lanes}x{st}>"
        packed = em.op(f"vector.from_elements {', '.join(values)} : {vec}")
        em.line(f"vector.store {packed}, {mem}[{self.flat(p)}] {{alignment = {vector_alignment(t, p.lanes)}}} : "
                f"{flat_memref(t)}, {vec}")


def vector_alignment(t: TensorType, lanes: int) -> int:
    """Bytes a vector of `lanes` elements starting at a multiple of `lanes` is aligned to."""
    return min(ARG_ALIGN, lanes * itemsize(t.dtype))


def widest_vector(types: list[TensorType], inner: int | None) -> int:
    """Lanes per access: 16 bytes of the widest array, halved until it divides `inner` (None: no limit)."""
    lanes = max(1, ARG_ALIGN // max((itemsize(t.dtype) for t in types), default=4))
    while inner is not None and lanes > 1 and inner % lanes:
        lanes //= 2
    return lanes
