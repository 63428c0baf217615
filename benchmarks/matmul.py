"""Contractions: jnova's generated kernel against XLA, TFLOP/s on the current GPU.

    JAX_PLATFORMS=cuda python benchmarks/matmul.py                 # the nine shapes, f32 (TF32) and bf16
    JAX_PLATFORMS=cuda python benchmarks/matmul.py --variants      # + other tile configs on GPT-2 shapes
    JAX_PLATFORMS=cuda python benchmarks/matmul.py --dtypes bfloat16 --shapes 16384x3072x768
    JAX_PLATFORMS=cuda python benchmarks/matmul.py --precision highest   # f32-accurate, tag "highest"

C = A @ B with A [M, K], B [K, N] (row-major; `--b-layout col`: B given as [N, K], K-major, and XLA
computes A @ B.T from it), f32 output. XLA runs `jnp.matmul` at matching
precision: f32 under `jax.default_matmul_precision("tensorfloat32")`, bf16 with
`preferred_element_type=float32`; with `--precision highest` (f32 only, records tagged "highest") XLA
runs `precision=HIGHEST` (`jax.default_matmul_precision("float32")`) and jnova its f32-accurate
split-TF32 kernels (codegen/gpu/split_tf32.py). jnova runs the kernel `build_matmul` generates from the Analytic
Configurator's TileConfig, launched through `nova_kernel_p` (jaxlib's PTX kernel call) under jit.
Both are timed the same way: back-to-back calls (dispatch overlaps the GPU work), the median per-call
time over repeated timed batches, after warm-up, on random inputs. Every jnova result is compared
with XLA's (relative error in norm) before it is timed.

When OUT is set, one JSON record per measurement goes to $OUT/matmul.jsonl (DESIGN.md, "Testing"),
tagged with JNOVA_SHA (the git commit; the GPU machine has no .git).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from jnova.codegen.gpu import matmul_wgmma
from jnova.codegen.gpu.matmul import build_matmul, matmul_refusal, persistent_blocks
from jnova.dialect.types import TensorType
from jnova.passes.configure.problem import ContractionProblem
from jnova.passes.configure.tile_config import TileConfig
from jnova.passes.configure.tile_schedule import choose_tiles
from jnova.primitives.gpu_lowering import GpuKernelHandle, register_gpu_lowering
from jnova.primitives.nova_kernel import nova_kernel_p
from jnova.runtime.target import get_target

SHAPES = [(512, 512, 512), (1024, 1024, 1024), (5120, 5120, 5120), (16384, 3072, 768), (16384, 768, 3072),
          (16384, 50304, 768), (16384, 768, 50304), (4096, 768, 50304), (4096, 768, 3072)]
GPT2 = [(16384, 3072, 768), (16384, 768, 3072), (16384, 50304, 768), (16384, 768, 50304), (4096, 768, 50304),
        (4096, 768, 3072)]
VARIANTS = {  # other schedules than the configurator's, to see where its choice stands
    "float32": ["block=128x128x32 warps=2x4 stages=3 mma=mma_sync_tf32_16x8x8 swizzle=128",  # before sm_90
                "block=128x256x32 warps=8x1 stages=4 mma=wgmma_tf32_m64nNk8 swizzle=128",
                "block=256x128x32 warps=8x1 stages=4 mma=wgmma_tf32_m64nNk8 swizzle=128",
                "block=128x128x32 warps=8x1 stages=4 mma=wgmma_tf32_m64nNk8 swizzle=128",
                "block=128x128x32 warps=4x1 stages=4 mma=wgmma_tf32_m64nNk8 swizzle=128",
                # warp-specialized (TF32 operands both K-major only: --b-layout col)
                "block=128x128x32 warps=4x1 stages=4 mma=wgmma_tf32_m64nNk8 swizzle=128 pingpong",
                "block=128x128x32 warps=4x1 stages=5 mma=wgmma_tf32_m64nNk8 swizzle=128 pingpong",
                "block=128x192x32 warps=4x1 stages=4 mma=wgmma_tf32_m64nNk8 swizzle=128 pingpong",
                "block=192x128x32 warps=4x1 stages=4 mma=wgmma_tf32_m64nNk8 swizzle=128 pingpong"],
    "bfloat16": ["block=128x128x64 warps=4x1 stages=3 mma=wgmma_bf16_m64nNk16 swizzle=128",
                 "block=128x128x64 warps=8x1 stages=4 mma=wgmma_bf16_m64nNk16 swizzle=128",
                 "block=128x128x64 warps=8x1 stages=3 mma=wgmma_bf16_m64nNk16 swizzle=128",
                 "block=128x128x64 warps=4x1 stages=4 mma=wgmma_bf16_m64nNk16 swizzle=128",
                 "block=128x256x64 warps=8x1 stages=4 mma=wgmma_bf16_m64nNk16 swizzle=128",
                 # warp-specialized, fed by TMA: the config is one consumer's tile (matmul_tma.py)
                 "block=128x128x64 warps=4x1 stages=4 mma=wgmma_bf16_m64nNk16 swizzle=128 pingpong",
                 "block=128x128x64 warps=4x1 stages=5 mma=wgmma_bf16_m64nNk16 swizzle=128 pingpong",
                 "block=128x192x64 warps=4x1 stages=4 mma=wgmma_bf16_m64nNk16 swizzle=128 pingpong",
                 "block=128x192x64 warps=4x1 stages=5 mma=wgmma_bf16_m64nNk16 swizzle=128 pingpong",
                 "block=192x128x64 warps=4x1 stages=5 mma=wgmma_bf16_m64nNk16 swizzle=128 pingpong"],
}
TOLERANCE = {"float32": 2e-3, "bfloat16": 1e-3}  # vs XLA: both TF32 / both f32-accumulated bf16
HIGHEST_TOLERANCE = 1e-5  # vs XLA's precision=HIGHEST: both f32-accurate


def timed(fn, args, reps: int = 7, batch_seconds: float = 0.03) -> float:
    """Median seconds per call over `reps` batches of back-to-back calls."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - start
    calls = max(1, min(100, int(batch_seconds / max(once, 1e-6))))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def jnova_call(kernel, problem: ContractionProblem):
    handle = GpuKernelHandle(kernel.launch(), [TensorType((problem.m, problem.n), "float32")])
    return jax.jit(lambda a, b: nova_kernel_p.bind(a, b, kernel=handle)[0])


