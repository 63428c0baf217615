"""Memory-bound layers, forward + backward: jnova against XLA, side by side in one process.

    JAX_PLATFORMS=cuda python benchmarks/memory_bound.py
    JAX_PLATFORMS=cuda python benchmarks/memory_bound.py --cases layernorm,gelu --dtypes bfloat16

Cases (the Nova report's memory-bound kernels, section 6.1):
  layernorm      Flax nn.LayerNorm on x [16, 1024, 768]: y, then dx, dscale, dbias from a random dy
  gelu           jax.nn.gelu (tanh form) on x [16, 1024, 3072]: y, then dx from a random dy
  cross_entropy  optax.softmax_cross_entropy_with_integer_labels on logits [16384, 50304], mean
                 over rows: the loss and dlogits
Each is one jitted function (the forward and its VJP), compiled by `jnova.compile` and by `jax.jit`.
Times are medians of back-to-back batches (benchmarks/matmul.py's `timed`). GB/s counts the bytes a
perfect kernel pair moves: forward reads x and writes y, backward reads x and dy and writes dx
(5 tensors; the per-row statistics and [C] parameters are negligible); cross-entropy reads the
logits twice and writes dlogits once (3). `copy_fraction` is GB/s over the measured copy bandwidth
(XLA's x + 1 over 1 GiB, read + write), the target being 0.85 where the tensor exceeds L2.

When OUT is set, one JSON record per measurement goes to $OUT/memory_bound.jsonl (DESIGN.md's format:
bench "memory_bound", metrics "ms", "gbps" and "copy_fraction", impl jnova / xla, case and dtype),
tagged with JNOVA_SHA.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jnova
from matmul import timed  # noqa: E402 (benchmarks/ is on sys.path when run as a script)

CASES = ("layernorm", "gelu", "cross_entropy")
SHAPES = {"layernorm": (16, 1024, 768), "gelu": (16, 1024, 3072), "cross_entropy": (16384, 50304)}
SMOKE_SHAPES = {"layernorm": (2, 16, 768), "gelu": (2, 16, 3072), "cross_entropy": (64, 50304)}


def _layernorm(dtype):
    shape = SHAPES["layernorm"]
    module = nn.LayerNorm(epsilon=1e-5, dtype=dtype)
    params = module.init(jax.random.key(0), jnp.zeros(shape[-1:], jnp.float32))

    def step(params, x, dy):
        y, vjp = jax.vjp(lambda p, v: module.apply(p, v), params, x)
        return y, vjp(dy.astype(y.dtype))

    key = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(key[0], shape, dtype)
    dy = jax.random.normal(key[1], shape, dtype)
    return step, (params, x, dy), 5 * x.size * x.dtype.itemsize


def _gelu(dtype):
    shape = SHAPES["gelu"]

    def step(x, dy):
        y, vjp = jax.vjp(lambda v: jax.nn.gelu(v, approximate=True), x)
        return y, vjp(dy)

    key = jax.random.split(jax.random.key(2), 2)
    x, dy = (jax.random.normal(k, shape, dtype) for k in key)
    return step, (x, dy), 5 * x.size * x.dtype.itemsize


def _cross_entropy(dtype):
    n, v = SHAPES["cross_entropy"]

    def loss(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()

    key = jax.random.split(jax.random.key(3), 2)
    logits = jax.random.normal(key[0], (n, v), dtype) * 3
    labels = jax.random.randint(key[1], (n,), 0, v)
    return jax.value_and_grad(loss), (logits, labels), 3 * logits.size * logits.dtype.itemsize


BUILD = {"layernorm": _layernorm, "gelu": _gelu, "cross_entropy": _cross_entropy}


def copy_bandwidth(elements: int = 1 << 28) -> float:
    """Bytes per second of XLA's x + 1 over `elements` f32 (1 GiB; read and write)."""
    x = jnp.ones((elements,), jnp.float32)
    seconds = timed(jax.jit(lambda a: a + 1), (x,))
    return 2 * x.size * 4 / seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--smoke", action="store_true", help="small shapes (a check that it runs, e.g. on a CPU)")
    args = parser.parse_args(argv)
    if args.smoke:
        SHAPES.update(SMOKE_SHAPES)
    copy = copy_bandwidth(1 << 20 if args.smoke else 1 << 28)
    print(f"copy bandwidth: {copy / 1e9:.0f} GB/s")
    base = {"bench": "memory_bound", "device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(),
            "jax": jax.__version__, "jnova": os.environ.get("JNOVA_SHA", "unknown")}
    records = [{**base, "case": "copy", "dtype": "float32", "impl": "xla", "metric": "gbps",
                "value": round(copy / 1e9, 1)}]
    failed = 0
    for case in args.cases.split(","):
        for dtype in args.dtypes.split(","):
            step, xs, nbytes = BUILD[case](jnp.dtype(dtype))
            print(f"{case} {dtype}: {nbytes / 1e9:.2f} GB moved at best")
            for impl, fn in (("jnova", jnova.compile(step)), ("xla", jax.jit(step))):
                try:
                    seconds = timed(fn, xs)
                except Exception as e:  # noqa: BLE001 (reported, the other cases still run)
                    print(f"  {impl:>5}: failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
                    failed += 1
                    continue
                gbps = nbytes / seconds / 1e9
                kernels = f", {fn.lower(*xs).stats()['kernels']} kernels" if impl == "jnova" else ""
                print(f"  {impl:>5}: {seconds * 1e3:8.3f} ms {gbps:7.0f} GB/s ({gbps * 1e9 / copy:.0%} of copy){kernels}")
                for metric, value in (("ms", round(seconds * 1e3, 4)), ("gbps", round(gbps, 1)),
                                      ("copy_fraction", round(gbps * 1e9 / copy, 3))):
                    records.append({**base, "case": case, "dtype": dtype, "impl": impl, "metric": metric,
                                    "label": "fwd+bwd", "value": value})
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "memory_bound.jsonl"), "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
