"""Where the user's code is: warnings attributed to the user's line, not to jnova's or JAX's.

`warnings.warn`'s `stacklevel` counts frames, which differ by how deep in jnova a warning is raised
(and `skip_file_prefixes` needs Python 3.12); `warn` instead names the user's line itself: the
source location of the equation a warning is about (`file.py:12:8 (fn)`, from the jaxpr's source
info), else the innermost calling frame outside jnova, JAX and jaxlib.
"""
from __future__ import annotations

import os
import re
import sys
import warnings

import jax
import jaxlib

_JNOVA_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY_DIRS = tuple(d + os.sep for d in (_JNOVA_DIR, *(os.path.dirname(os.path.abspath(m.__file__))
                                                          for m in (jax, jaxlib))))
_LOCATION = re.compile(r"^(?P<file>.+?):(?P<line>\d+)(?::(?P<col>\d+))? \((?P<fn>.*)\)$")


def parse_location(location: str | None):
    """(file, line, column, function) of a source location `file.py:12:8 (fn)`, or None."""
    m = _LOCATION.match(location or "")
    if m is None:
        return None
    return m["file"], int(m["line"]), int(m["col"] or 0), m["fn"]


def user_frame():
    """(file, line) of the innermost frame outside jnova, JAX and jaxlib, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_LIBRARY_DIRS) and not frame.f_code.co_filename.startswith("<frozen"):
            return frame.f_code.co_filename, frame.f_lineno, frame.f_globals
        frame = frame.f_back
    return None


def warn(message: str, category: type[Warning] = UserWarning, location: str | None = None) -> None:
    """`warnings.warn(message)` attributed to `location` (a source location of the user's code) or,
    without one, to the user's frame that called into jnova; warning filters apply as usual."""
    parsed = parse_location(location)
    if parsed is not None and not parsed[0].startswith("<"):
        filename, lineno = parsed[0], parsed[1]
        module, registry = os.path.splitext(os.path.basename(filename))[0], None
    else:
        frame = user_frame()
        if frame is None:
            warnings.warn(message, category, stacklevel=2)
            return
        filename, lineno, globals_ = frame
        module = globals_.get("__name__", "<string>")
        registry = globals_.setdefault("__warningregistry__", {})
    warnings.warn_explicit(message, category, filename, lineno, module=module, registry=registry)
