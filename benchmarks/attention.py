"""Causal attention: jnova's fused kernels against XLA's default `jax.nn.dot_product_attention` and cuDNN.

    JAX_PLATFORMS=cuda python benchmarks/attention.py --check --bench
    JAX_PLATFORMS=cuda python benchmarks/attention.py --bench --shapes 8x12x1024x64 --dtypes bfloat16
    JAX_PLATFORMS=cuda python benchmarks/attention.py --bench --dtypes bfloat16 \
        --variants "chosen;wgmma;mma.sync;fwd=128x64x8,bwd=64x64x4"

--check compares jnova's o and lse with a float32 reference (HIGHEST precision) first and drops a
case whose error is too large; --bench times, per shape (B, H, T, D) and dtype:
  fwd       the forward alone: jnova's kernel (launched through `nova_kernel_p`, jaxlib's PTX kernel
            call, under jit), XLA (`implementation=None`), cuDNN (`implementation="cudnn"`, bf16 only);
  fwd+bwd   forward and backward (`jax.vjp` of the attention, applied to a random cotangent): XLA and
            cuDNN; jnova: its forward kernel, then the dQ kernel (which writes delta) and the dK/dV kernel
            (`codegen/gpu/attention_backward.py`), three launches under one jit.
--variants times jnova's kernels under other tile configurations too (the measurements behind the
configurator's choices, `passes/configure/attention_tiles.py`): `chosen` (the configurator's), `mma.sync`
(its choice on the same GPU without wgmma), `wgmma` (its choice of wgmma tiles), or
`fwd=BMxBNxWARPS,bwd=BMxBNxWARPS` (wgmma tiles); each
variant's dQ and dK/dV kernels are also timed alone (labels dq, dkdv). Records carry the schedule.
Times are medians of back-to-back batches after warm-up (benchmarks/matmul.py's `timed`). TFLOP/s
counts causal FLOPs: forward 4 B H T^2 D / 2, backward 2.5 times that. Inputs are [B, T, H, D] (bthd),
what `dot_product_attention` takes. XLA's f32 runs at its default matmul precision.

When OUT is set, one JSON record per measurement goes to $OUT/attention.jsonl (DESIGN.md's format:
bench "attention", metric "ms" and "tflops", impl jnova / xla / cudnn, label fwd or fwd+bwd), tagged
with JNOVA_SHA.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import multiprocessing
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from matmul import timed  # noqa: E402 (benchmarks/ is on sys.path when run as a script)
from jnova.codegen.gpu.attention import build_attention_forward
from jnova.codegen.gpu.attention_backward import build_attention_dkdv, build_attention_dq
from jnova.dialect.types import TensorType
from jnova.passes.configure.attention_tiles import AttentionConfig, AttentionProblem, choose_attention_tiles
from jnova.primitives.gpu_lowering import GpuKernelHandle, register_gpu_lowering
from jnova.primitives.nova_kernel import nova_kernel_p
from jnova.runtime.target import get_target

SHAPES = [(8, 12, 1024, 64), (8, 12, 512, 64), (4, 16, 2048, 128), (8, 32, 1024, 128)]
TOLERANCE = {"bfloat16": 2e-2, "float32": 3e-3}


def problem(shape, dtype: str) -> AttentionProblem:
    b, h, t, d = shape
    return AttentionProblem(b, h, h, t, t, d, dtype, causal=True, layout="bthd")


def configs(variant: str, p: AttentionProblem, target) -> tuple[AttentionConfig, AttentionConfig]:
    """(forward, backward) configs of a --variants entry."""
    if variant in ("chosen", "mma.sync", "wgmma"):
        wgmma = {"chosen": None, "mma.sync": False, "wgmma": True}[variant]
        if variant == "mma.sync":
            target = dataclasses.replace(target, features=target.features - {"wgmma"})
        return (choose_attention_tiles(p, target, wgmma=wgmma),
                choose_attention_tiles(p, target, backward=True, wgmma=wgmma))
    tiles = dict(part.split("=") for part in variant.split(","))
    out = []
    for kind in ("fwd", "bwd"):
        bm, bn, warps = (int(x) for x in tiles[kind].split("x"))
        out.append(AttentionConfig(bm, bn, warps, 2, "wgmma"))
    return out[0], out[1]


def _build(p: AttentionProblem, target, variant: str = "chosen"):
    forward, backward = configs(variant, p, target)
    return (build_attention_forward(p, forward, target),
            build_attention_dq(p, backward, target), build_attention_dkdv(p, backward, target))


def jnova_forward(kernel, p: AttentionProblem):
    o_type = TensorType((p.batch, p.q_len, p.q_heads, p.head_dim), p.dtype)
    lse_type = TensorType((p.batch, p.q_heads, p.q_len), "float32")
    handle = GpuKernelHandle(kernel.launch(), [o_type, lse_type])
    return jax.jit(lambda q, k, v: tuple(nova_kernel_p.bind(q, k, v, kernel=handle)))


def handles(kernels, p: AttentionProblem) -> tuple[GpuKernelHandle, GpuKernelHandle, GpuKernelHandle]:
    """The forward, dQ and dK/dV kernels as launch handles with their results' types ([B, T, H, D])."""
    forward, dq_kernel, dkdv_kernel = kernels
    q_type = TensorType((p.batch, p.q_len, p.q_heads, p.head_dim), p.dtype)
    kv_type = TensorType((p.batch, p.kv_len, p.kv_heads, p.head_dim), p.dtype)
    rows = TensorType((p.batch, p.q_heads, p.q_len), "float32")
    return (GpuKernelHandle(forward.launch(), [q_type, rows]), GpuKernelHandle(dq_kernel.launch(), [q_type, rows]),
            GpuKernelHandle(dkdv_kernel.launch(), [kv_type, kv_type]))


