"""The fused attention backward as two ops, what the GPU's two backward kernels compute:

    nova.attention_dq    (q, k, v, o, lse, do [, extra]) -> dq, delta      delta = rowsum(do * o), f32 [B, Hq, Tq]
    nova.attention_dkdv  (q, k, v, lse, delta, do [, extra]) -> dk, dv

Together they are `nova.attention_backward` (dialect/ops_attention.py: the same attributes and
semantics); `passes/split_attention_backward.py` replaces a backward op by the pair in the GPU plan
where the kernels take it, so each becomes one launch of its own.
"""
from __future__ import annotations

from jnova.dialect.ops import register
from jnova.dialect.ops_attention import _AttentionBase
from jnova.dialect.types import TensorType


def _rows(op) -> TensorType:
    d = op.dims()
    return TensorType((d["B"], d["Hq"], d["Tq"]), "float32")


@register
class AttentionDqOp(_AttentionBase):
    """dq of `nova.attention` and delta = rowsum(do * o), the row term the dK/dV half reads."""

    name = "nova.attention_dq"
    operands_spec = ("q", "k", "v", "o", "lse", "do", "*extra")
    results_spec = ("dq", "delta")
    summary = "dq, delta of nova.attention from q, k, v, o, lse and do (the first half of its backward)"

    def verify_(self):
        self._verify_qkv()
        q = self.operands[0].type
        self._expect("operand 'o'", self.operands[3].type, q)
        self._expect("operand 'lse'", self.operands[4].type, _rows(self))
        self._expect("operand 'do'", self.operands[5].type, q)
        self._expect("result 'dq'", self.results[0].type, q)
        self._expect("result 'delta'", self.results[1].type, _rows(self))


@register
class AttentionDkdvOp(_AttentionBase):
    """dk and dv of `nova.attention` given lse and the dq half's delta."""

    name = "nova.attention_dkdv"
    operands_spec = ("q", "k", "v", "lse", "delta", "do", "*extra")
    results_spec = ("dk", "dv")
    summary = "dk, dv of nova.attention from q, k, v, lse, delta and do (the second half of its backward)"

    def verify_(self):
        self._verify_qkv()
        q, k, v = (self.operands[i].type for i in range(3))
        self._expect("operand 'lse'", self.operands[3].type, _rows(self))
        self._expect("operand 'delta'", self.operands[4].type, _rows(self))
        self._expect("operand 'do'", self.operands[5].type, q)
        self._expect("result 'dk'", self.results[0].type, k)
        self._expect("result 'dv'", self.results[1].type, v)
