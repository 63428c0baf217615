"""A fused kernel -> a launchable GPU kernel: pick its builder, build the gpu.module, produce PTX.

`BUILDERS` is the GPU's table of kernel families; `KERNEL_FAMILIES` answers kernel formation's
questions from it (`passes/form_kernels.KernelFamilies`). A new family is one `KernelFamily` entry:
its refusal (why it does not take a kernel, or None), its builder, and whether kernel formation may
merge neighbours into it or batch it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from jnova.codegen.gpu.attention import attention_kernel_refusal, build_attention
from jnova.codegen.gpu.attention_backward import (attention_dkdv_kernel_refusal, attention_dq_kernel_refusal,
                                                  build_attention_dkdv_kernel, build_attention_dq_kernel)
from jnova.codegen.gpu.batched import batched_refusal, build_batched
from jnova.codegen.gpu.column_reduction import build_column_reduction, column_reduction_refusal
from jnova.codegen.gpu.contraction import build_contraction, contraction_refusal, epilogue_of
from jnova.codegen.gpu.cross_entropy import build_sce, sce_kernel_refusal
from jnova.codegen.gpu.cross_entropy_backward import build_sce_backward, sce_backward_kernel_refusal
from jnova.codegen.gpu.elementwise import build_elementwise, elementwise_refusal
from jnova.codegen.gpu.emitter import GpuModule
from jnova.codegen.gpu.launch import GpuLaunch
from jnova.codegen.gpu.ptx import to_ptx
from jnova.codegen.gpu.reduction import build_row_reduction, row_reduction_refusal
from jnova.codegen.gpu.row_program import build_row_program, row_program_refusal
from jnova.codegen.gpu.scatter import build_scatter_add, scatter_refusal
from jnova.codegen.gpu.transpose import build_transpose, transpose_refusal
from jnova.errors import LoweringError
from jnova.passes.plan import Kernel
from jnova.runtime.target import Target



@dataclass(frozen=True)
class KernelFamily:
    """One GPU kernel builder: the kernels it takes (`refusal` says why not, or None) and how it builds
    them; `mergeable`: kernel formation may merge neighbouring groups into one kernel of this family
    (`form_kernels.merge_neighbours`); `batchable`: it may launch terminal kernels of this family as
    one (`form_kernels.batch_terminal_kernels`, built by `codegen/gpu/batched.py`); `in_place`: its
    kernels load every input of an element before they store its outputs, so an output may take the
    buffer of an input read only there (`passes/reuse_buffers.py`; the same holds for such a kernel as a
    batch's segment)."""

    name: str
    refusal: Callable[[Kernel], "str | None"]
    build: Callable
    mergeable: bool = False
    batchable: bool = False
    in_place: bool = False


# Kernel families in the order they are tried.
BUILDERS = (
    KernelFamily("attention", attention_kernel_refusal, build_attention),  # nova.attention: the fused forward
    KernelFamily("attention dq", attention_dq_kernel_refusal, build_attention_dq_kernel),  # the backward's halves
    KernelFamily("attention dk/dv", attention_dkdv_kernel_refusal, build_attention_dkdv_kernel),
    KernelFamily("cross-entropy", sce_kernel_refusal, build_sce),  # nova.sce: a pass over each row
    KernelFamily("cross-entropy backward", sce_backward_kernel_refusal, build_sce_backward, in_place=True),
    KernelFamily("contraction", contraction_refusal, build_contraction),
    KernelFamily("tiled transpose", transpose_refusal, build_transpose),  # before elementwise, which reads through it
    KernelFamily("elementwise", elementwise_refusal, build_elementwise, mergeable=True, batchable=True,
                 in_place=True),
    KernelFamily("row reduction", row_reduction_refusal, build_row_reduction, mergeable=True),
    KernelFamily("column reduction", column_reduction_refusal, build_column_reduction, batchable=True),
    KernelFamily("row program", row_program_refusal, build_row_program, mergeable=True),
    KernelFamily("scatter-add", scatter_refusal, build_scatter_add),
)


@dataclass(frozen=True)
class GpuKernelFamilies:
    """Kernel formation's view of `families` (`passes/form_kernels.KernelFamilies`)."""

    families: tuple[KernelFamily, ...]

    def accepts(self, kernel: Kernel) -> str | None:
        reasons = []
        for family in self.families:
            reason = family.refusal(kernel)
            if reason is None:
                return None
            reasons.append(f"not {family.name}: {reason}")
        return "; ".join(reasons)

    def mergeable(self, kernel: Kernel) -> bool:
        return any(f.refusal(kernel) is None for f in self.families if f.mergeable)

    def batchable(self, kernel: Kernel) -> bool:
        return any(f.refusal(kernel) is None for f in self.families if f.batchable)

    def in_place(self, kernel: Kernel) -> bool:
        family = next((f for f in self.families if f.refusal(kernel) is None), None)  # the one that builds it
        return family is not None and family.in_place

    def epilogue_refusal(self, ops) -> str | None:
        return epilogue_of(ops)[1]


KERNEL_FAMILIES = GpuKernelFamilies(BUILDERS)


def build_gpu_module(kernel: Kernel, target: Target) -> GpuModule:
    """The gpu.module of the first kernel family that takes `kernel`; LoweringError with every
    family's reason if none does."""
    if getattr(kernel, "segments", None):  # a batch of independent kernels (passes/plan.BatchedKernel)
        reason = batched_refusal(kernel)
        if reason is None:
            return build_batched(kernel, target)
        raise LoweringError(f"no GPU kernel builder takes {kernel.name} (not batched elementwise: {reason})")
    reasons = []
    for family in BUILDERS:
        reason = family.refusal(kernel)
        if reason is None:
            return family.build(kernel, target)
        reasons.append(f"not {family.name}: {reason}")
    raise LoweringError(f"no GPU kernel builder takes {kernel.name} ({'; '.join(reasons)})")


def compile_gpu_kernel(kernel: Kernel, target: Target) -> GpuLaunch:
    module = build_gpu_module(kernel, target)
    if kernel.reuses:  # outputs written in place of inputs that die here (passes/reuse_buffers.py)
        module = replace(module, aliases=tuple(dict.fromkeys(module.aliases + tuple(map(tuple, kernel.reuses)))))
    if module.block[1:] != (1, 1) or module.block[0] % 32:
        raise LoweringError(f"{kernel.name}: block {module.block} is not a whole number of warps along x")
    major, minor = target.compute_capability
    return GpuLaunch(module.name, to_ptx(module.text), module.grid, module.block, module.shared_mem_bytes,
                     10 * major + minor, module.schedule, module.text, module.aliases, module.tensor_maps)
