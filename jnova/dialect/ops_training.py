"""The memory-bound layers of a training step as nova ops: softmax cross-entropy, LayerNorm, RMSNorm
and GELU, each with its backward.

Semantics (rows are every index of the leading dimensions, the feature axis is the last; all
arithmetic in f32 whatever the operands' type, results converted to their declared type):

    nova.sce            logits [N, V], labels [N] (integer)  ->  loss, lse [N] f32
        lse[n]  = log sum_v exp(logits[n, v])
        l[n]    = lse[n] - logits[n, labels[n]]         (0 where labels[n] == ignore_index, if `has_ignore`)
        loss    = l (reduction "none", [N] f32), sum_n l[n] ("sum", [] f32), or
                  sum_n l[n] / (number of rows not ignored) ("mean", [] f32; N when nothing is ignored)
    nova.sce_backward   logits, labels, lse, dloss (loss's type)  ->  dlogits (logits' type)
        dlogits[n, v] = (exp(logits[n, v] - lse[n]) - [v == labels[n]]) * g[n], where g[n] is dloss[n],
        dloss, or dloss / count for the three reductions, and 0 in ignored rows

    nova.layernorm      x [..., C] (+ scale [C]) (+ bias [C])  ->  y [..., C], mean, rstd [...] f32
        mean = E[x], rstd = 1 / sqrt(E[x^2] - E[x]^2 + epsilon) (the variance clamped at 0, as Flax),
        y = (x - mean) * rstd (* scale) (+ bias)
    nova.layernorm_backward   x, mean, rstd, dy (+ scale)  ->  dx (x's type), dscale, dbias ([C], f32)
    nova.rmsnorm        x [..., C] (+ scale [C])  ->  y, rstd = 1 / sqrt(E[x^2] + epsilon);  y = x * rstd (* scale)
    nova.rmsnorm_backward     x, rstd, dy (+ scale)  ->  dx, dscale
    nova.gelu           x  ->  y = x * Phi(x): "erf" exactly, "tanh" as 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    nova.gelu_backward  x, dy  ->  dx = dy * gelu'(x)

Which of the optional parameters are present is said by the attributes `has_scale` / `has_bias`
(the variadic operand list `params` holds scale then bias); the backward's variadic results
`dparams` hold the gradient of each one present, in the same order. `y` may have another float type
than `x` (Flax's `dtype` computes the layer in bf16 from f32 inputs).
"""
from __future__ import annotations

from jnova.dialect.ir import Bool, F64, I64, Op, Str, Value
from jnova.dialect.ops import register
from jnova.dialect.types import TensorType

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
LABEL_DTYPES = ("int32", "int64", "uint32", "int16", "int8", "uint8")
REDUCTIONS = ("none", "mean", "sum")
APPROXIMATIONS = ("tanh", "erf")
F32 = "float32"


class _TrainingOp(Op):
    def _expect(self, what: str, got: TensorType, want: TensorType):
        if got != want:
            raise self.error(f"{what} has type {got}, expected {want}")

    def _expect_float(self, what: str, t: TensorType):
        if t.dtype not in FLOAT_DTYPES:
            raise self.error(f"{what} has element type {t.dtype}, expected one of {FLOAT_DTYPES}")

    def _expect_rows(self, what: str, t: TensorType, x: TensorType):
        self._expect(what, t, TensorType(x.shape[:-1], F32))


