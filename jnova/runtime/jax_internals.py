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
