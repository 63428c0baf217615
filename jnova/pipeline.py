"""The jnova compiler, top to bottom: one named call per stage.

The stages, in order, as `stats()["compile_s"]` times them (`STAGES`; a test checks this list
against it and against the calls):

    trace                the step's fwd + bwd + update as one jaxpr; then the persistent cache
                         (a hit restores the step: `jit` is the only stage left)
    to_nova              one nova function; primitives jnova cannot compile become fallbacks
    verify               every op checks its operands and attributes
    canonicalize         bit-exact local simplifications
    cse                  JAX repeats constants and broadcasts; they are merged
    dce                  what the step does not return is dropped
    raise_attention      attention as written (the softmax form, cuDNN's primitives) becomes
                         nova.attention and nova.attention_backward; the scores are dropped
    excess_precision     the default: 16-bit arithmetic as its f32 form between
                         explicit conversions
    mixed_precision      bf16 contraction operands where asked: precision "bfloat16", or the
                         option `mixed_precision="bf16"` (not for precision "highest")
    raise_training       GELU (forward, backward), LayerNorm, RMSNorm (forward), softmax
                         cross-entropy (forward, backward) as nova ops, where the backend compiles
                         them itself (the CPU's plan of a kernel per run; the cross-entropy also
                         in its plan of a kernel per group); GELU everywhere, since its
                         expansion's backward reads x alone
    rederive_dividends   a softmax's exp(x - max) need not be kept for the backward pass
    expand_attention     attention ops the backend has no kernel for become generic nova ops
    expand_training      training ops (nova.gelu, nova.layernorm, ...) the backend refuses, likewise
    split_sce            GPU: a cross-entropy's mean or sum over rows as a reduction after its row kernel
    split_attention      GPU: each attention backward kept whole as its dQ and dK/dV halves
    lead_batch_dims      GPU: contraction operands the kernels cannot read in place, transposed (batch dims first)
    align_contractions   per-group plans: contraction operands in whole 16-byte rows
    split_contractions   GPU: contractions whose tiles leave SMs idle as partial products over K
    transpose_reductions  GPU: a reduction over middle dims reads its operand transposed (leading or innermost)
    split_reductions     GPU: reductions into fewer rows than SMs, or into few columns over many rows, as
                         partial reductions, then their sum
    transpose_operands   GPU: TF32 operands made K-major where a transpose kernel pays for itself
    fuse                 fusion groups, with a reason for every refused fusion
    view_attention_operands  per-group plans: attention kernels read q, k, v (o, do) where they lie
                         in a larger buffer (a fused projection's slices) instead of from copies
    attention_writes_concatenation  per-group plans: the dK/dV kernel writes dk and dv into the
                         concatenation of the gradients (and copies dq there), not a kernel of its own
    form_kernels         the plan: GPU, a kernel per group (neighbours merged, terminal kernels
                         batched); CPU, a kernel per run of ops between fallbacks
    fold_roundings       excess precision: a value rounded to 16 bits and widened inside one kernel
                         is read unrounded there
    bucket_all_reduces   data parallel: all-reduces in buckets, each after its last operand
    reuse_buffers        outputs written into the buffers of inputs that die at their kernel
                         (then the in-memory cache, by structural hash: a hit skips code generation)
    to_linalg            CPU: each kernel as a destination-passing linalg function
    lower_cpu            CPU: bufferization, loops, the LLVM dialect (in the isolated worker)
    jit_llvm             CPU: LLVM's ORC JIT through the MLIR ExecutionEngine
    to_ptx               GPU: each kernel's gpu.module from its builder, then PTX
    jit                  the step function of kernel binds and fallback ops, under jax.jit
    xla_lower            XLA lowers the step as the user calls it (`Executable.prepare`)
    xla_compile          XLA compiles it

`compile_step` returns an `Executable`; `jnova.compile` (api.py) calls it once per new input
signature and keeps the result.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import jax
from jax import ensure_compile_time_eval as eager_jax_ops  # JAX ops on concrete values run, even under a trace
import numpy as np

from jnova.capture.to_nova import MAX_INLINE_CONSTANT, find_site, large_constants, to_nova
from jnova.capture.trace import Captured, trace
from jnova.dialect.ir import print_func_texts
from jnova.dialect.types import numpy_dtype
from jnova.options import Options
from jnova.passes.canonicalize import canonicalize
from jnova.passes.cse import cse
from jnova.passes.dce import dce
from jnova.passes.expand_attention import expand_refused_attention
from jnova.passes.excess_precision import fold_rounding_pairs, widen_16bit_arithmetic
from jnova.passes.expand_training import expand_refused_training
from jnova.passes.raise_attention import raise_attention
from jnova.passes.raise_cross_entropy import raise_cross_entropy
from jnova.passes.raise_training import raise_training
from jnova.primitives.nova_to_jax import evaluate_op
from jnova.passes.split_attention_backward import split_attention_backward
from jnova.passes.split_sce_reductions import split_sce_reductions
from jnova.passes.form_kernels import form_plan
from jnova.passes.plan import Kernel, plan_to_json
from jnova.passes.fuse import fuse
from jnova.passes.align_contractions import align_contractions
from jnova.passes.bucket_all_reduces import bucket_all_reduces, describe_buckets
from jnova.passes.mixed_precision import demote_contractions
from jnova.passes.rederive_dividends import rederive_dividends
from jnova.passes.reuse_buffers import reuse_buffers
from jnova.passes.split_contractions import split_contractions
from jnova.passes.lead_batch_dims import lead_batch_dims
from jnova.passes.split_reductions import split_reductions
from jnova.passes.transpose_reductions import transpose_reductions
from jnova.passes.transpose_operands import transpose_operands
from jnova.passes.view_attention_operands import view_attention_operands
from jnova.passes.attention_writes_concatenation import attention_writes_concatenation
from jnova.primitives import backends
from jnova.primitives.executor import step_function
from jnova.runtime import collector, launcher, user_code
from jnova.runtime.cache import ARTIFACTS
from jnova.runtime.disk_cache import cache_dir, open_cache
from jnova.runtime.dump import StepDump
from jnova.runtime.hashing import jaxpr_fingerprint, structural_hash
from jnova.runtime.jax_internals import compile_with_buffer_dump
from jnova.memory_report import MemoryReport, memory_report

log = logging.getLogger("jnova")

STAGES = ("trace", "to_nova", "verify", "canonicalize", "cse", "dce", "raise_attention", "excess_precision",
          "mixed_precision", "raise_training", "rederive_dividends", "expand_attention", "expand_training",
          "split_sce", "split_attention", "lead_batch_dims", "align_contractions", "split_contractions",
          "transpose_reductions", "split_reductions", "transpose_operands", "fuse", "view_attention_operands",
          "attention_writes_concatenation", "form_kernels",
          "fold_roundings", "bucket_all_reduces", "reuse_buffers", "to_linalg", "lower_cpu", "jit_llvm", "to_ptx", "jit",
          "xla_lower", "xla_compile")


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
    dump: StepDump | None = None  # where JNOVA_DUMP_DIR keeps this step's stages (None: not dumped)
    donated_arguments: tuple = ((), ())  # (dynamic positions, keyword names) the call donates
    named_as: tuple | None = None  # (name, signature of the dynamic arguments) of the user's function

    def prepare(self, args, kwargs, donate_argnums: tuple[int, ...], donate_argnames: tuple[str, ...],
                xla_options: dict | None) -> None:
        """Lower and compile with XLA (timing "xla_lower" and "xla_compile") the step that takes the
        arguments as the user passes them: `call`, jax's compiled object, whose C++ dispatch flattens
        the pytrees and checks their types. Called as `fn` is, it runs `run` (inlined)."""
        step = _pytree_step(self.run, self.captured.out_tree, self.named_as)
        jitted = jax.jit(step, donate_argnums=donate_argnums, donate_argnames=donate_argnames,
                         compiler_options=xla_options)
        with collector.paused():
            with _stage(self.times, "xla_lower"):
                lowered = jitted.lower(*args, **kwargs)
            with _stage(self.times, "xla_compile"):
                self.call = lowered.compile()
        log.info("jnova: XLA lowered the step in %.2f s and compiled it in %.2f s",
                 self.times["xla_lower"], self.times["xla_compile"])

    def memory(self, args, kwargs, donate_argnums: tuple[int, ...], donate_argnames: tuple[str, ...],
               xla_options: dict | None) -> MemoryReport:
        """The memory report of the step XLA compiles for these arguments (memory_report.py): the step is
        compiled as `prepare` compiles it, with XLA's dump of its buffer plan on. Written to the step's
        dump folder as memory.txt and memory.json when JNOVA_DUMP_DIR is set."""
        step = _pytree_step(self.run, self.captured.out_tree, self.named_as)
        with collector.paused():
            lowered = jax.jit(step, donate_argnums=donate_argnums, donate_argnames=donate_argnames).lower(*args, **kwargs)
            compiled, texts = compile_with_buffer_dump(lowered, xla_options)
        report = memory_report(texts, compiled.memory_analysis(), self.meta["plan"])
        if self.dump is None:
            self.dump = StepDump("step", self.key)
        self.dump.write("memory", ".txt", str(report))
        self.dump.write("memory", ".json", report.to_json())
        log.info("jnova: the step's peak is %.1f MB (%s)", report.peak_bytes / 1e6,
                 ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in report.by_kind().items()))
        return report

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
        """Every name `as_text` takes."""
        return sorted(["jaxpr", "hlo", "buckets", *self.texts])

    def as_text(self, stage: str) -> str:
        if stage == "hlo":            # the jitted step as XLA sees it, for the step's backend
            return self.lowered_hlo()
        if stage == "buckets":        # the data-parallel all-reduce buckets (passes/bucket_all_reduces.py)
            return self.meta.get("buckets", "no bucket plan was recorded for this step\n")
        if stage == "jaxpr":          # printed only now: a large step's jaxpr takes a while to print
            return self.captured.jaxpr_text
        if stage not in self.texts:
            raise ValueError(f"unknown stage {stage!r}; this step has {self.stages}")
        return self.texts[stage]

    def lowered_hlo(self) -> str:
        platform = "cuda" if self.meta["backend"] == "gpu" else "cpu"
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.captured.in_avals]
        return self.run.trace(*avals).lower(lowering_platforms=(platform,)).as_text()


@contextmanager
def _stage(times: dict, name: str):
    if name not in STAGES:
        raise ValueError(f"jnova: {name!r} is not a compile stage (pipeline.STAGES)")
    start = time.perf_counter()
    yield
    times[name] = times.get(name, 0.0) + time.perf_counter() - start
    log.debug("stage %-18s %8.1f ms", name, 1e3 * times[name])


def compile_step(fn: Callable, args: tuple, kwargs: dict, options: Options, backend: str,
                 target=None, donate: tuple[int, ...] = (), *, static_argnums: tuple[int, ...] = (),
                 static_argnames: tuple[str, ...] = ()) -> Executable:
    """Compile `fn` for these arguments (static ones as values); `donate` are the flat indices of the
    donated dynamic leaves."""
    times: dict[str, float] = {}
    stage = functools.partial(_stage, times)
    if backend == "gpu" and target is not None:  # kernels take TMA descriptors only where jnova's launcher builds them
        target = dataclasses.replace(target, tensor_maps=launcher.tensor_maps_available())
    target_key = target.cache_key if target is not None else "cpu"
    with collector.paused():            # (tracing allocates ~1M short-lived objects: collector.py)
        with stage("trace"):
            captured = trace(fn, args, kwargs, static_argnums, static_argnames)
        disk = open_cache()
        disk_key = capture_key(captured, options, target_key, donate)
        entry = disk.load(disk_key) if disk else None
        if entry is not None:           # compiled by an earlier process: skip the nova pipeline
            try:
                return _restore(entry, captured, disk_key, donate, stage, times, options)
            except Exception as e:  # an entry this jnova cannot use (format, or a bug): recompile
                user_code.warn(f"jnova: cannot use the cached entry {disk_key[:12]} ({type(e).__name__}: {e}); "
                               "recompiling")
                disk.discard(disk_key)
    with stage("to_nova"):
        program = to_nova(captured, fallback=options.fallback, platforms=("cuda",) if backend == "gpu" else ("cpu",))
    func = program.func
    with stage("verify"):
        func.verify()
    with stage("canonicalize"):
        canonicalize(func)
    with stage("cse"):
        cse(func)
    with stage("dce"):
        effect_sites = {i for i, e in enumerate(program.sites) if e.effects}
        dce(func, keep_sites=effect_sites)
    with stage("raise_attention"):
        if raise_attention(func, program.sites):
            canonicalize(func)              # the transposes around the raised ops cancel
            dce(func, keep_sites=effect_sites)  # the scores and probabilities the raised ops replace
        program.fallbacks = {name: why for name, why in program.fallbacks.items()
                             if any(op.name == "nova.fallback" and op.attrs["primitive"] == name for op in func.ops)}
    if options.excess_precision:        # after raising: its f32 forms would hide a bf16 softmax from the matcher
        with stage("excess_precision"):
            widen_16bit_arithmetic(func)
    with stage("mixed_precision"):
        demote_contractions(func, precisions=("default", "bfloat16") if options.mixed_precision == "bf16"
                            else ("bfloat16",))
        dce(func, keep_sites=effect_sites)  # what the rewrites above leave unread
    per_group = options.kernels == "fused" or (options.kernels == "auto" and backend == "gpu")
    # where the backend keeps the ops (raised and expanded again, the decomposition replaces the user's
    # formula) and GELU (backends.py). The probes are computed by JAX ops on NumPy values, eagerly even
    # where the step is first called inside jax.jit or lax.scan (whose trace would stage them)
    with stage("raise_training"), eager_jax_ops():
        raised = {}
        training_ops = backends.raised_training_ops(backend, per_group)
        if training_ops:
            raised.update(raise_training(func, evaluate_op, training_ops))
        if backends.keeps_training_op("nova.sce", backend, per_group):
            raised.update(raise_cross_entropy(func, evaluate_op))
        if raised:                      # the softmax and exponentials the raised ops replace
            dce(func, keep_sites=effect_sites)
    with stage("rederive_dividends"):
        rederive_dividends(func)
    with stage("expand_attention"):
        expand_refused_attention(func, backends.attention_refusal(backend, target))
    with stage("expand_training"):
        expand_refused_training(func, backends.training_refusal(backend, target, per_group))
    if backend == "gpu":
        with stage("split_sce"):        # the cross-entropy kernels compute rows; their mean is a reduction
            split_sce_reductions(func)
        with stage("split_attention"):  # the fused attention backward as its two kernels' ops
            split_attention_backward(func, lambda op: True)
    if per_group and backend == "gpu":
        with stage("lead_batch_dims"):
            lead_batch_dims(func)
    if per_group:
        with stage("align_contractions"):
            align_contractions(func)
    if per_group and backend == "gpu":
        with stage("split_contractions"):
            split_contractions(func, target)
        with stage("transpose_reductions"):
            transpose_reductions(func)
        with stage("split_reductions"):
            split_reductions(func, target)
        with stage("transpose_operands"):
            transpose_operands(func, target)
    plain, shown = print_func_texts(func)  # the structure (what the kernels depend on); and with names and
    nova_text = "module {\n" + plain + "\n}\n"  # source locations, for the user
    shown_text = "module {\n" + shown + "\n}\n"
    with stage("fuse"):
        fusion = fuse(func)
    groups = fusion.groups
    if per_group:
        with stage("view_attention_operands"):  # the copies of q, k, v out of a fused projection: dropped
            groups = view_attention_operands(func, groups)
        with stage("attention_writes_concatenation"):  # and the kernel concatenating their gradients
            groups = attention_writes_concatenation(func, groups)
    with stage("form_kernels"):
        plan = form_plan(func, groups, per_group, backends.gpu_kernel_families() if backend == "gpu" else None)
    if options.excess_precision:
        with stage("fold_roundings"):
            fold_rounding_pairs(func, [k for k in plan.kernels if type(k) is Kernel],
                                untouched=[k for k in plan.kernels if type(k) is not Kernel])
    with stage("bucket_all_reduces"):
        plan = bucket_all_reduces(plan, program.sites, options.bucket_bytes)
    families = backends.gpu_kernel_families() if backend == "gpu" else None
    with stage("reuse_buffers"):        # outputs in the buffers of inputs that die at their kernel
        reuse_buffers(plan, donate, families.in_place if families is not None else lambda kernel: True)
    key = structural_hash(nova_text, program.sites, {**options.hash_items(), "donate": donate}, target=target_key)
    compiled = ARTIFACTS.get(key)       # a structurally identical step compiled in this process
    cache_hit = compiled is not None
    if compiled is None:
        compiled = backends.compile_gpu(plan, target, stage) if backend == "gpu" else backends.compile_cpu(plan, stage)
        ARTIFACTS.put(key, compiled)
    plan_json = plan_to_json(plan)
    meta = {"backend": backend, "plan": plan_json, "site_paths": program.site_paths,
            "names": [captured.in_names, captured.out_names],
            "held_constants": [{"dtype": c.dtype.name, "shape": list(c.shape), "hex": c.tobytes().hex()}
                               for c in program.held_constants],
            "fallbacks": program.fallbacks, "nova_ops": len(func.ops), "refused_fusions": fusion.refused,
            "xla_groups": compiled.xla_groups, "buckets": describe_buckets(plan, program.sites)}
    texts = {"nova": shown_text, **compiled.texts}
    if disk:
        disk.store(disk_key, {"meta.json": json.dumps(meta), "nova.mlir": shown_text, **compiled.files})
    with stage("jit"):
        run = jax.jit(step_function(plan_json, program.sites, compiled.handles, program.const_args,
                                    captured.in_avals, captured.out_avals), donate_argnums=donate,
                      compiler_options=dict(options.xla_options) or None)
    dump = _dump(func.name, key, captured, texts, meta, times)
    log.info("jnova compiled %s for %s: %d ops, %d kernels, %d fallbacks%s in %.2f s", func.name,
             target.name if target is not None else "cpu",
             len(func.ops), len(plan.kernels), sum(not isinstance(s, Kernel) for s in plan.steps),
             " (cache hit)" if cache_hit else "", sum(times.values()))
    return Executable(run, captured, meta, key, texts, times, "memory" if cache_hit else None, dump=dump)


def _pytree_step(run: Callable, out_tree, named_as: tuple | None = None) -> Callable:
    """`run` (flat arguments, flat results) called with the user's pytrees and returning theirs. The
    function `run` jits, not `run`: a nested jit may not carry XLA options (jax refuses them). With
    `named_as` (the user's function's name and the signature of its dynamic arguments), jax's errors
    about the arguments (wrong devices, an overflowing integer, an AOT call's shapes) name the user's
    function and arguments, as jax.jit's do, not this wrapper's `args[1]`."""
    flat_step = getattr(run, "__wrapped__", run)

    def step(*args, **kwargs):
        return jax.tree_util.tree_unflatten(out_tree, flat_step(*jax.tree_util.tree_leaves((args, kwargs))))

    if named_as is not None:
        step.__name__ = step.__qualname__ = named_as[0]
        step.__signature__ = named_as[1]
    return step


def capture_key(captured: Captured, options: Options, target_key: str, donate: tuple[int, ...] = ()) -> str:
    """Key of the persistent cache: the jaxpr's fingerprint (structure, shapes, params, literals), the
    values of small captured constants (they are compiled into kernels), the JAX context's matmul
    precision (the jaxpr records "bfloat16" as DEFAULT), options, target and versions."""
    consts = []
    for c in map(np.asarray, captured.consts):
        digest = hashlib.sha256(c.tobytes()).hexdigest() if c.size <= MAX_INLINE_CONSTANT else ""
        consts.append(f"{c.dtype}{c.shape}{digest}")
    context = f"matmul_precision={captured.matmul_precision}"
    return structural_hash(jaxpr_fingerprint(captured.jaxpr) + "\n" + "\n".join(consts) + "\n" + context, [],
                           {**options.hash_items(), "donate": donate}, target=target_key)


def _restore(entry: dict, captured: Captured, key: str, donate, stage, times, options: Options) -> Executable:
    """An Executable from a persistent-cache entry: rebuild kernel handles, rebind fallbacks."""
    meta = json.loads(entry["meta.json"])
    plan_json = meta["plan"]
    restore = backends.restore_gpu if meta["backend"] == "gpu" else backends.restore_cpu
    compiled = restore(entry, plan_json, stage)
    sites = [find_site(captured.jaxpr, tuple(p)) for p in meta["site_paths"]]
    held = [np.frombuffer(bytes.fromhex(c["hex"]), numpy_dtype(c["dtype"])).reshape(c["shape"])
            for c in meta["held_constants"]]
    with stage("jit"):
        run = jax.jit(step_function(plan_json, sites, compiled.handles, large_constants(captured) + held,
                                    captured.in_avals, captured.out_avals), donate_argnums=donate,
                      compiler_options=dict(options.xla_options) or None)
    texts = {"nova": _named_for(entry["nova.mlir"], meta.get("names"), captured), **compiled.texts}
    dump = _dump("step", key, captured, texts, meta, times, restored_from=cache_dir())
    log.info("jnova restored a compiled step from the persistent cache in %.2f s", sum(times.values()))
    return Executable(run, captured, meta, key, texts, times, "disk", dump=dump)


def _named_for(nova_text: str, stored_names, captured: Captured) -> str:
    """The cached nova text with this step's argument and result names. The cache's key is the program's
    structure: a step whose arguments are named otherwise (another function of the same structure) reads
    the entry of the one that stored it. Its names are replaced, and its source locations, which are
    that function's, dropped, with a comment saying so."""
    if stored_names == [captured.in_names, captured.out_names]:
        return nova_text
    from jnova.dialect.parse import parse_module

    func = parse_module(nova_text, verify=False)
    if stored_names is None and func.arg_names[:len(captured.in_names)] == captured.in_names \
            and func.result_names == captured.out_names:
        return nova_text
    func.arg_names = captured.in_names + func.arg_names[len(captured.in_names):]
    func.result_names = list(captured.out_names)
    for op in func.ops:
        op.loc = None
    return ("// restored from jnova's persistent cache, stored by a step of the same structure: the names are\n"
            "// this step's; source locations are not kept (JNOVA_CACHE_DIR=off compiles the step anew)\n"
            "module {\n" + func.print(debug_info=True) + "\n}\n")


def _dump(name: str, key: str, captured: Captured, texts: dict, meta: dict, times: dict,
          restored_from: str | None = None) -> StepDump | None:
    """The step's stages under JNOVA_DUMP_DIR. A step restored from the persistent cache dumps what
    the cache holds (every stage's text, not the passes' times), after a note that says so."""
    dump = StepDump(name, key)
    if dump.path is None:               # dumping is off: do not print the jaxpr for nothing
        return None
    if restored_from is not None:
        dump.write("restored", ".txt", restored_note(key, restored_from))
    dump.write("jaxpr", ".txt", captured.jaxpr_text)
    dump.write("nova", ".mlir", texts["nova"])
    dump.write("plan", ".json", json.dumps(meta["plan"], indent=1))
    dump.write("fusion", ".txt", "\n".join(meta["refused_fusions"]) + "\n")
    for stage_name, ext in (("linalg", ".mlir"), ("llvm", ".mlir"), ("gpu", ".mlir"), ("ptx", ".ptx"),
                            ("launches", ".txt"), ("xla_groups", ".mlir")):
        if stage_name in texts:
            dump.write(stage_name, ext, texts[stage_name])
    dump.write("times", ".json", json.dumps(times, indent=1))
    return dump


def restored_note(key: str, cache_root: str | None) -> str:
    return (f"This step was restored from jnova's persistent cache ({cache_root}), entry {key}.\n"
            "The nova pipeline did not run: the stages in this folder are the ones the cache holds, and\n"
            "times.json has the restore's times, not the passes', and the nova text's source locations are\n"
            "those of the compile that stored the entry.\n"
            "For a full dump, compile without the cache: JNOVA_CACHE_DIR=off (or delete the entry).\n")
