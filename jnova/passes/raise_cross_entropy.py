"""raise_cross_entropy: softmax cross-entropy as users write it, forward and the backward JAX's AD
produced for it, raised to nova.sce and nova.sce_backward (dialect/ops_training.py).

Recognized by value, whatever the form: `optax.softmax_cross_entropy_with_integer_labels`,
`jax.nn.log_softmax` with `jnp.take_along_axis` at the labels, the one-hot forms
(`-(jax.nn.one_hot(labels, V) * jax.nn.log_softmax(logits)).sum(-1)`, `optax.softmax_cross_entropy`
of a one-hot built from integer labels), reduced by a mean or a sum over the rows (any leading
dimensions, [B, T, V] logits as well as [N, V]), with or without an ignored label (rows whose label is
a constant `ignore`, masked out of the loss with `jnp.where(labels != ignore, ...)` and divided by
their count or not), or the rows' losses weighted by a float mask (the rows' loss is raised, and the
gradient as nova.sce_backward of the cotangent AD computed for them).

How:
- anchors: every log-sum-exp of the ops (a sum over the last dimension of exp(x - a row value)); x,
  before its float conversions (bf16 logits cast to f32 for the loss), is the logits;
- candidates: the values computed from the logits and one integer value of the logits' rows (the
  labels) by the ops this module can evaluate over a few rows (elementwise ops, broadcasts, reshapes,
  reductions, gathers, scatters): a scalar or a value per row (the loss), and values of the logits'
  shape that may read one more value computed from neither the logits nor an integer value, the
  loss's cotangent (the gradient wrt the logits);
- each candidate is evaluated on `PROBE_ROWS` rows of random logits (the rows' dimensions shrunk to
  them, the classes as they are; labels including the first and last class, the ignored value where
  the ops compare the labels with a constant, and labels outside [0, V)) and kept if it equals,
  within the rounding of its type, a constant times nova.sce's loss (reduction "sum", "mean", "none";
  ignore_index or not), or a constant times the cotangent times nova.sce_backward's gradient, on
  every probe, labels outside [0, V) treated by one of `LABEL_RULES` (what the form makes of them);
- the loss and the gradient are replaced by nova.sce's (times the constant) and nova.sce_backward's,
  which reads the forward's lse, each reading the labels rewritten by its rule (negative ones
  wrapped, those out of range replaced by an ignored label, a NaN added to the loss where the
  gather's fill would be): the softmax, log-softmax and exponentials the forward saved for the
  backward ([N, V] f32 each) are dead, and the dce that follows drops them.

Refused (logged on `jnova.passes` at DEBUG with the reason; the ops stay as they were, correct):
values that differ from softmax cross-entropy's (label smoothing, a temperature, another axis); a
loss whose logits' softmax or log-softmax is read by something else (raising would compute it twice);
a gradient without a recognized forward (nova.sce_backward reads nova.sce's lse); ops the probes
cannot evaluate at their shapes. Each raised op is logged at INFO.

Where it runs is the backend's choice (`primitives/backends.keeps_training_op`): the pipeline calls
it in the raise_training stage where the backend keeps nova.sce and nova.sce_backward.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from jnova.dialect.ir import Func, Op, Value
from jnova.dialect.ops import ElementwiseOp, OPS
from jnova.dialect.ops_training import LABEL_DTYPES, sce_backward_op, sce_op
from jnova.passes.raise_training import insert_and_replace
from jnova.dialect.types import TensorType, itemsize, numpy_dtype
from jnova.passes.expand_attention import _Builder

log = logging.getLogger("jnova.passes")

F32 = "float32"
FLOATS = ("float32", "bfloat16", "float16")
PROBE_ROWS = 5          # rows of logits each candidate is evaluated on
MAX_CONE_OPS = 400      # a candidate computed by more ops than this is not looked at
# how far a candidate's values may be from the definition's (f64) and still be it: its types' rounding
PROBE_TOLERANCE = {"float32": 2e-4, "float16": 4e-3, "bfloat16": 4e-2}
ELEMENTWISE_NAMES = {"nova.convert", "nova.select", "nova.compare", "nova.constant", "nova.iota"}
EVALUATED = ELEMENTWISE_NAMES | {"nova.broadcast", "nova.reshape", "nova.reduce", "nova.gather", "nova.scatter"}


# --------------------------------------------------------------------------- cones
@dataclass
class _Cone:
    """The ops computing `root` from `leaves`, in program order."""

    root: Value
    ops: list[Op]
    leaves: list[Value]


def _evaluable(op: Op) -> bool:
    return op.name in EVALUATED or isinstance(op, ElementwiseOp)


def _cone(root: Value, logits: Value, position: dict[Op, int], stops: frozenset = frozenset()) -> _Cone | None:
    ops: dict[Op, None] = {}
    leaves: dict[Value, None] = {}
    stack = [root]
    while stack:
        v = stack.pop()
        op = v.owner
        if v is logits or v in stops or op is None or not _evaluable(op) or len(op.results) != 1:
            leaves[v] = None
            continue
        if op in ops:
            continue
        ops[op] = None
        if len(ops) > MAX_CONE_OPS:
            return None
        stack.extend(op.operands)
    return _Cone(root, sorted(ops, key=position.__getitem__), list(leaves))


# --------------------------------------------------------------------------- the row model
class _RowModel:
    """Values of the step over `PROBE_ROWS` rows instead of the logits' N: a shape whose leading
    dimensions multiply to N has them replaced by ones and the probe's rows; other shapes stay."""

    def __init__(self, rows: tuple[int, ...]):
        self.n = math.prod(rows)

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        for k in range(1, len(shape) + 1):
            size = math.prod(shape[:k])
            if size == self.n:
                return (1,) * (k - 1) + (PROBE_ROWS,) + tuple(shape[k:])
            if size > self.n:
                break
        return tuple(shape)

    def type(self, t: TensorType) -> TensorType:
        return TensorType(self.shape(t.shape), t.dtype)

    def op(self, op: Op) -> Op | str:
        """`op` over the model's shapes, or why it cannot be."""
        attrs = dict(op.attrs)
        if op.name == "nova.gather":
            real, model = op.operands[0].type.shape, self.shape(op.operands[0].type.shape)
            sizes = list(attrs["slice_sizes"])
            for d, (r, m) in enumerate(zip(real, model)):
                if r != m and sizes[d] not in (1, r):
                    return f"a gather of part of the rows ({op.results[0].type})"
                if r != m and sizes[d] == r:
                    sizes[d] = m
            attrs["slice_sizes"] = tuple(sizes)
        if op.name == "nova.iota":
            t = op.results[0].type
            if self.shape(t.shape)[attrs["dim"]] != t.shape[attrs["dim"]]:
                return "an iota along the rows"
        return OPS[op.name]([], [self.type(r.type) for r in op.results], attrs)


