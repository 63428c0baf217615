"""`jnova.compile`: the user-facing entry point."""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import jax

from jnova.capture.trace import dynamic_signature, function_name
from jnova.errors import DeletedArgumentError
from jnova.options import Options
from jnova.runtime.jax_internals import (InternalFloatingPointError, raise_where_invalid, resolve_argnums,
                                        trace_context, varying_axes)
from jnova.runtime.target import get_target

log = logging.getLogger("jnova")


def compile(fn: Callable, *, static_argnums: int | Sequence[int] | None = None,
            static_argnames: str | Iterable[str] | None = None,
            donate_argnums: int | Sequence[int] | None = None, donate_argnames: str | Iterable[str] | None = None,
            mixed_precision: str | None = None, backend: str | None = None, fallback: str = "xla",
            bucket_bytes: int = 25 * 2**20, target: str | None = None, kernels: str = "auto",
            xla_options: dict | None = None, excess_precision: bool | None = None) -> "CompiledStep":
    """Compile a JAX training step with jnova; returns a callable with `fn`'s signature.

    Every option is checked here, with jax.jit's exception types where jax.jit checks the same.

    Args:
      fn: anything `jax.make_jaxpr` can trace (plain, `jax.jit`-wrapped, `jax.value_and_grad`, a step
        with an optax update). Arguments and results are pytrees of arrays.
      static_argnums, static_argnames: arguments passed to `fn` as Python values, not traced (as in
        `jax.jit`): they must be hashable, and each new value compiles the step again.
      donate_argnums, donate_argnames: arguments whose buffers the step may reuse (as in `jax.jit`).
      mixed_precision: None, or "bf16" to run contraction operands in bfloat16 (GPU backend).
      backend: None (the platform of the inputs), "cpu" or "gpu".
      fallback: "xla" runs primitives jnova cannot compile as ordinary JAX ops (one warning each);
        "error" raises instead, naming the primitive and the source line.
      bucket_bytes: the most bytes of one all-reduce bucket in a data-parallel step (shard_map or pmap
        around the compiled step): the step's all-reduces run as buckets of their operands, each right
        after its last operand is computed (passes/bucket_all_reduces.py).
      target: a GPU name ("h200", ...) to compile ahead of time without a GPU.
      kernels: "auto"; "fused" compiles one kernel per fusion group (the GPU's plan; on the CPU this
        tests the fusion plan), "segments" one kernel per run of ops between fallbacks (the CPU's).
      xla_options: XLA compile options for the step around jnova's kernels (`jax.jit`'s
        compiler_options), e.g. {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL"}.
      excess_precision: whether a bf16 / f16 value rounded and widened again inside one kernel may stay
        f32, as in XLA (default: XLA's `xla_allow_excess_precision` where set, in `xla_options` or
        XLA_FLAGS, else True). The rounding stays where the value leaves the kernel.
    """
    if not callable(fn):
        raise TypeError(f"jnova.compile expects a callable, got {type(fn).__name__}")
    options = Options(mixed_precision=mixed_precision, backend=backend, fallback=fallback,
                      bucket_bytes=bucket_bytes, target=target, kernels=kernels,
                      xla_options=Options.xla_pairs(xla_options),
                      excess_precision=Options.excess_precision_default(excess_precision, xla_options))
    if target is not None:
        get_target(target)  # an unknown GPU name is an error now (naming the presets), not at the first call
    arguments = Arguments(*resolve_argnums(fn, static_argnums, static_argnames, donate_argnums, donate_argnames))
    return CompiledStep(fn, options, arguments)


