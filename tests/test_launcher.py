"""jnova's kernel launcher (jnova/runtime/launcher.c) on a CPU: its FFI handler runs on XLA's CPU
backend against a stand-in driver (tests/data/mock_cuda.c) whose "kernels" compute on the host, so
parameter order, aliasing, launch geometry, module caching and every error path are checked through
real results. The GPU tests run every jnova kernel through the same handler on the H200."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jnova.errors import CompileError
from jnova.runtime import launcher

pytestmark = pytest.mark.skipif(launcher.compiler() is None, reason="no C compiler")

MOCK_SOURCE = Path(__file__).with_name("data") / "mock_cuda.c"
HOST_TARGET = "jnova_launch_host_test"


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """(launcher, mock driver): the host-test build of the launcher on the stand-in driver, registered
    with XLA's CPU backend as HOST_TARGET."""
    mock = tmp_path_factory.mktemp("mock") / "mock_cuda.so"
    subprocess.run([launcher.compiler(), "-O1", "-shared", "-fPIC", str(MOCK_SOURCE), "-o", str(mock)], check=True)
    lib = launcher.Launcher(launcher.build((launcher.HOST_TEST,)), driver=str(mock))
    assert lib.driver_error is None
    jax.ffi.register_ffi_target(HOST_TARGET, lib.handler(), platform="cpu", api_version=1)
    driver = ctypes.CDLL(str(mock))
    driver.mock_loads.restype = driver.mock_launches.restype = ctypes.c_long
    return lib, driver


@pytest.fixture
def rng():
    seed = int(os.environ.get("JNOVA_TEST_SEED") or np.random.SeedSequence().entropy % 2**31)
    print(f"random seed {seed}")  # shown with a failure
    return np.random.default_rng(seed)


def register(lib, entry: str, ptx: str) -> int:
    kernel_id = launcher.kernel_id(entry, ptx)
    lib.register(kernel_id, entry, ptx)
    return kernel_id


def launch(kernel_id, out_shape, *args, geometry, aliases=None, **attrs):
    call = jax.ffi.ffi_call(HOST_TARGET, out_shape, input_output_aliases=aliases)
    attrs = {"kernel_id": np.uint64(kernel_id), "launch": np.array(geometry, np.int64), **attrs}
    return jax.jit(lambda *xs: call(*xs, **attrs))(*args)


def last_launch(driver) -> list[int]:
    out = (ctypes.c_int64 * 7)()
    driver.mock_last_launch(out)
    return list(out)


def test_launch_passes_buffers_in_order_with_the_geometry(host, rng):
    lib, driver = host
    kernel_id = register(lib, "mock_add", "// add, geometry test")
    a, b = (rng.standard_normal(640).astype(np.float32) for _ in range(2))
    out = launch(kernel_id, jax.ShapeDtypeStruct((640,), jnp.float32), a, b, geometry=[5, 1, 1, 128, 1, 1, 4096])
    np.testing.assert_array_equal(np.asarray(out), a + b)
    assert last_launch(driver) == [5, 1, 1, 128, 1, 1, 4096]


def test_large_dynamic_shared_memory_is_allowed_on_the_function(host, rng):
    lib, driver = host
    kernel_id = register(lib, "mock_add", "// add, 200 KiB of shared memory")
    a, b = (rng.standard_normal(256).astype(np.float32) for _ in range(2))
    launch(kernel_id, jax.ShapeDtypeStruct((256,), jnp.float32), a, b, geometry=[2, 1, 1, 128, 1, 1, 200 * 1024])
    assert driver.mock_max_dynamic_shared() == 200 * 1024


def test_aliased_result_updates_in_place(host, rng):
    lib, _ = host
    kernel_id = register(lib, "mock_axpy_inplace", "// y += 2 x")
    x, y = (rng.standard_normal(512).astype(np.float32) for _ in range(2))
    out = launch(kernel_id, jax.ShapeDtypeStruct((512,), jnp.float32), x, y, geometry=[4, 1, 1, 128, 1, 1, 0],
                 aliases={1: 0})
    np.testing.assert_allclose(np.asarray(out), y + 2 * x, rtol=1e-6)


