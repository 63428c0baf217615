"""The memory report of the GPT-2 124M training step (the example's, as benchmarks/compare.py runs it):
what jnova's compiled step holds at its peak, beside XLA's memory analysis of jax.jit's step.

    python benchmarks/memory_report.py --dtype float32 --attention manual
    python benchmarks/memory_report.py --dtype bfloat16 --attention manual
    python benchmarks/memory_report.py --dtype bfloat16 --attention cudnn

Compiles only (nothing runs). Prints jnova's report (`Lowered.memory()`: peak, XLA's totals, the
buffers live at the peak with the kernel and nova op behind each; docs/memory.md) and one JSON record
(DESIGN.md's format, bench `gpt2_memory`: jnova's and XLA's planned peak, in GB); with OUT set it writes
$OUT/memory-<dtype>-<attention>.txt and appends the record to $OUT/gpt2_memory.jsonl.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "gpt2"))
import model as gpt2  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--attention", choices=list(gpt2.ATTENTIONS), default="manual")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=12)
    args = p.parse_args()

    import jnova

    config = gpt2.GPTConfig.gpt2_124m(dtype=gpt2.DTYPES[args.dtype], attention=args.attention, n_layer=args.n_layer)
    module = gpt2.GPT(config)
    optimizer = gpt2.make_optimizer(gpt2.lr_schedule(6e-4, 6e-5, 100, 10_000), 0.1, clip_norm=1.0)
    step = gpt2.make_train_step(module, optimizer)
    params = gpt2.init_params(module, jax.random.key(0), args.seq)
    state = optimizer.init(params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, gpt2.GPT2_VOCAB, (args.batch, args.seq + 1)), jnp.int32)
    batch = (params, state, tokens[:, :-1], tokens[:, 1:])

    report = jnova.compile(step, donate_argnums=(0, 1)).lower(*batch).memory()
    precision = "tensorfloat32" if args.dtype == "float32" else "default"
    with jax.default_matmul_precision(precision):
        xla = jax.jit(step, donate_argnums=(0, 1)).lower(*batch).compile().memory_analysis()
    xla_bytes = xla.argument_size_in_bytes + xla.temp_size_in_bytes + xla.output_size_in_bytes - xla.alias_size_in_bytes
    print(report)
    record = {"bench": "gpt2_memory", "case": f"{args.dtype}/{args.attention}/B{args.batch}",
              "device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(),
              "jax": jax.__version__, "jnova": os.environ.get("JNOVA_SHA", "unknown"), "metric": "planned_gb",
              "value": {"jnova_peak": report.peak_bytes / 1e9, "jnova_allocated": report.allocated_bytes / 1e9,
                        "xla_allocated": xla_bytes / 1e9, "jnova_by_kind": {k: v / 1e9 for k, v in report.by_kind().items()}}}
    print(json.dumps(record))
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        (out / f"memory-{args.dtype}-{args.attention}.txt").write_text(str(report))
        with open(out / "gpt2_memory.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
