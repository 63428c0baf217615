"""linalg lowerings of nova ops that index: slices, concatenate, pad, reverse, gather, scatter, argreduce.

Every result is computed by a `linalg.generic` over a fresh tensor (or, for scatter, an `scf.for`
nest that updates one tensor in place) whose body reads its operands with `tensor.extract` at
positions computed in `index` arithmetic (clamped or range-checked where they come from runtime
indices). Nothing returns a view of another tensor: the CPU pipeline links no runtime library for a
strided `memref.copy`, which `tensor.extract_slice`/`insert_slice` results would need.

Out-of-bounds rules (those of XLA on the CPU): dynamic slice starts and gather windows are clamped
so the whole window is in range (gather mode 'fill' yields `fill` instead); scatter windows are
clamped in mode 'clip' and dropped whole otherwise. Unsigned indices compare as unsigned.
"""
from __future__ import annotations


from jnova.codegen.index_arith import add_index, all_of, clamp, constant, in_range, window_at
from jnova.codegen.linalg.emitter import Scalar, affine_map, compute_dtype, element, identity_map, tensor
from jnova.codegen.linalg.lowering import lowering
from jnova.codegen.linalg.rules_reduce import combine, reduce_init
from jnova.dialect.types import FLOAT_DTYPES, UNSIGNED_DTYPES, TensorType

SCATTER_COMBINE = {"add": "sum", "mul": "prod", "min": "min", "max": "max"}


# --------------------------------------------------------------------------- scalar helpers
def _stored(dtype: str) -> str:
    """The element type of `dtype` inside a tensor (bool may be stored wider than i1)."""
    return tensor(TensorType((), dtype))[len("tensor<"):-1]


def _extract(s: Scalar, x: str, t: TensorType, coords) -> str:
    """Load x[coords] as a scalar of the body's element type (`i1` for bool)."""
    v = s.op(f"tensor.extract {x}[{', '.join(coords)}] : {tensor(t)}")
    return _from_storage(s, v, t.dtype)


def _from_storage(s: Scalar, v: str, dtype: str) -> str:
    stored = _stored(dtype)
    return v if stored == element(dtype) else s.op(f"arith.trunci {v} : {stored} to {element(dtype)}")


def _to_storage(s: Scalar, v: str, dtype: str) -> str:
    stored = _stored(dtype)
    return v if stored == element(dtype) else s.op(f"arith.extui {v} : {element(dtype)} to {stored}")


def _load_index(s: Scalar, x: str, t: TensorType, coords) -> str:
    """An integer tensor element widened to i64 (zero-extended if unsigned)."""
    v = _extract(s, x, t, coords)
    if t.dtype in ("int64", "uint64"):
        return v
    return s.op(f"arith.{'extui' if t.dtype in UNSIGNED_DTYPES else 'extsi'} {v} : {element(t.dtype)} to i64")


def _if(s: Scalar, cond: str, type_: str, then, other) -> str:
    """`scf.if cond -> type_`; `then`/`other` build each branch with a Scalar and return its value."""
    em, result = s.em, s.em.fresh()
    inner = Scalar(em, s.indent + "  ")
    em.lines.append(f"{s.indent}{result} = scf.if {cond} -> ({type_}) {{")
    em.lines.append(f"{s.indent}  scf.yield {then(inner)} : {type_}")
    em.lines.append(f"{s.indent}}} else {{")
    em.lines.append(f"{s.indent}  scf.yield {other(inner)} : {type_}")
    em.lines.append(f"{s.indent}}}")
    return result


def _over(em, out: TensorType, body, ins=()) -> str:
    """An all-parallel generic writing every element of a fresh `out`; `ins` use identity maps."""
    m = identity_map(out.rank)
    return em.generic([(v, t, m) for v, t in ins], [(em.empty(out), out, m)], ["parallel"] * out.rank, body)[0]


def _starts(em, op, starts: list[str], window) -> list[str]:
    """Runtime start indices (scalar tensors) clamped so that `window` fits, as `index` values."""
    s, xt = Scalar(em, "  "), op.operands[0].type
    out = []
    for d, (v, operand) in enumerate(zip(starts, op.variadic_operands())):
        raw = _load_index(s, v, operand.type, [])
        out.append(clamp(s, raw, xt.shape[d] - window[d], operand.type.dtype in UNSIGNED_DTYPES))
    return out


