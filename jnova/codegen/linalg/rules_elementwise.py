"""linalg lowerings of elementwise nova ops: one `linalg.generic` each, scalar math in the body."""
from __future__ import annotations

from jnova.codegen.linalg.emitter import compute_dtype, element
from jnova.codegen.linalg.lowering import LoweringError, lowering
from jnova.dialect.types import FLOAT_DTYPES, UNSIGNED_DTYPES

# nova op -> math/arith op on floats (computed in f32 for 16-bit floats)
FLOAT_UNARY = {
    "nova.exp": "math.exp", "nova.exp2": "math.exp2", "nova.expm1": "math.expm1", "nova.log": "math.log",
    "nova.log1p": "math.log1p", "nova.tanh": "math.tanh", "nova.erf": "math.erf", "nova.sqrt": "math.sqrt",
    "nova.rsqrt": "math.rsqrt", "nova.cbrt": "math.cbrt", "nova.sin": "math.sin", "nova.cos": "math.cos",
    "nova.tan": "math.tan", "nova.asin": "math.asin", "nova.acos": "math.acos", "nova.atan": "math.atan",
    "nova.sinh": "math.sinh", "nova.cosh": "math.cosh", "nova.asinh": "math.asinh", "nova.acosh": "math.acosh",
    "nova.atanh": "math.atanh", "nova.floor": "math.floor", "nova.ceil": "math.ceil", "nova.abs": "math.absf",
    "nova.neg": "arith.negf",
}
FLOAT_BINARY = {
    "nova.add": "arith.addf", "nova.sub": "arith.subf", "nova.mul": "arith.mulf", "nova.div": "arith.divf",
    "nova.rem": "arith.remf", "nova.max": "arith.maximumf", "nova.min": "arith.minimumf",
    "nova.pow": "math.powf", "nova.atan2": "math.atan2",
}
# nova op -> (signed, unsigned) integer op
INT_BINARY = {
    "nova.add": ("arith.addi",) * 2, "nova.sub": ("arith.subi",) * 2, "nova.mul": ("arith.muli",) * 2,
    "nova.div": ("arith.divsi", "arith.divui"), "nova.rem": ("arith.remsi", "arith.remui"),
    "nova.max": ("arith.maxsi", "arith.maxui"), "nova.min": ("arith.minsi", "arith.minui"),
    "nova.and": ("arith.andi",) * 2, "nova.or": ("arith.ori",) * 2, "nova.xor": ("arith.xori",) * 2,
    "nova.shift_left": ("arith.shli",) * 2, "nova.shift_right_logical": ("arith.shrui",) * 2,
    "nova.shift_right_arithmetic": ("arith.shrsi",) * 2,
}
FLOAT_PREDICATES = {"eq": "oeq", "ne": "une", "lt": "olt", "le": "ole", "gt": "ogt", "ge": "oge"}
SIGNED_PREDICATES = {"eq": "eq", "ne": "ne", "lt": "slt", "le": "sle", "gt": "sgt", "ge": "sge"}
UNSIGNED_PREDICATES = {"eq": "eq", "ne": "ne", "lt": "ult", "le": "ule", "gt": "ugt", "ge": "uge"}


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


@lowering(*sorted(set(FLOAT_UNARY) | {"nova.logistic", "nova.sign", "nova.square", "nova.is_finite", "nova.round",
                                      "nova.not", "nova.population_count", "nova.ipow"}))
def _unary(em, op, x):
    dtype = op.operands[0].type.dtype
    if dtype in FLOAT_DTYPES:
        return _float_math(em, op, [x], lambda s, a, e, w: (_float_unary(s, op, a[0], e, w), _result_dtype(op, w)))
    return em.map_elementwise([(x, op.operands[0].type)], op.results[0].type, lambda s, a: _int_unary(s, op, a[0], dtype))


def _result_dtype(op, wide):
    return "bool" if op.name == "nova.is_finite" else wide


