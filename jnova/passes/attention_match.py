"""The softmax form of attention in nova IR, matched and raised (see raise_attention.py).

Axes are followed by label: the score matmul's batch axes are "x0", "x1", ..., its query axis "i",
its key axis "j" (the axis the softmax reduces), an extra query-side axis "g" (the query heads of one
kv head, as `jax.nn.dot_product_attention` splits them for grouped-query attention) and the head dim
"d"; size-1 axes carry None. Views (transpose, reshape that adds or drops size-1 axes, same-size
broadcast, convert) move labels; every other op of the forward must be one the match expects:

    s = [scale *] matmul(q, k) [* or / scalar]  [select(keep, large negative, s) | s + bias]
    m = max_j(s) [max with -inf];  e = exp(s - m);  p = e / sum_j(e);  o = matmul(p, v)

The backward is recognized by its interface: the ops reachable from the forward's score values read
nothing but those values, constants, the mask and the matmul dO v^T, and write nothing but three
matmuls (dv = p^T dO, dq = dS k, dk = dS^T q). Those are replaced by nova.attention_backward's
results; the forward's o by nova.attention's. Anything else is refused with its reason.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np

from jnova.dialect.ir import Func, Op, Value
from jnova.dialect.ops import OPS
from jnova.dialect.ops_attention import MASKED_SCORE, attention_backward_op, attention_op, head_axes
from jnova.dialect.types import FLOAT_DTYPES, TensorType, numpy_dtype

log = logging.getLogger("jnova.passes")

LARGE_NEGATIVE = -1e9   # a masked score at or below this is a masked score (MASKED_SCORE, -inf, finfo.min)
MAX_MASK_ELEMENTS = 1 << 24  # a constant mask is evaluated at compile time up to this size
VIEWS = ("nova.transpose", "nova.reshape", "nova.convert", "nova.broadcast")
BACKWARD_OPS = {"nova.mul", "nova.div", "nova.add", "nova.sub", "nova.neg", "nova.select", "nova.convert",
                "nova.reduce", "nova.broadcast", "nova.reshape", "nova.transpose", "nova.ipow", "nova.exp",
                "nova.constant", "nova.max", "nova.compare", "nova.and"}


class Refused(Exception):
    """A candidate that is not attention as nova.attention defines it; the message says why."""


Labels = tuple  # one label (str or None) per axis


# --------------------------------------------------------------------------- labels through views
def _is_view(op: Op) -> bool:
    if op.name == "nova.broadcast":
        return op.operands[0].type.size == op.results[0].type.size
    return op.name in VIEWS


def _non_unit(labels: Labels, shape) -> list:
    return [l for l, s in zip(labels, shape) if s != 1]


def view_forward(op: Op, labels: Labels) -> Labels | None:
    """The labels of a view's result from its operand's (None: it moves axes in a way not followed)."""
    x, out = op.operands[0].type, op.results[0].type
    if op.name == "nova.convert":
        return labels
    if op.name == "nova.transpose":
        return tuple(labels[p] for p in op.attrs["perm"])
    if op.name == "nova.broadcast":
        result = [None] * out.rank
        for k, d in enumerate(op.attrs["dims"]):
            result[d] = labels[k] if out.shape[d] != 1 else None
        return tuple(result)
    non_unit = iter(_non_unit(labels, x.shape))  # a reshape: size-1 axes added or dropped only
    if [s for s in x.shape if s != 1] != [s for s in out.shape if s != 1]:
        return None
    return tuple(next(non_unit) if s != 1 else None for s in out.shape)


def view_backward(op: Op, labels: Labels) -> Labels | None:
    """The labels of a view's operand from its result's."""
    x, out = op.operands[0].type, op.results[0].type
    if op.name == "nova.convert":
        return labels
    if op.name == "nova.transpose":
        result = [None] * x.rank
        for a, p in enumerate(op.attrs["perm"]):
            result[p] = labels[a]
        return tuple(result)
    if op.name == "nova.broadcast":
        return tuple(labels[d] for d in op.attrs["dims"])
    if [s for s in x.shape if s != 1] != [s for s in out.shape if s != 1]:
        return None
    non_unit = iter(_non_unit(labels, out.shape))
    return tuple(next(non_unit) if s != 1 else None for s in x.shape)


def labels_from(value: Value, known: dict) -> Labels | None:
    """`value`'s labels, found by walking back through views to a value in `known`."""
    path = []
    while value not in known:
        op = value.owner
        if op is None or not _is_view(op):
            return None
        path.append(op)
        value = op.operands[0]
    labels = known[value]
    for op in reversed(path):
        labels = view_forward(op, labels)
        if labels is None:
            return None
    return labels


def peel(value: Value, labels: Labels, *, converts=False) -> tuple[Value, Labels]:
    """The value `value` is a view of (through transposes and reshapes, and converts if asked), with its labels."""
    while value.owner is not None and value.owner.name in ("nova.transpose", "nova.reshape") + (
            ("nova.convert",) if converts else ()):
        back = view_backward(value.owner, labels)
        if back is None:
            break
        value, labels = value.owner.operands[0], back
    return value, labels


# --------------------------------------------------------------------------- building
class _Builder:
    def __init__(self, loc):
        self.ops: list[Op] = []
        self.loc = loc

    def __call__(self, name, operands, out: TensorType, **attrs) -> Value:
        op = OPS[name](list(operands), [out], attrs, loc=self.loc)
        self.ops.append(op)
        return op.results[0]

    def arrange(self, value: Value, labels: Labels, target: list, sizes: dict, dtype: str | None = None) -> Value:
        """`value` (axes `labels`) with its axes in `target` order: each target entry a label, a merged
        pair (outer, inner) of labels, or None (a size-1 axis); converted to `dtype` if given."""
        atoms = [l for l, s in zip(labels, value.type.shape) if s != 1]
        wanted = [a for t in target if t is not None for a in (t if isinstance(t, tuple) else (t,)) if sizes[a] != 1]
        if sorted(atoms) != sorted(wanted) or len(set(atoms)) != len(atoms):
            raise Refused(f"axes {labels} cannot be arranged as {target}")
        x = value
        squeezed = [l for l, s in zip(labels, value.type.shape) if s != 1]
        if tuple(s for s in value.type.shape if s != 1) != value.type.shape:
            x = self("nova.reshape", [x], TensorType(tuple(sizes[l] for l in squeezed), x.type.dtype))
        perm = tuple(squeezed.index(a) for a in wanted)
        if perm != tuple(range(len(perm))):
            x = self("nova.transpose", [x], TensorType(tuple(x.type.shape[p] for p in perm), x.type.dtype), perm=perm)
        shape = tuple(1 if t is None else math.prod(sizes[a] for a in (t if isinstance(t, tuple) else (t,)))
                      for t in target)
        if x.type.shape != shape:
            x = self("nova.reshape", [x], TensorType(shape, x.type.dtype))
        if dtype is not None and x.type.dtype != dtype:
            x = self("nova.convert", [x], x.type.with_dtype(dtype))
        return x

    def scaled(self, x: Value, factor: float) -> Value:
        if factor == 1.0:
            return x
        c = self("nova.constant", [], TensorType((), x.type.dtype),
                 value=np.array(factor, dtype=numpy_dtype(x.type.dtype)))
        return self("nova.mul", [x, self("nova.broadcast", [c], x.type, dims=())], x.type)