def test_hundreds_of_buffers(host, rng):
    """A horizontally fused kernel (an optimizer's updates) takes hundreds of buffers."""
    lib, _ = host
    kernel_id = register(lib, "mock_sum_many", "// sum of 300 inputs")
    xs = [rng.standard_normal(64).astype(np.float32) for _ in range(300)]
    out = launch(kernel_id, jax.ShapeDtypeStruct((64,), jnp.float32), *xs, geometry=[1, 1, 1, 64, 1, 1, 0])
    np.testing.assert_allclose(np.asarray(out), np.sum(xs, axis=0, dtype=np.float64), rtol=1e-4, atol=1e-4)


def test_tensor_maps_are_encoded_from_their_buffer_and_passed_by_value_after_the_buffers(host, rng):
    """A kernel registered with a TMA descriptor gets it after its buffers, 64-byte aligned, encoded
    from the buffer's address at the launch with the registered shape (the stand-in encodes the
    address and arguments, and its kernel reads the input through the map)."""
    from jnova.codegen.gpu.launch import TensorMap

    lib, _ = host
    tensor_map = TensorMap(buffer=0, param=2, dtype="bfloat16", dims=(64, 5), strides=(128,), box=(64, 2), swizzle=128)
    ptx = "// through a tensor map"
    kernel_id = launcher.kernel_id("mock_through_map", ptx, (tensor_map,))
    assert kernel_id != launcher.kernel_id("mock_through_map", ptx)
    lib.register(kernel_id, "mock_through_map", ptx, (tensor_map,))
    a = rng.standard_normal(320).astype(np.float32)
    out = launch(kernel_id, jax.ShapeDtypeStruct((320,), jnp.float32), a, geometry=[5, 1, 1, 64, 1, 1, 0])
    # dims 64 + 5, stride 128, box 64 + 2, bf16 = 9, 128-byte swizzle = 3, rank 2; aligned (no 1000)
    want = a + np.float32(64 + 5 + 128 + 64 + 2 + 9 + 3 + 2)
    np.testing.assert_array_equal(np.asarray(out), want)
    # an aliased result: the call has three buffers (a, the operand the result aliases, the result),
    # the kernel declares two; its map still follows them
    poison = np.full(320, np.nan, np.float32)
    out = launch(kernel_id, jax.ShapeDtypeStruct((320,), jnp.float32), a, poison, geometry=[5, 1, 1, 64, 1, 1, 0],
                 aliases={1: 0})
    np.testing.assert_array_equal(np.asarray(out), want)


def test_tensor_maps_outside_what_the_driver_takes_are_refused(host):
    from jnova.codegen.gpu.launch import TensorMap

    lib, _ = host
    with pytest.raises(ValueError, match="multiples of 16"):
        TensorMap(buffer=0, param=2, dtype="bfloat16", dims=(64, 5), strides=(130,), box=(64, 2))
    with pytest.raises(ValueError, match="box"):
        TensorMap(buffer=0, param=2, dtype="bfloat16", dims=(512, 5), strides=(1024,), box=(512, 2))
    maps = [TensorMap(buffer=0, param=3 + i, dtype="float32", dims=(64,), strides=(), box=(64,)) for i in range(9)]
    with pytest.raises(CompileError, match="9 tensor maps"):
        lib.register(launcher.kernel_id("mock_add", "// nine maps", maps), "mock_add", "// nine maps", maps)


def test_module_loads_once_per_context(host, rng):
    lib, driver = host
    kernel_id = register(lib, "mock_add", "// add, module cache test")
    a, b = (rng.standard_normal(128).astype(np.float32) for _ in range(2))
    shape = jax.ShapeDtypeStruct((128,), jnp.float32)
    loads, launches = driver.mock_loads(), driver.mock_launches()
    for _ in range(3):
        launch(kernel_id, shape, a, b, geometry=[1, 1, 1, 128, 1, 1, 0])
    assert (driver.mock_loads() - loads, driver.mock_launches() - launches) == (1, 3)
    driver.mock_set_context(2)  # another device's context loads its own module
    try:
        launch(kernel_id, shape, a, b, geometry=[1, 1, 1, 128, 1, 1, 0])
    finally:
        driver.mock_set_context(1)
    launch(kernel_id, shape, a, b, geometry=[1, 1, 1, 128, 1, 1, 0])
    assert driver.mock_loads() - loads == 2 and lib.module_loads() >= 2
    assert driver.mock_context_depth() == 0  # every push was popped


