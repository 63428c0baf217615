"""jnova's own kernel launcher (`launcher.c`): built with the host C compiler, registered with XLA.

A jnova step on a GPU is mostly kernel launches, and each one through jaxlib's PTX kernel call
costs several microseconds of host time (launcher.c says where they go). jnova's launcher is a
small XLA FFI handler: the call carries the kernel's 63-bit id and launch geometry, the PTX is
registered here once when the step is lowered, and a launch is a table lookup and cuLaunchKernel.

It is C compiled on first use: `$CC` (or `cc`, `gcc`) against the XLA FFI headers of the jaxlib
installed, into `<JNOVA_CACHE_DIR>/launcher/` (a private folder; the file is named by the hash of
the source, headers, compiler and flags, and written by rename). No CUDA toolkit is needed: the
driver is opened with dlopen. Without a C compiler jnova uses jaxlib's PTX kernel call, with a
warning. `JNOVA_LAUNCHER=jaxlib` asks for jaxlib's call; `JNOVA_LAUNCHER=jnova` makes a build
failure an error.

A lowered step registers its kernels in this process; an executable serialized by one process and
deserialized in another without lowering the step there fails with a clear "not registered" error.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import jax

from jnova.errors import CompileError

log = logging.getLogger("jnova.launcher")

TARGET = "jnova_launch"
SOURCE = Path(__file__).with_name("launcher.c")
FLAGS = ("-O2", "-std=c11", "-shared", "-fPIC", "-Wall")
LIBS = ("-ldl", "-lpthread")
HOST_TEST = "JNOVA_LAUNCHER_HOST_TEST"  # the test build: no stream (XLA's CPU backend has none)


def choice() -> str:
    """`jnova` or `jaxlib`: the launcher the next lowering uses (`JNOVA_LAUNCHER`; default jnova)."""
    value = os.environ.get("JNOVA_LAUNCHER", "").strip().lower() or "auto"
    if value not in ("auto", "jnova", "jaxlib"):
        raise ValueError(f"JNOVA_LAUNCHER={value!r}: expected 'jnova' or 'jaxlib'")
    if value == "jaxlib":
        return "jaxlib"
    if load() is not None:
        return "jnova"
    if value == "jnova":
        raise CompileError("launcher", "JNOVA_LAUNCHER=jnova but jnova's launcher could not be built or loaded "
                           "(see the warning above)")
    return "jaxlib"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build_dir() -> Path:
    from jnova.runtime.disk_cache import cache_dir

    root = cache_dir()
    if root is None:
        return Path(_temporary_dir())
    path = Path(root) / "launcher"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


@functools.lru_cache(maxsize=1)
def _temporary_dir() -> str:
    return tempfile.mkdtemp(prefix="jnova-launcher-")


def build(defines: tuple[str, ...] = ()) -> Path:
    """The launcher's shared library, compiled unless this source, compiler and jaxlib already have one.

    Raises CompileError (stage "launcher") with the compiler's output when compiling fails."""
    cc = compiler()
    if cc is None:
        raise CompileError("launcher", "no C compiler: set CC or install cc/gcc")
    include = jax.ffi.include_dir()
    header = Path(include, "xla", "ffi", "api", "c_api.h").read_bytes()
    flags = FLAGS + tuple(f"-D{d}" for d in defines)
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), header, cc.encode(), " ".join(flags).encode()]))
    out = _build_dir() / f"jnova_launcher-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    fd, partial = tempfile.mkstemp(dir=out.parent, suffix=".so.partial")
    os.close(fd)
    command = [cc, *flags, "-I", include, str(SOURCE), "-o", partial, *LIBS]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise CompileError("launcher", done.stderr.strip() or done.stdout.strip(), str(SOURCE), " ".join(command))
        os.replace(partial, out)  # atomic: a concurrent build of the same key writes the same file
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    log.info("jnova: built the kernel launcher %s", out)
    return out


class Launcher:
    """The loaded launcher library: kernel registration and the FFI handler's capsule."""

    def __init__(self, path: Path, driver: str = "libcuda.so.1"):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.lib.jnova_launcher_init.argtypes = [ctypes.c_char_p]
        self.lib.jnova_launcher_error.restype = ctypes.c_char_p
        self.lib.jnova_register.argtypes = [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        self.lib.jnova_is_registered.argtypes = [ctypes.c_uint64]
        self.lib.jnova_module_loads.restype = ctypes.c_long
        # No driver (a machine without a GPU) still registers kernels and lowers steps; a launch then
        # fails with the reason.
        self.driver_status = self.lib.jnova_launcher_init(driver.encode())  # 0, -1 no driver, -2 unusable
        self.driver_error = self.lib.jnova_launcher_error().decode() if self.driver_status else None

    def handler(self) -> dict:
        """The FFI handler's stages as PyCapsules (for jax.ffi.register_ffi_target): initialize loads
        the kernel's module, execute launches it."""
        return {"initialize": jax.ffi.pycapsule(self.lib.jnova_launch_initialize),
                "execute": jax.ffi.pycapsule(self.lib.jnova_launch)}

    def register(self, kernel_id: int, name: str, ptx: str) -> None:
        """Register a kernel (the library copies it, under its own lock); the same kernel again is a no-op.
        Callers register each kernel once a process (gpu_lowering caches by launch)."""
        image = ptx.encode()
        status = self.lib.jnova_register(kernel_id, name.encode(), image, len(image))
        if status != 0:
            reason = {-1: "its id is taken by another kernel (a hash collision)",
                      -2: "the launcher's table is full (12288 kernels a process)",
                      -3: "out of memory"}.get(status, f"status {status}")
            raise CompileError("launcher", f"cannot register kernel {name} ({kernel_id:016x}): {reason}")

    def is_registered(self, kernel_id: int) -> bool:
        return bool(self.lib.jnova_is_registered(kernel_id))

    def module_loads(self) -> int:
        return int(self.lib.jnova_module_loads())


def kernel_id(name: str, ptx: str) -> int:
    """A kernel's id: 63 bits of the SHA-256 of its entry name and PTX (MLIR's Python bindings cannot
    make an unsigned 64-bit attribute of a value above 2**63 - 1)."""
    digest = hashlib.sha256(name.encode() + b"\0" + ptx.encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


_load_lock = threading.Lock()
_loaded: list = []  # [Launcher | None] once load() has run


def load() -> Launcher | None:
    """The process's launcher, built, loaded and registered with XLA for CUDA on first use; None (with
    a warning, once) when it cannot be built."""
    with _load_lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


def _load() -> Launcher | None:
    try:
        launcher = Launcher(build())
    except (CompileError, OSError, subprocess.SubprocessError) as e:
        warnings.warn(f"jnova's kernel launcher is unavailable, using jaxlib's PTX kernel call "
                      f"(more host time per launch): {e}", RuntimeWarning, stacklevel=3)
        return None
    if launcher.driver_status == -2:  # a driver the launcher cannot use: jaxlib's call still can
        warnings.warn(f"jnova's kernel launcher cannot use this CUDA driver, using jaxlib's PTX kernel call: "
                      f"{launcher.driver_error}", RuntimeWarning, stacklevel=3)
        return None
    try:
        jax.ffi.register_ffi_target(TARGET, launcher.handler(), platform="CUDA", api_version=1)
    except Exception as e:  # a CPU-only jaxlib may know no CUDA platform: steps still lower ahead of time
        log.info("jnova: launcher not registered with XLA for CUDA (%s)", e)
    if launcher.driver_error:
        log.info("jnova: launcher has no CUDA driver here (%s); it can lower steps, not launch them",
                 launcher.driver_error)
    return launcher
