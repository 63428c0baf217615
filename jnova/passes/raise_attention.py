"""raise_attention: attention as the user wrote it, raised to nova.attention and nova.attention_backward.

Recognized, forward and the backward JAX's AD produced for it, in f32 and bf16:

- the cuDNN form: `jax.nn.dot_product_attention(implementation="cudnn")` binds the primitives
  `dot_product_attention_fwd_wrapper` / `_bwd_wrapper`, which capture keeps as fallback ops (XLA would
  run cuDNN's kernels); each becomes nova.attention / nova.attention_backward (cuDNN's softmax
  statistics are the natural-log lse the nova ops define);
- the softmax form (`attention_match.py`): scores q k^T from a matmul, scaled (before or after the
  matmul, by a multiply or a divide), masked by a select against a large negative value (a causal
  `jnp.tril` mask or any boolean mask) or an additive bias, a softmax (max, exp, sum, divide, with the
  converts mixed precision inserts), and the probabilities times v: the manual einsum form and
  `jax.nn.dot_product_attention(implementation=None)` (is_causal, mask, grouped-query attention).
  Its backward is the matmuls JAX's AD made of it: they are replaced by one nova.attention_backward,
  after which the scores and probabilities are dead (dce drops them), so no B*H*Tq*Tk buffer is held
  from the forward to the backward.

A match is refused, and the attention left as the ops it was (correct, only slower), when it is not
attention as the ops define it: dropout, a bias or mask of a shape the ops do not take, probabilities
used for something else, a softmax over another axis, ... Every refusal is logged (logger
`jnova.passes`, INFO) with its reason; `raise_attention` returns the refusals too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from jnova.dialect.ir import Func, Op, Value
from jnova.dialect.ops_attention import AttentionOp, attention_backward_op, attention_op
from jnova.runtime import user_code

log = logging.getLogger("jnova.passes")

CUDNN_FORWARD = "dot_product_attention_fwd_wrapper"
CUDNN_BACKWARD = "dot_product_attention_bwd_wrapper"
CUDNN_PRIMITIVES = (CUDNN_FORWARD, CUDNN_BACKWARD)
CUDNN_LAYOUTS = {0: "bthd", 1: "bhtd"}  # jax's AttentionLayout: BTNH, BNTH


@dataclass
class Raised:
    """What `raise_attention` did: the forward and backward ops it made, and each refusal's reason."""

    forward: int = 0
    backward: int = 0
    refused: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.forward or self.backward)

    def refuse(self, what: str, reason: str) -> None:
        message = f"raise_attention: {what} stays as it is: {reason}"
        log.info(message)
        self.refused.append(message)


def raise_attention(func: Func, sites: list | None = None) -> Raised:
    """Raise in place every attention `func` holds (`sites`: the fallback ops' equations, for the cuDNN
    form); dead ops are left for dce."""
    from jnova.passes.attention_match import raise_softmax_attention

    raised = Raised()
    if sites is not None:
        _raise_cudnn(func, sites, raised)
    raise_softmax_attention(func, raised)
    if raised.forward or raised.backward:
        log.info("raise_attention: %d nova.attention and %d nova.attention_backward in func @%s",
                 raised.forward, raised.backward, func.name)
    return raised


# --------------------------------------------------------------------------- the cuDNN form
def _raise_cudnn(func: Func, sites: list, raised: Raised) -> None:
    users = func.uses()
    replace: dict[Value, Value] = {}
    ops: list[Op] = []
    for op in func.ops:
        op.operands = [replace.get(v, v) for v in op.operands]
        primitive = op.attrs.get("primitive") if op.name == "nova.fallback" else None
        if primitive not in CUDNN_PRIMITIVES:
            ops.append(op)
            continue
        params = sites[op.attrs["site"]].params
        made, why = _cudnn_op(op, params, primitive == CUDNN_FORWARD, users)
        if made is None:
            raised.refuse(f"{primitive} at {op.loc or 'its call'}", why)
            user_code.warn(f"jnova: the JAX primitive '{primitive}' is not compiled ({why}); it runs as an XLA op"
                           + (f" (at {op.loc})" if op.loc else ""), location=op.loc)
            ops.append(op)
            continue
        ops.append(made)
        replace.update(zip(op.results, made.results))
        if primitive == CUDNN_FORWARD:
            raised.forward += 1
        else:
            raised.backward += 1
    func.ops = ops
    func.returns = [replace.get(v, v) for v in func.returns]


def _cudnn_op(op: Op, params: dict, forward: bool, users) -> tuple[Op | None, str]:
    """The nova op for one cuDNN wrapper fallback, or (None, why not)."""
    if params.get("dropout_rate", 0.0):
        return None, f"dropout (rate {params['dropout_rate']}) is not part of nova.attention"
    if params.get("sliding_window_length") is not None:
        return None, f"a sliding window ({params['sliding_window_length']}) is not part of nova.attention"
    layout = CUDNN_LAYOUTS.get(int(params["layout"]))
    if layout is None:
        return None, f"layout {params['layout']} (BTNH and BNTH only)"
    mask_type = getattr(params["mask_type"], "name", str(params["mask_type"]))
    if mask_type not in ("NO_MASK", "CAUSAL"):
        return None, f"mask type {mask_type} (padding masks take sequence lengths nova.attention has not)"
    q, k, v, bias, *lengths = op.operands[:10]
    if any(x.type.size for x in lengths):
        return None, "sequence lengths, offsets or page tables (padded or packed sequences)"
    has_bias, _ = params["variadic_args"]
    extra = {"bias": bias} if has_bias else {}
    attrs = dict(causal=mask_type == "CAUSAL", scale=float(params["scale"]), layout=layout, **extra, loc=op.loc)
    if forward:
        made = attention_op(q, k, v, **attrs)
        if len(op.results) > 1 and op.results[1].type != made.results[1].type and users.get(op.results[1]):
            return None, f"its softmax statistics {op.results[1].type} are read, and differ from the lse"
    else:
        stats, o, do = op.operands[10:13]
        if not isinstance(stats.owner, AttentionOp):
            return None, "its forward was not raised"
        if len(op.results) > 3 and users.get(op.results[3]):
            return None, "the bias gradient is read (nova.attention_backward does not compute it)"
        made = attention_backward_op(q, k, v, o, stats, do, **attrs)
    try:
        made.verify()
    except ValueError as e:
        return None, str(e)
    return made, ""  # an unread dbias result of `op` maps to nothing
