"""view_attention_operands: attention kernels read q, k, v (o, do) where they lie, not from copies.

A step that splits a fused projection (`qkv = Dense(3 C)(x)`, then q, k, v as slices of its last
axis, each reshaped to [B, T, H, D]) makes the slices' fusion group a kernel that copies the three
parts out of the [B, T, 3 C] buffer, and every attention kernel (forward, dQ, dK/dV) reads the
copies. The attention kernels copy their operands' rows into shared memory anyway, D elements at a
time, from any row stride and offset: so a group that only reshapes, slices or transposes buffers
(`strided_views.VIEW_OPS`) for attention ops to read, each output a view the kernels can read
(`strided_views.row_view_refusal`: rows contiguous and 16-byte aligned), is dissolved and each
reader's group takes its own copy of the ops between the buffer and its operand. The kernel then
reads the buffer itself, and its builder finds the view from those ops (`strided_views.strided_view`).

A group is left as it is where any of its values is returned or read by another op (or by an
attention op at a position it does not read through a view: lse, delta, a bias), where it does more
than remap (a convert, an add), or where it is only reshapes (a reshape moves no data: the plan
makes it a view of the same buffer already).
"""
from __future__ import annotations

import logging

from jnova.dialect.ir import Func, Op
from jnova.passes.strided_views import VIEW_OPS, row_view_refusal, strided_view, viewed_positions

log = logging.getLogger("jnova.passes")


def view_attention_operands(func: Func, groups: list) -> list:
    """`groups` (fusion groups in execution order) with the remap groups only attention ops read
    dissolved into their readers' groups (module docstring)."""
    returned = set(func.returns)
    order = {op: i for i, op in enumerate(func.ops)}
    members = [set(g.ops) for g in groups]
    readers: dict = {}  # value -> [(group index, op)] of the ops that read it
    for gi, g in enumerate(groups):
        for op in g.ops:
            for v in op.operands:
                readers.setdefault(v, []).append((gi, op))
    taken: dict[int, set[Op]] = {}  # group index -> the view ops it takes
    dissolved = set()
    for gi, g in enumerate(groups):
        added = _readers_views(g, gi, members, readers, returned)
        if added is None:
            continue
        dissolved.add(gi)
        for gj, ops in added.items():
            taken.setdefault(gj, set()).update(ops)
    if not dissolved:
        return groups
    out = []
    for gi, g in enumerate(groups):
        if gi in dissolved:
            continue
        if gi in taken:
            g = type(g)(sorted(set(g.ops) | taken[gi], key=order.__getitem__), g.kind, g.anchor)
        out.append(g)
    log.debug("view_attention_operands: %d remap groups read in place by attention kernels", len(dissolved))
    return out


def _readers_views(g, gi: int, members, readers, returned) -> dict[int, set[Op]] | None:
    """For a group that only remaps buffers for attention ops: each reader group and the view ops it
    needs; None where the group must stay."""
    if any(op.name not in VIEW_OPS for op in g.ops) or all(op.name == "nova.reshape" for op in g.ops):
        return None
    inside = members[gi]
    needs: dict[int, set[Op]] = {}
    for op in g.ops:
        for r in op.results:
            outside = [(gj, u) for gj, u in readers.get(r, ()) if gj != gi and op not in members[gj]]
            if r in returned:
                return None
            if not outside:
                continue
            if any(not viewed_positions(u, r) for _, u in outside):
                return None
            view = strided_view(r, lambda x: x in inside)
            if view is None or row_view_refusal(view) is not None or view.base.owner in inside:
                return None
            for gj, _ in outside:
                needs.setdefault(gj, set()).update(view.ops)
    return needs
