"""raise_training: find GELU, LayerNorm and RMSNorm in the generic nova ops that users' code (jax.nn,
Flax) and JAX's AD produce, and replace them by nova.gelu / nova.gelu_backward, nova.layernorm and
nova.rmsnorm (dialect/ops_training.py).

How each is recognized:
- GELU, forward and backward, by value: an elementwise cone (the elementwise ops, constants and
  broadcast scalars that compute one value from its leaves) holding a tanh, erf or erfc whose only
  leaf is x (forward), or whose leaves are x of a recognized forward and one more value dy
  (backward), is evaluated at `PROBES` points and kept if it equals gelu(x) or dy * gelu'(x) (the form
  of the cone's transcendental) within the rounding of its element type. This finds jax.nn.gelu's
  forms in f32 and bf16, with Flax's converts, whatever the order JAX's AD wrote the chain rule in.
- LayerNorm and RMSNorm forward: the row statistics by structure from each rsqrt (sums over the last
  dimension divided by its size: E[x] and E[x^2], Flax's variance max(0, E[x^2] - E[x]^2), plus a
  constant epsilon), then the normalized output by value over its broadcast leaves (which leaf is
  the mean, the rstd, the scale, the bias). The raised op's mean and rstd replace the statistics, so
  the backward (left as AD wrote it) reads them and they are computed once.

Softmax cross-entropy, forward and backward, is raised to nova.sce / nova.sce_backward by
raise_cross_entropy.py, in the same pipeline stage (where the backend keeps those ops:
backends.keeps_training_op). The norms' backwards are dialect ops but not raised yet.

A match replaces the value it computes; interior values that other ops read (the residuals JAX's
AD saved for the backward) keep their ops, and what nothing reads any more is dropped by the dce
that follows. Candidates refused are logged on logger `jnova.passes` with the reason at DEBUG, each
raised op at INFO; unrecognized code stays as it was, so it stays correct.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jnova.dialect.ir import Func, Op, Value
from jnova.dialect.ops import ElementwiseOp, OPS
from jnova.dialect.ops_training import TRAINING_OPS, gelu_backward_op, gelu_op, layernorm_op, rmsnorm_op
from jnova.dialect.types import TensorType, numpy_dtype

log = logging.getLogger("jnova.passes")

FLOATS = ("float32", "bfloat16", "float16")
MAX_CONE_OPS = 192    # an elementwise cone larger than this is not a GELU (converts between 16-bit ops count)
PROBES = 97 + 16      # points a cone is evaluated at: 97 within [-6, 6], then 16 wide ones (`WIDE`)
WIDE = np.array([8.0, 10, 15, 25, 50, 100, 1e3, 1e4])  # and their negatives: a clip at any of these binds
# how far a cone's values may be from the definition's (f64) and still be it: the rounding of its type
PROBE_TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 4e-2}
CONE_NAMES = {"nova.convert", "nova.select", "nova.compare"}
TRANSCENDENTAL = {"nova.tanh", "nova.erf", "nova.erfc"}


# --------------------------------------------------------------------------- def-use
class _Uses:
    def __init__(self, func: Func):
        self.users: dict[Value, list[Op]] = defaultdict(list)
        for op in func.ops:
            for v in op.operands:
                self.users[v].append(op)
        self.returned = set(func.returns)


def _scalar(v: Value) -> float | None:
    """The one value of `v` if it is a constant of equal elements (possibly broadcast, reshaped or
    converted: excess precision computes 16-bit constants as their f32 conversion)."""
    op = v.owner
    while op is not None and op.name in ("nova.broadcast", "nova.reshape", "nova.convert"):
        op = op.operands[0].owner
    if op is None or op.name != "nova.constant":
        return None
    value = np.asarray(op.attrs["value"])
    if value.size == 0:
        return None
    first = value.reshape(-1)[0]
    return float(first) if (value == first).all() else None


@dataclass
class _Cone:
    """The elementwise ops computing `root` from `leaves` (constants inlined), in program order."""

    root: Value
    ops: list[Op]
    leaves: list[Value]
    transcendental: bool


def _cone(root: Value, stops: set[Value]) -> _Cone | None:
    shape = root.type.shape
    ops: dict[Op, None] = {}
    leaves: dict[Value, None] = {}
    stack = [root]
    while stack:
        v = stack.pop()
        op = v.owner
        if v in stops or op is None:
            leaves[v] = None
            continue
        if op in ops:
            continue
        if _scalar(v) is not None:
            ops[op] = None
            continue
        elementwise = isinstance(op, ElementwiseOp) or op.name in CONE_NAMES
        if not elementwise or op.results[0].type.shape != shape or len(op.results) != 1:
            leaves[v] = None
            continue
        ops[op] = None
        if len(ops) > MAX_CONE_OPS:
            return None
        stack.extend(op.operands)
    order = sorted(ops, key=lambda o: _position(o))
    return _Cone(root, order, list(leaves), any(o.name in TRANSCENDENTAL for o in order))


_POSITION: dict[Op, int] = {}
_EVALUATE: list = [None]  # the op evaluator raise_training was handed


def _position(op: Op) -> int:
    return _POSITION[op]


def _evaluate(cone: _Cone, samples: dict[Value, np.ndarray], widen: bool = False) -> np.ndarray:
    """The cone's root at the sample points: every op applied to [PROBES] vectors (constants as scalars).
    With `widen`, 16-bit float ops compute in f32: the function the cone's ops and constants define (its
    constants rounded as the program has them), without the rounding of each step, so that it can be
    told from another function by far less than the 16-bit type's tolerance."""
    env = {}
    for leaf, x in samples.items():
        env[leaf] = jnp.asarray(_widened(x.astype(numpy_dtype(leaf.type.dtype)), widen))
    for op in cone.ops:
        s = _scalar(op.results[0])
        if s is not None and op.name in ("nova.constant", "nova.broadcast", "nova.reshape", "nova.convert"):
            env[op.results[0]] = jnp.asarray(_widened(np.full((PROBES,), s, numpy_dtype(op.results[0].type.dtype)), widen))
            continue
        small = _vector_op(op, widen)
        env[op.results[0]] = _EVALUATE[0](small, *[env[v] for v in op.operands])[0]
    return np.asarray(env[cone.root], np.float64)