# --------------------------------------------------------------------------- the forward
@dataclass
class Forward:
    scores_matmul: Op
    q: tuple[Value, Labels]          # the matmul's query-side operand and its labels
    k: tuple[Value, Labels]
    v: tuple[Value, Labels]
    o_matmul: Op
    o_labels: Labels
    scale: float
    q_prescale: float = 1.0          # a scale applied to q (or k) before the scores matmul
    k_prescale: float = 1.0
    causal: bool = False
    mask: tuple[Value, Labels] | None = None
    masked_to: float | None = None   # the score the mask's select gives a masked key (-inf, finfo.min, ...)
    bias: tuple[Value, Labels] | None = None
    score_values: set = field(default_factory=set)  # every value of the forward from the scores to p
    keep_values: set = field(default_factory=set)   # the mask as the forward reads it (and its views)
    probabilities: Value | None = None
    sizes: dict = field(default_factory=dict)
    p_labels: dict = field(default_factory=dict)     # labels of the score-shaped forward values
    kv_label: str | None = None                      # under grouped-query attention: the kv heads' label


def _scalar_constant(v: Value) -> float | None:
    """The value of a splat constant or a broadcast (or convert) of a scalar constant, in `v`'s type, else None."""
    op = v.owner
    while op is not None and op.name in ("nova.broadcast", "nova.convert"):
        op = op.operands[0].owner
    if op is None or op.name != "nova.constant" or v.type.dtype not in FLOAT_DTYPES:
        return None
    value = np.asarray(op.attrs["value"])
    flat = value.reshape(-1)
    if flat.size == 0 or not (flat == flat[0]).all():
        return None
    return float(np.asarray(flat[0]).astype(numpy_dtype(v.type.dtype)))


def _prescale(value: Value, labels: Labels) -> tuple[Value, Labels, float]:
    """q (or k) before a multiply or divide by a scalar, and that factor."""
    op = value.owner
    if op is not None and op.name in ("nova.mul", "nova.div"):
        for i in (0, 1) if op.name == "nova.mul" else (1,):
            c = _scalar_constant(op.operands[i])
            if c is not None and c != 0 and math.isfinite(c):
                return op.operands[1 - i], labels, (c if op.name == "nova.mul" else 1.0 / c)
    return value, labels, 1.0


def _single_user(users, v: Value) -> Op:
    us = users.get(v, [])
    if len(us) != 1 or us[0] is None:
        what = v.owner.name.removeprefix("nova.") if v.owner is not None else "argument"
        raise Refused(f"a score value (of a {what}) has {len(us)} readers, expected the next step of the softmax only")
    return us[0]


