"""The jnova compiler, top to bottom: one named call per stage.

    trace -> (persistent cache: restore and stop here on a hit)
          -> to_nova -> verify -> canonicalize -> cse -> (mixed precision) -> dce
          -> (GPU plan: align, split_k, transpose) -> fuse -> form_kernels -> bucket_all_reduces
          -> (in-memory cache by structural hash)
          -> CPU: kernel_to_linalg -> CPU pass pipeline -> LLVM JIT
             GPU: per kernel, a gpu.module from its builder -> PTX
          -> step function of kernel binds and fallback ops, under jax.jit

`compile_step` returns an `Executable`; `jnova.compile` (api.py) calls it once per new input
signature and keeps the result.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import jax
import numpy as np

from jnova.capture.to_nova import MAX_INLINE_CONSTANT, find_site, large_constants, to_nova
from jnova.capture.trace import Captured, trace
from jnova.options import Options
from jnova.passes.canonicalize import canonicalize
from jnova.passes.cse import cse
from jnova.passes.dce import dce
from jnova.passes.form_kernels import (Kernel, batch_terminal_kernels, form_kernels, gpu_batchable,
                                      gpu_mergeable, kernels_from_fusion, merge_neighbours, plan_to_json,
                                      split_contraction_epilogues)
from jnova.passes.fuse import fuse
from jnova.passes.align_contractions import align_contractions
from jnova.passes.bucket_all_reduces import bucket_all_reduces
from jnova.passes.mixed_precision import demote_contractions
from jnova.passes.rederive_dividends import rederive_dividends
from jnova.passes.split_contractions import split_contractions
from jnova.passes.transpose_operands import transpose_operands
from jnova.primitives import backends
from jnova.primitives.executor import step_function
from jnova.runtime import collector, launcher
from jnova.runtime.cache import ARTIFACTS
from jnova.runtime.disk_cache import open_cache
from jnova.runtime.dump import StepDump
from jnova.runtime.hashing import jaxpr_fingerprint, structural_hash

log = logging.getLogger("jnova")


@dataclass
class Executable:
    """A compiled step for one input signature."""

    run: Callable                 # jitted: flat args -> flat outputs
    captured: Captured
    meta: dict                    # plan (JSON form), fallback sites and reasons, op count
    key: str                      # structural hash
    texts: dict[str, str]         # stage name -> IR text (the "jaxpr" stage is printed when asked for)
    times: dict[str, float] = field(default_factory=dict)
    cache_hit: str | None = None  # None, "memory" (same structure in this process) or "disk"
    call: Callable | None = None  # jax's compiled step, called with the user's pytrees (`prepare`)

    def prepare(self, args, kwargs, donate_argnums: tuple[int, ...], xla_options: dict | None) -> None:
        """Lower and compile with XLA (timing "xla_lower" and "xla_compile") the step that takes the
        arguments as the user passes them: `call`, jax's compiled object, whose C++ dispatch flattens
        the pytrees and checks their types. Called as `fn` is, it runs `run` (inlined)."""
        step = _pytree_step(self.run, self.captured.out_tree)
        jitted = jax.jit(step, donate_argnums=donate_argnums, compiler_options=xla_options)
        with collector.paused():
            with _stage(self.times, "xla_lower"):
                lowered = jitted.lower(*args, **kwargs)
            with _stage(self.times, "xla_compile"):
                self.call = lowered.compile()
        log.info("jnova: XLA lowered the step in %.2f s and compiled it in %.2f s",
                 self.times["xla_lower"], self.times["xla_compile"])

    def stats(self) -> dict:
        """Kernels, ops, fallbacks, cache hit and compile time per stage of this signature."""
        steps = self.meta["plan"]["steps"]
        return {"backend": self.meta["backend"], "kernels": sum("kernel" in s for s in steps),
                "views": sum("view" in s for s in steps),
                "nova_ops": self.meta["nova_ops"], "fallbacks": [s["fallback"] for s in steps if "fallback" in s],
                "all_reduce_buckets": [len(s["in"]) for s in steps if "bucket" in s],
                "xla_groups": len(self.meta["xla_groups"]), "cache_hit": self.cache_hit,
                "compile_s": dict(self.times)}

    @property
    def stages(self) -> list[str]:
        return sorted(["jaxpr", *self.texts])

    def as_text(self, stage: str) -> str:
        if stage == "hlo":            # the jitted step as XLA sees it, for the step's backend
            return self.lowered_hlo()
        if stage == "jaxpr":          # printed only now: a large step's jaxpr takes a while to print
            return self.captured.jaxpr_text
        if stage not in self.texts:
            raise ValueError(f"unknown stage {stage!r}; this step has {self.stages + ['hlo']}")
        return self.texts[stage]

    def lowered_hlo(self) -> str:
        platform = "cuda" if self.meta["backend"] == "gpu" else "cpu"
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.captured.in_avals]
        return self.run.trace(*avals).lower(lowering_platforms=(platform,)).as_text()


@contextmanager
def _stage(times: dict, name: str):
    start = time.perf_counter()
    yield
    times[name] = times.get(name, 0.0) + time.perf_counter() - start
    log.debug("stage %-14s %8.1f ms", name, 1e3 * times[name])


def compile_step(fn: Callable, args: tuple, kwargs: dict, options: Options, backend: str,
                 target=None, donate: tuple[int, ...] = ()) -> Executable:
    times: dict[str, float] = {}
    stage = functools.partial(_stage, times)
    target_name = target.name if target is not None else "cpu"
    if backend == "gpu" and not launcher.tensor_maps_available():  # kernels that take TMA descriptors are
        target_name += " without tensor maps"  # chosen only where jnova's launcher can build them: part of the keys
    with collector.paused():            # (tracing allocates ~1M short-lived objects: collector.py)
        with stage("trace"):            # capture: fwd + bwd + update as one jaxpr
            captured = trace(fn, args, kwargs)
        disk = open_cache()
        disk_key = capture_key(captured, options, target_name)
        entry = disk.load(disk_key) if disk else None
        if entry is not None:           # compiled by an earlier process: skip the nova pipeline
            try:
                return _restore(entry, captured, disk_key, donate, stage, times, options)
            except Exception as e:  # an entry this jnova cannot use (format, or a bug): recompile
                warnings.warn(f"jnova: cannot use the cached entry {disk_key[:12]} ({type(e).__name__}: {e}); "
                              "recompiling", stacklevel=2)
                disk.discard(disk_key)
    with stage("to_nova"):              # one nova function; unknown primitives become fallbacks
        program = to_nova(captured, fallback=options.fallback)
    func = program.func
    with stage("verify"):               # every op checks its operands and attributes
        func.verify()
    with stage("canonicalize"):         # bit-exact local simplifications
        canonicalize(func)
    with stage("cse"):                  # JAX repeats constants and broadcasts; merge them
        cse(func)
    if options.mixed_precision == "bf16":
        with stage("mixed_precision"):  # opt-in: contraction operands in bf16, f32 accumulation
            demote_contractions(func)
    with stage("dce"):                  # drop what the step does not return
        dce(func, keep_sites={i for i, e in enumerate(program.sites) if e.effects})
    with stage("rederive"):             # a softmax's exp(x - max) need not be kept for the backward
        rederive_dividends(func)
    per_group = options.kernels == "fused" or (options.kernels == "auto" and backend == "gpu")
    if per_group:
        with stage("align"):            # the GPU plan: contraction operands in whole 16-byte rows
            align_contractions(func)
    if per_group and backend == "gpu":
        with stage("split_k"):          # weight gradients that leave SMs idle: partial products over K
            split_contractions(func, target)
        with stage("transpose"):        # TF32: K-major operands where a transpose kernel pays for itself
            transpose_operands(func, target)
    nova_text = "module {\n" + func.print() + "\n}\n"
    with stage("fuse"):                 # fusion groups, with a reason for every refused fusion
        fusion = fuse(func)
    with stage("form_kernels"):         # GPU: a kernel per group; CPU: per run between fallbacks
        groups = fusion.groups
        if backend == "gpu":            # epilogues the matmuls cannot take split off; neighbours that
            groups = merge_neighbours(func, split_contraction_epilogues(groups), gpu_mergeable)  # share rows merged
        plan = kernels_from_fusion(func, groups) if per_group else form_kernels(func)
        if per_group and backend == "gpu":  # an optimizer's per-leaf updates: a few launches, not one per leaf
            plan = batch_terminal_kernels(plan, gpu_batchable)
    with stage("bucket_all_reduces"):   # data parallel: all-reduces in buckets, each after its last operand
        plan = bucket_all_reduces(plan, program.sites, options.bucket_bytes)
    key = structural_hash(nova_text, program.sites, options.hash_items(), target=target_name)
    compiled = ARTIFACTS.get(key)       # a structurally identical step compiled in this process
    cache_hit = compiled is not None
    if compiled is None:
        compiled = backends.compile_gpu(plan, target, stage) if backend == "gpu" else backends.compile_cpu(plan, stage)
        ARTIFACTS.put(key, compiled)
    plan_json = plan_to_json(plan)
    meta = {"backend": backend, "plan": plan_json, "site_paths": program.site_paths,
            "fallbacks": program.fallbacks, "nova_ops": len(func.ops), "refused_fusions": fusion.refused,
            "xla_groups": compiled.xla_groups}
    texts = {"nova": nova_text, **compiled.texts}
    if disk:
        disk.store(disk_key, {"meta.json": json.dumps(meta), "nova.mlir": nova_text, **compiled.files})
    with stage("jit"):                  # the step: kernel binds + fallback ops, planned by XLA
        run = jax.jit(step_function(plan_json, program.sites, compiled.handles, program.const_args,
                                    captured.in_avals, captured.out_avals), donate_argnums=donate,
                      compiler_options=dict(options.xla_options) or None)
    _dump(func.name, key, captured, texts, meta, times)
    log.info("jnova compiled %s for %s: %d ops, %d kernels, %d fallbacks%s in %.2f s", func.name, target_name,
             len(func.ops), len(plan.kernels), sum(not isinstance(s, Kernel) for s in plan.steps),
             " (cache hit)" if cache_hit else "", sum(times.values()))
    return Executable(run, captured, meta, key, texts, times, "memory" if cache_hit else None)


def _pytree_step(run: Callable, out_tree) -> Callable:
    """`run` (flat arguments, flat results) called with the user's pytrees and returning theirs. The
    function `run` jits, not `run`: a nested jit may not carry XLA options (jax refuses them)."""
    flat_step = getattr(run, "__wrapped__", run)

    def step(*args, **kwargs):
        return jax.tree_util.tree_unflatten(out_tree, flat_step(*jax.tree_util.tree_leaves((args, kwargs))))

    return step


def capture_key(captured: Captured, options: Options, target_name: str) -> str:
    """Key of the persistent cache: the jaxpr's fingerprint (structure, shapes, params, literals), the
    values of small captured constants (they are compiled into kernels), options, target and versions."""
    consts = []
    for c in map(np.asarray, captured.consts):
        digest = hashlib.sha256(c.tobytes()).hexdigest() if c.size <= MAX_INLINE_CONSTANT else ""
        consts.append(f"{c.dtype}{c.shape}{digest}")
    return structural_hash(jaxpr_fingerprint(captured.jaxpr) + "\n" + "\n".join(consts), [], options.hash_items(),
                           target=target_name)


def _restore(entry: dict, captured: Captured, key: str, donate, stage, times, options: Options) -> Executable:
    """An Executable from a persistent-cache entry: rebuild kernel handles, rebind fallbacks."""
    meta = json.loads(entry["meta.json"])
    plan_json = meta["plan"]
    restore = backends.restore_gpu if meta["backend"] == "gpu" else backends.restore_cpu
    compiled = restore(entry, plan_json, stage)
    sites = [find_site(captured.jaxpr, tuple(p)) for p in meta["site_paths"]]
    with stage("jit"):
        run = jax.jit(step_function(plan_json, sites, compiled.handles, large_constants(captured),
                                    captured.in_avals, captured.out_avals), donate_argnums=donate,
                      compiler_options=dict(options.xla_options) or None)
    texts = {"nova": entry["nova.mlir"], **compiled.texts}
    log.info("jnova restored a compiled step from the persistent cache in %.2f s", sum(times.values()))
    return Executable(run, captured, meta, key, texts, times, "disk")


def _dump(name: str, key: str, captured: Captured, texts: dict, meta: dict, times: dict) -> None:
    dump = StepDump(name, key)
    if dump.path is None:               # dumping is off: do not print the jaxpr for nothing
        return
    dump.write("jaxpr", ".txt", captured.jaxpr_text)
    dump.write("nova", ".mlir", texts["nova"])
    dump.write("plan", ".json", json.dumps(meta["plan"], indent=1))
    dump.write("fusion", ".txt", "\n".join(meta["refused_fusions"]) + "\n")
    for stage_name, ext in (("linalg", ".mlir"), ("llvm", ".mlir"), ("gpu", ".mlir"), ("ptx", ".ptx"),
                            ("xla_groups", ".mlir")):
        if stage_name in texts:
            dump.write(stage_name, ext, texts[stage_name])
    dump.write("times", ".json", json.dumps(times, indent=1))