def test_launch_while_the_stream_is_captured(host, rng):
    """XLA records the handler into a command buffer by capturing the stream: the context then comes
    from cuCtxGetCurrent (the stand-in, like CUDA, refuses cuStreamGetCtx during capture)."""
    lib, driver = host
    kernel_id = register(lib, "mock_add", "// add, capture test")
    a, b = (rng.standard_normal(256).astype(np.float32) for _ in range(2))
    launch(kernel_id, jax.ShapeDtypeStruct((256,), jnp.float32), a, b, geometry=[2, 1, 1, 128, 1, 1, 0])
    driver.mock_set_capturing(1)
    try:
        out = launch(kernel_id, jax.ShapeDtypeStruct((256,), jnp.float32), b, b, geometry=[2, 1, 1, 128, 1, 1, 0])
    finally:
        driver.mock_set_capturing(0)
    np.testing.assert_array_equal(np.asarray(out), b + b)


def test_without_an_initialize_stage_modules_load_at_the_first_launch(host, rng):
    """The handler registered with its record stage has no initialize stage (XLA would run it for every
    call of every step): a module loads at the kernel's first launch, and a first launch while the
    stream is captured (the driver cannot load a module then) fails with the reason and the way out."""
    lib, driver = host
    target = HOST_TARGET + "_execute_only"
    jax.ffi.register_ffi_target(target, {"execute": jax.ffi.pycapsule(lib.lib.jnova_launch)}, platform="cpu",
                                api_version=1)
    a, b = (rng.standard_normal(128).astype(np.float32) for _ in range(2))
    shape = jax.ShapeDtypeStruct((128,), jnp.float32)

    def run(kernel_id):
        call = jax.ffi.ffi_call(target, shape)
        attrs = {"kernel_id": np.uint64(kernel_id), "launch": np.array([1, 1, 1, 128, 1, 1, 0], np.int64)}
        return np.asarray(jax.jit(lambda x, y: call(x, y, **attrs))(a, b))

    loads = driver.mock_loads()
    np.testing.assert_array_equal(run(register(lib, "mock_add", "// add, loaded by its launch")), a + b)
    assert driver.mock_loads() == loads + 1
    kernel_id = register(lib, "mock_add", "// add, first launched during capture")
    driver.mock_set_capturing(1)
    try:
        with pytest.raises(Exception, match="not loaded in this context.*JNOVA_LAUNCHER_RECORD=0"):
            run(kernel_id)
    finally:
        driver.mock_set_capturing(0)
    assert driver.mock_loads() == loads + 1
    np.testing.assert_array_equal(run(kernel_id), a + b)  # outside capture it loads and runs


def test_unregistered_kernel_is_a_clear_error(host):
    x = np.ones(4, np.float32)
    with pytest.raises(Exception, match="is not registered in this process"):
        launch(12345, jax.ShapeDtypeStruct((4,), jnp.float32), x, x, geometry=[1, 1, 1, 4, 1, 1, 0])


def test_driver_failure_names_the_kernel_and_the_call(host):
    lib, driver = host
    kernel_id = register(lib, "mock_add", "// MOCK_INVALID_PTX")
    x = np.ones(4, np.float32)
    with pytest.raises(Exception, match=r"jnova kernel mock_add: cuModuleLoadData failed: mock: invalid PTX"):
        launch(kernel_id, jax.ShapeDtypeStruct((4,), jnp.float32), x, x, geometry=[1, 1, 1, 4, 1, 1, 0])
    assert driver.mock_context_depth() == 0
    unknown = register(lib, "no_such_entry", "// a module without the entry")
    with pytest.raises(Exception, match="cuModuleGetFunction failed"):
        launch(unknown, jax.ShapeDtypeStruct((4,), jnp.float32), x, x, geometry=[1, 1, 1, 4, 1, 1, 0])


