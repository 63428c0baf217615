"""Train GPT-2 with jnova (or jax.jit, or both side by side), as nanoGPT trains it.

Commands, from the repository root (README: how to install):

  python examples/gpt2/train.py                  # tiny GPT-2 on Shakespeare with jnova (20 steps on a CPU:
                                                 # a few minutes; it says how long after step 2)
  python examples/gpt2/train.py --small          # CPU check: a few steps with jnova and with jax.jit from the
                                                 # same init; exits 1 if the losses diverge
  python examples/gpt2/train.py --compiler both --steps 200     # loss curves of both compilers, one PNG
  python examples/gpt2/train.py --data 'fineweb10B/fineweb_*.bin'    # llm.c / nanoGPT uint16 token shards
  python examples/gpt2/train.py --model gpt2-124m --batch 8 --seq-len 1024 --dtype bfloat16 \\
      --attention cudnn --steps 500 --compiler both                  # on a GPU
  python examples/gpt2/train.py --ckpt-dir ckpt --ckpt-interval 100  # ... later, add --resume

Training: AdamW (b2 0.95, weight decay 0.1 on matrices), learning rate warmed up linearly to --lr then
decayed along a cosine to --min-lr (6e-4 -> 6e-5), gradients clipped to global norm --clip (1.0),
--grad-accum micro-batches per step. Prints `step | loss | ms | tok/s | MFU` per step (MFU on a GPU)
and the validation loss every --eval-interval steps; with --compiler both, jax.jit's loss and time are
beside jnova's and |loss_jnova - loss_xla| <= tol * |loss_xla| is checked at every step (same init and
batches). Writes --out/<compiler>-seed<seed>.csv and .json (per step: loss, validation loss, learning
rate, ms, tok/s, MFU) and, when both compilers' metrics are there, --out/loss-seed<seed>.png. Ends with
a few lines of text sampled from the model (top-k). Checkpoints are orbax-checkpoint's (the Flax
ecosystem's standard): params, optimizer state (with the schedule's step) and the step; batches depend
only on (seed, step), so a resumed run continues exactly as an uninterrupted one.

Precision: `--dtype bfloat16` is Flax's mixed precision (every module computes in bf16; parameters and
optimizer state stay f32), for both compilers. `--mixed-precision bf16` is jnova's own: the step as
written (f32), with every contraction's operands demoted to bf16 (f32 accumulation); XLA runs it in
TF32. On a GPU, f32 contractions are TF32 for both compilers.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jnova
from data import CORPORA, EOT, Batches, eval_batches, load_splits
from model import (ATTENTIONS, DTYPES, GPT2_VOCAB, PADDED_VOCAB, GPT, GPTConfig, generate, init_params, loss_fn,
                   lr_schedule, make_accumulation_steps, make_optimizer, make_train_step)

MODELS = {"tiny": GPTConfig.tiny, "gpt2-124m": GPTConfig.gpt2_124m}
SMALL = {"model": "tiny", "batch": 4, "seq_len": 32, "steps": 5, "compiler": "both", "eval_interval": 0,
         "sample_tokens": 0, "eval_batches": 1}
DEFAULTS = {"model": "tiny", "batch": 8, "seq_len": 64, "steps": 200, "compiler": "jnova", "eval_interval": 50,
            "sample_tokens": 48, "eval_batches": 8}
# jnova's CPU kernels are plain loops (the tiny step takes seconds): a default CPU run is a short demo
CPU_DEFAULTS = {**DEFAULTS, "batch": 4, "seq_len": 32, "steps": 20, "eval_interval": 10, "eval_batches": 4,
                "sample_tokens": 24}
COMPILERS = ("jnova", "xla", "both")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help=f"CPU check: {SMALL} unless given")
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=sorted(MODELS), help=f"model size (default {DEFAULTS['model']})")
    g.add_argument("--n-layer", type=int, help="override the model's number of layers")
    g.add_argument("--d-model", type=int, help="override the model's width")
    g.add_argument("--n-head", type=int, help="override the model's number of heads")
    g.add_argument("--unpadded-vocab", action="store_true",
                   help=f"{GPT2_VOCAB} embedding rows instead of {PADDED_VOCAB} (a multiple of 64)")
    g.add_argument("--vocab-size", type=int,
                   help="embedding rows for shards of another tokenizer (token ids must be below it)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="the modules' computation dtype (Flax mixed precision: parameters stay f32)")
    g.add_argument("--mixed-precision", choices=["none", "bf16"], default="none",
                   help="jnova's contraction-operand demotion (jnova only)")
    g.add_argument("--attention", choices=ATTENTIONS, default="xla",
                   help="manual: written out; xla: jax.nn.dot_product_attention; cudnn: its cuDNN implementation")
    g = p.add_argument_group("training")
    g.add_argument("--compiler", choices=COMPILERS, help=f"default {DEFAULTS['compiler']}")
    g.add_argument("--batch", type=int, help=f"sequences per micro-batch (default {DEFAULTS['batch']})")
    g.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {DEFAULTS['seq_len']})")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--steps", type=int, help=f"optimizer steps (default {DEFAULTS['steps']})")
    g.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=6e-5, help="learning rate at the end of the cosine decay")
    g.add_argument("--warmup-steps", type=int, help="linear warmup steps (default: a tenth of --steps)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    g.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm (0: off)")
    g.add_argument("--seed", type=int, default=0, help="seed of the initialization and of the batches")
    g.add_argument("--tol", type=float, default=None,
                   help="relative loss tolerance of --compiler both (default 1e-5 on the CPU, 2e-3 on a GPU: "
                        "TF32; 2e-2 with bf16)")
    g = p.add_argument_group("data and evaluation")
    g.add_argument("--data", default="shakespeare",
                   help=f"{' | '.join(CORPORA)} | PATH to uint16 token shards (file, folder or glob)")
    g.add_argument("--val-fraction", type=float, default=0.1, help="the validation split of a corpus")
    g.add_argument("--eval-interval", type=int, help="validation loss every N steps (0: at the end only)")
    g.add_argument("--eval-batches", type=int, help="batches of the validation split per evaluation (default 8)")
    g = p.add_argument_group("checkpoints and output")
    g.add_argument("--ckpt-dir", help="save orbax checkpoints here (one folder per compiler)")
    g.add_argument("--ckpt-interval", type=int, default=0, help="checkpoint every N steps (0: at the end only)")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    g.add_argument("--stop-after", type=int, help="stop after this many steps of this run (resume later)")
    g.add_argument("--out", default="out/gpt2", help="folder for the metrics (CSV, JSON) and the loss plot")
    g.add_argument("--sample-tokens", type=int, help="tokens of text to sample at the end (0: none)")
    g.add_argument("--samples", type=int, default=2, help="sequences to sample")
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--prompt", default="\n", help="text the samples start from")
    args = p.parse_args(argv)
    cpu = jax.devices()[0].platform == "cpu"
    for name, value in (SMALL if args.small else CPU_DEFAULTS if cpu else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.warmup_steps is None:
        args.warmup_steps = args.steps // 10
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    if args.grad_accum < 1 or args.steps < 1:
        p.error("--grad-accum and --steps must be at least 1")
    return args


def model_config(args) -> GPTConfig:
    overrides = {"n_layer": args.n_layer, "d_model": args.d_model, "n_head": args.n_head}
    size = MODELS[args.model]
    vocab = args.vocab_size or (GPT2_VOCAB if args.unpadded_vocab else PADDED_VOCAB)
    base = size(vocab_size=vocab) if args.model == "tiny" else dataclasses.replace(size(), vocab_size=vocab)
    try:
        cfg = dataclasses.replace(base, dtype=DTYPES[args.dtype], attention=args.attention,
                                  **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as e:
        raise SystemExit(str(e))
    if args.seq_len > cfg.block_size:
        raise SystemExit(f"--seq-len {args.seq_len} is longer than the model's block size {cfg.block_size}")
    return cfg


def peak_flops(device: jax.Device, dtype: str) -> float | None:
    """The GPU's dense tensor-core FLOP/s for the step's contractions (TF32 for f32), for MFU; None on the CPU."""
    if device.platform == "cpu":
        return None
    from jnova.runtime.target import get_target

    return get_target(None).peak_tensor_flops(dtype)


class Run:
    """One compiler's training state and compiled steps."""

    def __init__(self, name: str, args, model: GPT, optimizer, params):
        self.name, self.args = name, args
        self.params = jax.tree.map(jnp.copy, params)   # donated to the step: each run has its own copy
        self.opt_state = optimizer.init(self.params)
        mp = "bf16" if args.mixed_precision == "bf16" else None

        def compile_(fn, donate):
            if name == "jnova":
                return jnova.compile(fn, donate_argnums=donate, mixed_precision=mp)
            return jax.jit(fn, donate_argnums=donate)

        if args.grad_accum == 1:
            self.train_step = compile_(make_train_step(model, optimizer), (0, 1))
        else:
            grad_step, update_step = make_accumulation_steps(model, optimizer, args.grad_accum)
            self.grad_step, self.update_step = compile_(grad_step, (1,)), compile_(update_step, (0, 1))
        self.eval_loss = compile_(lambda p, x, y: loss_fn(model, p, x, y), ())

    def compile(self, x, y) -> str:
        """Compile every step ahead of the first (so `ms` is the step alone); returns what was compiled."""
        lowered = []
        if self.args.grad_accum == 1:
            lowered.append(self.train_step.lower(self.params, self.opt_state, x, y))
        else:
            zeros = jax.tree.map(jnp.zeros_like, self.params)
            lowered.append(self.grad_step.lower(self.params, zeros, x, y))
            lowered.append(self.update_step.lower(self.params, self.opt_state, zeros))
        lowered.append(self.eval_loss.lower(self.params, x, y))
        for low in lowered:
            low.compile()
        if self.name != "jnova":
            return f"{len(lowered)} functions"
        kernels = sum(low.stats()["kernels"] for low in lowered)
        groups = sum(low.stats()["xla_groups"] for low in lowered)
        return f"{len(lowered)} functions, {kernels} kernels, {groups} XLA groups"

    def step(self, batches: Batches, step: int) -> float:
        """One optimizer step (step numbers start at 1); returns the mean training loss."""
        accum = self.args.grad_accum
        if accum == 1:
            x, y = batches.at(step - 1)
            self.params, self.opt_state, loss = self.train_step(self.params, self.opt_state, x, y)
            return float(loss)
        grad_sum, losses = jax.tree.map(jnp.zeros_like, self.params), []
        for micro in range(accum):
            x, y = batches.at((step - 1) * accum + micro)
            grad_sum, loss = self.grad_step(self.params, grad_sum, x, y)
            losses.append(loss)
        self.params, self.opt_state = self.update_step(self.params, self.opt_state, grad_sum)
        return float(np.mean([float(v) for v in losses]))

    def validation_loss(self, val) -> float:
        return float(np.mean([float(self.eval_loss(self.params, x, y)) for x, y in val]))


