"""The in-memory form of nova IR: values, ops, functions, and their MLIR text.

jnova's passes work on this small Python IR (like xDSL); the same module prints as MLIR text
that upstream MLIR parses and verifies against the registered nova dialect (see `irdl.py`), and
`parse.py` reads such text back. Value semantics: every op takes tensors and returns new tensors.
"""
from __future__ import annotations

import itertools
import math
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from jnova.dialect.types import TensorType, mlir_element, numpy_dtype


class VerifyError(ValueError):
    """An op or function that breaks the rules of the nova dialect."""


# --------------------------------------------------------------------------- attributes
class AttrKind:
    """How an attribute's Python value prints as MLIR (and which IRDL base it has)."""

    irdl_base: ClassVar[str]

    @staticmethod
    def check(value) -> bool:
        raise NotImplementedError

    @staticmethod
    def print(value) -> str:
        raise NotImplementedError


class I64(AttrKind):
    irdl_base = "#builtin.integer"

    @staticmethod
    def check(value):
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

    @staticmethod
    def print(value):
        return f"{int(value)} : i64"


class Bool(AttrKind):
    irdl_base = "#builtin.integer"

    @staticmethod
    def check(value):
        return isinstance(value, (bool, np.bool_))

    @staticmethod
    def print(value):
        return "true" if value else "false"


class F64(AttrKind):
    irdl_base = "#builtin.float"

    @staticmethod
    def check(value):
        return isinstance(value, (float, int, np.floating)) and not isinstance(value, bool)

    @staticmethod
    def print(value):
        return f"{format_float(float(value), 'f64')} : f64"


class Str(AttrKind):
    irdl_base = "#builtin.string"

    @staticmethod
    def check(value):
        return isinstance(value, str)

    @staticmethod
    def print(value):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'


class I64Array(AttrKind):
    irdl_base = "#builtin.dense_array"

    @staticmethod
    def check(value):
        return isinstance(value, tuple) and all(I64.check(v) for v in value)

    @staticmethod
    def print(value):
        return f"array<i64: {', '.join(str(int(v)) for v in value)}>" if value else "array<i64>"


class Dense(AttrKind):
    """A constant tensor, held as a NumPy array of the op's result type."""

    irdl_base = "#builtin.dense_int_or_fp_elements"

    @staticmethod
    def check(value):
        return isinstance(value, np.ndarray)

    @staticmethod
    def print(value):
        raise TypeError("Dense attributes print with their type: use print_dense")


