"""Compile isolation, failure reports, IR dumps and stats."""
import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnova
from jnova.capture.trace import Captured
from jnova.codegen.worker import run_pipeline
from jnova.errors import CompileError
from jnova.runtime.cache import ARTIFACTS

# memref loads of i1 hit an assertion in MLIR's memref-to-LLVM lowering: an abort, not an error
ABORTING_MODULE = """func.func @k(%a: memref<4xi1>, %o: memref<4xi1>) {
  %c0 = arith.constant 0 : index
  %v = memref.load %a[%c0] : memref<4xi1>
  memref.store %v, %o[%c0] : memref<4xi1>
  return
}"""


def test_mlir_abort_becomes_compile_error_and_the_process_survives(tmp_path, monkeypatch):
    monkeypatch.setenv("JNOVA_DUMP_DIR", str(tmp_path))
    with pytest.raises(CompileError) as info:
        run_pipeline("cpu", ABORTING_MODULE, stage="lower_cpu")
    err = info.value
    assert err.stage == "lower_cpu"
    assert "Assertion" in str(err) and "MemRefToLLVM" in str(err)
    assert open(err.input_path).read() == ABORTING_MODULE
    # the printed command reproduces the same abort
    cmd = err.repro.split()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode != 0 and "Assertion" in proc.stderr
    # and the next compile in this process works (a fresh worker)
    assert "llvm.func @k" in run_pipeline("cpu", "func.func @k() { return }", stage="lower_cpu")


def test_diagnosed_pass_failure_names_stage():
    with pytest.raises(CompileError, match="stage 'lower_cpu' failed: Unable to parse"):
        run_pipeline("cpu", "func.func @k( {", stage="lower_cpu")


def _step(w, x):
    return jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)


def test_dump_dir_gets_every_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("JNOVA_DUMP_DIR", str(tmp_path))
    rng = np.random.default_rng()
    w, x = rng.standard_normal((5, 3), np.float32), rng.standard_normal((4, 5), np.float32)
    jnova.compile(_step)(w, x)
    (step_dir,) = [d for d in os.listdir(tmp_path) if d.startswith("0")]
    files = sorted(os.listdir(tmp_path / step_dir))
    assert [f.split("_", 1)[1] for f in files] == ["jaxpr.txt", "nova.mlir", "plan.json", "fusion.txt", "linalg.mlir", "llvm.mlir", "times.json"]
    assert "nova.matmul" in (tmp_path / step_dir / files[1]).read_text()
    assert json.loads((tmp_path / step_dir / files[2]).read_text())["steps"][0]["kernel"] == "kernel_0"
    assert "cannot fuse" in (tmp_path / step_dir / files[3]).read_text()


def test_stats_report_kernels_fallbacks_and_stage_times():
    ARTIFACTS.clear()  # an earlier test may have compiled the same structure
    rng = np.random.default_rng()
    w, x = rng.standard_normal((5, 3), np.float32), rng.standard_normal((4, 5), np.float32)
    step = jnova.compile(_step)
    step(w, x)
    (stats,) = step.stats()
    assert stats["kernels"] == 1 and stats["fallbacks"] == []
    assert {"trace", "to_nova", "lower_cpu", "jit_llvm", "xla_lower", "xla_compile"} <= set(stats["compile_s"])
    assert all(t >= 0 for t in stats["compile_s"].values())


def test_the_jaxpr_is_printed_only_when_asked_for(monkeypatch, tmp_path):
    """The cold and the warm path key and compile without printing the jaxpr; `as_text("jaxpr")` prints it."""
    monkeypatch.setenv("JNOVA_CACHE_DIR", str(tmp_path))
    printed = []
    original = Captured.jaxpr_text.func
    monkeypatch.setattr(Captured, "jaxpr_text", property(lambda self: printed.append(1) or original(self)))
    ARTIFACTS.clear()  # an earlier test may have compiled the same structure
    fn = lambda x: jnp.sum(jnp.tanh(x) ** 2)
    x = np.ones((3, 4), np.float32)
    cold = jnova.compile(fn).lower(x)
    warm = jnova.compile(fn).lower(x)
    assert cold.stats()["cache_hit"] is None and warm.stats()["cache_hit"] == "disk"
    assert printed == []
    assert "tanh" in warm.as_text("jaxpr") and printed == [1]
    assert "jaxpr" in warm.stages and "nova" in warm.stages