def xla_call(dtype: str, b_layout: str = "row", precision: str = "default"):
    """XLA's C = A @ B; with `b_layout` "col" the B it is given is [N, K]; f32 in TF32, or with
    `precision` "highest" f32-accurate (precision=HIGHEST)."""
    if b_layout == "col":
        call = jax.jit(lambda a, b: jnp.matmul(a, b.T, preferred_element_type=jnp.float32))
    else:
        call = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    if dtype != "float32":
        return call

    def tf32(a, b):
        with jax.default_matmul_precision("float32" if precision == "highest" else "tensorfloat32"):
            return call(a, b)
    return tf32


def relative_error(x, y) -> float:
    return float(jnp.linalg.norm((x - y).astype(jnp.float32)) / jnp.linalg.norm(y.astype(jnp.float32)))


def build_all(jobs, target):
    """GpuKernel (or the exception) per job (problem, config, persistent), compiled in parallel processes."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(16, os.cpu_count() or 1), mp_context=context) as pool:
        futures = [pool.submit(build_matmul, problem, config, target, None, None, persistent)
                   for problem, config, persistent in jobs]
        return [f.exception() or f.result() for f in futures]


def diagnose_wgmma(target, records_note: list) -> None:
    """If a bf16 kernel with an MN-major operand is wrong, try the other reading of the MN-major
    descriptor's offsets (LBO and SBO exchanged) and say whether that fixes it."""
    key = jax.random.PRNGKey(7)
    for a_layout, b_layout in (("row", "row"), ("col", "col"), ("row", "col"), ("col", "row")):
        problem = ContractionProblem(512, 256, 192, operand_dtype="bfloat16", a_layout=a_layout, b_layout=b_layout)
        a = jax.random.normal(key, (512, 192) if a_layout == "row" else (192, 512), jnp.bfloat16)
        b = jax.random.normal(key, (192, 256) if b_layout == "row" else (256, 192), jnp.bfloat16)
        want = jnp.matmul(a if a_layout == "row" else a.T, b if b_layout == "row" else b.T,
                          preferred_element_type=jnp.float32)
        config = TileConfig.parse("block=128x128x64 warps=4x1 stages=3 mma=wgmma_bf16_m64nNk16 swizzle=128")
        for swap in (False, True):
            original = matmul_wgmma.mn_major_offsets
            if swap:
                matmul_wgmma.mn_major_offsets = lambda tile, built=original: tuple(reversed(built(tile)))
            try:
                kernel = build_matmul(problem, config, target, name=f"diag_{a_layout}{b_layout}_{int(swap)}")
            finally:
                matmul_wgmma.mn_major_offsets = original
            err = relative_error(jnova_call(kernel, problem)(a, b), want)
            line = f"diagnose wgmma a={a_layout} b={b_layout} lbo/sbo {'swapped' if swap else 'as built'}: rel err {err:.2e}"
            print(line)
            records_note.append(line)


