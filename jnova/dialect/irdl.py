"""The nova dialect registered with upstream MLIR through IRDL, and MLIR-side verification.

`nova_irdl()` writes an `irdl.dialect @nova` module from `OPS`: per op its operands and results
(`variadic` for a `*name`) and its attributes with the IRDL base of their AttrKind. Every operand and
result gets its own constraint value: in IRDL one constraint value is one type variable, so two
operands sharing it would be forced to have the same type.

What IRDL checks: op names, operand/result counts, that every value is a `tensor`, that each
declared attribute is present with the right base (`#builtin.dense_array`, `#builtin.string`, ...).
Shapes, dtypes and attribute values are checked by the Python verifiers (`Op.verify`).

Upstream limitation: IRDL binds a variadic list to ONE constraint value, hence one type for all its
values. That is right for `nova.select` cases and the start indices of the dynamic slices (JAX
requires one index type), but `nova.concatenate` of different-sized inputs and `nova.fallback`
with differently typed inputs or outputs are valid nova that MLIR rejects ("expected 'tensor<..>'
but got 'tensor<..>'"); `verify_with_mlir` says so in its error. (An `irdl.any_of` of several
`irdl.base` constraints, the obvious way around it, aborts the process in MLIR 22's IRDL loader.)
"""
from __future__ import annotations

import functools
import itertools
import re

from mlir import ir
from mlir.dialects import irdl as mlir_irdl

from jnova.dialect.ops import OPS
from jnova.dialect.parse import parse_module
from jnova.errors import ParseError, VerifyError

TENSOR_BASE = '"!builtin.tensor"'


def nova_irdl() -> str:
    """The IRDL text of the nova dialect, for the ops registered now (cached per op set)."""
    return _irdl_text(tuple(sorted(OPS)))


@functools.lru_cache(maxsize=4)
def _irdl_text(names: tuple[str, ...]) -> str:
    lines = ["irdl.dialect @nova {"]
    for name in names:
        lines += _irdl_operation(OPS[name])
    lines.append("}")
    return "\n".join(lines) + "\n"


def _irdl_operation(cls) -> list[str]:
    dialect, _, short = cls.name.partition(".")
    if dialect != "nova" or not short:
        raise ValueError(f"op {cls.name!r} is not in the nova dialect")
    body: list[str] = []
    counter = itertools.count()

    def constraint(base: str) -> str:
        value = f"%{next(counter)}"
        body.append(f"    {value} = irdl.base {base}")
        return value

    def values(spec) -> str:
        parts = []
        for n in spec:
            variadic = n.startswith("*")
            parts.append(f"{n.lstrip('*')}: {'variadic ' if variadic else ''}{constraint(TENSOR_BASE)}")
        return ", ".join(parts)

    operands = values(cls.operands_spec)
    results = values(cls.results_spec)
    attrs = []
    for key, kind in sorted(cls.attributes.items()):
        base = '"' + kind.irdl_base + '"'
        attrs.append(f'"{key}" = {constraint(base)}')
    body.append(f"    irdl.operands({operands})")
    body.append(f"    irdl.results({results})")
    if attrs:
        body.append(f"    irdl.attributes {{{', '.join(attrs)}}}")
    return [f"  irdl.operation @{short} {{", *body, "  }"]


def fresh_context() -> ir.Context:
    """A new MLIR context that loads dialects on demand (loading all of them up front costs ~20 ms)."""
    return ir.Context(load_on_create_dialects=["func"])


def load_nova(context: ir.Context) -> None:
    """Register the nova dialect (from `nova_irdl()`) in `context`; a no-op if it is there already."""
    if context.is_registered_operation(min(OPS)):
        return
    module = ir.Module.parse(nova_irdl(), context)
    mlir_irdl.load_dialects(module)


def verify_with_mlir(text: str) -> None:
    """Parse nova MLIR text in a fresh context with the dialect loaded; raise VerifyError if MLIR rejects it.

    The error carries MLIR's diagnostics and, where the Python side can name the problem (an attribute
    of the wrong kind, a shape), the nova verifier's message too.
    """
    context = fresh_context()
    load_nova(context)
    try:
        module = ir.Module.parse(text, context)
        module.operation.verify()
    except ir.MLIRError as e:
        raise VerifyError(_explain(text, e)) from None


def _explain(text: str, error: ir.MLIRError) -> str:
    lines = ["MLIR rejected the nova module:"]
    source = text.splitlines()
    for d in error.error_diagnostics:
        lines.append(f"  {_where(d.location, source)}{d.message}")
        lines += [f"    note: {n.message}" for n in d.notes]
        if _VARIADIC_TYPE_CLASH.search(d.message) and any(_is_heterogeneous_op(n.message) for n in d.notes):
            lines.append("    (IRDL gives all values of a variadic list one type: see jnova/dialect/irdl.py)")
    if not error.error_diagnostics:
        lines.append(f"  {error}")
    nova = _nova_diagnosis(text)
    if nova:
        lines.append(f"nova verifier: {nova}")
    return "\n".join(lines)


_VARIADIC_TYPE_CLASH = re.compile(r"^expected 'tensor<.*>' but got 'tensor<.*>'$")
_HETEROGENEOUS_VARIADIC_OPS = ("nova.concatenate", "nova.fallback")


def _is_heterogeneous_op(note: str) -> bool:
    return any(f'"{name}"' in note for name in _HETEROGENEOUS_VARIADIC_OPS)


def _where(location: ir.Location, source: list[str]) -> str:
    m = re.search(r":(\d+):(\d+)\)$", str(location))
    if not m:
        return ""
    line = int(m.group(1))
    snippet = source[line - 1].strip() if 0 < line <= len(source) else ""
    return f"line {line}: {snippet}\n    " if snippet else f"line {line}: "


def _nova_diagnosis(text: str) -> str | None:
    """The Python parser/verifier's view of text MLIR rejected (None if it accepts it or cannot parse it)."""
    try:
        parse_module(text)
    except (VerifyError, ParseError) as e:
        return str(e)
    return None
