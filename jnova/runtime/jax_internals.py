"""Every use of private JAX (`jax._src`) in jnova, with its version checks.

jnova supports jaxlib 0.10.2 (Python 3.11) and 0.11.x (Python 3.12). Anything reached through
`jax._src` is imported here, so a JAX upgrade touches one file.
"""
from __future__ import annotations

import jax

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())
if JAX_VERSION < (0, 10, 2):
    raise ImportError(f"jnova needs jax >= 0.10.2, found {jax.__version__}")


def source_line(eqn) -> str:
    """The user's source line that produced a jaxpr equation ('file.py:12 (fn)'), or ''."""
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # source info is best effort: never fail a compile over it
        return ""


def explicit_sharding(x):
    """An array's sharding where it is part of its type: a NamedSharding over a mesh with Explicit axes
    (`jax.make_mesh`'s default), whose spec shard_map and sharding-in-types check while tracing; None
    otherwise (an Auto mesh's sharding is XLA's to propagate, not the trace's)."""
    sharding = getattr(x, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    axis_types = getattr(mesh, "axis_types", ())
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    return sharding if explicit is not None and explicit in axis_types else None


def replicated(sharding):
    """`sharding` (an aval's: a NamedSharding, possibly over an abstract mesh) with every axis
    replicated; anything else as is."""
    spec = getattr(sharding, "spec", None)
    if spec is None or not any(p is not None for p in spec):
        return sharding
    return sharding.update(spec=jax.sharding.PartitionSpec())


def trace_context() -> tuple:
    """The JAX configuration that tracing reads (matmul precision, the PRNG implementation and its
    partitioning, dtype and rank promotion, x64, ...): part of jax.jit's cache key, so a step traced in one
    context is never reused in another."""
    from jax._src import config

    if hasattr(config, "trace_context"):
        return config.trace_context()
    return (jax.config.jax_default_matmul_precision,)  # pragma: no cover - a JAX without it: the precision


try:  # what jax's dispatch raises when jax.debug_nans / debug_infs finds one in a compiled step's outputs
    from jax._src.api_util import InternalFloatingPointError
except ImportError:  # pragma: no cover - a JAX without it raises FloatingPointError itself
    class InternalFloatingPointError(Exception):
        ty = "nan"


def raise_where_invalid(found: Exception, fn, args, kwargs):
    """jax.jit's answer to a NaN or Inf that jax.debug_nans / debug_infs finds in a compiled step's
    outputs: the function run again without compiling it, which raises FloatingPointError at the
    operation that produced it; if it produces none, a FloatingPointError that says so."""
    import logging

    logging.getLogger("jnova").warning("jnova: invalid value (%s) in the output of a compiled step; running the "
                                       "function uncompiled to find where", getattr(found, "ty", "nan"))
    try:
        fn(*args, **kwargs)
    except (FloatingPointError, ZeroDivisionError) as e:
        raise e from None
    raise FloatingPointError(f"invalid value ({getattr(found, 'ty', 'nan')}) encountered in the output of the "
                             f"jnova-compiled {getattr(fn, '__qualname__', 'function')}; run uncompiled, it "
                             "produced none (as jax.jit, the compiled form can differ, e.g. by fusing or "
                             "reordering arithmetic)") from None


def bind_equation(eqn, ins: list):
    """Bind a jaxpr equation's primitive to `ins`, as jax's own jaxpr evaluation does: a higher-order
    primitive (shard_map, pmap's, a call) takes its sub-jaxpr as a function (`get_bind_params`), not
    the jaxpr parameter it was recorded with."""
    return eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))


def varying_axes(aval) -> frozenset:
    """The manual mesh axes a value varies over inside shard_map (check_vma), from its aval: `.mat.varying`
    on jax 0.10-0.11 (`.vma` on earlier and later ones); empty outside shard_map."""
    mat = getattr(aval, "mat", None)
    found = getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", None)
    return frozenset(found or ())


def gpu_triton():
    """jaxlib's PTX kernel-call module, or None on a CPU-only jaxlib (it imports but lacks TritonKernel)."""
    try:
        from jax._src.lib import gpu_triton as module
    except ImportError:
        return None
    return module if getattr(module, "TritonKernel", None) is not None else None


