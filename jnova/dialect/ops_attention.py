"""Attention as nova ops: `nova.attention` (forward) and `nova.attention_backward`.

Semantics (for each batch b, query head h, query i, key j; kv head g = h // (Hq // Hkv)):

    s[b, h, i, j] = scale * sum_d q[b, h, i, d] * k[b, g, j, d]  (+ bias[b, h, i, j])
    s[b, h, i, j] = MASKED_SCORE  where mask[b, h, i, j] is False, or causal and j > i
    lse[b, h, i]  = log sum_j exp(s[b, h, i, j])                  (natural log, f32)
    o[b, h, i, :] = sum_j exp(s[b, h, i, j] - lse[b, h, i]) * v[b, g, j, :]

`layout` says where the dimensions are in q, k, v, o (and dq, dk, dv): "bthd" is [B, T, H, D] (what
`jax.nn.dot_product_attention` takes), "bhtd" is [B, H, T, D]. `bias` and `mask` are always in the
logical order [B, Hq, Tq, Tk], each dimension of size 1 (broadcast) or full, and `lse` is
[B, Hq, Tq] in either layout. Scores are computed in f32 whatever the inputs' type (f32, bf16 or
f16); o and the gradients take the inputs' type.

Masked scores are the finite MASKED_SCORE (-1e30), not -inf: a row whose every key is masked (only
possible with a mask) attends uniformly to all keys, as `jax.nn.dot_product_attention` does with
its large negative fill, and its lse is MASKED_SCORE + log(Tk), which rounds to -1e30 in f32. Causal
attention requires Tq == Tk (query i sees keys j <= i), so no causal row is fully masked. A masked
score is a constant: the gradients flow through the kept scores only.

At most one of `bias` (additive, float) and `mask` (bool, True keeps the score) is present:
attribute `optional_operand` ("none", "bias" or "mask") says which, and the variadic operand list
`extra` holds it (empty or one value). `nova.attention_backward` takes q, k, v, o, lse and do (the
gradient of o), the same optional operand and attributes, and returns dq, dk, dv; it does not
differentiate with respect to the bias.
"""
from __future__ import annotations

from jnova.dialect.ir import Bool, F64, Op, Str, Value
from jnova.dialect.ops import register
from jnova.dialect.types import TensorType

LAYOUTS = ("bthd", "bhtd")
OPTIONAL_OPERANDS = ("none", "bias", "mask")
ATTENTION_DTYPES = ("float32", "bfloat16", "float16")
BIAS_DTYPES = ("float32", "bfloat16", "float16")
MASKED_SCORE = -1e30

_ATTRIBUTES = {"causal": Bool, "scale": F64, "layout": Str, "optional_operand": Str}


def head_axes(layout: str) -> tuple[int, int]:
    """(time axis, head axis) of q, k, v and o in `layout`."""
    return (1, 2) if layout == "bthd" else (2, 1)


class _AttentionBase(Op):
    """What the forward and the backward share: operand names, dimensions, verification of q, k, v and
    the optional bias or mask."""

    attributes = dict(_ATTRIBUTES)

    # -- dimensions
    def dims(self) -> dict[str, int]:
        """B, Hq, Hkv, Tq, Tk and D of this op (from q and k in its layout)."""
        t_axis, h_axis = head_axes(self.attrs["layout"])
        q, k = self.operands[0].type, self.operands[1].type
        return {"B": q.shape[0], "Hq": q.shape[h_axis], "Hkv": k.shape[h_axis], "Tq": q.shape[t_axis],
                "Tk": k.shape[t_axis], "D": q.shape[3]}

    @property
    def bias(self) -> Value | None:
        return self.variadic_operands()[0] if self.attrs["optional_operand"] == "bias" else None

    @property
    def mask(self) -> Value | None:
        return self.variadic_operands()[0] if self.attrs["optional_operand"] == "mask" else None

    # -- verification
    def _verify_qkv(self):
        a = self.attrs
        if a["layout"] not in LAYOUTS:
            raise self.error(f"attribute 'layout' = {a['layout']!r}, expected one of {LAYOUTS}")
        if a["optional_operand"] not in OPTIONAL_OPERANDS:
            raise self.error(f"attribute 'optional_operand' = {a['optional_operand']!r}, expected one of "
                             f"{OPTIONAL_OPERANDS}")
        q, k, v = (self.operands[i].type for i in range(3))
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.rank != 4:
                raise self.error(f"operand '{name}' has type {t}, expected a rank-4 tensor "
                                 f"({'[B, T, H, D]' if a['layout'] == 'bthd' else '[B, H, T, D]'} for layout "
                                 f"{a['layout']!r})")
            if t.dtype not in ATTENTION_DTYPES:
                raise self.error(f"operand '{name}' has element type {t.dtype}, expected one of {ATTENTION_DTYPES}")
        for name, t in (("k", k), ("v", v)):
            if t.dtype != q.dtype:
                raise self.error(f"operand '{name}' has element type {t.dtype}, expected {q.dtype} like operand 'q'")
        if k.shape != v.shape:
            raise self.error(f"operand 'v' has shape {v.shape}, expected {k.shape} like operand 'k'")
        d = self.dims()
        if k.shape[0] != d["B"]:
            raise self.error(f"operand 'k' has batch size {k.shape[0]}, expected {d['B']} like operand 'q'")
        if k.shape[3] != d["D"]:
            raise self.error(f"operand 'k' has head dim {k.shape[3]}, expected {d['D']} like operand 'q'")
        if d["Hkv"] == 0 or d["Hq"] % d["Hkv"]:
            raise self.error(f"operand 'k' has {d['Hkv']} heads, expected a divisor of the {d['Hq']} heads of "
                             "operand 'q' (grouped-query attention: q head h reads kv head h // (Hq / Hkv))")
        if a["causal"] and d["Tq"] != d["Tk"]:
            raise self.error(f"causal attention needs as many queries as keys: operand 'q' has {d['Tq']}, "
                             f"operand 'k' {d['Tk']}")
        if not (a["scale"] == a["scale"]) or a["scale"] in (float("inf"), float("-inf")):
            raise self.error(f"attribute 'scale' = {a['scale']}, expected a finite float")
        self._verify_optional(d)

    def _verify_optional(self, d: dict):
        extra, kind = self.variadic_operands(), self.attrs["optional_operand"]
        want = 0 if kind == "none" else 1
        if len(extra) != want:
            raise self.error(f"attribute 'optional_operand' = {kind!r}, so expected {want} operands 'extra', got "
                             f"{len(extra)}")
        if not extra:
            return
        t, full = extra[0].type, (d["B"], d["Hq"], d["Tq"], d["Tk"])
        if t.rank != 4 or any(s not in (1, f) for s, f in zip(t.shape, full)):
            raise self.error(f"operand '{kind}' has shape {t.shape}, expected 4 dimensions [B, Hq, Tq, Tk] each "
                             f"1 or {list(full)}")
        if kind == "mask" and t.dtype != "bool":
            raise self.error(f"operand 'mask' has element type {t.dtype}, expected bool (True keeps the score)")
        if kind == "bias" and t.dtype not in BIAS_DTYPES:
            raise self.error(f"operand 'bias' has element type {t.dtype}, expected one of {BIAS_DTYPES}")

    def _expect(self, what: str, got: TensorType, want: TensorType):
        if got != want:
            raise self.error(f"{what} has type {got}, expected {want}")