class _Probe:
    """One evaluation of the candidates: leaves' values (logits, labels, any other value drawn once)
    and every value computed from them (memoized across candidates)."""

    def __init__(self, model: _RowModel, logits: Value, labels: Value, x: np.ndarray, label_rows: np.ndarray,
                 rng: np.random.Generator, evaluate: Callable):
        self.model, self.rng, self.evaluate = model, rng, evaluate
        self.x = x.astype(numpy_dtype(logits.type.dtype)).astype(np.float64).reshape(PROBE_ROWS, -1)
        self.labels = label_rows
        self.env: dict[Value, object] = {
            logits: x.astype(numpy_dtype(logits.type.dtype)).reshape(model.shape(logits.type.shape)),
            labels: label_rows.astype(numpy_dtype(labels.type.dtype)).reshape(model.shape(labels.type.shape))}

    def value(self, cone: _Cone) -> np.ndarray:
        import jax.numpy as jnp  # the probes run jax's evaluation of each op (handed in by the pipeline)

        for leaf in cone.leaves:
            if leaf not in self.env:
                shape = self.model.shape(leaf.type.shape)
                self.env[leaf] = self.rng.uniform(0.5, 2.0, shape).astype(numpy_dtype(leaf.type.dtype))
        for op in cone.ops:
            if op.results[0] in self.env:
                continue
            if op.name == "nova.constant":
                self.env[op.results[0]] = _model_constant(op, self.model)
                continue
            small = self.model.op(op)
            if isinstance(small, str):
                raise _Unmodeled(small)
            args = [self.env[v] for v in op.operands]
            value = _numpy_op(small, [np.asarray(x) for x in args])
            if value is None:   # gathers, scatters, what numpy does not say the same of: jax's evaluation
                value = np.asarray(self.evaluate(small, *[jnp.asarray(x) for x in args])[0])
            self.env[op.results[0]] = value
        return np.asarray(self.env[cone.root], np.float64)

    def leaf(self, v: Value) -> np.ndarray:
        return np.asarray(self.env[v], np.float64)


_NUMPY_UNARY = {"nova.exp": np.exp, "nova.log": np.log, "nova.neg": np.negative, "nova.abs": np.abs,
                "nova.is_finite": np.isfinite, "nova.sign": np.sign, "nova.square": np.square}
_NUMPY_BINARY = {"nova.add": np.add, "nova.sub": np.subtract, "nova.mul": np.multiply, "nova.max": np.maximum,
                 "nova.min": np.minimum}
_NUMPY_COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
                  "ge": np.greater_equal}
_NUMPY_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min}