# --------------------------------------------------------------------------- cross-entropy
class _SceBase(_TrainingOp):
    attributes = {"reduction": Str, "has_ignore": Bool, "ignore_index": I64}

    def _verify_logits_labels(self):
        a = self.attrs
        if a["reduction"] not in REDUCTIONS:
            raise self.error(f"attribute 'reduction' = {a['reduction']!r}, expected one of {REDUCTIONS}")
        logits, labels = self.operands[0].type, self.operands[1].type
        if logits.rank != 2:
            raise self.error(f"operand 'logits' has type {logits}, expected a rank-2 tensor [N, V]")
        self._expect_float("operand 'logits'", logits)
        if logits.shape[1] == 0:
            raise self.error("operand 'logits' has no classes (V = 0)")
        if labels.dtype not in LABEL_DTYPES:
            raise self.error(f"operand 'labels' has element type {labels.dtype}, expected an integer type")
        if labels.shape != logits.shape[:1]:
            raise self.error(f"operand 'labels' has shape {labels.shape}, expected ({logits.shape[0]},) "
                             "like the rows of operand 'logits'")

    def loss_type(self) -> TensorType:
        n = self.operands[0].type.shape[0]
        return TensorType((n,) if self.attrs["reduction"] == "none" else (), F32)


@register
class SceOp(_SceBase):
    """Softmax cross-entropy with integer labels (module docstring)."""

    name = "nova.sce"
    operands_spec = ("logits", "labels")
    results_spec = ("loss", "lse")
    summary = "loss, lse = softmax cross-entropy of logits [N, V] at integer labels [N]"

    def verify_(self):
        self._verify_logits_labels()
        self._expect("result 'loss'", self.results[0].type, self.loss_type())
        self._expect_rows("result 'lse'", self.results[1].type, self.operands[0].type)


@register
class SceBackwardOp(_SceBase):
    """dlogits of `nova.sce` from its logits, labels, lse and the gradient of its loss."""

    name = "nova.sce_backward"
    operands_spec = ("logits", "labels", "lse", "dloss")
    results_spec = ("dlogits",)
    summary = "dlogits = (softmax(logits) - onehot(labels)) * dloss, from the forward's lse"

    def verify_(self):
        self._verify_logits_labels()
        logits = self.operands[0].type
        self._expect_rows("operand 'lse'", self.operands[2].type, logits)
        self._expect("operand 'dloss'", self.operands[3].type, self.loss_type())
        self._expect("result 'dlogits'", self.results[0].type, logits)


# --------------------------------------------------------------------------- normalizations
class _NormBase(_TrainingOp):
    bias_allowed = True

    def param_names(self) -> list[str]:
        names = ["scale"] if self.attrs["has_scale"] else []
        return names + (["bias"] if self.attrs.get("has_bias") else [])

    def _verify_x(self):
        x = self.operands[0].type
        if x.rank < 1 or x.shape[-1] == 0:
            raise self.error(f"operand 'x' has type {x}, expected at least one dimension, the features last")
        self._expect_float("operand 'x'", x)
        if not (self.attrs["epsilon"] >= 0.0) or self.attrs["epsilon"] == float("inf"):
            raise self.error(f"attribute 'epsilon' = {self.attrs['epsilon']}, expected a finite float >= 0")
        return x

    def _verify_params(self, names: list[str]):
        params, x = self.variadic_operands(), self.operands[0].type
        if len(params) != len(names):
            raise self.error(f"attributes say the parameters are {names or 'none'}, so expected {len(names)} "
                             f"operands 'params', got {len(params)}")
        for name, p in zip(names, params):
            if p.type.shape != x.shape[-1:]:
                raise self.error(f"operand '{name}' has shape {p.type.shape}, expected ({x.shape[-1]},) like the "
                                 "last dimension of operand 'x'")
            self._expect_float(f"operand '{name}'", p.type)

    def _verify_y(self, i: int, name: str, x: TensorType):
        y = self.results[i].type
        if y.shape != x.shape:
            raise self.error(f"result '{name}' has shape {y.shape}, expected {x.shape} like operand 'x'")
        self._expect_float(f"result '{name}'", y)

    def _verify_dparams(self, first: int):
        names, x = self.param_names(), self.operands[0].type
        got = self.results[first:]
        if len(got) != len(names):
            raise self.error(f"expected {len(names)} results 'dparams' ({names}), got {len(got)}")
        for name, r in zip(names, got):
            self._expect(f"result 'd{name}'", r.type, TensorType(x.shape[-1:], F32))