def match_forward(m1: Op, users) -> Forward:
    """The attention forward whose scores `m1` computes (Refused if there is none)."""
    a = m1.attrs
    lhs, rhs = m1.operands
    if a.get("precision", "default") == "highest" and lhs.type.dtype == "float32":
        raise Refused("the scores are asked for in f32-accurate arithmetic (precision highest), and the "
                      "attention kernels and their generic form run TF32")
    if len(a["lhs_contract"]) != 1:
        raise Refused("the scores matmul contracts more than one axis")
    nb = len(a["lhs_batch"])
    out = m1.results[0].type
    lf = [d for d in range(lhs.type.rank) if d not in a["lhs_batch"] and d not in a["lhs_contract"]]
    rf = [d for d in range(rhs.type.rank) if d not in a["rhs_batch"] and d not in a["rhs_contract"]]
    sizes: dict = {}
    batch = [f"x{n}" for n in range(nb)]
    for n, d in enumerate(a["lhs_batch"]):
        sizes[batch[n]] = lhs.type.shape[d]
    lfree = [d for d in lf if lhs.type.shape[d] != 1]
    rfree = [d for d in rf if rhs.type.shape[d] != 1]
    # grouped-query scores k q^T (einsum may put k first): the side with two free axes is the query's
    swapped = len(rfree) == 2 and len(lfree) == 1
    if swapped:
        lhs, rhs, lf, rf, lfree, rfree = rhs, lhs, rf, lf, rfree, lfree
        a = {**a, "lhs_batch": a["rhs_batch"], "lhs_contract": a["rhs_contract"],
             "rhs_batch": a["lhs_batch"], "rhs_contract": a["lhs_contract"]}
    if len(rfree) != 1 or len(lfree) not in (1, 2):
        raise Refused(f"scores with {len(lfree)} query-side and {len(rfree)} key-side free axes")
    # lhs free axes: i (and g), rhs free: j -- or swapped, decided by the softmax's axis below
    lhs_free_labels = {}
    if len(lfree) == 2:
        # grouped-query: the axis right after a batch axis in the operand's order is g (dot_product_attention's
        # [B, T, K, G, H]); the other is i
        split = lhs.owner.operands[0].type.shape if lhs.owner is not None and lhs.owner.name == "nova.reshape" else None
        g_axis = next((d for d in lfree if d - 1 in a["lhs_batch"] and split == lhs.type.shape[:d - 1] + (
            lhs.type.shape[d - 1] * lhs.type.shape[d],) + lhs.type.shape[d + 1:]), None)
        if g_axis is None:
            raise Refused("two query-side free axes, none of them a split of the heads")
        lhs_free_labels = {d: ("g" if d == g_axis else "i") for d in lfree}
        kv_label_of_g = batch[list(a["lhs_batch"]).index(g_axis - 1)]
    else:
        lhs_free_labels = {lfree[0]: "i"}
    for d, l in lhs_free_labels.items():
        sizes[l] = lhs.type.shape[d]
    sizes["j"] = rhs.type.shape[rfree[0]]
    sizes["d"] = lhs.type.shape[a["lhs_contract"][0]]
    if "g" in sizes and sizes["g"] in (sizes["i"],) and sizes["g"] != 1:
        raise Refused("the grouped-query axis and the query axis have one size: ambiguous")
    q_free = tuple(lhs_free_labels.get(d) for d in lf)
    k_free = tuple("j" if d in rfree else None for d in rf)
    out_labels = tuple(batch) + ((k_free + q_free) if swapped else (q_free + k_free))

    def operand_labels(side, t, batch_dims, contract, free_label):
        result = [None] * t.rank
        for n, d in enumerate(batch_dims):
            result[d] = batch[n] if t.shape[d] != 1 else None
        result[contract[0]] = "d"
        for d, l in free_label.items():
            result[d] = l
        return tuple(result)

    q_labels = operand_labels("lhs", lhs.type, a["lhs_batch"], a["lhs_contract"], lhs_free_labels)
    k_labels = operand_labels("rhs", rhs.type, a["rhs_batch"], a["rhs_contract"], {rfree[0]: "j"})

    # the score chain, one reader per step
    values = {m1.results[0]}
    labels = {m1.results[0]: out_labels}
    s = m1.results[0]
    scale, masked = 1.0, False
    fw = Forward(m1, (lhs, q_labels), (rhs, k_labels), None, None, None, 1.0, sizes=sizes)
    if len(lfree) == 2:
        fw.kv_label = kv_label_of_g
    while True:
        readers = users.get(s, [])
        if len(readers) > 1 and any(u is not None and u.name == "nova.reduce" and u.attrs["kind"] == "max"
                                    for u in readers):
            break
        op = _single_user(users, s)
        if _is_view(op):
            nxt = view_forward(op, labels[s])
            if nxt is None:
                raise Refused(f"a {op.name} moves the score axes")
        elif op.name in ("nova.mul", "nova.div") and not masked and fw.bias is None:
            other = op.operands[1] if op.operands[0] is s else op.operands[0]
            c = _scalar_constant(other)
            if c is None or (op.name == "nova.div" and op.operands[1] is s):
                raise Refused(f"the scores are multiplied by a non-constant ({op.name})")
            scale *= c if op.name == "nova.mul" else 1.0 / c
            nxt = labels[s]
        elif op.name == "nova.select" and len(op.operands) == 3 and op.operands[2] is s and not masked:
            fill = _scalar_constant(op.operands[1])
            if fill is None or fill > LARGE_NEGATIVE:
                raise Refused(f"a select of the scores against {fill}, not a large negative value (a mask)")
            _match_keep(fw, op.operands[0], labels[s], out.shape)
            fw.masked_to = fill
            masked = True
            nxt = labels[s]
        elif op.name == "nova.add" and fw.bias is None and not masked:
            other = op.operands[1] if op.operands[0] is s else op.operands[0]
            fw.bias = _optional_operand(other, labels[s], op.results[0].type.shape, "bias")
            nxt = labels[s]
        else:
            raise Refused(f"a {op.name.removeprefix('nova.')} of the scores (dropout, or not attention)")
        s = op.results[0]
        values.add(s)
        labels[s] = nxt
    fw.scale = scale
    # softmax over j: max, exp(s - max), sum, divide
    readers = users.get(s, [])
    if len(readers) != 2 or None in readers:
        raise Refused("the masked scores have readers besides the softmax's max and subtract")
    maxop = next((u for u in readers if u.name == "nova.reduce"), None)
    other = next((u for u in readers if u is not maxop), None)
    if maxop is None or other is None:
        raise Refused("not a softmax (max, then subtract)")
    axis_labels = [labels[s][d] for d in maxop.attrs["dims"]]
    if axis_labels == ["i"] and "g" not in sizes:  # k q^T: the operands are the other way round
        fw.q, fw.k = fw.k, fw.q
        swap = {"i": "j", "j": "i"}
        relabel = lambda ls: tuple(swap.get(l, l) for l in ls)  # noqa: E731
        labels = {v: relabel(ls) for v, ls in labels.items()}
        fw.q, fw.k = (fw.q[0], relabel(fw.q[1])), (fw.k[0], relabel(fw.k[1]))
        sizes["i"], sizes["j"] = sizes["j"], sizes["i"]
        if fw.mask is not None:
            fw.mask = (fw.mask[0], relabel(fw.mask[1]))
        if fw.bias is not None:
            fw.bias = (fw.bias[0], relabel(fw.bias[1]))
        axis_labels = ["j"]
    if axis_labels != ["j"]:
        raise Refused(f"a softmax over axes {axis_labels}, not over the keys")
    # the scores reach the subtract through views (dot_product_attention transposes them)
    x = s
    while other.name != "nova.sub":
        if not _is_view(other) or view_forward(other, labels[x]) is None:
            raise Refused(f"not a softmax (a {other.name.removeprefix('nova.')} between the scores and the subtract)")
        labels[other.results[0]] = view_forward(other, labels[x])
        x = other.results[0]
        values.add(x)
        other = _single_user(users, x)
    subop = other
    if subop.operands[0] is not x:
        raise Refused("not a softmax (the scores are subtracted from something)")
    m = maxop.results[0]
    values.add(m)
    m_user = _single_user(users, m)
    if m_user.name == "nova.max" and _scalar_constant(m_user.operands[0] if m_user.operands[1] is m else m_user.operands[1]) == -math.inf:
        m = m_user.results[0]
        values.add(m)
    if not _reaches(subop.operands[1], m, users, values):
        raise Refused("the softmax subtracts something other than its row max")
    e_op = _single_user(users, subop.results[0])
    values.add(subop.results[0])
    if e_op.name != "nova.exp":
        raise Refused("no exp after the subtract")
    e = e_op.results[0]
    values.add(e)
    labels[subop.results[0]] = labels[e] = labels[x]
    summed = [e] + [u.results[0] for u in users.get(e, []) if u is not None and u.name == "nova.convert"
                    and len(users.get(u.results[0], [])) == 1]  # a bf16 softmax sums in f32
    sum_op = next((u for x in summed for u in users.get(x, []) if u is not None and u.name == "nova.reduce"
                   and u.attrs["kind"] == "sum" and [labels[e][d] for d in u.attrs["dims"]] == ["j"]), None)
    if sum_op is not None and sum_op.operands[0] is not e:
        values.add(sum_op.operands[0])
    div_op = next((u for u in users.get(e, []) if u is not None and u.name == "nova.div" and u.operands[0] is e), None)
    if sum_op is None or div_op is None or not _reaches(div_op.operands[1], sum_op.results[0], users, values):
        raise Refused("the softmax does not divide exp by its row sum over the keys")
    values.add(sum_op.results[0])
    p = div_op.results[0]
    values.add(p)
    labels[p] = labels[x]
    fw.probabilities = p
    # p (through views) times v, contracting j: the first matmul to read p (the backward's p^T dO comes later)
    order = {op: n for n, op in enumerate(users.get("order", []))}
    matmuls, stack = [], [p]
    while stack:
        x = stack.pop()
        for u in users.get(x, []):
            if u is None:
                continue
            if u.name == "nova.matmul":
                matmuls.append((order.get(u, 1 << 60), u, x))
            elif _is_view(u) and view_forward(u, labels[x]) is not None:
                labels[u.results[0]] = view_forward(u, labels[x])
                values.add(u.results[0])
                stack.append(u.results[0])
    if not matmuls:
        raise Refused("the probabilities reach no matmul with v (dropout, or not attention)")
    _, m2, x = min(matmuls, key=lambda t: t[0])
    side = 0 if m2.operands[0] is x else 1
    contract = m2.attrs["lhs_contract" if side == 0 else "rhs_contract"]
    if [labels[x][d] for d in contract] != ["j"]:
        raise Refused("the probabilities' first matmul does not contract the keys (not p v)")
    fw.o_matmul = m2
    ma = m2.attrs
    pb, vb = (ma["lhs_batch"], ma["rhs_batch"]) if side == 0 else (ma["rhs_batch"], ma["lhs_batch"])
    pc, vc = (ma["lhs_contract"], ma["rhs_contract"]) if side == 0 else (ma["rhs_contract"], ma["lhs_contract"])
    v = m2.operands[1 - side]
    v_labels = [None] * v.type.rank
    for d_p, d_v in zip(pb, vb):
        v_labels[d_v] = labels[x][d_p] if v.type.shape[d_v] != 1 else None
    v_labels[vc[0]] = "j"
    vfree = [d for d in range(v.type.rank) if d not in vb and d not in vc and v.type.shape[d] != 1]
    if len(vfree) != 1 or v.type.shape[vfree[0]] != sizes["d"]:
        raise Refused("v's head dim differs from q's (nova.attention takes one head dim)")
    v_labels[vfree[0]] = "d"
    fw.v = (v, tuple(v_labels))
    pfree = [d for d in range(x.type.rank) if d not in pb and d not in pc]
    vfree_all = [d for d in range(v.type.rank) if d not in vb and d not in vc]
    batch_labels = tuple(labels[x][d] for d in pb)
    p_free = tuple(labels[x][d] for d in pfree)
    v_free = tuple(v_labels[d] for d in vfree_all)
    fw.o_labels = batch_labels + (p_free + v_free if side == 0 else v_free + p_free)
    if any(l is not None and l not in batch and l not in ("i", "g", "d") for l in fw.o_labels):
        raise Refused("the output's axes are not the queries'")
    fw.score_values = values
    fw.p_labels = labels
    if fw.causal and sizes["i"] != sizes["j"]:
        raise Refused("a causal mask with fewer queries than keys")
    return fw


