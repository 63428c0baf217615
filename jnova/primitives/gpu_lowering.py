"""The CUDA lowering of `nova_kernel_p`: a jnova GPU kernel as a custom call that launches it.

By default the call is jnova's own launcher (`jnova_launch`, jnova/runtime/launcher.py): the kernel
is registered with the launcher here, and the call carries its 63-bit id and launch geometry
(attributes `kernel_id` and `launch`). Where the launcher cannot be built (no C compiler), or with
`JNOVA_LAUNCHER=jaxlib`, the call is jaxlib's PTX kernel call instead:

The jaxlib call is `triton_kernel_call_ffi` (api_version 4); its `opaque` attribute is a zlib-compressed
`jax_triton.TritonAnyKernelCall` protobuf (jaxlib/gpu/triton.proto) holding the PTX, entry name,
warps, dynamic shared memory, compute capability, grid and one array parameter per buffer. Buffers
are the operands then the results (aliased results included), each array parameter takes the next
one; jaxlib appends two pointers (scratch, profiling) the PTX need not declare. jaxlib assembles
the PTX with ptxas on first use and caches the module by the opaque bytes.

With a CUDA jaxlib the protobuf comes from jaxlib's own objects (`gpu_triton.TritonKernelCall`).
A CPU-only jaxlib has none, so the same message is written here from the .proto's field numbers
(stable from jaxlib 0.4 to 0.11; every field is a varint, a length-delimited string or a nested
message), which lets a CPU machine lower a step for CUDA ahead of time.
"""
from __future__ import annotations

import functools
import zlib

import jax
import numpy as np
from jax.interpreters import mlir

from jnova.codegen.gpu.launch import GpuLaunch
from jnova.dialect.types import TensorType
from jnova.primitives.nova_kernel import KernelHandle, nova_kernel_p
from jnova.runtime import jax_internals, launcher

TARGET = "triton_kernel_call_ffi"
PTR_DIVISIBILITY = 16  # jaxlib checks every buffer's alignment before the launch (the PTX assumes it)


class GpuKernelHandle(KernelHandle):
    """A `nova_kernel_p` kernel compiled for CUDA. `aliases` pairs (operand index, result index) that
    share a buffer (XLA's input_output_aliases: in-place updates, donated inputs).

    Equal by value (launch, result types, aliases), unlike CPU handles: the same kernel launched by
    each of a model's layers then lowers once (JAX caches lowerings by params), which makes the step's
    lowering several times faster."""

    def __init__(self, launch: GpuLaunch, out_types: list[TensorType], aliases: tuple[tuple[int, int], ...] = (),
                 out_deps=None):
        super().__init__(launch.name, out_types, "gpu", out_deps=out_deps)
        self.launch = launch
        self.aliases = tuple(aliases)
        self._key = (launch, tuple(self.out_types), self.aliases, self.out_deps)

    def __eq__(self, other):
        return isinstance(other, GpuKernelHandle) and self._key == other._key

    def __hash__(self):
        return hash(self._key)


def kernel_call_proto(launch: GpuLaunch, num_buffers: int) -> bytes:
    """The serialized TritonAnyKernelCall launching `launch` on `num_buffers` buffers (uncompressed)."""
    triton = jax_internals.gpu_triton()
    if triton is None:
        return _encode_kernel_call(launch, num_buffers)
    kernel = triton.TritonKernel(launch.name, launch.num_warps, 1, launch.shared_mem_bytes, launch.ptx, "",
                                 launch.compute_capability)  # positional: the form every jaxlib >= 0.10 takes
    params = [triton.create_array_parameter(0, PTR_DIVISIBILITY) for _ in range(num_buffers)]
    call = triton.TritonKernelCall(kernel, *launch.grid, params)
    return call.to_proto(launch.name, b"")