def _widened(x: np.ndarray, widen: bool) -> np.ndarray:
    return x.astype(np.float32) if widen and x.dtype.name in ("bfloat16", "float16") else x


def _vector_op(op: Op, widen: bool = False) -> Op:
    """`op` over [PROBES] vectors instead of its own shape (elementwise ops only); with `widen`, 16-bit
    float results in f32."""
    def dtype(t):
        return "float32" if widen and t.dtype in ("bfloat16", "float16") else t.dtype

    small = OPS[op.name]([], [TensorType((PROBES,), dtype(r.type)) for r in op.results], op.attrs)
    return small


# how far a GELU cone evaluated in f32 (`widen`) may be from the definition: its constants' rounding in
# the cone's type (bf16's sqrt(2/pi) is 1.3e-3 off) and f32's own; relative to |gelu(x)| + |x|
FUNCTION_TOLERANCE = {"float32": 4e-6, "float16": 1e-3, "bfloat16": 2.5e-3}


def _function_error(got: np.ndarray, want: np.ndarray, scale: np.ndarray, dtype: str) -> float:
    """The largest difference in units of `FUNCTION_TOLERANCE` times (|want| + scale), the scale of
    the terms the function is computed from (|x| for a GELU): a function another one differs from by
    more than its type's rounding is never taken for it (a tanh-GELU with another cubic coefficient,
    0.5 x (1 + tanh(sqrt(2/pi) x)) in bf16)."""
    bound = FUNCTION_TOLERANCE.get(dtype, FUNCTION_TOLERANCE["float32"]) * (np.abs(want) + scale + 1e-30)
    return float(np.max(np.abs(got - want) / bound))


