"""On a machine with a GPU: the CUDA lowering registered, the target of the GPU tests, and kernels run
through `nova_kernel_p` with poisoned output buffers. Importing it skips the importing test module
where JAX sees no GPU."""
import os

import jax
import jax.numpy as jnp
import pytest


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


if not _has_gpu():
    pytest.skip("no GPU visible to JAX", allow_module_level=True)

from jnova.primitives.gpu_lowering import GpuKernelHandle, register_gpu_lowering  # noqa: E402
from jnova.primitives.nova_kernel import nova_kernel_p  # noqa: E402
from jnova.runtime.target import get_target  # noqa: E402

register_gpu_lowering()
TARGET = get_target(os.environ.get("JNOVA_TEST_TARGET", "h200"))
f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32


def poisoned_like(want):
    if want.dtype == jnp.bool_:
        return ~want
    if jnp.issubdtype(want.dtype, jnp.integer):
        return want + 1
    return jnp.where(jnp.isnan(want.astype(f32)), 0, jnp.nan).astype(want.dtype)


def run_kernel(launch, kernel, inputs, poison=None):
    """The kernel's outputs via nova_kernel_p under jax.jit; `poison` arrays become the outputs' buffers."""
    out_types = [v.type for v in kernel.outputs]
    if poison is None:
        handle = GpuKernelHandle(launch, out_types)
        return jax.jit(lambda *xs: nova_kernel_p.bind(*xs, kernel=handle))(*inputs)
    n = len(inputs)
    handle = GpuKernelHandle(launch, out_types, aliases=tuple((n + i, i) for i in range(len(poison))))
    donate = tuple(range(n, n + len(poison)))
    return jax.jit(lambda *xs: nova_kernel_p.bind(*xs, kernel=handle), donate_argnums=donate)(*inputs, *poison)
