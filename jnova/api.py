"""`jnova.compile`: the user-facing entry point."""
from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Sequence

import jax

from jnova.options import Options
from jnova.runtime.jax_internals import varying_axes

log = logging.getLogger("jnova")


def compile(fn: Callable, *, mixed_precision: str | None = None, backend: str | None = None,
            fallback: str = "xla", bucket_bytes: int = 25 * 2**20, target: str | None = None,
            donate_argnums: int | Sequence[int] = (), kernels: str = "auto",
            xla_options: dict | None = None) -> "CompiledStep":
    """Compile a JAX training step with jnova; returns a callable with `fn`'s signature.

    Args:
      fn: anything `jax.make_jaxpr` can trace (plain, `jax.jit`-wrapped, `jax.value_and_grad`, a step
        with an optax update). Arguments and results are pytrees of arrays.
      mixed_precision: None, or "bf16" to run contraction operands in bfloat16 (GPU backend).
      backend: None (the platform of the inputs), "cpu" or "gpu".
      fallback: "xla" runs primitives jnova cannot compile as ordinary JAX ops (one warning each);
        "error" raises instead, naming the primitive and the source line.
      bucket_bytes: the most bytes of one all-reduce bucket in a data-parallel step (shard_map or pmap
        around the compiled step): the step's all-reduces run as buckets of their operands, each right
        after its last operand is computed (passes/bucket_all_reduces.py).
      target: a GPU name ("h200", ...) to compile ahead of time without a GPU.
      donate_argnums: positional arguments whose buffers the step may reuse (as in `jax.jit`).
      kernels: "auto"; "fused" compiles one kernel per fusion group (the GPU's plan; on the CPU this
        tests the fusion plan), "segments" one kernel per run of ops between fallbacks (the CPU's).
      xla_options: XLA compile options for the step around jnova's kernels (`jax.jit`'s
        compiler_options), e.g. {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL"}.
    """
    if not callable(fn):
        raise TypeError(f"jnova.compile expects a callable, got {type(fn).__name__}")
    options = Options(mixed_precision=mixed_precision, backend=backend, fallback=fallback,
                      bucket_bytes=bucket_bytes, target=target, kernels=kernels,
                      xla_options=Options.xla_pairs(xla_options))
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    return CompiledStep(fn, options, donate)


class CompiledStep:
    """A jnova-compiled step. Call it like `fn`; `.lower(*args)` exposes every stage's IR."""

    def __init__(self, fn: Callable, options: Options, donate_argnums: tuple[int, ...]):
        self.fn = fn
        self.options = options
        self.donate_argnums = donate_argnums
        self._executables: dict = {}
        self._last = None  # the compiled step (jax's) of the signature called last
        self.compile_count = 0
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        # The last signature's compiled step first: jax's C++ dispatch flattens the arguments and checks
        # their types, as for a jax.jit call (jnova's own dispatch in Python cost ~0.8 ms a GPT-2 step).
        last = self._last
        if last is not None:
            try:
                return _call_compiled(last, args, kwargs)
            except _DeletedArgumentError:
                raise
            except (TypeError, ValueError):  # other types, structure, devices or tracers: jnova's dispatch
                pass
        flat, tree = jax.tree_util.tree_flatten((args, kwargs))
        executable = self._executable(args, kwargs, flat, tree)
        if any(isinstance(x, jax.core.Tracer) for x in flat):  # inside a transformation: jax compiles
            return jax.tree_util.tree_unflatten(executable.captured.out_tree, executable.run(*flat))
        self._last = self._prepared(executable, args, kwargs)
        return _call_compiled(executable.call, args, kwargs)

    def _prepared(self, executable, args, kwargs):
        """The executable's compiled step (jax's), compiled by XLA now unless it was before."""
        if executable.call is None:
            executable.prepare(args, kwargs, self.donate_argnums, dict(self.options.xla_options) or None)
        return executable.call

    def stats(self) -> list[dict]:
        """One record per compiled input signature (see `Executable.stats`)."""
        return [e.stats() for e in self._executables.values()]

    def lower(self, *args, **kwargs) -> "Lowered":
        """The compiled stages of the step for these arguments (arrays, or jax.ShapeDtypeStruct), as
        `jax.jit(fn).lower`: `.as_text(stage)`, `.stats()`, and `.compile()` for XLA's executable."""
        return Lowered(self._executable(args, kwargs), self, args, kwargs)

    def _executable(self, args, kwargs, flat=None, tree=None):
        _configure_logging()
        if flat is None:
            flat, tree = jax.tree_util.tree_flatten((args, kwargs))
        avals = tuple(map(_signature, flat))
        backend = self.options.backend or ("gpu" if self.options.target else _platform_of(flat))
        key = (tree, avals, backend)
        executable = self._executables.get(key)
        if executable is None:
            from jnova.pipeline import compile_step

            if backend not in ("cpu", "gpu"):
                raise NotImplementedError(f"jnova has no backend for the {backend!r} platform (cpu and gpu only)")
            target = None
            if backend == "gpu":
                from jnova.runtime import launcher
                from jnova.runtime.target import get_target

                target = get_target(self.options.target)
                launcher.choice()  # loads and registers the launcher now, before JAX lowers the step
            donate = _flat_donate(args, self.donate_argnums)
            executable = compile_step(self.fn, args, kwargs, self.options, backend, target, donate)
            self.compile_count += 1
            self._executables[key] = executable
        return executable


