"""From a kernel plan to callable kernels, per backend; and back from persistent-cache files.

`compile_cpu` / `compile_gpu` return `CompiledKernels`: the handles the executor binds, the IR
texts of the stages (`linalg`/`llvm` or `gpu`/`ptx`), and the plain files the persistent cache
keeps so that `restore` can rebuild the handles in another process without the nova pipeline.

On the GPU, a kernel no builder takes yet (contractions until their builder lands, data movement)
runs as XLA ops through `nova_to_jax`; it is listed in `xla_groups` with the builders' reasons.
"""
from __future__ import annotations

import hashlib
import json
import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

from jnova.codegen import cpu
from jnova.codegen.linalg.lowering import LoweringError, kernel_to_linalg
from jnova.dialect.ir import Func
from jnova.dialect.json_form import func_from_json, func_to_json
from jnova.dialect.types import TensorType
from jnova.errors import CompileError
from jnova.passes.form_kernels import Kernel, Plan
from jnova.primitives.nova_kernel import KernelHandle
from jnova.primitives.nova_to_jax import evaluate_ops
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


# --------------------------------------------------------------------------- CPU
def compile_cpu(plan: Plan, stage=lambda name: nullcontext()) -> CompiledKernels:
    with stage("to_linalg"):            # each kernel becomes a destination-passing func
        try:
            linalg = "module {\n" + "\n".join(kernel_to_linalg(k.name, k.ops, k.inputs, k.outputs)
                                               for k in plan.kernels) + "\n}\n"
        except LoweringError as e:
            raise CompileError("to_linalg", str(e)) from None
    with stage("lower_cpu"):            # bufferize, loops, LLVM dialect (in the isolated worker)
        llvm = cpu.lower_to_llvm(linalg)
    return _cpu_handles(plan.kernels_json(), linalg, llvm, stage)


def restore_cpu(files: dict[str, str], plan_json: dict, stage=lambda name: nullcontext()) -> CompiledKernels:
    return _cpu_handles([s for s in plan_json["steps"] if "kernel" in s], files["linalg.mlir"], files["llvm.mlir"], stage)


def _cpu_handles(kernel_steps, linalg: str, llvm: str, stage) -> CompiledKernels:
    with stage("jit_llvm"):             # LLVM ORC JIT through the MLIR ExecutionEngine
        executable = cpu.jit_llvm(llvm)
    handles = {}
    for step in kernel_steps:
        name, types = step["kernel"], _types(step)
        run = (lambda name, types: lambda *xs: executable.run(name, list(xs), types))(name, types)
        handles[name] = KernelHandle(name, types, "cpu", run, out_deps=step.get("deps"))
    return CompiledKernels(handles, {"linalg": linalg, "llvm": llvm}, {"linalg.mlir": linalg, "llvm.mlir": llvm})


# --------------------------------------------------------------------------- GPU
def compile_gpu(plan: Plan, target, stage=lambda name: nullcontext()) -> CompiledKernels:
    from jnova.codegen.gpu.compile import compile_gpu_kernel

    launches, xla_groups, groups_text, groups_json = {}, {}, {}, {}
    by_structure: dict[str, object] = {}  # identical kernels (same ops, types) compile once
    with stage("to_ptx"), Progress("compiling GPU kernels", len(plan.kernels)) as progress:
        for k in plan.kernels:
            progress.step()
            text = group_text(k, "kernel")
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
