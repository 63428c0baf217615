"""The LM head and its cross-entropy, forward + backward: jnova against XLA, side by side in one process.

    JAX_PLATFORMS=cuda python benchmarks/lm_head_ce.py
    python benchmarks/lm_head_ce.py --smoke          # small shapes: a check that it runs (a CPU)

The function is what a GPT-2 step does at its end, as a Flax user writes it: logits = x @ W^T with the
tied embedding W [V, C] (Flax's `Embed.attend`), cast to f32, optax's
`softmax_cross_entropy_with_integer_labels`, the mean over the rows; the loss and its gradients with
respect to x and W. Shapes: 8192 tokens x 768 x vocabulary 50304 (and 50257, not a tile multiple).
dtypes: bfloat16 (x and W in bf16, as Flax's `dtype=bfloat16` computes) and float32 (TF32 contractions
for both compilers, JAX's default precision on this GPU).

Times are medians of back-to-back batches (benchmarks/matmul.py's `timed`). `tflops` counts the three
contractions (logits, dX, dW: 6 N C V). `peak_gb` is the compiled step's own memory as XLA plans it
(arguments, outputs and temporaries, `memory_analysis()`), so both impls are measured in one process.

When OUT is set, records go to $OUT/lm_head_ce.jsonl (DESIGN.md's format: bench "lm_head_ce", metrics
"ms", "tflops", "peak_gb", impl jnova / xla, case "<tokens>x<C>x<V>", dtype), tagged with JNOVA_SHA.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp
import optax

import jnova
from matmul import timed  # noqa: E402 (benchmarks/ is on sys.path when run as a script)

SHAPES = ((8192, 768, 50304), (8192, 768, 50257))
SMOKE_SHAPES = ((64, 64, 1000), (64, 64, 1003))


def loss(x, w, labels):
    logits = (x @ w.T).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def inputs(n: int, c: int, v: int, dtype):
    kx, kw, kl = jax.random.split(jax.random.key(n + v), 3)
    x = jax.random.normal(kx, (n, c), jnp.float32).astype(dtype)
    w = (0.05 * jax.random.normal(kw, (v, c), jnp.float32)).astype(dtype)
    labels = jax.random.randint(kl, (n,), 0, v)
    return x, w, labels


def peak_bytes(compiled) -> int | None:
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
            - stats.alias_size_in_bytes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--smoke", action="store_true", help="small shapes (a check that it runs, e.g. on a CPU)")
    args = parser.parse_args(argv)
    base = {"bench": "lm_head_ce", "device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(),
            "jax": jax.__version__, "jnova": os.environ.get("JNOVA_SHA", "unknown")}
    step = jax.value_and_grad(loss, argnums=(0, 1))
    records, failed = [], 0
    for n, c, v in SMOKE_SHAPES if args.smoke else SHAPES:
        for dtype in args.dtypes.split(","):
            xs = inputs(n, c, v, jnp.dtype(dtype))
            case = f"{n}x{c}x{v}"
            print(f"{case} {dtype}:")
            results = {}
            for impl, fn in (("jnova", jnova.compile(step)), ("xla", jax.jit(step))):
                try:
                    compiled = fn.lower(*xs).compile()
                    seconds = timed(compiled, xs)
                    results[impl] = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), compiled(*xs))
                except Exception as e:  # noqa: BLE001 (reported, the other cases still run)
                    print(f"  {impl:>5}: failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
                    failed += 1
                    continue
                tflops = 6 * n * c * v / seconds / 1e12
                peak = peak_bytes(compiled)
                kernels = f", {fn.lower(*xs).stats()['kernels']} kernels" if impl == "jnova" else ""
                print(f"  {impl:>5}: {seconds * 1e3:8.3f} ms {tflops:6.1f} TFLOP/s, "
                      f"peak {peak / 1e9 if peak else float('nan'):.2f} GB{kernels}")
                for metric, value in (("ms", round(seconds * 1e3, 4)), ("tflops", round(tflops, 1)),
                                      ("peak_gb", None if peak is None else round(peak / 1e9, 3))):
                    if value is not None:
                        records.append({**base, "case": case, "dtype": dtype, "impl": impl, "metric": metric,
                                        "label": "fwd+bwd", "value": value})
            if len(results) == 2:   # the same function: a check that the timed kernels compute it
                (lj, (dxj, dwj)), (lx, (dxx, dwx)) = results["jnova"], results["xla"]
                rel = [float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in ((dxj, dxx), (dwj, dwx))]
                print(f"  loss {float(lj):.5f} vs {float(lx):.5f}; rel. L2 difference dx {rel[0]:.1e}, dW {rel[1]:.1e}")
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "lm_head_ce.jsonl"), "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
