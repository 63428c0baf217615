"""The compiled step as a JAX function: kernel binds and fallback ops in plan order.

It runs the JSON form of the plan (`passes.plan.plan_to_json`), so a step restored from the
persistent cache runs without any nova IR.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jnova.primitives.nova_kernel import KernelHandle, nova_kernel_p
from jnova.runtime.jax_internals import bind_equation, is_key, weakly_typed, wrap_key


def step_function(plan: dict, sites: list, handles: dict[str, KernelHandle], const_args: list,
                  in_avals=(), out_avals=()) -> Callable:
    """A function of the step's flat arguments returning its flat outputs (to be jitted).

    Typed PRNG keys live in nova as their raw uint32 data: arguments are unwrapped on entry,
    wrapped again for the fallback equations that take keys, and for the results that are keys.
    Results that jax.jit returns weakly typed (a learning rate computed from a Python float, a step
    count passed in as a Python int) are weakly typed again: nova types have no weak types.
    """
    key_args = [i for i, a in enumerate(in_avals) if is_key(a)]
    key_outs = {i: a.dtype for i, a in enumerate(out_avals) if is_key(a)}
    weak_outs = {i for i, a in enumerate(out_avals) if getattr(a, "weak_type", False) and not is_key(a)}

    def run(*flat_args):
        flat_args = list(flat_args)
        for i in key_args:
            flat_args[i] = jax.random.key_data(flat_args[i])
        env: dict[int, object] = dict(enumerate(flat_args + list(const_args)))
        for step in plan["steps"]:
            ins = [env[i] for i in step["in"]]
            if "view" in step:  # a reshape: XLA makes it a bitcast
                outs = [jax.lax.reshape(ins[0], tuple(step["out_types"][0][0]))]
            elif "bucket" in step:  # all-reduces of several values as one, over their concatenation
                outs = _all_reduce_bucket(sites[step["bucket"]], ins)
            elif "kernel" in step:
                handle = handles[step["kernel"]]
                with jax.named_scope(step["kernel"]):  # XLA's op_name of its ops: the memory report reads it
                    if isinstance(handle, KernelHandle):
                        outs = nova_kernel_p.bind(*ins, kernel=handle)
                    else:  # a group with no kernel builder on this backend: its ops as JAX ops
                        outs = handle(*ins)
            else:  # a fallback op: the original JAX equation, bound as XLA would run it
                outs = _bind(sites[step["site"]], ins)
            env.update(zip(step["out"], outs))
        outs = [env[i] for i in plan["returns"]]
        outs = [weakly_typed(x) if i in weak_outs and not x.aval.weak_type else x for i, x in enumerate(outs)]
        return [wrap_key(x, key_outs[i]) if i in key_outs else x for i, x in enumerate(outs)]

    return run


def _all_reduce_bucket(eqn, ins: list) -> list:
    """The all-reduce `eqn` of each of `ins`, done once over their flat concatenation."""
    if len(ins) == 1:
        return _bind(eqn, ins)
    (total,) = _bind(eqn, [jnp.concatenate([jnp.ravel(x) for x in ins])])
    outs, start = [], 0
    for x in ins:
        outs.append(total[start:start + x.size].reshape(x.shape))
        start += x.size
    return outs


def _bind(eqn, ins: list) -> list:
    ins = [wrap_key(x, v.aval.dtype) if is_key(v.aval) else x for x, v in zip(ins, eqn.invars)]
    outs = bind_equation(eqn, ins)
    outs = outs if eqn.primitive.multiple_results else [outs]
    return [jax.random.key_data(x) if is_key(v.aval) else x for x, v in zip(outs, eqn.outvars)]
