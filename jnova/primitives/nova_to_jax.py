"""nova ops as JAX ops: runs a group of nova ops with `jax.lax`.

Used for the kernels a backend has no builder for yet (they run as XLA ops, recorded in the
step's stats as `xla_groups`), and in tests as an oracle for the capture rules that does not go
through any jnova code generation.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jnova.dialect.ir import Op, Value
from jnova.dialect.ops_training import TRAINING_OPS
from jnova.dialect.types import numpy_dtype

UNARY = {
    "exp": lax.exp, "exp2": lax.exp2, "expm1": lax.expm1, "log": lax.log, "log1p": lax.log1p,
    "tanh": lax.tanh, "logistic": lax.logistic, "erf": lax.erf, "erfc": lax.erfc, "erf_inv": lax.erf_inv,
    "sqrt": lax.sqrt, "rsqrt": lax.rsqrt, "cbrt": lax.cbrt, "sin": lax.sin, "cos": lax.cos, "tan": lax.tan,
    "asin": lax.asin, "acos": lax.acos, "atan": lax.atan, "sinh": lax.sinh, "cosh": lax.cosh,
    "asinh": lax.asinh, "acosh": lax.acosh, "atanh": lax.atanh, "floor": lax.floor, "ceil": lax.ceil,
    "neg": lax.neg, "abs": lax.abs, "sign": lax.sign, "square": lax.square, "not": lax.bitwise_not,
    "population_count": lax.population_count, "clz": lax.clz, "is_finite": lax.is_finite,
}
BINARY = {
    "add": lax.add, "sub": lax.sub, "mul": lax.mul, "div": lax.div, "rem": lax.rem, "max": lax.max,
    "min": lax.min, "pow": lax.pow, "and": lax.bitwise_and, "or": lax.bitwise_or, "xor": lax.bitwise_xor,
    "shift_left": lax.shift_left, "shift_right_logical": lax.shift_right_logical,
    "shift_right_arithmetic": lax.shift_right_arithmetic, "atan2": lax.atan2, "nextafter": lax.nextafter,
}
COMPARE = {"eq": lax.eq, "ne": lax.ne, "lt": lax.lt, "le": lax.le, "gt": lax.gt, "ge": lax.ge}
REDUCE = {"sum": lax.reduce_sum_p, "prod": lax.reduce_prod_p, "max": lax.reduce_max_p, "min": lax.reduce_min_p,
          "and": lax.reduce_and_p, "or": lax.reduce_or_p, "xor": lax.reduce_xor_p}
MODES = {"clip": lax.GatherScatterMode.CLIP, "fill": lax.GatherScatterMode.FILL_OR_DROP,
         "promise_in_bounds": lax.GatherScatterMode.PROMISE_IN_BOUNDS}
SCATTER = {"add": lax.scatter_add, "set": lax.scatter, "mul": lax.scatter_mul, "min": lax.scatter_min,
           "max": lax.scatter_max}


def evaluate_op(op: Op, *xs):
    """The results of one nova op applied to JAX values `xs` (a list)."""
    short, a = op.name.removeprefix("nova."), op.attrs
    out = op.results[0].type if op.results else None
    if short in UNARY:
        return [UNARY[short](xs[0])]
    if short in BINARY:
        return [BINARY[short](*xs)]
    rule = _RULES.get(short)
    if rule is None:
        raise NotImplementedError(f"no JAX evaluation for '{op.name}'")
    result = rule(op, a, out, *xs)
    return result if isinstance(result, list) else [result]


def evaluate_ops(ops: list[Op], inputs: list[Value], outputs: list[Value]) -> Callable:
    """A JAX function of `inputs` computing `outputs` by running `ops` in order."""

    def run(*xs):
        env = dict(zip(inputs, xs))
        for op in ops:
            env.update(zip(op.results, evaluate_op(op, *[env[v] for v in op.operands])))
        return [env[v] for v in outputs]

    return run


def _dt(t):
    return numpy_dtype(t.dtype)


def _select(op, a, out, which, *cases):
    if which.shape != tuple(out.shape):
        which = jnp.broadcast_to(which, out.shape)
    return lax.select_n(which, *cases)


def _round(op, a, out, x):
    method = lax.RoundingMethod.TO_NEAREST_EVEN if a["method"] == "to_nearest_even" else lax.RoundingMethod.AWAY_FROM_ZERO
    return lax.round(x, method)


def _gather(op, a, out, x, idx):
    dn = lax.GatherDimensionNumbers(a["offset_dims"], a["collapsed_slice_dims"], a["start_index_map"],
                                    a["operand_batching_dims"], a["start_indices_batching_dims"])
    fill = a["fill"] if a["mode"] == "fill" else None
    return lax.gather(x, idx, dn, a["slice_sizes"], mode=MODES[a["mode"]], fill_value=fill)


def _scatter(op, a, out, x, idx, upd):
    dn = lax.ScatterDimensionNumbers(a["update_window_dims"], a["inserted_window_dims"],
                                     a["scatter_dims_to_operand_dims"], a["operand_batching_dims"],
                                     a["scatter_indices_batching_dims"])
    return SCATTER[a["kind"]](x, idx, upd, dn, mode=MODES[a["mode"]])


def _attention(op, a, out, *xs):
    """An attention op as the JAX ops of its generic decomposition (what a backend that refuses it runs)."""
    from jnova.passes.expand_attention import attention_decomposition

    ops, results = attention_decomposition(op)
    return evaluate_ops(ops, op.operands, results)(*xs)


def _attention_half(op, a, out, *xs):
    """nova.attention_dq (dq, delta) or nova.attention_dkdv (dk, dv): their results of the whole
    backward's decomposition, which recomputes the softmax from q and k (not from lse and delta)."""
    from jnova.passes.expand_attention import attention_decomposition

    ops, results = attention_decomposition(op)
    dq, dk, dv = evaluate_ops(ops, op.operands, results)(*xs)
    if op.name == "nova.attention_dkdv":
        return [dk, dv]
    o, do = (x.astype(jnp.float32) for x in (xs[3], xs[5]))
    delta = jnp.sum(o * do, axis=-1)  # rowsum(do * o) over D: [B, T, H] or [B, H, T]
    return [dq, jnp.swapaxes(delta, 1, 2) if a["layout"] == "bthd" else delta]