@register
class LayerNormOp(_NormBase):
    name = "nova.layernorm"
    operands_spec = ("x", "*params")
    results_spec = ("y", "mean", "rstd")
    attributes = {"epsilon": F64, "has_scale": Bool, "has_bias": Bool}
    summary = "y, mean, rstd = LayerNorm of x over its last dimension (optional scale, bias)"

    def verify_(self):
        x = self._verify_x()
        self._verify_params(self.param_names())
        self._verify_y(0, "y", x)
        self._expect_rows("result 'mean'", self.results[1].type, x)
        self._expect_rows("result 'rstd'", self.results[2].type, x)


@register
class LayerNormBackwardOp(_NormBase):
    name = "nova.layernorm_backward"
    operands_spec = ("x", "mean", "rstd", "dy", "*params")
    results_spec = ("dx", "*dparams")
    attributes = {"epsilon": F64, "has_scale": Bool, "has_bias": Bool}
    summary = "dx (, dscale, dbias) of nova.layernorm from x, its mean and rstd, and dy"

    def verify_(self):
        x = self._verify_x()
        self._verify_params(["scale"] if self.attrs["has_scale"] else [])
        self._expect_rows("operand 'mean'", self.operands[1].type, x)
        self._expect_rows("operand 'rstd'", self.operands[2].type, x)
        if self.operands[3].type.shape != x.shape:
            raise self.error(f"operand 'dy' has shape {self.operands[3].type.shape}, expected {x.shape}")
        self._expect_float("operand 'dy'", self.operands[3].type)
        self._expect("result 'dx'", self.results[0].type, x)
        self._verify_dparams(1)


@register
class RmsNormOp(_NormBase):
    name = "nova.rmsnorm"
    operands_spec = ("x", "*params")
    results_spec = ("y", "rstd")
    attributes = {"epsilon": F64, "has_scale": Bool}
    summary = "y, rstd = RMSNorm of x over its last dimension (optional scale)"

    def verify_(self):
        x = self._verify_x()
        self._verify_params(self.param_names())
        self._verify_y(0, "y", x)
        self._expect_rows("result 'rstd'", self.results[1].type, x)


@register
class RmsNormBackwardOp(_NormBase):
    name = "nova.rmsnorm_backward"
    operands_spec = ("x", "rstd", "dy", "*params")
    results_spec = ("dx", "*dparams")
    attributes = {"epsilon": F64, "has_scale": Bool}
    summary = "dx (, dscale) of nova.rmsnorm from x, its rstd and dy"

    def verify_(self):
        x = self._verify_x()
        self._verify_params(self.param_names())
        self._expect_rows("operand 'rstd'", self.operands[1].type, x)
        if self.operands[2].type.shape != x.shape:
            raise self.error(f"operand 'dy' has shape {self.operands[2].type.shape}, expected {x.shape}")
        self._expect_float("operand 'dy'", self.operands[2].type)
        self._expect("result 'dx'", self.results[0].type, x)
        self._verify_dparams(1)


# --------------------------------------------------------------------------- GELU
class _GeluBase(_TrainingOp):
    attributes = {"approximate": Str}

    def _verify_x(self):
        if self.attrs["approximate"] not in APPROXIMATIONS:
            raise self.error(f"attribute 'approximate' = {self.attrs['approximate']!r}, expected one of "
                             f"{APPROXIMATIONS}")
        x = self.operands[0].type
        self._expect_float("operand 'x'", x)
        return x


@register
class GeluOp(_GeluBase):
    name = "nova.gelu"
    operands_spec = ("x",)
    results_spec = ("y",)
    summary = "y = gelu(x), approximate 'tanh' or 'erf'"

    def verify_(self):
        self._expect("result 'y'", self.results[0].type, self._verify_x())


@register
class GeluBackwardOp(_GeluBase):
    name = "nova.gelu_backward"
    operands_spec = ("x", "dy")
    results_spec = ("dx",)
    summary = "dx = dy * gelu'(x)"

    def verify_(self):
        x = self._verify_x()
        self._expect("operand 'dy'", self.operands[1].type, x)
        self._expect("result 'dx'", self.results[0].type, x)