def _numpy_op(op: Op, xs: list[np.ndarray]) -> np.ndarray | None:
    """`op` on numpy arrays (floats computed in f32 at least, then rounded to the result's type), for the
    ops a probe meets most (each jax evaluation of a new shape compiles); None for the others."""
    out = op.results[0].type
    dtype = numpy_dtype(out.dtype)
    floats = out.dtype in FLOATS

    def wide(x):
        return x.astype(np.float32) if x.dtype.kind == "V" or str(x.dtype) in ("bfloat16", "float16") else x

    with np.errstate(all="ignore"):
        if op.name in _NUMPY_UNARY and (floats or op.name == "nova.is_finite"):
            return np.asarray(_NUMPY_UNARY[op.name](wide(xs[0]))).astype(dtype)
        if op.name in _NUMPY_BINARY and xs[0].dtype == xs[1].dtype:
            return np.asarray(_NUMPY_BINARY[op.name](wide(xs[0]), wide(xs[1]))).astype(dtype)
        if op.name == "nova.div" and floats:
            return np.asarray(wide(xs[0]) / wide(xs[1])).astype(dtype)
        if op.name == "nova.compare":
            return _NUMPY_COMPARE[op.attrs["predicate"]](wide(xs[0]), wide(xs[1]))
        if op.name == "nova.select" and len(xs) == 3:
            return np.where(np.broadcast_to(xs[0], out.shape), xs[2], xs[1]).astype(dtype)
        if op.name == "nova.convert" and (floats or out.dtype == "bool") and xs[0].dtype.kind in "fVbiu":
            return wide(xs[0]).astype(dtype) if floats else xs[0] != 0
        if op.name == "nova.reshape":
            return xs[0].reshape(out.shape)
        if op.name == "nova.broadcast":
            dims = tuple(op.attrs["dims"])
            shape = [1] * out.rank
            for i, d in enumerate(dims):
                shape[d] = xs[0].shape[i]
            return np.broadcast_to(xs[0].reshape(shape), out.shape).copy()
        if op.name == "nova.reduce" and op.attrs["kind"] in _NUMPY_REDUCE and (floats or out.dtype.startswith("int")):
            x = xs[0].astype(np.float64) if floats else xs[0]
            return _NUMPY_REDUCE[op.attrs["kind"]](x, axis=tuple(op.attrs["dims"])).astype(dtype)
        if op.name == "nova.iota":
            return np.broadcast_to(np.arange(out.shape[op.attrs["dim"]]).reshape(
                [-1 if d == op.attrs["dim"] else 1 for d in range(out.rank)]), out.shape).astype(dtype)
    return None


def _model_constant(op: Op, model: _RowModel):
    value = np.asarray(op.attrs["value"])
    t = op.results[0].type
    shape = model.shape(t.shape)
    if shape == t.shape:
        return value.reshape(t.shape).astype(numpy_dtype(t.dtype))
    first = value.reshape(-1)[0] if value.size else 0
    if not (value == first).all():
        raise _Unmodeled("a constant that differs between rows")
    return np.full(shape, first, numpy_dtype(t.dtype))


class _Unmodeled(Exception):
    pass


# --------------------------------------------------------------------------- the definition (f64)
# What a form makes of a label outside [0, V) (the ignored one aside), as the probes find it: whether
# a negative label counts from the end first ("wrap", take_along_axis's indexing), and what a label
# still out of range gives: "nan" (the gather's fill: a NaN loss), "zero" (a row of zeros: one_hot's
# labels, or a gradient through the gather's dropped scatter) or "softmax" (no logit picked: a loss of
# lse, a gradient of the softmax; nova.sce's own).
LABEL_RULES = ((True, "nan"), (True, "softmax"), (True, "zero"), (False, "zero"), (False, "softmax"))
NO_LABEL = -1          # what a label outside [0, V) becomes where its row is ignored (the "zero" rule)


@dataclass(frozen=True)
class _Form:
    reduction: str               # "sum", "mean" or "none"
    ignore: int | None
    wrap: bool = False           # LABEL_RULES
    outside: str = "softmax"

    @property
    def ignores_outside(self) -> bool:
        return self.outside == "zero"


def _definition(probe: _Probe, form: _Form) -> tuple[np.ndarray, np.ndarray]:
    """(the form's loss, d loss / d logits for a unit dloss) on the probe's rows."""
    x, labels = probe.x, probe.labels.astype(np.int64)
    v = x.shape[1]
    ignored = np.zeros(PROBE_ROWS, bool) if form.ignore is None else labels == form.ignore
    if form.wrap:
        labels = np.where((labels < 0) & ~ignored, labels + v, labels)
    valid = (labels >= 0) & (labels < v)
    m = x.max(axis=1, keepdims=True)
    e = np.exp(x - m)
    lse = (m + np.log(e.sum(axis=1, keepdims=True)))[:, 0]
    onehot = (np.arange(v)[None, :] == labels[:, None]).astype(np.float64)
    picked = np.where(valid, x[np.arange(PROBE_ROWS), np.clip(labels, 0, v - 1)], 0.0)
    keep = (~ignored & (valid | (form.outside != "zero"))).astype(np.float64)
    loss = (lse - picked) * keep
    if form.outside == "nan":
        loss = np.where(valid | ignored, loss, np.nan)
    grad = (e / e.sum(axis=1, keepdims=True) - onehot) * keep[:, None]
    if form.reduction == "none":
        return loss, grad
    count = keep.sum() if form.reduction == "mean" else 1.0
    return np.array(loss.sum() / max(count, 1.0)), grad / max(count, 1.0)