@register
class AttentionOp(_AttentionBase):
    """Scaled dot-product attention: o and the log-sum-exp of the scores (module docstring)."""

    name = "nova.attention"
    operands_spec = ("q", "k", "v", "*extra")
    results_spec = ("o", "lse")
    summary = "o, lse = softmax(scale * q k^T (+ bias | masked)) v; layout 'bthd' or 'bhtd'; GQA"

    def verify_(self):
        self._verify_qkv()
        q, d = self.operands[0].type, self.dims()
        self._expect("result 'o'", self.results[0].type, q)
        self._expect("result 'lse'", self.results[1].type, TensorType((d["B"], d["Hq"], d["Tq"]), "float32"))


@register
class AttentionBackwardOp(_AttentionBase):
    """dq, dk, dv of `nova.attention` given its o and lse and the gradient `do` of o."""

    name = "nova.attention_backward"
    operands_spec = ("q", "k", "v", "o", "lse", "do", "*extra")
    results_spec = ("dq", "dk", "dv")
    summary = "dq, dk, dv of nova.attention from q, k, v, o, lse and do"

    def verify_(self):
        self._verify_qkv()
        q, k, v = (self.operands[i].type for i in range(3))
        d = self.dims()
        self._expect("operand 'o'", self.operands[3].type, q)
        self._expect("operand 'lse'", self.operands[4].type, TensorType((d["B"], d["Hq"], d["Tq"]), "float32"))
        self._expect("operand 'do'", self.operands[5].type, q)
        for i, (name, t) in enumerate((("dq", q), ("dk", k), ("dv", v))):
            self._expect(f"result '{name}'", self.results[i].type, t)


def attention_op(q: Value, k: Value, v: Value, *, causal: bool, scale: float, layout: str,
                 bias: Value | None = None, mask: Value | None = None, loc: str | None = None) -> AttentionOp:
    """A `nova.attention` op (not yet in any function) over q, k, v with the given attributes."""
    extra, kind = _optional(bias, mask)
    d_t, d_h = head_axes(layout)
    lse = TensorType((q.type.shape[0], q.type.shape[d_h], q.type.shape[d_t]), "float32")
    return AttentionOp([q, k, v, *extra], [q.type, lse], _attrs(causal, scale, layout, kind), loc)


def attention_backward_op(q: Value, k: Value, v: Value, o: Value, lse: Value, do: Value, *, causal: bool,
                          scale: float, layout: str, bias: Value | None = None, mask: Value | None = None,
                          loc: str | None = None) -> AttentionBackwardOp:
    """A `nova.attention_backward` op (not yet in any function) with the given attributes."""
    extra, kind = _optional(bias, mask)
    return AttentionBackwardOp([q, k, v, o, lse, do, *extra], [q.type, k.type, v.type],
                               _attrs(causal, scale, layout, kind), loc)


def _optional(bias, mask):
    if bias is not None and mask is not None:
        raise ValueError("nova.attention takes a bias or a mask, not both")
    if bias is not None:
        return [bias], "bias"
    if mask is not None:
        return [mask], "mask"
    return [], "none"


def _attrs(causal, scale, layout, kind) -> dict:
    return {"causal": bool(causal), "scale": float(scale), "layout": layout, "optional_operand": kind}


from jnova.dialect import ops_attention_split  # noqa: E402,F401  (registers the backward's two halves)
