"""Data movement at points: which operand element an output element of a remap op reads.

Transpose, slice, reverse, pad, concatenate, dynamic_slice and gather are evaluated the way
broadcasts and reshapes are (`evaluate.py`): the operand's coordinates are computed from those of
the output point and the operand is evaluated there, so a kernel reads through the op instead of
running it. The index rules are the CPU lowering's (`codegen/linalg/rules_index.py`, whose scalar
helpers do the clamping and range checks here too): dynamic slice starts and gather windows are
clamped so the window is in range, gather mode 'fill' yields `fill` for a window out of range, pad
reads its padding value outside the operand (and between interior elements).

A point of several contiguous lanes stays one vector access of the operand where the lanes move
along the operand's innermost dimension and start at a multiple of the lane count there
(`vector_read`); otherwise it is split into single lanes. Pad and concatenate pick the element
with `scf.if`, so only the element read is computed.
"""
from __future__ import annotations

from jnova.codegen.linalg.emitter import element
from jnova.codegen.index_arith import all_of, clamp, constant, in_range, window_at
from jnova.dialect.ir import Op
from jnova.dialect.ops import ConcatenateOp, DynamicSliceOp, GatherOp, PadOp, ReverseOp, SliceOp, TransposeOp
from jnova.dialect.types import UNSIGNED_DTYPES

REMAP_OPS = (TransposeOp, SliceOp, ReverseOp, PadOp, ConcatenateOp, DynamicSliceOp, GatherOp)


def evaluate_remap(ev, op: Op, p) -> list[str]:
    """The registers of `op`'s result at point `p` (one per lane), read through `ev`."""
    if p.lanes > 1 and not p.contiguous:  # every lane is the same element
        return evaluate_remap(ev, op, ev.first_lane(p)) * p.lanes
    if p.lanes > 1 and not vector_read(op, p.shape, p.lanes):
        return [evaluate_remap(ev, op, q)[0] for q in ev.split(p)]
    return _RULES[type(op)](ev, op, p)


def vector_read(op: Op, shape: tuple[int, ...], lanes: int) -> bool:
    """Whether `lanes` consecutive output elements of a row, from a multiple of `lanes`, read as many
    consecutive operand elements from a multiple of `lanes` (so one aligned vector access)."""
    if not shape or shape[-1] % lanes:
        return False
    x, last = op.operands[0].type, len(shape) - 1
    if isinstance(op, TransposeOp):
        return op.attrs["perm"][-1] == last
    if isinstance(op, SliceOp):
        return op.attrs["strides"][-1] == 1 and op.attrs["start"][-1] % lanes == 0 and x.shape[-1] % lanes == 0
    if isinstance(op, ReverseOp):
        return True
    if isinstance(op, PadOp):
        return op.attrs["low"][-1] == op.attrs["high"][-1] == op.attrs["interior"][-1] == 0
    if isinstance(op, ConcatenateOp):
        return op.attrs["dim"] != last or all(v.type.shape[-1] % lanes == 0 for v in op.operands)
    if isinstance(op, DynamicSliceOp):
        return op.attrs["sizes"][-1] == x.shape[-1]
    if isinstance(op, GatherOp):
        a, inner = op.attrs, x.rank - 1
        window = [d for d in range(x.rank) if d not in a["collapsed_slice_dims"] + a["operand_batching_dims"]]
        return (bool(a["offset_dims"]) and a["offset_dims"][-1] == last and window[-1] == inner
                and (inner not in a["start_index_map"] or a["slice_sizes"][inner] == x.shape[inner])
                and x.shape[-1] % lanes == 0)
    return False


# --------------------------------------------------------------------------- index arithmetic
def _plus(em, i: str, k: int) -> str:
    return i if k == 0 else em.op(f"arith.addi {i}, {em.index(k)} : index")


def _times(em, i: str, k: int) -> str:
    return i if k == 1 else em.op(f"arith.muli {i}, {em.index(k)} : index")


def _index_i64(s, v: str, dtype: str) -> str:
    """An integer register widened to i64 (zero-extended if unsigned), as `rules_index._load_index`."""
    if dtype in ("int64", "uint64"):
        return v
    ext = "extui" if dtype in UNSIGNED_DTYPES else "extsi"
    return s.op(f"arith.{ext} {v} : {element(dtype)} to i64")


# --------------------------------------------------------------------------- the ops
def _transpose(ev, op, p):
    coords, perm = ev.coords(p), op.attrs["perm"]
    reads = [None] * len(perm)
    for i, d in enumerate(perm):  # result dim i is operand dim perm[i]
        reads[d] = coords[i]
    return ev.read(op.operands[0], reads, p.lanes)


def _slice(ev, op, p):
    start, strides = op.attrs["start"], op.attrs["strides"]
    reads = [_plus(ev.em, _times(ev.em, c, strides[d]), start[d]) for d, c in enumerate(ev.coords(p))]
    return ev.read(op.operands[0], reads, p.lanes)


