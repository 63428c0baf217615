"""Conversion rules for elementwise JAX primitives (arithmetic, comparison, transcendental)."""
from __future__ import annotations

from jnova.capture.to_nova import Unsupported, out_type, rule

# JAX primitive -> nova op with the same elementwise semantics
UNARY = {
    "neg": "neg", "abs": "abs", "sign": "sign", "square": "square", "not": "not",
    "exp": "exp", "exp2": "exp2", "expm1": "expm1", "log": "log", "log1p": "log1p",
    "tanh": "tanh", "logistic": "logistic", "erf": "erf", "erfc": "erfc", "erf_inv": "erf_inv", "sqrt": "sqrt",
    "rsqrt": "rsqrt", "cbrt": "cbrt", "sin": "sin", "cos": "cos", "tan": "tan", "asin": "asin",
    "acos": "acos", "atan": "atan", "sinh": "sinh", "cosh": "cosh", "asinh": "asinh",
    "acosh": "acosh", "atanh": "atanh", "floor": "floor", "ceil": "ceil", "is_finite": "is_finite",
    "population_count": "population_count", "clz": "clz",
}
BINARY = {
    "add": "add", "add_any": "add", "sub": "sub", "mul": "mul", "div": "div", "rem": "rem", "max": "max", "min": "min",
    "pow": "pow", "and": "and", "or": "or", "xor": "xor", "atan2": "atan2", "nextafter": "nextafter",
    "shift_left": "shift_left", "shift_right_logical": "shift_right_logical",
    "shift_right_arithmetic": "shift_right_arithmetic",
}
COMPARE = {"eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge"}
# accuracy hints ask for more than the default; jnova's math matches XLA's defaults only
_IGNORED_PARAMS = {"accuracy"}


def _unary(b, eqn, x):
    if eqn.params.get("accuracy") is not None:
        raise Unsupported(f"accuracy={eqn.params['accuracy']}")
    return b.emit(f"nova.{UNARY[eqn.primitive.name]}", [x], out_type(eqn))


def _binary(b, eqn, lhs, rhs):
    out = out_type(eqn)
    if eqn.primitive.name == "pow" and rhs.type.dtype != lhs.type.dtype:
        # lax.pow(float, int): XLA converts the exponent to the base's type first
        rhs = b.emit("nova.convert", [rhs], rhs.type.with_dtype(lhs.type.dtype))
    return b.emit(f"nova.{BINARY[eqn.primitive.name]}", [b.broadcast_to(lhs, out.shape), b.broadcast_to(rhs, out.shape)], out)


def _compare(b, eqn, lhs, rhs):
    shape = out_type(eqn).shape
    return b.emit("nova.compare", [b.broadcast_to(lhs, shape), b.broadcast_to(rhs, shape)], out_type(eqn),
                  predicate=COMPARE[eqn.primitive.name])


for _name in UNARY:
    rule(_name)(_unary)
for _name in BINARY:
    rule(_name)(_binary)
for _name in COMPARE:
    rule(_name)(_compare)


@rule("integer_pow")
def _integer_pow(b, eqn, x):
    return b.emit("nova.ipow", [x], out_type(eqn), exponent=int(eqn.params["y"]))


@rule("round")
def _round(b, eqn, x):
    method = eqn.params["rounding_method"]
    name = "to_nearest_even" if int(method) == 1 else "away_from_zero"
    return b.emit("nova.round", [x], out_type(eqn), method=name)


@rule("select_n")
def _select_n(b, eqn, which, *cases):
    out = out_type(eqn)
    return b.emit("nova.select", [which] + [b.broadcast_to(c, out.shape) for c in cases], out)


@rule("clamp")
def _clamp(b, eqn, lo, x, hi):
    out = out_type(eqn)
    lo, hi = b.broadcast_to(lo, out.shape), b.broadcast_to(hi, out.shape)
    return b.emit("nova.min", [b.emit("nova.max", [x, lo], out), hi], out)


@rule("reduce_precision")
def _reduce_precision(b, eqn, x):
    return b.emit("nova.reduce_precision", [x], out_type(eqn), exponent_bits=int(eqn.params["exponent_bits"]),
                  mantissa_bits=int(eqn.params["mantissa_bits"]))


@rule("convert_element_type")
def _convert(b, eqn, x):
    out = out_type(eqn)
    return x if out == x.type else b.emit("nova.convert", [x], out)


@rule("stop_gradient", "copy", "copy_p", "optimization_barrier", "reduce_precision_identity",
      "name")  # jax.ad_checkpoint.checkpoint_name: a name for remat policies, its value unchanged
def _identity(b, eqn, *xs):
    return list(xs)


@rule("bitcast_convert_type")
def _bitcast_convert_type(b, eqn, x):
    out = out_type(eqn)
    if out.shape != x.type.shape:
        raise Unsupported(f"bitcast between widths ({x.type.dtype} -> {out.dtype}) changes the shape")
    return x if out == x.type else b.emit("nova.bitcast", [x], out)


@rule("one_minus_square")
def _one_minus_square(b, eqn, x):
    """jax >= 0.11's tanh derivative helper: (1 + x) * (1 - x), the cancellation-free form."""
    out = out_type(eqn)
    one = b.broadcast_to(b.constant(1, out.dtype), out.shape)
    return b.emit("nova.mul", [b.emit("nova.add", [one, x], out), b.emit("nova.sub", [one, x], out)], out)
