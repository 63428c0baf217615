"""canonicalize: local rewrites that never change a result bit.

Each pattern looks at one op (and the ops that define its operands) and returns a Value that
replaces the op's result, a new Op that replaces the op, or None. Patterns:

- identity reshape / convert / broadcast / transpose (same type, or the identity permutation): the operand;
- reshape of a reshape: one reshape; transpose of a transpose: one transpose (or none);
- a reduction over size-1 dims only: a reshape (what XLA makes of it, so jax.jit's bits);
- convert of a convert, only where the first is exact: x -> wider -> x is x (f32 -> f64 -> f32,
  bf16 -> f32 -> bf16, int8 -> int32 -> int8), and two exact widenings are one (bf16 -> f32 -> f64).
  Never a rounding first step (f32 -> bf16 -> f32 rounds). As in XLA, a signalling NaN that the
  widening would have quieted stays signalling;
- an empty result (a dimension of size 0) of a pure op: an empty constant; a reduction of an empty
  operand: its identity (0, 1, -inf / the least integer, +inf / the greatest, True, False), and a
  contraction over an empty dimension: zeros, as XLA folds them (up to MAX_FOLDED_ELEMENTS results).
  No kernel then has an empty loop to schedule;
- broadcast of a splat constant: a splat constant of the result type (up to MAX_FOLDED_ELEMENTS);
- elementwise ops on constants, folded with NumPy only where NumPy is bit-exact with the compiled
  op: integer and bool arithmetic/bitwise ops and comparisons; f32/f64 add, sub, mul, div, neg, abs
  and comparisons when no operand or result is NaN or subnormal (NaN bits depend on operand order,
  and a CPU may flush subnormals). Results up to MAX_FOLDED_ELEMENTS.

Rewrites that could change floating-point results (x + 0 -> x is wrong for -0.0) are not done.
"""
from __future__ import annotations

import logging
import operator
from typing import Callable

import ml_dtypes
import numpy as np

from jnova.dialect.ir import Func, Op, Value
from jnova.dialect.ops import ConstantOp, ConvertOp, ElementwiseOp, ReshapeOp, TransposeOp
from jnova.dialect.types import FLOAT_DTYPES, INTEGER_DTYPES, SIGNED_DTYPES, UNSIGNED_DTYPES, bitwidth, numpy_dtype
from jnova.passes import TRACE

log = logging.getLogger("jnova.passes")

MAX_FOLDED_ELEMENTS = 1024

def canonicalize(func: Func) -> int:
    """Simplify in place; returns how many rewrites were applied (dead producers are left to dce)."""
    replace: dict[Value, Value] = {}
    kept: list[Op] = []
    changes = 0
    for op in func.ops:
        op.operands = [replace.get(v, v) for v in op.operands]
        current: Op | Value = op
        while isinstance(current, Op):
            rewritten = _first_rewrite(current)
            if rewritten is None:
                break
            changes += 1
            log.log(TRACE, "canonicalize: %s rewrote %r into %r", rewritten[0], current, rewritten[1])
            current = rewritten[1]
        if isinstance(current, Value):
            replace[op.results[0]] = current
        else:
            kept.append(current)
            replace.update((old, new) for old, new in zip(op.results, current.results) if old is not new)
    func.returns = [replace.get(v, v) for v in func.returns]
    func.ops = kept
    log.debug("canonicalize: %d rewrites in func @%s", changes, func.name)
    return changes


def _first_rewrite(op: Op) -> tuple[str, "Value | Op"] | None:
    for pattern in PATTERNS.get(op.name, ()) + GENERIC_PATTERNS:
        out = pattern(op)
        if out is not None:
            return pattern.__name__, out
    return None


def _producer(v: Value, cls: type[Op]) -> Op | None:
    return v.owner if isinstance(v.owner, cls) else None


def _same(op: Op, operands, **attrs) -> Op:
    """A new op of op's kind and result types, on other operands/attributes."""
    return type(op)(operands, [r.type for r in op.results], {**op.attrs, **attrs}, loc=op.loc)


# --------------------------------------------------------------------------- shape ops
def identity_same_type(op: Op) -> Value | None:
    """reshape/convert/broadcast to the operand's own type."""
    x = op.operands[0]
    return x if x.type == op.results[0].type else None


def identity_transpose(op: Op) -> Value | None:
    return op.operands[0] if tuple(op.attrs["perm"]) == tuple(range(len(op.attrs["perm"]))) else None


