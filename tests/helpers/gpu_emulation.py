"""GPU kernels run on the CPU, for tests without a GPU.

`simulate` runs a generated `gpu.func` whose threads do not talk to each other (elementwise and
index-remap kernels, reductions of one thread per row: no shuffles or barriers) as a host function
that runs every thread of the grid in turn, compiled with MLIR's ExecutionEngine. The kernel's text is
the one that becomes PTX; only `gpu.block_id`, `gpu.thread_id`, `gpu.grid_dim` and `gpu.block_dim` are
replaced by the loops' indices and the launch's sizes. So the builders' index arithmetic (remaps,
vector groups, tails, grid-stride loops) is checked on every CI run; what is not checked is the NVPTX
backend and anything that needs threads running at once (ptxas assembles the PTX in other tests, and
the GPU tests run the real thing).

`check_plan_kernels` does this for every such kernel of a step's GPU plan, against the kernel's own
ops run by `jax.lax` on the same random inputs.
"""
from __future__ import annotations

import ctypes
import dataclasses
import re

import jax.numpy as jnp
import numpy as np

from jnova.capture.to_nova import to_nova
from jnova.capture.trace import trace
from jnova.codegen.cpu import with_bf16_runtime
from jnova.codegen.gpu.compile import build_gpu_module
from jnova.passes.align_contractions import align_contractions
from jnova.passes.lead_batch_dims import lead_batch_dims
from jnova.passes.split_contractions import split_contractions
from jnova.passes.split_reductions import split_reductions
from jnova.passes.transpose_operands import transpose_operands
from jnova.passes.transpose_reductions import transpose_reductions
from jnova.codegen.gpu.row_program import build_row_program, choose_row_program_schedule
from jnova.errors import LoweringError
from jnova.dialect.ops import ReduceOp
from jnova.passes.canonicalize import canonicalize
from jnova.passes.cse import cse
from jnova.passes.dce import dce
from jnova.codegen.gpu.compile import KERNEL_FAMILIES
from jnova.passes.form_kernels import form_plan
from jnova.passes.plan import Kernel
from jnova.passes.fuse import fuse
from jnova.passes.expand_training import expand_refused_training
from jnova.passes.raise_training import raise_training
from jnova.passes.raise_cross_entropy import raise_cross_entropy
from jnova.passes.split_sce_reductions import split_sce_reductions
from jnova.primitives.backends import training_refusal
from jnova.primitives.nova_to_jax import evaluate_op

from helpers.random_inputs import values_for

SIM_PIPELINE = ("builtin.module(convert-scf-to-cf, convert-vector-to-llvm, expand-strided-metadata, lower-affine,"
                "arith-emulate-unsupported-floats{source-types=bf16 target-type=f32}, arith-expand{include-bf16=true},"
                "convert-math-to-llvm, convert-math-to-libm, finalize-memref-to-llvm,"
                "convert-arith-to-llvm, convert-cf-to-llvm, convert-func-to-llvm, convert-index-to-llvm,"
                "reconcile-unrealized-casts)")
THREADS_TALK = ("gpu.shuffle", "gpu.barrier", "nvvm.", "memref.atomic", "gpu.dynamic_shared_memory")


def simulable(module) -> bool:
    """Whether `module`'s threads are independent (so running them one after another is exact)."""
    body = module.text.split(" kernel attributes ", 1)[1]
    return not any(word in body for word in THREADS_TALK)