def jnova_forward_and_backward(kernels, p: AttentionProblem):
    fwd, dq, dkdv = handles(kernels, p)

    def step(q, k, v, do):
        o, lse = nova_kernel_p.bind(q, k, v, kernel=fwd)
        dq_, delta = nova_kernel_p.bind(q, k, v, o, lse, do, kernel=dq)
        dk, dv = nova_kernel_p.bind(q, k, v, lse, delta, do, kernel=dkdv)
        return o, dq_, dk, dv
    return jax.jit(step)


def jnova_backward_halves(kernels, p: AttentionProblem):
    """The dQ kernel alone and the dK/dV kernel alone, each a jitted function of (q, k, v, o, lse, delta, do)."""
    _, dq, dkdv = handles(kernels, p)
    return {"dq": jax.jit(lambda q, k, v, o, lse, delta, do: nova_kernel_p.bind(q, k, v, o, lse, do, kernel=dq)),
            "dkdv": jax.jit(lambda q, k, v, o, lse, delta, do: nova_kernel_p.bind(q, k, v, lse, delta, do,
                                                                                kernel=dkdv))}


def xla_attention(implementation):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def forward_and_backward(attention):
    def step(q, k, v, do):
        o, pullback = jax.vjp(attention, q, k, v)
        return o, *pullback(do)
    return jax.jit(step)


def reference(q, k, v, scale: float):
    q, k, v = (jnp.swapaxes(x.astype(jnp.float32), 1, 2) for x in (q, k, v))
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest") * scale
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    o = jnp.einsum("bhqk,bhkd->bhqd", jnp.exp(s - lse[..., None]), v, precision="highest")
    return jnp.swapaxes(o, 1, 2), lse


