"""MLIR text -> nova `Func`: the inverse of `ir.print_func`.

The text is parsed by upstream MLIR (the Python bindings) with nova ops as unregistered generic
ops, so parsing checks syntax and SSA structure only; the nova rules are checked afterwards by
`Func.verify()` (and by MLIR through IRDL in `irdl.verify_with_mlir`). Attributes become Python
values by the kind the op declares for them; a constant's dense elements become a NumPy array of
the result dtype (bf16 included, read from MLIR's literal text where the bindings cannot convert).

Round trip: `parse_module(f.print()).print() == f.print()`, and the same with `print(debug_info=True)`:
argument and result names and ops' source locations are read back.
"""
from __future__ import annotations

import re

import numpy as np
from mlir import ir

from jnova.dialect.ir import NAME_ATTR, Bool, Dense, F64, Func, I64, I64Array, Op, Str, Value
from jnova.dialect.ops import OPS
from jnova.dialect.types import FLOAT_DTYPES, TensorType, dtype_of_element, numpy_dtype
from jnova.errors import ParseError, VerifyError


def parse_module(text: str, *, verify: bool = True) -> Func:
    """The single `func.func` of a nova module (bare or inside `module { ... }`)."""
    funcs = parse_funcs(text, verify=verify)
    if len(funcs) != 1:
        raise ParseError(f"expected one func.func in the module, found {len(funcs)}")
    return funcs[0]


def parse_funcs(text: str, *, verify: bool = True) -> list[Func]:
    """Every `func.func` of a nova module, in order; each is verified unless `verify=False`."""
    context = ir.Context(load_on_create_dialects=["func"])  # dialects load on demand: ~0.2 ms, not ~20
    context.allow_unregistered_dialects = True
    try:
        module = ir.Module.parse(text, context)
    except ir.MLIRError as e:
        raise ParseError(f"not valid MLIR: {e}") from None
    funcs = []
    for op in module.body.operations:
        if op.operation.name != "func.func":
            raise ParseError(f"expected only func.func ops in the module, found '{op.operation.name}'")
        funcs.append(_read_func(op.operation))
    if verify:
        for f in funcs:
            f.verify()
    return funcs


def _read_func(func_op: ir.Operation) -> Func:
    name = ir.StringAttr(func_op.attributes["sym_name"]).value
    signature = ir.FunctionType(ir.TypeAttr(func_op.attributes["function_type"]).value)
    where = f"func @{name}"
    arg_types = [_tensor_type(t, f"{where}: argument #{i}") for i, t in enumerate(signature.inputs)]
    result_types = [_tensor_type(t, f"{where}: result #{i}") for i, t in enumerate(signature.results)]
    blocks = list(func_op.regions[0].blocks)
    if len(blocks) != 1:
        raise ParseError(f"{where} has {len(blocks)} blocks, expected one (nova functions are a single block)")
    func = Func(name, arg_types, result_types=result_types, arg_names=_read_names(func_op, "arg_attrs"),
                result_names=_read_names(func_op, "res_attrs"))
    values: dict[ir.Value, Value] = dict(zip(blocks[0].arguments, func.args))
    for op in blocks[0].operations:
        op = op.operation
        if op.name == "func.return":
            func.returns = [values[v] for v in op.operands]
            continue
        nova_op = _read_op(op, values)
        nova_op.loc = _read_location(op.location)
        func.add(nova_op)
        values.update(zip(op.results, nova_op.results))
    return func


def _read_names(func_op: ir.Operation, key: str) -> list[str | None]:
    """The `jnova.name` of each argument (`arg_attrs`) or result (`res_attrs`), None where it has none."""
    if key not in func_op.attributes:
        return []
    names = []
    for attrs in map(ir.DictAttr, ir.ArrayAttr(func_op.attributes[key])):
        names.append(ir.StringAttr(attrs[NAME_ATTR]).value if NAME_ATTR in attrs else None)
    return names if any(names) else []


def _read_location(loc: ir.Location) -> str | None:
    """An op's source location as `ir.print_location` wrote it (`file.py:12:8 (fn)`), or None."""
    if not loc.is_a_name():
        return None
    child = loc.child_loc
    if child.is_a_file():
        return f"{child.filename}:{child.start_line}:{child.start_col} ({loc.name_str})"
    return loc.name_str


def _read_op(op: ir.Operation, values: dict) -> Op:
    cls = OPS.get(op.name)
    if cls is None:
        raise ParseError(f"unknown op '{op.name}' (not in the nova dialect)")
    result_types = [_tensor_type(r.type, f"'{op.name}' op: result #{i}") for i, r in enumerate(op.results)]
    attrs = {}
    for i in range(len(op.attributes)):
        named = op.attributes[i]
        attrs[named.name] = _read_attr(cls, named.name, named.attr, result_types)
    return cls([values[v] for v in op.operands], result_types, attrs)


