"""Conversion rules for slicing, concatenation, padding, tiling, gather/scatter, arg- and cumulative reductions.

Out-of-bounds behaviour follows what `jax.jit` does on the CPU: gather windows are clamped into
range (`clip`, `promise_in_bounds`) or replaced by a fill value (`fill`); scatter windows are
clamped (`clip`) or dropped whole (`fill` and `promise_in_bounds`, which XLA treats alike).
Cumulative reductions become an O(n^2) masked reduction, the form XLA's CPU rewrite also uses.
"""
from __future__ import annotations

import numpy as np

from jnova.capture.to_nova import Unsupported, out_type, rule
from jnova.dialect.types import FLOAT_DTYPES, UNSIGNED_DTYPES, TensorType

# GatherScatterMode names -> the nova `mode` attribute
MODES = {"CLIP": "clip", "FILL_OR_DROP": "fill", "PROMISE_IN_BOUNDS": "promise_in_bounds"}
# scatter primitive -> nova.scatter `kind` (scatter-sub adds the negated updates)
SCATTER_KINDS = {"scatter": "set", "scatter-add": "add", "scatter-sub": "add", "scatter-mul": "mul",
                 "scatter-min": "min", "scatter-max": "max"}
CUMULATIVE = {"cumsum": "sum", "cumprod": "prod", "cummax": "max", "cummin": "min"}


def _ints(xs) -> tuple[int, ...]:
    return tuple(int(x) for x in xs)


def _mode(eqn) -> str:
    mode = eqn.params["mode"]
    name = getattr(mode, "name", str(mode))
    if name not in MODES:
        raise Unsupported(f"mode {name}")
    return MODES[name]


# --------------------------------------------------------------------------- slices
@rule("slice")
def _slice(b, eqn, x):
    start = _ints(eqn.params["start_indices"])
    limit = _ints(eqn.params["limit_indices"])
    strides = _ints(eqn.params["strides"] or (1,) * len(start))
    if start == (0,) * len(start) and limit == x.type.shape and set(strides) <= {1}:
        return x
    return b.emit("nova.slice", [x], out_type(eqn), start=start, limit=limit, strides=strides)


@rule("split")
def _split(b, eqn, x):
    axis, outs, offset = int(eqn.params["axis"]), [], 0
    for i, size in enumerate(_ints(eqn.params["sizes"])):
        start = tuple(offset if d == axis else 0 for d in range(x.type.rank))
        limit = tuple(offset + size if d == axis else n for d, n in enumerate(x.type.shape))
        outs.append(b.emit("nova.slice", [x], out_type(eqn, i), start=start, limit=limit, strides=(1,) * x.type.rank))
        offset += size
    return outs


@rule("dynamic_slice")
def _dynamic_slice(b, eqn, x, *starts):
    if len(starts) != x.type.rank:
        raise Unsupported("dynamic shapes")
    return b.emit("nova.dynamic_slice", [x, *starts], out_type(eqn), sizes=_ints(eqn.params["slice_sizes"]))


@rule("dynamic_update_slice")
def _dynamic_update_slice(b, eqn, x, update, *starts):
    return b.emit("nova.dynamic_update_slice", [x, update, *starts], out_type(eqn))


@rule("concatenate")
def _concatenate(b, eqn, *xs):
    if len(xs) == 1:
        return xs[0]
    return b.emit("nova.concatenate", list(xs), out_type(eqn), dim=int(eqn.params["dimension"]))


@rule("stack")
def _stack(b, eqn, *xs):
    """jnp.stack (a primitive since JAX 0.10): each input gets a unit dimension at `axis`, then one concatenation."""
    axis = int(eqn.params["axis"])
    pieces = [b.emit("nova.reshape", [x], x.type.with_shape(x.type.shape[:axis] + (1,) + x.type.shape[axis:]))
              for x in xs]
    return pieces[0] if len(pieces) == 1 else b.emit("nova.concatenate", pieces, out_type(eqn), dim=axis)


@rule("unstack")
def _unstack(b, eqn, x):
    """The transpose of stack: slice i along `axis`, without that dimension, for every i."""
    axis, t, outs = int(eqn.params["axis"]), x.type, []
    for i in range(t.shape[axis]):
        start = tuple(i if d == axis else 0 for d in range(t.rank))
        limit = tuple(i + 1 if d == axis else n for d, n in enumerate(t.shape))
        piece = b.emit("nova.slice", [x], t.with_shape(t.shape[:axis] + (1,) + t.shape[axis + 1:]),
                       start=start, limit=limit, strides=(1,) * t.rank)
        outs.append(b.emit("nova.reshape", [piece], out_type(eqn, i)))
    return outs


@rule("pad")
def _pad(b, eqn, x, value):
    lo, hi, interior = (tuple(int(c[i]) for c in eqn.params["padding_config"]) for i in range(3))
    if not any(lo + hi + interior):
        return x
    return b.emit("nova.pad", [x, value], out_type(eqn), low=lo, high=hi, interior=interior)


