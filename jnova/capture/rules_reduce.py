"""Conversion rules for reductions and contractions."""
from __future__ import annotations

from jnova.capture.to_nova import Unsupported, out_type, rule

REDUCE = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod",
          "reduce_and": "and", "reduce_or": "or", "reduce_xor": "xor"}


@rule(*REDUCE)
def _reduce(b, eqn, x):
    dims = tuple(sorted(int(a) for a in eqn.params["axes"]))
    if not dims:
        return x
    return b.emit("nova.reduce", [x], out_type(eqn), kind=REDUCE[eqn.primitive.name], dims=dims)


@rule("dot_general")
def _dot_general(b, eqn, lhs, rhs):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    out = out_type(eqn)
    if lhs.type.dtype != rhs.type.dtype:
        raise Unsupported(f"mixed operand types {lhs.type.dtype} x {rhs.type.dtype}")
    return b.emit("nova.matmul", [lhs, rhs], out, lhs_batch=tuple(map(int, lb)), rhs_batch=tuple(map(int, rb)),
                  lhs_contract=tuple(map(int, lc)), rhs_contract=tuple(map(int, rc)))