def is_key(aval_or_dtype) -> bool:
    """Whether a value (or dtype) is a typed PRNG key (`key<fry>`)."""
    dtype = getattr(aval_or_dtype, "dtype", aval_or_dtype)
    try:
        return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    except TypeError:
        return False


def key_data_shape(dtype) -> tuple[int, ...]:
    """The trailing uint32 shape of one key's raw data (e.g. (2,) for threefry)."""
    return tuple(dtype._impl.key_shape)  # private: the key type's PRNG implementation


def wrap_key(data, dtype):
    """Raw uint32 key data back into keys of `dtype`."""
    return jax.random.wrap_key_data(data, impl=dtype._impl)


def weakly_typed(x):
    """`x` as a weakly typed value of its dtype (what jax.jit returns for a result traced as weak, such as
    a Python scalar's product with a weak input): a no-op convert, so the result promotes as jax.jit's."""
    from jax._src.lax import lax as lax_internal

    return lax_internal._convert_element_type(x, x.dtype, weak_type=True)


def compile_with_buffer_dump(lowered, compiler_options: dict | None = None) -> tuple[object, dict[str, str]]:
    """Compile a `jax.jit(...).lower(...)` result with XLA's dump of the optimized module on, and return
    (jax's compiled object, {"hlo", "live_range", "buffer_assignment": text}) of the module XLA compiled.

    XLA writes, per compiled module under `--xla_dump_to`, `<module>.<backend>_after_optimizations.txt`
    (the scheduled HLO, with each instruction's op_name), `...-buffer-assignment.txt` and, with
    `xla_dump_buffer_assignment_analysis`, `...-live-range.txt` (the instruction sequence, every
    buffer's live range over it, and the buffers live at the peak). Both the CPU and the GPU compiler
    write them (xla/service/dump.cc, jaxlib 0.10-0.11): the dump is the stable, public way to read
    XLA's buffer assignment, which jaxlib's Python objects do not expose."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="jnova_xla_dump_") as root:
        options = {**(compiler_options or {}), "xla_dump_to": root, "xla_dump_hlo_as_text": True,
                   "xla_dump_buffer_assignment_analysis": True}
        compiled = lowered.compile(compiler_options=options)
        names = os.listdir(root)
        ranges = sorted((n for n in names if n.endswith("_after_optimizations-live-range.txt")),
                        key=lambda n: os.path.getsize(os.path.join(root, n)))
        if not ranges:
            raise RuntimeError(f"XLA (jax {jax.__version__}) wrote no '*_after_optimizations-live-range.txt' under "
                               f"xla_dump_to; it wrote {sorted(names)[:8]}")
        stem = ranges[-1][:-len("-live-range.txt")]  # the largest module: the step (not a callback's)
        texts = {}
        for key, suffix in (("hlo", ".txt"), ("live_range", "-live-range.txt"),
                            ("buffer_assignment", "-buffer-assignment.txt")):
            path = os.path.join(root, stem + suffix)
            if os.path.exists(path):
                with open(path) as f:
                    texts[key] = f.read()
    return compiled, texts


def lowering_on_one_device(ctx) -> bool:
    """Whether a lowering rule's context is a computation on one device (not partitioned over several,
    not inside shard_map or pmap): `ShardingContext` with one device on jax 0.10-0.11."""
    axis_context = getattr(ctx.module_context, "axis_context", None)
    return type(axis_context).__name__ == "ShardingContext" and getattr(axis_context, "num_devices", 0) == 1


def resolve_argnums(fn, static_argnums, static_argnames, donate_argnums, donate_argnames):
    """jax.jit's checks and completion of its argument options, with its exception types: names
    filled in from numbers and numbers from names by `fn`'s signature, each checked against it, static
    and donated ones disjoint. Returns (static_argnums, static_argnames, donate_argnums,
    donate_argnames)."""
    from jax._src import api_util

    signature = api_util.fun_signature(fn)  # None for builtins without one: jax.jit checks nothing then
    donate_argnums, donate_argnames, static_argnums, static_argnames = api_util.resolve_argnums(
        fn, signature, donate_argnums, donate_argnames, static_argnums, static_argnames)
    return tuple(static_argnums), tuple(static_argnames), tuple(donate_argnums), tuple(donate_argnames)
