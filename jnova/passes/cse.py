"""cse: merge ops that compute the same thing (same name, operands, attributes and result types).

Attributes are compared by what they mean to the op (through the kind it declares): floats by their
bits (so -0.0 and 0.0 stay apart and equal NaNs merge), dense constants by dtype, shape and bytes,
integers and bools as such. Ops with side effects (`nova.fallback`) are never merged, nor are ops
carrying an attribute their class does not declare.
"""
from __future__ import annotations

import logging
import struct

import numpy as np

from jnova.dialect.ir import Bool, Dense, F64, Func, I64, I64Array, Op, Str, Value
from jnova.dialect.types import numpy_dtype
from jnova.passes import TRACE

log = logging.getLogger("jnova.passes")


def cse(func: Func) -> int:
    """Replace repeated pure ops by their first occurrence, in place; returns how many were merged."""
    replace: dict[Value, Value] = {}
    seen: dict[tuple, list[Value]] = {}
    kept = []
    for op in func.ops:
        op.operands = [replace.get(v, v) for v in op.operands]
        key = op_key(op) if op.pure else None
        if key is not None:
            if key in seen:
                log.log(TRACE, "cse: %r is a repeat", op)
                for r, prev in zip(op.results, seen[key]):
                    replace[r] = prev
                continue
            seen[key] = op.results
        kept.append(op)
    func.returns = [replace.get(v, v) for v in func.returns]
    merged = len(func.ops) - len(kept)
    func.ops = kept
    log.debug("cse: merged %d ops in func @%s", merged, func.name)
    return merged


def op_key(op: Op) -> tuple | None:
    """What identifies the op's computation, or None if it cannot be told (an undeclared attribute)."""
    attrs = []
    for name in sorted(op.attrs):
        kind = op.attributes.get(name)
        if kind is None:
            return None
        attrs.append((name, attr_key(kind, op.attrs[name], op)))
    return (op.name, tuple(id(v) for v in op.operands), tuple(attrs), tuple(r.type for r in op.results))


def attr_key(kind, value, op: Op):
    """A hashable stand-in for an attribute value that is equal exactly when the values mean the same."""
    if kind is F64:
        return struct.pack("<d", float(value))
    if kind is I64:
        return int(value)
    if kind is Bool:
        return bool(value)
    if kind is Str:
        return str(value)
    if kind is I64Array:
        return tuple(int(v) for v in value)
    if kind is Dense:
        array = np.ascontiguousarray(value, dtype=numpy_dtype(op.results[0].type.dtype))
        return (array.dtype.str, array.shape, array.tobytes())
    raise TypeError(f"cse: no key for attribute kind {kind.__name__}")
