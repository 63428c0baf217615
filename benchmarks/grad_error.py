"""How far each compiler's bf16 GPT-2 training drifts from float32's: jnova against jax.jit, step by step.

    JAX_PLATFORMS=cuda python benchmarks/grad_error.py                    # GPT-2 124M, ~5 min on an H200
    python benchmarks/grad_error.py --small                               # the tiny model, on a CPU

Two measurements, both against a float32 reference (the same Flax model with f32 modules, compiled by
jax.jit under `jax.default_matmul_precision("float32")`):

- trajectories: from one initialization and on the same batches (Shakespeare, as the parity run), the
  reference, jax.jit's bf16 step (Flax `dtype=bfloat16`, f32 parameters) and jnova's bf16 step each
  train --train-steps AdamW steps. Per step, each bf16 loss's distance from the reference's loss; at the
  end, each bf16 run's parameters' distance from the reference's, relative to how far the reference
  moved. A compiler whose bf16 arithmetic is as accurate as the other's drifts as fast.
- gradients: at the reference's final parameters, on --grad-batches fresh batches, each impl's gradient
  against the reference's, per parameter group (all layers' c_attn kernels together, ...): the relative
  L2 error ||g - g_ref|| / ||g_ref|| and the norm ratio ||g|| / ||g_ref|| (a bias shows as a ratio away
  from 1 that rounding alone does not give). Besides jnova as a user calls it, variants with one of its
  rewrites switched off (--variants): "no-attention" (attention stays the generic ops: no fused
  attention kernels), "no-training-ops" (no fused LayerNorm / GELU / cross-entropy kernels),
  "no-excess-precision" (every bf16 rounding the program writes is kept); a variant whose error is
  jax.jit's where jnova's is larger names the kernels that lose the accuracy.

Writes records (bench `grad_error`; metrics `loss_drift` (mean |loss - loss_ref| over the steps),
`param_drift`, and per group `rel_err_<group>` / `norm_ratio_<group>`; impl `xla`, `jnova`,
`jnova-<variant>`) to $OUT/grad_error.jsonl when OUT is set, tagged with JNOVA_SHA.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("JNOVA_CACHE_DIR", "off")   # the variants must compile, not hit each other's entries

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "gpt2"))
import jnova  # noqa: E402
import model as gpt2  # noqa: E402
from data import Batches, load_splits  # noqa: E402

VARIANTS = ("no-attention", "no-training-ops", "no-excess-precision")
GROUP_PATTERNS = (("wte", r"^wte/"), ("wpe", r"^wpe/"), ("c_attn", r"/attn/c_attn/"),
                  ("attn_proj", r"/attn/c_proj/"), ("c_fc", r"/mlp/c_fc/"), ("mlp_proj", r"/mlp/c_proj/"),
                  ("layernorms", r"/ln_\d/|^ln_f/"))


def say(message: str) -> None:
    print(message, flush=True)


def leaf_groups(params) -> dict[str, list[int]]:
    """Parameter group -> the indices of its leaves in `jax.tree.leaves(params)` order."""
    paths = ["/".join(str(getattr(k, "key", k)) for k in path)
             for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    groups: dict[str, list[int]] = {}
    for i, path in enumerate(paths):
        name = next((g for g, pattern in GROUP_PATTERNS if re.search(pattern, path)), "other")
        groups.setdefault(name, []).append(i)
    return groups


def compare_grads(grads, ref, groups) -> dict[str, float]:
    """Per group: relative L2 error against the reference, and the ratio of the norms."""
    g = [np.asarray(x, np.float64) for x in jax.tree.leaves(grads)]
    r = [np.asarray(x, np.float64) for x in jax.tree.leaves(ref)]
    out = {}
    for name, idx in groups.items():
        diff = np.sqrt(sum(np.sum((g[i] - r[i]) ** 2) for i in idx))
        norm_ref = np.sqrt(sum(np.sum(r[i] ** 2) for i in idx))
        norm = np.sqrt(sum(np.sum(g[i] ** 2) for i in idx))
        out[f"rel_err_{name}"] = float(diff / norm_ref)
        out[f"norm_ratio_{name}"] = float(norm / norm_ref)
    return out


def tree_distance(a, b) -> float:
    return float(np.sqrt(sum(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2)
                             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))))


def jnova_compile(fn, variant: str | None, **kw):
    """jnova.compile(fn), with one of its rewrites switched off for a variant (a diagnostic, not an option)."""
    import jnova.pipeline as pipeline
    from jnova.primitives import backends

    if variant is None:
        return jnova.compile(fn, **kw)
    if variant == "no-excess-precision":
        return jnova.compile(fn, excess_precision=False, **kw)
    compiled = jnova.compile(fn, **kw)
    lower = compiled.lower

    def lower_without(*args, **kwargs):
        saved = pipeline.raise_attention, backends.raised_training_ops, backends.keeps_training_op
        if variant == "no-attention":
            pipeline.raise_attention = lambda func, sites: False
        elif variant == "no-training-ops":
            backends.raised_training_ops = lambda backend, per_group: ()
            backends.keeps_training_op = lambda name, backend, per_group: False
        else:
            raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
        try:
            return lower(*args, **kwargs).compile()
        finally:
            pipeline.raise_attention, backends.raised_training_ops, backends.keeps_training_op = saved

    class Variant:
        def __init__(self):
            self.executable = None

        def __call__(self, *args):
            if self.executable is None:
                self.executable = lower_without(*args)
            return self.executable(*args)

    return Variant()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="the tiny model at 4 x 32 tokens (a CPU check)")
    p.add_argument("--attention", choices=gpt2.ATTENTIONS, default="xla")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--train-steps", type=int, default=100)
    p.add_argument("--grad-batches", type=int, default=2)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--data", default=str(REPO / ".gpu-pack" / "shakespeare")
                   if (REPO / ".gpu-pack" / "shakespeare").exists() else "shakespeare")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.small:
        args.batch, args.seq = 4, 32
    make = gpt2.GPTConfig.tiny if args.small else gpt2.GPTConfig.gpt2_124m
    bf16_model = gpt2.GPT(make(dtype=jnp.bfloat16, attention=args.attention))
    ref_model = gpt2.GPT(make(dtype=None, attention="xla" if args.attention == "cudnn" else args.attention))
    train_tokens, _ = load_splits(args.data, 0.1, log=say)
    batches = Batches(train_tokens, args.batch, args.seq, seed=args.seed, vocab=bf16_model.config.vocab_size)
    params0 = gpt2.init_params(bf16_model, jax.random.key(args.seed), args.seq)
    schedule = gpt2.lr_schedule(6e-4, 6e-5, max(1, args.train_steps // 10), args.train_steps + 1)
    optimizer = gpt2.make_optimizer(schedule, 0.1, clip_norm=1.0)
    records, t0 = [], time.perf_counter()

    def record(impl: str, metric: str, value: float) -> None:
        records.append({"impl": impl, "metric": metric, "value": value})

    # --- trajectories ---
    final, losses = {}, {}
    for impl in ("reference", "xla", "jnova"):
        model = ref_model if impl == "reference" else bf16_model
        step = gpt2.make_train_step(model, optimizer)
        compiled = jnova.compile(step) if impl == "jnova" else jax.jit(step)
        params, opt_state, curve = jax.tree.map(jnp.copy, params0), optimizer.init(params0), []
        with jax.default_matmul_precision("float32" if impl == "reference" else None):
            for i in range(args.train_steps):
                params, opt_state, loss = compiled(params, opt_state, *batches.at(i))
                curve.append(float(loss))
        final[impl], losses[impl] = params, np.array(curve)
        say(f"{impl:>10}: {args.train_steps} steps, loss {curve[0]:.4f} -> {curve[-1]:.4f} "
            f"[{time.perf_counter() - t0:.0f} s]")
    moved = tree_distance(final["reference"], params0)
    for impl in ("xla", "jnova"):
        drift = np.abs(losses[impl] - losses["reference"])
        record(impl, "loss_drift", float(drift.mean()))
        record(impl, "param_drift", tree_distance(final[impl], final["reference"]) / moved)
        quarters = np.array_split(drift, 4)
        say(f"{impl:>10}: mean |loss - loss_ref| {drift.mean():.4f} (by quarter of the steps: "
            + ", ".join(f"{q.mean():.4f}" for q in quarters) + f"); mean loss - loss_ref "
            f"{(losses[impl] - losses['reference']).mean():+.4f}; parameters "
            f"{records[-1]['value']:.3f} of the reference's own move from the init")

    # --- gradients at the reference's parameters ---
    params = final["reference"]
    groups = leaf_groups(params)
    probe = [batches.at(args.train_steps + i) for i in range(args.grad_batches)]

    def grad_fn(model):
        return lambda p, x, y: jax.value_and_grad(lambda q: gpt2.loss_fn(model, q, x, y))(p)

    def mean_grads(fn, precision=None):
        with jax.default_matmul_precision(precision):
            outs = [fn(params, x, y) for x, y in probe]
        loss = float(np.mean([float(o[0]) for o in outs]))
        return loss, jax.tree.map(lambda *g: sum(np.asarray(v, np.float64) for v in g) / len(g), *[o[1] for o in outs])

    ref_loss, ref_grads = mean_grads(jax.jit(grad_fn(ref_model)), "float32")
    impls = {"xla": jax.jit(grad_fn(bf16_model)), "jnova": jnova_compile(grad_fn(bf16_model), None)}
    impls.update({f"jnova-{v}": jnova_compile(grad_fn(bf16_model), v) for v in args.variants})
    for impl, fn in impls.items():
        loss, grads = mean_grads(fn)
        stats = compare_grads(grads, ref_grads, groups)
        record(impl, "loss_error", abs(loss - ref_loss))
        for k, v in stats.items():
            record(impl, k, v)
        say(f"{impl:>26}: loss error {abs(loss - ref_loss):.2e}; rel err / norm ratio: " + ", ".join(
            f"{g} {stats['rel_err_' + g]:.4f}/{stats['norm_ratio_' + g]:.4f}" for g in groups)
            + f" [{time.perf_counter() - t0:.0f} s]")

    meta = {"bench": "grad_error", "case": f"{'tiny' if args.small else 'gpt2-124m'}/B{args.batch}xT{args.seq}/"
            f"{args.attention}/{args.train_steps}steps", "dtype": "bfloat16", "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "jnova": os.environ.get("JNOVA_SHA", "unknown"),
            "date": datetime.date.today().isoformat(), "seed": args.seed}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "grad_error.jsonl"), "a") as f:
            f.write("".join(json.dumps({**meta, **r}) + "\n" for r in records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