def reshape_of_reshape(op: Op) -> Op | None:
    inner = _producer(op.operands[0], ReshapeOp)
    return _same(op, [inner.operands[0]]) if inner is not None else None


def reduce_of_size_1_dims(op: Op) -> Op | None:
    """A reduction over size-1 dims only (a broadcast's transpose in a backward pass) is a reshape:
    XLA's algebraic simplifier rewrites it so (the init value is the reduction's identity), so the
    result keeps jax.jit's bits, -0.0 included."""
    x = op.operands[0]
    if any(x.type.shape[d] != 1 for d in op.attrs["dims"]):
        return None
    return ReshapeOp([x], [op.results[0].type], {}, loc=op.loc)


def transpose_of_transpose(op: Op) -> Op | None:
    """Result dim j of t2(t1(x)) is x's dim p1[p2[j]]."""
    inner = _producer(op.operands[0], TransposeOp)
    if inner is None:
        return None
    p1, p2 = inner.attrs["perm"], op.attrs["perm"]
    return _same(op, [inner.operands[0]], perm=tuple(p1[j] for j in p2))


def exact_convert_chain(op: Op) -> "Value | Op | None":
    inner = _producer(op.operands[0], ConvertOp)
    if inner is None:
        return None
    x = inner.operands[0]
    a, b, c = x.type.dtype, inner.results[0].type.dtype, op.results[0].type.dtype
    if not is_exact_conversion(a, b):
        return None
    if a == c:
        return x
    if is_exact_conversion(b, c):
        return _same(op, [x])
    return None


def is_exact_conversion(src: str, dst: str) -> bool:
    """Whether every `src` value converts to `dst` exactly (and back: dst -> src recovers it)."""
    if src == dst:
        return True
    if dst == "bool":
        return False
    if src == "bool":
        return True
    if src in FLOAT_DTYPES:
        return dst in FLOAT_DTYPES and _float_fits(src, dst)
    if dst in FLOAT_DTYPES:  # every integer of src is exact in dst's significand
        bits = bitwidth(src) - (1 if src in SIGNED_DTYPES else 0)
        return bits <= _finfo(dst).nmant + 1
    if src in UNSIGNED_DTYPES and dst in SIGNED_DTYPES:
        return bitwidth(dst) > bitwidth(src)
    if src in SIGNED_DTYPES and dst in UNSIGNED_DTYPES:
        return False
    return src in INTEGER_DTYPES and bitwidth(dst) >= bitwidth(src)


def _finfo(dtype: str):
    return ml_dtypes.finfo(numpy_dtype(dtype))  # numpy's finfo does not know bfloat16


def _float_fits(src: str, dst: str) -> bool:
    s, d = _finfo(src), _finfo(dst)
    return d.nmant >= s.nmant and d.maxexp >= s.maxexp and d.minexp <= s.minexp


# --------------------------------------------------------------------------- empty tensors
def empty_result(op: Op) -> Op | None:
    """A pure op with one result of size 0 computes nothing: an empty constant of its type."""
    if isinstance(op, ConstantOp) or not op.pure or len(op.results) != 1 or op.results[0].type.size != 0:
        return None
    out = op.results[0].type
    return ConstantOp([], [out], {"value": np.zeros(out.shape, numpy_dtype(out.dtype))}, loc=op.loc)


def reduce_of_empty(op: Op) -> Op | None:
    """A reduction of an empty operand is its identity everywhere."""
    x, out = op.operands[0].type, op.results[0].type
    if x.size != 0 or out.size > MAX_FOLDED_ELEMENTS:
        return None
    return _splat(op, out, _reduction_identity(op.attrs["kind"], numpy_dtype(out.dtype)))


def contraction_over_empty(op: Op) -> Op | None:
    """A contraction whose contracted dimensions hold no element is zeros."""
    lhs, out = op.operands[0].type, op.results[0].type
    if all(lhs.shape[d] for d in op.attrs["lhs_contract"]) or out.size > MAX_FOLDED_ELEMENTS:
        return None
    return _splat(op, out, 0)


def _splat(op: Op, out, element) -> ConstantOp:
    return ConstantOp([], [out], {"value": np.full(out.shape, element, numpy_dtype(out.dtype))}, loc=op.loc)