class Lowered:
    """The stages of one compiled signature: `.as_text(stage)` for "jaxpr", "nova", then "linalg" and
    "llvm" (CPU) or "gpu" and "ptx" (GPU), and "hlo" (the jitted step as XLA sees it)."""

    def __init__(self, executable, step: CompiledStep | None = None, args=(), kwargs=None):
        self.executable = executable
        self._step, self._args, self._kwargs = step, args, kwargs or {}

    def compile(self):
        """Compile the step around jnova's kernels with XLA now (ahead of the first call, as
        `jax.jit(fn).lower(...).compile()`), and return jax's compiled object for this signature:
        called with the user's arguments, it runs the step. Calls of the jnova step with this signature
        then use it."""
        if self._step is None:
            raise ValueError("this Lowered was made without the step's arguments; use CompiledStep.lower(*args)")
        return self._step._prepared(self.executable, self._args, self._kwargs)

    def as_text(self, stage: str = "nova") -> str:
        return self.executable.as_text(stage)

    def stats(self) -> dict:
        return self.executable.stats()

    @property
    def stages(self) -> list[str]:
        return self.executable.stages


def _signature(x) -> tuple:
    """(shape, dtype, weak type) of an argument as jax.jit sees it. Runs on every call, once per
    leaf: an array (or tracer) gives its shape, dtype and weak type as is, without the conversions
    `abstract` makes for NumPy arrays and Python scalars (a GPT-2 step has ~450 leaves: 0.14 ms per
    call; reading each leaf's aval took 0.37 ms, converting each to a ShapeDtypeStruct 4 ms)."""
    if isinstance(x, jax.core.Tracer):  # inside shard_map, which mesh axes it varies over is its type too
        return x.shape, x.dtype, x.weak_type, varying_axes(jax.typeof(x))
    try:  # a jax.Array: 0.3 us a leaf, 0.8 through .aval
        return x.shape, x.dtype, x.weak_type
    except AttributeError:
        from jnova.capture.trace import abstract

        aval = abstract(x)
    return tuple(aval.shape), aval.dtype, bool(aval.weak_type)


def _platform_of(flat_args) -> str:
    for x in flat_args:
        if isinstance(x, jax.Array):
            try:
                platform = next(iter(x.devices())).platform
            except Exception:
                continue
            return "gpu" if platform in ("gpu", "cuda", "rocm") else platform
    platform = jax.default_backend()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


class _DeletedArgumentError(ValueError):
    """An argument's buffer was deleted or donated: jax.jit raises ValueError for it."""


def _call_compiled(call, args, kwargs):
    """jax's compiled step called; a donated argument used again raises jax.jit's ValueError (jax's
    compiled objects raise a RuntimeError). Types or structure it does not take raise TypeError."""
    try:
        return call(*args, **kwargs)
    except RuntimeError as e:
        if "has been deleted" in str(e):
            raise _DeletedArgumentError(f"an argument's buffer has been deleted or donated (to an earlier call of "
                                       f"the step, with donate_argnums): {e}") from e
        raise


def _flat_donate(args, donate_argnums) -> tuple[int, ...]:
    """Flat leaf indices of the donated positional arguments."""
    if not donate_argnums:
        return ()
    out, offset = [], 0
    for i, a in enumerate(args):
        n = len(jax.tree_util.tree_leaves(a))
        if i in donate_argnums:
            out.extend(range(offset, offset + n))
        offset += n
    return tuple(out)


_LOGGING_SET = False


def _configure_logging():
    """Honour JNOVA_LOG (a logging level name) once."""
    global _LOGGING_SET
    if _LOGGING_SET:
        return
    _LOGGING_SET = True
    level = os.environ.get("JNOVA_LOG")
    if level:
        logger = logging.getLogger("jnova")
        logger.setLevel(level.upper())
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
            logger.addHandler(handler)