def _error(got: np.ndarray, want: np.ndarray, dtype: str) -> float:
    """The largest difference in units of the type's tolerance (relative, with an absolute floor of a
    quarter of the largest value: the cancellations of 1 + tanh near -1); at most 1 is a match. The
    points within [-6, 6] and the wide ones are held each to its own floor: the wide ones' values
    (up to 1e4) would make the floor of the others too loose to tell a GELU from another function."""
    def error(got, want):
        tol = PROBE_TOLERANCE.get(dtype, 1e-4)
        bound = tol * (np.abs(want) + 0.25 * np.abs(want).max() + 1e-6)
        return float(np.max(np.abs(got - want) / bound))

    narrow = PROBES - 2 * len(WIDE)
    return max(error(got[:narrow], want[:narrow]), error(got[narrow:], want[narrow:]))


# --------------------------------------------------------------------------- GELU definitions (f64)
def _phi(x: np.ndarray, form: str) -> tuple[np.ndarray, np.ndarray]:
    """(Phi(x), x * Phi'(x)) of the GELU form."""
    if form == "tanh":
        k = math.sqrt(2 / math.pi)
        t = np.tanh(k * (x + 0.044715 * x ** 3))
        return 0.5 * (1 + t), 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)
    erf = np.vectorize(math.erf)
    return 0.5 * (1 + erf(x / math.sqrt(2))), x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _probe_points(rng: np.random.Generator, dtype: str) -> np.ndarray:
    """x within [-6, 6] (where GELU curves), then +-`WIDE`: where a GELU is x or 0, and a clip of it
    (`jnp.minimum(gelu(x), 8.0)`), which points within [-6, 6] never reach, shows."""
    narrow = PROBES - 2 * len(WIDE)
    x = np.concatenate([np.linspace(-6, 6, narrow - 17), rng.standard_normal(17) * 2, WIDE, -WIDE])
    return x.astype(numpy_dtype(dtype)).astype(np.float64)


def _narrowest(cone: _Cone, *values: Value) -> str:
    """The narrowest float type among `values` and the cone's results: the rounding of its constants."""
    dtypes = {v.type.dtype for v in values} | {r.type.dtype for o in cone.ops for r in o.results}
    for dtype in ("bfloat16", "float16"):
        if dtype in dtypes:
            return dtype
    return "float32"


def _widest(*dtypes: str) -> str:
    return "float32" if "float32" in dtypes or len(set(dtypes)) > 1 else dtypes[0]


# --------------------------------------------------------------------------- the pass
@dataclass
class _Replacement:
    at: Op                       # the new ops go right before this op
    ops: list[Op]
    values: dict[Value, Value]   # old value -> the value computed by the new ops that replaces it


RAISED_OPS = frozenset({"nova.gelu", "nova.layernorm", "nova.rmsnorm"})


def raise_training(func: Func, evaluate_op: Callable, ops: frozenset[str] = RAISED_OPS) -> dict[str, int]:
    """Raise, in place, what this module recognizes of `ops` ("nova.gelu" for GELU and its backward,
    "nova.layernorm", "nova.rmsnorm"); returns how many of each op were raised.
    `evaluate_op(op, *arrays)` computes one nova op (the pipeline hands in primitives/nova_to_jax's:
    passes do not import the layers below them); the probes evaluate candidate cones with it."""
    unknown = set(ops) - RAISED_OPS
    if unknown:
        raise ValueError(f"raise_training: it raises {sorted(RAISED_OPS)}, not {sorted(unknown)}")
    _EVALUATE[0] = evaluate_op
    _POSITION.clear()
    _POSITION.update((op, i) for i, op in enumerate(func.ops))
    uses = _Uses(func)
    rng = np.random.default_rng(0)
    counts: dict[str, int] = defaultdict(int)
    replacements: list[_Replacement] = []
    if "nova.gelu" in ops:
        gelus = _raise_gelu_forward(func, uses, rng, replacements)
        _raise_gelu_backward(func, uses, rng, gelus, replacements)
    if ops & {"nova.layernorm", "nova.rmsnorm"}:
        _raise_norms(func, uses, rng, replacements)
        replacements = [r for r in replacements  # a LayerNorm without the RMSNorm, or the other way round
                        if next(op.name for op in r.ops if op.name in TRAINING_OPS).removesuffix("_backward") in ops]
    for r in replacements:
        counts[next(op.name for op in r.ops if op.name in TRAINING_OPS)] += 1
    _apply(func, replacements)
    return dict(counts)


