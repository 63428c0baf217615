"""The persistent artifact cache: across processes, corruption, concurrency, no pickling."""
import json
import os
import pathlib
import stat
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnova
from jnova.runtime.cache import ARTIFACTS

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    import jnova

    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.5 * g, loss

    rng = np.random.default_rng(int(sys.argv[1]))
    w, x = rng.standard_normal((6, 3), np.float32), rng.standard_normal((5, 6), np.float32)
    compiled = jnova.compile(step)
    got = compiled(w, x)
    want = jax.jit(step)(w, x)
    ok = all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want))
    print(json.dumps({"ok": bool(ok), "stats": compiled.stats()[0]}))
""")


def _run(cache_dir, seed=0, **popen):
    env = dict(os.environ, JNOVA_CACHE_DIR=str(cache_dir), JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(seed)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def _result(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_second_process_skips_the_nova_pipeline(tmp_path):
    first = _result(_run(tmp_path, seed=1))
    second = _result(_run(tmp_path, seed=2))  # other values, same structure
    assert first["ok"] and second["ok"]
    assert first["stats"]["cache_hit"] is None and "to_nova" in first["stats"]["compile_s"]
    assert second["stats"]["cache_hit"] == "disk"
    assert not {"to_nova", "lower_cpu", "to_linalg"} & set(second["stats"]["compile_s"])


def test_cache_dir_is_private(tmp_path):
    root = tmp_path / "cache"
    _result(_run(root))
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def _step(w, x):
    return jax.value_and_grad(lambda w: jnp.sum(jnp.sin(x @ w)))(w)


@pytest.mark.parametrize("damage", ["truncate", "alter", "drop_manifest_entry"])
def test_corrupt_entry_is_discarded_and_recompiled(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("JNOVA_CACHE_DIR", str(tmp_path))
    rng = np.random.default_rng()
    w, x = rng.standard_normal((4, 3), np.float32), rng.standard_normal((2, 4), np.float32)
    jnova.compile(_step)(w, x)
    (entry,) = [p for p in tmp_path.glob("*/*") if p.is_dir()]
    target = entry / "llvm.mlir"
    if damage == "truncate":
        target.write_text(target.read_text()[:100])
    elif damage == "alter":
        target.write_text(target.read_text().replace("llvm.func", "llvm.fun", 1))
    else:
        manifest = json.loads((entry / "manifest.json").read_text())
        manifest["files"]["llvm.mlir"] = "0" * 64
        (entry / "manifest.json").write_text(json.dumps(manifest))
    ARTIFACTS.clear()
    step = jnova.compile(_step)
    with pytest.warns(UserWarning, match="corrupt cache entry"):
        got = step(w, x)
    assert step.stats()[0]["cache_hit"] is None  # recompiled
    want = jax.jit(_step)(w, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
    # the rewritten entry is whole again and hits next time
    ARTIFACTS.clear()
    again = jnova.compile(_step)
    again(w, x)
    assert again.stats()[0]["cache_hit"] == "disk"


def test_two_processes_compiling_at_once(tmp_path):
    procs = [_run(tmp_path, seed=s) for s in (3, 4)]
    results = [_result(p) for p in procs]
    assert all(r["ok"] for r in results)
    entries = [p for p in tmp_path.glob("*/*") if p.is_dir()]
    assert len(entries) == 1 and not list(tmp_path.glob("*/.*"))  # one entry, no leftovers
    third = _result(_run(tmp_path, seed=5))
    assert third["ok"] and third["stats"]["cache_hit"] == "disk"


def test_cache_path_never_pickles_or_evaluates():
    root = pathlib.Path(jnova.__file__).parent
    for name in ("runtime/disk_cache.py", "pipeline.py", "primitives/executor.py", "passes/form_kernels.py"):
        source = (root / name).read_text()
        for forbidden in ("import pickle", "pickle.", "marshal", "eval(", "exec(", "shelve", "import dill"):
            assert forbidden not in source, f"{name} uses {forbidden}"


def test_entry_this_jnova_cannot_use_is_a_miss(tmp_path, monkeypatch):
    """A whole entry (hashes fine) whose contents an older or newer jnova wrote differently."""
    monkeypatch.setenv("JNOVA_CACHE_DIR", str(tmp_path))
    rng = np.random.default_rng()
    w, x = rng.standard_normal((4, 3), np.float32), rng.standard_normal((2, 4), np.float32)
    jnova.compile(_step)(w, x)
    (entry,) = [p for p in tmp_path.glob("*/*") if p.is_dir()]
    meta = json.loads((entry / "meta.json").read_text())
    del meta["backend"]  # as an entry from before the GPU backend
    from jnova.runtime.disk_cache import DiskCache

    files = {p.name: p.read_text() for p in entry.iterdir() if p.name != "manifest.json"}
    files["meta.json"] = json.dumps(meta)
    import shutil

    shutil.rmtree(entry)
    DiskCache(str(tmp_path)).store(entry.name, files)
    ARTIFACTS.clear()
    step = jnova.compile(_step)
    with pytest.warns(UserWarning, match="cannot use the cached entry"):
        got = step(w, x)
    assert step.stats()[0]["cache_hit"] is None
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, jax.jit(_step)(w, x))


XLA_CACHE_SCRIPT = textwrap.dedent("""
    import json, os
    import jax, jax.numpy as jnp, numpy as np
    import jnova

    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the test step compiles fast
    folder = jnova.enable_xla_cache()
    step = jnova.compile(lambda w, x: jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w))
    step(np.ones((4, 3), np.float32), np.ones((2, 4), np.float32))
    jax.jit(lambda x: jnp.sin(x) * 2)(np.ones(3, np.float32))  # on the CPU jnova's kernels are host
    # callbacks, which JAX does not cache; its GPU kernels are custom calls, which it does
    print(json.dumps({"folder": folder, "configured": jax.config.jax_compilation_cache_dir,
                      "files": len(os.listdir(folder)) if folder else 0}))