def no_store(ctx, epilogue, fragments) -> None:
    """An epilogue that sums the accumulators and stores the sum only if it is an impossible value:
    the main loop runs in full, C is not written."""
    em = ctx.em
    total = fragments[0].values[0]
    for f in fragments:
        for v in f.values:
            total = em.op(f"arith.addf {total}, {v} : f32")
    never = em.op(f"arith.cmpf oeq, {total}, {em.op('arith.constant 1.25e+38 : f32')} : f32")
    with em.region(f"scf.if {never} {{"):
        em.line(f"memref.store {total}, {ctx.memrefs['c'][0]}[{em.index(0)}] : {ctx.memrefs['c'][1]}")


def mainloop_only(target, shapes, dtypes, notes: list, variants: bool = False) -> None:
    """Time the configurator's kernel (and with `variants` the VARIANTS configs, a block per tile)
    with its stores removed (the accumulators are summed and stored only if the sum is an impossible
    value), to see what the epilogue costs."""
    from jnova.codegen.gpu import matmul as matmul_module

    original = matmul_module.store_fragments
    for dtype in dtypes:
        for m, n, k in shapes:
            problem = ContractionProblem(m, n, k, operand_dtype=dtype)
            configs = [choose_tiles(problem, target)]
            configs += [TileConfig.parse(v) for v in VARIANTS[dtype] if "pingpong" not in v] if variants else []
            for config in configs:
                matmul_module.store_fragments = no_store
                try:
                    kernel = build_matmul(problem, config, target, name=f"mainloop_only_{dtype}_{m}x{n}x{k}",
                                          persistent=False)
                finally:
                    matmul_module.store_fragments = original
                a = jnp.ones((m, k), jnp.dtype(dtype))
                b = jnp.ones((k, n), jnp.dtype(dtype))
                t = timed(jnova_call(kernel, problem), (a, b))
                line = (f"mainloop only {dtype} {m}x{n}x{k} {config}: {problem.flops / t / 1e12:.1f} TFLOP/s "
                        f"({t * 1e3:.3f} ms)")
                print(line)
                notes.append(line)


def accuracy(target, base: dict, m: int = 1024, n: int = 1024, k: int = 1024,
             precision: str = "default") -> list[dict]:
    """Relative error in norm against float64 NumPy of jnova's kernel and of XLA, per dtype, on one
    shape: how each rounds its operands (TF32 rounding or truncation, or the split) shows here."""
    import numpy as np

    records = []
    for dtype in ("float32",) if precision == "highest" else ("float32", "bfloat16"):
        problem = ContractionProblem(m, n, k, operand_dtype=dtype, precision=precision)
        ka, kb = jax.random.split(jax.random.PRNGKey(11))
        a = jax.random.normal(ka, (m, k), jnp.dtype(dtype))
        b = jax.random.normal(kb, (k, n), jnp.dtype(dtype))
        want = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
        kernel = build_matmul(problem, choose_tiles(problem, target), target)
        for impl, fn in (("jnova", jnova_call(kernel, problem)), ("xla", xla_call(dtype, precision=precision))):
            got = np.asarray(fn(a, b), np.float64)
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            print(f"accuracy {dtype} {m}x{n}x{k} {impl}: relative error vs float64 {err:.2e}")
            records.append({**base, "case": f"{m}x{n}x{k}", "dtype": dtype, "impl": impl,
                            "metric": "rel_err_vs_f64", "value": err})
    return records