def _float_unary(s, op, x, e, wide):
    name = op.name
    if name in FLOAT_UNARY:
        return s.op(f"{FLOAT_UNARY[name]} {x} : {e}")
    if name == "nova.logistic":  # 1 / (1 + exp(-x))
        one = s.const(1.0, wide)
        neg = s.op(f"arith.negf {x} : {e}")
        denom = s.op(f"arith.addf {one}, {s.op(f'math.exp {neg} : {e}')} : {e}")
        return s.op(f"arith.divf {one}, {denom} : {e}")
    if name == "nova.square":
        return s.op(f"arith.mulf {x}, {x} : {e}")
    if name == "nova.sign":  # -1, 0 or +1; keeps NaN and signed zero
        zero, one, minus = s.const(0.0, wide), s.const(1.0, wide), s.const(-1.0, wide)
        pos = s.op(f"arith.cmpf ogt, {x}, {zero} : {e}")
        neg = s.op(f"arith.cmpf olt, {x}, {zero} : {e}")
        return s.op(f"arith.select {pos}, {one}, {s.op(f'arith.select {neg}, {minus}, {x} : {e}')} : {e}")
    if name == "nova.is_finite":
        return s.op(f"math.isfinite {x} : {e}")
    if name == "nova.round":
        return s.op(f"{'math.roundeven' if op.attrs['method'] == 'to_nearest_even' else 'math.round'} {x} : {e}")
    if name == "nova.ipow":
        return _ipow(s, x, op.attrs["exponent"], wide, lambda a, b: s.op(f"arith.mulf {a}, {b} : {e}"),
                     lambda a, b: s.op(f"arith.divf {a}, {b} : {e}"))
    raise LoweringError(f"'{name}' on floats")


def _int_unary(s, op, x, dtype):
    e = element(dtype)
    name = op.name
    if name == "nova.neg":
        return s.op(f"arith.subi {s.const(0, dtype)}, {x} : {e}")
    if name == "nova.abs":
        return s.op(f"math.absi {x} : {e}")
    if name == "nova.square":
        return s.op(f"arith.muli {x}, {x} : {e}")
    if name == "nova.not":
        ones = s.op(f"arith.constant {'true' if dtype == 'bool' else -1} : {e}")
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
    if name == "nova.ipow":
        if op.attrs["exponent"] < 0:
            raise LoweringError("negative integer power of an integer")
        return _ipow(s, x, op.attrs["exponent"], dtype, lambda a, b: s.op(f"arith.muli {a}, {b} : {e}"), None)
    raise LoweringError(f"'{name}' on {dtype}")


def _ipow(s, x, n, dtype, mul, div):
    """x ** n by repeated squaring, the same multiplication order as XLA's integer_pow expansion."""
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


@lowering(*sorted(set(FLOAT_BINARY) | set(INT_BINARY)))
def _binary(em, op, lhs, rhs):
    dtype = op.operands[0].type.dtype
    if dtype in FLOAT_DTYPES:
        if op.name not in FLOAT_BINARY:
            raise LoweringError(f"'{op.name}' on {dtype}")
        return _float_math(em, op, [lhs, rhs],
                           lambda s, a, e, w: (s.op(f"{FLOAT_BINARY[op.name]} {a[0]}, {a[1]} : {e}"), w))
    if op.name not in INT_BINARY:
        raise LoweringError(f"'{op.name}' on {dtype}")
    if op.name == "nova.pow":
        raise LoweringError("integer pow")
    signed, unsigned = INT_BINARY[op.name]
    name = unsigned if dtype in UNSIGNED_DTYPES else signed
    e = element(dtype)
    if dtype == "bool" and op.name in ("nova.add", "nova.max"):
        name = "arith.ori"
    elif dtype == "bool" and op.name in ("nova.mul", "nova.min"):
        name = "arith.andi"
    return em.map_elementwise([(lhs, op.operands[0].type), (rhs, op.operands[1].type)], op.results[0].type,
                              lambda s, a: s.op(f"{name} {a[0]}, {a[1]} : {e}"))


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
    out = op.results[0].type
    wt = op.operands[0].type
    e = element(out.dtype)
    if wt.shape != out.shape:  # scalar predicate
        from jnova.codegen.linalg.emitter import affine_map
        m = affine_map(out.rank, [])
    else:
        m = None
    from jnova.codegen.linalg.emitter import identity_map

    im = identity_map(out.rank)
    ins = [(which, wt, m or im)] + [(c, v.type, im) for c, v in zip(cases, op.operands[1:])]

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

    return em.generic(ins, [(em.empty(out), out, im)], ["parallel"] * out.rank, lambda s, a: body(s, a))[0]


@lowering("nova.convert")
def _convert(em, op, x):
    src, dst = op.operands[0].type.dtype, op.results[0].type.dtype
    return em.map_elementwise([(x, op.operands[0].type)], op.results[0].type, lambda s, a: s.cast(a[0], src, dst))
