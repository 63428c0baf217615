"""Train GPT-2 with jnova (and, side by side, with jax.jit).

Commands, from the repository root (README: how to install):

  python examples/gpt2/train.py --small          # CPU check: tiny GPT-2 on Shakespeare, a few steps with jnova
                                                 # and with jax.jit from the same init; exits 1 if the losses diverge
  python examples/gpt2/train.py --small --data kjv --steps 20
  python examples/gpt2/train.py --model tiny --batch 8 --seq-len 64 --steps 50 --compare-xla
  python examples/gpt2/train.py --data 'fineweb10B/fineweb_train_*.bin'    # llm.c / nanoGPT uint16 token shards
  python examples/gpt2/train.py --model gpt2-124m --batch 8 --seq-len 1024 --compare-xla   # on a GPU

Prints `step | loss | ms | tok/s` per step (and MFU on a GPU), and with --compare-xla (implied by
--small) jax.jit's loss and time next to jnova's, checking |loss_jnova - loss_xla| <= tol * |loss_xla| at
every step. Both are compiled before step 1 (jnova's step 1 still includes XLA's compilation of the
function around jnova's kernels).

On a GPU, jnova and XLA both use TF32 contractions, so the loss check uses --tol 2e-3 there unless given.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jnova
from data import CORPORA, Batches, load_tokens
from model import GPT, GPTConfig, init_params, make_optimizer, make_train_step

MODELS = {"tiny": GPTConfig.tiny(), "gpt2-124m": GPTConfig.gpt2_124m()}
SMALL = {"model": "tiny", "batch": 4, "seq_len": 32, "steps": 5}
DEFAULTS = {"model": "tiny", "batch": 8, "seq_len": 64, "steps": 50}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true",
                   help=f"CPU check: {SMALL} unless given, and --compare-xla")
    p.add_argument("--model", choices=sorted(MODELS), help=f"model size (default {DEFAULTS['model']})")
    p.add_argument("--n-layer", type=int, help="override the model's number of layers")
    p.add_argument("--d-model", type=int, help="override the model's width")
    p.add_argument("--n-head", type=int, help="override the model's number of heads")
    p.add_argument("--batch", type=int, help=f"sequences per step (default {DEFAULTS['batch']})")
    p.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {DEFAULTS['seq_len']})")
    p.add_argument("--steps", type=int, help=f"training steps (default {DEFAULTS['steps']})")
    p.add_argument("--data", default="shakespeare",
                   help=f"{' | '.join(CORPORA)} | PATH to uint16 token shards (file, folder or glob)")
    p.add_argument("--lr", type=float, default=6e-4, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialization and of the batches")
    p.add_argument("--compare-xla", action="store_true", help="also train with jax.jit and check loss parity")
    p.add_argument("--tol", type=float, default=None,
                   help="relative loss tolerance of --compare-xla (default 1e-5 on the CPU, 2e-3 on a GPU: TF32)")
    args = p.parse_args(argv)
    for name, value in (SMALL if args.small else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.compare_xla = args.compare_xla or args.small
    return args


def model_config(args) -> GPTConfig:
    overrides = {"n_layer": args.n_layer, "d_model": args.d_model, "n_head": args.n_head}
    cfg = dataclasses.replace(MODELS[args.model], **{k: v for k, v in overrides.items() if v is not None})
    if args.seq_len > cfg.block_size:
        raise SystemExit(f"--seq-len {args.seq_len} is longer than the model's block size {cfg.block_size}")
    if cfg.d_model % cfg.n_head:
        raise SystemExit(f"d_model {cfg.d_model} is not divisible by n_head {cfg.n_head}")
    return cfg


def compute_device() -> jax.Device:
    """The default device: the GPU when there is one (jnova compiles for it), else the CPU."""
    device = jax.devices()[0]
    print(f"device: {device.platform.upper()} ({device.device_kind})", flush=True)
    return device


def peak_flops(device: jax.Device) -> float | None:
    """The GPU's dense tensor-core FLOP/s for f32 (TF32) training, for MFU; None on the CPU."""
    if device.platform == "cpu":
        return None
    from jnova.runtime.target import get_target

    return get_target(None).peak_tensor_flops("float32")


