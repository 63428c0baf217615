"""cse: merge ops that compute the same thing (same name, operands, attributes and result types)."""
from __future__ import annotations

import numpy as np

from jnova.dialect.ir import Func, Value


def _attr_key(value):
    if isinstance(value, np.ndarray):
        return ("dense", value.dtype.str, value.shape, value.tobytes())
    return value


def cse(func: Func) -> int:
    """Replace repeated pure ops by their first occurrence, in place; returns how many were merged."""
    replace: dict[Value, Value] = {}
    seen: dict[tuple, list[Value]] = {}
    kept = []
    for op in func.ops:
        op.operands = [replace.get(v, v) for v in op.operands]
        if op.pure:
            key = (op.name, tuple(id(v) for v in op.operands),
                   tuple(sorted((k, _attr_key(v)) for k, v in op.attrs.items())),
                   tuple(r.type for r in op.results))
            if key in seen:
                for r, prev in zip(op.results, seen[key]):
                    replace[r] = prev
                continue
            seen[key] = op.results
        kept.append(op)
    func.returns = [replace.get(v, v) for v in func.returns]
    merged = len(func.ops) - len(kept)
    func.ops = kept
    return merged
