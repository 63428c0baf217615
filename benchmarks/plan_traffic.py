"""The bytes a GPU plan's kernels touch, built on any machine (no GPU needed): an upper bound of the
step's DRAM traffic, per kernel family and for the largest kernels.

    python benchmarks/plan_traffic.py --dtype bfloat16 [--layers 12 --batch 8 --seq 1024 --target h200]

The step is the GPT-2 example's as `benchmarks/compare.py` runs it (vocabulary padded to 50304,
AdamW with the warmup-cosine schedule and clipping at 1.0, params and optimizer state donated,
`jax.nn.dot_product_attention`). For each launch the bytes are the sizes of all its buffers (inputs
and outputs) times its launch count: a kernel that reads or writes part of a buffer (an in-place
scatter, a split-K slice) is counted whole, so this bounds the traffic from above and compares plans,
not a measurement. Prints a table; with OUT set, appends DESIGN.md records (bench `plan_traffic`,
metric `gb`, case `<dtype>/L<layers>/B<batch>`, device `plan for <target>`) to $OUT/plan_traffic.jsonl.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "gpt2"))
import model as gpt2  # noqa: E402

ELEMENT_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "ui32": 4, "i64": 8, "i8": 1, "i1": 1, "i16": 2}


def kernel_bytes(gpu_text: str, launches_text: str) -> list[tuple[int, str, str]]:
    """(bytes x launches, kernel name, launch line) of every kernel in the plan's gpu text."""
    launches = {line.split()[0]: line for line in launches_text.splitlines() if line.strip()}
    out = []
    for func in re.split(r"(?=gpu\.func @)", gpu_text)[1:]:
        name = re.match(r"gpu\.func @(\w+)\(", func).group(1)
        line = launches.get(name)
        if line is None:
            continue
        count = int(line.split()[1].removeprefix("x"))
        params = re.match(r"gpu\.func @\w+\((.*?)\) kernel", func, re.S).group(1)
        nbytes = sum(int(n) * ELEMENT_BYTES.get(t, 4) for n, t in re.findall(r"memref<(\d+)x(\w+)>", params))
        out.append((nbytes * count, name, line))
    return out


def family(line: str) -> str:
    return line.split()[2].split("(")[0].split("[")[0] + ("[" + line.split("[")[1].split("]")[0] + "]"
                                                          if " matmul[" in line or "attention[" in line else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--target", default="h200")
    p.add_argument("--top", type=int, default=12, help="largest kernels listed")
    args = p.parse_args(argv)
    import jnova

    config = gpt2.GPTConfig.gpt2_124m(dtype=gpt2.DTYPES[args.dtype], attention="xla", n_layer=args.layers)
    module = gpt2.GPT(config)
    optimizer = gpt2.make_optimizer(gpt2.lr_schedule(6e-4, 6e-5, 100, 10_000), 0.1, clip_norm=1.0)
    params = jax.eval_shape(lambda: gpt2.init_params(module, jax.random.key(0), args.seq))
    state = jax.eval_shape(optimizer.init, params)
    tokens = jax.ShapeDtypeStruct((args.batch, args.seq), jnp.int32)
    lowered = jnova.compile(gpt2.make_train_step(module, optimizer), target=args.target, donate_argnums=(0, 1)) \
        .lower(params, state, tokens, tokens)
    rows = sorted(kernel_bytes(lowered.as_text("gpu"), lowered.as_text("launches")), reverse=True)
    by_family = defaultdict(int)
    for nbytes, _, line in rows:
        by_family[family(line)] += nbytes
    total = sum(by_family.values())
    case = f"{args.dtype}/L{args.layers}/B{args.batch}"
    print(f"GPT-2 step {case}, T={args.seq}, plan for {args.target}: {lowered.stats()['kernels']} kernels, "
          f"{total / 1e9:.2f} GB of kernel buffers")
    for name, nbytes in sorted(by_family.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {nbytes / 1e9:8.2f} GB")
    for nbytes, _, line in rows[:args.top]:
        print(f"  {nbytes / 1e9:7.3f} GB  {line[:150]}")
    if os.environ.get("OUT"):
        meta = {"bench": "plan_traffic", "case": case, "dtype": args.dtype, "impl": "jnova",
                "device": f"plan for {args.target}", "date": datetime.date.today().isoformat(),
                "jax": jax.__version__, "jnova": os.environ.get("JNOVA_SHA", "unknown")}
        records = [{**meta, "metric": "gb", "value": total / 1e9},
                   {**meta, "metric": "kernels", "value": lowered.stats()["kernels"]}]
        records += [{**meta, "metric": "gb", "family": k, "value": v / 1e9} for k, v in by_family.items()]
        with open(os.path.join(os.environ["OUT"], "plan_traffic.jsonl"), "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
