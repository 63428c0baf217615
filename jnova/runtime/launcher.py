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

Where jaxlib's FFI has the record stage (jaxlib 0.11), the launcher records each launch into XLA's
command buffers as a kernel node of its own, which XLA updates like its own kernels, instead of
being captured as a child graph; jaxlib's Python registration takes no record stage, so jnova runs
one bootstrap call on the GPU that registers the launcher through XLA's FFI API (`mode` says which
way it went). Registered that way the handler has no initialize stage, which XLA runs for every call
before every execution of a step (~1.5 us of host time each, 0.5 ms a GPT-2 step): a kernel's module
loads at its first launch instead (captured launches keep the stage: no module loads during capture). `JNOVA_LAUNCHER_RECORD=0` when a step is lowered makes its launches captured ones (the
same handler, registered without the record stage as `jnova_launch_captured`).

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
from pathlib import Path

import jax

from jnova.errors import CompileError
from jnova.runtime import user_code

log = logging.getLogger("jnova.launcher")

TARGET = "jnova_launch"
CAPTURED_TARGET = "jnova_launch_captured"  # the same handler without its record stage (beside it)
BOOTSTRAP = "jnova_launch_bootstrap"
# jax's platform name -> (the name jax.ffi.register_ffi_target takes, the FFI registry's)
XLA_PLATFORMS = {"cuda": ("CUDA", "CUDA"), "cpu": ("cpu", "Host")}
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