# --------------------------------------------------------------------------- static data movement
@lowering("nova.slice")
def _slice(em, op, x):
    # reads use index arithmetic, not an affine map: linalg insists that a map result that is a bare
    # loop dimension (a prefix slice, `x[:3]`) spans the whole operand dimension
    xt, out = op.operands[0].type, op.results[0].type
    if out.size == 0:
        return em.empty(out)

    def read(s, d):
        at = s.index(d)
        if op.attrs["strides"][d] != 1:
            at = s.op(f"arith.muli {at}, {s.index_const(op.attrs['strides'][d])} : index")
        return add_index(s, at, op.attrs["start"][d])

    return _over(em, out, lambda s, a: _extract(s, x, xt, [read(s, d) for d in range(out.rank)]))


@lowering("nova.reverse")
def _reverse(em, op, x):
    xt, dims = op.operands[0].type, op.attrs["dims"]
    if xt.size == 0:
        return em.empty(xt)
    reads = [f"{xt.shape[d] - 1} - d{d}" if d in dims else d for d in range(xt.rank)]
    return em.generic([(x, xt, affine_map(xt.rank, reads))], [(em.empty(xt), xt, identity_map(xt.rank))],
                      ["parallel"] * xt.rank, lambda s, a: a[0])[0]


@lowering("nova.concatenate")
def _concatenate(em, op, *xs):
    out, dim = op.results[0].type, op.attrs["dim"]
    pieces, offset = [], 0  # (value, type, first index along dim)
    for v, operand in zip(xs, op.operands):
        if operand.type.shape[dim]:
            pieces.append((v, operand.type, offset))
            offset += operand.type.shape[dim]
    if out.size == 0:
        return em.empty(out)

    def body(s, args):
        coords = [s.index(d) for d in range(out.rank)]

        def read(s, k):
            v, t, first = pieces[k]
            return _extract(s, v, t, coords[:dim] + [add_index(s, coords[dim], -first)] + coords[dim + 1:])

        def piece(s, k):  # the element of pieces[k], or of a later piece
            if k + 1 == len(pieces):
                return read(s, k)
            before = s.op(f"arith.cmpi ult, {coords[dim]}, {s.index_const(pieces[k + 1][2])} : index")
            return _if(s, before, element(out.dtype), lambda s: read(s, k), lambda s: piece(s, k + 1))

        return piece(s, 0)

    return _over(em, out, body)


@lowering("nova.pad")
def _pad(em, op, x, value):
    xt, out = op.operands[0].type, op.results[0].type
    lo, interior = op.attrs["low"], op.attrs["interior"]
    if out.size == 0:
        return em.empty(out)
    pad = _extract(Scalar(em, "  "), value, op.operands[1].type, [])
    if xt.size == 0:
        return _over(em, out, lambda s, a: pad)

    def body(s, args):
        reads, inside = [], []
        for d in range(out.rank):
            step, n = interior[d] + 1, xt.shape[d]
            p = add_index(s, s.index(d), -lo[d])  # position relative to x's first element
            if step == 1:
                reads.append(p)
                if lo[d] > 0 or lo[d] + n < out.shape[d]:
                    inside.append(s.op(f"arith.cmpi ult, {p}, {s.index_const(n)} : index"))
                continue
            reads.append(s.op(f"arith.divui {p}, {s.index_const(step)} : index"))
            on_grid = s.op(f"arith.cmpi eq, {s.op(f'arith.remui {p}, {s.index_const(step)} : index')}, "
                           f"{s.index_const(0)} : index")
            within = s.op(f"arith.cmpi ule, {p}, {s.index_const((n - 1) * step)} : index")
            inside.append(s.op(f"arith.andi {on_grid}, {within} : i1"))
        if not inside:
            return _extract(s, x, xt, reads)
        return _if(s, all_of(s, inside), element(out.dtype), lambda s: _extract(s, x, xt, reads), lambda s: pad)

    return _over(em, out, body)