def _maximal(matches: dict[Value, object], uses: _Uses) -> list[Value]:
    """The matched values read by something other than a matched value's convert (or returned), less
    a convert of one of them: it stays a convert, of the raised value (a bf16 GELU gradient that the
    contractions read and, widened to f32, the bias gradient's sum: one raised op, not two)."""
    out = []
    for v in matches:
        readers = uses.users.get(v, [])
        only_converted = readers and all(u.name == "nova.convert" and u.results[0] in matches for u in readers)
        if not only_converted or v in uses.returned:
            out.append(v)
    kept = set(out)
    return [v for v in out if not (v.owner is not None and v.owner.name == "nova.convert" and v.owner.operands[0] in kept)]


def _candidates(func: Func):
    for op in func.ops:
        if len(op.results) == 1 and op.results[0].type.dtype in FLOATS and op.results[0].type.rank > 0 and (
                op.name in ("nova.mul", "nova.add", "nova.convert", "nova.sub")):
            yield op


def _single_input_cone(root: Value) -> _Cone | None:
    """The elementwise cone computing `root` from one value x through a tanh, erf or erfc, x the
    latest such value (x is often itself elementwise: a contraction's output plus its bias)."""
    whole = _cone(root, set())
    if whole is None or not whole.transcendental:
        return None
    inner = [r for o in reversed(whole.ops) for r in o.results if r is not root and _scalar(r) is None]
    for x in ([whole.leaves[0]] if len(whole.leaves) == 1 else []) + inner:
        cone = _cone(root, {x})
        if cone is not None and cone.transcendental and cone.leaves == [x]:
            return cone
    return None


def _raise_gelu_forward(func, uses, rng, replacements) -> dict[Value, str]:
    """Values that are gelu(x); returns x -> form for the backward's search."""
    matches: dict[Value, tuple[Value, str]] = {}
    for op in _candidates(func):
        if op.name not in ("nova.mul", "nova.convert"):
            continue
        cone = _single_input_cone(op.results[0])
        if cone is None:
            continue
        x = cone.leaves[0]
        if x.type.dtype not in FLOATS or x.type.shape != op.results[0].type.shape:
            continue
        dtype = _widest(x.type.dtype, op.results[0].type.dtype) if x.type.dtype != op.results[0].type.dtype else x.type.dtype
        points = _probe_points(rng, x.type.dtype)
        got = _evaluate(cone, {x: points}, widen=True)
        kind = _narrowest(cone, x, op.results[0])
        # the form is the cone's (in bf16 the two differ by less than its rounding)
        form = "tanh" if any(o.name == "nova.tanh" for o in cone.ops) else "erf"
        if _function_error(got, points * _phi(points, form)[0], np.abs(points), kind) <= 1:
            matches[op.results[0]] = (x, form)
        else:
            log.debug("raise_training: %s at %s: an elementwise function of one value with %s, not a GELU "
                      "(its values differ from the form's)", op.name, op.results[0].type,
                      [o.name for o in cone.ops if o.name in TRANSCENDENTAL])
    found: dict[Value, str] = {}
    for v in _maximal(matches, uses):
        x, form = matches[v]
        new = [gelu_op(x, approximate=form)]
        value = new[-1].results[0]
        if value.type.dtype != v.type.dtype:
            new.append(OPS["nova.convert"]([value], [v.type], {}))
            value = new[-1].results[0]
        replacements.append(_Replacement(v.owner, new, {v: value}))
        found[x] = form
        log.info("raise_training: nova.gelu (%s) on %s", form, x.type)
    return found


