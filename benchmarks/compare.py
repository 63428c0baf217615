"""GPT-2 124M training step: jnova against jax.jit as a JAX user runs it, in one command.

    python benchmarks/compare.py --quick        # batch 8: f32, bf16, bf16 + cuDNN; ~5-6 min on an H200
    python benchmarks/compare.py                # batch 8 and 16, and manual attention too (~15 min: run
                                                # --batch 8 and --batch 16 as two commands where a call is capped)
    python benchmarks/compare.py --report-only  # the table and chart again from $OUT/gpt2_compare.jsonl

The step is the example's (examples/gpt2): GPT-2 124M, vocabulary padded to 50304, T=1024, AdamW with
the warmup-cosine schedule and gradient clipping at 1.0, params and optimizer state donated. Cases are
`<dtype>/<attention>/B<batch>`:
- `float32/xla`: f32 modules, both compilers' contractions in TF32.
- `bfloat16/xla`: Flax mixed precision (`dtype=bfloat16` modules, f32 params and optimizer state) with
  `jax.nn.dot_product_attention`'s XLA implementation; jnova compiles that attention itself.
- `bfloat16/cudnn`: the same with `implementation="cudnn"` (cuDNN's fused attention), as a user who
  wants XLA at its best writes it; jnova compiles the rest around the cuDNN call.
- `bfloat16/manual` (not in --quick): attention written out (softmax(QK^T) V).
The goal lines compare jnova's best bf16 case (its own attention or cuDNN) with XLA + cuDNN.

Every measurement is its own process (peak memory cannot be reset): the step is compiled
(`.lower(...).compile()`, the cold compile, on fresh caches: jnova's and JAX's persistent compilation
cache), run, then timed over --steps steps (median ms); a second process on the same caches measures the
warm compile. peak_gb is the device's peak_bytes_in_use. MFU is the 6N + 12LTC FLOPs per token over the
GPU's dense tensor-core peak (TF32 for float32, bf16 otherwise). Where PyTorch is installed, the same
GPT-2 with `torch.compile` (benchmarks/gpt2_torch.py) is the anchor (impl `torch_compile`); without it,
it is skipped.

Writes DESIGN.md records (bench `gpt2_compare`, metrics tok_s, ms, peak_gb, compile_s, warm_compile_s,
mfu; `error` where a process failed) to $OUT/gpt2_compare.jsonl (appended), and from all of that file's
records $OUT/gpt2_compare.md (the table) and $OUT/gpt2_compare.png (the chart; needs matplotlib, which
`--report-only` can run elsewhere).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = "gpt2_compare"
RECORD_FILE = "gpt2_compare.jsonl"
METRICS = ("tok_s", "ms", "peak_gb", "compile_s", "warm_compile_s", "mfu")
IMPLS = ("jnova", "xla", "torch_compile")
RESULT = "RESULT "   # the line a worker prints its measurement on


@dataclasses.dataclass
class Measurement:
    case: str                  # <dtype>/<attention>/B<batch>
    impl: str                  # jnova | xla | torch_compile
    tok_s: float | None = None
    ms: float | None = None
    peak_gb: float | None = None
    compile_s: float | None = None
    warm_compile_s: float | None = None
    mfu: float | None = None
    error: str | None = None
    variant: str = ""          # what the impl ran where it is not the case's name (torch: "sdpa")

    @property
    def dtype(self) -> str:
        return self.case.split("/")[0]

    @property
    def batch(self) -> int:
        return int(self.case.rsplit("/B", 1)[1])


def cases(quick: bool, batches: list[int]) -> list[str]:
    attentions = [("float32", "xla"), ("bfloat16", "xla"), ("bfloat16", "cudnn")]
    if not quick:
        attentions.append(("bfloat16", "manual"))
    return [f"{d}/{a}/B{b}" for b in batches for d, a in attentions]


# --- the orchestrator: one process per measurement ---------------------------------------------------

def run_worker(argv: list[str], env: dict, timeout: float) -> dict:
    """Run `python <argv>` and return the JSON of its RESULT line, or {"error": ...}."""
    try:
        proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = [line for line in (proc.stderr or proc.stdout).strip().splitlines() if "Warning" not in line][-3:]
    return {"error": f"exit {proc.returncode}: " + " / ".join(tail)[-400:]}


def measure(case: str, impl: str, args, env: dict) -> Measurement:
    """The cold process (compile on fresh caches, then the timed steps) and the warm one (compile only)."""
    dtype, attention, batch = case.split("/")[0], case.split("/")[1], int(case.rsplit("/B", 1)[1])
    caches = tempfile.mkdtemp(prefix="gpt2-compare-")
    env = {**env, "JNOVA_CACHE_DIR": os.path.join(caches, "jnova"), "TORCHINDUCTOR_CACHE_DIR":
           os.path.join(caches, "inductor"), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if impl == "torch_compile":
        script = [str(REPO / "benchmarks" / "gpt2_torch.py")]
    else:
        script = [str(Path(__file__).resolve()), "--worker", "--impl", impl, "--attention", attention,
                  "--xla-cache-dir", os.path.join(caches, "xla")]
    common = [*script, "--dtype", dtype, "--batch", str(batch), "--seq", str(args.seq), "--steps", str(args.steps),
              "--n-layer", str(args.n_layer)]
    if args.unpadded_vocab:
        common.append("--unpadded-vocab")
    start = time.perf_counter()
    cold = run_worker(common, env, args.timeout)
    m = Measurement(case=case, impl=impl, variant="sdpa" if impl == "torch_compile" else "")
    if "error" in cold:
        m.error = cold["error"]
    else:
        for k in ("tok_s", "ms", "peak_gb", "compile_s", "mfu"):
            setattr(m, k, cold.get(k))
        if not args.no_warm:
            warm = run_worker([*common, "--compile-only"], env, args.timeout)
            m.warm_compile_s = warm.get("compile_s")
    def show(v, fmt):
        return "-" if v is None else format(v, fmt)

    print(f"{case:<20} {impl:<14} " + (f"error: {m.error}" if m.error else
          f"{show(m.tok_s, ',.0f')} tok/s, {show(m.ms, '.1f')} ms, {show(m.peak_gb, '.2f')} GB, compile "
          f"{show(m.compile_s, '.1f')} s (warm {show(m.warm_compile_s, '.1f')} s), MFU {show(m.mfu, '.1%')}")
          + f"   [{time.perf_counter() - start:.0f} s]", flush=True)
    return m


def torch_available(env: dict) -> bool:
    probe = subprocess.run([sys.executable, "-c", "import torch; assert torch.cuda.is_available()"], env=env,
                           capture_output=True, timeout=120)
    return probe.returncode == 0


def torch_cases(all_cases: list[str], quick: bool) -> list[str]:
    """The anchor's cases: its bf16 (autocast + SDPA's fused attention) under bfloat16/cudnn, f32 under float32/xla."""
    wanted = [c for c in all_cases if c.startswith("bfloat16/cudnn/") or c.startswith("float32/xla/")]
    return [c for c in wanted if not (quick and c.startswith("float32"))]


# --- records, the table and the chart -----------------------------------------------------------------

def run_meta() -> dict:
    """The records' device, date, jax and jnova, without starting JAX here (the GPU is the workers')."""
    from importlib.metadata import version

    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30).stdout.split("\n")
        device = names[0].strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        device = "unknown"
    return {"device": device, "date": datetime.date.today().isoformat(), "jax": version("jax"),
            "jnova": os.environ.get("JNOVA_SHA", "unknown")}


def records(measurements: list[Measurement], meta: dict) -> list[dict]:
    """DESIGN.md's records: one per (case, impl, metric) measured; `error` where the process failed."""
    out = []
    for m in measurements:
        base = {"bench": BENCH, "case": m.case, "dtype": m.dtype, "impl": m.impl, **meta}
        if m.variant:
            base["variant"] = m.variant
        if m.error:
            out.append({**base, "metric": "error", "value": m.error})
            continue
        out += [{**base, "metric": k, "value": getattr(m, k)} for k in METRICS if getattr(m, k) is not None]
    return out


