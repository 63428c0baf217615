"""The jnova compiler, top to bottom: one named call per stage.

    trace -> (persistent cache: restore and stop here on a hit)
          -> to_nova -> verify -> canonicalize -> cse -> (mixed precision) -> dce -> fuse -> form_kernels
          -> (in-memory cache by structural hash) -> kernel_to_linalg -> CPU pass pipeline -> JIT
          -> step function of kernel binds and fallback ops, under jax.jit

`compile_step` returns an `Executable`; `jnova.compile` (api.py) calls it once per new input
signature and caches the result.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import jax
import numpy as np

from jnova.capture.to_nova import find_site, large_constants, to_nova
from jnova.capture.trace import Captured, trace
from jnova.codegen import cpu
from jnova.codegen.linalg.lowering import LoweringError, kernel_to_linalg
from jnova.dialect.types import TensorType
from jnova.errors import CompileError
from jnova.options import Options
from jnova.passes.canonicalize import canonicalize
from jnova.passes.cse import cse
from jnova.passes.dce import dce
from jnova.passes.form_kernels import Plan, form_kernels, kernels_from_fusion, plan_to_json
from jnova.passes.fuse import fuse
from jnova.passes.mixed_precision import demote_contractions
from jnova.primitives.executor import step_function
from jnova.primitives.nova_kernel import KernelHandle
from jnova.runtime.cache import ARTIFACTS
from jnova.runtime.disk_cache import open_cache
from jnova.runtime.dump import StepDump
from jnova.runtime.hashing import structural_hash

log = logging.getLogger("jnova")


@dataclass
class Executable:
    """A compiled step for one input signature."""

    run: Callable                 # jitted: flat args -> flat outputs
    captured: Captured
    meta: dict                    # plan (JSON form), fallback sites and reasons, op count
    key: str                      # structural hash
    texts: dict[str, str]         # stage name -> IR text
    times: dict[str, float] = field(default_factory=dict)
    cache_hit: str | None = None  # None, "memory" (same structure in this process) or "disk"

    def stats(self) -> dict:
        """Kernels, ops, fallbacks, cache hit and compile time per stage of this signature."""
        steps = self.meta["plan"]["steps"]
        return {"kernels": sum("kernel" in s for s in steps), "nova_ops": self.meta["nova_ops"],
                "fallbacks": [s["fallback"] for s in steps if "fallback" in s], "cache_hit": self.cache_hit,
                "compile_s": dict(self.times)}

    def as_text(self, stage: str) -> str:
        if stage not in self.texts:
            raise ValueError(f"unknown stage {stage!r}; this step has {sorted(self.texts)}")
        return self.texts[stage]


@dataclass
class _CompiledKernels:
    """What the artifact cache keeps per structural hash: one executable per kernel module."""

    handles: dict[str, KernelHandle]
    linalg: str
    llvm: str


@contextmanager
def _stage(times: dict, name: str):
    start = time.perf_counter()
    yield
    times[name] = time.perf_counter() - start
    log.debug("stage %-14s %8.1f ms", name, 1e3 * times[name])


def compile_step(fn: Callable, args: tuple, kwargs: dict, options: Options, donate: tuple[int, ...] = ()) -> Executable:
    times: dict[str, float] = {}
    with _stage(times, "trace"):        # capture: fwd + bwd + update as one jaxpr
        captured = trace(fn, args, kwargs)
    disk = open_cache()
    disk_key = capture_key(captured, options)
    entry = disk.load(disk_key) if disk else None
    if entry is not None:               # compiled by an earlier process: skip the nova pipeline
        return _restore(entry, captured, disk_key, donate, times)
    with _stage(times, "to_nova"):      # one nova function; unknown primitives become fallbacks
        program = to_nova(captured, fallback=options.fallback)
    func = program.func
    with _stage(times, "verify"):       # every op checks its operands and attributes
        func.verify()
    with _stage(times, "canonicalize"):  # fold no-op reshapes/converts/broadcasts and the like
        canonicalize(func)
    with _stage(times, "cse"):          # JAX repeats constants and broadcasts; merge them
        cse(func)
    if options.mixed_precision == "bf16":
        with _stage(times, "mixed_precision"):  # opt-in: contraction operands in bf16, f32 accumulate
            demote_contractions(func)
    with _stage(times, "dce"):          # drop what the step does not return
        dce(func, keep_sites={i for i, e in enumerate(program.sites) if e.effects})
    nova_text = "module {\n" + func.print() + "\n}\n"
    with _stage(times, "fuse"):         # fusion groups, with a reason for every refused fusion
        fusion = fuse(func)
    with _stage(times, "form_kernels"):  # CPU: a kernel per run between fallbacks; GPU: per group
        plan = kernels_from_fusion(func, fusion.groups) if options.kernels == "fused" else form_kernels(func)
    key = structural_hash(nova_text, program.sites, options.hash_items(), target=options.backend or "cpu")
    compiled = ARTIFACTS.get(key)       # a structurally identical step compiled in this process
    cache_hit = compiled is not None
    if compiled is None:
        compiled = _compile_kernels(plan, times)
        ARTIFACTS.put(key, compiled)
    plan_json = plan_to_json(plan)
    texts = {"jaxpr": str(captured.jaxpr), "nova": nova_text, "linalg": compiled.linalg, "llvm": compiled.llvm}
    meta = {"plan": plan_json, "site_paths": program.site_paths, "fallbacks": program.fallbacks,
            "nova_ops": len(func.ops), "refused_fusions": fusion.refused}
    if disk:
        disk.store(disk_key, {"meta.json": json.dumps(meta), "nova.mlir": nova_text,
                              "linalg.mlir": compiled.linalg, "llvm.mlir": compiled.llvm})
    with _stage(times, "jit"):          # the step: kernel binds + fallback ops, planned by XLA
        run = jax.jit(step_function(plan_json, program.sites, compiled.handles, program.const_args),
                      donate_argnums=donate)
    _dump(func.name, key, texts, meta, times)
    log.info("jnova compiled %s: %d ops, %d kernels, %d fallbacks%s in %.2f s", func.name, len(func.ops),
             len(plan.kernels), len(plan.steps) - len(plan.kernels), " (cache hit)" if cache_hit else "",
             sum(times.values()))
    return Executable(run, captured, meta, key, texts, times, "memory" if cache_hit else None)


def capture_key(captured: Captured, options: Options) -> str:
    """Key of the persistent cache: the jaxpr (structure, shapes, params, literals), the values of
    small captured constants (they are compiled into kernels), options and versions."""
    from jnova.capture.to_nova import MAX_INLINE_CONSTANT

    consts = []
    for c in map(np.asarray, captured.consts):
        consts.append(f"{c.dtype}{c.shape}" + (hashlib.sha256(c.tobytes()).hexdigest() if c.size <= MAX_INLINE_CONSTANT else ""))
    return structural_hash(str(captured.jaxpr) + "\n".join(consts), [], options.hash_items(),
                           target=options.backend or "cpu")


def _restore(entry: dict, captured: Captured, key: str, donate, times) -> Executable:
    """An Executable from a persistent-cache entry: JIT the cached LLVM module, rebind fallbacks."""
    meta = json.loads(entry["meta.json"])
    plan_json = meta["plan"]
    with _stage(times, "jit_llvm"):
        executable = cpu.jit_llvm(entry["llvm.mlir"])
    handles = _handles(executable, plan_json)
    sites = [find_site(captured.jaxpr, tuple(p)) for p in meta["site_paths"]]
    with _stage(times, "jit"):
        run = jax.jit(step_function(plan_json, sites, handles, large_constants(captured)), donate_argnums=donate)
    texts = {"jaxpr": str(captured.jaxpr), "nova": entry["nova.mlir"], "linalg": entry["linalg.mlir"],
             "llvm": entry["llvm.mlir"]}
    log.info("jnova restored a compiled step from the persistent cache in %.2f s", sum(times.values()))
    return Executable(run, captured, meta, key, texts, times, "disk")


def _dump(name: str, key: str, texts: dict, meta: dict, times: dict) -> None:
    dump = StepDump(name, key)
    dump.write("jaxpr", ".txt", texts["jaxpr"])
    dump.write("nova", ".mlir", texts["nova"])
    dump.write("plan", ".json", json.dumps(meta["plan"], indent=1))
    dump.write("fusion", ".txt", "\n".join(meta["refused_fusions"]) + "\n")
    dump.write("linalg", ".mlir", texts["linalg"])
    dump.write("llvm", ".mlir", texts["llvm"])
    dump.write("times", ".json", json.dumps(times, indent=1))


def _compile_kernels(plan: Plan, times: dict) -> _CompiledKernels:
    with _stage(times, "to_linalg"):    # each kernel becomes a destination-passing func
        try:
            linalg = "module {\n" + "\n".join(kernel_to_linalg(k.name, k.ops, k.inputs, k.outputs)
                                               for k in plan.kernels) + "\n}\n"
        except LoweringError as e:
            raise CompileError("to_linalg", str(e)) from None
    with _stage(times, "lower_cpu"):    # bufferize, loops, LLVM dialect (in the isolated worker)
        llvm = cpu.lower_to_llvm(linalg)
    with _stage(times, "jit_llvm"):     # LLVM ORC JIT through the MLIR ExecutionEngine
        executable = cpu.jit_llvm(llvm)
    handles = _handles(executable, plan_to_json(plan))
    return _CompiledKernels(handles, linalg, llvm)


def _handles(executable, plan_json: dict) -> dict[str, KernelHandle]:
    handles = {}
    for step in plan_json["steps"]:
        if "kernel" in step:
            types = [TensorType(tuple(shape), dtype) for shape, dtype in step["out_types"]]
            run = (lambda name, types: lambda *xs: executable.run(name, list(xs), types))(step["kernel"], types)
            handles[step["kernel"]] = KernelHandle(step["kernel"], types, "cpu", run)
    return handles
