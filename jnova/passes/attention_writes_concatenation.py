"""attention_writes_concatenation: the dK/dV kernel writes dk and dv into the concatenation the step
makes of the gradients, instead of a kernel of their own concatenating them.

The backward of a fused projection's split (`q, k, v = split(qkv)`) concatenates dq, dk and dv into
the gradient of qkv, [B, T, 3 C], which the weight and input gradients' contractions read: a kernel
reading the three and writing the concatenation. The dK/dV kernel stores its rows of dk and dv
wherever a row view says (`strided_views.concatenation_views`: a part's place in the concatenation's
buffer, through the reshapes and transposes between them), and copies the concatenation's other
parts (dq, computed by the dQ kernel before it) row by row into their places: so the group that only
concatenates (reshapes, transposes) joins the dK/dV group, whose kernel then writes the whole
concatenation and nothing else. dq still crosses memory twice (written by the dQ kernel, copied by
the dK/dV kernel); dk and dv once.

The group is left as it is where dk or dv is read by any other op or returned, where it does more
than concatenate (a convert, an add), where a part's place is not rows of contiguous, 16-byte aligned
elements (`strided_views.row_view_refusal`), or where it has more than one output.
"""
from __future__ import annotations

import logging

from jnova.dialect.ir import Func
from jnova.passes.strided_views import VIEW_OPS, concatenation_views, row_view_refusal

log = logging.getLogger("jnova.passes")

PART_OPS = ("nova.reshape", "nova.transpose")  # between a part and its concatenation operand


def attention_writes_concatenation(func: Func, groups: list) -> list:
    """`groups` (fusion groups in execution order) with each concatenation of a dK/dV op's results
    that only its kernel can write joined to that op's group (module docstring)."""
    returned = set(func.returns)
    order = {op: i for i, op in enumerate(func.ops)}
    readers: dict = {}
    for gi, g in enumerate(groups):
        for op in g.ops:
            for v in op.operands:
                readers.setdefault(v, set()).add(gi)
    group_of = {op: gi for gi, g in enumerate(groups) if g.kind == "attention" for op in g.ops}
    joins: dict[int, int] = {}  # concatenating group -> dK/dV group
    for gi, g in enumerate(groups):
        target = _dkdv_group(g, gi, groups, group_of, readers, returned, order)
        if target is not None:
            joins[gi] = target
    if not joins:
        return groups
    taken = {target: gi for gi, target in joins.items()}
    out = []
    for gi, g in enumerate(groups):
        if gi in joins:
            continue
        if gi in taken:
            g = type(g)(sorted(set(g.ops) | set(groups[taken[gi]].ops), key=order.__getitem__), g.kind, g.anchor)
        out.append(g)
    log.debug("attention_writes_concatenation: %d concatenations written by dK/dV kernels", len(joins))
    return out


def _dkdv_group(g, gi: int, groups, group_of, readers, returned, order) -> int | None:
    """The dK/dV group that takes over group `g`, or None where `g` stays."""
    concats = [op for op in g.ops if op.name == "nova.concatenate"]
    if len(concats) != 1 or any(op.name not in VIEW_OPS + ("nova.concatenate",) for op in g.ops):
        return None
    members = set(g.ops)
    outputs = [r for op in g.ops for r in op.results
               if r in returned or any(gj != gi and op not in groups[gj].ops for gj in readers.get(r, ()))]
    if len(outputs) != 1:
        return None
    concat = concats[0]
    views = concatenation_views(concat, lambda op: op in members and op.name in PART_OPS)
    if views is None or any(row_view_refusal(v) for v in views):
        return None
    dkdv = {v.value.owner for v in views if v.value.owner is not None and v.value.owner.name == "nova.attention_dkdv"}
    if len(dkdv) != 1:
        return None
    op = dkdv.pop()
    target = group_of.get(op)
    written = [v.value for v in views if v.value.owner is op]
    if target is None or sorted(op.results.index(v) for v in written) != [0, 1]:
        return None  # dk and dv each once
    if any(r in returned or readers.get(r, set()) - {gi} for r in op.results):
        return None
    copied = [v.value for v in views if v.value.owner is not op]
    if any(v.owner is not None and (v.owner in members or order[v.owner] > order[op]) for v in copied):
        return None  # a part the kernel copies is computed before it
    return target
