"""Conversion rules for `jnova.ops.attention`'s primitives: nova.attention and nova.attention_backward."""
from __future__ import annotations

from jnova.capture.attention_primitives import attention_backward_p, attention_p
from jnova.capture.to_nova import out_type, rule


def _attrs(eqn) -> dict:
    p = eqn.params
    return {"causal": bool(p["causal"]), "scale": float(p["scale"]), "layout": p["layout"],
            "optional_operand": p["optional_operand"]}


@rule(attention_p.name)
def _attention(b, eqn, *operands):
    return b.op("nova.attention", list(operands), [out_type(eqn, 0), out_type(eqn, 1)], **_attrs(eqn)).results


@rule(attention_backward_p.name)
def _attention_backward(b, eqn, *operands):
    return b.op("nova.attention_backward", list(operands), [out_type(eqn, i) for i in range(3)], **_attrs(eqn)).results
