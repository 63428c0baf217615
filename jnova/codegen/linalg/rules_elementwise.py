"""linalg lowerings of elementwise nova ops: one `linalg.generic` each, scalar math in the body.

Semantics follow XLA's, including its special values: float max/min propagate NaN, integer
division by zero gives -1 (all ones) and remainder by zero the dividend, shifts by the bit width or
more give 0 (or the sign for arithmetic right shifts). 16-bit floats compute in f32 and round once
per op. Functions whose MLIR lowering is inaccurate (`math.expm1` and `math.log1p` become
`exp(x) - 1` and `log(1 + x)`) are written out here; the rest call libm through the math dialect.
"""
from __future__ import annotations

import numpy as np

from jnova.codegen.linalg.emitter import affine_map, compute_dtype, element, identity_map
from jnova.codegen.linalg.lowering import lowering
from jnova.errors import LoweringError
from jnova.dialect.types import FLOAT_DTYPES, UNSIGNED_DTYPES, bitwidth

# nova op -> math/arith op on floats (computed in f32 for 16-bit floats)
FLOAT_UNARY = {
    "nova.exp": "math.exp", "nova.exp2": "math.exp2", "nova.log": "math.log", "nova.tanh": "math.tanh",
    "nova.erf": "math.erf", "nova.erfc": "math.erfc", "nova.sqrt": "math.sqrt", "nova.rsqrt": "math.rsqrt",
    "nova.cbrt": "math.cbrt", "nova.sin": "math.sin", "nova.cos": "math.cos", "nova.tan": "math.tan",
    "nova.asin": "math.asin", "nova.acos": "math.acos", "nova.atan": "math.atan", "nova.sinh": "math.sinh",
    "nova.cosh": "math.cosh", "nova.asinh": "math.asinh", "nova.acosh": "math.acosh", "nova.atanh": "math.atanh",
    "nova.floor": "math.floor", "nova.ceil": "math.ceil", "nova.abs": "math.absf", "nova.neg": "arith.negf",
}
FLOAT_BINARY = {
    "nova.add": "arith.addf", "nova.sub": "arith.subf", "nova.mul": "arith.mulf", "nova.div": "arith.divf",
    "nova.rem": "arith.remf", "nova.pow": "math.powf", "nova.atan2": "math.atan2",
}
FLOAT_MAX_MIN = {"nova.max": "max", "nova.min": "min"}
# nova op -> (signed, unsigned) integer op; bool uses the unsigned column
INT_BINARY = {
    "nova.add": ("arith.addi", "arith.addi"), "nova.sub": ("arith.subi", "arith.subi"),
    "nova.mul": ("arith.muli", "arith.muli"), "nova.max": ("arith.maxsi", "arith.maxui"),
    "nova.min": ("arith.minsi", "arith.minui"), "nova.and": ("arith.andi", "arith.andi"),
    "nova.or": ("arith.ori", "arith.ori"), "nova.xor": ("arith.xori", "arith.xori"),
}
BOOL_BINARY = {"nova.add": "arith.ori", "nova.max": "arith.ori", "nova.mul": "arith.andi", "nova.min": "arith.andi"}
INT_DIVIDE = {"nova.div": ("arith.divsi", "arith.divui"), "nova.rem": ("arith.remsi", "arith.remui")}
SHIFTS = {"nova.shift_left": "arith.shli", "nova.shift_right_logical": "arith.shrui",
          "nova.shift_right_arithmetic": "arith.shrsi"}
FLOAT_PREDICATES = {"eq": "oeq", "ne": "une", "lt": "olt", "le": "ole", "gt": "ogt", "ge": "oge"}
SIGNED_PREDICATES = {"eq": "eq", "ne": "ne", "lt": "slt", "le": "sle", "gt": "sgt", "ge": "sge"}
UNSIGNED_PREDICATES = {"eq": "eq", "ne": "ne", "lt": "ult", "le": "ule", "gt": "ugt", "ge": "uge"}
FLOAT_SPECIAL = ("nova.logistic", "nova.sign", "nova.square", "nova.is_finite", "nova.round", "nova.ipow",
                 "nova.expm1", "nova.log1p", "nova.erf_inv")
