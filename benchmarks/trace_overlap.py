"""How much of a step's collective communication ran beside its compute, read from a profile.

`jax.profiler.trace(dir, create_perfetto_trace=True)` writes the GPU's kernels as trace events: one
process per device ("/device:GPU:0"), one thread per CUDA stream. NCCL's kernels (names containing
"nccl") are the communication; every other kernel on that device is compute. For each device, the
overlapped time is the length of the intersection of the two unions of intervals, so two kernels of one
kind at once are counted once. `overlapped_fraction` is overlapped over communication time, all
devices together: 0 when every all-reduce waits for the backward to finish, near 1 when they hide
behind it.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path


def collective_overlap(trace: Path | dict) -> dict:
    """{"devices": {name: {"comm_us", "compute_us", "overlapped_us", "collectives"}},
    "overlapped_fraction": ...} of a perfetto trace file (or its parsed JSON)."""
    events = _events(trace)
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpus = {pid for pid, name in names.items() if "/device:GPU" in name}
    per_device: dict[int, dict[str, list]] = {pid: {"comm": [], "compute": []} for pid in gpus}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpus or not e.get("dur"):
            continue
        kind = "comm" if "nccl" in e.get("name", "").lower() else "compute"
        per_device[e["pid"]][kind].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    report, comm_total, overlapped_total = {}, 0.0, 0.0
    for pid, kinds in sorted(per_device.items()):
        comm, compute = _union(kinds["comm"]), _union(kinds["compute"])
        overlapped = _intersection_length(comm, compute)
        comm_us = sum(b - a for a, b in comm)
        report[names[pid]] = {"comm_us": round(comm_us, 1), "compute_us": round(sum(b - a for a, b in compute), 1),
                              "overlapped_us": round(overlapped, 1), "collectives": len(kinds["comm"])}
        comm_total += comm_us
        overlapped_total += overlapped
    return {"devices": report, "overlapped_fraction": overlapped_total / comm_total if comm_total else 0.0}


def _events(trace) -> list[dict]:
    if isinstance(trace, dict):
        data = trace
    else:
        path = Path(trace)
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _intersection_length(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total
