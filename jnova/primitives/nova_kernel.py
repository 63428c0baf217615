"""`nova_kernel_p`: one bind per generated kernel, re-entering JAX as an ordinary primitive.

Its rules sit together: abstract evaluation from the kernel's nova result types, the CPU lowering
(a host call into the JIT-compiled kernel), and an actionable error for every transformation a
compiled kernel does not support.
"""
from __future__ import annotations

import logging
from functools import partial

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from jnova.dialect.types import TensorType, numpy_dtype
from jnova.runtime.jax_internals import lowering_on_one_device, replicated, varying_axes

log = logging.getLogger("jnova")

nova_kernel_p = jex_core.Primitive("nova_kernel")
nova_kernel_p.multiple_results = True


class KernelHandle:
    """What a bind of `nova_kernel_p` carries: the kernel's name, result types and how to run it.

    Hashed by identity (JAX caches lowerings by params); `run_host` runs it on NumPy arrays.
    """

    def __init__(self, name: str, out_types: list[TensorType], backend: str, run_host=None, out_deps=None,
                 aliases: tuple[tuple[int, int], ...] = ()):
        self.name = name
        # (operand index, result index) pairs sharing a buffer (XLA's input_output_aliases)
        self.aliases = tuple(aliases)
        self.out_types = list(out_types)
        self.backend = backend
        self.run_host = run_host
        # for each result, the operands it is computed from (plan_to_json's "deps"); None: all of them
        self.out_deps = None if out_deps is None else tuple(tuple(d) for d in out_deps)

    def __repr__(self):
        return f"KernelHandle({self.name}, {self.backend})"


def _abstract_eval(*avals, kernel: KernelHandle):
    if not any(varying_axes(a) for a in avals):  # outside shard_map: the first operand's, updated
        return [_result_aval(kernel, list(avals[:1]), t) for t in kernel.out_types]
    deps = kernel.out_deps or [range(len(avals))] * len(kernel.out_types)
    return [_result_aval(kernel, [avals[j] for j in d], t) for d, t in zip(deps, kernel.out_types)]


def _result_aval(kernel: KernelHandle, sources: list, t: TensorType):
    """A result's aval, as a JAX op would give it: its operands' (`sources`) updated to its type, which
    keeps their sharding and the manual mesh axes they vary over inside shard_map; a result computed
    from constants only is a plain, invariant array. Where the result's shape is not its operand's, an
    Explicit-axes sharding (part of the type under `jax.make_mesh`) becomes replicated over the mesh:
    a jnova kernel is not partitioned by XLA, which replicates its operands for it."""
    if not sources:
        return jax.core.ShapedArray(t.shape, numpy_dtype(t.dtype))
    widest = max(sources, key=lambda a: len(varying_axes(a)))
    if any(not varying_axes(a) <= varying_axes(widest) for a in sources):
        raise TypeError(f"jnova kernel {kernel.name} combines values that vary over different mesh axes "
                        f"({sorted(map(sorted, {varying_axes(a) for a in sources}))}); JAX's own ops would "
                        "have made them agree (jax.lax.pvary) before combining them")
    if tuple(t.shape) != tuple(widest.shape):  # the operand's sharding spec is for its own shape
        return widest.update(shape=t.shape, dtype=numpy_dtype(t.dtype), weak_type=False,
                             sharding=replicated(widest.sharding))
    return widest.update(shape=t.shape, dtype=numpy_dtype(t.dtype), weak_type=False)


def _impl(*args, kernel: KernelHandle):
    return jax.jit(partial(nova_kernel_p.bind, kernel=kernel))(*args)


def _cpu_lowering(ctx, *args, kernel: KernelHandle):
    if kernel.backend != "cpu":
        raise NotImplementedError(f"jnova kernel {kernel.name} was compiled for {kernel.backend}, not for the CPU")
    shapes = [jax.ShapeDtypeStruct(t.shape, numpy_dtype(t.dtype)) for t in kernel.out_types]

    def call(*xs):
        return jax.pure_callback(kernel.run_host, shapes, *xs, vmap_method="sequential")

    outs = mlir.lower_fun(call, multiple_results=True)(ctx, *args)
    if kernel.aliases and lowering_on_one_device(ctx):  # partitioned, XLA wraps the host call's operands
        _alias_callback_results(kernel, outs, args)
    return outs


def _alias_callback_results(kernel: KernelHandle, outs, args) -> None:
    """Mark the host call's results as written into the operands' buffers (`kernel.aliases`), as the GPU's
    custom call does: the host kernel computes every result before XLA copies them into their buffers,
    so a result may take an operand's. Left as is (a warning) where the call is not one custom call of
    exactly the kernel's operands."""
    ir = mlir.ir
    values = [v for out in outs for v in (out if isinstance(out, (list, tuple)) else [out])]
    op = values[0].owner if values else None
    op = getattr(op, "operation", op)
    if op is None or op.name != "stablehlo.custom_call" or len(op.operands) != len(args) \
            or len(op.results) != len(values):
        log.warning("jnova: kernel %s's host call is not one custom call of its operands; its results "
                    "take no operand's buffer", kernel.name)
        return
    single = len(op.results) == 1
    attrs = [ir.Attribute.parse(f"#stablehlo.output_operand_alias<output_tuple_indices = {[] if single else [b]}, "
                                f"operand_index = {a}, operand_tuple_indices = []>") for a, b in kernel.aliases]
    op.attributes["output_operand_aliases"] = ir.ArrayAttr.get(attrs)


def _cuda_lowering(ctx, *args, kernel: KernelHandle):
    from jnova.primitives.gpu_lowering import lower_gpu_kernel  # it imports this module

    return lower_gpu_kernel(ctx, *args, kernel=kernel)  # refuses kernels compiled for the CPU


def _no_jvp(primals, tangents, *, kernel):
    raise TypeError("cannot differentiate a jnova-compiled kernel; apply jax.grad / jax.value_and_grad "
                    "before jnova.compile (jnova compiles the backward pass JAX produces)")


def _no_batch(args, dims, *, kernel):
    raise TypeError("cannot vmap a jnova-compiled kernel; apply jax.vmap before jnova.compile")


nova_kernel_p.def_abstract_eval(_abstract_eval)
nova_kernel_p.def_impl(_impl)
mlir.register_lowering(nova_kernel_p, _cpu_lowering, platform="cpu")
mlir.register_lowering(nova_kernel_p, _cuda_lowering, platform="cuda")
ad.primitive_jvps[nova_kernel_p] = _no_jvp
batching.primitive_batchers[nova_kernel_p] = _no_batch