INT_UNARY = ("nova.not", "nova.population_count", "nova.clz")


def _float_math(em, op, operands, body):
    """Elementwise float op: widen 16-bit floats to f32, apply `body`, round the result back."""
    dtype = op.operands[0].type.dtype
    wide = compute_dtype(dtype)
    out = op.results[0].type

    def scalar(s, args):
        args = [s.cast(a, dtype, wide) for a in args]
        r, r_dtype = body(s, args, element(wide), wide)
        return s.cast(r, r_dtype, out.dtype)

    return em.map_elementwise([(v, o.type) for v, o in zip(operands, op.operands)], out, scalar)


# --------------------------------------------------------------------------- unary
@lowering(*sorted(set(FLOAT_UNARY) | set(FLOAT_SPECIAL) | set(INT_UNARY)))
def _unary(em, op, x):
    dtype = op.operands[0].type.dtype
    if dtype in FLOAT_DTYPES:
        return _float_math(em, op, [x], lambda s, a, e, w: (_float_unary(s, op, a[0], e, w), _result_dtype(op, w)))
    return em.map_elementwise([(x, op.operands[0].type)], op.results[0].type, lambda s, a: _int_unary(s, op, a[0], dtype))


def _result_dtype(op, wide):
    return "bool" if op.name == "nova.is_finite" else wide


def _float_unary(s, op, x, e, wide):
    name = op.name
    f = lambda arith, *args: _apply(s, arith, e, *args)  # noqa: E731
    if name in FLOAT_UNARY:
        return f(FLOAT_UNARY[name], x)
    if name == "nova.logistic":  # 1 / (1 + exp(-x))
        one = s.const(1.0, wide)
        return f("arith.divf", one, f("arith.addf", one, f("math.exp", f("arith.negf", x))))
    if name == "nova.square":
        return f("arith.mulf", x, x)
    if name == "nova.sign":  # -1, 0 or +1; keeps NaN and signed zero
        zero = s.const(0.0, wide)
        # neither side of zero: x * 0 keeps NaN and the zero's sign, and gives a signed zero for a
        # subnormal that the comparisons read as zero (XLA's CPU flushes subnormals), as XLA's sign does
        negative = f("arith.select", f("arith.cmpf olt", x, zero), s.const(-1.0, wide), f("arith.mulf", x, zero))
        return f("arith.select", f("arith.cmpf ogt", x, zero), s.const(1.0, wide), negative)
    if name == "nova.is_finite":
        return f("math.isfinite", x)
    if name == "nova.round":
        return f("math.roundeven" if op.attrs["method"] == "to_nearest_even" else "math.round", x)
    if name == "nova.ipow":  # repeated multiplication in x's dtype, as JAX lowers it: 16-bit floats round each product
        dtype = op.operands[0].type.dtype
        rounded = lambda v: s.cast(s.cast(v, wide, dtype), dtype, wide)  # noqa: E731
        return _ipow(s, x, op.attrs["exponent"], wide, lambda a, b: rounded(f("arith.mulf", a, b)),
                     lambda a, b: rounded(f("arith.divf", a, b)))
    if name == "nova.expm1":
        return _expm1(f, s, x, wide)
    if name == "nova.log1p":
        return _log1p(f, s, x, wide)
    if name == "nova.erf_inv":
        return _erf_inv(f, s, x, wide)
    raise LoweringError(f"'{name}' on floats")


def _apply(s, arith: str, e: str, *args: str) -> str:
    """`arith args : e`; a comparison (`arith.cmpf olt`) yields i1, `arith.select` takes an i1 first."""
    return s.op(f"{arith}{',' if arith.startswith('arith.cmp') else ''} {', '.join(args)} : {e}")