@dataclass(frozen=True)
class Arguments:
    """Which arguments of the step are static and which donated, as jax.jit resolves them: numbers
    and names completed from each other through the function's signature."""

    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    donate_argnames: tuple[str, ...] = ()

    def split(self, fn, args: tuple, kwargs: dict):
        """(dynamic positional arguments, dynamic keyword arguments, static key, static positions of
        this call). The static key holds each static value with its type (as jax.jit: 1 and 1.0 are
        different); a value that cannot be hashed is jax.jit's ValueError."""
        if not (self.static_argnums or self.static_argnames):
            return args, kwargs, (), ()
        positions = tuple(sorted({i % len(args) for i in self.static_argnums if -len(args) <= i < len(args)}))
        static = tuple((i, type(args[i]), args[i]) for i in positions)
        static += tuple((k, type(kwargs[k]), kwargs[k]) for k in sorted(kwargs) if k in self.static_argnames)
        for item in static:
            try:
                hash(item)
            except TypeError as e:
                where = f"index {item[0]}" if isinstance(item[0], int) else f"name {item[0]!r}"
                raise ValueError(
                    f"Non-hashable static arguments are not supported. The static argument ({where}) of "
                    f"{function_name(fn)} is of type {item[1]}: {item[2]!r}. The error was:\n{type(e).__name__}: "
                    f"{e}\n(as jax.jit: a static argument is part of the cache key; pass arrays as ordinary "
                    "arguments)") from None
        dynamic_args = tuple(a for i, a in enumerate(args) if i not in positions)
        dynamic_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        return dynamic_args, dynamic_kwargs, static, positions

    def donated(self, args: tuple, kwargs: dict, static_positions: tuple[int, ...]):
        """Where this call donates: (positions among the dynamic positional arguments, keyword names,
        flat leaf indices of the dynamic arguments)."""
        if not (self.donate_argnums or self.donate_argnames):
            return (), (), ()
        donate = {i % len(args) for i in self.donate_argnums if -len(args) <= i < len(args)}
        dynamic = [i for i in range(len(args)) if i not in static_positions]
        positions = tuple(j for j, i in enumerate(dynamic) if i in donate)
        names = tuple(k for k in kwargs if k in self.donate_argnames)
        flags = ([jax.tree_util.tree_map(lambda _, d=i in donate: d, args[i]) for i in dynamic],
                 {k: jax.tree_util.tree_map(lambda _, d=k in names: d, v) for k, v in kwargs.items()
                  if k not in self.static_argnames})
        return positions, names, tuple(i for i, d in enumerate(jax.tree_util.tree_leaves(flags)) if d)