class Checkpoints:
    """orbax-checkpoint's CheckpointManager over {params, opt_state, step}, one folder per compiler."""

    def __init__(self, directory: str, name: str):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.manager = ocp.CheckpointManager(os.path.abspath(os.path.join(directory, name)),
                                             options=ocp.CheckpointManagerOptions(max_to_keep=3))

    def save(self, run: Run, step: int) -> None:
        state = {"params": run.params, "opt_state": run.opt_state, "step": step}
        self.manager.save(step, args=self.ocp.args.StandardSave(state))
        self.manager.wait_until_finished()   # before the next step donates the buffers

    def restore(self, run: Run) -> int:
        """Restore the latest checkpoint into `run`; returns its step (0 when there is none)."""
        latest = self.manager.latest_step()
        if latest is None:
            return 0
        target = {"params": run.params, "opt_state": run.opt_state, "step": 0}
        state = self.manager.restore(latest, args=self.ocp.args.StandardRestore(target))
        run.params, run.opt_state = state["params"], state["opt_state"]
        return int(state["step"])


def say(message: str) -> None:
    print(message, flush=True)


def train(args) -> int:
    device = jax.devices()[0]
    cfg = model_config(args)
    train_tokens, val_tokens = load_splits(args.data, args.val_fraction, log=say)
    if val_tokens.max() >= cfg.vocab_size:   # training batches are checked as they are drawn (shards are mapped)
        raise SystemExit(f"--data holds token id {val_tokens.max()}, outside the model's vocabulary of {cfg.vocab_size}")
    batches = Batches(train_tokens, args.batch, args.seq_len, seed=args.seed, vocab=cfg.vocab_size)
    val = eval_batches(val_tokens, args.batch, args.seq_len, args.eval_batches)

    say(f"initializing GPT-2 {args.model} (seed {args.seed}) ...")
    model = GPT(cfg)
    schedule = lr_schedule(args.lr, args.min_lr, args.warmup_steps, args.steps)
    optimizer = make_optimizer(schedule, args.weight_decay, clip_norm=args.clip or None)
    params = init_params(model, jax.random.key(args.seed), args.seq_len)
    n_params = sum(p.size for p in jax.tree.leaves(params))
    tokens_per_step = args.batch * args.seq_len * args.grad_accum
    say(f"GPT-2 {args.model}: {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, vocabulary "
        f"{cfg.vocab_size}, {n_params / 1e6:.2f}M parameters, dtype {args.dtype}, attention {args.attention}; "
        f"data {args.data}: {len(batches):,} training / {len(val_tokens):,} validation tokens; "
        f"{args.grad_accum} x {args.batch} x {args.seq_len} = {tokens_per_step:,} tokens per step")
    if n_params > 20e6 and device.platform == "cpu":
        say("note: jnova's CPU kernels are unoptimized loops; a model this size takes minutes per step on a CPU")

    names = ("jnova", "xla") if args.compiler == "both" else (args.compiler,)
    runs = {name: Run(name, args, model, optimizer, params) for name in names}
    checkpoints = {name: Checkpoints(args.ckpt_dir, name) for name in names} if args.ckpt_dir else {}
    start_step = 0
    for name, run in runs.items():
        if args.resume:
            restored = checkpoints[name].restore(run)
            say(f"{name}: resumed from step {restored}" if restored else f"{name}: no checkpoint in "
                f"{args.ckpt_dir}/{name}: starting at step 0")
            if start_step and restored != start_step:
                raise SystemExit(f"the compilers' checkpoints are at different steps ({start_step}, {restored})")
            start_step = restored
    x, y = batches.at(0)
    for name, run in runs.items():
        hint = "(the step's jaxpr through the nova pipeline to kernels, then XLA's compile around them; " \
               "cached on disk for the next run)" if name == "jnova" else "(jax.jit)"
        say(f"{name}: compiling the training and evaluation steps {hint} ...")
        start = time.perf_counter()
        what = run.compile(x, y)
        say(f"{name}: compiled {what} in {time.perf_counter() - start:.1f} s")

    compute = "bfloat16" if args.dtype == "bfloat16" or args.mixed_precision == "bf16" else "float32"
    peak = peak_flops(device, compute)
    step_flops = cfg.flops_per_token(args.seq_len) * tokens_per_step
    header = f"{'step':>5} | {'loss':>8} | {'ms':>8} | {'tok/s':>9}" + (f" | {'MFU':>5}" if peak else "")
    if len(runs) == 2:
        header += f" | {'xla loss':>8} | {'xla ms':>8} | {'rel diff':>8}"
    say(header)
    metrics = {name: [] for name in runs}
    worst, last_step = 0.0, args.steps
    if args.stop_after is not None:
        last_step = min(args.steps, start_step + args.stop_after)
    wall = time.perf_counter()
    for i in range(start_step + 1, last_step + 1):
        losses, times = {}, {}
        for name, run in runs.items():
            t0 = time.perf_counter()
            losses[name] = run.step(batches, i)   # float(): waits for the step
            times[name] = 1e3 * (time.perf_counter() - t0)
        main = names[0]
        row = (f"{i:>5} | {losses[main]:>8.4f} | {times[main]:>8.1f} | "
               f"{tokens_per_step / times[main] * 1e3:>9.0f}")
        if peak:
            row += f" | {step_flops / (times[main] / 1e3) / peak:>5.1%}"
        if len(runs) == 2:
            diff = abs(losses["jnova"] - losses["xla"]) / max(abs(losses["xla"]), 1e-30)
            worst = max(worst, diff)
            row += f" | {losses['xla']:>8.4f} | {times['xla']:>8.1f} | {diff:>8.1e}"
        say(row)
        evaluate = (args.eval_interval and i % args.eval_interval == 0) or i == args.steps
        val_losses = {name: run.validation_loss(val) for name, run in runs.items()} if evaluate else {}
        if val_losses:
            say(f"step {i}: validation loss " + ", ".join(f"{v:.4f} ({n})" for n, v in val_losses.items()))
        for name in runs:
            metrics[name].append({
                "step": i, "loss": losses[name], "val_loss": val_losses.get(name), "lr": float(schedule(i - 1)),
                "ms": times[name], "tok_s": tokens_per_step / times[name] * 1e3,
                "mfu": step_flops / (times[name] / 1e3) / peak if peak else None})
        if i == start_step + 2 and last_step - i > 2:
            per_step = sum(times.values()) / 1e3
            say(f"(about {per_step * (last_step - i):.0f} s for the remaining {last_step - i} steps, "
                f"plus validation)")
        if not all(np.isfinite(v) for v in losses.values()):
            say(f"FAIL: non-finite loss at step {i}: {losses}")
            return 1
        if len(runs) == 2 and diff > args.tol:
            say(f"FAIL: jnova's loss differs from jax.jit's by {diff:.2e} (relative) at step {i}, "
                f"more than --tol {args.tol:g}")
            return 1
        if checkpoints and ((args.ckpt_interval and i % args.ckpt_interval == 0) or i == last_step):
            for name, run in runs.items():
                checkpoints[name].save(run, i)
            say(f"step {i}: checkpoint saved in {args.ckpt_dir}")
    elapsed = time.perf_counter() - wall

    paths = write_metrics(args, cfg, metrics, n_params)
    for name, rows in metrics.items():
        if rows:
            ms = np.median([r["ms"] for r in rows])
            say(f"{name}: median {ms:.1f} ms/step, {tokens_per_step / ms * 1e3:,.0f} tok/s")
    if len(runs) == 2:
        say(f"loss parity OK (worst relative difference {worst:.1e})")
    say(f"trained steps {start_step + 1}..{last_step} in {elapsed:.1f} s; metrics: {', '.join(paths)}")
    if args.sample_tokens and last_step == args.steps:
        sample_text(args, model, runs[names[0]].params, cfg)
    return 0