# --------------------------------------------------------------------------- dynamic slices
@lowering("nova.dynamic_slice")
def _dynamic_slice(em, op, x, *starts):
    xt, out = op.operands[0].type, op.results[0].type
    if out.size == 0:
        return em.empty(out)
    first = _starts(em, op, list(starts), op.attrs["sizes"])
    return _over(em, out, lambda s, a: _extract(s, x, xt, [add_index(s, s.index(d), f) for d, f in enumerate(first)]))


@lowering("nova.dynamic_update_slice")
def _dynamic_update_slice(em, op, x, update, *starts):
    xt, ut = op.operands[0].type, op.operands[1].type
    if ut.size == 0:
        return x
    first = _starts(em, op, list(starts), ut.shape)

    def body(s, args):
        reads, inside = [], []
        for d in range(xt.rank):
            r = s.op(f"arith.subi {s.index(d)}, {first[d]} : index")
            reads.append(r)
            if ut.shape[d] < xt.shape[d]:
                inside.append(s.op(f"arith.cmpi ult, {r}, {s.index_const(ut.shape[d])} : index"))
        if not inside:
            return _extract(s, update, ut, reads)
        return _if(s, all_of(s, inside), element(xt.dtype), lambda s: _extract(s, update, ut, reads), lambda s: args[0])

    return _over(em, xt, body, ins=[(x, xt)])


# --------------------------------------------------------------------------- gather
@lowering("nova.gather")
def _gather(em, op, x, indices):
    a, xt, it, out = op.attrs, op.operands[0].type, op.operands[1].type, op.results[0].type
    if out.size == 0:
        return em.empty(out)
    batch_dims = [d for d in range(out.rank) if d not in a["offset_dims"]]
    window_dims = [d for d in range(xt.rank) if d not in a["collapsed_slice_dims"] + a["operand_batching_dims"]]
    unsigned = it.dtype in UNSIGNED_DTYPES

    def body(s, args):
        coords = [s.index(d) for d in range(out.rank)]
        batch = [coords[d] for d in batch_dims]
        start: dict[int, str] = {}
        valid = []
        for k, d in enumerate(a["start_index_map"]):
            raw = _load_index(s, indices, it, batch + [s.index_const(k)])
            hi = xt.shape[d] - a["slice_sizes"][d]
            start[d] = clamp(s, raw, hi, unsigned)
            if a["mode"] == "fill":
                valid.append(in_range(s, raw, hi))
        for d, bd in zip(a["operand_batching_dims"], a["start_indices_batching_dims"]):
            start[d] = batch[bd]
        offsets = {d: coords[o] for d, o in zip(window_dims, a["offset_dims"])}
        v = _extract(s, x, xt, window_at(s, xt.rank, start, offsets))
        if not valid:
            return v
        return s.op(f"arith.select {all_of(s, valid)}, {v}, {constant(s, a['fill'], xt.dtype)} : {element(xt.dtype)}")

    return _over(em, out, body)


# --------------------------------------------------------------------------- scatter
@lowering("nova.scatter")
def _scatter(em, op, x, indices, updates):
    """Updates in XLA's order: scatter indices outer, each window inner, one tensor carried in place."""
    a, xt, it, ut = op.attrs, op.operands[0].type, op.operands[1].type, op.operands[2].type
    if ut.size == 0:
        return x
    scatter_dims = [d for d in range(ut.rank) if d not in a["update_window_dims"]]
    window_dims = [d for d in range(xt.rank) if d not in a["inserted_window_dims"] + a["operand_batching_dims"]]
    window = [1] * xt.rank
    for d, u in zip(window_dims, a["update_window_dims"]):
        window[d] = ut.shape[u]
    top = Scalar(em, "  ")
    zero, one = top.index_const(0), top.index_const(1)
    acc_type = tensor(xt)

    def loops(s, dims, acc, body, ivs=()):
        """An scf.for nest over updates dims `dims` carrying `acc`; body(s, ivs, acc) -> new acc."""
        if not dims:
            return body(s, list(ivs), acc)
        iv, arg, result = em.fresh("i"), em.fresh("acc"), em.fresh()
        bound = s.index_const(ut.shape[dims[0]])
        em.lines.append(f"{s.indent}{result} = scf.for {iv} = {zero} to {bound} step {one} "
                        f"iter_args({arg} = {acc}) -> ({acc_type}) {{")
        inner = Scalar(em, s.indent + "  ")
        em.lines.append(f"{inner.indent}scf.yield {loops(inner, dims[1:], arg, body, (*ivs, iv))} : {acc_type}")
        em.lines.append(f"{s.indent}}}")
        return result

    def per_index(s, batch, acc):
        start: dict[int, str] = {}
        valid = []
        for k, d in enumerate(a["scatter_dims_to_operand_dims"]):
            raw = _load_index(s, indices, it, batch + [s.index_const(k)])
            start[d] = clamp(s, raw, xt.shape[d] - window[d], it.dtype in UNSIGNED_DTYPES)
            if a["mode"] != "clip":
                valid.append(in_range(s, raw, xt.shape[d] - window[d]))
        for d, bd in zip(a["operand_batching_dims"], a["scatter_indices_batching_dims"]):
            start[d] = batch[bd]

        def update_window(s):
            def one(s, w, acc):
                at = window_at(s, xt.rank, start, dict(zip(window_dims, w)))
                return _combine_one(s, op, acc, updates, batch, w, at)

            return loops(s, list(a["update_window_dims"]), acc, one)

        if not valid:
            return update_window(s)
        return _if(s, all_of(s, valid), acc_type, update_window, lambda s: acc)

    return loops(top, scatter_dims, x, per_index)


