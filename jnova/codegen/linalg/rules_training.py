"""nova.sce, nova.layernorm, nova.rmsnorm, nova.gelu and their backwards on the CPU: their generic
decomposition (passes/expand_training.py), lowered in place with the other ops' rules inside the
kernel that holds the op."""
from __future__ import annotations

from jnova.codegen.linalg.lowering import lower_decomposition, lowering
from jnova.dialect.ops_training import TRAINING_OPS
from jnova.passes.expand_training import training_decomposition


@lowering(*TRAINING_OPS)
def _training(em, op, *operands):
    return lower_decomposition(em, op, operands, training_decomposition)
