"""Python's cyclic garbage collector paused while jnova builds large object graphs.

Tracing a GPT-2 step creates about a million short-lived Python objects (jaxpr equations, tracers,
avals). Each allocation burst past the collector's threshold triggers a collection that walks every
live object of the older generations, the model's pytrees included: on a warm compile (a persistent
cache hit) that was 0.15-0.2 s of a 1.05 s compile. Tracing and restoring create little cyclic
garbage, so jnova pauses the collector for those stages and lets it resume (and catch up) after.
"""
from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0  # nested or concurrent pauses: the collector resumes when the last one ends
_was_enabled = False


@contextlib.contextmanager
def paused():
    """Pause the cyclic collector for the block (re-entrant; resumed only if it ran before)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
