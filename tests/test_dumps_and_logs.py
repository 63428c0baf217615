"""What a user debugging a step sees: every stage `as_text` takes, dumps (also of a step restored
from the persistent cache), stage times at DEBUG and single rewrites only below it."""
from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnova
from models import assert_trees_close, fresh_seed, mlp


def step(w, x):
    loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    return w - 0.5 * g, loss


def _args():
    rng = np.random.default_rng(fresh_seed())
    return (jnp.asarray(rng.standard_normal((6, 3)), jnp.float32),
            jnp.asarray(rng.standard_normal((5, 6)), jnp.float32))


def test_stages_lists_every_stage_as_text_takes_hlo_included():
    args = _args()
    lowered = jnova.compile(step).lower(*args)
    assert "hlo" in lowered.stages and {"jaxpr", "nova"} <= set(lowered.stages)
    for stage in lowered.stages:
        assert lowered.as_text(stage).strip(), stage
    hlo, jit_hlo = lowered.as_text("hlo"), jax.jit(step).lower(*args).as_text()
    assert "func.func public @main" in hlo and "func.func public @main" in jit_hlo  # StableHLO, as jax.jit's
    with pytest.raises(ValueError, match=re.escape(str(lowered.stages))):
        lowered.as_text("bogus")


def _stage_files(folder) -> dict[str, str]:
    return {re.sub(r"^\d+_", "", p.stem): p.read_text() for p in sorted(folder.iterdir())}


def test_dump_of_a_step_restored_from_the_persistent_cache(tmp_path, monkeypatch):
    """The second compile comes from the persistent cache: its dump holds the stages the cache keeps,
    and a note that it was restored, with its key and how to get a full dump."""
    monkeypatch.setenv("JNOVA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("JNOVA_DUMP_DIR", str(tmp_path / "dump"))
    args = _args()
    compiled = jnova.compile(step)
    compiled(*args)
    restored = jnova.compile(step)
    assert_trees_close(restored(*args), jax.jit(step)(*args))
    assert restored.stats()[0]["cache_hit"] == "disk"
    full, again = (_stage_files(d) for d in sorted((tmp_path / "dump").iterdir()))
    assert "restored" not in full
    note = again.pop("restored")
    assert restored._executables[next(iter(restored._executables))].key in note
    assert "persistent cache" in note and "JNOVA_CACHE_DIR=off" in note
    assert set(full) == set(again), (sorted(full), sorted(again))
    for stage in set(full) - {"times"}:
        assert again[stage] == full[stage], stage


def test_debug_logs_stage_times_and_trace_logs_each_rewrite(caplog):
    params, x, y = mlp.init(jax.random.key(fresh_seed())), *mlp.batch(jax.random.key(fresh_seed()))
    caplog.set_level(logging.DEBUG, logger="jnova")
    jnova.compile(mlp.sgd_step)(params, x, y)
    debug = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("stage to_nova") for m in debug) and any(m.startswith("stage canonicalize") for m in debug)
    assert any(re.match(r"canonicalize: \d+ rewrites", m) for m in debug)
    assert not any("rewrote" in m for m in debug), "single rewrites logged at DEBUG"
    caplog.clear()
    caplog.set_level(logging.getLevelName("TRACE"), logger="jnova")
    jnova.compile(mlp.sgd_step)(params, x, y)
    rewrites = [r for r in caplog.records if "rewrote" in r.getMessage()]
    assert rewrites and all(r.name == "jnova.passes" and r.levelname == "TRACE" for r in rewrites)


# --------------------------------------------------------------------------- names and locations in nova text
def _signature_line(text: str, marker: str) -> str:
    return next(line for line in text.splitlines() if marker in line)


def test_nova_text_names_arguments_and_results_by_pytree_path_like_jit():
    """The nova function's arguments and results carry the pytree paths jax.jit's StableHLO gives them
    (`params['w1']`, `result[0]['b1']`), in the same order."""
    params, x, y = mlp.init(jax.random.key(fresh_seed())), *mlp.batch(jax.random.key(fresh_seed()))
    nova = _signature_line(jnova.compile(mlp.sgd_step).lower(params, x, y).as_text("nova"), "func.func @step")
    hlo = _signature_line(jax.jit(mlp.sgd_step).lower(params, x, y).as_text(debug_info=True), "@main")
    jit_args = re.findall(r'%arg\d+: tensor<[^>]*> loc\("([^"]*)"\)', hlo)
    jit_results = re.findall(r'jax\.result_info = "([^"]*)"', hlo)
    assert jit_args == ["params['b1']", "params['b2']", "params['w1']", "params['w2']", "x", "y"]
    assert re.findall(r'jnova\.name = "([^"]*)"', nova) == jit_args + jit_results


def attention_scores(q, k):
    scores = q @ k.T  # the matmul's line
    return jax.nn.softmax(scores / 8.0, axis=-1)


def test_nova_ops_carry_the_users_source_locations_like_jit():
    q, k = _args()[1], _args()[1]
    nova = jnova.compile(attention_scores).lower(q, k).as_text("nova")
    hlo = jax.jit(attention_scores).lower(q, k).as_text(debug_info=True)
    line = attention_scores.__code__.co_firstlineno + 1
    matmul = next(l for l in nova.splitlines() if '"nova.matmul"' in l)
    assert re.search(rf'loc\("attention_scores"\("{re.escape(__file__)}":{line}:\d+\)\)$', matmul), matmul
    assert f'"{__file__}":{line}:' in hlo  # jax.jit's StableHLO names the same line


def test_names_and_locations_round_trip_through_the_parser():
    from jnova.dialect.ir import Func
    from jnova.dialect.ops import OPS
    from jnova.dialect.parse import parse_module
    from jnova.dialect.types import TensorType

    t = TensorType((4,), "float32")
    f = Func("step", [t, t], arg_names=["params['h_0']['attn']", None], result_names=["result[0]", 'odd "name"'])
    a = f.add(OPS["nova.add"]([f.args[0], f.args[1]], [t], loc='/tmp/my "dir"/train.py:12:8 (loss_fn)'))
    b = f.add(OPS["nova.mul"]([a.result, f.args[1]], [t], loc="somewhere without a line"))
    f.returns = [a.result, b.result]
    text = f.print(debug_info=True)
    back = parse_module(text)
    assert back.print(debug_info=True) == text
    assert back.arg_names == f.arg_names and back.result_names == f.result_names
    assert [op.loc for op in back.ops] == [op.loc for op in f.ops]
    assert "loc(" not in f.print() and "jnova.name" not in f.print()  # the structure alone, for hashing


def test_structurally_equal_steps_share_kernels_whatever_their_lines():
    """Names and locations are debug information: two steps alike but for where they are written
    share the compiled kernels (the in-memory cache keys the text without them)."""
    from jnova.runtime.cache import ARTIFACTS

    def one(w, x):
        return jnp.tanh(x @ w).sum()

    def two(w, x):
        return jnp.tanh(x @ w).sum()

    args = _args()
    jnova.compile(one)(*args)
    hits = ARTIFACTS.stats.hits
    got = jnova.compile(two)(*args)
    assert ARTIFACTS.stats.hits == hits + 1
    assert_trees_close(got, jax.jit(two)(*args))
