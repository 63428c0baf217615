"""The in-memory form of nova IR: values, ops, functions, and their MLIR text.

jnova's passes work on this small Python IR (like xDSL); the same module prints as MLIR text
that upstream MLIR parses and verifies against the registered nova dialect (see `irdl.py`), and
`parse.py` reads such text back. Value semantics: every op takes tensors and returns new tensors.
"""
from __future__ import annotations

import functools
import itertools
import math
import re
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from jnova.dialect.types import FLOAT_DTYPES, TensorType, mlir_element, numpy_dtype
from jnova.errors import VerifyError


# --------------------------------------------------------------------------- attributes
class AttrKind:
    """How an attribute's Python value prints as MLIR (and which IRDL base it has).

    `expected` says in words what a value of this kind is, for verifier messages.
    """

    irdl_base: ClassVar[str]
    expected: ClassVar[str]

    @staticmethod
    def check(value) -> bool:
        raise NotImplementedError

    @staticmethod
    def print(value) -> str:
        raise NotImplementedError


class I64(AttrKind):
    irdl_base = "#builtin.integer"
    expected = "an integer (i64)"

    @staticmethod
    def check(value):
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

    @staticmethod
    def print(value):
        return f"{int(value)} : i64"


class Bool(AttrKind):
    irdl_base = "#builtin.integer"
    expected = "a bool"

    @staticmethod
    def check(value):
        return isinstance(value, (bool, np.bool_))

    @staticmethod
    def print(value):
        return "true" if value else "false"


class F64(AttrKind):
    irdl_base = "#builtin.float"
    expected = "a float (f64)"

    @staticmethod
    def check(value):
        return isinstance(value, (float, int, np.floating)) and not isinstance(value, bool)

    @staticmethod
    def print(value):
        return f"{format_float(float(value), 'f64')} : f64"


class Str(AttrKind):
    irdl_base = "#builtin.string"
    expected = "a string"

    @staticmethod
    def check(value):
        return isinstance(value, str)

    @staticmethod
    def print(value):
        return print_string(value)


class I64Array(AttrKind):
    irdl_base = "#builtin.dense_array"
    expected = "a tuple of integers (array<i64>)"

    @staticmethod
    def check(value):
        return isinstance(value, tuple) and all(I64.check(v) for v in value)

    @staticmethod
    def print(value):
        return f"array<i64: {', '.join(str(int(v)) for v in value)}>" if value else "array<i64>"


class Dense(AttrKind):
    """A constant tensor, held as a NumPy array of the op's result type."""

    irdl_base = "#builtin.dense_int_or_fp_elements"
    expected = "a NumPy array of the result type (dense elements)"

    @staticmethod
    def check(value):
        return isinstance(value, np.ndarray)

    @staticmethod
    def print(value):
        raise TypeError("Dense attributes print with their type: use print_dense")


