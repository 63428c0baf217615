"""The memory report (`Lowered.memory()`): XLA's peak and the buffers live at it, mapped to jnova's kernels."""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jnova
from jnova.runtime.xla_buffers import element_shape, parse_entry, parse_live_ranges
from models import tiny

ITEMSIZE = {"float32": 4, "int32": 4, "bfloat16": 2, "bool": 1, "uint32": 4, "float16": 2}


@pytest.fixture(scope="module")
def report():
    step, params, state, ids = tiny.setup(seed=int(np.random.default_rng().integers(1 << 30)),
                                          optimizer=optax.adamw(1e-3))
    return jnova.compile(step, kernels="fused").lower(params, state, ids).memory()


def test_report_accounts_for_the_peak(report):
    assert report.peak_bytes > 0 and report.buffers
    assert sum(b.bytes for b in report.buffers) == report.peak_bytes  # the buffers XLA lists at its peak
    assert report.peak_bytes <= report.allocated_bytes  # XLA's plan holds at least its peak
    a = report.analysis
    assert a["argument"] > 0 and a["output"] > 0
    for b in report.buffers:
        if b.dtype in ITEMSIZE and b.bytes > 16:
            assert b.bytes == math.prod(b.shape) * ITEMSIZE[b.dtype], b


def test_buffers_name_their_kind_and_kernels(report):
    kinds = report.by_kind()
    assert {"parameter", "optimizer state", "residual"} <= set(kinds), kinds
    params = [b for b in report.buffers if b.kind == "parameter"]
    assert all(b.value.startswith("params") for b in params)  # named by the argument's name and pytree path
    assert all(b.value.startswith("state") for b in report.buffers if b.kind == "optimizer state")
    computed = [b for b in report.buffers if b.kind in ("residual", "temporary") and b.value.startswith("kernel_")]
    assert computed
    for b in computed:  # written by a jnova kernel: which one, and the nova op that computed the value
        assert b.made_by.startswith(b.value.split()[0] + ": nova."), b
        assert b.last_read_by.startswith(("kernel_", "view_")) or b.last_read_by, b
        assert b.live[0] < b.live[1]
    assert "live at the peak" in str(report) and "residual" in str(report)


def test_report_is_dumped_under_the_dump_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JNOVA_DUMP_DIR", str(tmp_path))
    x = jnp.asarray(np.random.default_rng().standard_normal((64, 32)), jnp.float32)

    def f(x):
        return jnp.tanh(x @ x.T).sum()

    r = jnova.compile(f).lower(x).memory()
    texts = [p for p in tmp_path.rglob("*memory.txt")]
    jsons = [p for p in tmp_path.rglob("*memory.json")]
    assert len(texts) == 1 and len(jsons) == 1
    assert texts[0].read_text() == str(r)
    data = json.loads(jsons[0].read_text())
    assert data["peak_bytes"] == r.peak_bytes and len(data["buffers"]) == len(r.buffers)


def test_live_ranges_and_entry_parse():
    live = parse_live_ranges("""HloLiveRange (max 4)
  InstructionSequence:
    0:p
    1:call
    2:gte
    3:tuple
  BufferLiveRange:
    p{}:0-4
    call{0}:1-4
    call{1}:1-2
  Live ranges at 1 (peak):
    p{}: 400 bytes (cumulative: 400 bytes)
    call{0}: 200 bytes (cumulative: 600 bytes)
    call{1}: 8 bytes (cumulative: 608 bytes)
""")
    assert live.sequence == ["p", "call", "gte", "tuple"] and live.peak_position == 1
    assert live.ranges["call{1}"].index == (1,) and live.ranges["call{1}"].end == 2
    assert live.peak == [("p{}", 400), ("call{0}", 200), ("call{1}", 8)]
    entry = parse_entry("""HloModule m

%command_buffer (p0: f32[100]) -> f32[50] {
  %p0 = f32[100]{0} parameter(0)
  ROOT %inner = f32[50]{0} custom-call(%p0), custom_call_target="y", metadata={op_name="jit(step)/kernel_4/nova_kernel"}
}

ENTRY %main (p: f32[100]) -> f32[50] {
  %p = f32[100]{0} parameter(0), metadata={op_name="args[0][\\'w\\']"}
  %call = (f32[50]{0}, s32[2]{0}) custom-call(%p), custom_call_target="x", metadata={op_name="jit(step)/kernel_3/nova_kernel"}
  ROOT %gte = f32[50]{0} get-tuple-element(%call), index=0
}
""")
    assert entry["p"].parameter == 0 and entry["p"].op_name == "args[0]['w']"
    assert entry["call"].operands == ["p"] and entry["call"].op_name.endswith("kernel_3/nova_kernel")
    assert entry["gte"].tuple_index == 0
    assert entry["p0"].parameter is None and entry["inner"].op_name.endswith("kernel_4/nova_kernel")  # a called computation
    assert element_shape(entry["call"].shape, (1,)) == ("s32", (2,))
    assert element_shape(entry["p"].shape, ()) == ("f32", (100,))
