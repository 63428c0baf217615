"""Persistent artifact cache (`JNOVA_CACHE_DIR`): plain files, atomic writes, verified reads.

An entry is a folder named by its key holding text files (JSON, MLIR, PTX) and a `manifest.json`
with each file's SHA-256. Entries are written to a temporary folder and renamed into place, so a
reader never sees half an entry and two processes compiling the same step at once are safe (the
first rename wins). A file that fails its hash is treated as a miss: the entry is discarded with a
warning and the step recompiled. Nothing is pickled or evaluated: entries are only read as text.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile

from jnova.runtime import user_code

log = logging.getLogger("jnova.cache")

MANIFEST = "manifest.json"
FORMAT = 4  # bump when what an entry holds changes: older entries then miss


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jnova")


def cache_dir() -> str | None:
    """The cache folder, or None when disabled (`JNOVA_CACHE_DIR=""` or `off`)."""
    value = os.environ.get("JNOVA_CACHE_DIR")
    if value is None:
        return default_dir()
    return None if value.strip().lower() in ("", "off", "0", "none") else value


def enable_xla_cache() -> str | None:
    """Cache XLA's compiles in the persistent cache too, through JAX's own compilation cache.

    A warm `jnova.compile` skips the whole nova pipeline, but XLA still compiles the jitted step around
    jnova's kernels (seconds for a GPT-2 step). JAX's persistent compilation cache keeps that compiled
    executable (XLA's serialized form, nothing pickled); this points it at `<jnova cache>/xla` unless
    JAX's cache is already configured (`jax_compilation_cache_dir`), which is then left as it is. It is
    process-wide: every `jax.jit` of the process is cached there too. Returns JAX's cache folder (None
    when jnova's cache is off and JAX's is not configured)."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    root = cache_dir()
    if root is None:
        return None
    path = os.path.join(root, "xla")
    os.makedirs(path, mode=0o700, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    log.info("jnova: JAX's compilation cache is %s", path)
    return path


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class DiskCache:
    def __init__(self, root: str):
        self.root = root

    def _ensure_root(self):
        os.makedirs(self.root, mode=0o700, exist_ok=True)

    def _entry(self, key: str) -> str:
        if not key.isalnum():
            raise ValueError(f"bad cache key {key!r}")
        return os.path.join(self.root, key[:2], key)

    def load(self, key: str) -> dict[str, str] | None:
        """The files of entry `key`, or None (missing, or corrupt: then it is removed)."""
        path = self._entry(key)
        try:
            with open(os.path.join(path, MANIFEST), "rb") as f:
                manifest = json.loads(f.read())
            if manifest.get("format") != FORMAT or manifest.get("key") != key:
                raise ValueError("manifest does not match the entry")
            files = {}
            for name, digest in manifest["files"].items():
                if os.path.basename(name) != name:
                    raise ValueError(f"bad file name {name!r}")
                with open(os.path.join(path, name), "rb") as f:
                    data = f.read()
                if _sha256(data) != digest:
                    raise ValueError(f"{name} does not match its hash")
                files[name] = data.decode()
            return files
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, UnicodeDecodeError, AttributeError, TypeError) as e:
            user_code.warn(f"jnova: discarding corrupt cache entry {path} ({e}); recompiling")
            shutil.rmtree(path, ignore_errors=True)
            return None

    def discard(self, key: str) -> None:
        """Remove entry `key` (one that loaded but could not be used)."""
        shutil.rmtree(self._entry(key), ignore_errors=True)

    def store(self, key: str, files: dict[str, str]) -> None:
        """Write entry `key` atomically; if another process wrote it first, keep theirs."""
        self._ensure_root()
        final = self._entry(key)
        os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{key[:12]}-", dir=os.path.dirname(final))
        try:
            digests = {}
            for name, text in files.items():
                data = text.encode()
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
                digests[name] = _sha256(data)
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump({"format": FORMAT, "key": key, "files": digests}, f)
            try:
                os.rename(tmp, final)
                log.debug("cache: stored %s", final)
            except OSError:  # the entry exists already (a concurrent writer won)
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def open_cache() -> DiskCache | None:
    root = cache_dir()
    return DiskCache(root) if root else None