ANY = "any"   # a probe whose values say nothing of the scale (all NaN where the form has NaN)


def _scale(got: np.ndarray, want: np.ndarray, dtype: str):
    """The constant c with got == c * want within the rounding of `dtype` (NaN where want is NaN), if
    there is one."""
    got, want = got.reshape(-1), want.reshape(-1)
    nan = np.isnan(want)
    if not np.array_equal(np.isnan(got), nan):
        return None
    got, want = got[~nan], want[~nan]
    if want.size == 0:
        return ANY
    if not np.all(np.isfinite(got)):
        return None
    norm = float(want @ want)
    if norm == 0.0:       # every row ignored: zeros say nothing of the scale
        return ANY if np.all(got == 0.0) else None
    c = float(got @ want) / norm
    tol = PROBE_TOLERANCE.get(dtype, 2e-4)
    bound = tol * (np.abs(c * want) + 0.05 * np.abs(c * want).max() + 1e-30)
    return c if c != 0.0 and bool(np.all(np.abs(got - c * want) <= bound)) else None


def _same(scales: list, dtype: str) -> float | None:
    if any(s is None for s in scales):
        return None
    known = [s for s in scales if s is not ANY]
    if not known:
        return None
    tol = PROBE_TOLERANCE.get(dtype, 2e-4)
    return known[0] if all(abs(s - known[0]) <= tol * abs(known[0]) for s in known) else None


# --------------------------------------------------------------------------- the pass
@dataclass
class _Match:
    value: Value                 # the loss or the gradient the step computes
    form: _Form
    scale: float                 # value == scale * definition (times the cotangent, for a gradient)
    cone: _Cone
    cotangent: Value | None = None


@dataclass
class _Group:
    """The candidates over one logits value and one labels value."""

    logits: Value
    labels: Value
    losses: list[_Cone] = field(default_factory=list)
    grads: list[_Cone] = field(default_factory=list)


def raise_cross_entropy(func: Func, evaluate_op: Callable) -> dict[str, int]:
    """Raise, in place, every softmax cross-entropy `func` holds; returns how many of each op were
    raised. `evaluate_op(op, *arrays)` computes one nova op (the pipeline hands in primitives/
    nova_to_jax's); the probes evaluate candidates with it. Dead ops are left for dce."""
    position = {op: i for i, op in enumerate(func.ops)}
    counts: dict[str, int] = defaultdict(int)
    before: dict[Op, list[Op]] = defaultdict(list)
    replace: dict[Value, Value] = {}
    for logits in _logits(func):
        for group in _groups(func, logits, position):
            raised = _raise_group(func, group, position, evaluate_op, before, replace)
            for name in raised:
                counts[name] += 1
    if replace:
        insert_and_replace(func, before, replace)
    return dict(counts)


def _logits(func: Func) -> list[Value]:
    """The x of every sum over the last dimension of exp(x - a row value)."""
    found: dict[Value, None] = {}
    for op in func.ops:
        if op.name != "nova.reduce" or op.attrs["kind"] != "sum":
            continue
        x = op.operands[0]
        e = x.owner
        while e is not None and e.name == "nova.convert":
            e = e.operands[0].owner
        if e is None or e.name != "nova.exp":
            continue
        shifted = e.operands[0].owner
        while shifted is not None and shifted.name == "nova.convert":   # excess precision's roundings
            shifted = shifted.operands[0].owner
        if shifted is None or shifted.name != "nova.sub":
            continue
        if tuple(op.attrs["dims"]) != (x.type.rank - 1,) or x.type.rank < 2:
            log.debug("raise_cross_entropy: a log-sum-exp of %s over dimensions %s, not the last: not nova.sce's",
                      x.type, tuple(op.attrs["dims"]))
            continue
        logits = _before_converts(shifted.operands[0])
        if logits.type.dtype in FLOATS and logits.type.shape == x.type.shape:
            found[logits] = None
    return list(found)


def _before_converts(v: Value) -> Value:
    """`v` before the float widenings that computed it (bf16 logits cast to f32 for the loss): nova.sce
    reads them as they are, in f32 arithmetic, and the f32 copy dies where nothing else reads it. Not
    past a narrowing (the f32 matmul result rounded to bf16 logits): that rounding is the user's."""
    while v.owner is not None and v.owner.name == "nova.convert" and v.owner.operands[0].type.dtype in FLOATS \
            and itemsize(v.owner.operands[0].type.dtype) < itemsize(v.type.dtype):
        v = v.owner.operands[0]
    return v


