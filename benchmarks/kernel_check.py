"""Every kernel of a compiled GPT-2 step against its own ops run by XLA, on the step's own values.

    JAX_PLATFORMS=cuda python benchmarks/kernel_check.py [--dtype bfloat16] [--attention xla] [--layers 12]
    python benchmarks/kernel_check.py --small                  # the tiny model on a CPU

A step whose result is off (against jax.jit or a float32 reference) can be wrong in one kernel or in
the plan around it. This runs the plan jnova compiled eagerly, step by step: each kernel is launched on
the inputs the earlier kernels produced, and the same inputs go through the kernel's nova ops evaluated
one by one by XLA (`nova_to_jax`, each op's result rounded to its type). A kernel whose outputs differ
from its ops' by more than its arithmetic allows is the one to look at; the plan's other kernels then
are not suspects. Kernels whose ops have no XLA evaluation are listed as unchecked (the attention
kernels are evaluated by their ops' decomposition, in f32: their bf16 outputs differ by bf16's rounding). Prints the kernels by the largest relative L2 difference of any output; exits 1 when one is
above --tol.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("JNOVA_CACHE_DIR", "off")   # the plan's kernels are taken from a compile, not the cache

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "gpt2"))
import jnova  # noqa: E402
import jnova.primitives.backends as backends  # noqa: E402
import model as gpt2  # noqa: E402
from jnova.primitives.nova_kernel import KernelHandle, nova_kernel_p  # noqa: E402
from jnova.primitives.nova_to_jax import evaluate_ops  # noqa: E402


def captured_plan(step, args, **options):
    """(what the step function runs: its plan's JSON form, fallback sites, kernel handles and constant
    arguments; the Plan with the kernels' nova ops)."""
    import jnova.pipeline as pipeline

    plans, runs = [], []
    compile_gpu, compile_cpu, step_function = backends.compile_gpu, backends.compile_cpu, pipeline.step_function

    def keep_run(plan_json, sites, handles, const_args, *rest):
        runs.append({"plan": plan_json, "sites": sites, "handles": handles, "const_args": const_args})
        return step_function(plan_json, sites, handles, const_args, *rest)

    def keep_gpu(plan, *rest):
        plans.append(plan)
        return compile_gpu(plan, *rest)

    def keep_cpu(plan, *rest):
        plans.append(plan)
        return compile_cpu(plan, *rest)

    backends.compile_gpu, backends.compile_cpu, pipeline.step_function = keep_gpu, keep_cpu, keep_run
    try:
        jnova.compile(step, **options).lower(*args)
    finally:
        backends.compile_gpu, backends.compile_cpu, pipeline.step_function = compile_gpu, compile_cpu, step_function
    return runs[-1], plans[-1]


def relative_difference(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.dtype.kind not in "fc":
        return float(np.mean(got != want))
    finite = np.isfinite(want)
    if not np.array_equal(finite, np.isfinite(got)):
        return float("inf")
    scale = np.linalg.norm(want[finite])
    return float(np.linalg.norm((got - want)[finite]) / scale) if scale > 0 else float(np.abs(got[finite]).max())


def check(run, plan, flat_args) -> tuple[list[tuple], list[str]]:
    """([(difference, kernel name, output index, output type, ops)], unchecked kernel names)."""
    from jnova.primitives.executor import _bind

    kernels = {k.name: k for k in plan.kernels}
    plan_json, compiled_handles = run["plan"], run["handles"]
    env = dict(enumerate(list(flat_args) + list(run["const_args"])))
    rows, unchecked = [], []
    for step in plan_json["steps"]:
        ins = [env[i] for i in step["in"]]
        if "view" in step:
            outs = [jax.lax.reshape(ins[0], tuple(step["out_types"][0][0]))]
        elif "kernel" in step:
            handle = compiled_handles[step["kernel"]]
            outs = nova_kernel_p.bind(*ins, kernel=handle) if isinstance(handle, KernelHandle) else handle(*ins)
            outs = jax.block_until_ready(list(outs))
            kernel = kernels[step["kernel"]]
            try:
                want = evaluate_ops(kernel.ops, kernel.inputs, kernel.outputs)(*ins)
            except NotImplementedError:
                unchecked.append(kernel.name)
            else:
                for i, (g, w) in enumerate(zip(outs, want)):
                    rows.append((relative_difference(g, w), kernel.name, i, str(kernel.outputs[i].type),
                                 " ".join(op.name.removeprefix("nova.") for op in kernel.ops)[:120]))
        elif "bucket" in step:
            raise SystemExit("a data-parallel step: kernel_check runs one device's steps")
        else:
            outs = _bind(run["sites"][step["site"]], ins)
        env.update(zip(step["out"], outs))
    return rows, unchecked


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="the tiny model at 4 x 32 tokens (a CPU check)")
    p.add_argument("--dtype", choices=sorted(gpt2.DTYPES), default="bfloat16")
    p.add_argument("--attention", choices=gpt2.ATTENTIONS, default="xla")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--no-excess-precision", action="store_true")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--tol", type=float, default=0.05, help="relative L2 difference that fails a kernel")
    args = p.parse_args(argv)
    if args.small:
        args.batch, args.seq = 4, 32
        config = gpt2.GPTConfig.tiny(dtype=gpt2.DTYPES[args.dtype], attention=args.attention)
    else:
        config = gpt2.GPTConfig.gpt2_124m(dtype=gpt2.DTYPES[args.dtype], attention=args.attention, n_layer=args.layers)
    model = gpt2.GPT(config)
    params = gpt2.init_params(model, jax.random.key(0), args.seq)
    params = jax.tree.map(lambda w: w + 0.02 * jax.random.normal(jax.random.key(1), w.shape, w.dtype), params)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (args.batch, args.seq)).astype(np.int32)
    targets = rng.integers(0, config.vocab_size, (args.batch, args.seq)).astype(np.int32)

    def grad_step(p, x, y):
        return jax.value_and_grad(lambda q: gpt2.loss_fn(model, q, x, y))(p)

    run, plan = captured_plan(grad_step, (params, tokens, targets),
                                     excess_precision=False if args.no_excess_precision else None)
    flat = jax.tree.leaves((params, tokens, targets))
    rows, unchecked = check(run, plan, flat)
    rows.sort(key=lambda r: -r[0])
    print(f"{len(plan.kernels)} kernels, {len(rows)} outputs checked; unchecked (no XLA evaluation): "
          f"{len(unchecked)} {sorted(set(unchecked))[:6]}")
    for diff, name, i, t, ops in rows[:args.top]:
        print(f"  {diff:9.2e}  {name:24s} out{i} {t:34s} {ops}")
    bad = [r for r in rows if not r[0] <= args.tol]
    print(f"{len(bad)} outputs above --tol {args.tol:g}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
