"""From a kernel plan to callable kernels, per backend; and back from persistent-cache files.

`compile_cpu` / `compile_gpu` return `CompiledKernels`: the handles the executor binds, the IR
texts of the stages (`linalg`/`llvm` or `gpu`/`ptx`), and the plain files the persistent cache
keeps so that `restore` can rebuild the handles in another process without the nova pipeline.

On the GPU, a kernel no builder takes yet (contractions until their builder lands, data movement)
runs as XLA ops through `nova_to_jax`; it is listed in `xla_groups` with the builders' reasons.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

from jnova.codegen import cpu
from jnova.codegen.linalg.lowering import kernel_to_linalg
from jnova.dialect.ir import Func, Op
from jnova.dialect.json_form import func_from_json, func_to_json
from jnova.dialect.types import TensorType
from jnova.errors import CompileError, LoweringError
from jnova.passes.plan import Kernel, Plan
from jnova.primitives.nova_kernel import KernelHandle
from jnova.primitives.nova_to_jax import evaluate_ops
from jnova.runtime import user_code
from jnova.runtime.progress import Progress

log = logging.getLogger("jnova")


@dataclass
class CompiledKernels:
    handles: dict[str, KernelHandle | Callable]
    texts: dict[str, str]
    files: dict[str, str]
    xla_groups: dict[str, str] = field(default_factory=dict)  # kernel name -> why it runs as XLA ops


def _types(step: dict) -> list[TensorType]:
    return [TensorType(tuple(shape), dtype) for shape, dtype in step["out_types"]]


# --------------------------------------------------------------------------- attention
def attention_refusal(backend: str, target=None) -> Callable[[Op], str | None]:
    """What `backend` says of each attention op: None where it compiles the op as one kernel of its own,
    else why not (the op then runs as generic nova ops: passes/expand_attention.py).

    The CPU takes every attention op (it lowers the op's decomposition inside its kernel). The GPU asks
    `jnova.codegen.gpu.attention.attention_refusal(op, target)`, its flash-attention kernels' own refusal."""
    if backend != "gpu":
        return lambda op: None
    if importlib.util.find_spec("jnova.codegen.gpu.attention") is None:
        return lambda op: "this jnova has no GPU attention kernels"
    from jnova.codegen.gpu.attention import attention_refusal as gpu_refusal

    return lambda op: gpu_refusal(op, target)


# --------------------------------------------------------------------------- training ops
# Training ops with kernels of their own (they are raised, and kept to code generation, where the
# backend has them; elsewhere they run as their decomposition). The one place that says so.
# The GPU's cross-entropy kernels (codegen/gpu/cross_entropy.py, cross_entropy_backward.py); GELU,
# LayerNorm and RMSNorm run as their decompositions there.
GPU_TRAINING_KERNELS: frozenset[str] = frozenset({"nova.sce", "nova.sce_backward"})
# a CPU plan of a kernel per fusion group (it stands for the GPU's) keeps the loss head as one kernel
PER_GROUP_TRAINING_KERNELS: frozenset[str] = frozenset({"nova.sce", "nova.sce_backward"})


def keeps_training_op(name: str, backend: str, per_group: bool = False) -> bool:
    """Whether `backend` compiles training op `name` itself (see `training_refusal`). Where it does not,
    raising the op only to expand it again would replace the user's formula by jnova's definition (the
    same function, rounded differently), so the pipeline does not raise it there."""
    if backend == "gpu":
        return name in GPU_TRAINING_KERNELS
    return not per_group or name in PER_GROUP_TRAINING_KERNELS


def keeps_training_ops(backend: str, per_group: bool = False) -> bool:
    """Whether `backend` compiles GELU, LayerNorm and RMSNorm (raise_training's ops) itself."""
    return all(keeps_training_op(name, backend, per_group) for name in ("nova.gelu", "nova.layernorm", "nova.rmsnorm"))


# Raised even where they are expanded again: GELU's decomposition (passes/expand_training.py) computes
# the backward from x alone, where the backward JAX's AD wrote reads the forward's intermediates
# (tanh(u) and x^2 or the like, two more tensors of the activation's size written in the forward and
# read in the backward of every layer). The price: jnova's formula for the function, the same to
# within its rounding (a few f32 ulps), instead of the user's.
RAISED_FOR_THEIR_BACKWARD = frozenset({"nova.gelu"})


def raised_training_ops(backend: str, per_group: bool = False) -> frozenset[str]:
    """Which of raise_training's ops the pipeline raises for `backend`: all where it keeps them,
    otherwise those whose raising pays for itself even expanded (`RAISED_FOR_THEIR_BACKWARD`)."""
    if keeps_training_ops(backend, per_group):
        return frozenset({"nova.gelu", "nova.layernorm", "nova.rmsnorm"})
    return RAISED_FOR_THEIR_BACKWARD


def training_refusal(backend: str, target=None, per_group: bool = False) -> Callable[[Op], str | None]:
    """What `backend` says of each training op (nova.gelu, nova.layernorm, nova.rmsnorm, nova.sce and
    their backwards): None where it compiles the op itself, else why not (the op then runs as generic
    nova ops: passes/expand_training.py).

    The CPU's plan of a kernel per run takes every one (it lowers the op's decomposition inside its
    kernel). The CPU's plan of a kernel per fusion group (`per_group`, which stands for the GPU's)
    takes the cross-entropy ops (a kernel of their own each) and refuses the others, as the GPU refuses
    those it has no kernel for (`GPU_TRAINING_KERNELS`): the row-reduction and elementwise kernels
    compute their decompositions, fused with the neighbouring ops as before they were raised. The GPU's
    cross-entropy kernels say which ops they take (`codegen/gpu/cross_entropy.sce_refusal`: bf16 and
    f32 logits, labels that can name every class; a mean or sum over rows is split off first,
    passes/split_sce_reductions.py)."""
    sce_refusal = _gpu_sce_refusal(target) if backend == "gpu" else None

    def refusal(op: Op) -> str | None:
        if keeps_training_op(op.name, backend, per_group):
            return sce_refusal(op) if sce_refusal is not None and op.name in SCE_OPS else None
        if backend == "gpu":
            return (f"the GPU has no kernel family of its own for {op.name}; its decomposition runs in the "
                    "row-reduction and elementwise kernels")
        return f"a plan of a kernel per fusion group computes {op.name}'s decomposition in its groups"

    return refusal


SCE_OPS = ("nova.sce", "nova.sce_backward")


def _gpu_sce_refusal(target) -> Callable[[Op], str | None]:
    if importlib.util.find_spec("jnova.codegen.gpu.cross_entropy") is None:
        return lambda op: "this jnova has no GPU cross-entropy kernels"
    from jnova.codegen.gpu.cross_entropy import sce_refusal

    return lambda op: sce_refusal(op, target)


# --------------------------------------------------------------------------- CPU
def compile_cpu(plan: Plan, stage=lambda name: nullcontext()) -> CompiledKernels:
    """The plan's kernels as one LLVM module. A kernel the CPU lowering does not take (an op in a dtype
    it has no code for, such as float64 erf_inv) runs as XLA ops instead, with a warning naming why."""
    lowered, groups = [], {}
    with stage("to_linalg"):            # each kernel becomes a destination-passing func
        for k in plan.kernels:
            try:
                lowered.append(kernel_to_linalg(k.name, k.ops, k.inputs, k.outputs))
            except LoweringError as e:
                groups[k.name] = str(e)
    by_name = {k.name: k for k in plan.kernels}
    for name, reason in groups.items():
        where = next((op.loc for op in by_name[name].ops if op.loc), None)
        user_code.warn(f"jnova: the CPU has no code for a kernel's op ({reason}); its kernel runs as XLA ops",
                       location=where)
    linalg = "module {\n" + "\n".join(lowered) + "\n}\n"
    with stage("lower_cpu"):            # bufferize, loops, LLVM dialect (in the isolated worker)
        llvm = cpu.lower_to_llvm(linalg) if lowered else ""
    files = {"linalg.mlir": linalg, "llvm.mlir": llvm,
             "xla_groups.json": json.dumps({n: func_to_json(group_func(by_name[n], n)) for n in groups}),
             "xla_reasons.json": json.dumps(groups)}
    return _cpu_handles(plan.kernels_json(), files, stage)


def restore_cpu(files: dict[str, str], plan_json: dict, stage=lambda name: nullcontext()) -> CompiledKernels:
    return _cpu_handles([s for s in plan_json["steps"] if "kernel" in s], files, stage)


def _cpu_handles(kernel_steps, files: dict[str, str], stage) -> CompiledKernels:
    linalg, llvm = files["linalg.mlir"], files["llvm.mlir"]
    groups = {name: func_from_json(d) for name, d in json.loads(files.get("xla_groups.json", "{}")).items()}
    with stage("jit_llvm"):             # LLVM ORC JIT through the MLIR ExecutionEngine
        executable = cpu.jit_llvm(llvm) if llvm else None
    handles = {}
    for step in kernel_steps:
        name, types = step["kernel"], _types(step)
        if name in groups:
            f = groups[name]
            handles[name] = evaluate_ops(f.ops, f.args, f.returns)
            continue
        run = (lambda name, types: lambda *xs: executable.run(name, list(xs), types))(name, types)
        handles[name] = KernelHandle(name, types, "cpu", run, out_deps=step.get("deps"),
                                     aliases=tuple(map(tuple, step.get("reuses", ()))))
    texts = {"linalg": linalg, "llvm": llvm}
    if groups:
        texts["xla_groups"] = "module {\n" + "\n".join(f.print() for f in groups.values()) + "\n}\n"
    return CompiledKernels(handles, texts, files, json.loads(files.get("xla_reasons.json", "{}")))


# --------------------------------------------------------------------------- GPU
def gpu_kernel_families():
    """What the GPU's kernel builders take, for kernel formation (`codegen/gpu/compile.KERNEL_FAMILIES`);
    imported only when a step is compiled, not when it is restored from the persistent cache."""
    from jnova.codegen.gpu.compile import KERNEL_FAMILIES

    return KERNEL_FAMILIES


def compile_gpu(plan: Plan, target, stage=lambda name: nullcontext()) -> CompiledKernels:
    from jnova.codegen.gpu.compile import compile_gpu_kernel

    launches, xla_groups, groups_text, groups_json = {}, {}, {}, {}
    by_structure: dict[str, object] = {}  # identical kernels (same ops, types) compile once
    with stage("to_ptx"), Progress("compiling GPU kernels", len(plan.kernels)) as progress:
        for k in plan.kernels:
            progress.step()
            text = group_text(k, "kernel") + f"\nreuses {list(k.reuses)}"  # in place or not: another launch
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest not in by_structure:
                try:
                    by_structure[digest] = compile_gpu_kernel(k, target)
                except LoweringError as e:
                    by_structure[digest] = str(e)
            result = by_structure[digest]
            if isinstance(result, str):
                xla_groups[k.name] = result
                groups_text[k.name] = group_text(k, k.name)
                groups_json[k.name] = func_to_json(group_func(k, k.name))
            else:
                launches[k.name] = result
    if xla_groups:
        log.info("jnova: %d of %d kernels have no GPU builder yet and run as XLA ops", len(xla_groups), len(plan.kernels))
    distinct = list({id(l): l for l in launches.values()}.values())  # 12 layers: each kernel stored once
    index = {id(l): i for i, l in enumerate(distinct)}
    files = {"launches.json": json.dumps({"launches": [_launch_json(l) for l in distinct],
                                          "kernels": {n: index[id(l)] for n, l in launches.items()}}),
             "xla_groups.mlir": "module {\n" + "\n".join(groups_text.values()) + "\n}\n",  # for reading
             "xla_groups.json": json.dumps(groups_json),  # for running: read back without MLIR
             "xla_reasons.json": json.dumps(xla_groups)}
    return _gpu_handles(plan.kernels_json(), files)


def restore_gpu(files: dict[str, str], plan_json: dict, stage=lambda name: nullcontext()) -> CompiledKernels:
    return _gpu_handles([s for s in plan_json["steps"] if "kernel" in s], files)


def _gpu_handles(kernel_steps, files: dict[str, str]) -> CompiledKernels:
    from jnova.codegen.gpu.launch import GpuLaunch, TensorMap
    from jnova.primitives.gpu_lowering import GpuKernelHandle

    stored = json.loads(files["launches.json"])
    distinct = [GpuLaunch(**{**d, "grid": tuple(d["grid"]), "block": tuple(d["block"]),
                             "aliases": tuple(map(tuple, d.get("aliases", ()))),
                             "tensor_maps": tuple(TensorMap.from_json(m) for m in d.get("tensor_maps", ()))})
                for d in stored["launches"]]
    launches = {name: distinct[i] for name, i in stored["kernels"].items()}
    groups = {name: func_from_json(d) for name, d in json.loads(files["xla_groups.json"]).items()}
    for f in groups.values():
        f.verify()
    handles = {}
    for step in kernel_steps:
        name = step["kernel"]
        if name in launches:
            handles[name] = GpuKernelHandle(launches[name], _types(step), aliases=launches[name].aliases,
                                            out_deps=step.get("deps"))
        else:
            f = groups[name]
            handles[name] = evaluate_ops(f.ops, f.args, f.returns)
    texts = {"gpu": "\n".join(l.gpu_module for l in distinct),
             "ptx": "\n".join(l.ptx for l in distinct),
             "launches": launch_table(distinct, launches),
             "xla_groups": files["xla_groups.mlir"]}
    return CompiledKernels(handles, texts, files, json.loads(files["xla_reasons.json"]))


def launch_table(distinct, launches: dict) -> str:
    """One line per distinct GPU kernel: PTX entry, launches per step, schedule, grid, block, shared memory,
    and the tensor maps (TMA descriptors) the launcher builds for it: buffer, box."""
    count: dict[int, int] = {}
    for launch in launches.values():
        count[id(launch)] = count.get(id(launch), 0) + 1

    def maps(l) -> str:
        return "".join(f" tensor_map[{m.buffer}]={'x'.join(map(str, m.box))}" for m in l.tensor_maps)

    return "".join(f"{l.name} x{count[id(l)]} {l.schedule} grid={list(l.grid)} block={list(l.block)} "
                   f"smem={l.shared_mem_bytes}{maps(l)}\n" for l in distinct)


def _launch_json(launch) -> dict:
    return {"name": launch.name, "ptx": launch.ptx, "grid": list(launch.grid), "block": list(launch.block),
            "shared_mem_bytes": launch.shared_mem_bytes, "compute_capability": launch.compute_capability,
            "schedule": launch.schedule, "gpu_module": launch.gpu_module, "aliases": [list(a) for a in launch.aliases],
            "tensor_maps": [m.to_json() for m in launch.tensor_maps]}


def group_text(kernel: Kernel, name: str) -> str:
    """The kernel's ops as a standalone nova function, printed."""
    return group_func(kernel, name).print()


def group_func(kernel: Kernel, name: str) -> Func:
    """The kernel's ops as a standalone nova function (its inputs become arguments)."""
    f = Func(name, [])
    f.args, f.ops, f.returns = list(kernel.inputs), list(kernel.ops), list(kernel.outputs)
    return f