class CompiledStep:
    """A jnova-compiled step. Call it like `fn`; `.lower(*args)` exposes every stage's IR."""

    def __init__(self, fn: Callable, options: Options, arguments: Arguments = Arguments()):
        self.fn = fn
        self.options = options
        self.arguments = arguments
        self._executables: dict = {}
        self._last = None  # (static key and trace context, jax's compiled step, weak leaves) of the last signature
        self.compile_count = 0
        functools.update_wrapper(self, fn, updated=())

    @property
    def donate_argnums(self) -> tuple[int, ...]:
        return self.arguments.donate_argnums

    def __call__(self, *args, **kwargs):
        try:
            return self._call(args, kwargs)
        except InternalFloatingPointError as e:  # jax.debug_nans / debug_infs: where, as jax.jit says it
            raise_where_invalid(e, self.fn, args, kwargs)

    def _call(self, args, kwargs):
        args, kwargs, static, positions = self.arguments.split(self.fn, args, kwargs)
        context = trace_context()  # a new matmul precision, PRNG or promotion context compiles again
        # The last signature's compiled step first: jax's C++ dispatch flattens the arguments and checks
        # their shapes and dtypes, as for a jax.jit call (jnova's own dispatch in Python cost ~0.8 ms a
        # GPT-2 step). It takes a weak-typed value where a strong one was compiled, and back, where
        # jax.jit traces again (the result's dtype can differ): the weak leaves are compared first.
        last = self._last
        if last is not None and last[0] == (static, context) and last[2] == _weak_leaves(args, kwargs):
            try:
                return _call_compiled(last[1], args, kwargs)
            except DeletedArgumentError:
                raise
            except (TypeError, ValueError):  # other types, structure, devices or tracers: jnova's dispatch
                pass
        flat, tree = jax.tree_util.tree_flatten((args, kwargs))
        executable = self._executable(args, kwargs, static, positions, flat, tree)
        if any(isinstance(x, jax.core.Tracer) for x in flat):  # inside a transformation: jax compiles
            return jax.tree_util.tree_unflatten(executable.captured.out_tree, executable.run(*flat))
        self._last = ((static, context), self._prepared(executable, args, kwargs), _weak_positions(flat))
        return _call_compiled(executable.call, args, kwargs)

    def _prepared(self, executable, args, kwargs):
        """The executable's compiled step (jax's), compiled by XLA now unless it was before; it takes
        the dynamic arguments (as jax.jit's compiled objects do)."""
        if executable.call is None:
            positions, names = executable.donated_arguments
            executable.prepare(args, kwargs, positions, names, dict(self.options.xla_options) or None)
        return executable.call

    def stats(self) -> list[dict]:
        """One record per compiled input signature (see `Executable.stats`)."""
        return [e.stats() for e in self._executables.values()]

    def lower(self, *args, **kwargs) -> "Lowered":
        """The compiled stages of the step for these arguments (arrays, or jax.ShapeDtypeStruct; static
        ones as values), as `jax.jit(fn).lower`: `.as_text(stage)`, `.stats()`, and `.compile()` for
        XLA's executable, which takes the dynamic arguments."""
        args, kwargs, static, positions = self.arguments.split(self.fn, args, kwargs)
        return Lowered(self._executable(args, kwargs, static, positions), self, args, kwargs)

    def _executable(self, args, kwargs, static=(), positions=(), flat=None, tree=None):
        _configure_logging()
        if flat is None:
            flat, tree = jax.tree_util.tree_flatten((args, kwargs))
        try:
            avals = tuple(map(_signature, flat))
        except (TypeError, OverflowError):  # not an array, or an int too large: the error names the
            # function and the argument's path
            from jnova.capture.trace import abstract_arguments

            abstract_arguments(self.fn, *_with_statics(args, kwargs, static, positions), positions,
                               self.arguments.static_argnames)
            raise
        backend = self.options.backend or ("gpu" if self.options.target else _platform_of(flat))
        # the JAX configuration tracing reads (matmul precision, PRNG, promotion): jax.jit's key too
        key = (tree, avals, _placements(flat), backend, static, trace_context())
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
            full_args, full_kwargs = _with_statics(args, kwargs, static, positions)
            donate_positions, donate_names, donate = self.arguments.donated(full_args, full_kwargs, positions)
            executable = compile_step(self.fn, full_args, full_kwargs, self.options, backend, target, donate,
                                      static_argnums=positions, static_argnames=self.arguments.static_argnames)
            executable.donated_arguments = (donate_positions, donate_names)
            executable.named_as = dynamic_signature(self.fn, positions, self.arguments.static_argnames)
            self.compile_count += 1
            self._executables[key] = executable
        return executable


def _with_statics(args, kwargs, static, positions):
    """The call's whole argument list again: the dynamic arguments with the static values put back."""
    if not static:
        return args, kwargs
    values = iter(args)
    by_position = {item[0]: item[2] for item in static if isinstance(item[0], int)}
    full_args = tuple(by_position[i] if i in by_position else next(values)
                      for i in range(len(args) + len(by_position)))
    full_kwargs = dict(kwargs, **{item[0]: item[2] for item in static if isinstance(item[0], str)})
    return full_args, full_kwargs