def _cotangents(func: Func, logits: Value) -> frozenset:
    """The float values computed from neither the logits, nor an integer value, nor constants alone: what
    a gradient's cone stops at, its cotangent (a loss weighted by a float mask: mask / mask.sum())."""
    dependent: set[Value] = {logits}
    computed: set[Value] = set(func.args)
    for op in func.ops:
        if any(v in dependent or v.type.dtype not in FLOATS for v in op.operands):
            dependent.update(op.results)
        if any(v in computed for v in op.operands) or op.name == "nova.fallback":
            computed.update(op.results)
    return frozenset(v for v in computed - dependent if v.type.dtype in FLOATS)


def _gradient_cone(v: Value, logits: Value, position: dict[Op, int], stops: frozenset) -> _Cone | None:
    """The cone of `v` stopped at its cotangent: where it reads several values independent of the
    logits (the cotangent and its negation, say), the latest is computed inside it until one is left."""
    for _ in range(8):
        cone = _cone(v, logits, position, stops)
        read = [leaf for leaf in (cone.leaves if cone is not None else ()) if leaf in stops and leaf.owner is not None]
        if cone is None or len(read) <= 1:
            return cone
        stops = stops - {max(read, key=lambda leaf: position[leaf.owner])}
    return cone


def _groups(func: Func, logits: Value, position: dict[Op, int]) -> list[_Group]:
    rows = logits.type.shape[:-1]
    n = math.prod(rows)
    model = _RowModel(rows)
    stops = _cotangents(func, logits)
    groups: dict[Value, _Group] = {}
    start = position[logits.owner] if logits.owner is not None else -1
    for op in func.ops[start + 1:]:
        if len(op.results) != 1 or not _evaluable(op):
            continue
        v = op.results[0]
        t = v.type
        loss_like = t.dtype in FLOATS and (t.rank == 0 or (t.size == n and model.shape(t.shape) != t.shape))
        grad_like = t.dtype in FLOATS and t.shape == logits.type.shape
        if not (loss_like or grad_like) or v is logits:
            continue
        cone = _gradient_cone(v, logits, position, stops) if grad_like else _cone(v, logits, position)
        if cone is None or logits not in cone.leaves:
            continue
        ints = [leaf for leaf in cone.leaves if leaf.type.dtype in LABEL_DTYPES]
        others = [leaf for leaf in cone.leaves if leaf is not logits and leaf not in ints]
        if len(ints) != 1 or ints[0].type.size != n or _RowModel(rows).shape(ints[0].type.shape)[-1] != PROBE_ROWS:
            continue
        refusal = _label_use_refusal(cone, ints[0], logits)
        if refusal is not None:
            log.debug("raise_cross_entropy: %s from %s refused: %s", v.type, logits.type, refusal)
            continue
        group = groups.setdefault(ints[0], _Group(logits, ints[0]))
        if loss_like and not others:
            group.losses.append(cone)
        elif grad_like and len(others) <= 1 and all(o.type.dtype in FLOATS and (o.type.rank == 0 or o.type.size == n)
                                                     for o in others):
            group.grads.append(cone)
    return list(groups.values())


def _ignored_values(cones: list[_Cone], labels: Value) -> list[int]:
    """Integer constants the cones compare the labels with for equality: the candidates of an ignored label."""
    return _compared_constants(cones, labels, ("eq", "ne"))


def _compared_constants(cones: list[_Cone], labels: Value, predicates=None) -> list[int]:
    """Integer constants the cones compare the labels with (through broadcasts and reshapes), in the
    order found; by `predicates` only, or by any."""
    found = []
    for cone in cones:
        for op in cone.ops:
            if op.name != "nova.compare" or (predicates is not None and op.attrs["predicate"] not in predicates):
                continue
            a, b = (_through_remaps(v) for v in op.operands)
            for lab, other in ((a, b), (b, a)):
                c = other.owner
                if lab is labels and c is not None and c.name == "nova.constant":
                    value = np.asarray(c.attrs["value"]).reshape(-1)
                    if value.size and (value == value[0]).all() and float(value[0]).is_integer() \
                            and int(value[0]) not in found:
                        found.append(int(value[0]))
    return found


def _label_use_refusal(cone: _Cone, labels: Value, logits: Value) -> str | None:
    """Why the cone reads the labels in a way a few probe rows cannot tell from softmax cross-entropy's,
    if it does: a gather at the labels from values not computed from the logits (class weights looked
    up per label), or a comparison of the labels with a constant of several values (`jnp.isin(labels,
    special_ids)`). Random probe labels miss the few classes such a table or set singles out, and the
    loss would be raised without the weights or the mask (its count seen as a constant)."""
    from_labels, from_logits = {labels}, {logits}
    for op in cone.ops:
        reads_labels = [v in from_labels for v in op.operands]
        if any(reads_labels):
            from_labels.update(op.results)
        if any(v in from_logits for v in op.operands):
            from_logits.update(op.results)
        if op.name == "nova.gather" and any(reads_labels[1:]) and op.operands[0] not in from_logits:
            return "it gathers values not computed from the logits at the labels (per-label weights)"
        if op.name == "nova.compare" and any(reads_labels):
            for v in op.operands:
                c = _through_remaps(v).owner
                if v not in from_labels and c is not None and c.name == "nova.constant":
                    value = np.asarray(c.attrs["value"]).reshape(-1)
                    if value.size > 1 and not (value == value[0]).all():
                        return "it compares the labels with a set of several values"
    return None


