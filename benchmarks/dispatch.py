"""Host dispatch of the GPT-2 training step: jnova against jax.jit, interleaved in one process.

    JAX_PLATFORMS=cuda python benchmarks/dispatch.py --dtype float32 [--batch 8 --seq 1024 --rounds 60]

Dispatch is the time a step call takes to return, with the previous step finished (so the launch
queue starts empty). Both steps are compiled in the same process and called in alternation, A B B A
..., so that what drifts during a run (clocks, other tenants of the host, the allocator) falls on
both alike; separate processes differ by up to 1.5x from one to the next (benchmarks/results). The
record gives each side's median and the median of the per-round ratios, with its quartiles.

jnova's step is measured up to three times: launching its kernels through jnova's launcher (the
default: "jnova"), through the same launcher without its record stage where it has one
(JNOVA_LAUNCHER_RECORD=0 while it is compiled: "jnova-captured", each launch captured into XLA's
command buffer as a child graph instead of recorded as a kernel node), and through jaxlib's PTX
kernel call (JNOVA_LAUNCHER=jaxlib: "jnova-jaxlib"; `--no-jaxlib-launcher` leaves it out). Each
side's step time (until its results are ready, the GPU idle before) is recorded beside its dispatch.
Each record names the kernel call its side's lowering chose ("launcher").

`--dtype bfloat16` is jnova's mixed_precision="bf16" against XLA with bf16 contraction operands, as in
gpt2_step.py. `--jnova-xla-option` passes XLA options to jnova's step only (e.g. command buffers:
CUDA graphs around its kernel calls). Appends records to $OUT/dispatch.jsonl when OUT is set.
"""
from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import statistics
import time

import jax

from gpt2_step import compile_step, emit, parser, setup


def dispatch_seconds(run, args) -> tuple[float, float]:
    """Seconds for `run(*args)` to return, with the GPU idle before the call, and for its results to
    be ready (the step's time)."""
    t0 = time.perf_counter()
    out = run(*args)
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    return t1 - t0, time.perf_counter() - t0


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


@contextlib.contextmanager
def launcher_env(values: dict):
    """The launcher's environment variables set to `values` (the others unset) while a step is compiled
    and first called."""
    names = ("JNOVA_LAUNCHER", "JNOVA_LAUNCHER_RECORD")
    old = {name: os.environ.pop(name, None) for name in names}
    os.environ.update(values)
    try:
        yield
    finally:
        for name in names:
            os.environ.pop(name, None)
            if old[name] is not None:
                os.environ[name] = old[name]


def kernel_call(hlo: str) -> str:
    """Which kernel call a jnova step's HLO launches through."""
    from jnova.runtime import launcher

    if "@" + launcher.CAPTURED_TARGET in hlo:
        return "jnova-captured"
    if "@" + launcher.TARGET in hlo:
        return "jnova-record" if launcher.load().mode == "record" else "jnova-captured"
    return "jaxlib" if "triton_kernel_call" in hlo else "none"


def main():
    p = parser(steps=0, impl=False)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--label", default="")
    p.add_argument("--no-jaxlib-launcher", action="store_true", help="leave out jnova's step on jaxlib's kernel call")
    p.add_argument("--jnova-xla-option", action="append", default=[], metavar="NAME=VALUE",
                   help="an XLA option for jnova's step (jnova.compile's xla_options), e.g. "
                        "xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL")
    args = p.parse_args()

    xla_options = dict(o.split("=", 1) for o in args.jnova_xla_option) or None
    config, step, batch = setup(args.batch, args.seq, args.layers)
    from jnova.runtime import launcher

    lib = launcher.load()
    sides = {"jnova": {}}
    if lib is not None and lib.mode == "record":
        sides["jnova-captured"] = {"JNOVA_LAUNCHER_RECORD": "0"}
    if not args.no_jaxlib_launcher:
        sides["jnova-jaxlib"] = {"JNOVA_LAUNCHER": "jaxlib"}
    sides["xla"] = {}
    runs, launchers = {}, {}
    for side, env in sides.items():
        impl = "xla" if side == "xla" else "jnova"
        with launcher_env(env):
            run, compiled = compile_step(impl, args.dtype, step, batch, xla_options if impl == "jnova" else None)
            if compiled is not None:  # which kernel call its lowering chose
                launchers[side] = kernel_call(compiled.lower(*batch).as_text("hlo"))
            for _ in range(3):  # first calls: kernels load, XLA warms its allocator
                jax.block_until_ready(run(*batch))
        runs[side] = run
    print("launchers:", launchers, "launcher counts:", lib.counts() if lib is not None else None)
    times = {side: [] for side in runs}
    step_times = {side: [] for side in runs}
    ratios = {side: [] for side in runs if side != "xla"}
    orders = itertools.cycle(itertools.permutations(runs))
    for r in range(args.rounds):
        this = {side: dispatch_seconds(runs[side], batch) for side in next(orders)}
        for side, (t, step_t) in this.items():
            times[side].append(t)
            step_times[side].append(step_t)
        for side in ratios:
            ratios[side].append(this[side][0] / this["xla"][0])

    base = {"bench": "dispatch", "case": f"B{args.batch}xT{args.seq}xL{args.layers}", "dtype": args.dtype,
            "device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(),
            "jax": jax.__version__, "jnova": os.environ.get("JNOVA_SHA", "unknown"), "rounds": args.rounds}
    if args.label:
        base["label"] = args.label
    if xla_options:
        base["jnova_xla_options"] = xla_options
    records = [{**base, "impl": impl, "metric": "dispatch_ms", "launcher": launchers.get(impl, "xla"),
                "value": round(statistics.median(ts) * 1e3, 3),
                "quartiles_ms": [round(q * 1e3, 3) for q in quartiles(ts)]} for impl, ts in times.items()]
    records += [{**base, "impl": impl, "metric": "step_ms", "launcher": launchers.get(impl, "xla"),
                 "value": round(statistics.median(ts) * 1e3, 3),
                 "quartiles_ms": [round(q * 1e3, 3) for q in quartiles(ts)]} for impl, ts in step_times.items()]
    records += [{**base, "impl": f"{side}/xla", "metric": "dispatch_ratio", "launcher": launchers[side],
                 "value": round(statistics.median(rs), 3), "quartiles": [round(q, 3) for q in quartiles(rs)]}
                for side, rs in ratios.items()]
    if lib is not None:
        print("launcher counts after the rounds:", lib.counts())
    emit("dispatch.jsonl", records)


if __name__ == "__main__":
    main()