def simulate(module, inputs, outputs) -> None:
    """Run a gpu.module's kernel on the CPU, writing `outputs` (aligned arrays, see `aligned`) in place:
    its body runs inside loops over the grid's blocks and the block's threads."""
    from mlir import ir, passmanager
    from mlir.execution_engine import ExecutionEngine
    from mlir.runtime import get_ranked_memref_descriptor

    assert module.grid[1:] == (1, 1) and module.block[1:] == (1, 1), (module.grid, module.block)
    lines = module.text.splitlines()
    head = next(i for i, line in enumerate(lines) if "gpu.func" in line)
    params = re.search(r"gpu\.func @\w+\((.*)\)( workgroup\(.*\))? kernel", lines[head]).group(1)
    body = "\n".join(lines[head + 1: lines.index("    gpu.return")])
    body = (body.replace("gpu.block_id x", "arith.addi %sim_b, %sim_0 : index")
                .replace("gpu.thread_id x", "arith.addi %sim_t, %sim_0 : index")
                .replace("gpu.grid_dim x", f"arith.constant {module.grid[0]} : index")
                .replace("gpu.block_dim x", f"arith.constant {module.block[0]} : index"))
    text = "\n".join([
        f"func.func @sim({params}) attributes {{llvm.emit_c_interface}} {{",
        "%sim_0 = arith.constant 0 : index", "%sim_1 = arith.constant 1 : index",
        f"%sim_g = arith.constant {module.grid[0]} : index", f"%sim_n = arith.constant {module.block[0]} : index",
        "scf.for %sim_b = %sim_0 to %sim_g step %sim_1 {", "scf.for %sim_t = %sim_0 to %sim_n step %sim_1 {",
        body, "}", "}", "return", "}"])
    with ir.Context():
        mlir_module = ir.Module.parse(with_bf16_runtime(f"module {{\n{text}\n}}"))
        passmanager.PassManager.parse(SIM_PIPELINE).run(mlir_module.operation)
        engine = ExecutionEngine(mlir_module, opt_level=0)
    buffers = [aligned(np.asarray(x)) for x in inputs] + outputs
    descriptors = [get_ranked_memref_descriptor(b.reshape(-1).view(f"u{b.dtype.itemsize}")) for b in buffers]
    engine.invoke("sim", *[ctypes.pointer(ctypes.pointer(d)) for d in descriptors])


def simulate_with_shared_memory(module, inputs, outputs) -> None:
    """`simulate` for kernels whose threads only talk through shared memory behind a barrier, written
    so that running them one after another is exact (column reductions, batches of them: the thread
    that folds the partials runs last): each workgroup buffer becomes a last parameter, the barriers
    are dropped."""
    lines = module.text.splitlines()
    head = next(i for i, line in enumerate(lines) if "gpu.func" in line)
    group = re.search(r" workgroup\((.*?)\) kernel", lines[head])
    extra, shared = [], []
    for name, size, dtype in re.findall(r"(%\w+) : memref<(\d+)x(\w+), #gpu.address_space<workgroup>>",
                                        group.group(1) if group else ""):
        extra.append(f", {name}: memref<{size}x{dtype}>")
        shared.append(aligned(np.zeros(int(size), {"f32": np.float32, "i32": np.int32, "f64": np.float64}[dtype])))
    if group:
        lines[head] = lines[head].replace(group.group(0), " kernel").replace(") kernel", "".join(extra) + ") kernel", 1)
    text = "\n".join(line for line in lines if line.strip() != "gpu.barrier")
    text = text.replace(", #gpu.address_space<workgroup>", "")
    simulate(dataclasses.replace(module, text=text), inputs, outputs + shared)


SEQUENTIAL_SCHEDULES = ("column_reduction(", "batched_elementwise(")  # see simulate_with_shared_memory
PHASED_SCHEDULES = ("transpose(",)  # see simulate_in_phases


def simulate_in_phases(module, inputs, outputs) -> None:
    """`simulate` for kernels whose barriers separate phases that share nothing but shared memory (no
    value computed before a barrier is used after it; the MLIR parser rejects the kernel otherwise):
    each phase runs for all of a block's threads before the next one starts, as the barrier
    guarantees on a GPU. Workgroup buffers become parameters, as in `simulate_with_shared_memory`."""
    lines = module.text.splitlines()
    head = next(i for i, line in enumerate(lines) if "gpu.func" in line)
    end = lines.index("    gpu.return")
    phases, current = [], []
    for line in lines[head + 1:end]:
        if line.strip() == "gpu.barrier":
            phases.append(current)
            current = []
        else:
            current.append(line)
    phases.append(current)
    loops = []
    for phase in phases:
        loops += ["scf.for %phase_t = %sim_0 to %phase_n step %sim_1 {", *phase, "}"]
    # `simulate` wraps this in its block loop and a thread loop of one trip
    body = [f"%phase_n = arith.constant {module.block[0]} : index", *loops]
    text = "\n".join(lines[:head + 1] + body + lines[end:])
    one = dataclasses.replace(module, text=text.replace("gpu.thread_id x", "arith.addi %phase_t, %sim_0 : index"),
                              block=(1, 1, 1))
    simulate_with_shared_memory(one, inputs, outputs)