def _through_remaps(v: Value) -> Value:
    while v.owner is not None and v.owner.name in ("nova.broadcast", "nova.reshape"):
        v = v.owner.operands[0]
    return v


def _probes(group: _Group, ignores: list[int], evaluate: Callable) -> list[_Probe]:
    """Two probes of valid labels (the first and the last class among them), one per ignored value, one
    of valid labels next to a negative one and one past the end, and one of labels outside [0, V)
    only (negative, past the end, the type's extremes).

    The third kind keeps the probes whose loss is not zero from all keeping every row: a mean over
    the rows some comparison of the labels keeps (`labels >= 0`, which no `eq` or `ne` names as an
    ignored value) divides by a count of them, which such probes would see as the constant
    1 / PROBE_ROWS (a sum over the labels in range divided by the count of those >= 0, no form of
    nova.sce's, was raised as that sum times 1 / PROBE_ROWS)."""
    rng = np.random.default_rng(0)
    v = group.logits.type.shape[-1]
    model = _RowModel(group.logits.type.shape[:-1])
    shape = model.shape(group.logits.type.shape)
    label_sets = [np.array([0, v - 1] + list(rng.integers(0, v, PROBE_ROWS - 2))),
                  rng.integers(0, v, PROBE_ROWS)]
    for ignore in ignores:
        label_sets.append(np.array([ignore, v - 1, ignore] + list(rng.integers(0, v, PROBE_ROWS - 3))))
    info = np.iinfo(numpy_dtype(group.labels.type.dtype))
    outside = [x for x in (-1, v, -v - 1, int(info.max), int(info.min))
               if x not in ignores and info.min <= x <= info.max]
    below, above = [x for x in outside if x < 0][:1], [x for x in outside if x >= v][:1]
    mixed = [0, v - 1] + below + above
    label_sets.append(np.array(mixed + list(rng.integers(0, v, PROBE_ROWS - len(mixed)))))
    label_sets.append(np.resize(np.array(outside or [0]), PROBE_ROWS))
    # both sides of every constant the labels are compared with, so that an ordering comparison
    # (`labels < 100`) is never seen from one side only
    for c in sorted(_compared_constants(group.losses + group.grads, group.labels)):
        around = [x for x in (c - 1, c, c + 1) if info.min <= x <= info.max]
        label_sets.append(np.array(around + list(rng.integers(0, v, PROBE_ROWS - len(around)))))
    probes = [_Probe(model, group.logits, group.labels, rng.standard_normal(shape) * 2, labels, rng, evaluate)
              for labels in label_sets]
    # and rows whose logits span 80: probabilities down to e^-80, still normal in f32 and bf16, so a
    # clip of the probabilities (`jnp.clip(softmax(x), 1e-7, 1)` before the log) binds
    wide = rng.uniform(-40.0, 40.0, shape)
    wide.reshape(PROBE_ROWS, -1)[:, :2] = (-40.0, 40.0)
    probes.append(_Probe(model, group.logits, group.labels, wide, label_sets[0], rng, evaluate))
    return probes


def _dtype(cone: _Cone) -> str:
    """The narrowest float type the candidate is computed in (its rounding is the probes' tolerance): of
    its ops' results, not of its leaves (bf16 logits widened exactly to f32 make an f32 loss, whose
    probes must match to f32's rounding: a scalar matches any form within bf16's)."""
    types = {o.results[0].type.dtype for o in cone.ops}
    return "bfloat16" if "bfloat16" in types else "float16" if "float16" in types else F32


def _forms(ignores: list[int], rows: bool, grad: bool = False) -> list[_Form]:
    """The forms a candidate is compared with. Without an ignored label a mean is the sum times the
    constant 1/N (a probe's mean would divide by its rows, not by the step's N)."""
    if rows:
        shapes = [("none", i) for i in [None, *ignores]]
    else:
        shapes = [("sum", None)] + [(r, i) for i in ignores for r in ("mean", "sum")]
    return [_Form(r, i, wrap, outside) for wrap, outside in LABEL_RULES for r, i in shapes
            if not (grad and outside == "nan")]


def _match_loss(cone: _Cone, probes: list[_Probe], ignores: list[int]) -> _Match | None:
    rows = cone.root.type.rank > 0
    got = [p.value(cone) for p in probes]
    dtype = _dtype(cone)
    for form in _forms(ignores, rows):
        scale = _same([_scale(g, _definition(p, form)[0], dtype) for g, p in zip(got, probes)], dtype)
        if scale is not None:
            return _Match(cone.root, *_as_mean(form, scale, probes[0].model.n, dtype), cone)
    return None


