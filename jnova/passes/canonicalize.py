"""canonicalize: local simplifications that never change a result bit.

Replaces ops that do nothing (reshape/convert/broadcast/transpose to the same type) by their
operand. Rewrites that could change floating-point results (x + 0 -> x is wrong for -0.0) are
not done.
"""
from __future__ import annotations

from jnova.dialect.ir import Func, Value

IDENTITY_WHEN_SAME_TYPE = {"nova.reshape", "nova.convert", "nova.broadcast"}


def canonicalize(func: Func) -> int:
    """Simplify in place; returns how many ops were replaced."""
    replace: dict[Value, Value] = {}
    kept = []
    for op in func.ops:
        op.operands = [replace.get(v, v) for v in op.operands]
        if _is_identity(op):
            replace[op.results[0]] = op.operands[0]
            continue
        kept.append(op)
    func.returns = [replace.get(v, v) for v in func.returns]
    removed = len(func.ops) - len(kept)
    func.ops = kept
    return removed


def _is_identity(op) -> bool:
    if op.name in IDENTITY_WHEN_SAME_TYPE:
        if op.name == "nova.broadcast" and op.attrs["dims"] != tuple(range(op.results[0].type.rank)):
            return False
        return op.operands[0].type == op.results[0].type
    if op.name == "nova.transpose":
        return op.attrs["perm"] == tuple(range(len(op.attrs["perm"])))
    return False
