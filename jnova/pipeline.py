"""The jnova compiler, top to bottom: one named call per stage.

    trace -> to_nova -> verify -> canonicalize -> cse -> dce -> form_kernels
          -> (cache lookup by structural hash) -> kernel_to_linalg -> CPU pass pipeline -> JIT
          -> step function of kernel binds and fallback ops, under jax.jit

`compile_step` returns an `Executable`; `jnova.compile` (api.py) calls it once per new input
signature and caches the result.
"""
from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import jax

from jnova.capture.to_nova import Program, to_nova
from jnova.capture.trace import Captured, trace
from jnova.codegen import cpu
from jnova.codegen.linalg.lowering import LoweringError, kernel_to_linalg
from jnova.errors import CompileError
from jnova.options import Options
from jnova.passes.canonicalize import canonicalize
from jnova.passes.cse import cse
from jnova.passes.dce import dce
from jnova.passes.form_kernels import Kernel, Plan, form_kernels
from jnova.primitives.executor import step_function
from jnova.primitives.nova_kernel import KernelHandle
from jnova.runtime.cache import ARTIFACTS
from jnova.runtime.dump import StepDump
from jnova.runtime.hashing import structural_hash

log = logging.getLogger("jnova")


@dataclass
class Executable:
    """A compiled step for one input signature."""

    run: Callable                 # jitted: flat args -> flat outputs
    captured: Captured
    program: Program
    plan: Plan
    key: str                      # structural hash
    texts: dict[str, str]         # stage name -> IR text
    times: dict[str, float] = field(default_factory=dict)
    cache_hit: bool = False

    def stats(self) -> dict:
        """Kernels, ops, fallbacks, cache hit and compile time per stage of this signature."""
        fallbacks = [s.attrs["primitive"] for s in self.plan.steps if not isinstance(s, Kernel)]
        return {"kernels": len(self.plan.kernels), "nova_ops": len(self.program.func.ops),
                "fallbacks": fallbacks, "cache_hit": self.cache_hit, "compile_s": dict(self.times)}

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
    with _stage(times, "to_nova"):      # one nova function; unknown primitives become fallbacks
        program = to_nova(captured, fallback=options.fallback)
    func = program.func
    with _stage(times, "verify"):       # every op checks its operands and attributes
        func.verify()
    with _stage(times, "canonicalize"):  # fold no-op reshapes/converts/broadcasts and the like
        canonicalize(func)
    with _stage(times, "cse"):          # JAX repeats constants and broadcasts; merge them
        cse(func)
    with _stage(times, "dce"):          # drop what the step does not return
        dce(func, keep_sites={i for i, e in enumerate(program.sites) if e.effects})
    nova_text = func.print()
    with _stage(times, "form_kernels"):  # kernels are the runs between fallback ops
        plan = form_kernels(func)
    key = structural_hash(nova_text, program.sites, options.hash_items(), target=options.backend or "cpu")
    dump = StepDump(func.name, key)
    dump.write("jaxpr", ".txt", str(captured.jaxpr))
    dump.write("nova", ".mlir", "module {\n" + nova_text + "\n}\n")
    dump.write("plan", ".json", json.dumps(describe_plan(plan), indent=1))
    compiled = ARTIFACTS.get(key)
    cache_hit = compiled is not None
    if compiled is None:
        compiled = _compile_kernels(plan, times)
        ARTIFACTS.put(key, compiled)
    dump.write("linalg", ".mlir", compiled.linalg)
    dump.write("llvm", ".mlir", compiled.llvm)
    with _stage(times, "jit"):          # the step: kernel binds + fallback ops, planned by XLA
        run = jax.jit(step_function(plan, program.sites, compiled.handles, program.const_args), donate_argnums=donate)
    dump.write("times", ".json", json.dumps(times, indent=1))
    texts = {"jaxpr": str(captured.jaxpr), "nova": "module {\n" + nova_text + "\n}\n",
             "linalg": compiled.linalg, "llvm": compiled.llvm}
    log.info("jnova compiled %s: %d ops, %d kernels, %d fallbacks%s in %.2f s", func.name, len(func.ops),
             len(plan.kernels), len(plan.steps) - len(plan.kernels), " (cache hit)" if cache_hit else "",
             sum(times.values()))
    return Executable(run, captured, program, plan, key, texts, times, cache_hit)


def describe_plan(plan: Plan) -> list[dict]:
    """The plan as JSON-able records: each kernel's op counts and I/O types, each fallback's primitive."""
    steps = []
    for step in plan.steps:
        if isinstance(step, Kernel):
            steps.append({"kernel": step.name, "ops": len(step.ops),
                          "inputs": [str(v.type) for v in step.inputs], "outputs": [str(v.type) for v in step.outputs]})
        else:
            steps.append({"fallback": step.attrs["primitive"], "site": step.attrs["site"]})
    return steps


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
    handles = {}
    for k in plan.kernels:
        out_types = [v.type for v in k.outputs]
        run = (lambda name, types: lambda *xs: executable.run(name, list(xs), types))(k.name, out_types)
        handles[k.name] = KernelHandle(k.name, out_types, "cpu", run)
    return _CompiledKernels(handles, linalg, llvm)