def _expm1(f, s, x, wide):
    """exp(x) - 1 without cancellation: tanh(x/2) * (exp(x) + 1) for |x| <= 1/2 (XLA's formula)."""
    half, one = s.const(0.5, wide), s.const(1.0, wide)
    half_x, exp_x = f("arith.mulf", x, half), f("math.exp", x)
    small = f("arith.mulf", f("math.tanh", half_x), f("arith.addf", exp_x, one))
    result = f("arith.select", f("arith.cmpf ogt", f("math.absf", x), half), f("arith.subf", exp_x, one), small)
    underflows = f("arith.cmpf oeq", half_x, s.const(0.0, wide))  # tiny x (this also keeps -0.0)
    return f("arith.select", underflows, x, result)


def _log1p(f, s, x, wide):
    """log(1 + x) without cancellation (Kahan): log(u) * (x / (u - 1)) with u = 1 + x rounded."""
    one = s.const(1.0, wide)
    u = f("arith.addf", one, x)
    u_minus_one = f("arith.subf", u, one)
    scaled = f("arith.mulf", f("math.log", u), f("arith.divf", x, u_minus_one))
    exact = f("arith.cmpf oeq", u_minus_one, s.const(0.0, wide))  # 1 + x == 1: log1p(x) = x
    infinite = f("arith.cmpf oeq", x, s.const(np.inf, wide))
    return f("arith.select", s.op(f"arith.ori {exact}, {infinite} : i1"), x, scaled)


# Giles, "Approximating the erfinv function" (GPU Computing Gems, 2011), single precision; XLA uses it too
_ERF_INV_CENTRAL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                    -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
_ERF_INV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
                 -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)


def _erf_inv(f, s, x, wide):
    if wide != "float32":
        raise LoweringError(f"erf_inv on {wide} (jnova has the single-precision approximation only)")
    w = f("arith.negf", _log1p(f, s, f("arith.negf", f("arith.mulf", x, x)), wide))  # -log(1 - x^2)
    central = f("arith.cmpf olt", w, s.const(5.0, wide))
    w = f("arith.select", central, f("arith.subf", w, s.const(2.5, wide)),
          f("arith.subf", f("math.sqrt", w), s.const(3.0, wide)))
    p = None
    for c, t in zip(_ERF_INV_CENTRAL, _ERF_INV_TAIL):
        coefficient = f("arith.select", central, s.const(c, wide), s.const(t, wide))
        p = coefficient if p is None else f("arith.addf", coefficient, f("arith.mulf", p, w))
    at_one = f("arith.cmpf oeq", f("math.absf", x), s.const(1.0, wide))  # erf_inv(+-1) = +-inf
    return f("arith.select", at_one, f("arith.mulf", x, s.const(np.inf, wide)), f("arith.mulf", p, x))


def _int_unary(s, op, x, dtype):
    e = element(dtype)
    name = op.name
    if name == "nova.neg":
        return s.op(f"arith.subi {s.const(0, dtype)}, {x} : {e}")
    if name == "nova.abs":
        return x if dtype in UNSIGNED_DTYPES else s.op(f"math.absi {x} : {e}")
    if name == "nova.square":
        return s.op(f"arith.muli {x}, {x} : {e}")
    if name == "nova.not":
        ones = s.const(True, "bool") if dtype == "bool" else s.const(-1, dtype)
        return s.op(f"arith.xori {x}, {ones} : {e}")
    if name == "nova.sign":
        if dtype in UNSIGNED_DTYPES:
            return s.op(f"arith.extui {s.op(f'arith.cmpi ne, {x}, {s.const(0, dtype)} : {e}')} : i1 to {e}")
        zero = s.const(0, dtype)
        pos = s.op(f"arith.extui {s.op(f'arith.cmpi sgt, {x}, {zero} : {e}')} : i1 to {e}")
        neg = s.op(f"arith.extui {s.op(f'arith.cmpi slt, {x}, {zero} : {e}')} : i1 to {e}")
        return s.op(f"arith.subi {pos}, {neg} : {e}")
    if name == "nova.population_count":
        return s.op(f"math.ctpop {x} : {e}")
    if name == "nova.clz":
        return s.op(f"math.ctlz {x} : {e}")
    if name == "nova.ipow":
        n = op.attrs["exponent"]
        power = _ipow(s, x, abs(n), dtype, lambda a, b: s.op(f"arith.muli {a}, {b} : {e}"), None)
        return power if n >= 0 else _int_divide(s, "nova.div", dtype, s.const(1, dtype), power)
    raise LoweringError(f"'{name}' on {dtype}")


