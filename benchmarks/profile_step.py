"""Where a GPT-2 training step's GPU time goes: jnova's kernels by family, or XLA's, from a profile.

    python benchmarks/profile_step.py --impl jnova --dtype float32 [--batch 8 --seq 1024 --steps 3]
    python benchmarks/profile_step.py --impl jnova --dtype bfloat16 --flax-attention cudnn

Without --flax-attention the step is benchmarks/gpt2_step.py's (the f32 model; bf16 through jnova's
`mixed_precision="bf16"`). With it, the step is benchmarks/compare.py's: the Flax model computing in
`--dtype` (vocabulary padded to 50304, AdamW with clipping, attention "xla", "cudnn" or "manual"), compiled
with plain `jnova.compile` or `jax.jit`, as a JAX user writes it.

Runs the step a few times under `jax.profiler.trace` (Perfetto trace), sums the GPU time of every
kernel per step and prints the kernels that take the most, and (jnova) the total per kernel family
(contraction, elementwise, row/column reduction, scatter-add, and XLA's ops for the groups jnova has no
builder for), from the launch table of the compiled step (`.as_text("launches")`). Writes
$OUT/profile-<impl>-<dtype>.json when OUT is set. A profile, not a benchmark: timings under the
profiler are slightly longer than gpt2_step.py's.
"""
from __future__ import annotations

import collections
import datetime
import glob
import gzip
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt2_step import compile_step, parser, setup  # noqa: E402


def trace_steps(run, batch, steps: int, warmup: int = 2) -> str:
    """The folder of a Perfetto trace of `steps` calls of `run(*batch)`, after `warmup` untraced calls."""
    for _ in range(warmup):
        jax.block_until_ready(run(*batch))
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(steps):
            jax.block_until_ready(run(*batch))
    return trace_dir


def trace_events(trace_dir: str) -> tuple[list[dict], dict, dict]:
    """(events, process names by pid, thread names by (pid, tid)) of the Perfetto trace in `trace_dir`."""
    (path,) = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return events, processes, threads


def kernel_times(trace_dir: str) -> tuple[dict[str, float], dict[str, int], list[str]]:
    """(GPU microseconds per kernel name, launches per name, the GPU threads seen) of a Perfetto trace."""
    events, processes, threads = trace_events(trace_dir)
    gpu = {pid for pid, name in processes.items() if "GPU" in name or "gpu" in name}
    streams = {key for key, name in threads.items() if key[0] in gpu and "stream" in name.lower()}
    times, counts = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams:
            times[e["name"]] += float(e.get("dur", 0))
            counts[e["name"]] += 1
    if not streams:  # say what the trace has instead
        print("no GPU stream threads; processes:", sorted(set(processes.values()))[:12],
              "threads:", sorted(set(threads.values()))[:20])
    return times, counts, sorted({threads[k] for k in streams})


def families(launch_table: str) -> dict[str, str]:
    """PTX entry name -> kernel family, from `.as_text("launches")`."""
    out = {}
    for line in launch_table.splitlines():
        name, _, schedule = line.split(" ", 2)
        out[name] = schedule.split("(", 1)[0]
    return out


def flax_setup(dtype: str, attention: str, batch: int, seq: int, layers: int):
    """compare.py's step: (train step, its arguments), params and optimizer state not donated (the
    profile calls the step again on the same arguments)."""
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt2"))
    import model as gpt2

    config = gpt2.GPTConfig.gpt2_124m(dtype=gpt2.DTYPES[dtype], attention=attention, n_layer=layers)
    module = gpt2.GPT(config)
    optimizer = gpt2.make_optimizer(gpt2.lr_schedule(6e-4, 6e-5, 100, 10_000), 0.1, clip_norm=1.0)
    params = gpt2.init_params(module, jax.random.key(0), seq)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, gpt2.GPT2_VOCAB, (batch, seq + 1)), jnp.int32)
    return gpt2.make_train_step(module, optimizer), (params, optimizer.init(params), tokens[:, :-1], tokens[:, 1:])


def flax_compile(impl: str, dtype: str, step, batch):
    if impl == "jnova":
        import jnova

        compiled = jnova.compile(step)
        compiled.lower(*batch).compile()
        return compiled, compiled
    with jax.default_matmul_precision("tensorfloat32" if dtype == "float32" else "default"):
        return jax.jit(step).lower(*batch).compile(), None


def main():
    p = parser(steps=3)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--flax-attention", choices=["xla", "cudnn", "manual"],
                   help="profile compare.py's Flax step with this attention instead of gpt2_step.py's")
    args = p.parse_args()

    if args.flax_attention:
        step, batch = flax_setup(args.dtype, args.flax_attention, args.batch, args.seq, args.layers)
        run, compiled = flax_compile(args.impl, args.dtype, step, batch)
    else:
        config, step, batch = setup(args.batch, args.seq, args.layers)
        run, compiled = compile_step(args.impl, args.dtype, step, batch)
    family = {}
    if compiled is not None:
        lowered = compiled.lower(*batch)
        family = families(lowered.as_text("launches")) if lowered.stats()["backend"] == "gpu" else {}
    times, counts, streams = kernel_times(trace_steps(run, batch, args.steps))
    total = sum(times.values()) / args.steps
    rows = sorted(times.items(), key=lambda kv: -kv[1])
    by_family = collections.Counter()
    for name, t in times.items():
        by_family[family.get(re.sub(r"\.\d+$", "", name), "xla" if args.impl == "jnova" else name.split(".")[0])] += t
    print(f"{args.impl} {args.dtype}: {total / 1e3:.2f} ms of GPU kernels per step, {sum(counts.values()) // args.steps} "
          f"launches, streams {streams}")
    for name, t in by_family.most_common(12):
        print(f"  {name:28s} {t / args.steps / 1e3:8.2f} ms  {100 * t / args.steps / total:5.1f}%")
    for name, t in rows[:args.top]:
        print(f"  {t / args.steps / 1e3:8.3f} ms  x{counts[name] // args.steps:<4d} {family.get(name, '')[:20]:20s} {name[:90]}")
    case = f"B{args.batch}xT{args.seq}xL{args.layers}" + (f"/flax-{args.flax_attention}" if args.flax_attention else "")
    record = {"impl": args.impl, "dtype": args.dtype, "case": case,
              "device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(),
              "jax": jax.__version__, "jnova": os.environ.get("JNOVA_SHA", "unknown"), "gpu_ms_per_step": total / 1e3,
              "launches_per_step": sum(counts.values()) // args.steps,
              "by_family_ms": {k: v / args.steps / 1e3 for k, v in by_family.items()},
              "top_kernels": [{"name": n, "ms": t / args.steps / 1e3, "launches": counts[n] // args.steps,
                               "family": family.get(n, "")} for n, t in rows[:args.top]]}
    if os.environ.get("OUT"):
        suffix = f"-flax-{args.flax_attention}" if args.flax_attention else ""
        with open(os.path.join(os.environ["OUT"], f"profile-{args.impl}-{args.dtype}{suffix}.json"), "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