def _match_grad(cone: _Cone, probes: list[_Probe], logits: Value, ignores: list[int]) -> _Match | None:
    others = [leaf for leaf in cone.leaves if leaf is not logits and leaf.type.dtype not in LABEL_DTYPES]
    cotangent = others[0] if others else None
    got = [p.value(cone).reshape(PROBE_ROWS, -1) for p in probes]
    dtype = _dtype(cone)
    rows = cotangent is not None and cotangent.type.rank > 0
    for form in _forms(ignores, rows, grad=True):
        wants = []
        for p in probes:
            want = _definition(p, form)[1]
            if cotangent is not None:
                g = p.leaf(cotangent).reshape(-1)
                want = want * (g[:, None] if rows else g[0])
            wants.append(want)
        scale = _same([_scale(g, w, dtype) for g, w in zip(got, wants)], dtype)
        if scale is not None:
            return _Match(cone.root, *_as_mean(form, scale, probes[0].model.n, dtype), cone, cotangent)
    return None


def _as_mean(form: _Form, scale: float, n: int, dtype: str) -> tuple[_Form, float]:
    """A sum over the rows times 1/N is their mean (not where labels outside [0, V) are ignored: nova.sce's
    mean would not count those rows); a scale within rounding of 1/N or 1 is that (the probes of a
    16-bit form measure the step's constant only to its rounding)."""
    tol = PROBE_TOLERANCE.get(dtype, PROBE_TOLERANCE[F32])
    if abs(scale * n - 1.0) <= tol:
        if (form.reduction, form.ignore) == ("sum", None) and not form.ignores_outside:
            return _Form("mean", None, form.wrap, form.outside), 1.0
        return form, 1.0 / n
    return form, 1.0 if abs(scale - 1.0) <= tol else scale


def _maximal(matches: list[_Match]) -> list[_Match]:
    """The matches not read only by a matched value's cone (the loss, not the sum it divides)."""
    inner: set[Value] = set()
    for m in matches:
        inner.update(r for op in m.cone.ops for r in op.results if r is not m.value)
    return [m for m in matches if m.value not in inner]