""")


def test_xla_compiles_are_cached_with_jnovas_cache(tmp_path):
    """enable_xla_cache: JAX's compilation cache under <jnova cache>/xla, so a warm process skips XLA's
    compile of the step too; a cache the user configured for JAX is left alone."""
    env = dict(os.environ, JNOVA_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    run = subprocess.run([sys.executable, "-c", XLA_CACHE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["folder"] == result["configured"] == str(tmp_path / "xla") and result["files"] >= 1
    theirs = tmp_path / "theirs"
    env.update(JAX_COMPILATION_CACHE_DIR=str(theirs), JNOVA_CACHE_DIR=str(tmp_path / "jnova"))
    run = subprocess.run([sys.executable, "-c", XLA_CACHE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["folder"] == str(theirs)
    assert not (tmp_path / "jnova" / "xla").exists()


def test_a_step_restored_from_another_steps_entry_shows_its_own_names(tmp_path, monkeypatch):
    """The cache's key is the program's structure, so a function of the same structure with other
    argument names restores the entry another stored: its nova text names its own arguments and
    results, not the other's, and says that the source locations were not kept."""
    monkeypatch.setenv("JNOVA_CACHE_DIR", str(tmp_path))
    ARTIFACTS.clear()

    def first(params, lr):
        return params * lr

    def second(weights, scale):
        return {"moved": weights * scale}

    x = jnp.ones(3)
    stored = jnova.compile(first).lower(x, 2.0)
    ARTIFACTS.clear()
    restored = jnova.compile(second).lower(x, 2.0)
    assert restored.stats()["cache_hit"] == "disk"
    text = restored.as_text("nova")
    assert 'jnova.name = "weights"' in text and 'jnova.name = "scale"' in text
    assert "result['moved']" in text and "params" not in text and "first" not in text and "loc(" not in text
    assert "source locations are not kept" in text
    again = jnova.compile(first).lower(x, 2.0).as_text("nova")  # the function that stored it: as stored
    assert again == stored.as_text("nova") and 'first"("' in again and "not kept" not in again