TRAINING_OPS = ("nova.sce", "nova.sce_backward", "nova.layernorm", "nova.layernorm_backward", "nova.rmsnorm",
                "nova.rmsnorm_backward", "nova.gelu", "nova.gelu_backward")


# --------------------------------------------------------------------------- constructors
def _sce_attrs(reduction: str, ignore_index: int | None) -> dict:
    return {"reduction": reduction, "has_ignore": ignore_index is not None,
            "ignore_index": int(ignore_index) if ignore_index is not None else 0}


def sce_op(logits: Value, labels: Value, *, reduction: str = "mean", ignore_index: int | None = None,
           loc: str | None = None) -> SceOp:
    n = logits.type.shape[0]
    loss = TensorType((n,) if reduction == "none" else (), F32)
    return SceOp([logits, labels], [loss, TensorType((n,), F32)], _sce_attrs(reduction, ignore_index), loc)


def sce_backward_op(logits: Value, labels: Value, lse: Value, dloss: Value, *, reduction: str = "mean",
                    ignore_index: int | None = None, loc: str | None = None) -> SceBackwardOp:
    return SceBackwardOp([logits, labels, lse, dloss], [logits.type], _sce_attrs(reduction, ignore_index), loc)


def _rows(x: Value) -> TensorType:
    return TensorType(x.type.shape[:-1], F32)


def layernorm_op(x: Value, scale: Value | None = None, bias: Value | None = None, *, epsilon: float,
                 y_dtype: str | None = None, loc: str | None = None) -> LayerNormOp:
    params = [p for p in (scale, bias) if p is not None]
    y = x.type.with_dtype(y_dtype or x.type.dtype)
    return LayerNormOp([x, *params], [y, _rows(x), _rows(x)],
                       {"epsilon": float(epsilon), "has_scale": scale is not None, "has_bias": bias is not None}, loc)


def layernorm_backward_op(x: Value, mean: Value, rstd: Value, dy: Value, scale: Value | None = None, *,
                          has_bias: bool, epsilon: float, loc: str | None = None) -> LayerNormBackwardOp:
    c = TensorType(x.type.shape[-1:], F32)
    dparams = [c] * ((scale is not None) + bool(has_bias))
    return LayerNormBackwardOp([x, mean, rstd, dy] + ([scale] if scale is not None else []), [x.type, *dparams],
                               {"epsilon": float(epsilon), "has_scale": scale is not None, "has_bias": bool(has_bias)},
                               loc)


def rmsnorm_op(x: Value, scale: Value | None = None, *, epsilon: float, y_dtype: str | None = None,
               loc: str | None = None) -> RmsNormOp:
    y = x.type.with_dtype(y_dtype or x.type.dtype)
    return RmsNormOp([x] + ([scale] if scale is not None else []), [y, _rows(x)],
                     {"epsilon": float(epsilon), "has_scale": scale is not None}, loc)


def rmsnorm_backward_op(x: Value, rstd: Value, dy: Value, scale: Value | None = None, *, epsilon: float,
                        loc: str | None = None) -> RmsNormBackwardOp:
    dparams = [TensorType(x.type.shape[-1:], F32)] if scale is not None else []
    return RmsNormBackwardOp([x, rstd, dy] + ([scale] if scale is not None else []), [x.type, *dparams],
                             {"epsilon": float(epsilon), "has_scale": scale is not None}, loc)


def gelu_op(x: Value, *, approximate: str, loc: str | None = None) -> GeluOp:
    return GeluOp([x], [x.type], {"approximate": approximate}, loc)


def gelu_backward_op(x: Value, dy: Value, *, approximate: str, loc: str | None = None) -> GeluBackwardOp:
    return GeluBackwardOp([x, dy], [x.type], {"approximate": approximate}, loc)
