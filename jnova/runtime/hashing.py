"""Structural hashes: of a captured step's jaxpr (the persistent cache's key) and of a nova function
(the in-memory cache's key). Topology, shapes, dtypes, parameters and options; never addresses.

`jaxpr_fingerprint` walks the jaxpr instead of printing it (printing GPT-2's takes several times
longer): values are numbered in program order, every equation contributes its primitive, sorted
parameters (nested jaxprs by their own fingerprint), operands and result types.

The printed nova function already numbers values in program order (normalized ids), sorts
attributes and spells every shape and dtype, so it is `structural_hash`'s main input. Fallback
equations add their primitive and parameters, with object addresses scrubbed.
"""
from __future__ import annotations

import functools
import hashlib
import pathlib
import re

import jax
import numpy as np
from jax.extend import core as jex_core

from jnova.version import __version__

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A digest of jnova's own sources: a fix to the compiler invalidates what it compiled before."""
    h = hashlib.sha256()
    root = pathlib.Path(__file__).resolve().parents[1]  # the jnova package
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def structural_hash(func_text: str, sites: list, options: dict, target: str = "cpu") -> str:
    h = hashlib.sha256()
    for part in (f"jnova {__version__} {code_digest()}", f"jax {jax.__version__}", f"target {target}",
                 "options " + repr(sorted(options.items())), func_text):
        h.update(part.encode())
        h.update(b"\0")
    for eqn in sites:
        h.update(eqn.primitive.name.encode())
        h.update(_ADDRESS.sub("", repr(sorted((k, str(v)) for k, v in eqn.params.items()))).encode())
    return h.hexdigest()


def jaxpr_fingerprint(jaxpr: jex_core.Jaxpr) -> str:
    """A digest of everything in `jaxpr` that the compiled step depends on, equal in every process
    for the same program: each equation's primitive, parameters (sorted by name; nested jaxprs by
    their fingerprint, the constants of a nested closed jaxpr by value since they are compiled in;
    other values as printed, object addresses scrubbed), operands (values by program-order number,
    literals by value and type), result types and effects; the jaxpr's argument, constant and result
    types. Source lines are not part of it. (The values of the top-level constants are not either:
    `pipeline.capture_key` adds the small ones, which are compiled in.)"""
    return _Fingerprint().jaxpr(jaxpr)


class _Fingerprint:
    """One walk over a jaxpr and the jaxprs in its parameters; each distinct nested jaxpr is walked
    once (GPT-2's layers call the same jitted functions)."""

    def __init__(self):
        self.jaxprs: dict[int, tuple[object, str]] = {}  # id -> (jaxpr, digest); holding it keeps the id its own
        self.types: dict[int, tuple[object, str]] = {}   # id -> (aval, text); avals are shared objects
        self.dtypes: dict[np.dtype, str] = {}

    def jaxpr(self, jaxpr) -> str:
        done = self.jaxprs.get(id(jaxpr))
        if done is not None:
            return done[1]
        numbers: dict = {}  # var -> its number in program order, as text
        for v in jaxpr.constvars + jaxpr.invars:
            numbers[v] = str(len(numbers))
        lines = ["consts " + " ".join(self.type(v.aval) for v in jaxpr.constvars),
                 "in " + " ".join(self.type(v.aval) for v in jaxpr.invars)]
        for eqn in jaxpr.eqns:
            operands = " ".join(self.operand(v, numbers) for v in eqn.invars)
            for v in eqn.outvars:
                numbers[v] = str(len(numbers))
            results = " ".join(("_" if isinstance(v, jex_core.DropVar) else "") + self.type(v.aval)
                               for v in eqn.outvars)
            params = " ".join(f"{k}={self.param(eqn.params[k])}" for k in sorted(eqn.params))
            lines.append(f"{eqn.primitive.name}[{params}]({operands}) -> {results}{_effects(eqn.effects)}")
        lines.append("out " + " ".join(self.operand(v, numbers) for v in jaxpr.outvars) + _effects(jaxpr.effects))
        digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
        self.jaxprs[id(jaxpr)] = (jaxpr, digest)
        return digest

    def closed(self, closed) -> str:
        """A closed jaxpr in a parameter: its jaxpr, and its constants' values (to_nova inlines them all)."""
        consts = " ".join(_values(np.asarray(c)) for c in closed.consts)
        return f"closed {self.jaxpr(closed.jaxpr)} consts {consts}"

    def type(self, aval) -> str:
        done = self.types.get(id(aval))
        if done is None:
            done = self.types[id(aval)] = (aval, _scrub(str(aval)))  # dtype, shape, ~ for a weak type
        return done[1]

    def operand(self, v, numbers: dict) -> str:
        if isinstance(v, jex_core.Literal):
            return f"{self.literal(v.val)}:{self.type(v.aval)}"
        return numbers[v]

    def literal(self, value) -> str:
        """A literal's value, exactly (JAX holds them as small NumPy arrays, scalars, or Python numbers)."""
        if isinstance(value, (np.ndarray, np.generic)) and value.nbytes <= 64:
            dtype = self.dtypes.get(value.dtype)
            if dtype is None:
                dtype = self.dtypes[value.dtype] = str(value.dtype)  # slow to spell, few kinds
            return f"{dtype}{value.shape}:{value.tobytes().hex()}"
        if isinstance(value, (bool, int, float, complex)):
            return f"{type(value).__name__}:{value!r}"  # a float's repr reads back exactly
        return _values(np.asarray(value))

    def param(self, value) -> str:
        if isinstance(value, jex_core.ClosedJaxpr):  # first: from JAX 0.11 every Jaxpr is one
            return self.closed(value)
        if isinstance(value, jex_core.Jaxpr):
            return "jaxpr " + self.jaxpr(value)
        if type(value) in (tuple, list) and not _printable(value):
            return "(" + ", ".join(self.param(x) for x in value) + ")"
        if isinstance(value, (set, frozenset)):
            return "{" + ", ".join(sorted(self.param(x) for x in value)) + "}"  # not in hash order
        if isinstance(value, np.ndarray):
            return _values(value)
        return _scrub(str(value))


_NOT_PRINTABLE = (jex_core.Jaxpr, jex_core.ClosedJaxpr, set, frozenset, np.ndarray)


def _printable(value) -> bool:
    """Whether `str(value)` spells all of it the same in every process (no jaxpr, set or array inside)."""
    if type(value) in (tuple, list):
        return all(_printable(x) for x in value)
    return not isinstance(value, _NOT_PRINTABLE)


def _values(a: np.ndarray) -> str:
    """dtype, shape and a digest of the values."""
    return f"{a.dtype}{a.shape}:{hashlib.sha256(a.tobytes()).hexdigest()}"


def _effects(effects) -> str:
    return " effects " + " ".join(sorted(_scrub(str(e)) for e in effects)) if effects else ""


def _scrub(text: str) -> str:
    return _ADDRESS.sub(" at 0x", text) if " at 0x" in text else text