def _reverse(ev, op, p):
    em, shape, dims = ev.em, op.operands[0].type.shape, op.attrs["dims"]
    reads, last = list(ev.coords(p)), len(shape) - 1
    for d in dims:  # n - 1 - c; along the lanes, the vector starts at the last lane's element
        top = shape[d] - (p.lanes if d == last else 1)
        reads[d] = em.op(f"arith.subi {em.index(top)}, {reads[d]} : index")
    values = ev.read(op.operands[0], reads, p.lanes)
    return values[::-1] if last in dims else values


def _pad(ev, op, p):
    em, (x, value) = ev.em, op.operands
    xt, out = x.type, op.results[0].type
    pad = ev.lanes(value, ev.uniform((), 1))[0]
    if xt.size == 0:
        return [pad] * p.lanes
    lo, interior = op.attrs["low"], op.attrs["interior"]
    reads, inside = [], []
    for d, c in enumerate(ev.coords(p)):  # as rules_index's pad
        step, n = interior[d] + 1, xt.shape[d]
        at = _plus(em, c, -lo[d])  # position relative to x's first element (wraps when below it)
        if step == 1:
            reads.append(at)
            if lo[d] > 0 or lo[d] + n < out.shape[d]:
                inside.append(em.op(f"arith.cmpi ult, {at}, {em.index(n)} : index"))
            continue
        reads.append(em.op(f"arith.divui {at}, {em.index(step)} : index"))
        on_grid = em.op(f"arith.cmpi eq, {em.op(f'arith.remui {at}, {em.index(step)} : index')}, {em.index(0)} : index")
        within = em.op(f"arith.cmpi ule, {at}, {em.index((n - 1) * step)} : index")
        inside.append(em.op(f"arith.andi {on_grid}, {within} : i1"))
    if not inside:
        return ev.read(x, reads, p.lanes)
    return ev.branch(all_of(em.scalar(), inside), out.dtype, p.lanes,
                     lambda child: child.read(x, reads, p.lanes), lambda child: [pad] * p.lanes)


def _concatenate(ev, op, p):
    dim, out = op.attrs["dim"], op.results[0].type
    pieces, first = [], 0  # (operand, its first index along dim)
    for v in op.operands:
        if v.type.shape[dim]:
            pieces.append((v, first))
            first += v.type.shape[dim]
    coords = ev.coords(p)

    def read(e, k):
        v, start = pieces[k]
        return e.read(v, coords[:dim] + [_plus(e.em, coords[dim], -start)] + coords[dim + 1:], p.lanes)

    def piece(e, k):  # the element of pieces[k], or of a later piece
        if k + 1 == len(pieces):
            return read(e, k)
        before = e.em.op(f"arith.cmpi ult, {coords[dim]}, {e.em.index(pieces[k + 1][1])} : index")
        return e.branch(before, out.dtype, p.lanes, lambda e2: read(e2, k), lambda e2: piece(e2, k + 1))

    return piece(ev, 0)


def _dynamic_slice(ev, op, p):
    em, s, x = ev.em, ev.em.scalar(), op.operands[0]
    reads = []
    for d, (c, start) in enumerate(zip(ev.coords(p), op.operands[1:])):
        hi = x.type.shape[d] - op.attrs["sizes"][d]
        if hi == 0:  # the clamp makes the start 0
            reads.append(c)
            continue
        raw = _index_i64(s, ev.lanes(start, ev.uniform((), 1))[0], start.type.dtype)
        first = clamp(s, raw, hi, start.type.dtype in UNSIGNED_DTYPES)
        reads.append(em.op(f"arith.addi {c}, {first} : index"))
    return ev.read(x, reads, p.lanes)


def _gather(ev, op, p):
    em, s = ev.em, ev.em.scalar()
    a, (x, indices), out = op.attrs, op.operands, op.results[0].type
    xt, it = x.type, indices.type
    coords = ev.coords(p)
    batch = [coords[d] for d in range(out.rank) if d not in a["offset_dims"]]
    window_dims = [d for d in range(xt.rank) if d not in a["collapsed_slice_dims"] + a["operand_batching_dims"]]
    start, valid = {}, []
    for k, d in enumerate(a["start_index_map"]):  # as rules_index's gather
        raw = _index_i64(s, ev.read(indices, batch + [em.index(k)])[0], it.dtype)
        hi = xt.shape[d] - a["slice_sizes"][d]
        start[d] = clamp(s, raw, hi, it.dtype in UNSIGNED_DTYPES)
        if a["mode"] == "fill":
            valid.append(in_range(s, raw, hi))
    for d, bd in zip(a["operand_batching_dims"], a["start_indices_batching_dims"]):
        start[d] = batch[bd]
    offsets = {d: coords[o] for d, o in zip(window_dims, a["offset_dims"])}
    values = ev.read(x, window_at(s, xt.rank, start, offsets), p.lanes)
    if not valid:
        return values
    ok, fill, e = all_of(s, valid), constant(s, a["fill"], xt.dtype), element(xt.dtype)
    return [s.op(f"arith.select {ok}, {v}, {fill} : {e}") for v in values]


_RULES = {TransposeOp: _transpose, SliceOp: _slice, ReverseOp: _reverse, PadOp: _pad, ConcatenateOp: _concatenate,
          DynamicSliceOp: _dynamic_slice, GatherOp: _gather}
