"""jax.jit's contract on the GPU: static and donated arguments, and the dump of a step restored from
the persistent cache (PTX, launches), each against jax.jit on the GPU."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnova
from helpers.random_inputs import rand
from models import fresh_seed

pytestmark = pytest.mark.gpu


def _normal(*shape, seed):
    return rand(shape, jnp.float32, seed)


def update(params, grads, lr, *, activation="tanh"):
    act = jnp.tanh if activation == "tanh" else jax.nn.gelu
    return jax.tree.map(lambda p, g: p - lr * act(g) * p.mean(), params, grads)


def test_static_and_donated_arguments_on_the_gpu_like_jit():
    seed = fresh_seed()
    results, deleted = [], []
    for make in (jax.jit, jnova.compile):
        step = make(update, static_argnums=2, static_argnames="activation", donate_argnames="params")
        out = []
        for lr, activation in [(0.1, "tanh"), (0.2, "gelu")]:
            params = {"w": _normal(256, 128, seed=seed), "b": _normal(128, seed=seed + 1)}
            grads = {"w": _normal(256, 128, seed=seed + 2), "b": _normal(128, seed=seed + 3)}
            out.append(step(params, grads, lr, activation=activation))
            deleted.append([p.is_deleted() for p in jax.tree.leaves(params)])
        results.append(out)
        if make is jnova.compile:
            assert step.compile_count == 2
    for got, want in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[0])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert deleted[2:] == deleted[:2]


def test_dump_of_a_gpu_step_restored_from_the_persistent_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JNOVA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("JNOVA_DUMP_DIR", str(tmp_path / "dump"))
    seed = fresh_seed()
    params, grads = {"w": _normal(64, 32, seed=seed)}, {"w": _normal(64, 32, seed=seed + 1)}
    jnova.compile(update, static_argnums=2)(params, grads, 0.1)
    restored = jnova.compile(update, static_argnums=2)
    got = restored(params, grads, 0.1)
    np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(jax.jit(update, static_argnums=2)(params, grads, 0.1)["w"]),
                               rtol=1e-5, atol=1e-6)
    assert restored.stats()[0]["cache_hit"] == "disk"
    full, again = ({re.sub(r"^\d+_", "", p.stem) for p in d.iterdir()} for d in sorted((tmp_path / "dump").iterdir()))
    assert {"ptx", "gpu", "launches", "nova", "plan"} <= full and again == full | {"restored"}