def tensor_maps_available() -> bool:
    """Whether kernels compiled now may take TMA descriptors: only jnova's launcher builds them, so
    not with JNOVA_LAUNCHER=jaxlib nor without a C compiler to build the launcher (a failed build is
    the one case left: the lowering of such a kernel then says so)."""
    return os.environ.get("JNOVA_LAUNCHER", "").strip().lower() != "jaxlib" and compiler() is not None


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
        self.lib.jnova_register.argtypes = [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                            ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
        self.lib.jnova_is_registered.argtypes = [ctypes.c_uint64]
        self.lib.jnova_module_loads.restype = ctypes.c_long
        self.lib.jnova_counts.argtypes = [ctypes.c_long * 3]
        self.lib.jnova_bootstrap_configure.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        self.has_record_stage = bool(self.lib.jnova_has_record_stage())
        self.mode = None  # how it is registered with XLA for CUDA: "record", "capture" or None (not)
        # No driver (a machine without a GPU) still registers kernels and lowers steps; a launch then
        # fails with the reason.
        self.driver_status = self.lib.jnova_launcher_init(driver.encode())  # 0, -1 no driver, -2 unusable
        self.driver_error = self.lib.jnova_launcher_error().decode() if self.driver_status else None

    def handler(self) -> dict:
        """The FFI handler's stages as PyCapsules (for jax.ffi.register_ffi_target): initialize loads
        the kernel's module, execute launches it."""
        return {"initialize": jax.ffi.pycapsule(self.lib.jnova_launch_initialize),
                "execute": jax.ffi.pycapsule(self.lib.jnova_launch)}

    def register(self, kernel_id: int, name: str, ptx: str, tensor_maps=()) -> None:
        """Register a kernel (the library copies it, under its own lock); the same kernel again is a no-op.
        `tensor_maps` (codegen.gpu.launch.TensorMap) are built at each launch and passed after the
        buffers. Callers register each kernel once a process (gpu_lowering caches by launch)."""
        image = ptx.encode()
        words = [w for m in tensor_maps for w in m.words()]
        status = self.lib.jnova_register(kernel_id, name.encode(), image, len(image), len(tensor_maps),
                                         (ctypes.c_int64 * max(1, len(words)))(*words))
        if status != 0:
            reason = {-1: "its id is taken by another kernel (a hash collision)",
                      -2: "the launcher's table is full (12288 kernels a process)",
                      -3: "out of memory",
                      -4: f"{len(tensor_maps)} tensor maps (at most 8, of rank 1 to 5)"}.get(status, f"status {status}")
            raise CompileError("launcher", f"cannot register kernel {name} ({kernel_id:016x}): {reason}")

    def is_registered(self, kernel_id: int) -> bool:
        return bool(self.lib.jnova_is_registered(kernel_id))

    def module_loads(self) -> int:
        return int(self.lib.jnova_module_loads())

    def counts(self) -> dict:
        """What the handler has done in this process: launches by the execute stage (captured ones
        included), kernel nodes created and updated by the record stage, modules loaded."""
        out = (ctypes.c_long * 3)()
        self.lib.jnova_counts(out)
        return {"launches": out[0], "record_creates": out[1], "record_updates": out[2],
                "module_loads": self.module_loads()}

    def bootstrap(self, target: str, platform: str, bootstrap: str = BOOTSTRAP) -> None:
        """Register the handler, every stage it has (the record stage included), as `target` for jax's
        `platform`: registers and runs the one-off call `bootstrap`, which registers it through the FFI
        API XLA passes its calls. Raises RuntimeError when the registration fails."""
        import jax.numpy as jnp

        jax_platform, ffi_platform = XLA_PLATFORMS[platform]
        self.lib.jnova_bootstrap_configure(target.encode(), ffi_platform.encode())
        jax.ffi.register_ffi_target(bootstrap, {"execute": jax.ffi.pycapsule(self.lib.jnova_bootstrap)},
                                    platform=jax_platform, api_version=1)
        call = jax.ffi.ffi_call(bootstrap, jax.ShapeDtypeStruct((), jnp.uint8))
        with jax.default_device(jax.devices(platform)[0]):
            jax.block_until_ready(jax.jit(call)())
        if self.lib.jnova_bootstrap_status() != 1:
            raise RuntimeError(f"the bootstrap call did not register {target} (status "
                               f"{self.lib.jnova_bootstrap_status()})")


def kernel_id(name: str, ptx: str, tensor_maps=()) -> int:
    """A kernel's id: 63 bits of the SHA-256 of its entry name, PTX and tensor maps (MLIR's Python
    bindings cannot make an unsigned 64-bit attribute of a value above 2**63 - 1)."""
    maps = "".join(f"\0{m.words()}" for m in tensor_maps).encode()
    digest = hashlib.sha256(name.encode() + b"\0" + ptx.encode() + maps).digest()
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
        user_code.warn(f"jnova's kernel launcher is unavailable, using jaxlib's PTX kernel call "
                      f"(more host time per launch): {e}", RuntimeWarning)
        return None
    if launcher.driver_status == -2:  # a driver the launcher cannot use: jaxlib's call still can
        user_code.warn(f"jnova's kernel launcher cannot use this CUDA driver, using jaxlib's PTX kernel call: "
                      f"{launcher.driver_error}", RuntimeWarning)
        return None
    launcher.mode = _register_with_xla(launcher)
    if launcher.driver_error:
        log.info("jnova: launcher has no CUDA driver here (%s); it can lower steps, not launch them",
                 launcher.driver_error)
    return launcher


def _register_with_xla(launcher: Launcher) -> str | None:
    """Register the launcher for CUDA: with its record stage where it has one and a GPU is here
    ("record"), else through jaxlib with the stages it takes ("capture"); None where this jaxlib has
    no CUDA (steps still lower ahead of time)."""
    if _record_wanted() and launcher.has_record_stage and launcher.driver_status == 0:
        try:
            launcher.bootstrap(TARGET, "cuda")
            jax.ffi.register_ffi_target(CAPTURED_TARGET, launcher.handler(), platform="CUDA", api_version=1)
            log.info("jnova: launcher registered for CUDA with its record stage")
            return "record"
        except Exception as e:  # no CUDA device, or XLA refused: launches are captured instead
            log.info("jnova: launcher not registered with its record stage (%s); launches are captured", e)
    try:
        jax.ffi.register_ffi_target(TARGET, launcher.handler(), platform="CUDA", api_version=1)
    except Exception as e:  # a CPU-only jaxlib may know no CUDA platform: steps still lower ahead of time
        log.info("jnova: launcher not registered with XLA for CUDA (%s)", e)
        return None
    return "capture"


def _record_wanted() -> bool:
    return os.environ.get("JNOVA_LAUNCHER_RECORD", "1").strip() != "0"


def call_target(launcher: Launcher) -> str:
    """The custom-call target a step lowered now launches through: the launcher with its record stage,
    unless JNOVA_LAUNCHER_RECORD=0 asks for captured launches where it has one."""
    if launcher.mode == "record" and not _record_wanted():
        return CAPTURED_TARGET
    return TARGET