def aligned(x: np.ndarray) -> np.ndarray:
    """A 64-byte-aligned copy of `x` (the kernels' vector accesses assume 16-byte aligned buffers)."""
    raw = np.empty(max(x.nbytes, 1) + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start: start + x.nbytes].view(x.dtype).reshape(x.shape)
    out[...] = x
    return out


def poisoned_like(want: np.ndarray) -> np.ndarray:
    """An output buffer differing from `want` in every element, so an unwritten element fails."""
    if want.dtype == np.bool_:
        return aligned(~want)
    if np.issubdtype(want.dtype, np.integer):
        return aligned(want + 1)
    return aligned(np.where(np.isnan(want.astype(np.float32)), 0, np.nan).astype(want.dtype))


def assert_outputs_close(got, want, rtol: float, atol: float, err_msg: str = "") -> None:
    """Simulated outputs against expected arrays (bf16 compared as f32)."""
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        if w.dtype == jnp.bfloat16:
            g, w = g.astype(np.float32), w.astype(np.float32)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=err_msg)


# --------------------------------------------------------------------------- a step's GPU plan
def gpu_plan(fn, *args, target=None, training_ops: bool = False):
    """(the nova program, its GPU plan) of `fn` on `args`: one kernel per fusion group, contraction
    epilogues split off, terminal elementwise kernels batched, as `jnova.compile(..., backend="gpu")`
    forms them; with a `target`, the contraction passes for it run first too (operands transposed to
    lead with their batch dims, aligned operands, split-K, K-major TF32 operands). Every primitive must convert. With `training_ops` (as the pipeline
    does) GELU, LayerNorm and RMSNorm are raised to their nova ops and expanded back where the GPU
    refuses them, and softmax cross-entropy is raised to the ops the GPU's row kernels compute (a mean
    split off); without, the plan of the generic ops as captured. With a `target`, reductions over
    middle dims read a transposed operand (`transpose_reductions`) and reductions into fewer rows than
    its SMs are split (`split_reductions`) too."""
    program = to_nova(trace(fn, args, {}), fallback="error")
    func = program.func
    canonicalize(func)
    cse(func)
    effects = {i for i, e in enumerate(program.sites) if e.effects}
    if training_ops:
        dce(func, keep_sites=effects)  # as the pipeline: a dead reader of a softmax would keep it unraised
        raise_training(func, evaluate_op)
        raise_cross_entropy(func, evaluate_op)
    dce(func, keep_sites=effects)
    if training_ops:
        expand_refused_training(func, training_refusal("gpu", target))
        split_sce_reductions(func)
    if target is not None:
        lead_batch_dims(func)
        align_contractions(func)
        split_contractions(func, target)
        transpose_reductions(func)
        split_reductions(func, target)
        transpose_operands(func, target)
    return program, form_plan(func, fuse(func).groups, True, KERNEL_FAMILIES)


def random_inputs(kernel: Kernel, rng: np.random.Generator) -> list[np.ndarray]:
    """Standard normal floats, integers in [-50, 50] (or the type's range), random bools."""
    return values_for([v.type for v in kernel.inputs], rng, low=-50, high=51)


# error allowed where a kernel computes float math, relative to max(|value|, 1) (the inputs are of order 1,
# so an expression that cancels, like 1 - tanh(x)**2, is measured at their scale): the CPU's libm and XLA's
# own functions may differ by a few ulps, and one ulp of f32 can round a bf16 result to its neighbour. A
# wrong index reads another random element, off by about 1.
RTOL = {"float32": 1e-5, "float64": 1e-12, "bfloat16": 2.0**-7, "float16": 2.0**-10}


# a row program run as a thread per row holds the whole row in that thread's slots, unrolled: past this
# many, MLIR's JIT takes minutes (one row of 8192 in groups of 4: 2048 slots, 7 minutes), so such a
# kernel is left to the GPU tests (tests/gpu/test_gpu_kernels.py runs long rows with their teams)
MAX_THREAD_PER_ROW_SLOTS = 64