def _combine_one(s, op, acc, updates, batch, window_ivs, at):
    """acc[at] = acc[at] (+) updates[batch, window_ivs]; returns the new acc."""
    a, xt, ut = op.attrs, op.operands[0].type, op.operands[2].type
    b_iter, w_iter = iter(batch), iter(window_ivs)
    u_at = [next(w_iter) if d in a["update_window_dims"] else next(b_iter) for d in range(ut.rank)]
    u = _extract(s, updates, ut, u_at)
    if a["kind"] == "set":
        new = u
    else:
        wide = compute_dtype(xt.dtype)  # 16-bit floats: one f32 operation, rounded, per update
        old = s.cast(_extract(s, acc, xt, at), xt.dtype, wide)
        new = s.cast(combine(s, SCATTER_COMBINE[a["kind"]], wide, old, s.cast(u, xt.dtype, wide)), wide, xt.dtype)
    return s.op(f"tensor.insert {_to_storage(s, new, xt.dtype)} into {acc}[{', '.join(at)}] : {tensor(xt)}")


# --------------------------------------------------------------------------- argmax / argmin
@lowering("nova.argreduce")
def _argreduce(em, op, x):
    """First index of the max (min); a NaN beats every number, and the first NaN wins (as XLA)."""
    xt, out, axis, kind = op.operands[0].type, op.results[0].type, op.attrs["axis"], op.attrs["kind"]
    if out.size == 0:
        return em.empty(out)
    values = out.with_dtype(xt.dtype)
    kept = [d for d in range(xt.rank) if d != axis]
    outs = [(em.filled(values, reduce_init(kind, xt.dtype)), values, affine_map(xt.rank, kept)),
            (em.filled(out, 0), out, affine_map(xt.rank, kept))]
    e = element(xt.dtype)

    def body(s, args):
        v, best, best_at = args
        if xt.dtype in FLOAT_DTYPES:
            better = s.op(f"arith.cmpf {'ogt' if kind == 'max' else 'olt'}, {v}, {best} : {e}")
            new_nan = s.op(f"arith.andi {s.op(f'arith.cmpf uno, {v}, {v} : {e}')}, "
                           f"{s.op(f'arith.cmpf ord, {best}, {best} : {e}')} : i1")
            better = s.op(f"arith.ori {better}, {new_nan} : i1")
        else:
            unsigned = xt.dtype in UNSIGNED_DTYPES or xt.dtype == "bool"
            pred = ("u" if unsigned else "s") + ("gt" if kind == "max" else "lt")
            better = s.op(f"arith.cmpi {pred}, {v}, {best} : {e}")
        at = s.cast(s.op(f"arith.index_cast {s.index(axis)} : index to i64"), "int64", out.dtype)
        return [s.op(f"arith.select {better}, {v}, {best} : {e}"),
                s.op(f"arith.select {better}, {at}, {best_at} : {element(out.dtype)}")]

    iters = ["reduction" if d == axis else "parallel" for d in range(xt.rank)]
    return em.generic([(x, xt, identity_map(xt.rank))], outs, iters, body)[1]