def _reaches(value: Value, source: Value, users, values: set) -> bool:
    """Whether `value` is `source` through broadcasts, reshapes and transposes (adding those to `values`)."""
    path = []
    while value is not source:
        op = value.owner
        if op is None or op.name not in ("nova.broadcast", "nova.reshape", "nova.transpose", "nova.convert"):
            return False
        path.append(value)
        value = op.operands[0]
    values.update(path)
    return True


def _optional_operand(value: Value, score_labels: Labels, shape, what: str) -> tuple[Value, Labels]:
    """A bias or mask read by the scores: its labels, through the views that spread and arrange it."""
    v, labels = _through_views(value, score_labels)
    _check_operand_labels(labels, what)
    return v, labels


def _through_views(value: Value, labels: Labels) -> tuple[Value, Labels]:
    """The value `value` is a broadcast, reshape, transpose or convert of (GQA's grouped mask is
    dot_product_attention's mask broadcast over the group and transposed), with its labels; the labels
    of its size-1 dims are None."""
    v = value
    while v.owner is not None and v.owner.name in ("nova.broadcast", "nova.reshape", "nova.convert", "nova.transpose"):
        back = view_backward(v.owner, labels)
        if back is None:
            break
        v, labels = v.owner.operands[0], back
    return v, tuple(l if s != 1 else None for l, s in zip(labels, v.type.shape))


def _check_operand_labels(labels: Labels, what: str) -> None:
    if any(l == "g" for l in labels):
        raise Refused(f"a {what} that differs between the query heads of one kv head")
    if any(l == "d" for l in labels):
        raise Refused(f"a {what} over the head dim")


def _match_keep(fw: Forward, keep: Value, labels: Labels, shape) -> None:
    """A select's keep mask: the conjunction of a constant lower triangle (causal), constants that keep
    everything, and at most one other mask (the mask operand)."""
    masks = []
    for core, core_labels in _conjuncts(fw, keep, labels):
        if core.type.dtype != "bool":
            raise Refused(f"a mask of element type {core.type.dtype}")
        value = _constant_value(core)
        if value is not None and value.all():
            continue
        if value is not None and _is_lower_triangle(value, core_labels, fw.sizes):
            fw.causal = True
            continue
        if value is not None and _within_lower_triangle(value, core_labels, fw.sizes):
            fw.causal = True  # a window below the diagonal: the mask operand, and causal loop bounds
        masks.append((core, core_labels))
    if len(masks) > 1:
        raise Refused("a mask made of several masks")
    if masks:
        core, core_labels = masks[0]
        _check_operand_labels(core_labels, "mask")
        if set(l for l in core_labels if l is not None) - {"x0", "x1", "i", "j"}:
            raise Refused(f"an unsupported mask shape {core.type.shape}")
        fw.mask = masks[0]