def _raise_gelu_backward(func, uses, rng, gelus: dict[Value, str], replacements) -> None:
    if not gelus:
        return
    matches: dict[Value, tuple[Value, Value, str]] = {}
    stops = set(gelus)
    for op in _candidates(func):
        cone = _cone(op.results[0], stops)
        if cone is None or len(cone.leaves) != 2:
            continue
        xs = [v for v in cone.leaves if v in gelus]
        if len(xs) != 1:
            continue
        x = xs[0]
        dy = next(v for v in cone.leaves if v is not x)
        if dy.type.shape != x.type.shape or dy.type.dtype not in FLOATS or not _uses_x_nonlinearly(cone, x):
            continue
        points = _probe_points(rng, x.type.dtype)
        d = rng.standard_normal(PROBES).astype(numpy_dtype(dy.type.dtype)).astype(np.float64)
        got = _evaluate(cone, {x: points, dy: d}, widen=True)
        phi, xdphi = _phi(points, gelus[x])
        kind = _narrowest(cone, x, dy, op.results[0])
        if _function_error(got, d * (phi + xdphi), np.abs(d) * (1 + np.abs(points)), kind) <= 1:
            matches[op.results[0]] = (x, _as_rounded(cone, dy), gelus[x])
    for v in _maximal(matches, uses):
        x, dy, form = matches[v]
        wide = _widest(x.type.dtype, dy.type.dtype)
        new: list[Op] = []

        def conv(value, dtype):
            if value.type.dtype == dtype:
                return value
            new.append(OPS["nova.convert"]([value], [value.type.with_dtype(dtype)], {}))
            return new[-1].results[0]

        new.append(gelu_backward_op(conv(x, wide), conv(dy, wide), approximate=form))
        value = conv(new[-1].results[0], v.type.dtype)
        replacements.append(_Replacement(v.owner, new, {v: value}))
        log.info("raise_training: nova.gelu_backward (%s) on %s", form, x.type)


def _as_rounded(cone: _Cone, leaf: Value) -> Value:
    """`leaf` as the cone reads it: its rounding to 16 bits when that is all the cone reads of it (a
    bf16 step's incoming gradient, the f32 result of a contraction rounded to bf16), so the rounding
    the program made stays where the value crosses memory; `leaf` otherwise."""
    readers = [op for op in cone.ops if leaf in op.operands]
    if len(readers) == 1 and readers[0].name == "nova.convert" and leaf.type.dtype == "float32" \
            and readers[0].results[0].type.dtype in ("bfloat16", "float16"):
        return readers[0].results[0]
    return leaf


def _uses_x_nonlinearly(cone: _Cone, x: Value) -> bool:
    """A cheap filter before probing: the cone holds a transcendental op (read through x's forward)
    or reads x more than once."""
    return cone.transcendental or sum(v is x for o in cone.ops for v in o.operands) > 1


def _apply(func: Func, replacements: list[_Replacement]) -> None:
    """Insert each replacement's ops before the op it replaces and redirect every use of its value."""
    before: dict[Op, list[Op]] = defaultdict(list)
    replace: dict[Value, Value] = {}
    for r in replacements:
        before[r.at] += r.ops
        replace.update(r.values)
    insert_and_replace(func, before, replace)


def insert_and_replace(func: Func, before: dict[Op, list[Op]], replace: dict[Value, Value]) -> None:
    """Insert the new ops before the ops they are placed at and redirect every use of a replaced value
    (the raising passes' last step)."""
    ops: list[Op] = []
    for op in func.ops:
        for new in before.get(op, ()):
            new.operands = [replace.get(v, v) for v in new.operands]
            ops.append(new)
        op.operands = [replace.get(v, v) for v in op.operands]
        ops.append(op)
    func.ops = ops
    func.returns = [replace.get(v, v) for v in func.returns]


# --------------------------------------------------------------------------- LayerNorm, RMSNorm
def _peel(v: Value) -> Value:
    """`v` before the broadcasts and reshapes that only add or drop dimensions of size 1."""
    while v.owner is not None and v.owner.name in ("nova.broadcast", "nova.reshape") and \
            v.owner.operands[0].type.size == v.type.size:
        v = v.owner.operands[0]
    return v


