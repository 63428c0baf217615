"""Where a GPT-2 step's host dispatch goes, jnova against XLA: the host events of a profile.

    python benchmarks/host_profile.py --dtype float32 [--batch 1 --seq 64 --steps 5]

Compiles both steps in one process, then runs each `--steps` times under `jax.profiler.trace`
(Perfetto trace, CUPTI on: XLA's own trace annotations and the CUDA API calls on the host threads),
and prints, per side, the host time per step by event name: the events that take the most, their
count per step and their mean. A profile, not a benchmark (the profiler slows the host down); it
says what differs, and dispatch.py measures by how much. Writes $OUT/host_profile.json when OUT is
set.
"""
from __future__ import annotations

import collections
import json
import os
import re
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt2_step import compile_step, parser, setup  # noqa: E402
from profile_step import trace_events, trace_steps  # noqa: E402


def host_events(trace_dir: str) -> tuple[collections.Counter, collections.Counter]:
    """(host microseconds per event name, count per name) of the Perfetto trace in `trace_dir`:
    complete events on threads of processes that are not GPUs. Names lose their numeric suffixes
    (`fusion.12` -> `fusion.N`) so that events of one kind add up."""
    events, processes, _ = trace_events(trace_dir)
    gpu = {pid for pid, name in processes.items() if "gpu" in name.lower() or "/device:" in name.lower()}
    times, counts = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") not in gpu and not e["name"].startswith("$"):  # not Python frames
            name = re.sub(r"\d+", "N", e["name"])[:120]
            times[name] += float(e.get("dur", 0))
            counts[name] += 1
    return times, counts


def main():
    p = parser(steps=5, impl=False)
    p.add_argument("--top", type=int, default=30)
    p.set_defaults(batch=1, seq=64)
    args = p.parse_args()

    config, step, batch = setup(args.batch, args.seq, args.layers)
    report = {"case": f"B{args.batch}xT{args.seq}xL{args.layers}", "dtype": args.dtype,
              "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "jnova": os.environ.get("JNOVA_SHA", "unknown"), "sides": {}}
    runs = {impl: compile_step(impl, args.dtype, step, batch)[0] for impl in ("jnova", "xla")}
    for impl, run in runs.items():
        times, counts = host_events(trace_steps(run, batch, args.steps, warmup=3))
        rows = [{"name": n, "us_per_step": round(t / args.steps, 1), "count_per_step": counts[n] / args.steps,
                 "mean_us": round(t / counts[n], 2)} for n, t in times.most_common(args.top)]
        report["sides"][impl] = rows
        print(f"--- {impl}: host events, us per step (count per step, mean us)")
        for r in rows:
            print(f"  {r['us_per_step']:10.1f}  x{r['count_per_step']:<7.1f} {r['mean_us']:8.2f}  {r['name']}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "host_profile.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