def timed(fn, *args):
    """Run `fn(*args)` to completion; returns (result, milliseconds)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, 1e3 * (time.perf_counter() - start)


def train(args) -> int:
    cfg = model_config(args)
    tokens = load_tokens(args.data)
    if tokens.max() >= cfg.vocab_size:
        raise SystemExit(f"--data holds token id {tokens.max()}, outside GPT-2's vocabulary of {cfg.vocab_size}")
    batches = Batches(tokens, args.batch, args.seq_len, seed=args.seed)
    model, optimizer = GPT(cfg), make_optimizer(args.lr, args.weight_decay)
    train_step = make_train_step(model, optimizer)
    params = init_params(model, jax.random.key(args.seed), args.seq_len)
    n_params = sum(p.size for p in jax.tree.leaves(params))
    print(f"GPT-2 {args.model}: {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, "
          f"{n_params / 1e6:.2f}M parameters; data {args.data}: {len(tokens):,} tokens; "
          f"batch {args.batch} x {args.seq_len}", flush=True)
    if n_params > 20e6 and jax.devices()[0].platform == "cpu":
        print("note: jnova's CPU kernels are unoptimized loops; a model this size takes minutes per step", flush=True)

    # donate params and optimizer state (updated in place); each side starts from its own copy of the init
    names = ("jnova", "xla") if args.compare_xla else ("jnova",)
    state = {name: (jax.tree.map(jnp.copy, params), optimizer.init(params)) for name in names}
    x, y = map(jnp.asarray, batches.next())
    runs = {}
    for name in names:   # compile ahead of the first step, so that `ms` is the step alone
        start = time.perf_counter()
        if name == "jnova":
            runs[name] = jnova.compile(train_step, donate_argnums=(0, 1))
            runs[name].lower(*state[name], x, y)
        else:
            runs[name] = jax.jit(train_step, donate_argnums=(0, 1)).lower(*state[name], x, y).compile()
        print(f"{name}: compiled in {time.perf_counter() - start:.1f} s", flush=True)

    tokens_per_step = args.batch * args.seq_len
    peak = peak_flops(jax.devices()[0])
    step_flops = cfg.flops_per_token(args.seq_len) * tokens_per_step
    header = f"{'step':>5} | {'loss':>8} | {'ms':>8} | {'tok/s':>8}" + (f" | {'MFU':>5}" if peak else "")
    if args.compare_xla:
        header += f" | {'xla loss':>8} | {'xla ms':>8} | {'rel diff':>8}"
    print(header, flush=True)
    worst, times = 0.0, {name: [] for name in runs}
    for i in range(1, args.steps + 1):
        losses = {}
        for name, step in runs.items():
            (*new_state, loss), ms = timed(step, *state[name], x, y)
            state[name], losses[name] = tuple(new_state), float(loss)
            times[name].append(ms)
        row = (f"{i:>5} | {losses['jnova']:>8.4f} | {times['jnova'][-1]:>8.1f} | "
               f"{tokens_per_step / times['jnova'][-1] * 1e3:>8.0f}")
        if peak:
            row += f" | {step_flops / (times['jnova'][-1] / 1e3) / peak:>5.1%}"
        if args.compare_xla:
            diff = abs(losses["jnova"] - losses["xla"]) / max(abs(losses["xla"]), 1e-30)
            worst = max(worst, diff)
            row += f" | {losses['xla']:>8.4f} | {times['xla'][-1]:>8.1f} | {diff:>8.1e}"
        print(row, flush=True)
        if not all(np.isfinite(v) for v in losses.values()):
            print(f"FAIL: non-finite loss at step {i}: {losses}", flush=True)
            return 1
        if args.compare_xla and diff > args.tol:
            print(f"FAIL: jnova's loss differs from jax.jit's by {diff:.2e} (relative) at step {i}, "
                  f"more than --tol {args.tol:g}", flush=True)
            return 1
        x, y = map(jnp.asarray, batches.next())
    summary = ", ".join(f"{name} {np.median(t):.1f} ms/step" for name, t in times.items())
    print(f"median: {summary}" + (f"; loss parity OK (worst relative difference {worst:.1e})" if args.compare_xla else ""))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    device = compute_device()
    if args.tol is None:
        args.tol = 1e-5 if device.platform == "cpu" else 2e-3
    with jax.default_device(device):
        return train(args)


if __name__ == "__main__":
    sys.exit(main())
