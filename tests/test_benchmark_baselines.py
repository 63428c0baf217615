"""The XLA side of the GPT-2 benchmark with bf16 operands does the arithmetic jnova's mixed precision does."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpt2_step  # noqa: E402
import plan_traffic  # noqa: E402,F401


def _contractions(jaxpr, found):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(([str(v.aval.dtype) for v in eqn.invars], str(eqn.outvars[0].aval.dtype)))
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                _contractions(inner, found)
    return found


def test_demote_dots_gives_every_contraction_bf16_operands_and_f32_results():
    _, step, batch = gpt2_step.setup(batch=2, seq=16, layers=2)
    before = _contractions(jax.make_jaxpr(step)(*batch).jaxpr, [])
    after = _contractions(jax.make_jaxpr(gpt2_step.demote_dots(step))(*batch).jaxpr, [])
    assert len(before) >= 20 and all(ins == ["float32", "float32"] for ins, _ in before)
    assert len(after) == len(before)
    assert all(ins == ["bfloat16", "bfloat16"] and out == "float32" for ins, out in after)


def test_demote_dots_keeps_everything_else():
    def f(x, w):  # a nested jit, a custom_jvp (relu) and an integer contraction that stays as it is
        h = jax.jit(lambda a, b: a @ b)(x, w)
        return jax.nn.relu(h).sum(), jnp.arange(3) @ jnp.arange(3)

    rng = np.random.default_rng(0)
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((4, 8), (8, 5)))
    (found,) = [_contractions(jax.make_jaxpr(gpt2_step.demote_dots(f))(x, w).jaxpr, [])]
    assert sorted(found) == [(["bfloat16", "bfloat16"], "float32"), (["int32", "int32"], "int32")]
    out = gpt2_step.demote_dots(lambda x, w: (jax.nn.relu(x).sum(), x.shape))(x, w)
    assert out[1] == (4, 8) and float(out[0]) == float(jax.nn.relu(x).sum())


def test_plan_traffic_counts_every_kernel_buffer(tmp_path, monkeypatch, capsys):
    """benchmarks/plan_traffic.py on a one-layer step: its records add up to the families' bytes, and
    the counting itself is checked on a hand-written plan text."""
    import json

    gpu = ("gpu.func @kernel_0(%in0: memref<10xf32> {llvm.align = 16 : i64}, %out0: memref<10xbf16>) kernel {\n"
           "gpu.func @kernel_1(%a: memref<4xbf16>, %b: memref<4xbf16>, %c: memref<2xf32>) kernel {\n")
    launches = ("kernel_0 x3 elementwise(vector=4, block=256, grid=1) grid=[1, 1, 1]\n"
                "kernel_1 x1 matmul[wgmma] 1x1x2x4 bfloat16 a=row b=row grid=[1, 1, 1]\n")
    rows = sorted(plan_traffic.kernel_bytes(gpu, launches))
    assert [r[0] for r in rows] == [24, 3 * (40 + 20)]
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("JNOVA_CACHE_DIR", "off")
    assert plan_traffic.main(["--layers", "1", "--batch", "1", "--seq", "32", "--top", "2"]) == 0
    records = [json.loads(line) for line in (tmp_path / "plan_traffic.jsonl").read_text().splitlines()]
    total = next(r["value"] for r in records if r["metric"] == "gb" and "family" not in r)
    families = [r["value"] for r in records if "family" in r]
    assert total > 0 and abs(sum(families) - total) < 1e-9 and "matmul" in capsys.readouterr().out