def _ipow(s, x, n, dtype, mul, div):
    """x ** n by repeated squaring, the same multiplication order as JAX's integer_pow lowering."""
    if n == 0:
        return s.const(1, dtype)
    acc, base, k = None, x, abs(n)
    while k:
        if k & 1:
            acc = base if acc is None else mul(acc, base)
        k >>= 1
        if k:
            base = mul(base, base)
    return div(s.const(1.0, dtype), acc) if n < 0 else acc


# --------------------------------------------------------------------------- binary
@lowering(*sorted(set(FLOAT_BINARY) | set(FLOAT_MAX_MIN) | set(INT_BINARY) | set(INT_DIVIDE) | set(SHIFTS)
                  | {"nova.nextafter"}))
def _binary(em, op, lhs, rhs):
    dtype = op.operands[0].type.dtype
    if op.name == "nova.nextafter":
        return em.map_elementwise([(lhs, op.operands[0].type), (rhs, op.operands[1].type)], op.results[0].type,
                                  lambda s, a: _nextafter(s, a[0], a[1], dtype))
    if dtype in FLOAT_DTYPES and op.name in FLOAT_MAX_MIN:
        return _float_math(em, op, [lhs, rhs], lambda s, a, e, w: (s.float_max_min(FLOAT_MAX_MIN[op.name], *a, w), w))
    if dtype in FLOAT_DTYPES:
        if op.name not in FLOAT_BINARY:
            raise LoweringError(f"'{op.name}' on {dtype}")
        return _float_math(em, op, [lhs, rhs],
                           lambda s, a, e, w: (s.op(f"{FLOAT_BINARY[op.name]} {a[0]}, {a[1]} : {e}"), w))
    return em.map_elementwise([(lhs, op.operands[0].type), (rhs, op.operands[1].type)], op.results[0].type,
                              lambda s, a: _int_binary(s, op.name, dtype, a[0], a[1]))


def _int_binary(s, name, dtype, x, y):
    e = element(dtype)
    if dtype == "bool" and name in BOOL_BINARY:
        return s.op(f"{BOOL_BINARY[name]} {x}, {y} : {e}")
    if name in INT_DIVIDE:
        return _int_divide(s, name, dtype, x, y)
    if name in SHIFTS:
        return _shift(s, name, dtype, x, y)
    if name not in INT_BINARY:
        raise LoweringError(f"'{name}' on {dtype}")
    signed, unsigned = INT_BINARY[name]
    return s.op(f"{unsigned if dtype in UNSIGNED_DTYPES else signed} {x}, {y} : {e}")


def _int_divide(s, name, dtype, x, y):
    """XLA's integer division: x / 0 = -1 (all ones), x % 0 = x, INT_MIN / -1 = INT_MIN, INT_MIN % -1 = 0."""
    e = element(dtype)
    unsigned = dtype in UNSIGNED_DTYPES
    by_zero = s.op(f"arith.cmpi eq, {y}, {s.const(0, dtype)} : {e}")
    bad = by_zero
    if not unsigned:  # INT_MIN / -1 overflows; dividing by 1 instead gives XLA's INT_MIN and 0
        overflow = s.op(f"arith.andi {s.op(f'arith.cmpi eq, {x}, {s.const(np.iinfo(dtype).min, dtype)} : {e}')}, "
                        f"{s.op(f'arith.cmpi eq, {y}, {s.const(-1, dtype)} : {e}')} : i1")
        bad = s.op(f"arith.ori {by_zero}, {overflow} : i1")
    safe = s.op(f"arith.select {bad}, {s.const(1, dtype)}, {y} : {e}")
    result = s.op(f"{INT_DIVIDE[name][unsigned]} {x}, {safe} : {e}")
    if_zero = s.const(-1, dtype) if name == "nova.div" else x
    return s.op(f"arith.select {by_zero}, {if_zero}, {result} : {e}")


