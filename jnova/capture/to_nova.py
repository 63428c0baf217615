"""jaxpr -> nova: one conversion rule per JAX primitive, all into a single `func.func`.

Call-like primitives (`jit`/`pjit`, `custom_jvp_call`, `custom_vjp_call`, `remat`, `closed_call`) are
inlined, and so is the branch a `cond` with a constant index takes. `lax.platform_dependent` (which
`jnp.diagonal` and its gradient use) is such a `cond`: its index, `platform_index`, is a constant for
the platform the step is compiled for (XLA makes that choice when it lowers the step: no control flow
runs).

A primitive without a rule (or whose rule raises `Unsupported`) becomes a `nova.fallback` op that runs
as an ordinary JAX op between compiled kernels (`fallback="xla"`, one warning per primitive), or raises
`UnsupportedPrimitiveError` naming it and the user's source line (`fallback="error"`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from jax.extend import core as jex_core

from jnova.capture.trace import Captured
from jnova.dialect.ir import Func, Op, Value
from jnova.dialect.ops import OPS, BroadcastOp, ConstantOp, FallbackOp
from jnova.dialect.types import HELD_DTYPES, TensorType, dtype_name
from jnova.errors import UnsupportedPrimitiveError
from jnova.runtime import user_code
from jnova.runtime.jax_internals import is_key, source_line

log = logging.getLogger("jnova.capture")

# constants up to this many elements are embedded in the IR; larger ones become function arguments
MAX_INLINE_CONSTANT = 256

CALL_PRIMITIVES = {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                   "remat", "remat2", "checkpoint", "custom_lin"}


# fallbacks a pass may still compile (passes/raise_attention.py: cuDNN's attention); it warns if it does not
RAISED_LATER = {"dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper"}


class Unsupported(Exception):
    """Raised by a rule for a form of its primitive that jnova does not compile."""


@dataclass
class Program:
    """The nova function of a step and what is needed to run it next to JAX.

    `sites[i]` is the jaxpr equation that `nova.fallback {site = i}` stands for. The function's
    arguments are the step's flat arguments followed by `const_args`: large captured constants, then
    the constants of element types no kernel computes with (`held_constants`, which only fallback ops
    read: a complex literal), in the order the conversion met them.
    """

    func: Func
    sites: list[jex_core.JaxprEqn]
    const_args: list[np.ndarray]
    num_user_args: int
    fallbacks: dict[str, str] = field(default_factory=dict)  # primitive -> reason
    site_paths: list[tuple[int, ...]] = field(default_factory=list)  # where each site is in the jaxpr
    held_constants: list[np.ndarray] = field(default_factory=list)    # the last of `const_args`


Rule = Callable[..., "Value | list[Value]"]
RULES: dict[str, Rule] = {}


def rule(*names: str):
    """Register a conversion rule `fn(b: Builder, eqn, *operands) -> Value | list[Value]`."""

    def wrap(fn):
        for n in names:
            RULES[n] = fn
        return fn

    return wrap


class Builder:
    """Appends nova ops to a function; what conversion rules use to emit IR."""

    def __init__(self, func: Func, matmul_precision: str | None = None):
        self.func = func
        self.first_const_arg = len(func.args)      # the arguments after the step's own are constants
        self.held_constants: list[np.ndarray] = []
        self.loc: str | None = None
        self.matmul_precision = matmul_precision  # the JAX context's, when the step was traced

    def op(self, op_name: str, operands, result_types, **attrs) -> Op:
        op = OPS[op_name](operands, result_types, attrs, loc=self.loc)
        self.func.add(op)
        return op

    def emit(self, op_name: str, operands, result_type: TensorType, **attrs) -> Value:
        return self.op(op_name, operands, [result_type], **attrs).result

    def constant(self, value, dtype: str, shape=()) -> Value:
        from jnova.dialect.types import numpy_dtype

        array = np.broadcast_to(np.asarray(value, dtype=numpy_dtype(dtype)), shape).copy()
        if dtype in HELD_DTYPES:        # no kernel computes it: the step passes it to the ops that read it
            return self.held_argument(array)
        return self.emit(ConstantOp.name, [], TensorType(tuple(shape), dtype), value=array)

    def held_argument(self, array: np.ndarray) -> Value:
        """A new last argument of the function, whose value is `array` (in `held_constants`)."""
        value = Value(TensorType(array.shape, dtype_name(array.dtype)), None, len(self.func.args))
        self.func.args.append(value)
        self.func.arg_names.append(f"const[{len(self.func.args) - self.first_const_arg - 1}]")
        self.held_constants.append(array)
        return value

    def broadcast_to(self, x: Value, shape) -> Value:
        """Implicit broadcasting of an elementwise operand: a scalar, or size-1 dims of equal rank."""
        shape = tuple(shape)
        if x.type.shape == shape:
            return x
        if x.type.rank == 0:
            dims = ()
        elif x.type.rank == len(shape) and all(a in (1, b) for a, b in zip(x.type.shape, shape)):
            dims = tuple(range(len(shape)))
        else:
            raise Unsupported(f"implicit broadcast of {x.type} to {shape}")
        return self.emit(BroadcastOp.name, [x], x.type.with_shape(shape), dims=dims)


def out_type(eqn, i: int = 0) -> TensorType:
    return TensorType.of(eqn.outvars[i].aval)


def to_nova(captured: Captured, *, fallback: str = "xla", name: str = "step",
            platforms: tuple[str, ...] = ("cpu", "cuda")) -> Program:
    """Convert a captured step into one nova function, for a step run on one of `platforms` (JAX's
    names: the compiled step's; a platform-dependent choice is made here only where they all agree)."""
    if fallback not in ("xla", "error"):
        raise ValueError(f"fallback must be 'xla' or 'error', got {fallback!r}")
    consts = [np.asarray(c) for c in captured.consts]
    big = large_constants(captured)
    arg_types = [TensorType.of(a) for a in captured.in_avals] + [TensorType.of(c) for c in big]
    func = Func(name, arg_types, arg_names=captured.in_names + [f"const[{i}]" for i in range(len(big))],
                result_names=captured.out_names)
    conv = _Converter(func, fallback, platforms)
    conv.b.matmul_precision = captured.matmul_precision
    conv.b.first_const_arg = len(captured.in_avals)
    env_consts, big_args = [], iter(func.args[len(captured.in_avals):])
    for c in consts:
        if c.size > MAX_INLINE_CONSTANT:
            env_consts.append(next(big_args))
        else:
            env_consts.append(conv.b.constant(c, dtype_name(c.dtype), c.shape))
    outs = conv.convert(captured.jaxpr, env_consts + func.args[: len(captured.in_avals)])
    func.returns = outs
    return Program(func, conv.sites, big + conv.b.held_constants, len(captured.in_avals), conv.fallbacks,
                   conv.site_paths, conv.b.held_constants)


def large_constants(captured: Captured) -> list[np.ndarray]:
    """The captured constants passed to the compiled step as arguments rather than embedded."""
    return [c for c in map(np.asarray, captured.consts) if c.size > MAX_INLINE_CONSTANT]


def find_site(jaxpr, path: tuple[int, ...]):
    """The equation at `path` (equation indices through inlined call primitives; through an inlined
    cond, its index and then the taken branch's) of `jaxpr`."""
    path = list(path)
    while len(path) > 1:
        eqn = jaxpr.eqns[path.pop(0)]
        jaxpr = eqn.params["branches"][path.pop(0)].jaxpr if eqn.primitive.name == "cond" else _inner_jaxpr(eqn)[0]
    return jaxpr.eqns[path[0]]


def platform_branch(branches_platforms, platforms: tuple[str, ...]) -> int | None:
    """The index of the branch `lax.platform_dependent` takes on every one of `platforms` (a branch
    naming the platform, else the default branch, whose entry is None), or None where they differ."""
    default = next((i for i, names in enumerate(branches_platforms) if names is None), None)
    taken = {next((i for i, names in enumerate(branches_platforms) if names and platform in names), default)
             for platform in platforms}
    return taken.pop() if len(taken) == 1 and None not in taken else None


class _Converter:
    def __init__(self, func: Func, fallback: str, platforms: tuple[str, ...]):
        self.b = Builder(func)
        self.fallback = fallback
        self.platforms = platforms
        self.sites: list = []
        self.site_paths: list[tuple[int, ...]] = []
        self.path: list[int] = []
        self.fallbacks: dict[str, str] = {}
        self.warned: set[str] = set()
        self.call_site: str | None = None  # user line of the inlined call being converted

    def convert(self, jaxpr, in_values: list[Value]) -> list[Value]:
        env: dict = dict(zip(jaxpr.constvars + jaxpr.invars, in_values))
        for i, eqn in enumerate(jaxpr.eqns):
            operands = [self.read(env, v) for v in eqn.invars]
            self.path.append(i)
            outs = self.convert_eqn(eqn, operands)
            self.path.pop()
            for var, val in zip(eqn.outvars, outs):
                if not isinstance(var, jex_core.DropVar):
                    env[var] = val
        return [self.read(env, v) for v in jaxpr.outvars]

    def read(self, env, var) -> Value:
        if isinstance(var, jex_core.Literal):
            return self.b.constant(var.val, dtype_name(var.aval.dtype), var.aval.shape)
        return env[var]

    def convert_eqn(self, eqn, operands: list[Value]) -> list[Value]:
        name = eqn.primitive.name
        # equations inside a jitted library function (jnp.sort, ...) have no user frame: use the call's
        self.b.loc = source_line(eqn) or self.call_site
        if name in CALL_PRIMITIVES:
            inner = _inner_jaxpr(eqn)
            if inner is not None:
                return self.inline(*inner, operands)
        if name == "platform_index":    # lax.platform_dependent's choice, for the compiled step's platform
            chosen = platform_branch(eqn.params["platforms"], self.platforms)
            if chosen is not None:
                return [self.b.constant(chosen, out_type(eqn).dtype)]
        if name == "cond" and isinstance(operands[0].owner, ConstantOp):  # (such as the platform's index)
            return self.inline_branch(eqn, operands)
        reason = f"no jnova rule for '{name}'"
        if name in ("shard_map", "xla_pmap"):  # a data-parallel program: its body is not compiled
            reason += "; compile the step inside it instead: jax.shard_map(jnova.compile(step), ...)"
        fn = RULES.get(name)
        if any(is_key(v.aval) for v in list(eqn.invars) + list(eqn.outvars)):
            fn, reason = None, "PRNG keys run as XLA ops"  # jnova holds keys as raw data only
        elif held := sorted(held_dtypes(eqn)):
            fn, reason = None, f"jnova holds {', '.join(held)} values but does not compute with them"
        if fn is not None:
            try:
                out = fn(self.b, eqn, *operands)
                return out if isinstance(out, list) else [out]
            except Unsupported as e:
                reason = f"'{name}': {e}"
        return self.emit_fallback(eqn, operands, reason)

    def inline(self, jaxpr, consts: list, operands: list[Value]) -> list[Value]:
        """The values of `jaxpr` (a called function's, or the branch taken) converted in place."""
        const_values = [self.b.constant(np.asarray(c), dtype_name(np.asarray(c).dtype), np.shape(c)) for c in consts]
        outer, self.call_site = self.call_site, self.b.loc
        try:
            return self.convert(jaxpr, const_values + operands)
        finally:
            self.call_site = outer

    def inline_branch(self, eqn, operands: list[Value]) -> list[Value]:
        """The values of the branch a `cond` whose index is a constant takes (clamped, as `lax.switch`
        clamps it); its path in the jaxpr names the branch."""
        branches = eqn.params["branches"]
        chosen = min(max(int(operands[0].owner.attrs["value"]), 0), len(branches) - 1)
        self.path.append(chosen)
        try:
            return self.inline(branches[chosen].jaxpr, list(branches[chosen].consts), operands[1:])
        finally:
            self.path.pop()

    def emit_fallback(self, eqn, operands, reason: str) -> list[Value]:
        name = eqn.primitive.name
        where = self.b.loc
        if self.fallback == "error":
            raise UnsupportedPrimitiveError(
                f"jnova cannot compile the JAX primitive '{name}' ({reason})"
                + (f", used at {where}" if where else "")
                + "; pass fallback='xla' to run it as an ordinary JAX op between jnova kernels")
        if name not in self.fallbacks:
            self.fallbacks[name] = reason
        if name not in self.warned and name not in RAISED_LATER:
            self.warned.add(name)
            user_code.warn(  # attributed to the line of the user's code that used the primitive
                f"jnova: the JAX primitive '{name}' is not compiled ({reason}); it runs as an XLA op"
                + (f" (first use at {where})" if where else ""), location=where)
        site = len(self.sites)
        self.sites.append(eqn)
        self.site_paths.append(tuple(self.path))
        types = [TensorType.of(v.aval) for v in eqn.outvars]
        return self.b.op(FallbackOp.name, operands, types, primitive=name, site=site).results


def held_dtypes(eqn) -> set[str]:
    """The element types of `eqn`'s operands and results that nova values hold but no nova op computes
    with (complex, fp8: dialect/types.py)."""
    dtypes = {dtype_name(v.aval.dtype) for v in list(eqn.invars) + list(eqn.outvars) if hasattr(v.aval, "dtype")}
    return dtypes & HELD_DTYPES


def _inner_jaxpr(eqn):
    """(jaxpr, consts) of a call-like equation, or None if it has none we can inline."""
    p = eqn.params
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = p.get(key)
        if inner is None:
            continue
        if isinstance(inner, jex_core.ClosedJaxpr):
            return inner.jaxpr, list(inner.consts)
        if isinstance(inner, jex_core.Jaxpr):
            return inner, []
    return None


# importing the rule modules registers their rules
from jnova.capture import rules_attention, rules_elementwise, rules_index, rules_reduce, rules_shape  # noqa: E402,F401