def check_kernel(kernel: Kernel, target, rng: np.random.Generator) -> tuple[bool, list[str]]:
    """(simulated, problems): simulate `kernel`'s GPU code on random inputs with poisoned outputs and
    compare with its ops run by `jax.lax` (exact for data movement and integers); one line per output
    that differs. Kernels without a builder, or whose threads talk to each other, are not simulated."""
    try:
        module = build_gpu_module(kernel, target)
    except LoweringError:
        return False, []
    if not simulable(module) and module.schedule.startswith("row_program"):
        if choose_row_program_schedule(kernel, target, 1).slots > MAX_THREAD_PER_ROW_SLOTS:
            return False, []
        module = build_row_program(kernel, target, team=1)  # the same program, a thread per row
    sequential = module.schedule.startswith(SEQUENTIAL_SCHEDULES) and "gpu.shuffle" not in module.text
    phased = module.schedule.startswith(PHASED_SCHEDULES)
    if not simulable(module) and not sequential and not phased:
        return False, []
    ins = random_inputs(kernel, rng)
    want = [np.asarray(w) for w in reference(kernel)(*ins)]
    outs = [poisoned_like(w) for w in want]
    run = simulate_in_phases if phased else simulate_with_shared_memory if sequential else simulate
    run(module, ins, outs)
    return True, differences(kernel, outs, want, module.schedule)


def differences(kernel: Kernel, got, want, schedule: str) -> list[str]:
    """One line per output of `kernel` where `got` and `want` differ by more than float math allows: an
    output is as precise as the narrowest float its kernel computes in (an f32 partial sum of bf16
    products is off by a bf16 rounding where one product rounds to its neighbour)."""
    problems, widen = [], np.sqrt(_longest_reduction(kernel))
    computed_in = {r.type.dtype for op in kernel.ops for r in op.results}
    for i, (v, g, w) in enumerate(zip(kernel.outputs, got, want)):
        g64, w64 = np.asarray(g).astype(np.float64), np.asarray(w).astype(np.float64)
        close = (g64 == w64) | (np.isnan(g64) & np.isnan(w64))
        rtol = max(RTOL.get(dtype, 0.0) for dtype in computed_in | {v.type.dtype})
        close |= np.abs(g64 - w64) <= rtol * widen * np.maximum(np.abs(w64), 1.0)
        if not close.all():
            at = tuple(int(k) for k in np.argwhere(~close)[0])
            problems.append(f"{kernel.name} out{i} {v.type} {schedule}: {int((~close).sum())} of {close.size} "
                            f"differ, first at {at}: kernel {g64[at]!r}, jax.lax {w64[at]!r}")
    return problems


def reference(kernel: Kernel):
    """`kernel`'s ops run one by one by jax.lax (each op's result rounded to its type: a jitted function
    would let XLA keep bf16 intermediates in f32 inside its fusions), with sums of 16-bit floats
    accumulated in f32 and rounded once, as jnova's kernels do (XLA's CPU backend would accumulate them
    in their own type)."""
    def run(*xs):
        env = dict(zip(kernel.inputs, xs))
        for op in kernel.ops:
            args = [env[v] for v in op.operands]
            if isinstance(op, ReduceOp) and op.attrs["kind"] == "sum" and args[0].dtype.itemsize == 2 \
                    and args[0].dtype.kind != "i":
                wide = jnp.sum(args[0].astype(np.float32), axis=tuple(op.attrs["dims"]))
                results = [wide.astype(args[0].dtype)]
            else:
                results = evaluate_op(op, *args)
            env.update(zip(op.results, results))
        return [env[v] for v in kernel.outputs]

    return run


def _longest_reduction(kernel: Kernel) -> int:
    """The most elements any reduction of `kernel` combines (1 if none): sequential and tree sums
    differ by about sqrt(n) roundings."""
    n = 1
    for op in kernel.ops:
        if isinstance(op, ReduceOp):
            shape = op.operands[0].type.shape
            n = max(n, int(np.prod([shape[d] for d in op.attrs["dims"]])))
    return n


def check_plan_kernels(fn, *args, target, seed: int = 0) -> tuple[int, list[str]]:
    """(kernels simulated, problems) over every kernel of `fn`'s GPU plan."""
    rng = np.random.default_rng(seed)
    simulated, problems = 0, []
    for kernel in gpu_plan(fn, *args, target=target)[1].kernels:
        ran, found = check_kernel(kernel, target, rng)
        simulated += ran
        problems += found
    return simulated, problems
