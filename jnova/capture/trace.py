"""Capture: the jaxpr of a training step, with its pytree structure.

Anything `jax.make_jaxpr` accepts is captured: plain functions, `jax.jit`-wrapped ones,
`jax.value_and_grad`, whole steps with an optax update. The backward pass JAX's AD produced is
already in the graph, so forward, backward and optimizer update arrive as one jaxpr.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

import jax
from jax.extend import core as jex_core

from jnova.capture.precision import context_precision
from jnova.runtime.jax_internals import explicit_sharding, is_key, varying_axes


@dataclass
class Captured:
    """A traced step: flat jaxpr (closed over `consts`) plus the pytree structure of its I/O."""

    jaxpr: jex_core.Jaxpr
    consts: list[Any]
    in_tree: Any
    out_tree: Any
    in_avals: list[Any]
    out_avals: list[Any]
    in_names: list[str] = field(default_factory=list)   # each flat input's path: params['h_0']['w']
    out_names: list[str] = field(default_factory=list)  # each flat result's: result[0]['h_0']['w']
    matmul_precision: str | None = None  # jax_default_matmul_precision when traced (capture/precision.py)

    @cached_property
    def jaxpr_text(self) -> str:
        """The jaxpr printed: the "jaxpr" stage and its dump, printed when asked for (a large step's
        jaxpr takes longer to print than a warm compile spends on everything after the trace)."""
        return str(self.jaxpr)


def trace(fn: Callable, args: tuple, kwargs: dict, static_argnums: tuple[int, ...] = (),
          static_argnames: tuple[str, ...] = ()) -> Captured:
    """Trace `fn(*args, **kwargs)` at the abstract values of its array arguments; the arguments at
    `static_argnums` (non-negative) and the keyword arguments in `static_argnames` are passed as they
    are (jax.jit's static arguments). The step's flat inputs are the leaves of (dynamic positional
    arguments, dynamic keyword arguments), as `jax.tree_util.tree_flatten` orders them.

    `fn` itself is traced (not a wrapper of it), so JAX's tracing errors name the user's function
    and the path of the argument (`params['w']`), as under jax.jit."""
    traced_args, traced_kwargs = abstract_arguments(fn, args, kwargs, static_argnums, static_argnames)
    static_kwargs = {k: v for k, v in kwargs.items() if k in static_argnames}
    dynamic_args = tuple(a for i, a in enumerate(traced_args) if i not in static_argnums)
    target = functools.partial(fn, **static_kwargs) if static_kwargs else fn  # jax unwraps partials
    closed, out_shape = jax.make_jaxpr(target, static_argnums=tuple(static_argnums), return_shape=True)(
        *traced_args, **traced_kwargs)
    flat_avals, in_tree = jax.tree_util.tree_flatten((dynamic_args, traced_kwargs))
    out_tree = jax.tree_util.tree_structure(out_shape)
    names = argument_names(fn, len(args))
    dynamic_names = [names[i] for i in range(len(args)) if i not in static_argnums]
    in_names = []
    for path, _ in jax.tree_util.tree_flatten_with_path((dynamic_args, traced_kwargs))[0]:
        top = dynamic_names[path[1].idx] if path[0].idx == 0 else path[1].key  # a position, or a keyword
        in_names.append(top + jax.tree_util.keystr(path[2:]))
    return Captured(closed.jaxpr, list(closed.consts), in_tree, out_tree, flat_avals, list(closed.out_avals),
                    in_names, leaf_paths(out_shape, "result"), context_precision())


def abstract_arguments(fn: Callable, args: tuple, kwargs: dict, static_argnums=(), static_argnames=()):
    """(positional, keyword) arguments with every dynamic leaf replaced by its abstract value (static
    ones as they are, keyword ones left out); a leaf that is not an array is a TypeError naming `fn`
    and the argument's path, as jax.jit's."""
    names = argument_names(fn, len(args))
    traced_args = [a if i in static_argnums else _abstract_tree(fn, a, names[i]) for i, a in enumerate(args)]
    traced_kwargs = {k: _abstract_tree(fn, v, k) for k, v in kwargs.items() if k not in static_argnames}
    return traced_args, traced_kwargs


def argument_names(fn: Callable, count: int) -> list[str]:
    """How jax.jit names `fn`'s first `count` positional arguments: by the parameter names of its
    signature (`params`, and `args[2]` for what `*args` takes), `args[i]` where there is none."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins have no signature
        params = []
    names = []
    for i in range(count):
        if i < len(params) and params[i].kind in (params[i].POSITIONAL_ONLY, params[i].POSITIONAL_OR_KEYWORD):
            names.append(params[i].name)
        else:
            names.append(f"args[{i}]")
    return names


def function_name(fn: Callable) -> str:
    """`fn`'s name as jax.jit's errors give it (through partials and wrappers)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = inspect.unwrap(fn) if callable(fn) else fn
    return getattr(fn, "__name__", None) or type(fn).__name__


def dynamic_signature(fn: Callable, static_argnums=(), static_argnames=()) -> tuple | None:
    """(name, signature without the static parameters) of `fn`, for naming the arguments of the step
    jax compiles around its dynamic ones; None where `fn` has no signature to read."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    kept = [p for i, p in enumerate(signature.parameters.values())
            if not (p.kind in positional and i in static_argnums) and p.name not in static_argnames]
    return function_name(fn), signature.replace(parameters=kept)


def leaf_paths(tree, root: str) -> list[str]:
    """The path of every leaf of `tree` below `root`, as jax spells it: `params['h_0']['w']`."""
    return [root + jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _abstract_tree(fn: Callable, tree, root: str):
    """`tree` with each leaf replaced by its abstract value; a leaf that is not an array is a TypeError
    naming its path."""
    def leaf(path, x):
        try:
            return abstract(x)
        except TypeError:
            where = root + jax.tree_util.keystr(path)
            raise TypeError(
                f"jnova.compile: argument {where} of {function_name(fn)} is of type {type(x).__name__}, "
                "not an array; pass arrays, "
                "Python scalars or pytrees of them, or mark the argument static (static_argnums / "
                "static_argnames, as in jax.jit)") from None
        except OverflowError as e:  # a Python int beyond int32 (int64 with x64)
            where = root + jax.tree_util.keystr(path)
            raise OverflowError(f"jnova.compile: an overflow was encountered while parsing argument {where} of "
                                f"{function_name(fn)} (a {type(x).__name__} of value {x!r}): {e}") from None

    return jax.tree_util.tree_map_with_path(leaf, tree)


def abstract(x) -> jax.ShapeDtypeStruct:
    """The shape and dtype of an argument (an array, a scalar, or a ShapeDtypeStruct), with the dtype
    jax.jit gives it: without jax_enable_x64 a float64 / int64 NumPy array is passed as float32 / int32,
    so it is traced and compiled as one."""
    if isinstance(x, jax.core.Tracer) and varying_axes(jax.typeof(x)):  # inside shard_map: its aval as is,
        return jax.typeof(x)                                              # with the mesh axes it varies over
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        dtype = x.dtype if is_key(x.dtype) else jax.dtypes.canonicalize_dtype(x.dtype)  # keys stay keys
        if isinstance(x, jax.ShapeDtypeStruct) and dtype == x.dtype:
            return x
        return jax.ShapeDtypeStruct(x.shape, dtype, weak_type=bool(getattr(x, "weak_type", False)),
                                    sharding=explicit_sharding(x))
    try:
        aval = jax.typeof(x)   # jax.core.get_aval was removed in JAX 0.10
    except TypeError:
        raise TypeError(f"{type(x).__name__} is not an array") from None
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))