def compiled_matmuls(shapes, dtypes, base: dict) -> list[dict]:
    """`jnova.compile(a @ b)`, what a user runs: the configurator's kernel plus whatever the plan adds
    before it (a TF32 operand transposed into a K-major copy, `passes/transpose_operands.py`), timed
    with its launches against XLA's matmul."""
    import jnova

    records = []
    for dtype in dtypes:
        for m, n, k in shapes:
            case = f"{m}x{n}x{k}"
            ka, kb = jax.random.split(jax.random.PRNGKey(m + n + k))
            a = jax.random.normal(ka, (m, k), jnp.dtype(dtype))
            b = jax.random.normal(kb, (k, n), jnp.dtype(dtype))
            step = jnova.compile(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
            err = relative_error(step(a, b), xla_call(dtype)(a, b))
            launches = [line.split(" grid=")[0] for line in step.lower(a, b).as_text("launches").splitlines()]
            if not err < TOLERANCE[dtype]:
                print(f"compiled {case} {dtype}: WRONG (rel err {err:.2e} vs XLA)")
                continue
            t, t_xla = timed(step, (a, b)), timed(xla_call(dtype), (a, b))
            flops = 2 * m * n * k
            print(f"compiled {case:>18} {dtype:>9} jnova {flops / t / 1e12:7.1f} xla {flops / t_xla / 1e12:7.1f} "
                  f"ratio {t_xla / t:5.2f}  {' | '.join(launches)}")
            records.append({**base, "case": case, "dtype": dtype, "impl": "jnova-compiled", "metric": "tflops",
                            "value": round(flops / t / 1e12, 2), "config": " | ".join(launches)})
            records.append({**base, "case": case, "dtype": dtype, "impl": "xla", "label": "compiled",
                            "metric": "tflops", "value": round(flops / t_xla / 1e12, 2)})
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--shapes", default=",".join(f"{m}x{n}x{k}" for m, n, k in SHAPES))
    parser.add_argument("--variants", action="store_true", help="also time other tile configs on GPT-2 shapes")
    parser.add_argument("--diagnose", action="store_true", help="check the wgmma descriptor variants first")
    parser.add_argument("--mainloop-only", action="store_true",
                        help="only time kernels with their stores removed (the --shapes; with --variants also "
                             "the other configs)")
    parser.add_argument("--b-layout", choices=("row", "col"), default="row",
                        help="B as [K, N] (row) or [N, K] (col: K-major, what TF32 wgmma reads)")
    parser.add_argument("--precision", choices=("default", "highest"), default="default",
                        help="highest: f32-accurate kernels against XLA's precision=HIGHEST (float32 only; "
                             "records tagged 'highest')")
    parser.add_argument("--compiled", action="store_true",
                        help="only time jnova.compile(a @ b) (kernel plus operand transposes) against XLA")
    args = parser.parse_args(argv)
    if args.precision == "highest":
        if args.compiled or args.mainloop_only or args.variants:
            parser.error("--precision highest times the configurator's kernels only (no --compiled, "
                         "--mainloop-only or --variants)")
        args.dtypes = "float32"
    register_gpu_lowering()
    try:
        target = get_target(None)
    except RuntimeError as e:
        print(f"(device query failed: {e}; using the h200 preset)")
        target = get_target("h200")
    device = jax.devices()[0].device_kind
    notes: list[str] = []
    if args.diagnose:
        diagnose_wgmma(target, notes)
        mainloop_only(target, [(16384, 3072, 768), (16384, 768, 3072)], args.dtypes.split(","), notes)

    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.mainloop_only:
        mainloop_only(target, shapes, args.dtypes.split(","), notes, args.variants)
        return 0
    if args.compiled:
        base = {"bench": "matmul", "device": device, "date": datetime.date.today().isoformat(),
                "jax": jax.__version__, "jnova": os.environ.get("JNOVA_SHA", "unknown")}
        append_records("matmul.jsonl", compiled_matmuls(shapes, args.dtypes.split(","), base))
        return 0
    jobs = []  # (problem, config, chosen?, persistent: None = as build_matmul decides, False = never)
    for dtype in args.dtypes.split(","):
        for m, n, k in shapes:
            problem = ContractionProblem(m, n, k, operand_dtype=dtype, b_layout=args.b_layout,
                                         precision=args.precision)
            configs = [(choose_tiles(problem, target), True)]
            if args.variants and (m, n, k) in GPT2:
                variants = [TileConfig.parse(v) for v in VARIANTS[dtype]]
                configs += [(c, False) for c in variants if matmul_refusal(problem, c, target) is None]
            for config, chosen in configs:
                jobs.append((problem, config, chosen, None))
                if args.variants and persistent_blocks(problem, config, target):  # the same, a block per tile
                    jobs.append((problem, config, False, False))
    start = time.time()
    kernels = build_all([(p, c, persistent) for p, c, _, persistent in jobs], target)
    print(f"compiled {len(kernels)} kernels in {time.time() - start:.1f} s")

    records, rows = [], []
    base = {"bench": "matmul", "device": device, "date": datetime.date.today().isoformat(),
            "jax": jax.__version__, "jnova": os.environ.get("JNOVA_SHA", "unknown")}
    if args.b_layout == "col":
        base["b_layout"] = "col"
    if args.precision == "highest":
        base["tag"] = "highest"
    tolerance = {"float32": HIGHEST_TOLERANCE} if args.precision == "highest" else TOLERANCE
    xla_done = {}
    for (problem, config, chosen, _), kernel in zip(jobs, kernels):
        case, dtype = f"{problem.m}x{problem.n}x{problem.k}", problem.operand_dtype
        key = jax.random.PRNGKey(problem.m + problem.n + problem.k)
        ka, kb = jax.random.split(key)
        a = jax.random.normal(ka, (problem.m, problem.k), jnp.dtype(dtype))
        b_shape = (problem.k, problem.n) if problem.b_layout == "row" else (problem.n, problem.k)
        b = jax.random.normal(kb, b_shape, jnp.dtype(dtype))
        xla = xla_call(dtype, problem.b_layout, problem.precision)
        if (case, dtype) not in xla_done:
            xla_done[(case, dtype)] = timed(xla, (a, b))
            records.append({**base, "case": case, "dtype": dtype, "impl": "xla", "metric": "tflops",
                            "value": round(problem.flops / xla_done[(case, dtype)] / 1e12, 2)})
        t_xla = xla_done[(case, dtype)]
        impl = "jnova" if chosen else "jnova-variant"
        if isinstance(kernel, BaseException):
            rows.append((case, dtype, impl, None, t_xla, None, f"{config}: BUILD FAILED {type(kernel).__name__}: {kernel}"))
            continue
        call = jnova_call(kernel, problem)
        err = relative_error(call(a, b), xla(a, b))
        if not err < tolerance[dtype]:
            rows.append((case, dtype, impl, None, t_xla, err, f"{config}: WRONG (rel err {err:.2e} vs XLA)"))
            continue
        t = timed(call, (a, b))
        schedule = kernel.schedule.split(" b=", 1)[1].split(" ", 1)[1]  # the config and the store form
        records.append({**base, "case": case, "dtype": dtype, "impl": impl, "metric": "tflops",
                        "value": round(problem.flops / t / 1e12, 2), "config": schedule})
        rows.append((case, dtype, impl, t, t_xla, err, schedule))
        del a, b

    print(f"\n{device}, jax {jax.__version__}, jnova {base['jnova']}, B as {'[N, K]' if args.b_layout == 'col' else '[K, N]'}")
    print(f"{'case':>18} {'dtype':>9} {'impl':>13} {'jnova TF/s':>10} {'xla TF/s':>9} {'ratio':>6} {'rel err':>8}  config")
    for case, dtype, impl, t, t_xla, err, note in rows:
        m, n, k = (int(x) for x in case.split("x"))
        flops = 2 * m * n * k
        ours = f"{flops / t / 1e12:10.1f}" if t else f"{'-':>10}"
        ratio = f"{t_xla / t:6.2f}" if t else f"{'-':>6}"
        print(f"{case:>18} {dtype:>9} {impl:>13} {ours} {flops / t_xla / 1e12:9.1f} {ratio} "
              f"{err if err is None else format(err, '.1e'):>8}  {note}")
    records += accuracy(target, base, precision=args.precision)
    append_records("matmul.jsonl", records)
    return 0


def append_records(filename: str, records: list[dict]) -> None:
    """One JSON line per record, appended to $OUT/<filename> when OUT is set."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, filename), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    sys.exit(main())
