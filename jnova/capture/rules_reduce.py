"""Conversion rules for reductions and contractions."""
from __future__ import annotations

import numpy as np
from jax import lax

from jnova.capture.to_nova import Unsupported, out_type, rule

# dot algorithms that mean what jnova computes: each operand in its own type (every operand type the
# algorithm lists as supported), products accumulated in f32. jax.nn.dot_product_attention asks for
# BF16_BF16_F32 on bf16 queries; XLA's CPU backend does not round an f32 operand of it to bf16 either.
OPERAND_TYPE_ALGORITHMS = ("DEFAULT", "F32_F32_F32", "BF16_BF16_F32", "F16_F16_F32")

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
    """Mixed operand types (int8 x bf16) are fine: the lowering converts each operand to the accumulator."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    out = out_type(eqn)
    precision = eqn.params.get("precision")
    if isinstance(precision, lax.DotAlgorithm) or (
            isinstance(precision, lax.DotAlgorithmPreset) and not _operand_type_algorithm(precision, lhs, rhs)):
        raise Unsupported(f"precision={precision} (jnova computes in the operand types, accumulating in f32)")
    if "bool" in (lhs.type.dtype, rhs.type.dtype):
        raise Unsupported("bool operands")
    return b.emit("nova.matmul", [lhs, rhs], out, lhs_batch=tuple(map(int, lb)), rhs_batch=tuple(map(int, rb)),
                  lhs_contract=tuple(map(int, lc)), rhs_contract=tuple(map(int, rc)))


def _operand_type_algorithm(preset, lhs, rhs) -> bool:
    if preset.name not in OPERAND_TYPE_ALGORITHMS:
        return False
    if preset.name == "DEFAULT":
        return True
    names = lambda types: {np.dtype(t).name for t in types}  # noqa: E731
    return lhs.type.dtype in names(preset.supported_lhs_types) and rhs.type.dtype in names(preset.supported_rhs_types)