class Lowered:
    """The stages of one compiled signature: `.as_text(stage)` for "jaxpr", "nova", then "linalg" and
    "llvm" (CPU) or "gpu" and "ptx" (GPU), and "hlo" (the jitted step as XLA sees it)."""

    def __init__(self, executable, step: CompiledStep | None = None, args=(), kwargs=None):
        self.executable = executable
        self._step, self._args, self._kwargs = step, args, kwargs or {}

    def compile(self):
        """Compile the step around jnova's kernels with XLA now (ahead of the first call, as
        `jax.jit(fn).lower(...).compile()`), and return jax's compiled object for this signature:
        called with the user's arguments (the static ones left out, as jax.jit's), it runs the step. Calls of the jnova step with this signature
        then use it."""
        if self._step is None:
            raise ValueError("this Lowered was made without the step's arguments; use CompiledStep.lower(*args)")
        return self._step._prepared(self.executable, self._args, self._kwargs)

    def memory(self):
        """The step's peak memory as XLA plans it for these arguments, and the buffers live at the peak:
        size, dtype, the kernel and nova op that wrote each, which reads it last, and whether it is a
        parameter, optimizer state, a residual or a temporary (`jnova.memory_report.MemoryReport`;
        print it for a table). Compiles the step with XLA once more (with its buffer dump on), so the
        arguments' devices must be present; with JNOVA_DUMP_DIR set it is written as memory.txt/.json."""
        if self._step is None:
            raise ValueError("this Lowered was made without the step's arguments; use CompiledStep.lower(*args)")
        positions, names = self.executable.donated_arguments
        return self.executable.memory(self._args, self._kwargs, positions, names,
                                      dict(self._step.options.xla_options) or None)

    def as_text(self, stage: str = "nova") -> str:
        return self.executable.as_text(stage)

    def stats(self) -> dict:
        return self.executable.stats()

    @property
    def stages(self) -> list[str]:
        return self.executable.stages


def _signature(x) -> tuple:
    """(shape, dtype, weak type) of an argument as jax.jit sees it. Runs on every call that misses the
    last signature, once per leaf: an array (or tracer) gives them as is, without the conversions
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


def _placements(flat) -> tuple:
    """Where the arrays are, as jax.jit's key has it: the sharding of each array that is not on the
    default device alone (another device, or split over several), by leaf position. The same step
    called on arrays on another device compiles for that device; an array on the default device and
    a ShapeDtypeStruct without a sharding (`lower`) are one signature."""
    default = jax.config.jax_default_device  # a device, a platform's name, or None
    default = default if isinstance(default, jax.Device) else jax.devices(default)[0]
    placed = []
    for i, x in enumerate(flat):
        sharding = getattr(x, "sharding", None)
        if sharding is None or isinstance(x, jax.core.Tracer):
            continue
        if isinstance(sharding, jax.sharding.SingleDeviceSharding) and sharding.device_set == {default}:
            continue
        placed.append((i, sharding))
    return tuple(placed)


_PYTHON_SCALARS = frozenset((int, float, bool, complex))


def _weak_positions(flat) -> tuple[int, ...]:
    """Which leaves are weakly typed: Python scalars, and arrays with a weak type (~0.4 us a leaf)."""
    return tuple(i for i, x in enumerate(flat)
                 if type(x) in _PYTHON_SCALARS or getattr(x, "weak_type", False))


def _weak_leaves(args, kwargs) -> tuple[int, ...]:
    return _weak_positions(jax.tree_util.tree_leaves((args, kwargs)))


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


def _call_compiled(call, args, kwargs):
    """jax's compiled step called; a donated argument used again raises jax.jit's ValueError (jax's
    compiled objects raise a RuntimeError). Types or structure it does not take raise TypeError."""
    try:
        return call(*args, **kwargs)
    except RuntimeError as e:
        if "has been deleted" in str(e):
            raise DeletedArgumentError(f"an argument's buffer has been deleted or donated (to an earlier call of "
                                       f"the step, with donate_argnums or donate_argnames): {e}") from e
        raise


_LOGGING_SET = False


def _configure_logging():
    """Honour JNOVA_LOG (a logging level: a name, TRACE for every single rewrite of the passes, or a
    number) once."""
    global _LOGGING_SET
    if _LOGGING_SET:
        return
    _LOGGING_SET = True
    level = os.environ.get("JNOVA_LOG")
    if level:
        from jnova.passes import TRACE  # noqa: F401 - registers the TRACE level name

        logger = logging.getLogger("jnova")
        logger.setLevel(int(level) if level.strip().isdigit() else level.strip().upper())
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
            logger.addHandler(handler)