def lower_gpu_kernel(ctx, *args, kernel: KernelHandle):
    """The CUDA lowering rule of `nova_kernel_p`."""
    launch = getattr(kernel, "launch", None)
    if not isinstance(launch, GpuLaunch):
        raise NotImplementedError(
            f"jnova kernel {kernel.name} was compiled for {kernel.backend}; it cannot be lowered for a GPU. "
            "Compile the step with the inputs on the GPU (or backend='gpu').")
    aliases = dict(getattr(kernel, "aliases", ()))
    choice = launcher.choice()
    if launch.tensor_maps and choice != "jnova":
        raise NotImplementedError(
            f"jnova kernel {launch.name} takes TMA descriptors, which only jnova's kernel launcher builds, and "
            "the launcher is not in use here (it could not be built, or JNOVA_LAUNCHER=jaxlib was set after the "
            "step was compiled); with JNOVA_LAUNCHER=jaxlib set before jnova.compile the step is compiled "
            "without such kernels")
    if choice == "jnova":
        kernel_id = _register(launch)
        geometry = np.array([*launch.grid, *launch.block, launch.shared_mem_bytes], np.int64)
        target = launcher.call_target(launcher.load())
        rule = jax.ffi.ffi_lowering(target, api_version=4, operand_output_aliases=aliases or None)
        return rule(ctx, *args, kernel_id=np.uint64(kernel_id), launch=geometry)
    opaque = _opaque(launch, len(ctx.avals_in) + len(ctx.avals_out))
    rule = jax.ffi.ffi_lowering(TARGET, api_version=4, operand_output_aliases=aliases or None)
    return rule(ctx, *args, name=launch.name, opaque=opaque)


@functools.lru_cache(maxsize=4096)
def _register(launch: GpuLaunch) -> int:
    """Register `launch`'s PTX with jnova's launcher (once a process); its kernel id."""
    kernel_id = launcher.kernel_id(launch.name, launch.ptx, launch.tensor_maps)
    launcher.load().register(kernel_id, launch.name, launch.ptx, launch.tensor_maps)
    return kernel_id


@functools.lru_cache(maxsize=4096)
def _opaque(launch: GpuLaunch, num_buffers: int) -> bytes:
    """The compressed call (a step launches each distinct kernel many times: once per layer).

    zlib's fastest level: GPT-2's 64 distinct calls (1.4 MB of PTX) compress in 12 ms instead of
    43 ms at the default level, to 340 KB instead of 280 KB; jaxlib inflates any level."""
    return zlib.compress(kernel_call_proto(launch, num_buffers), 1)


def register_gpu_lowering() -> None:
    """Make `nova_kernel_p` lower to the PTX kernel call on CUDA (replaces the refusing rule)."""
    mlir.register_lowering(nova_kernel_p, lower_gpu_kernel, platform="cuda")


# --------------------------------------------------------------------------- protobuf, by hand
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _uint(field: int, n: int) -> bytes:
    """A varint field, omitted when zero as proto3 does for fields without presence."""
    return _varint(field << 3) + _varint(n) if n else b""


def _bytes(field: int, data: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(data)) + data if data else b""


def _encode_kernel_call(launch: GpuLaunch, num_buffers: int) -> bytes:
    kernel = b"".join([  # TritonKernel
        _bytes(1, launch.name.encode()), _uint(2, launch.num_warps), _uint(3, launch.shared_mem_bytes),
        _bytes(4, launch.ptx.encode()), _uint(6, launch.compute_capability),
        _varint(10 << 3) + _varint(1),  # optional num_ctas = 1 (an absent value reads as 0 on older jaxlibs)
    ])
    array = _uint(2, PTR_DIVISIBILITY)  # Parameter.Array: bytes_to_zero = 0, ptr_divisibility
    parameter = _varint(1 << 3 | 2) + _varint(len(array)) + array  # Parameter.array (present even if empty)
    gx, gy, gz = launch.grid
    call = b"".join([_bytes(1, kernel), _uint(2, gx), _uint(3, gy), _uint(4, gz)]
                    + [_bytes(5, parameter)] * num_buffers)  # TritonKernelCall
    return _bytes(1, call) + _bytes(4, launch.name.encode())  # TritonAnyKernelCall: kernel_call, name
