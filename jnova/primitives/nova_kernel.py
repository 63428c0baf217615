"""`nova_kernel_p`: one bind per generated kernel, re-entering JAX as an ordinary primitive.

Its rules sit together: abstract evaluation from the kernel's nova result types, the CPU lowering
(a host call into the JIT-compiled kernel), and an actionable error for every transformation a
compiled kernel does not support.
"""
from __future__ import annotations

from functools import partial

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from jnova.dialect.types import TensorType, numpy_dtype

nova_kernel_p = jex_core.Primitive("nova_kernel")
nova_kernel_p.multiple_results = True


class KernelHandle:
    """What a bind of `nova_kernel_p` carries: the kernel's name, result types and how to run it.

    Hashed by identity (JAX caches lowerings by params); `run_host` runs it on NumPy arrays.
    """

    def __init__(self, name: str, out_types: list[TensorType], backend: str, run_host=None):
        self.name = name
        self.out_types = list(out_types)
        self.backend = backend
        self.run_host = run_host

    def __repr__(self):
        return f"KernelHandle({self.name}, {self.backend})"


def _abstract_eval(*avals, kernel: KernelHandle):
    if avals:  # aval.update keeps what the inputs carry (sharding, varying manual axes)
        return [avals[0].update(shape=t.shape, dtype=numpy_dtype(t.dtype), weak_type=False) for t in kernel.out_types]
    return [jax.core.ShapedArray(t.shape, numpy_dtype(t.dtype)) for t in kernel.out_types]


def _impl(*args, kernel: KernelHandle):
    return jax.jit(partial(nova_kernel_p.bind, kernel=kernel))(*args)


def _cpu_lowering(ctx, *args, kernel: KernelHandle):
    if kernel.backend != "cpu":
        raise NotImplementedError(f"jnova kernel {kernel.name} was compiled for {kernel.backend}, not for the CPU")
    shapes = [jax.ShapeDtypeStruct(t.shape, numpy_dtype(t.dtype)) for t in kernel.out_types]

    def call(*xs):
        return jax.pure_callback(kernel.run_host, shapes, *xs, vmap_method="sequential")

    return mlir.lower_fun(call, multiple_results=True)(ctx, *args)


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
