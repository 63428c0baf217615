"""The compiled step as a JAX function: kernel binds and fallback ops in plan order.

It runs the JSON form of the plan (`passes.form_kernels.plan_to_json`), so a step restored from the
persistent cache runs without any nova IR.
"""
from __future__ import annotations

from typing import Callable

from jnova.primitives.nova_kernel import KernelHandle, nova_kernel_p


def step_function(plan: dict, sites: list, handles: dict[str, KernelHandle], const_args: list) -> Callable:
    """A function of the step's flat arguments returning its flat outputs (to be jitted)."""

    def run(*flat_args):
        env: dict[int, object] = dict(enumerate(list(flat_args) + list(const_args)))
        for step in plan["steps"]:
            ins = [env[i] for i in step["in"]]
            if "kernel" in step:
                handle = handles[step["kernel"]]
                if isinstance(handle, KernelHandle):
                    outs = nova_kernel_p.bind(*ins, kernel=handle)
                else:  # a group with no kernel builder on this backend: its ops as JAX ops
                    outs = handle(*ins)
            else:  # a fallback op: the original JAX equation, bound as XLA would run it
                eqn = sites[step["site"]]
                outs = eqn.primitive.bind(*ins, **eqn.params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            env.update(zip(step["out"], outs))
        return [env[i] for i in plan["returns"]]

    return run
