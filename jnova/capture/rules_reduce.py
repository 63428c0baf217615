"""Conversion rules for reductions and contractions."""
from __future__ import annotations

from jnova.capture.precision import UnsupportedPrecision, matmul_precision
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
    """Mixed operand types (int8 x bf16) are fine: the lowering converts each operand to the accumulator.
    The precision (capture/precision.py) comes from the equation's `precision` and the context."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    out = out_type(eqn)
    try:
        precision = matmul_precision(eqn.params.get("precision"), b.matmul_precision, (lhs.type.dtype, rhs.type.dtype))
    except UnsupportedPrecision as e:
        raise Unsupported(str(e)) from None
    if "bool" in (lhs.type.dtype, rhs.type.dtype):
        raise Unsupported("bool operands")
    return b.emit("nova.matmul", [lhs, rhs], out, lhs_batch=tuple(map(int, lb)), rhs_batch=tuple(map(int, rb)),
                  lhs_contract=tuple(map(int, lc)), rhs_contract=tuple(map(int, rc)), precision=precision)