def _row_mean(v: Value) -> tuple[Value, Value] | None:
    """(t, the division's result) where `v` is sum(t over its last dimension) / C, the mean of t's rows."""
    d = _peel(v)
    if d.owner is None or d.owner.name != "nova.div":
        return None
    total, count = d.owner.operands
    red = _peel(total).owner
    if red is None or red.name != "nova.reduce" or red.attrs["kind"] != "sum":
        return None
    t = red.operands[0]
    if tuple(red.attrs["dims"]) != (t.type.rank - 1,) or _scalar(count) != float(t.type.shape[-1]):
        return None
    return t, d


def _square_of(t: Value) -> Value | None:
    op = t.owner
    if op is None:
        return None
    if op.name == "nova.square" or (op.name == "nova.ipow" and op.attrs["exponent"] == 2):
        return op.operands[0]
    if op.name == "nova.mul" and op.operands[0] is op.operands[1]:
        return op.operands[0]
    return None


@dataclass
class _Stats:
    x: Value
    rstd: Value                  # the rsqrt's result
    mean: Value | None           # LayerNorm: the division that is E[x]
    epsilon: float


def _norm_stats(r: Op) -> _Stats | None:
    """The statistics behind rsqrt op `r`: rsqrt(E[x^2] + eps) (RMSNorm) or rsqrt(max(0, E[x^2] - E[x]^2)
    + eps) (LayerNorm, Flax's fast variance)."""
    a = r.operands[0].owner
    if a is None or a.name != "nova.add":
        return None
    for var, eps in (a.operands, a.operands[::-1]):
        epsilon = _scalar(eps)
        if epsilon is None:
            continue
        v = _peel(var)
        if v.owner is not None and v.owner.name == "nova.max":
            lo, hi = v.owner.operands
            v = _peel(hi) if _scalar(lo) == 0.0 else _peel(lo) if _scalar(hi) == 0.0 else None
            if v is None:
                continue
        if v.owner is not None and v.owner.name == "nova.sub":   # E[x^2] - E[x]^2
            msq, sq = (_row_mean(v.owner.operands[0]), _square_of(_peel(v.owner.operands[1])))
            mean = _row_mean(sq) if sq is not None else None
            if msq is None or mean is None or _square_of(msq[0]) is not mean[0]:
                continue
            return _Stats(mean[0], r.results[0], mean[1], epsilon)
        msq = _row_mean(v)
        if msq is not None and _square_of(msq[0]) is not None:
            return _Stats(_square_of(msq[0]), r.results[0], None, epsilon)
    return None


def _base(v: Value) -> Value:
    """`v` before every broadcast and reshape."""
    while v.owner is not None and v.owner.name in ("nova.broadcast", "nova.reshape"):
        v = v.owner.operands[0]
    return v


def _along_rows(leaf: Value) -> bool:
    """Whether `leaf` (x's shape) is a per-row value broadcast along the last dimension."""
    op = leaf.owner
    if op is None or op.name != "nova.broadcast":
        return False
    src, rank = op.operands[0].type, leaf.type.rank
    dims = tuple(op.attrs["dims"])
    return (dims == tuple(range(rank)) and src.shape[-1] == 1) or dims == tuple(range(rank - 1))


def _param_of(leaf: Value, x: Value) -> Value | None:
    """The [C] value that `leaf` broadcasts along x's rows, if it does."""
    op, p = leaf.owner, _base(leaf)
    if op is None or op.name != "nova.broadcast" or p.type.shape != x.type.shape[-1:]:
        return None
    src = op.operands[0].type
    return p if op.attrs["dims"][-1] == leaf.type.rank - 1 and src.shape[-1] == x.type.shape[-1] else None