def write_metrics(args, cfg: GPTConfig, metrics: dict, n_params: int) -> list[str]:
    """<out>/<compiler>-seed<seed>.csv and .json (a resumed run appends to them); the loss plot when
    both compilers' metrics are in <out>."""
    os.makedirs(args.out, exist_ok=True)
    written = []
    for name, rows in metrics.items():
        stem = os.path.join(args.out, f"{name}-seed{args.seed}")
        previous = []
        if args.resume and os.path.exists(stem + ".json"):
            with open(stem + ".json") as f:
                previous = [r for r in json.load(f)["rows"] if rows and r["step"] < rows[0]["step"]]
        rows = previous + rows
        with open(stem + ".csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["step", "loss", "val_loss", "lr", "ms", "tok_s", "mfu"])
            writer.writeheader()
            writer.writerows(rows)
        vals = [r["val_loss"] for r in rows if r["val_loss"] is not None]
        summary = {"compiler": name, "seed": args.seed, "model": args.model, "n_params": n_params,
                   "config": {k: str(v) for k, v in dataclasses.asdict(cfg).items()},
                   "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))},
                   "final_val_loss": vals[-1] if vals else None,
                   "median_ms": float(np.median([r["ms"] for r in rows])) if rows else None,
                   "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                   "jnova": os.environ.get("JNOVA_SHA", "unknown"), "rows": rows}
        with open(stem + ".json", "w") as f:
            json.dump(summary, f, indent=1)
        written += [stem + ".csv", stem + ".json"]
    curves = [os.path.join(args.out, f"{n}-seed{args.seed}.json") for n in ("jnova", "xla")]
    if all(os.path.exists(c) for c in curves):
        from plot import plot_loss_curves

        png = os.path.join(args.out, f"loss-seed{args.seed}.png")
        if plot_loss_curves(curves, png, title=f"GPT-2 {args.model}, seed {args.seed}: jnova vs jax.jit"):
            written.append(png)
    return written


def sample_text(args, model: GPT, params, cfg: GPTConfig) -> None:
    """A few lines of generated text (top-k sampling), decoded with GPT-2's tokenizer when it is installed."""
    try:
        from data import gpt2_tokenizer

        tokenizer = gpt2_tokenizer()
    except (ImportError, FileNotFoundError) as e:
        say(f"(no text sample: the GPT-2 tokenizer is not installed: {e})")
        return
    prompt = tokenizer.encode(args.prompt).ids or [EOT]
    new = min(args.sample_tokens, args.seq_len - len(prompt))
    if new < 1:
        say(f"(no text sample: the prompt's {len(prompt)} tokens fill --seq-len {args.seq_len})")
        return
    say(f"sampling {args.samples} x {new} tokens (top-k {args.top_k}, jax.jit) ...")
    out = generate(model, params, prompt, new, jax.random.key(args.seed + 1), top_k=args.top_k,
                   samples=args.samples, vocab=min(GPT2_VOCAB, cfg.vocab_size))
    for row in out:
        say("-" * 40 + "\n" + tokenizer.decode([int(t) for t in row]))


def main(argv=None) -> int:
    args = parse_args(argv)
    device = jax.devices()[0]
    say(f"device: {device.platform.upper()} ({device.device_kind})")
    if args.tol is None:
        bf16 = args.dtype == "bfloat16" or args.mixed_precision == "bf16"
        args.tol = 2e-2 if bf16 else 1e-5 if device.platform == "cpu" else 2e-3
    jnova_log = logging.getLogger("jnova")
    if not jnova_log.handlers and "JNOVA_LOG" not in os.environ:   # jnova's compile summaries as progress
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("  %(message)s"))
        jnova_log.addHandler(handler)
        jnova_log.setLevel(logging.INFO)
        jnova_log.propagate = False
    try:
        with jax.default_device(device):
            return train(args)
    except ValueError as e:   # bad combinations the model or the data refuse (cuDNN on a CPU, ...)
        if "attention 'cudnn'" in str(e) or "outside the model's vocabulary" in str(e):
            raise SystemExit(f"error: {e}")
        raise


if __name__ == "__main__":
    sys.exit(main())