def _conjuncts(fw: Forward, keep: Value, labels: Labels) -> list:
    """The masks `keep` is the `and` of (through views), each with its labels."""
    core, core_labels = _through_views(keep, labels)
    fw.keep_values |= _views_between(keep, core)
    whole = ({l for l in core_labels if l is not None} <= {"i", "j"}  # a constant [Tq, Tk] `and` (a window's
             and _constant_value(core) is not None)                    # two bounds) is one mask
    if core.owner is not None and core.owner.name == "nova.and" and not whole:
        fw.keep_values.add(core)
        out = []
        for x in core.owner.operands:
            out += _conjuncts(fw, x, core_labels)
        return out
    return [(core, core_labels)]


def _views_between(value: Value, core: Value) -> set:
    out = set()
    while value is not core:
        out.add(value)
        value = value.owner.operands[0]
    return out


def _is_lower_triangle(value: np.ndarray, labels: Labels, sizes: dict) -> bool:
    """Whether a constant mask keeps key j for query i exactly where j <= i, whatever its other axes."""
    if "i" not in labels or "j" not in labels or sizes["i"] != sizes["j"]:
        return False
    others = [a for a in range(value.ndim) if labels[a] not in ("i", "j")]
    arranged = np.transpose(value, others + [labels.index("i"), labels.index("j")])
    return bool((arranged == np.tri(sizes["i"], dtype=bool)).all())


def _within_lower_triangle(value: np.ndarray, labels: Labels, sizes: dict) -> bool:
    """Whether a constant mask keeps no key j > query i (a causal window: `local_window_size` with
    `is_causal`), whatever its other axes."""
    if "i" not in labels or "j" not in labels or sizes["i"] != sizes["j"]:
        return False
    others = [a for a in range(value.ndim) if labels[a] not in ("i", "j")]
    arranged = np.transpose(value, others + [labels.index("i"), labels.index("j")])
    return not (arranged & ~np.tri(sizes["i"], dtype=bool)).any()


def _constant_value(v: Value) -> np.ndarray | None:
    """`v` evaluated at compile time (NumPy) where it depends on constants and iota only, through the ops
    a mask is built of, and is at most MAX_MASK_ELEMENTS; else None."""
    cache: dict = {}

    def ev(x: Value):
        if x in cache:
            return cache[x]
        op = x.owner
        if op is None or x.type.size > MAX_MASK_ELEMENTS:
            raise Refused("not constant")
        args = [ev(y) for y in op.operands]
        out, a = op.results[0].type, op.attrs
        name = op.name.removeprefix("nova.")
        if name == "constant":
            r = np.asarray(a["value"])
        elif name == "iota":
            shape = out.shape
            r = np.broadcast_to(np.arange(shape[a["dim"]]).reshape([-1 if d == a["dim"] else 1 for d in range(len(shape))]), shape)
        elif name == "broadcast":
            expand = args[0].reshape([args[0].shape[list(a["dims"]).index(d)] if d in a["dims"] else 1
                                      for d in range(out.rank)])
            r = np.broadcast_to(expand, out.shape)
        elif name == "reshape":
            r = args[0].reshape(out.shape)
        elif name == "transpose":
            r = np.transpose(args[0], a["perm"])
        elif name == "convert":
            r = args[0].astype(bool) if out.dtype == "bool" else args[0].astype(np.float64)
        elif name == "compare":
            r = _COMPARE[a["predicate"]](args[0], args[1])
        elif name == "select" and len(args) == 3:
            r = np.where(args[0].astype(bool), args[2], args[1])
        elif name in _BINARY:
            r = _BINARY[name](args[0], args[1])
        elif name == "not":
            r = np.logical_not(args[0]) if out.dtype == "bool" else ~args[0]
        else:
            raise Refused(f"a {name} in a mask")
        cache[x] = r
        return r

    try:
        return np.asarray(ev(v))
    except Refused:
        return None


_COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
            "ge": np.greater_equal}
_BINARY = {"and": np.logical_and, "or": np.logical_or, "add": np.add, "sub": np.subtract, "xor": np.logical_xor}


# --------------------------------------------------------------------------- the backward
@dataclass
class Backward:
    do: tuple[Value, Labels]
    exits: dict                      # "dq" / "dk" / "dv" -> (matmul, result labels)


def _looks_like_attention(m1: Op, users) -> bool:
    """A batched matmul whose result reaches a max reduction within a few elementwise steps: worth a
    logged refusal if it is not attention (a linear layer's matmul has no batch axes)."""
    if not m1.attrs["lhs_batch"] or len(m1.attrs["lhs_contract"]) != 1:
        return False
    frontier, seen = [m1.results[0]], set()
    for _ in range(8):
        nxt = []
        for x in frontier:
            for u in users.get(x, []):
                if u is None or u in seen or u.name == "nova.matmul":
                    continue
                if u.name == "nova.reduce" and u.attrs["kind"] == "max":
                    return True
                seen.add(u)
                nxt.extend(u.results)
        frontier = nxt
    return False


def _constant_only(x: Value, memo: dict) -> bool:
    stack, seen = [x], []
    while stack:
        y = stack.pop()
        if y in memo:
            if not memo[y]:
                memo[x] = False
                return False
            continue
        if y.owner is None or y.owner.name == "nova.fallback":
            for z in seen + [x]:
                memo[z] = False
            return False
        seen.append(y)
        stack.extend(y.owner.operands)
    for z in seen:
        memo[z] = True
    return True


def _root(value: Value, labels: Labels | None = None):
    """The value a view chain starts at (through transposes, reshapes and converts)."""
    while value.owner is not None and value.owner.name in ("nova.transpose", "nova.reshape", "nova.convert"):
        value = value.owner.operands[0]
    return value


def _free_labels_by_size(t: TensorType, skip: set, sizes: dict, names=("i", "g")) -> dict:
    out = {}
    for d in range(t.rank):
        if d in skip or t.shape[d] == 1:
            continue
        found = [n for n in names if n in sizes and sizes[n] == t.shape[d]]
        if len(found) != 1:
            raise Refused(f"cannot tell the axes of a backward matmul operand {t.shape} apart")
        out[d] = found[0]
    return out


def _result_labels(m: Op, lhs_labels: Labels, rhs_labels: Labels) -> Labels:
    a = m.attrs
    lhs, rhs = m.operands
    lf = [d for d in range(lhs.type.rank) if d not in a["lhs_batch"] and d not in a["lhs_contract"]]
    rf = [d for d in range(rhs.type.rank) if d not in a["rhs_batch"] and d not in a["rhs_contract"]]
    return (tuple(lhs_labels[d] for d in a["lhs_batch"]) + tuple(lhs_labels[d] for d in lf)
            + tuple(rhs_labels[d] for d in rf))