def _shift(s, name, dtype, x, y):
    """Shift amounts of the bit width or more (unsigned) give 0, or the sign bits for arithmetic shifts."""
    e = element(dtype)
    width = s.const(bitwidth(dtype), dtype)
    too_far = s.op(f"arith.cmpi uge, {y}, {width} : {e}")
    shifted = s.op(f"{SHIFTS[name]} {x}, {y} : {e}")
    if name == "nova.shift_right_arithmetic":
        saturated = s.op(f"arith.shrsi {x}, {s.const(bitwidth(dtype) - 1, dtype)} : {e}")
    else:
        saturated = s.const(0, dtype)
    return s.op(f"arith.select {too_far}, {saturated}, {shifted} : {e}")


def _nextafter(s, x, y, dtype):
    """The next representable value after x towards y, by stepping x's bit pattern (in its own width).

    Selects pick bit patterns, not 16-bit floats: LLVM's x86 backend asserts on some bf16 selects.
    """
    e, n = element(dtype), bitwidth(dtype)
    bits, int_type = f"i{n}", f"int{n}"
    wide = compute_dtype(dtype)
    f = lambda arith, *args: _apply(s, arith, element(wide), *args)  # noqa: E731
    i = lambda arith, *args: _apply(s, arith, bits, *args)  # noqa: E731
    xw, yw = s.cast(x, dtype, wide), s.cast(y, dtype, wide)
    ix, iy = s.op(f"arith.bitcast {x} : {e} to {bits}"), s.op(f"arith.bitcast {y} : {e} to {bits}")
    zero = s.const(0.0, wide)
    # moving away from zero adds one to the bit pattern, towards zero subtracts one
    away = s.op(f"arith.cmpi eq, {f('arith.cmpf olt', xw, yw)}, {f('arith.cmpf ogt', xw, zero)} : i1")
    stepped = i("arith.addi", ix, i("arith.select", away, s.const(1, int_type), s.const(-1, int_type)))
    smallest = i("arith.ori", i("arith.andi", iy, s.const(1 << (n - 1), int_type)), s.const(1, int_type))
    result = i("arith.select", f("arith.cmpf oeq", xw, zero), smallest, stepped)  # from +-0: smallest denormal
    result = i("arith.select", f("arith.cmpf oeq", xw, yw), iy, result)
    nan = s.op(f"arith.bitcast {s.const(np.nan, dtype)} : {e} to {bits}")
    result = i("arith.select", f("arith.cmpf uno", xw, yw), nan, result)
    return s.op(f"arith.bitcast {result} : {bits} to {e}")


@lowering("nova.reduce_precision")
def _reduce_precision(em, op, x):
    t = op.operands[0].type
    return em.map_elementwise([(x, t)], t, lambda s, a: _round_to_format(
        s, a[0], t.dtype, op.attrs["exponent_bits"], op.attrs["mantissa_bits"]))


_MANTISSA_BITS = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}