def _reduction_identity(kind: str, dtype: np.dtype):
    if kind in ("sum", "or", "xor"):
        return 0
    if kind == "prod":
        return 1
    if kind == "and":
        return True if dtype == np.bool_ else -1
    if dtype == np.bool_:
        return kind == "min"
    bounds = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else None
    if kind == "max":
        return bounds.min if bounds is not None else -np.inf
    return bounds.max if bounds is not None else np.inf


# --------------------------------------------------------------------------- constants
def broadcast_of_splat_constant(op: Op) -> Op | None:
    const = _producer(op.operands[0], ConstantOp)
    out = op.results[0].type
    if const is None or out.size > MAX_FOLDED_ELEMENTS or not _is_splat(const.attrs["value"]):
        return None
    element = const.attrs["value"].reshape(-1)[:1]
    return ConstantOp([], [out], {"value": np.broadcast_to(element.reshape(()), out.shape).copy()}, loc=op.loc)


def _is_splat(value: np.ndarray) -> bool:
    """All elements have the same bits (so -0.0 and 0.0, or two NaN payloads, are not a splat)."""
    if value.size == 0:
        return False
    by_element = np.ascontiguousarray(value).reshape(-1).view(np.uint8).reshape(value.size, -1)
    return bool((by_element == by_element[0]).all())


_COMPARE = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt,
            "ge": operator.ge}
_INT_FOLDS: dict[str, Callable] = {
    "nova.add": np.add, "nova.sub": np.subtract, "nova.mul": np.multiply, "nova.neg": np.negative,
    "nova.abs": np.abs, "nova.and": np.bitwise_and, "nova.or": np.bitwise_or, "nova.xor": np.bitwise_xor,
    "nova.not": np.invert,
}
_BOOL_FOLDS = {k: _INT_FOLDS[k] for k in ("nova.and", "nova.or", "nova.xor", "nova.not")}
_FLOAT_FOLDS: dict[str, Callable] = {
    "nova.add": np.add, "nova.sub": np.subtract, "nova.mul": np.multiply, "nova.div": np.divide,
    "nova.neg": np.negative, "nova.abs": np.abs,
    "nova.sqrt": np.sqrt,  # correctly rounded in IEEE 754, as NumPy's and the GPU's sqrt.rn (the scale of attention)
}


def fold_constant_elementwise(op: Op) -> Op | None:
    if not isinstance(op, ElementwiseOp) or op.results[0].type.size > MAX_FOLDED_ELEMENTS:
        return None
    consts = [_producer(v, ConstantOp) for v in op.operands]
    fn = _exact_numpy_fold(op)
    if fn is None or any(c is None for c in consts):
        return None
    inputs = [c.attrs["value"] for c in consts]
    with np.errstate(all="ignore"):
        result = np.asarray(fn(*inputs))
    out = op.results[0].type
    if result.dtype != numpy_dtype(out.dtype) or result.shape != out.shape:
        return None
    floats = [a for a in inputs + [result] if a.dtype.kind == "f"]
    if not all(_plain_floats(a) for a in floats):
        return None
    return ConstantOp([], [out], {"value": np.array(result)}, loc=op.loc)


def _exact_numpy_fold(op: Op) -> Callable | None:
    """The NumPy function that computes `op` bit-exactly on its operand dtype, if there is one."""
    dtype = op.operands[0].type.dtype
    if dtype in FLOAT_DTYPES and dtype not in ("float32", "float64"):
        return None
    if op.name == "nova.compare":
        return _COMPARE.get(op.attrs["predicate"])
    if dtype == "bool":
        return _BOOL_FOLDS.get(op.name)
    if dtype in INTEGER_DTYPES:
        return _INT_FOLDS.get(op.name)
    return _FLOAT_FOLDS.get(op.name)


def _plain_floats(a: np.ndarray) -> bool:
    """No NaN and no subnormal (zeros and infinities are fine)."""
    if np.isnan(a).any():
        return False
    magnitude = np.abs(a)
    return not ((magnitude > 0) & (magnitude < np.finfo(a.dtype).tiny)).any()


PATTERNS: dict[str, tuple] = {
    "nova.reshape": (identity_same_type, reshape_of_reshape),
    "nova.convert": (identity_same_type, exact_convert_chain),
    "nova.broadcast": (identity_same_type, broadcast_of_splat_constant),
    "nova.transpose": (identity_transpose, transpose_of_transpose),
    "nova.reduce": (reduce_of_empty, reduce_of_size_1_dims),
    "nova.matmul": (contraction_over_empty,),
}
GENERIC_PATTERNS: tuple = (empty_result, fold_constant_elementwise)