def _paired_labels(m: Op, side: int, known: Labels, free: dict) -> Labels:
    """Labels of operand `1 - side` of matmul `m`, from operand `side`'s (`known`): batch and contracted
    axes pair up; its free axes get `free` (axis -> label)."""
    a = m.attrs
    kb, kc = (a["lhs_batch"], a["lhs_contract"]) if side == 0 else (a["rhs_batch"], a["rhs_contract"])
    ob, oc = (a["rhs_batch"], a["rhs_contract"]) if side == 0 else (a["lhs_batch"], a["lhs_contract"])
    other = m.operands[1 - side].type
    out = [None] * other.rank
    for x, y in list(zip(kb, ob)) + list(zip(kc, oc)):
        out[y] = known[x] if other.shape[y] != 1 else None
    for d, l in free.items():
        out[d] = l
    return tuple(out)


def match_backward(fw: Forward, users, func: Func) -> Backward | None:
    """The backward of `fw` that AD produced (None if the step does not differentiate it)."""
    F = set(fw.score_values)
    forward_ops = {x.owner for x in F} | {fw.scores_matmul}
    region, exits, entries, memo = set(), [], [], {}
    stack = list(F)
    region_values = set(F)
    while stack:
        x = stack.pop()
        for u in users.get(x, []):
            if u is None:
                raise Refused("a value of the softmax is returned by the step (the probabilities, or a gradient "
                              "of the bias)")
            if u in forward_ops or u is fw.o_matmul or u in region:
                continue
            if u.name == "nova.matmul":
                if u not in exits:
                    exits.append(u)
                continue
            if u.name not in BACKWARD_OPS:
                raise Refused(f"a value of the softmax is read by a {u.name.removeprefix('nova.')}")
            region.add(u)
            region_values.update(u.results)
            stack.extend(u.results)
    if not region and not exits:
        return None
    for op in region:
        for x in op.operands:
            if x in region_values or x in fw.keep_values or _constant_only(x, memo):
                continue
            if fw.mask is not None and x is fw.mask[0]:
                continue
            entry = x
            while entry.owner is not None and _is_view(entry.owner):
                entry = entry.owner.operands[0]
            if entry.owner is not None and entry.owner.name == "nova.matmul" and entry.owner not in exits:
                if entry.owner not in entries:
                    entries.append(entry.owner)
                continue
            raise Refused("the softmax's backward reads a value that is neither the forward's nor dO v^T "
                          "(a gradient of the bias, or not attention)")
    for op in region:
        for r in op.results:
            for u in users.get(r, []):
                if u is None:
                    raise Refused("a value of the softmax's backward is returned by the step (a gradient of the "
                                  "bias or mask, or not attention)")
                if u not in region and u not in exits:
                    raise Refused(f"a value of the softmax's backward is read by a {u.name.removeprefix('nova.')} "
                                  "(a gradient of the bias or mask, or not attention)")
    if len(entries) != 1:
        raise Refused(f"the backward has {len(entries)} matmuls dO v^T, expected one")
    dp = entries[0]
    v_root = _root(fw.v[0])
    side = next((s for s in (0, 1) if _root(dp.operands[s]) is v_root), None)
    if side is None:
        raise Refused("the backward's dO v^T does not read v")
    v_labels = labels_from(dp.operands[side], {fw.v[0]: fw.v[1]})
    if v_labels is None:
        v_root_value, v_root_labels = peel(fw.v[0], fw.v[1], converts=True)
        v_labels = labels_from(dp.operands[side], {v_root_value: v_root_labels})
    if v_labels is None:
        raise Refused("cannot follow v's axes into the backward")
    do = dp.operands[1 - side]
    a = dp.attrs
    ob, oc = (a["rhs_batch"], a["rhs_contract"]) if side == 0 else (a["lhs_batch"], a["lhs_contract"])
    do_free = _free_labels_by_size(do.type, set(ob) | set(oc), fw.sizes)
    do_labels = _paired_labels(dp, side, v_labels, do_free)
    if "i" not in do_labels or "d" not in do_labels:
        raise Refused("the backward's dO does not have the queries' axes")
    q_root, k_root = _root(fw.q[0]), _root(fw.k[0])
    found: dict = {}
    for x in exits:
        in_region = [s for s in (0, 1) if x.operands[s] in region_values]
        if len(in_region) != 1:
            raise Refused("a backward matmul reads two values of the softmax")
        s = in_region[0]
        r, y = x.operands[s], x.operands[1 - s]
        if r in F:  # dv = p^T dO
            kind = "dv"
            r_labels = labels_from(r, fw.p_labels)
            contract = x.attrs["lhs_contract" if s == 0 else "rhs_contract"]
            if r_labels is None or {r_labels[d] for d in contract} - {"i", "g", None} or "i" not in {r_labels[d] for d in contract}:
                raise Refused("a matmul of the probabilities in the backward that is not p^T dO")
            free_y = [d for d in range(y.type.rank) if d not in x.attrs["lhs_batch" if s == 1 else "rhs_batch"]
                      and d not in x.attrs["lhs_contract" if s == 1 else "rhs_contract"] and y.type.shape[d] != 1]
            if len(free_y) != 1 or y.type.shape[free_y[0]] != fw.sizes["d"]:
                raise Refused("p^T dO with a dO of another head dim")
            y_labels = _paired_labels(x, s, r_labels, {free_y[0]: "d"})
            lhs_l, rhs_l = (r_labels, y_labels) if s == 0 else (y_labels, r_labels)
        else:
            yr = _root(y)
            kind = "dq" if yr is k_root else "dk" if yr is q_root else None
            if kind is None:
                raise Refused("a matmul of the score gradient with neither q nor k")
            base = fw.k if kind == "dq" else fw.q
            y_labels = labels_from(y, {base[0]: base[1]})
            if y_labels is None:
                root_value, root_labels = peel(base[0], base[1], converts=True)
                y_labels = labels_from(y, {root_value: root_labels})
            if y_labels is None:
                raise Refused("cannot follow q's or k's axes into the backward")
            rb = x.attrs["lhs_batch" if s == 0 else "rhs_batch"]
            rc = x.attrs["lhs_contract" if s == 0 else "rhs_contract"]
            names = ("i", "g") if kind == "dq" else ("j",)
            r_free = _free_labels_by_size(r.type, set(rb) | set(rc), fw.sizes, names)
            r_labels = _paired_labels(x, 1 - s, y_labels, r_free)
            contracted = {y_labels[d] for d in x.attrs["lhs_contract" if s == 1 else "rhs_contract"]} - {None}
            if contracted != ({"j"} if kind == "dq" else {"i"} | ({"g"} if fw.sizes.get("g", 1) != 1 else set())):
                raise Refused(f"the {kind} matmul contracts {sorted(contracted)}")
            lhs_l, rhs_l = (r_labels, y_labels) if s == 0 else (y_labels, r_labels)
        if kind in found:
            raise Refused(f"two {kind} matmuls in the backward")
        found[kind] = (x, _result_labels(x, lhs_l, rhs_l))
    return Backward((do, do_labels), found)