def _round_to_format(s, x, dtype, exponent_bits, mantissa_bits):
    """XLA's reduce_precision: round the mantissa to nearest even, flush exponents out of range to 0 or
    inf (denormals of the narrow format included); NaN stays NaN, even with no mantissa bits."""
    e, n = element(dtype), bitwidth(dtype)
    src_mantissa = _MANTISSA_BITS[dtype]
    src_exponent = n - 1 - src_mantissa
    bits = f"i{n}"
    f = lambda arith, *args: _apply(s, arith, bits, *args)  # noqa: E731
    c = lambda value: s.const(value, f"int{n}")  # noqa: E731
    x_bits = s.op(f"arith.bitcast {x} : {e} to {bits}")
    sign_mask, exponent_mask = 1 << (n - 1), ((1 << src_exponent) - 1) << src_mantissa
    is_nan = f("arith.cmpi ugt", f("arith.andi", x_bits, c(~sign_mask)), c(exponent_mask))
    result = x_bits
    if mantissa_bits < src_mantissa:
        shift = src_mantissa - mantissa_bits
        last_bit = f("arith.andi", f("arith.shrui", result, c(shift)), c(1))
        bias = f("arith.addi", last_bit, c((1 << (shift - 1)) - 1))  # 0111... (+1 if odd): ties to even
        result = f("arith.andi", f("arith.addi", result, bias), c(~((1 << shift) - 1)))
    if exponent_bits < src_exponent:
        src_bias, reduced_bias = (1 << (src_exponent - 1)) - 1, (1 << (exponent_bits - 1)) - 1
        exponent = f("arith.andi", result, c(exponent_mask))
        overflows = f("arith.cmpi ugt", exponent, c((src_bias + reduced_bias) << src_mantissa))
        underflows = f("arith.cmpi ule", exponent, c((src_bias - reduced_bias) << src_mantissa))  # denormals too
        signed_zero = f("arith.andi", result, c(sign_mask))
        result = f("arith.select", overflows, f("arith.ori", signed_zero, c(exponent_mask)), result)
        result = f("arith.select", underflows, signed_zero, result)
    return s.op(f"arith.bitcast {f('arith.select', is_nan, x_bits, result)} : {bits} to {e}")  # NaN stays NaN


# --------------------------------------------------------------------------- compare, select, convert
@lowering("nova.compare")
def _compare(em, op, lhs, rhs):
    dtype = op.operands[0].type.dtype
    pred = op.attrs["predicate"]
    if dtype in FLOAT_DTYPES:
        return _float_math(em, op, [lhs, rhs],
                           lambda s, a, e, w: (s.op(f"arith.cmpf {FLOAT_PREDICATES[pred]}, {a[0]}, {a[1]} : {e}"), "bool"))
    table = UNSIGNED_PREDICATES if dtype in UNSIGNED_DTYPES or dtype == "bool" else SIGNED_PREDICATES
    e = element(dtype)
    return em.map_elementwise([(lhs, op.operands[0].type), (rhs, op.operands[1].type)], op.results[0].type,
                              lambda s, a: s.op(f"arith.cmpi {table[pred]}, {a[0]}, {a[1]} : {e}"))


@lowering("nova.select")
def _select(em, op, which, *cases):
    out, wt = op.results[0].type, op.operands[0].type
    e, im = element(out.dtype), identity_map(out.rank)
    which_map = im if wt.shape == out.shape else affine_map(out.rank, [])  # a scalar predicate
    ins = [(which, wt, which_map)] + [(c, v.type, im) for c, v in zip(cases, op.operands[1:])]

    def body(s, args):
        w, cs = args[0], args[1: 1 + len(cases)]
        if wt.dtype == "bool":
            return s.op(f"arith.select {w}, {cs[1]}, {cs[0]} : {e}") if len(cs) == 2 else cs[0]
        we = element(wt.dtype)
        result = cs[-1]
        for i in range(len(cs) - 2, -1, -1):  # which == i ? case_i : (later cases)
            eq = s.op(f"arith.cmpi eq, {w}, {s.const(i, wt.dtype)} : {we}")
            result = s.op(f"arith.select {eq}, {cs[i]}, {result} : {e}")
        return result

    return em.generic(ins, [(em.empty(out), out, im)], ["parallel"] * out.rank, body)[0]


@lowering("nova.convert")
def _convert(em, op, x):
    src, dst = op.operands[0].type.dtype, op.results[0].type.dtype
    return em.map_elementwise([(x, op.operands[0].type)], op.results[0].type, lambda s, a: s.cast(a[0], src, dst))


@lowering("nova.bitcast")
def _bitcast(em, op, x):
    src, dst = element(op.operands[0].type.dtype), element(op.results[0].type.dtype)
    return em.map_elementwise([(x, op.operands[0].type)], op.results[0].type,
                              lambda s, a: s.op(f"arith.bitcast {a[0]} : {src} to {dst}"))
