"""Strided views: where the elements of a value computed by reshapes, slices and transposes lie in the
row-major buffer they were taken from, so a kernel can read them there instead of from a copy.

A value `x` with `x = slice(reshape(buffer))` (GPT-2's q, k and v: heads of a fused projection
[B, T, 3 C] viewed as [B, T, 3 H, D] and sliced) is a *strided view* of `buffer`: element
(i0, ..., i_{r-1}) of `x` is element `offset + sum_k i_k * strides[k]` of the flat buffer. A slice
moves the offset and scales the strides, a transpose permutes them, and a reshape keeps the
elements where they are as long as every group of axes it merges or splits is itself laid out
contiguously (NumPy's rule for a reshape without a copy); otherwise there is no view and the value
must be computed (copied) first.

`strided_view` finds the view; `VIEWED_OPERANDS` says which operands of which ops their kernels read
through a view (the fused attention kernels: q, k, v, o and do, rows of D contiguous elements); and
`row_view_refusal` what such a kernel needs of the view (rows of whole 16-byte chunks).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from jnova.dialect.ir import Op, Value
from jnova.dialect.types import itemsize

VIEW_OPS = ("nova.reshape", "nova.slice", "nova.transpose")
# operands read through a view, per op: the attention kernels copy rows of D elements of q, k, v, o, do
VIEWED_OPERANDS = {"nova.attention": (0, 1, 2), "nova.attention_backward": (0, 1, 2, 3, 5),
                   "nova.attention_dq": (0, 1, 2, 3, 5), "nova.attention_dkdv": (0, 1, 2, 5)}
CHUNK_BYTES = 16  # the kernels copy rows in 16-byte chunks (cp.async) from 16-byte aligned buffers


@dataclass(frozen=True)
class StridedView:
    """`value`'s element (i0, ...) is element `offset + sum(i_k * strides[k])` of `base`'s row-major
    buffer; `ops` computes `value` from `base` (program order; empty when `value` is `base`)."""

    base: Value
    value: Value
    offset: int
    strides: tuple[int, ...]
    ops: tuple[Op, ...]


def row_major_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def strided_view(value: Value, inside: Callable[[Op], bool] = lambda op: True) -> StridedView | None:
    """The view of `value` in the buffer of the first value back along its reshapes, slices and
    transposes (only through ops `inside` accepts), or None where one of them copies."""
    chain, base = [], value
    while base.owner is not None and base.owner.name in VIEW_OPS and inside(base.owner):
        chain.append(base.owner)
        base = base.owner.operands[0]
    shape, offset, strides = base.type.shape, 0, row_major_strides(base.type.shape)
    for op in reversed(chain):
        a, out = op.attrs, op.results[0].type.shape
        if op.name == "nova.slice":
            offset += sum(s * st for s, st in zip(a["start"], strides))
            strides = tuple(st * step for st, step in zip(strides, a["strides"]))
        elif op.name == "nova.transpose":
            strides = tuple(strides[p] for p in a["perm"])
        else:
            strides = _reshaped(shape, strides, out)
            if strides is None:
                return None
        shape = out
    strides = tuple(0 if n == 1 else st for n, st in zip(shape, strides))  # a size-1 axis is never stepped
    return StridedView(base, value, offset, strides, tuple(reversed(chain)))


def _reshaped(shape, strides, new_shape) -> tuple[int, ...] | None:
    """The strides of `new_shape` over the same elements, or None where a merged or split group of
    axes is not contiguous (NumPy's `_attempt_nocopy_reshape`, row-major)."""
    if math.prod(shape) == 0:
        return None
    old = [(n, st) for n, st in zip(shape, strides) if n != 1]
    new = [0] * len(new_shape)
    kept = [i for i, n in enumerate(new_shape) if n != 1]
    oi = ni = 0
    while ni < len(kept) and oi < len(old):
        nj, oj = ni + 1, oi + 1
        np_, op_ = new_shape[kept[ni]], old[oi][0]
        while np_ != op_:
            if np_ < op_:
                np_ *= new_shape[kept[nj]]
                nj += 1
            else:
                op_ *= old[oj][0]
                oj += 1
        if any(old[k][1] != old[k + 1][0] * old[k + 1][1] for k in range(oi, oj - 1)):
            return None
        new[kept[nj - 1]] = old[oj - 1][1]
        for k in range(nj - 1, ni, -1):
            new[kept[k - 1]] = new[kept[k]] * new_shape[kept[k]]
        ni, oi = nj, oj
    return tuple(new)


def row_view_refusal(view: StridedView) -> str | None:
    """Why a kernel copying rows of a rank-4 operand's last axis in 16-byte chunks cannot read it
    through `view`, or None: the last axis must be contiguous and every row start 16-byte aligned."""
    t = view.value.type
    chunk = CHUNK_BYTES // itemsize(t.dtype)
    if t.rank != 4 or t.size == 0:
        return f"{t} is not a non-empty rank-4 tensor"
    if view.strides[-1] != 1 and t.shape[-1] != 1:
        return f"its last axis has stride {view.strides[-1]} in the buffer (rows must be contiguous)"
    if t.shape[-1] % chunk or view.offset % chunk or any(st % chunk for st in view.strides[:-1]):
        return (f"offset {view.offset} and strides {view.strides} are not whole {CHUNK_BYTES}-byte chunks "
                f"of {t.dtype}")
    return None


def viewed_positions(op: Op, value: Value) -> list[int]:
    """The positions at which `op` reads `value`, if it reads all of them through a view; else []."""
    positions = [i for i, x in enumerate(op.operands) if x is value]
    viewed = VIEWED_OPERANDS.get(op.name, ())
    return positions if positions and all(i in viewed for i in positions) else []


def concatenation_views(concat: Op, inside: Callable[[Op], bool] = lambda op: True) -> list[StridedView] | None:
    """Where each part of a concatenation lies in the buffer of its result: for operand i, the view of
    the value it is computed from by reshapes and transposes (only through ops `inside` accepts) in
    that buffer (`base` is the concatenation's result, `value` the part, `ops` the part's reshapes and
    transposes); None where one of them would copy. A kernel computing the part can write it there."""
    out = concat.results[0].type
    strides, axis = row_major_strides(out.shape), concat.attrs["dim"]
    views, start = [], 0
    for operand in concat.operands:
        chain, value = [], operand
        while value.owner is not None and value.owner.name in ("nova.reshape", "nova.transpose") \
                and inside(value.owner):
            chain.append(value.owner)
            value = value.owner.operands[0]
        shape, st = operand.type.shape, strides
        for op in chain:  # back from the operand to the value it is computed from
            x = op.operands[0].type.shape
            if op.name == "nova.transpose":
                inverse = [0] * len(st)
                for i, p in enumerate(op.attrs["perm"]):
                    inverse[p] = st[i]
                st = tuple(inverse)
            else:
                st = _reshaped(shape, st, x)
                if st is None:
                    return None
            shape = x
        st = tuple(0 if n == 1 else s for n, s in zip(shape, st))
        views.append(StridedView(concat.results[0], value, start * strides[axis], st, tuple(reversed(chain))))
        start += operand.type.shape[axis]
    return views
