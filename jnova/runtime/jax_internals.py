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


def gpu_triton():
    """jaxlib's PTX kernel-call module, or None on a CPU-only jaxlib (it imports but lacks TritonKernel)."""
    try:
        from jax._src.lib import gpu_triton as module
    except ImportError:
        return None
    return module if getattr(module, "TritonKernel", None) is not None else None