def from_records(recs: list[dict]) -> list[Measurement]:
    """Measurements back from records (the last record of each case, impl and metric wins)."""
    found: dict[tuple, Measurement] = {}
    for r in recs:
        if r.get("bench") != BENCH:
            continue
        m = found.setdefault((r["case"], r["impl"]), Measurement(case=r["case"], impl=r["impl"],
                                                               variant=r.get("variant", "")))
        if r["metric"] == "error":
            m.error = r["value"]
        elif r["metric"] in METRICS:
            setattr(m, r["metric"], r["value"])
            m.error = None
    return list(found.values())


def append_records(recs: list[dict], out: str) -> str:
    path = os.path.join(out, RECORD_FILE)
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    return path


def read_records(out: str) -> list[dict]:
    with open(os.path.join(out, RECORD_FILE)) as f:
        return [json.loads(line) for line in f if line.strip()]


def _case_order(case: str) -> tuple:
    dtype, attention, batch = case.split("/")
    return int(batch[1:]), dtype != "float32", ["xla", "cudnn", "manual"].index(attention) if attention in \
        ("xla", "cudnn", "manual") else 9


def table(measurements: list[Measurement], meta: dict | None = None) -> str:
    """The markdown table: per case and impl, the metrics and jnova's ratio to XLA; then the goals."""
    by = {(m.case, m.impl): m for m in measurements}
    lines = []
    if meta:
        lines.append(f"GPT-2 124M training step (T=1024) on {meta.get('device')}, jax {meta.get('jax')}, "
                     f"jnova {meta.get('jnova')}, {meta.get('date')}.\n")
    lines += ["| case | impl | tok/s | vs XLA | step ms | peak GB | vs XLA | compile s (cold) | warm | MFU |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def f(v, fmt):
        return "" if v is None else format(v, fmt)

    for case in sorted({m.case for m in measurements}, key=_case_order):
        xla = by.get((case, "xla"))
        for impl in IMPLS:
            m = by.get((case, impl))
            if m is None:
                continue
            name = impl + (f" ({m.variant})" if m.variant else "")
            if m.error:
                lines.append(f"| {case} | {name} | failed: {m.error[:120].replace('|', '/')} | | | | | | | |")
                continue
            ok = xla is not None and not xla.error and impl != "xla"
            speed = f"{m.tok_s / xla.tok_s:.2f}x" if ok else ""
            memory = f"{m.peak_gb / xla.peak_gb:.2f}x" if ok and xla.peak_gb else ""
            lines.append(f"| {case} | {name} | {f(m.tok_s, ',.0f')} | {speed} | {f(m.ms, '.1f')} | "
                         f"{f(m.peak_gb, '.2f')} | {memory} | {f(m.compile_s, '.1f')} | {f(m.warm_compile_s, '.1f')} | "
                         f"{f(m.mfu, '.1%')} |")
    goals = goal_lines(by)
    if goals:
        lines += ["", *goals]
    return "\n".join(lines) + "\n"


def goal_lines(by: dict) -> list[str]:
    """The goals: bf16 B8 jnova (best of its attentions) >= 1.15x XLA + cuDNN's tok/s in <= 0.85x its
    peak memory; f32 B8 jnova >= 1.5x XLA's tok/s."""
    out = []
    ref = by.get(("bfloat16/cudnn/B8", "xla"))
    mine = [m for (c, i), m in by.items() if i == "jnova" and c.startswith("bfloat16/") and c.endswith("/B8")
            and not m.error]
    if ref and not ref.error and mine:
        best = max(mine, key=lambda m: m.tok_s)
        speed, memory = best.tok_s / ref.tok_s, best.peak_gb / ref.peak_gb if ref.peak_gb else float("nan")
        met = "met" if speed >= 1.15 and memory <= 0.85 else "not met"
        out.append(f"- bf16 B8, jnova at its best ({best.case}) against XLA + cuDNN: {speed:.2f}x tokens/s "
                   f"(goal 1.15x) in {memory:.2f}x its peak memory (goal 0.85x): **{met}**")
    ref, mine = by.get(("float32/xla/B8", "xla")), by.get(("float32/xla/B8", "jnova"))
    if ref and mine and not ref.error and not mine.error:
        speed = mine.tok_s / ref.tok_s
        out.append(f"- f32 (TF32) B8, jnova against XLA: {speed:.2f}x tokens/s (goal 1.5x): "
                   f"**{'met' if speed >= 1.5 else 'not met'}**")
    return out


def chart(measurements: list[Measurement], png: str) -> bool:
    """Bars of tokens/s and of peak GB per case, one colour per impl; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no chart {png}: matplotlib is not installed; run --report-only where it is)", flush=True)
        return False
    ok = [m for m in measurements if not m.error]
    case_names = sorted({m.case for m in ok}, key=_case_order)
    impls = [i for i in IMPLS if any(m.impl == i for m in ok)]
    by = {(m.case, m.impl): m for m in ok}
    colors = {"jnova": "tab:blue", "xla": "tab:orange", "torch_compile": "tab:gray"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(impls))
    for ax, metric, label in ((axes[0], "tok_s", "tokens/s (thousands)"), (axes[1], "peak_gb", "peak GB")):
        for k, impl in enumerate(impls):
            xs = [i + (k - (len(impls) - 1) / 2) * width for i in range(len(case_names))]
            vals = [getattr(by[(c, impl)], metric) if (c, impl) in by else 0 for c in case_names]
            vals = [v / 1e3 if metric == "tok_s" else v for v in vals]
            ax.bar(xs, vals, width, label=impl, color=colors[impl])
        ax.set_xticks(range(len(case_names)))
        ax.set_xticklabels(case_names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("GPT-2 124M training step, T=1024: jnova vs jax.jit (and torch.compile)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


def write_report(out: str) -> list[str]:
    """$OUT/gpt2_compare.md and .png from every record in $OUT/gpt2_compare.jsonl."""
    recs = read_records(out)
    measurements = from_records(recs)
    meta = {k: recs[-1].get(k) for k in ("device", "date", "jax", "jnova")} if recs else None
    md = os.path.join(out, "gpt2_compare.md")
    with open(md, "w") as f:
        f.write(table(measurements, meta))
    written = [md]
    png = os.path.join(out, "gpt2_compare.png")
    if chart(measurements, png):
        written.append(png)
    return written


# --- the worker: one measurement ----------------------------------------------------------------------

def worker(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(REPO / "examples" / "gpt2"))
    import model as gpt2

    if args.xla_cache_dir:   # JAX's persistent compilation cache: XLA's own compile, and XLA's around jnova's kernels
        jax.config.update("jax_compilation_cache_dir", args.xla_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    config = gpt2.GPTConfig.gpt2_124m(pad_vocab=not args.unpadded_vocab, dtype=gpt2.DTYPES[args.dtype],
                                      attention=args.attention, n_layer=args.n_layer)
    module = gpt2.GPT(config)
    optimizer = gpt2.make_optimizer(gpt2.lr_schedule(6e-4, 6e-5, 100, 10_000), 0.1, clip_norm=1.0)
    step = gpt2.make_train_step(module, optimizer)
    params = gpt2.init_params(module, jax.random.key(0), args.seq)
    state = optimizer.init(params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, gpt2.GPT2_VOCAB, (args.batch, args.seq + 1)), jnp.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]

    start = time.perf_counter()
    if args.impl == "jnova":
        import jnova

        run = jnova.compile(step, donate_argnums=(0, 1))
        run.lower(params, state, x, y).compile()
    else:
        precision = "tensorfloat32" if args.dtype == "float32" else "default"
        with jax.default_matmul_precision(precision):
            run = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, x, y).compile()
    compile_s = time.perf_counter() - start
    if args.compile_only:
        return {"compile_s": compile_s}
    params, state, loss = run(params, state, x, y)
    for _ in range(2):
        params, state, loss = run(params, state, x, y)
    jax.block_until_ready(loss)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        params, state, loss = run(params, state, x, y)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens_per_step = args.batch * args.seq
    peak_bytes = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0)
    from jnova.runtime.target import get_target

    peak = get_target(None).peak_tensor_flops(args.dtype) if jax.devices()[0].platform != "cpu" else None
    flops = config.flops_per_token(args.seq) * tokens_per_step
    return {"tok_s": tokens_per_step / step_s, "ms": step_s * 1e3, "peak_gb": peak_bytes / 1e9,
            "compile_s": compile_s, "mfu": flops / step_s / peak if peak else None, "loss": float(loss)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="batch 8; f32, bf16 and bf16 + cuDNN; torch bf16 only")
    p.add_argument("--batch", type=int, nargs="+", help="batches (default 8 16; --quick: 8)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=12, help="layers (12: GPT-2 124M; fewer for a quick look)")
    p.add_argument("--steps", type=int, help="timed steps per measurement, the median is taken (default 20; quick 10)")
    p.add_argument("--cases", nargs="+", help="only these cases (<dtype>/<attention>/B<batch>)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--no-warm", action="store_true", help="skip the warm-compile processes")
    p.add_argument("--unpadded-vocab", action="store_true", help="vocabulary 50257 instead of 50304")
    p.add_argument("--timeout", type=float, default=300, help="seconds per process")
    p.add_argument("--out", default=os.environ.get("OUT"), help="results folder (default $OUT, else a temp folder)")
    p.add_argument("--report-only", action="store_true", help="only rewrite the table and chart from --out's records")
    # the worker's options (one measurement, run by the orchestrator)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=["jnova", "xla"], help=argparse.SUPPRESS)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help=argparse.SUPPRESS)
    p.add_argument("--attention", default="xla", help=argparse.SUPPRESS)
    p.add_argument("--xla-cache-dir", help=argparse.SUPPRESS)
    p.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.batch = args.batch[0] if args.batch else 8
        args.steps = args.steps or 20
        print(RESULT + json.dumps(worker(args)), flush=True)
        return 0
    args.out = args.out or tempfile.mkdtemp(prefix="gpt2-compare-out-")
    os.makedirs(args.out, exist_ok=True)
    if args.report_only:
        print("\n".join(f"wrote {p}" for p in write_report(args.out)))
        return 0
    args.batch = args.batch or ([8] if args.quick else [8, 16])
    args.steps = args.steps or (10 if args.quick else 20)
    todo = args.cases or cases(args.quick, args.batch)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    plan = [(c, i) for c in todo for i in ("jnova", "xla") if i in args.impls]
    if "torch_compile" in args.impls:
        if torch_available(env):
            plan += [(c, "torch_compile") for c in torch_cases(todo, args.quick)]
        else:
            print("PyTorch with CUDA is not installed here: the torch.compile anchor is skipped", flush=True)
    print(f"{len(plan)} measurements, each a cold and a warm process; results in {args.out}", flush=True)
    meta = run_meta()
    measurements = []
    for case, impl in plan:
        m = measure(case, impl, args, env)
        measurements.append(m)
        append_records(records([m], meta), args.out)   # as they come: a cut-off run keeps what it measured
    for path in write_report(args.out):
        print(f"wrote {path}")
    print(table(measurements))
    return 0 if all(not m.error for m in measurements) else 1


if __name__ == "__main__":
    sys.exit(main())