# --------------------------------------------------------------------------- raising
def _merge_heads(value: Value, labels: Labels, kv: str) -> tuple[Value, Labels]:
    """q split as [.., K, G, ..] from a [.., K*G, ..] tensor (dot_product_attention's GQA): that tensor,
    its head axis labelled (kv, "g")."""
    op = value.owner
    if op is None or op.name != "nova.reshape" or kv not in labels or "g" not in labels:
        return value, labels
    a = labels.index(kv)
    if a + 1 >= len(labels) or labels[a + 1] != "g":
        return value, labels
    x = op.operands[0].type
    merged = labels[:a] + ((kv, "g"),) + labels[a + 2:]
    shape = value.type.shape[:a] + (value.type.shape[a] * value.type.shape[a + 1],) + value.type.shape[a + 2:]
    if x.shape != shape:
        return value, labels
    return op.operands[0], merged


def _target(layout: str, b_label, h, t: str) -> list:
    return [b_label, t, h, "d"] if layout == "bthd" else [b_label, h, t, "d"]


def _fits(value: Value, labels: Labels, target: list, sizes: dict) -> bool:
    if value.type.rank != 4:
        return False
    for l, want, n in zip(labels, target, value.type.shape):
        want_size = 1 if want is None else math.prod(sizes[a] for a in (want if isinstance(want, tuple) else (want,)))
        if n != want_size or (n != 1 and l != want):
            return False
    return True


def _expand(labels: Labels, shape, sizes) -> tuple[list, tuple]:
    """Labels and shape with merged labels split into their atoms."""
    out_l, out_s = [], []
    for l, n in zip(labels, shape):
        if isinstance(l, tuple):
            out_l += list(l)
            out_s += [sizes[a] for a in l]
        else:
            out_l.append(l)
            out_s.append(n)
    return out_l, tuple(out_s)


def raise_softmax_attention(func: Func, raised) -> None:
    done: set = set()
    while True:
        users = func.uses()
        users["order"] = func.ops  # program order, for the matcher
        candidate = None
        for op in func.ops:
            if op.name == "nova.matmul" and op not in done:
                candidate = op
                break
        if candidate is None:
            return
        done.add(candidate)
        saved = (list(func.ops), list(func.returns), [(op, op.operands) for op in func.ops])
        try:
            fw = match_forward(candidate, users)
            bw = match_backward(fw, users, func)
            _rewrite(func, fw, bw)
            func.verify()
        except Refused as e:
            _restore(func, saved)
            if _looks_like_attention(candidate, users):
                raised.refuse(f"the attention at {candidate.loc or 'an unnamed location'}", str(e))
            continue
        except Exception as e:  # a form the matcher does not expect: leave the ops as they are, say so
            _restore(func, saved)
            log.warning("raise_attention: matching the matmul at %s failed (%s: %s); it stays as it is",
                        candidate.loc or "an unnamed location", type(e).__name__, e)
            continue
        raised.forward += 1
        raised.backward += bw is not None


def _restore(func: Func, saved) -> None:
    ops, returns, operands = saved
    func.ops, func.returns = ops, returns
    for op, values in operands:
        op.operands = values


