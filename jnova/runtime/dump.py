"""IR dumps (`JNOVA_DUMP_DIR`): one folder per compiled step, one numbered file per stage.

Like `--xla_dump_to`: `$JNOVA_DUMP_DIR/<seq>_<func>_<hash>/00_jaxpr.txt, 01_nova.mlir, ...`.
Inputs of failed stages are written here too (or to a temporary folder when no dump dir is set).
"""
from __future__ import annotations

import itertools
import os
import tempfile

_SEQ = itertools.count()


def dump_dir() -> str | None:
    return os.environ.get("JNOVA_DUMP_DIR") or None


class StepDump:
    """Writes the stages of one compiled step; does nothing when dumping is off."""

    def __init__(self, name: str, key: str):
        root = dump_dir()
        self.path = None
        self.count = itertools.count()
        if root:
            self.path = os.path.join(root, f"{next(_SEQ):03d}_{name}_{key[:12]}")
            os.makedirs(self.path, exist_ok=True)

    def write(self, stage: str, ext: str, text: str) -> str | None:
        if self.path is None:
            return None
        path = os.path.join(self.path, f"{next(self.count):02d}_{stage}{ext}")
        with open(path, "w") as f:
            f.write(text)
        return path


def failure_path(stage: str, ext: str) -> str:
    """Where to keep the input of a failed stage."""
    root = dump_dir()
    if root:
        os.makedirs(root, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=f"failed_{stage}_", suffix=ext, dir=root)
    else:
        fd, path = tempfile.mkstemp(prefix=f"jnova_failed_{stage}_", suffix=ext)
    os.close(fd)
    return path