@rule("tile")
def _tile(b, eqn, x):
    """x repeated reps[d] times along each d: broadcast to (reps[0], n0, reps[1], n1, ...), then merge pairs."""
    reps, t = _ints(eqn.params["reps"]), x.type
    if set(reps) <= {1}:
        return x
    spread = t.with_shape(tuple(n for pair in zip(reps, t.shape) for n in pair))
    x = b.emit("nova.broadcast", [x], spread, dims=tuple(2 * d + 1 for d in range(t.rank)))
    return b.emit("nova.reshape", [x], out_type(eqn))


@rule("rev")
def _rev(b, eqn, x):
    dims = tuple(sorted(_ints(eqn.params["dimensions"])))
    if not [d for d in dims if x.type.shape[d] > 1]:
        return x
    return b.emit("nova.reverse", [x], out_type(eqn), dims=dims)


# --------------------------------------------------------------------------- gather / scatter
@rule("gather")
def _gather(b, eqn, x, indices):
    dn, mode, dtype = eqn.params["dimension_numbers"], _mode(eqn), x.type.dtype
    fill = gather_fill(dtype, eqn.params.get("fill_value")) if mode == "fill" else 0.0
    return b.emit("nova.gather", [x, indices], out_type(eqn), offset_dims=_ints(dn.offset_dims),
                  collapsed_slice_dims=_ints(dn.collapsed_slice_dims), start_index_map=_ints(dn.start_index_map),
                  operand_batching_dims=_ints(dn.operand_batching_dims),
                  start_indices_batching_dims=_ints(dn.start_indices_batching_dims),
                  slice_sizes=_ints(eqn.params["slice_sizes"]), mode=mode, fill=fill)


def gather_fill(dtype: str, fill_value) -> float | int:
    """JAX's value for out-of-bounds gather windows: NaN, the integer minimum (maximum if unsigned), true."""
    if fill_value is None:
        if dtype in FLOAT_DTYPES:
            return float("nan")
        if dtype == "bool":
            return 1
        info = np.iinfo(dtype)
        return int(info.max if dtype in UNSIGNED_DTYPES else info.min)
    if dtype in FLOAT_DTYPES:
        return float(fill_value)
    return int(bool(fill_value)) if dtype == "bool" else int(fill_value)


@rule(*SCATTER_KINDS)
def _scatter(b, eqn, x, indices, updates):
    name, dn, p = eqn.primitive.name, eqn.params["dimension_numbers"], eqn.params
    if name == "scatter" and p.get("update_jaxpr") is not None:
        raise Unsupported("a custom update computation (scatter_apply)")
    if p.get("update_consts"):
        raise Unsupported("update computation with constants")
    if name == "scatter-sub":  # x - u is exactly x + (-u), in every dtype
        updates = b.emit("nova.neg", [updates], updates.type)
    return b.emit("nova.scatter", [x, indices, updates], out_type(eqn), kind=SCATTER_KINDS[name],
                  update_window_dims=_ints(dn.update_window_dims), inserted_window_dims=_ints(dn.inserted_window_dims),
                  scatter_dims_to_operand_dims=_ints(dn.scatter_dims_to_operand_dims),
                  operand_batching_dims=_ints(dn.operand_batching_dims),
                  scatter_indices_batching_dims=_ints(dn.scatter_indices_batching_dims), mode=_mode(eqn))


# --------------------------------------------------------------------------- arg-reductions, scans
@rule("argmax", "argmin")
def _argreduce(b, eqn, x):
    (axis,) = _ints(eqn.params["axes"])
    return b.emit("nova.argreduce", [x], out_type(eqn), kind=eqn.primitive.name[3:], axis=axis)


@rule(*CUMULATIVE)
def _cumulative(b, eqn, x):
    """out[i] = reduce(x[j] for j <= i) (j >= i if reversed): x broadcast along a new axis i, masked, reduced."""
    axis, reverse, t = int(eqn.params["axis"]), bool(eqn.params["reverse"]), x.type
    n = t.shape[axis]
    if n <= 1:
        return x
    kind = CUMULATIVE[eqn.primitive.name]
    # wide[..., i, j, ...] = x[..., j, ...]; the new axis i sits just before the scanned axis j
    wide = t.with_shape(t.shape[:axis] + (n,) + t.shape[axis:])
    spread = b.emit("nova.broadcast", [x], wide, dims=tuple(d + (d >= axis) for d in range(t.rank)))
    index = TensorType(wide.shape, "int32")
    i = b.emit("nova.iota", [], index, dim=axis)
    j = b.emit("nova.iota", [], index, dim=axis + 1)
    keep = b.emit("nova.compare", [j, i], index.with_dtype("bool"), predicate="ge" if reverse else "le")
    identity = b.broadcast_to(b.constant(_reduce_identity(kind, t.dtype), t.dtype), wide.shape)
    masked = b.emit("nova.select", [keep, identity, spread], wide)
    return b.emit("nova.reduce", [masked], out_type(eqn), kind=kind, dims=(axis + 1,))


def _reduce_identity(kind: str, dtype: str):
    if kind in ("sum", "prod"):
        return int(kind == "prod")
    if dtype in FLOAT_DTYPES:
        return -np.inf if kind == "max" else np.inf
    if dtype == "bool":
        return kind == "min"
    info = np.iinfo(dtype)
    return int(info.min if kind == "max" else info.max)
