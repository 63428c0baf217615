"""A fused kernel -> a launchable GPU kernel: pick its builder, build the gpu.module, produce PTX."""
from __future__ import annotations

from jnova.codegen.gpu.batched import batched_refusal, build_batched
from jnova.codegen.gpu.column_reduction import build_column_reduction, column_reduction_refusal
from jnova.codegen.gpu.contraction import build_contraction, contraction_refusal
from jnova.codegen.gpu.elementwise import build_elementwise, elementwise_refusal
from jnova.codegen.gpu.emitter import GpuModule
from jnova.codegen.gpu.launch import GpuLaunch
from jnova.codegen.gpu.ptx import to_ptx
from jnova.codegen.gpu.reduction import build_row_reduction, row_reduction_refusal
from jnova.codegen.gpu.row_program import build_row_program, row_program_refusal
from jnova.codegen.gpu.scatter import build_scatter_add, scatter_refusal
from jnova.codegen.gpu.transpose import build_transpose, transpose_refusal
from jnova.codegen.linalg.lowering import LoweringError
from jnova.passes.form_kernels import Kernel
from jnova.runtime.target import Target

# Kernel families in the order they are tried: (name, why-not, builder).
BUILDERS = (
    ("contraction", contraction_refusal, build_contraction),
    ("tiled transpose", transpose_refusal, build_transpose),  # before elementwise, which reads through it
    ("elementwise", elementwise_refusal, build_elementwise),
    ("row reduction", row_reduction_refusal, build_row_reduction),
    ("column reduction", column_reduction_refusal, build_column_reduction),
    ("row program", row_program_refusal, build_row_program),
    ("scatter-add", scatter_refusal, build_scatter_add),
)


def build_gpu_module(kernel: Kernel, target: Target) -> GpuModule:
    """The gpu.module of the first kernel family that takes `kernel`; LoweringError with every
    family's reason if none does."""
    if getattr(kernel, "segments", None):  # a batch of independent kernels (form_kernels.BatchedKernel)
        reason = batched_refusal(kernel)
        if reason is None:
            return build_batched(kernel, target)
        raise LoweringError(f"no GPU kernel builder takes {kernel.name} (not batched elementwise: {reason})")
    reasons = []
    for family, refusal, build in BUILDERS:
        reason = refusal(kernel)
        if reason is None:
            return build(kernel, target)
        reasons.append(f"not {family}: {reason}")
    raise LoweringError(f"no GPU kernel builder takes {kernel.name} ({'; '.join(reasons)})")


def compile_gpu_kernel(kernel: Kernel, target: Target) -> GpuLaunch:
    module = build_gpu_module(kernel, target)
    if module.block[1:] != (1, 1) or module.block[0] % 32:
        raise LoweringError(f"{kernel.name}: block {module.block} is not a whole number of warps along x")
    major, minor = target.compute_capability
    return GpuLaunch(module.name, to_ptx(module.text), module.grid, module.block, module.shared_mem_bytes,
                     10 * major + minor, module.schedule, module.text, module.aliases, module.tensor_maps)