def print_string(value: str) -> str:
    """An MLIR string literal: printable ASCII as is, everything else as `\\XX` escapes of its UTF-8 bytes."""
    out = []
    for byte in value.encode("utf-8"):
        ch = chr(byte)
        if ch in '"\\' or not 0x20 <= byte < 0x7F:
            out.append("\\%02X" % byte)
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def format_float(x: float, element: str) -> str:
    """A float literal MLIR reads back bit-exactly (hex bit pattern for non-finite values).

    MLIR's float literals need a '.', so `1e-05` is spelled `1.0e-05`.
    """
    if math.isfinite(x):
        text = repr(float(x))
        if "." in text:
            return text
        mantissa, e, exponent = text.partition("e")
        return f"{mantissa}.0{e}{exponent}"
    if element == "f64":
        return "0x%016X" % struct.unpack("<Q", struct.pack("<d", x))[0]
    bits = np.array([x], dtype=numpy_dtype({"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[element]))
    return "0x%0*X" % (bits.itemsize * 2, int(bits.view(f"u{bits.itemsize}")[0]))


def print_dense(value: np.ndarray, ttype: TensorType) -> str:
    element = mlir_element(ttype.dtype)
    flat = np.ascontiguousarray(np.asarray(value, dtype=numpy_dtype(ttype.dtype)).reshape(-1))
    if flat.size == 0:
        return f"dense<> : {ttype.mlir()}"
    by_element = flat.view(np.uint8).reshape(flat.size, -1)
    if (by_element == by_element[0]).all():
        body = _scalar_literal(flat[:1], ttype.dtype, element)
    elif ttype.dtype == "bool":
        body = _nested(flat.reshape(ttype.shape), lambda v: "true" if v else "false")
    else:
        body = '"0x' + flat.tobytes().hex().upper() + '"'
    return f"dense<{body}> : {ttype.mlir()}"


def _scalar_literal(one: np.ndarray, dtype: str, element: str) -> str:
    """The literal of the single element of `one` (non-finite floats as their own bit pattern)."""
    v = one[0]
    if dtype == "bool":
        return "true" if bool(v) else "false"
    if dtype in FLOAT_DTYPES:
        if math.isfinite(float(v)):
            return format_float(float(v), element)
        return "0x%0*X" % (one.itemsize * 2, int(one.view(f"u{one.itemsize}")[0]))
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

    def operand_label(self, i: int) -> str:
        """How verifier messages name operand `i`: `operand 'rhs'` or `operand 'cases' #2`."""
        return f"operand {_label(self._fixed_names(), self.operands_spec, i)}"

    def result_label(self, i: int) -> str:
        fixed = [n for n in self.results_spec if not n.startswith("*")]
        return f"result {_label(fixed, self.results_spec, i)}"

    # -- verification
    def verify(self) -> None:
        """Structural checks common to all ops, then the op's own `verify_`."""
        self._verify_counts("operand", self.operands, self.operands_spec)
        self._verify_counts("result", self.results, self.results_spec)
        for i, v in enumerate(self.operands):
            if not isinstance(v, Value) or not isinstance(v.type, TensorType):
                raise self.error(f"{self.operand_label(i)} is {v!r}, expected a nova Value of tensor type")
        for i, r in enumerate(self.results):
            if not isinstance(r, Value) or not isinstance(r.type, TensorType):
                raise self.error(f"{self.result_label(i)} is {r!r}, expected a nova Value of tensor type")
        for key, kind in self.attributes.items():
            if key not in self.attrs:
                raise self.error(f"missing attribute '{key}' (expected {kind.expected})")
            if not kind.check(self.attrs[key]):
                raise self.error(f"attribute '{key}' must be {kind.expected}, got {_short(self.attrs[key])}")
        unknown = set(self.attrs) - set(self.attributes)
        if unknown:
            raise self.error(f"unknown attributes {sorted(unknown)} (expected only {sorted(self.attributes)})")
        self.verify_()

    def _verify_counts(self, what: str, values: list, spec: tuple[str, ...]) -> None:
        fixed = [n for n in spec if not n.startswith("*")]
        variadic = len(fixed) != len(spec)
        if len(values) < len(fixed) or (not variadic and len(values) != len(fixed)):
            want = f"at least {len(fixed)}" if variadic else str(len(fixed))
            names = f" ({', '.join(spec)})" if spec else ""
            raise self.error(f"expected {want} {what}s{names}, got {len(values)}")

    def verify_(self) -> None:
        """Op-specific checks; raise `self.error(...)` naming the operand and what was expected."""

    def __repr__(self):
        return f"<{self.name} {len(self.operands)} -> {[str(r.type) for r in self.results]}>"


def _label(fixed: list[str], spec: tuple[str, ...], i: int) -> str:
    if i < len(fixed):
        return f"'{fixed[i]}'"
    variadic = [n for n in spec if n.startswith("*")]
    return f"'{variadic[0][1:]}' #{i - len(fixed)}" if variadic else f"#{i}"


def _short(value, limit: int = 80) -> str:
    if isinstance(value, np.ndarray):
        return f"a {value.dtype} array of shape {value.shape}"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- functions
class Func:
    """A single-block function: arguments, ops in program order, returned values.

    `result_types`, when given (the parser takes it from the signature), is what the function
    declares it returns; `verify` checks the returned values against it.
    """

    def __init__(self, name: str, arg_types, ops=None, returns=None, result_types=None, arg_names=None,
                 result_names=None):
        self.name = name
        self.args: list[Value] = [Value(t, None, i) for i, t in enumerate(arg_types)]
        self.ops: list[Op] = list(ops or [])
        self.returns: list[Value] = list(returns or [])
        self.result_types: list[TensorType] | None = None if result_types is None else list(result_types)
        # what the user calls each argument and result (pytree paths: `params['h_0']['w']`), or None;
        # printed as the `jnova.name` attribute of the argument or result, debug information only
        self.arg_names: list[str | None] = list(arg_names or [])
        self.result_names: list[str | None] = list(result_names or [])

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
        """Structure, then every op's own verifier.

        Every value is used only inside the function that defines it and after its definition;
        each op appears once and owns its results; the returned values match `result_types`.
        """
        where = f"func @{self.name}"
        for i, a in enumerate(self.args):
            if not isinstance(a, Value) or a.owner is not None or a.index != i:
                raise VerifyError(f"{where}: argument #{i} is {a!r}, expected a function argument with index {i}")
        position: dict[Op, int] = {}
        for k, op in enumerate(self.ops):
            if op in position:
                raise op.error(f"appears twice in {where} (ops #{position[op]} and #{k})")
            position[op] = k
        defined = set(self.args)
        for op in self.ops:
            for i, v in enumerate(op.operands):
                if v not in defined:
                    raise op.error(f"{op.operand_label(i)} {self._why_undefined(v, position)}")
            for j, r in enumerate(op.results):
                if not isinstance(r, Value) or r.owner is not op or r.index != j:
                    raise op.error(f"{op.result_label(j)} is {r!r}, expected a value owned by this op with index {j}")
            op.verify()
            defined.update(op.results)
        for i, v in enumerate(self.returns):
            if v not in defined:
                raise VerifyError(f"{where}: returned value #{i} {self._why_undefined(v, position)}")
        self._verify_result_types()

    def _why_undefined(self, v, position: dict) -> str:
        if not isinstance(v, Value):
            return f"is {v!r}, expected a nova Value"
        if v.owner is None:
            return f"is argument #{v.index} of another function, expected a value defined in func @{self.name}"
        if v.owner in position:
            return (f"is used before it is defined (by '{v.owner.name}' op #{position[v.owner]}); "
                    "expected ops in def-before-use order")
        return (f"is a result of a '{v.owner.name}' op that is not in func @{self.name} "
                "(another function's, or a removed op's); expected a value defined in this function")

    def _verify_result_types(self) -> None:
        if self.result_types is None:
            return
        if len(self.returns) != len(self.result_types):
            raise VerifyError(f"func @{self.name}: returns {len(self.returns)} values, expected "
                              f"{len(self.result_types)} from its signature")
        for i, (v, t) in enumerate(zip(self.returns, self.result_types)):
            if v.type != t:
                raise VerifyError(f"func @{self.name}: returned value #{i} has type {v.type}, expected {t} "
                                  "from the function signature")

    def print(self, debug_info: bool = False) -> str:
        """The MLIR text; with `debug_info`, also the argument and result names and each op's source
        location (`loc(...)`), as MLIR prints them (not part of what the text hashes to elsewhere)."""
        return print_func(self, debug_info)

    def __str__(self):
        return self.print()


def print_func(func: Func, debug_info: bool = False) -> str:
    """MLIR text of `func` as `func.func`, nova ops in generic form, values numbered like MLIR.

    With `debug_info`, an argument or result with a name carries it as `{jnova.name = "..."}` and an op
    with a source location ends in `loc("fn"("file.py":12:8))` (MLIR's name and file locations).
    `parse.parse_module` reads it back: `parse_module(print_func(f, d)).print(d) == print_func(f, d)`.
    """
    return print_func_texts(func, plain=not debug_info, debug=debug_info)[0 if not debug_info else 1]


def print_func_texts(func: Func, plain: bool = True, debug: bool = True) -> tuple[str | None, str | None]:
    """(text without, text with debug information) of `func`, printed in one walk (the op lines are
    formatted once); a text not asked for is None."""
    names: dict[Value, str] = {}
    for i, a in enumerate(func.args):
        names[a] = f"%arg{i}"
    counter = itertools.count()
    plain_lines, debug_lines = [], []

    def signature(arg_names, result_names):
        args = ", ".join(f"%arg{i}: {a.type}{_name_attr(arg_names, i)}" for i, a in enumerate(func.args))
        rets = ", ".join(f"{v.type}{_name_attr(result_names, i)}" for i, v in enumerate(func.returns))
        rets = f"({rets})" if len(func.returns) != 1 or any(result_names) else rets
        return f"func.func @{print_symbol(func.name)}({args}) -> {rets} {{"

    plain_lines.append(signature([], []))
    debug_lines.append(signature(func.arg_names, func.result_names) if debug else "")
    for op in func.ops:
        n = next(counter) if op.results else None
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
        line = f'  {lhs}"{op.name}"({operands}){attrs} : ({in_types}) -> {out_types}'
        plain_lines.append(line)
        if debug:
            debug_lines.append(f"{line} {print_location(op.loc)}" if op.loc else line)
    ret_vals = ", ".join(names[v] for v in func.returns)
    ret_types = ", ".join(str(v.type) for v in func.returns)
    tail = [f"  func.return {ret_vals} : {ret_types}" if func.returns else "  func.return", "}"]
    return ("\n".join(plain_lines + tail) if plain else None,
            "\n".join(debug_lines + tail) if debug else None)


def _name_attr(names: list, i: int) -> str:
    name = names[i] if i < len(names) else None
    return f" {{{NAME_ATTR} = {print_string(name)}}}" if name else ""


NAME_ATTR = "jnova.name"  # the argument or result attribute holding its name
_LOCATION = re.compile(r"^(?P<file>.+?):(?P<line>\d+):(?P<col>\d+) \((?P<fn>.*)\)$")


@functools.lru_cache(maxsize=4096)  # ops of one line share it; escaping a path byte by byte is slow
def print_location(location: str) -> str:
    """An op's source location (`file.py:12:8 (fn)`, as JAX summarizes it) as an MLIR location: a name
    location (the function) around a file location; any other text as a name location of it."""
    m = _LOCATION.match(location)
    if m is None:
        return f"loc({print_string(location)})"
    return f'loc({print_string(m["fn"])}({print_string(m["file"])}:{m["line"]}:{m["col"]}))'


def _print_attrs(op: Op) -> str:
    if not op.attrs:
        return ""
    parts = []
    for key in sorted(op.attrs):
        kind = op.attributes.get(key)
        value = op.attrs[key]
        if kind is None:
            raise op.error(f"cannot print unknown attribute '{key}' (expected only {sorted(op.attributes)})")
        if kind is Dense:
            text = print_dense(value, op.results[0].type)
        else:
            text = kind.print(value)
        parts.append(f"{key} = {text}")
    return " {" + ", ".join(parts) + "}"


_BARE_ID = re.compile(r"[A-Za-z_][A-Za-z0-9_$.]*")


def print_symbol(name: str) -> str:
    """A symbol name as MLIR spells it: bare when it is an identifier, else a quoted string."""
    return name if _BARE_ID.fullmatch(name) else print_string(name)


def print_module(funcs: list[Func]) -> str:
    body = "\n".join(f.print() for f in funcs)
    return "module {\n" + body + "\n}\n"