def _training(op, a, out, *xs):
    """A training op (nova.sce, nova.layernorm, ...) as the JAX ops of its generic decomposition."""
    from jnova.passes.expand_training import training_decomposition

    ops, results = training_decomposition(op)
    return evaluate_ops(ops, op.operands, results)(*xs)


def _argreduce(op, a, out, x):
    fn = lax.argmax if a["kind"] == "max" else lax.argmin
    return fn(x, a["axis"], _dt(out))


_RULES = {
    "compare": lambda op, a, out, x, y: COMPARE[a["predicate"]](x, y),
    "select": _select,
    "convert": lambda op, a, out, x: lax.convert_element_type(x, _dt(out)),
    "bitcast": lambda op, a, out, x: lax.bitcast_convert_type(x, _dt(out)),
    "round": _round,
    "ipow": lambda op, a, out, x: lax.integer_pow(x, a["exponent"]),
    "reduce_precision": lambda op, a, out, x: lax.reduce_precision(x, a["exponent_bits"], a["mantissa_bits"]),
    "broadcast": lambda op, a, out, x: lax.broadcast_in_dim(x, out.shape, a["dims"]),
    "reshape": lambda op, a, out, x: lax.reshape(x, out.shape),
    "transpose": lambda op, a, out, x: lax.transpose(x, a["perm"]),
    "slice": lambda op, a, out, x: lax.slice(x, a["start"], a["limit"], a["strides"]),
    # the nova ops clamp their starts, as the primitives do; lax's functions would first wrap a negative
    # start around its dimension (jnp's indexing convention, already applied where the step was traced)
    "dynamic_slice": lambda op, a, out, x, *s: lax.dynamic_slice(x, s, a["sizes"], allow_negative_indices=False),
    "dynamic_update_slice": lambda op, a, out, x, u, *s: lax.dynamic_update_slice(x, u, s,
                                                                                  allow_negative_indices=False),
    "concatenate": lambda op, a, out, *xs: lax.concatenate(xs, a["dim"]),
    "pad": lambda op, a, out, x, v: lax.pad(x, v, list(zip(a["low"], a["high"], a["interior"]))),
    "iota": lambda op, a, out: lax.broadcasted_iota(_dt(out), out.shape, a["dim"]),
    "reverse": lambda op, a, out, x: lax.rev(x, a["dims"]),
    "constant": lambda op, a, out: jnp.asarray(np.asarray(a["value"], dtype=_dt(out))),
    "reduce": lambda op, a, out, x: REDUCE[a["kind"]].bind(x, axes=tuple(a["dims"]), **(
        {"out_sharding": None} if a["kind"] == "sum" and "out_sharding" in _reduce_sum_params() else {})),
    "argreduce": _argreduce,
    "matmul": lambda op, a, out, x, y: lax.dot_general(
        x, y, ((a["lhs_contract"], a["rhs_contract"]), (a["lhs_batch"], a["rhs_batch"])),
        precision=lax.Precision.HIGHEST if a["precision"] == "highest" else lax.Precision.DEFAULT,
        preferred_element_type=_dt(out)),
    "gather": _gather,
    "scatter": _scatter,
    "attention": _attention,
    "attention_backward": _attention,
    "attention_dq": _attention_half,
    "attention_dkdv": _attention_half,
    **{name[len("nova."):]: _training for name in TRAINING_OPS},
}


@functools.lru_cache(maxsize=None)
def _reduce_sum_params():
    """reduce_sum gained an `out_sharding` parameter in newer JAX; bind with what this one has."""
    jaxpr = jax.make_jaxpr(lambda x: x.sum())(np.zeros(2, np.float32))
    return set(jaxpr.eqns[0].params)
