"""The compiled step as a JAX function: kernel binds and fallback ops in plan order."""
from __future__ import annotations

from typing import Callable

from jnova.dialect.ir import Value
from jnova.passes.form_kernels import Kernel, Plan
from jnova.primitives.nova_kernel import KernelHandle, nova_kernel_p


def step_function(plan: Plan, sites: list, handles: dict[str, KernelHandle], const_args: list) -> Callable:
    """A function of the step's flat arguments returning its flat outputs (to be jitted)."""
    func = plan.func

    def run(*flat_args):
        env: dict[Value, object] = dict(zip(func.args, list(flat_args) + list(const_args)))
        for step in plan.steps:
            if isinstance(step, Kernel):
                outs = nova_kernel_p.bind(*[env[v] for v in step.inputs], kernel=handles[step.name])
                env.update(zip(step.outputs, outs))
            else:  # a fallback op: the original JAX equation, bound as XLA would run it
                eqn = sites[step.attrs["site"]]
                outs = eqn.primitive.bind(*[env[v] for v in step.operands], **eqn.params)
                outs = outs if eqn.primitive.multiple_results else [outs]
                env.update(zip(step.results, outs))
        return [_materialize(env, v) for v in func.returns]

    return run


def _materialize(env, v: Value):
    if v in env:
        return env[v]
    raise KeyError(f"jnova internal error: returned value {v} was never computed")