def _tensor_type(t: ir.Type, where: str) -> TensorType:
    if not isinstance(t, ir.RankedTensorType) or not t.has_static_shape:
        raise VerifyError(f"{where} has type {t}, expected a static-shaped ranked tensor")
    try:
        return TensorType(tuple(t.shape), dtype_of_element(str(t.element_type)))
    except TypeError as e:
        raise VerifyError(f"{where} has type {t}: {e}") from None


# --------------------------------------------------------------------------- attributes
def _read_attr(cls: type[Op], key: str, attr: ir.Attribute, result_types: list[TensorType]):
    kind = cls.attributes.get(key)
    if kind is None:
        raise VerifyError(f"'{cls.name}' op: unknown attribute '{key}' (expected only {sorted(cls.attributes)})")
    value = _READERS[kind](attr, result_types)
    if value is None:
        raise VerifyError(f"'{cls.name}' op: attribute '{key}' must be {kind.expected}, got {attr}")
    return value


def _read_i64(attr, _):
    if isinstance(attr, ir.IntegerAttr) and str(attr.type) == "i64":
        return int(attr.value)
    return None


def _read_bool(attr, _):
    return bool(attr.value) if isinstance(attr, ir.BoolAttr) else None


def _read_f64(attr, _):
    if isinstance(attr, ir.FloatAttr) and str(attr.type) == "f64":
        return float(attr.value)
    return None


def _read_str(attr, _):
    return attr.value if isinstance(attr, ir.StringAttr) else None


def _read_i64_array(attr, _):
    return tuple(int(v) for v in attr) if isinstance(attr, ir.DenseI64ArrayAttr) else None


def _read_dense(attr, result_types):
    if not isinstance(attr, ir.DenseElementsAttr) or len(result_types) != 1:
        return None
    ttype = result_types[0]
    if _tensor_type(attr.type, "dense elements") != ttype:
        return None
    if ttype.dtype == "bool" and attr.is_splat:  # the bindings misread packed i1 splats (MLIR 22)
        array = np.array(bool(attr.get_splat_value().value))
    else:
        try:
            array = np.array(attr)
        except TypeError:  # the bindings cannot convert bf16: read MLIR's literal text instead
            return dense_from_text(str(attr), ttype)
    return np.array(np.broadcast_to(array, ttype.shape), dtype=numpy_dtype(ttype.dtype))  # a C-contiguous copy


_READERS = {I64: _read_i64, Bool: _read_bool, F64: _read_f64, Str: _read_str, I64Array: _read_i64_array,
            Dense: _read_dense}


_DENSE = re.compile(r"^dense<(.*)>\s*:\s*tensor<[^<>]*>$", re.S)
_LITERAL = re.compile(r"[^\[\],\s]+")


def dense_from_text(text: str, ttype: TensorType) -> np.ndarray:
    """The NumPy array of a `dense<...> : tensor<...>` literal: a hex blob, a splat, or nested lists."""
    m = _DENSE.match(text.strip())
    if not m:
        raise ParseError(f"not a dense elements literal: {text[:80]}")
    body, dtype = m.group(1).strip(), numpy_dtype(ttype.dtype)
    if not body:
        flat = np.zeros(0, dtype)
    elif body.startswith('"0x'):
        flat = np.frombuffer(bytes.fromhex(body[3:-1]), dtype).copy()
    else:
        flat = np.array([_scalar(tok, ttype.dtype) for tok in _LITERAL.findall(body)], dtype)
    if flat.size == 1 and ttype.size != 1:
        flat = np.broadcast_to(flat, (ttype.size,))
    if flat.size != ttype.size:
        raise ParseError(f"dense literal has {flat.size} elements, expected {ttype.size} for {ttype}")
    return np.array(flat.reshape(ttype.shape))


def _scalar(token: str, dtype: str):
    np_dtype = numpy_dtype(dtype)
    if token in ("true", "false"):
        return np.array(token == "true", np_dtype)
    if token.startswith("0x") and dtype in FLOAT_DTYPES:  # a float's bit pattern
        bits = np.array(int(token, 16), f"u{np_dtype.itemsize}")
        return bits.view(np_dtype)
    if dtype in FLOAT_DTYPES:
        return np.array(float(token)).astype(np_dtype)
    return np.array(int(token, 0)).astype(np_dtype)