def test_call_without_launch_geometry_is_refused(host):
    lib, _ = host
    kernel_id = register(lib, "mock_add", "// add, attribute test")
    call = jax.ffi.ffi_call(HOST_TARGET, jax.ShapeDtypeStruct((4,), jnp.float32))
    x = np.ones(4, np.float32)
    with pytest.raises(Exception, match=r"needs attributes kernel_id \(u64\) and launch \(i64\[7\]\)"):
        jax.jit(lambda a: call(a, a, kernel_id=np.uint64(kernel_id), launch=np.arange(6, dtype=np.int64)))(x)


def test_register_refuses_an_id_taken_by_another_kernel(host):
    lib, _ = host
    kernel_id = register(lib, "mock_add", "// add, collision test")
    with pytest.raises(CompileError, match="hash collision"):
        lib.register(kernel_id, "mock_add", "// another kernel, same id")
    lib.register(kernel_id, "mock_add", "// add, collision test")  # the same kernel again is fine
    assert lib.is_registered(kernel_id) and not lib.is_registered(kernel_id ^ 1)


def test_kernel_ids_fit_mlir_attributes():
    ids = {launcher.kernel_id("k", f"// {i}") for i in range(200)}
    assert len(ids) == 200 and max(ids) < 2**63 and max(ids) > 2**60


def test_missing_driver_is_reported_not_fatal():
    lib = launcher.Launcher(launcher.build((launcher.HOST_TEST,)), driver="/nonexistent/libcuda.so.1")
    assert lib.driver_status == -1 and "dlopen(/nonexistent/libcuda.so.1)" in lib.driver_error


def test_driver_without_a_needed_function_is_unusable(tmp_path):
    partial = tmp_path / "libcuda_partial.so"  # a "driver" exporting only cuStreamGetCtx
    source = tmp_path / "partial.c"
    source.write_text("int cuStreamGetCtx(void* s, void** c) { (void)s; *c = 0; return 0; }\n")
    subprocess.run([launcher.compiler(), "-shared", "-fPIC", str(source), "-o", str(partial)], check=True)
    lib = launcher.Launcher(launcher.build((launcher.HOST_TEST,)), driver=str(partial))
    assert lib.driver_status == -2 and "has no symbol cuStreamIsCapturing" in lib.driver_error


def test_build_is_reused_and_kept_private(tmp_path, monkeypatch):
    monkeypatch.setenv("JNOVA_CACHE_DIR", str(tmp_path))
    first = launcher.build()
    assert first.parent == tmp_path / "launcher" and (first.parent.stat().st_mode & 0o777) == 0o700
    mtime = first.stat().st_mtime_ns
    assert launcher.build() == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert launcher.build((launcher.HOST_TEST,)) != first  # other flags, another library
    assert not list(first.parent.glob("*.partial"))


def test_source_compiles_without_warnings():
    """The launcher against this jaxlib's FFI headers, with every warning an error."""
    command = [launcher.compiler(), *launcher.FLAGS, "-Wextra", "-Werror", "-fsyntax-only",
               "-I", jax.ffi.include_dir(), str(launcher.SOURCE)]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_failed_build_falls_back_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("JNOVA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")
    with pytest.raises(CompileError, match="stage 'launcher'"):
        launcher.build()
    with pytest.warns(RuntimeWarning, match="using jaxlib's PTX kernel call"):
        assert launcher._load() is None


def test_choice_follows_the_environment(monkeypatch):
    monkeypatch.setenv("JNOVA_LAUNCHER", "jaxlib")
    assert launcher.choice() == "jaxlib"
    monkeypatch.setenv("JNOVA_LAUNCHER", "jnova")
    assert launcher.choice() == "jnova"  # this machine has a C compiler
    monkeypatch.setenv("JNOVA_LAUNCHER", "cublas")
    with pytest.raises(ValueError, match="expected 'jnova' or 'jaxlib'"):
        launcher.choice()