def _relative(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(np.nan_to_num(x, nan=1e30) - y) / np.linalg.norm(y))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    parser.add_argument("--check", action="store_true", help="compare jnova with a float32 reference first")
    parser.add_argument("--bench", action="store_true", help="time jnova, XLA and cuDNN")
    parser.add_argument("--variants", default="chosen",
                        help="jnova tile configurations, ';'-separated: chosen, wgmma, mma.sync, fwd=BMxBNxW,bwd=BMxBNxW")
    args = parser.parse_args(argv)
    if not (args.check or args.bench):
        parser.error("nothing to do: pass --check and/or --bench")
    register_gpu_lowering()
    target = get_target(None)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    dtypes = args.dtypes.split(",")
    variants = args.variants.split(";")
    cases = [(shape, dtype, variant) for dtype in dtypes for shape in shapes
             for variant in (variants if dtype == "bfloat16" else ["chosen"])]  # f32 runs mma.sync only
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(16, os.cpu_count() or 1), mp_context=context) as pool:
        futures = [pool.submit(_build, problem(shape, dtype), target, variant) for shape, dtype, variant in cases]
        kernels = [f.exception() or f.result() for f in futures]

    base = {"bench": "attention", "device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(),
            "jax": jax.__version__, "jnova": os.environ.get("JNOVA_SHA", "unknown")}
    records, failed, baselines_done = [], 0, set()
    for (shape, dtype, variant), kernel in zip(cases, kernels):
        p = problem(shape, dtype)
        case = f"{'x'.join(map(str, shape))}-causal"
        key = jax.random.split(jax.random.PRNGKey(sum(shape)), 4)
        b, h, t, d = shape
        q, k, v, do = (jax.random.normal(kk, (b, t, h, d), jnp.dtype(dtype)) for kk in key)
        if isinstance(kernel, BaseException):
            print(f"{case} {dtype} [{variant}]: jnova kernel failed to build: {kernel}")
            failed += 1
            jnova = None
        else:
            jnova, jnova_both = jnova_forward(kernel[0], p), jnova_forward_and_backward(kernel, p)
            print(f"{case} {dtype} [{variant}]: {' | '.join(k.schedule for k in kernel)}")
        tags = {"case": case, "dtype": dtype}
        jnova_tags = {**tags, "impl": "jnova", "variant": variant,
                      "schedule": " | ".join(k.schedule for k in kernel) if jnova is not None else None}
        if jnova is not None and args.check:
            o, lse = jnova(q, k, v)
            want_o, want_lse = reference(q, k, v, p.softmax_scale)
            o_err, lse_err = _relative(o, want_o), float(np.abs(np.asarray(lse) - np.asarray(want_lse)).max())
            _, pullback = jax.vjp(lambda q, k, v: reference(q, k, v, p.softmax_scale)[0],
                                  *(x.astype(jnp.float32) for x in (q, k, v)))
            grads = jnova_both(q, k, v, do)[1:]
            errors = [_relative(g, w) for g, w in zip(grads, pullback(do.astype(jnp.float32)))]
            ok = o_err < TOLERANCE[dtype] and lse_err < TOLERANCE[dtype] and max(errors) < TOLERANCE[dtype]
            print(f"  check: relative error of o {o_err:.2e}, max |lse error| {lse_err:.2e}, of dq dk dv "
                  f"{' '.join(f'{e:.2e}' for e in errors)}: {'ok' if ok else 'WRONG'}")
            for label, value in (("fwd", o_err), ("dq", errors[0]), ("dk", errors[1]), ("dv", errors[2])):
                records.append({**base, **jnova_tags, "metric": "rel_err_vs_f32", "label": label, "value": value})
            if not ok:
                failed += 1
                jnova = None
        if not args.bench:
            continue
        runs = []
        if jnova is not None:
            o, lse = jnova(q, k, v)
            delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32))
            halves = jnova_backward_halves(kernel, p)
            runs += [("fwd", jnova_tags, jnova, (q, k, v)), ("fwd+bwd", jnova_tags, jnova_both, (q, k, v, do))]
            runs += [(name, jnova_tags, fn, (q, k, v, o, lse, delta, do)) for name, fn in halves.items()]
        if (shape, dtype) not in baselines_done:  # XLA and cuDNN once per case
            baselines_done.add((shape, dtype))
            impls = {"xla": xla_attention(None)}
            if dtype == "bfloat16":
                impls["cudnn"] = xla_attention("cudnn")
            runs += [("fwd", {**tags, "impl": name}, jax.jit(fn), (q, k, v)) for name, fn in impls.items()]
            runs += [("fwd+bwd", {**tags, "impl": name}, forward_and_backward(fn), (q, k, v, do))
                     for name, fn in impls.items()]
        for label, run_tags, fn, xs in runs:
            name = run_tags["impl"] + (f" [{variant}]" if run_tags["impl"] == "jnova" else "")
            try:
                seconds = timed(fn, xs)
            except Exception as e:  # noqa: BLE001 (a baseline missing on this machine is reported, not fatal)
                print(f"  {label:>7} {name}: failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
                continue
            flops = {"fwd": p.flops(), "fwd+bwd": p.flops() + p.flops(backward=True),
                     "dq": 0.6 * p.flops(backward=True), "dkdv": 0.8 * p.flops(backward=True)}[label]
            tflops = flops / seconds / 1e12  # dq and dk/dv: the matmuls each computes (3 and 4 of 5)
            print(f"  {label:>7} {name}: {seconds * 1e3:8.3f} ms {tflops:7.1f} TFLOP/s")
            for metric, value in (("ms", round(seconds * 1e3, 4)), ("tflops", round(tflops, 2))):
                records.append({**base, **run_tags, "metric": metric, "label": label, "value": value})
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention.jsonl"), "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