def _rewrite(func: Func, fw: Forward, bw: Backward | None) -> None:
    sizes = dict(fw.sizes)
    b = _Builder(fw.o_matmul.loc)
    batch = sorted(l for l in sizes if l.startswith("x"))
    kv_label = fw.kv_label if "g" in sizes and sizes["g"] != 1 else None
    # q, k, v before views and scalings
    q, ql = peel(*fw.q)
    q, ql, cq = _prescale(q, ql)
    q, ql = peel(q, ql)
    k, kl = peel(*fw.k)
    k, kl, ck = _prescale(k, kl)
    k, kl = peel(k, kl)
    v, vl = peel(*fw.v)
    if kv_label is not None:
        q, ql = _merge_heads(q, ql, kv_label)
        h_q, h_kv = (kv_label, "g"), kv_label
        b_label = next((l for l in batch if l != kv_label), None)
    else:
        sizes.pop("g", None)
        ql = tuple(None if l == "g" else l for l in ql)
        if len(batch) == 2:
            order = [l for l in ql if l in batch]
            b_label, h_q = (order[0], order[1]) if len(order) == 2 else (batch[0], batch[1])
        elif len(batch) == 1:
            b_label, h_q = None, batch[0]
        else:
            raise Refused(f"scores with {len(batch)} batch axes")
        h_kv = h_q
    if len(batch) > 2:
        raise Refused(f"scores with {len(batch)} batch axes")
    layout = next((L for L in ("bthd", "bhtd") if _fits(q, ql, _target(L, b_label, h_q, "i"), sizes)), "bhtd")
    dtype = q.type.dtype
    q4 = _arranged(b, q, ql, _target(layout, b_label, h_q, "i"), sizes, None)
    k4 = _arranged(b, k, kl, _target(layout, b_label, h_kv, "j"), sizes, dtype)
    v4 = _arranged(b, v, vl, _target(layout, b_label, h_kv, "j"), sizes, dtype)
    if fw.mask is not None and fw.bias is not None:
        raise Refused("a bias and a mask together (nova.attention takes one of them)")
    extra = {}
    for name, found in (("mask", fw.mask), ("bias", fw.bias)):
        if found is None:
            continue
        value, labels = found
        target = [t if t in labels else None for t in (b_label, h_q if kv_label is None else kv_label, "i", "j")]
        if kv_label is not None and target[1] is not None:
            raise Refused(f"a {name} per kv head under grouped-query attention")
        extra[name] = _arranged(b, value, labels, target, sizes, None if name == "mask" else None)
    scale = fw.scale * cq * ck
    fwd = attention_op(q4, k4, v4, causal=fw.causal, scale=scale, layout=layout, loc=fw.o_matmul.loc, **extra)
    try:
        fwd.verify()
    except ValueError as e:
        raise Refused(str(e)) from None
    b.ops.append(fwd)
    o4, lse = fwd.results
    no_key = None                       # the rows whose every key is masked, where the mask makes them NaN
    if fw.mask is not None and fw.masked_to == -math.inf:
        o4, lse, no_key = _nan_where_no_key(b, o4, lse, layout)
    o_labels = _target(layout, b_label, h_q, "i")
    users = func.uses()
    o_end, o_end_labels = _view_chain_end(fw.o_matmul.results[0], fw.o_labels, users)
    o = _arranged(b, o4, tuple(o_labels), list(o_end_labels), sizes, o_end.type.dtype)
    replace = {o_end: o}
    before = {fw.o_matmul: b.ops}
    if bw is not None:
        bb = _Builder(fw.o_matmul.loc)
        do_root, do_root_labels = peel(*bw.do)
        do4 = _arranged(bb, do_root, do_root_labels, o_labels, sizes, dtype)
        bwd = attention_backward_op(q4, k4, v4, o4, lse, do4, causal=fw.causal, scale=scale,
                                    layout=layout, loc=fw.o_matmul.loc, **extra)
        bwd.verify()
        bb.ops.append(bwd)
        dv = bwd.results[2] if no_key is None else _nan_where_a_row_has_no_key(bb, bwd.results[2], no_key, layout)
        grads = {"dq": (bwd.results[0], o_labels, 1.0 / cq), "dk": (bwd.results[1], _target(layout, b_label, h_kv, "j"), 1.0 / ck),
                 "dv": (dv, _target(layout, b_label, h_kv, "j"), 1.0)}
        for kind, (x, labels) in bw.exits.items():
            value, have, factor = grads[kind]
            end, end_labels = _view_chain_end(x.results[0], labels, users)
            r = _arranged(bb, value, tuple(have), list(end_labels), sizes, end.type.dtype)
            replace[end] = bb.scaled(r, factor)
        order = {op: i for i, op in enumerate(func.ops)}
        first = min((x for x, _ in bw.exits.values()), key=order.__getitem__, default=None)
        if first is not None:
            before[first] = before.get(first, []) + bb.ops
    ops = []
    for op in func.ops:
        ops += before.get(op, [])
        ops.append(op)
    for op in ops:
        op.operands = [replace.get(v, v) for v in op.operands]
    func.ops = ops
    func.returns = [replace.get(v, v) for v in func.returns]


def _scalar(b: _Builder, value: float, like: TensorType) -> Value:
    c = b("nova.constant", [], TensorType((), like.dtype), value=np.array(value, numpy_dtype(like.dtype)))
    return b("nova.broadcast", [c], like, dims=())


def _nan_where_no_key(b: _Builder, o: Value, lse: Value, layout: str) -> tuple[Value, Value, Value]:
    """o and lse with NaN in the rows whose every key the mask drops, as jax.nn.softmax makes a row of
    -inf scores (nova.attention's masked scores are the finite MASKED_SCORE: such a row attends to its
    keys uniformly, with an lse of MASKED_SCORE + log(keys)); and those rows ([b, h, t], as lse). The
    backward reads o and lse, so the NaN reaches dq's row where dO carries it, as in jax.jit's."""
    no_key = b("nova.compare", [lse, _scalar(b, MASKED_SCORE / 2, lse.type)], lse.type.with_dtype("bool"),
               predicate="lt")
    lse = b("nova.select", [no_key, lse, _scalar(b, math.nan, lse.type)], lse.type)
    rows = no_key
    if layout == "bthd":                  # lse is [b, h, t]; o [b, t, h, d]
        rows = b("nova.transpose", [rows], TensorType(o.type.shape[:3], "bool"), perm=(0, 2, 1))
    rows = b("nova.broadcast", [rows], o.type.with_dtype("bool"), dims=(0, 1, 2))
    return b("nova.select", [rows, o, _scalar(b, math.nan, o.type)], o.type), lse, no_key


def _nan_where_a_row_has_no_key(b: _Builder, dv: Value, no_key: Value, layout: str) -> Value:
    """dv with NaN for every key of a head one of whose rows has no key: jax.jit's dv = p^T dO reads
    that row's NaN probabilities, whatever dO is (the backward's masked lanes are zero instead)."""
    batch, heads = no_key.type.shape[:2]
    any_row = b("nova.reduce", [no_key], TensorType((batch, heads), "bool"), kind="or", dims=(2,))
    d_t, d_h = head_axes(layout)
    if dv.type.shape[d_h] != heads:       # grouped-query attention: the mask is the same for every head
        any_row = b("nova.reduce", [any_row], TensorType((batch,), "bool"), kind="or", dims=(1,))
        rows = b("nova.broadcast", [any_row], dv.type.with_dtype("bool"), dims=(0,))
    else:
        rows = b("nova.broadcast", [any_row], dv.type.with_dtype("bool"), dims=(0, d_h))
    return b("nova.select", [rows, dv, _scalar(b, math.nan, dv.type)], dv.type)


def _arranged(b: _Builder, value: Value, labels: Labels, target: list, sizes: dict, dtype) -> Value:
    """`value` with axes `labels` (merged labels allowed) in the `target` order."""
    atoms, shape = _expand(labels, value.type.shape, sizes)
    if shape != value.type.shape:
        value = b("nova.reshape", [value], TensorType(shape, value.type.dtype))
    return b.arrange(value, tuple(atoms), target, sizes, dtype)


def _view_chain_end(value: Value, labels: Labels, users) -> tuple[Value, Labels]:
    """The last value of the chain of views (each the only reader of the one before) that starts at
    `value`, and its labels: the raised op's result replaces it, so the views need no transposes."""
    while True:
        readers = users.get(value, [])
        if len(readers) != 1 or readers[0] is None or readers[0].name not in ("nova.transpose", "nova.reshape",
                                                                                "nova.convert"):
            return value, labels
        nxt = view_forward(readers[0], labels)
        if nxt is None:
            return value, labels
        value, labels = readers[0].results[0], nxt
