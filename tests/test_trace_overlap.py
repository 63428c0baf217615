"""The overlap of collectives with compute, read from a profile (benchmarks/trace_overlap.py), and the
scaling records of the data-parallel benchmark, on hand-made traces and records."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gpt2_dp import summarize  # noqa: E402
from trace_overlap import collective_overlap  # noqa: E402


def trace_of(kernels: dict[str, list[tuple[int, str, float, float]]]) -> dict:
    """Perfetto-style events: per process name, kernels as (stream, name, start, end)."""
    events = []
    for pid, (process, ks) in enumerate(kernels.items()):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": process}})
        events += [{"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": a, "dur": b - a} for tid, name, a, b in ks]
    return {"traceEvents": events}


def test_overlap_is_the_intersection_of_communication_and_compute_per_device(tmp_path):
    trace = trace_of({
        "/device:GPU:0": [(2, "ncclDevKernel_AllReduce_Sum_f32", 0, 10), (2, "ncclDevKernel_AllReduce", 20, 30),
                          (1, "gemm_kernel", 5, 25), (3, "fusion_3", 6, 8)],   # compute union [5, 25]
        "/device:GPU:1": [(2, "ncclKernel", 0, 10), (1, "gemm", 10, 20)],       # touching, not overlapping
        "/host:CPU": [(0, "ncclCommInit", 0, 100), (0, "work", 0, 100)],        # not a GPU: ignored
    })
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    report = collective_overlap(path)
    gpu0, gpu1 = report["devices"]["/device:GPU:0"], report["devices"]["/device:GPU:1"]
    assert (gpu0["comm_us"], gpu0["compute_us"], gpu0["overlapped_us"], gpu0["collectives"]) == (20, 20, 10, 2)
    assert (gpu1["comm_us"], gpu1["overlapped_us"]) == (10, 0)
    assert report["overlapped_fraction"] == pytest.approx(10 / 30)
    assert "/host:CPU" not in report["devices"]
    assert collective_overlap(trace_of({"/device:GPU:0": [(1, "gemm", 0, 5)]}))["overlapped_fraction"] == 0.0


def test_scaling_is_two_device_throughput_over_twice_one_device(tmp_path):
    path = tmp_path / "gpt2_dp.jsonl"
    rows = [("jnova", 1, 100.0), ("jnova", 2, 190.0), ("xla", 1, 100.0), ("xla", 2, 137.0), ("xla_lhs", 2, 150.0)]
    path.write_text("".join(json.dumps({"bench": "gpt2_dp", "impl": i, "dtype": "bfloat16", "devices": d,
                                        "metric": "tok_s", "value": v}) + "\n" for i, d, v in rows))
    summarize(path)
    scaling = {r["impl"]: r["value"] for r in map(json.loads, path.read_text().splitlines()) if r["metric"] == "scaling"}
    assert scaling == {"jnova": 0.95, "xla": 0.685}  # xla_lhs has no 1-device record of its own
