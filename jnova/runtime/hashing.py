"""Structural hash of a captured step: topology, shapes, dtypes, options; never addresses.

The printed nova function already numbers values in program order (normalized ids), sorts
attributes and spells every shape and dtype, so it is the hash's main input. Fallback equations add
their primitive and parameters, with object addresses scrubbed.
"""
from __future__ import annotations

import functools
import hashlib
import pathlib
import re

import jax

import jnova

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A digest of jnova's own sources: a fix to the compiler invalidates what it compiled before."""
    h = hashlib.sha256()
    root = pathlib.Path(jnova.__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def structural_hash(func_text: str, sites: list, options: dict, target: str = "cpu") -> str:
    h = hashlib.sha256()
    for part in (f"jnova {jnova.__version__} {code_digest()}", f"jax {jax.__version__}", f"target {target}",
                 "options " + repr(sorted(options.items())), func_text):
        h.update(part.encode())
        h.update(b"\0")
    for eqn in sites:
        h.update(eqn.primitive.name.encode())
        h.update(_ADDRESS.sub("", repr(sorted((k, str(v)) for k, v in eqn.params.items()))).encode())
    return h.hexdigest()