def _raise_group(func, group: _Group, position, evaluate, before, replace) -> list[str]:
    logits, labels = group.logits, group.labels
    what = f"softmax cross-entropy of {logits.type} at {labels.type}"
    if labels.type.dtype not in LABEL_DTYPES:
        return []
    ignores = _ignored_values(group.losses + group.grads, labels)
    try:
        probes = _probes(group, ignores, evaluate)
        losses = [m for m in (_match_loss(c, probes, ignores) for c in group.losses) if m is not None]
        grads = [m for m in (_match_grad(c, probes, logits, ignores) for c in group.grads) if m is not None]
    except _Unmodeled as e:
        log.debug("raise_cross_entropy: %s refused: %s", what, e)
        return []
    except Exception as e:  # an op of the cones that its evaluation does not take at the probe's shapes
        log.debug("raise_cross_entropy: %s refused: its ops cannot be evaluated on %d rows (%s: %s)", what,
                  PROBE_ROWS, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return []
    if not losses:
        if group.losses or grads:
            log.debug("raise_cross_entropy: %s refused: no loss over it has softmax cross-entropy's values "
                      "(label smoothing, a temperature, ...)", what)
        return []
    losses, grads = _maximal(losses), _maximal(grads)
    reader = _read_elsewhere(losses + grads, logits, func, position)
    if reader is not None:
        log.debug("raise_cross_entropy: %s refused: %s; raising would compute it twice", what, reader)
        return []
    _emit(func, group, losses, grads, position, before, replace)
    for m in losses:
        log.info("raise_cross_entropy: nova.sce (reduction %s%s%s; labels outside [0, V)%s: %s) on %s",
                 m.form.reduction, f", ignore_index {m.form.ignore}" if m.form.ignore is not None else "",
                 f", times {m.scale:g}" if m.scale != 1.0 else "", ", negative ones wrapped" if m.form.wrap else "",
                 m.form.outside, logits.type)
    for m in grads:
        log.info("raise_cross_entropy: nova.sce_backward (reduction %s%s%s; labels outside [0, V)%s: %s) on %s",
                 m.form.reduction, f", ignore_index {m.form.ignore}" if m.form.ignore is not None else "",
                 ", times the cotangent" if m.cotangent is not None else "",
                 ", negative ones wrapped" if m.form.wrap else "", m.form.outside, logits.type)
    return ["nova.sce"] * len(losses) + ["nova.sce_backward"] * len(grads)


def _read_elsewhere(matches: list[_Match], logits: Value, func: Func, position) -> str | None:
    """Why the values computed from the logits inside the matches' cones would stay alive, if they would."""
    inside: set[Op] = {op for m in matches for op in m.cone.ops}
    roots = {m.value for m in matches}
    depends: set[Value] = {logits}
    copies: set[Value] = {logits}   # the logits converted or reshaped: they may stay
    for op in sorted(inside, key=position.__getitem__):
        if any(v in depends for v in op.operands):
            depends.update(op.results)
        if op.name in ("nova.convert", "nova.reshape") and op.operands[0] in copies:
            copies.update(op.results)
    depends -= copies
    returned = set(func.returns)
    for op in func.ops:
        if op in inside:
            continue
        for v in op.operands:
            if v in depends and v not in roots:
                return f"{v.owner.name} -> {v.type} is also read by {op.name}"
    for v in returned:
        if v in depends and v not in roots:
            return f"{v.owner.name} -> {v.type} is also returned"
    return None


def _emit(func, group: _Group, losses: list[_Match], grads: list[_Match], position, before, replace) -> None:
    logits, labels = group.logits, group.labels
    n, v = math.prod(logits.type.shape[:-1]), logits.type.shape[-1]
    last = max([position[x.owner] for x in (logits, labels) if x.owner is not None], default=-1)
    at = func.ops[last + 1]
    b = _Builder()
    flat = b.reshape(logits, (n, v))
    flat_labels = b.reshape(labels, (n,))
    read = {}     # (ignore, wrap, zero rule) -> (the labels nova.sce reads, which rows are out of range, ignore_index)

    def labels_for(form: _Form, builder: _Builder):
        key = (form.ignore, form.wrap, form.ignores_outside)
        if key not in read:
            read[key] = _labels_by_rule(builder, flat_labels, v, form)
        return read[key]

    lse = None
    for m in losses:
        nova_labels, outside, ignore = labels_for(m.form, b)
        loss, lse = sce_op(flat, nova_labels, reduction=m.form.reduction, ignore_index=ignore).results
        b.ops.append(loss.owner)
        if m.scale != 1.0:
            loss = b.binary("mul", loss, b.const(m.scale, loss.type.shape))
        if m.form.outside == "nan":       # the gather's NaN where a label is out of range
            nan = b("nova.select", [outside, b.const(0.0, (n,)), b.const(math.nan, (n,))], TensorType((n,), F32))
            loss = b.binary("add", loss, nan if m.form.reduction == "none" else b.reduce("sum", nan, 0))
        replace[m.value] = b.convert(b.reshape(loss, m.value.type.shape), m.value.type.dtype)
    for m in grads:
        labels_for(m.form, b)
    before[at] += b.ops
    for m in grads:
        g = _Builder()
        if m.form.reduction == "none":
            dloss = g.reshape(m.cotangent, (n,))
            dloss = g.binary("mul", g.f32(dloss), g.const(m.scale, (n,)))
        else:
            dloss = g.const(m.scale, ())
            if m.cotangent is not None:
                dloss = g.binary("mul", g.f32(g.reshape(m.cotangent, ())), dloss)
        nova_labels, _, ignore = labels_for(m.form, b)
        op = sce_backward_op(flat, nova_labels, lse, dloss, reduction=m.form.reduction, ignore_index=ignore)
        g.ops.append(op)
        d = g.convert(g.reshape(op.results[0], logits.type.shape), m.value.type.dtype)
        replace[m.value] = d
        before[m.value.owner] += g.ops


def _labels_by_rule(b: _Builder, labels: Value, v: int, form: _Form):
    """(the labels nova.sce reads for the form's rule (LABEL_RULES), which rows' labels are out of range
    (bool [N]), the ignore_index): negative labels wrapped where the rule wraps them, labels out of range
    replaced by the ignored one where the rule ignores their rows."""
    n, dtype = labels.type.shape[0], labels.type.dtype
    flag = TensorType((n,), "bool")
    ignore = form.ignore

    def compare(x, predicate, value):
        return b("nova.compare", [x, b.const(value, (n,), dtype)], flag, predicate=predicate)

    def select(which, if_false, if_true):
        return b("nova.select", [which, if_false, if_true], if_false.type)

    def kept(x):  # the ignored label stays itself
        return x if ignore is None else select(compare(labels, "eq", ignore), x, labels)

    yes, no = b.const(True, (n,), "bool"), b.const(False, (n,), "bool")
    read = kept(select(compare(labels, "lt", 0), labels, b.binary("add", labels, b.const(v, (n,), dtype)))) \
        if form.wrap else labels
    inside = select(compare(read, "lt", 0), compare(read, "lt", v), no)
    if ignore is not None:
        inside = select(compare(labels, "eq", ignore), inside, yes)
    outside = select(inside, yes, no)
    if form.outside == "zero":
        ignore = NO_LABEL if ignore is None else ignore
        read = select(inside, b.const(ignore, (n,), dtype), read)
    return read, outside, ignore


