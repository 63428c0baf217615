"""Single kernels formed from a JAX function, and the ptxas check."""
import pytest

from jnova.capture.to_nova import to_nova
from jnova.capture.trace import trace
from jnova.codegen.gpu.compile import compile_gpu_kernel
from jnova.codegen.gpu.ptx import assemble_check, ptxas_path
from jnova.passes.canonicalize import canonicalize
from jnova.passes.cse import cse
from jnova.passes.dce import dce
from jnova.passes.form_kernels import form_kernels
from jnova.runtime.target import get_target

requires_ptxas = pytest.mark.skipif(ptxas_path() is None, reason="ptxas is not on PATH")


def kernel_of(fn, *args):
    """The single kernel jnova forms for `fn`, and the arrays its inputs are (in kernel order)."""
    program = to_nova(trace(fn, args, {}), fallback="error")
    func = program.func
    canonicalize(func)
    cse(func)
    dce(func, keep_sites=set())
    (kernel,) = form_kernels(func).kernels
    values = list(args) + list(program.const_args)
    return kernel, [values[func.args.index(v)] for v in kernel.inputs]


def assert_assembles_without_spills(kernel, target: str, label: str, max_registers: int = 64):
    """The kernel's PTX for `target`, assembled by ptxas: no spills, no stack frame, few registers."""
    t = get_target(target)
    launch = compile_gpu_kernel(kernel, t)
    report = assemble_check(launch.ptx, t.arch)
    print(f"{label}: {launch.schedule}: {report}")
    assert f".target {t.arch}" in launch.ptx and f".entry {kernel.name}(" in launch.ptx
    assert report.spills == 0 and report.stack_frame == 0, report.log
    assert report.registers <= max_registers, report.log
    return launch
