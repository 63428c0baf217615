"""Capture: the jaxpr of a training step, with its pytree structure.

Anything `jax.make_jaxpr` accepts is captured: plain functions, `jax.jit`-wrapped ones,
`jax.value_and_grad`, whole steps with an optax update. The backward pass JAX's AD produced is
already in the graph, so forward, backward and optimizer update arrive as one jaxpr.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import jax
from jax.extend import core as jex_core

from jnova.runtime.jax_internals import is_key, varying_axes


@dataclass
class Captured:
    """A traced step: flat jaxpr (closed over `consts`) plus the pytree structure of its I/O."""

    jaxpr: jex_core.Jaxpr
    consts: list[Any]
    in_tree: Any
    out_tree: Any
    in_avals: list[Any]
    out_avals: list[Any]

    @cached_property
    def jaxpr_text(self) -> str:
        """The jaxpr printed: the "jaxpr" stage and its dump, printed when asked for (a large step's
        jaxpr takes longer to print than a warm compile spends on everything after the trace)."""
        return str(self.jaxpr)


def trace(fn: Callable, args: tuple, kwargs: dict) -> Captured:
    """Trace `fn(*args, **kwargs)` at the abstract values of its (flattened) arguments."""
    flat_args, in_tree = jax.tree_util.tree_flatten((args, kwargs))
    out_tree_box = []

    def flat_fn(*flat):
        call_args, call_kwargs = jax.tree_util.tree_unflatten(in_tree, flat)
        out = fn(*call_args, **call_kwargs)
        flat_out, out_tree = jax.tree_util.tree_flatten(out)
        out_tree_box.append(out_tree)
        return flat_out

    avals = [abstract(a) for a in flat_args]
    closed = jax.make_jaxpr(flat_fn)(*avals)
    return Captured(closed.jaxpr, list(closed.consts), in_tree, out_tree_box[0], avals, list(closed.out_avals))


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
        return jax.ShapeDtypeStruct(x.shape, dtype, weak_type=bool(getattr(x, "weak_type", False)))
    try:
        aval = jax.typeof(x)   # jax.core.get_aval was removed in JAX 0.10
    except TypeError:
        raise TypeError(
            f"jnova.compile: argument of type {type(x).__name__} is not an array; pass arrays, "
            "Python scalars or pytrees of them (mark other arguments static)") from None
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))
