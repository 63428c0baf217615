"""Data-parallel GPT-2 124M step on every local GPU: jnova's bucketed all-reduces against XLA's pmap.

One configuration per process (XLA's flags are read once per process), 8 sequences of 1024 tokens per
GPU, AdamW, gradients averaged with `pmean` after the backward pass as a JAX user writes it:

    python benchmarks/gpt2_dp.py --impl jnova --devices 2 --dtype bfloat16
    python benchmarks/gpt2_dp.py --impl xla --devices 2 --dtype bfloat16 [--latency-hiding]

- `jnova`: `jax.jit(jax.shard_map(jnova.compile(step)))`: the step's all-reduces run in buckets of
  `--bucket-mb`, each right after its last gradient (`as_text("buckets")` is written beside the records).
- `xla`: `jax.pmap(step)`, with XLA's latency-hiding scheduler when `--latency-hiding` is given.

Records (DESIGN.md's format, bench `gpt2_dp`, case `<dtype>/D<devices>`, metrics `tok_s` and `ms`) go to
$OUT/gpt2_dp.jsonl; `--trace` also writes a profile of a few steps and prints how much of the NCCL
kernels' time ran beside compute kernels (`trace_overlap.py`). `--summarize` reads the records of one
run and adds the `scaling` records: 2-GPU tokens/s over twice the 1-GPU tokens/s of the same impl.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

LATENCY_HIDING = "--xla_gpu_enable_latency_hiding_scheduler=true"


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["jnova", "xla"])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--batch", type=int, default=8, help="sequences per device")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--latency-hiding", action="store_true", help="XLA's latency-hiding scheduler (xla only)")
    p.add_argument("--trace", action="store_true", help="profile 3 steps and report the NCCL overlap")
    p.add_argument("--summarize", metavar="JSONL", help="add scaling records to a run's records and exit")
    args = p.parse_args(argv)
    if args.summarize:
        summarize(Path(args.summarize))
        return
    if args.impl is None:
        p.error("--impl is required")
    if args.latency_hiding:  # before jax starts its backend
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + LATENCY_HIDING).strip()
    run(args)


def data_parallel_step(model, optimizer, gpt2):
    """The user's step: loss and gradients of the local batch, gradients averaged over axis "d"."""
    import jax
    import optax

    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(lambda p: gpt2.loss_fn(model, p, tokens, targets))(params)
        grads, loss = jax.lax.pmean((grads, loss), "d")
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def run(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt2"))
    import model as gpt2

    devices = jax.devices()[:args.devices]
    if len(devices) < args.devices:
        raise SystemExit(f"gpt2_dp: {args.devices} devices asked for, {len(devices)} present")
    config = gpt2_config(gpt2, args)
    module, optimizer = gpt2.GPT(config), gpt2.make_optimizer()
    params = gpt2.init_params(module, jax.random.key(0), args.seq)
    opt_state = optimizer.init(params)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (args.devices * args.batch, args.seq + 1)).astype(np.int32)
    x, y = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
    step = data_parallel_step(module, optimizer, gpt2)
    extra = {}
    if args.impl == "jnova":
        import jnova

        mesh = Mesh(np.array(devices), ("d",))
        inner = jnova.compile(step, bucket_bytes=int(args.bucket_mb * 2**20))

        def traced(*local):  # the bucket plan of the step jnova compiles, read where axis "d" is bound
            if "buckets" not in extra:
                extra["buckets"] = inner.lower(*local).as_text("buckets")
            return inner(*local)

        run_step = jax.jit(jax.shard_map(traced, mesh=mesh, in_specs=(P(), P(), P("d"), P("d")),
                                         out_specs=(P(), P(), P()), check_vma=False))
        operands = (params, opt_state, x, y)
    else:
        run_step = jax.pmap(step, axis_name="d", in_axes=(None, None, 0, 0), out_axes=(None, None, None),
                            devices=devices)
        operands = (params, opt_state, x.reshape(args.devices, args.batch, args.seq),
                    y.reshape(args.devices, args.batch, args.seq))
    t0 = time.perf_counter()
    out = run_step(*operands)
    jax.block_until_ready(out)
    compile_s = time.perf_counter() - t0
    losses, times = [], []
    state = operands
    for _ in range(args.steps):
        t = time.perf_counter()
        new_params, new_state, loss = run_step(*state)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
        state = (new_params, new_state, *state[2:])
    ms = 1e3 * statistics.median(times)
    tok_s = args.devices * args.batch * args.seq / (ms / 1e3)
    impl = args.impl + ("_lhs" if args.latency_hiding else "")
    case = f"{args.dtype}/D{args.devices}"
    base = {"bench": "gpt2_dp", "case": case, "dtype": args.dtype, "impl": impl,
            "device": devices[0].device_kind, "devices": args.devices, "date": datetime.date.today().isoformat(),
            "jax": jax.__version__, "jnova": os.environ.get("JNOVA_SHA", "unknown"),
            "batch_per_device": args.batch, "seq": args.seq, "layers": args.layers,
            "first_loss": losses[0], "last_loss": losses[-1]}
    records = [dict(base, metric="tok_s", value=round(tok_s, 1)), dict(base, metric="ms", value=round(ms, 3)),
               dict(base, metric="compile_s", value=round(compile_s, 2))]
    if args.trace:
        from trace_overlap import collective_overlap

        trace_dir = Path(os.environ.get("OUT", ".")) / f"trace-{impl}-{args.dtype}-D{args.devices}"
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            for _ in range(3):
                jax.block_until_ready(run_step(*state))
        found = sorted(trace_dir.rglob("*.trace.json.gz"))
        if found:
            report = collective_overlap(found[-1])
            records.append(dict(base, metric="overlap", value=round(report["overlapped_fraction"], 3),
                                detail=report))
            print(json.dumps(report, indent=1))
    for r in records:
        print(json.dumps(r))
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(Path(out_dir) / "gpt2_dp.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        if "buckets" in extra:
            (Path(out_dir) / f"buckets-{args.dtype}-D{args.devices}.txt").write_text(extra["buckets"])


def gpt2_config(gpt2, args):
    """GPT-2 124M with the vocabulary padded to 50304, computing in `args.dtype` as Flax users write
    mixed precision (parameters and optimizer state stay f32) where the model takes a dtype."""
    import dataclasses

    import jax.numpy as jnp

    fields = {f.name for f in dataclasses.fields(gpt2.GPTConfig)}
    settings = {"n_layer": args.layers, "vocab_size": 50304}
    if "dtype" in fields:
        settings["dtype"] = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    elif args.dtype != "float32":
        raise SystemExit("gpt2_dp: this GPT-2 model has no dtype setting")
    return gpt2.GPTConfig(**{k: v for k, v in settings.items() if k in fields})


def summarize(path: Path) -> None:
    """Append `scaling` records: for each impl and dtype, 2-GPU tok/s over twice the 1-GPU tok/s."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    tok = {(r["impl"], r["dtype"], r["devices"]): r for r in records if r["metric"] == "tok_s"}
    added = []
    for (impl, dtype, devices), r in sorted(tok.items()):
        one = tok.get((impl, dtype, 1))
        if devices > 1 and one is not None:
            added.append(dict(r, metric="scaling", value=round(r["value"] / (devices * one["value"]), 3)))
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in added)
    for r in added:
        print(f"{r['impl']:10s} {r['dtype']:9s} D{r['devices']}: scaling {r['value']:.3f}")


if __name__ == "__main__":
    main()
