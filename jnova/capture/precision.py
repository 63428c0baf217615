"""A contraction's precision as JAX defines it: `precision=` of a dot_general, else the context.

JAX writes the context (`jax.default_matmul_precision`, the `jax_default_matmul_precision` flag) into
each dot_general's `precision` when it traces, except "bfloat16", which it records as DEFAULT
(the two differ on GPUs only: XLA's DEFAULT runs TF32 there). So the context value read at trace
time decides a DEFAULT dot_general, and an explicit `precision=` decides every other one.

The result is one of the dialect's `MATMUL_PRECISIONS`: "default" (f32 operands may run in TF32),
"highest" (f32-accurate), "bfloat16" (f32 operands rounded to bf16); products accumulate in f32.
"""
from __future__ import annotations

import jax
import numpy as np
from jax import lax

# jax_default_matmul_precision's values (and the algorithm names it also takes) -> nova precision
CONTEXT_PRECISIONS = {
    None: "default", "default": "default", "high": "default", "tensorfloat32": "default",
    "DEFAULT": "default", "TF32_TF32_F32": "default",
    "highest": "highest", "float32": "highest", "F32_F32_F32": "highest", "TF32_TF32_F32_X3": "highest",
    "BF16_BF16_F32_X3": "highest", "BF16_BF16_F32_X6": "highest", "BF16_BF16_F32_X9": "highest",
    "bfloat16": "bfloat16", "BF16_BF16_F32": "bfloat16",
}
# dot algorithm presets on f32 operands -> nova precision (the multi-pass bf16 and TF32 algorithms
# get jnova's f32-accurate arithmetic: at least the accuracy they ask for)
F32_OPERAND_ALGORITHMS = {name: p for name, p in CONTEXT_PRECISIONS.items() if isinstance(name, str) and name.isupper()}
# presets that compute each operand in its own type, accumulating in f32, for the operand types they
# list (jax.nn.dot_product_attention asks for BF16_BF16_F32 on bf16 queries, with f32 operands in its
# backward pass, which XLA's CPU backend leaves in f32 too)
OPERAND_TYPE_ALGORITHMS = ("BF16_BF16_F32", "F16_F16_F32", "F32_F32_F32")


class UnsupportedPrecision(ValueError):
    """A precision or dot algorithm jnova does not compute (the dot_general falls back to XLA)."""


def context_precision() -> str | None:
    """The matmul precision the JAX context asks for now (read at trace time)."""
    return jax.config.jax_default_matmul_precision


def matmul_precision(precision, context: str | None, operand_dtypes: tuple[str, str]) -> str:
    """The nova precision of a dot_general with `precision` (its param: None, a Precision pair or a
    DotAlgorithmPreset) traced under the context value `context`, for operands of `operand_dtypes`."""
    if context not in CONTEXT_PRECISIONS:
        raise UnsupportedPrecision(f"jax_default_matmul_precision={context!r}")
    in_context = CONTEXT_PRECISIONS[context]
    if precision is None:
        return in_context
    if isinstance(precision, lax.DotAlgorithm):
        raise UnsupportedPrecision(f"precision={precision} (a DotAlgorithm; jnova takes the presets)")
    if isinstance(precision, lax.DotAlgorithmPreset):
        return _preset_precision(precision, in_context, operand_dtypes)
    pair = precision if isinstance(precision, tuple) else (precision, precision)
    if lax.Precision.HIGHEST in pair:
        return "highest"
    if in_context == "bfloat16" and all(p in (None, lax.Precision.DEFAULT) for p in pair):
        return "bfloat16"  # JAX records the "bfloat16" context as DEFAULT
    return "default"


def _preset_precision(preset, in_context: str, operand_dtypes: tuple[str, str]) -> str:
    name = preset.name
    if name == "DEFAULT":
        return in_context
    if operand_dtypes == ("float32", "float32") and name in F32_OPERAND_ALGORITHMS:
        return F32_OPERAND_ALGORITHMS[name]
    names = lambda types: {np.dtype(t).name for t in types}  # noqa: E731
    if name in OPERAND_TYPE_ALGORITHMS and operand_dtypes[0] in names(preset.supported_lhs_types) \
            and operand_dtypes[1] in names(preset.supported_rhs_types):
        return "default"  # the operands' own types, accumulated in f32: what jnova computes for them
    raise UnsupportedPrecision(f"precision={name} on {operand_dtypes[0]} x {operand_dtypes[1]} operands "
                               "(jnova computes in the operand types, accumulating in f32)")
