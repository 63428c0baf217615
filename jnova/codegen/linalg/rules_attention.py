"""nova.attention and nova.attention_backward on the CPU: their generic decomposition, lowered in place.

The decomposition (passes/expand_attention.py) is lowered with the other ops' rules inside the
attention op's own kernel, so its scores and probabilities are values of that kernel only: the plan
around it holds q, k, v, o, lse (and the gradients), never a B*H*Tq*Tk buffer.
"""
from __future__ import annotations

from jnova.codegen.linalg.lowering import lower_decomposition, lowering
from jnova.passes.expand_attention import ATTENTION_OPS, attention_decomposition


@lowering(*ATTENTION_OPS)
def _attention(em, op, *operands):
    return lower_decomposition(em, op, operands, attention_decomposition)