def test_bootstrap_registers_the_handler_through_a_call(host, rng):
    """jaxlib's Python registration takes no record stage, so on CUDA the launcher registers itself,
    every stage, through the FFI API of a call it runs once. Here the same path on XLA's CPU backend."""
    lib, driver = host
    target = "jnova_launch_host_bootstrapped"
    lib.bootstrap(target, "cpu", bootstrap="jnova_launch_bootstrap_host_test")
    assert lib.lib.jnova_bootstrap_status() == 1
    kernel_id = register(lib, "mock_add", "// add, bootstrap test")
    a, b = (rng.standard_normal(384).astype(np.float32) for _ in range(2))
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((384,), jnp.float32))
    launches = lib.counts()["launches"]
    out = jax.jit(lambda x, y: call(x, y, kernel_id=np.uint64(kernel_id),
                                    launch=np.array([3, 1, 1, 128, 1, 1, 0], np.int64)))(a, b)
    np.testing.assert_array_equal(np.asarray(out), a + b)
    assert last_launch(driver) == [3, 1, 1, 128, 1, 1, 0] and lib.counts()["launches"] == launches + 1


def test_launch_counts(host, rng):
    lib, _ = host
    kernel_id = register(lib, "mock_add", "// add, count test")
    a, b = (rng.standard_normal(128).astype(np.float32) for _ in range(2))
    before = lib.counts()
    launch(kernel_id, jax.ShapeDtypeStruct((128,), jnp.float32), a, b, geometry=[1, 1, 1, 128, 1, 1, 0])
    after = lib.counts()
    assert after["launches"] == before["launches"] + 1
    assert after["record_creates"] == before["record_creates"]  # XLA's CPU backend records nothing


RECORD_HEADER = Path(jax.ffi.include_dir(), "xla", "ffi", "api", "record_c_api.h")


@pytest.mark.skipif(not RECORD_HEADER.exists(), reason="this jaxlib's FFI has no record stage (jaxlib < 0.11)")
def test_record_stage_creates_and_updates_one_kernel_node(tmp_path):
    """The record stage against a stand-in for XLA's record API (tests/data/record_harness.c): create
    hands XLA the registered PTX, the geometry and the buffers in order; update the same command with
    the buffers' new addresses; bad buffers, another extension version, a full command list and the
    wrong stage are refused."""
    lib_path = launcher.build((launcher.HOST_TEST,))
    assert launcher.Launcher(lib_path).has_record_stage
    harness = tmp_path / "record_harness"
    subprocess.run([launcher.compiler(), "-O1", "-std=c11", "-Wall", "-Wextra", "-Werror", "-I", jax.ffi.include_dir(),
                    str(MOCK_SOURCE.with_name("record_harness.c")), "-o", str(harness), "-ldl"], check=True)
    # A fresh process: the library's counters start at zero.
    done = subprocess.run([str(harness), str(lib_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_record_stage_is_built_where_the_headers_have_it():
    lib = launcher.Launcher(launcher.build((launcher.HOST_TEST,)), driver="/nonexistent/libcuda.so.1")
    assert lib.has_record_stage == RECORD_HEADER.exists()


def test_record_stage_can_be_turned_off_per_lowering(monkeypatch):
    """Where the launcher is registered with its record stage, JNOVA_LAUNCHER_RECORD=0 while a step is
    lowered makes its launches captured ones (the same handler, registered without the record stage)."""
    lib = launcher.Launcher(launcher.build((launcher.HOST_TEST,)), driver="/nonexistent/libcuda.so.1")
    monkeypatch.delenv("JNOVA_LAUNCHER_RECORD", raising=False)
    lib.mode = "record"
    assert launcher.call_target(lib) == launcher.TARGET
    monkeypatch.setenv("JNOVA_LAUNCHER_RECORD", "0")
    assert launcher.call_target(lib) == launcher.CAPTURED_TARGET
    lib.mode = "capture"  # registered without it: one target, whatever the variable says
    assert launcher.call_target(lib) == launcher.TARGET