def _raise_norms(func, uses, rng, replacements) -> None:
    for op in func.ops:
        if op.name != "nova.rsqrt":
            continue
        stats = _norm_stats(op)
        if stats is None:
            continue
        kind = "layernorm" if stats.mean is not None else "rmsnorm"
        match = _norm_output(func, uses, stats, rng)
        if match is None:
            log.debug("raise_training: %s statistics of %s without a normalized output it recognizes", kind,
                      stats.x.type)
            continue
        y, scale, bias = match
        x = stats.x
        if kind == "layernorm":
            new = [layernorm_op(x, scale, bias, epsilon=stats.epsilon)]
        else:
            new = [rmsnorm_op(x, scale, epsilon=stats.epsilon)]
        values = {y: new[0].results[0]}
        rows = {stats.rstd: new[0].results[-1]}
        if stats.mean is not None:
            rows[stats.mean] = new[0].results[1]
        for old, value in rows.items():
            if old.type.shape != value.type.shape:
                new.append(OPS["nova.reshape"]([value], [old.type], {}))
                value = new[-1].results[0]
            values[old] = value
        first = min((v.owner for v in values), key=_position)
        late = [p for p in (x, scale, bias) if p is not None and p.owner is not None and
                _position(p.owner) >= _position(first)]
        if late:
            log.debug("raise_training: %s of %s refused: an input is computed after the statistics", kind, x.type)
            continue
        replacements.append(_Replacement(first, new, values))
        log.info("raise_training: nova.%s on %s (%s)", kind, x.type,
                 ", ".join(n for n, p in (("scale", scale), ("bias", bias)) if p is not None) or "no parameters")


def _norm_output(func, uses, stats: _Stats, rng):
    """(y, scale, bias) for the latest value y that is the normalized rows of x (times a scale, plus a bias)."""
    x = stats.x
    found = None
    seen = 0
    for op in func.ops[_position(stats.rstd.owner) + 1:]:
        if op.name not in ("nova.mul", "nova.add") or op.results[0].type != x.type:
            continue
        seen += 1
        if seen > 4 * MAX_CONE_OPS:
            break
        cone = _cone(op.results[0], {x})
        if cone is None or x not in cone.leaves:
            continue
        roles, params = {}, []
        for leaf in cone.leaves:
            if leaf is x:
                continue
            base = _base(leaf) if _along_rows(leaf) else None
            if base is not None and base is _base(stats.rstd):
                roles[leaf] = "rstd"
            elif base is not None and stats.mean is not None and base is stats.mean:
                roles[leaf] = "mean"
            elif _param_of(leaf, x) is not None and len(params) < 2:
                params.append(leaf)
            else:
                roles = None
                break
        if roles is None or "rstd" not in roles.values() or (stats.mean is not None and "mean" not in roles.values()):
            continue
        assigned = _assign_params(cone, x, roles, params, stats.mean is not None, rng)
        if assigned is not None:
            scale, bias = assigned
            found = (op.results[0], scale and _param_of(scale, x), bias and _param_of(bias, x))
    return found


def _assign_params(cone, x, roles, params, centered, rng):
    """(scale leaf, bias leaf) that make the cone (x - mean) * rstd * scale + bias, each possibly None."""
    n = PROBES
    sample = {x: rng.standard_normal(n) * 2}
    sample[x][n - 2 * len(WIDE):] *= 1e3  # normalized values up to ~1e4 too: a clip of the output binds
    ref = {"mean": rng.standard_normal(n), "rstd": rng.uniform(0.5, 2.0, n)}
    for leaf, role in roles.items():
        sample[leaf] = ref[role]
    for p in params:
        sample[p] = rng.standard_normal(n)
    dtype = cone.root.type.dtype
    got = _evaluate(cone, {k: v.astype(numpy_dtype(k.type.dtype)).astype(np.float64) for k, v in sample.items()})
    rounded = {k: v.astype(numpy_dtype(k.type.dtype)).astype(np.float64) for k, v in sample.items()}
    mean = ref["mean"] if centered else 0.0
    if centered:
        mean = next(rounded[k] for k, r in roles.items() if r == "mean")
    rstd = next(rounded[k] for k, r in roles.items() if r == "rstd")
    base = (rounded[x] - mean) * rstd
    options = [(None, None)] if not params else []
    if len(params) == 1:
        options = [(params[0], None)] + ([(None, params[0])] if centered else [])
    elif len(params) == 2 and centered:  # RMSNorm has a scale only
        options = [(params[0], params[1]), (params[1], params[0])]
    for scale, bias in options:
        want = base * (rounded[scale] if scale is not None else 1.0) + (rounded[bias] if bias is not None else 0.0)
        if _error(got, want, dtype if dtype != "float32" else "float32") <= 1:
            return scale, bias
    return None
