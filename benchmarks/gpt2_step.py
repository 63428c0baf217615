"""GPT-2 training step, jnova vs XLA on the same GPU: step time, tokens/s, peak memory, compile time.

One configuration per process (peak memory cannot be reset), so run it once per (impl, dtype):

    python benchmarks/gpt2_step.py --impl jnova --dtype float32 [--batch 8 --seq 1024 --steps 20]
    python benchmarks/gpt2_step.py --impl xla --dtype bfloat16

`--dtype bfloat16` means f32 weights with bf16 contraction operands and f32 accumulation: jnova's
mixed_precision="bf16", and for XLA the same step with every contraction's operands cast to bf16
(`demote_dots`); `jax.default_matmul_precision("bfloat16")` is not that on a GPU (XLA runs TF32 there).
Prints one JSON record per line (DESIGN.md's format) and appends them to $OUT/gpt2_step.jsonl when OUT
is set. With a persistent cache directory set (JNOVA_CACHE_DIR), a second jnova process measures the
warm compile; with --xla-cache, XLA's compile of the step around jnova's kernels is cached too
(jnova.enable_xla_cache). XLA's own runs never use a compilation cache (their compile time is a cold
compile).

compile_s is the time until the step is an executable, for both sides the same way: jax.jit(step)
.lower(...).compile() for XLA, jnova.compile(step).lower(...).compile() for jnova (tracing, the nova
pipeline or the cache, and XLA's compile of the step around jnova's kernels). first_call_s is the first
call until its results are ready (kernels load, XLA records its command buffers, the step runs).
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

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt2"))
import model as gpt2  # noqa: E402


def setup(batch: int, seq: int, layers: int):
    """GPT-2 (124M with 12 layers), AdamW, random tokens: (config, train step, its arguments)."""
    config = gpt2.GPTConfig(n_layer=layers)
    module, optimizer = gpt2.GPT(config), gpt2.make_optimizer()
    params = gpt2.init_params(module, jax.random.key(0), seq)
    state = optimizer.init(params)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, seq + 1)), jnp.int32)
    return config, gpt2.make_train_step(module, optimizer), (params, state, tokens[:, :-1], tokens[:, 1:])


def parser(steps: int, impl: bool = True) -> argparse.ArgumentParser:
    """The options every GPT-2 step script takes (gpt2_step.py, profile_step.py; dispatch.py runs
    both implementations and takes no --impl)."""
    p = argparse.ArgumentParser()
    if impl:
        p.add_argument("--impl", choices=["jnova", "xla"], required=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=steps)
    return p


def compile_step(impl: str, dtype: str, step, batch, xla_options: dict | None = None):
    """(the runnable step, jnova's CompiledStep or None): jnova with bf16 contraction operands for
    dtype="bfloat16" (and `xla_options` for XLA's compile around its kernels), or jax.jit under the
    matching default matmul precision (TF32 for f32)."""
    if impl == "jnova":
        import jnova

        compiled = jnova.compile(step, mixed_precision="bf16" if dtype == "bfloat16" else None,
                                 xla_options=xla_options)
        compiled.lower(*batch).compile()  # XLA's compile too, as .lower().compile() for XLA's side
        return compiled, compiled
    if dtype == "bfloat16":  # XLA with the same arithmetic: bf16 operands, f32 accumulation
        return jax.jit(demote_dots(step)).lower(*batch).compile(), None
    with jax.default_matmul_precision("tensorfloat32"):
        return jax.jit(step).lower(*batch).compile(), None


INLINED = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr",
           "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr"}


def demote_dots(fn):
    """`fn` with every f32 x f32 -> f32 contraction taking bf16 operands and accumulating in f32: the
    arithmetic of jnova's mixed_precision="bf16", for XLA to run. (`jax.default_matmul_precision
    ("bfloat16")` does not do this on a GPU: XLA keeps f32 operands there and runs TF32.) The step is
    traced and re-evaluated with calls inlined; a contraction inside a loop or branch raises."""

    def demoted(*args):
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = _eval_demoted(closed.jaxpr, closed.consts, jax.tree_util.tree_leaves(args))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), outs)

    return demoted


def _eval_demoted(jaxpr, consts, args):
    env = {}
    read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]
    for var, value in zip(jaxpr.constvars, consts):
        env[var] = value
    for var, value in zip(jaxpr.invars, args):
        env[var] = value
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in INLINED:
            sub = eqn.params[INLINED[name]]
            inner, inner_consts = (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, [])
            outs = _eval_demoted(inner, inner_consts, invals)
        elif name == "dot_general" and all(v.aval.dtype == jnp.float32 for v in eqn.invars) \
                and eqn.outvars[0].aval.dtype == jnp.float32:
            lhs, rhs = (x.astype(jnp.bfloat16) for x in invals)
            outs = [eqn.primitive.bind(lhs, rhs, **{**eqn.params, "preferred_element_type": jnp.float32})]
        elif any("dot_general" in str(p) for p in eqn.params.values()):
            raise NotImplementedError(f"demote_dots: a contraction inside {name}")
        else:
            outs = eqn.primitive.bind(*invals, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        for var, value in zip(eqn.outvars, outs):
            env[var] = value
    return [read(v) for v in jaxpr.outvars]


def main():
    p = parser(steps=20)
    p.add_argument("--label", default="")
    p.add_argument("--xla-cache", action="store_true",
                   help="jnova: also cache XLA's compile of the step (jnova.enable_xla_cache)")
    args = p.parse_args()

    config, step, (params, state, x, y) = setup(args.batch, args.seq, args.layers)

    start = time.perf_counter()
    if args.impl == "jnova" and args.xla_cache:
        import jnova

        jnova.enable_xla_cache()
    run, compiled = compile_step(args.impl, args.dtype, step, (params, state, x, y))
    compile_s = time.perf_counter() - start
    first = run(params, state, x, y)
    jax.block_until_ready(first)
    first_call_s = time.perf_counter() - start - compile_s

    times, dispatch = [], []
    p_, s_ = params, state
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = run(p_, s_, x, y)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        dispatch.append(t1 - t0)
    step_s = statistics.median(times)
    tokens_per_step = args.batch * args.seq
    flops = config.flops_per_token(args.seq) * tokens_per_step
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0)  # None on the CPU
    base = {"bench": "gpt2_step", "case": f"B{args.batch}xT{args.seq}xL{args.layers}", "dtype": args.dtype,
            "impl": args.impl, "device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(),
            "jax": jax.__version__, "jnova": os.environ.get("JNOVA_SHA", "unknown")}
    if args.label:
        base["label"] = args.label
    records = [
        {**base, "metric": "ms", "value": step_s * 1e3},
        {**base, "metric": "tok_s", "value": tokens_per_step / step_s},
        {**base, "metric": "tflops", "value": flops / step_s / 1e12},
        {**base, "metric": "peak_gb", "value": peak / 1e9},
        {**base, "metric": "compile_s", "value": compile_s},
        {**base, "metric": "first_call_s", "value": first_call_s},
        {**base, "metric": "dispatch_ms", "value": statistics.median(dispatch) * 1e3},
        {**base, "metric": "loss", "value": float(first[2])},
    ]
    if args.impl == "jnova":
        stats = compiled.stats()[0]
        records.append({**base, "metric": "stage_s", "value": {k: round(v, 3) for k, v in stats["compile_s"].items()}})
        records.append({**base, "metric": "kernels", "value": stats["kernels"]})
        records.append({**base, "metric": "xla_groups", "value": stats["xla_groups"]})
        records.append({**base, "metric": "cache_hit", "value": str(stats["cache_hit"])})
        from jnova.runtime import launcher

        lib = launcher.load() if launcher.choice() == "jnova" else None
        if lib is not None:  # launches, kernel nodes recorded and updated, modules loaded
            records.append({**base, "metric": "launcher", "value": {"mode": lib.mode, **lib.counts()}})
    emit("gpt2_step.jsonl", records)


def emit(filename: str, records: list[dict]) -> None:
    """Print the records, one JSON line each, and append them to $OUT/<filename> when OUT is set."""
    lines = [json.dumps(r) for r in records]
    print("\n".join(lines))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], filename), "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