def format_float(x: float, element: str) -> str:
    """A float literal MLIR reads back bit-exactly (hex bit pattern for non-finite values)."""
    if math.isfinite(x):
        text = repr(float(x))
        return text if ("e" in text or "." in text) else text + ".0"
    if element == "f64":
        return "0x%016X" % struct.unpack("<Q", struct.pack("<d", x))[0]
    bits = np.array([x], dtype=numpy_dtype({"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[element]))
    return "0x%0*X" % (bits.itemsize * 2, int(bits.view(f"u{bits.itemsize}")[0]))


def print_dense(value: np.ndarray, ttype: TensorType) -> str:
    element = mlir_element(ttype.dtype)
    flat = np.ascontiguousarray(np.asarray(value, dtype=numpy_dtype(ttype.dtype)).reshape(-1))
    if flat.size > 0 and (flat.view(np.uint8).reshape(flat.size, -1) == flat.view(np.uint8).reshape(flat.size, -1)[0]).all():
        body = _scalar_literal(flat[0], ttype.dtype, element)
    elif ttype.dtype == "bool":
        body = _nested(np.asarray(value).reshape(ttype.shape), lambda v: "true" if v else "false")
    else:
        body = '"0x' + flat.tobytes().hex().upper() + '"'
    return f"dense<{body}> : {ttype.mlir()}"


def _scalar_literal(v, dtype: str, element: str) -> str:
    if dtype == "bool":
        return "true" if bool(v) else "false"
    if element.startswith("f") or element == "bf16":
        return format_float(float(v), element)
    return str(int(v))


def _nested(array: np.ndarray, fmt) -> str:
    if array.ndim == 0:
        return fmt(array.item())
    return "[" + ", ".join(_nested(a, fmt) for a in array) + "]"


# --------------------------------------------------------------------------- values and ops
class Value:
    """An SSA value: a function argument (owner None) or the index-th result of an op."""

    __slots__ = ("type", "owner", "index")

    def __init__(self, type: TensorType, owner: "Op | None" = None, index: int = 0):
        self.type = type
        self.owner = owner
        self.index = index

    def __repr__(self):
        where = self.owner.name if self.owner is not None else "arg"
        return f"<Value {where}#{self.index} {self.type}>"


@dataclass(frozen=True)
class OperandSpec:
    name: str
    variadic: bool = False


class Op:
    """Base of every nova op. Subclasses declare `name`, `operands`, `results` and `attributes`.

    `operands`/`results` are tuples of names; a name starting with `*` is variadic (at most one per
    list, and it must be last). `attributes` maps each (required) attribute name to its AttrKind.
    """

    name: ClassVar[str]
    operands_spec: ClassVar[tuple[str, ...]] = ()
    results_spec: ClassVar[tuple[str, ...]] = ("out",)
    attributes: ClassVar[dict[str, type[AttrKind]]] = {}
    pure: ClassVar[bool] = True
    summary: ClassVar[str] = ""

    __slots__ = ("operands", "results", "attrs", "loc")

    def __init__(self, operands, result_types, attrs: dict[str, Any] | None = None, loc: str | None = None):
        self.operands: list[Value] = list(operands)
        self.results: list[Value] = [Value(t, self, i) for i, t in enumerate(result_types)]
        self.attrs: dict[str, Any] = dict(attrs or {})
        self.loc = loc

    # -- convenience
    @property
    def result(self) -> Value:
        if len(self.results) != 1:
            raise ValueError(f"{self.name} has {len(self.results)} results")
        return self.results[0]

    def operand(self, name: str) -> Value:
        return self.operands[self._fixed_names().index(name)]

    @classmethod
    def _fixed_names(cls):
        return [n for n in cls.operands_spec if not n.startswith("*")]

    def variadic_operands(self) -> list[Value]:
        return self.operands[len(self._fixed_names()):]

    def error(self, message: str) -> VerifyError:
        where = f" at {self.loc}" if self.loc else ""
        return VerifyError(f"'{self.name}' op{where}: {message}")

    # -- verification
    def verify(self) -> None:
        """Structural checks common to all ops, then the op's own `verify_`."""
        fixed = self._fixed_names()
        variadic = len(fixed) != len(self.operands_spec)
        if len(self.operands) < len(fixed) or (not variadic and len(self.operands) != len(fixed)):
            want = f"at least {len(fixed)}" if variadic else str(len(fixed))
            raise self.error(f"expected {want} operands ({', '.join(self.operands_spec)}), got {len(self.operands)}")
        fixed_results = [n for n in self.results_spec if not n.startswith("*")]
        variadic_results = len(fixed_results) != len(self.results_spec)
        if len(self.results) < len(fixed_results) or (not variadic_results and len(self.results) != len(fixed_results)):
            raise self.error(f"expected {len(fixed_results)} results, got {len(self.results)}")
        for key, kind in self.attributes.items():
            if key not in self.attrs:
                raise self.error(f"missing attribute '{key}'")
            if not kind.check(self.attrs[key]):
                raise self.error(f"attribute '{key}' must be {kind.__name__}, got {self.attrs[key]!r}")
        unknown = set(self.attrs) - set(self.attributes)
        if unknown:
            raise self.error(f"unknown attributes {sorted(unknown)}")
        self.verify_()

    def verify_(self) -> None:
        """Op-specific checks; raise `self.error(...)` naming the operand and what was expected."""

    def __repr__(self):
        return f"<{self.name} {len(self.operands)} -> {[str(r.type) for r in self.results]}>"


# --------------------------------------------------------------------------- functions
class Func:
    """A single-block function: arguments, ops in program order, returned values."""

    def __init__(self, name: str, arg_types, ops=None, returns=None):
        self.name = name
        self.args: list[Value] = [Value(t, None, i) for i, t in enumerate(arg_types)]
        self.ops: list[Op] = list(ops or [])
        self.returns: list[Value] = list(returns or [])

    def add(self, op: Op) -> Op:
        self.ops.append(op)
        return op

    def uses(self) -> dict[Value, list[Op | None]]:
        """Each value's users (None stands for the function's return)."""
        users: dict[Value, list] = {v: [] for v in self.args}
        for op in self.ops:
            for r in op.results:
                users[r] = []
        for op in self.ops:
            for v in op.operands:
                users.setdefault(v, []).append(op)
        for v in self.returns:
            users.setdefault(v, []).append(None)
        return users

    def verify(self) -> None:
        """Every operand is defined before use, and every op passes its own verifier."""
        defined = set(self.args)
        for op in self.ops:
            for i, v in enumerate(op.operands):
                if v not in defined:
                    raise op.error(f"operand #{i} is used before it is defined (or belongs to another function)")
            op.verify()
            defined.update(op.results)
        for i, v in enumerate(self.returns):
            if v not in defined:
                raise VerifyError(f"func @{self.name}: returned value #{i} is not defined in the function")

    def print(self) -> str:
        return print_func(self)

    def __str__(self):
        return self.print()


def print_func(func: Func) -> str:
    """MLIR text of `func` as `func.func`, nova ops in generic form, values numbered like MLIR."""
    names: dict[Value, str] = {}
    for i, a in enumerate(func.args):
        names[a] = f"%arg{i}"
    counter = itertools.count()
    lines = []
    args = ", ".join(f"%arg{i}: {a.type}" for i, a in enumerate(func.args))
    rets = ", ".join(str(v.type) for v in func.returns)
    rets = f"({rets})" if len(func.returns) != 1 else rets
    lines.append(f"func.func @{func.name}({args}) -> {rets} {{")
    for op in func.ops:
        n = next(counter)
        if len(op.results) == 1:
            names[op.results[0]] = f"%{n}"
            lhs = f"%{n} = "
        elif op.results:
            for i, r in enumerate(op.results):
                names[r] = f"%{n}#{i}"
            lhs = f"%{n}:{len(op.results)} = "
        else:
            lhs = ""
        operands = ", ".join(names[v] for v in op.operands)
        attrs = _print_attrs(op)
        in_types = ", ".join(str(v.type) for v in op.operands)
        out_types = ", ".join(str(r.type) for r in op.results)
        out_types = out_types if len(op.results) == 1 else f"({out_types})"
        lines.append(f'  {lhs}"{op.name}"({operands}){attrs} : ({in_types}) -> {out_types}')
    ret_vals = ", ".join(names[v] for v in func.returns)
    ret_types = ", ".join(str(v.type) for v in func.returns)
    lines.append(f"  func.return {ret_vals} : {ret_types}" if func.returns else "  func.return")
    lines.append("}")
    return "\n".join(lines)


def _print_attrs(op: Op) -> str:
    if not op.attrs:
        return ""
    parts = []
    for key in sorted(op.attrs):
        kind = op.attributes.get(key)
        value = op.attrs[key]
        if kind is Dense:
            text = print_dense(value, op.results[0].type)
        else:
            text = kind.print(value)
        parts.append(f"{key} = {text}")
    return " {" + ", ".join(parts) + "}"


def print_module(funcs: list[Func]) -> str:
    body = "\n".join(f.print() for f in funcs)
    return "module {\n" + body + "\n}\n"
