"""Where a contraction kernel's time goes: every operand layout, with and without its stores.

    JAX_PLATFORMS=cuda python benchmarks/matmul_layouts.py --dtype float32 \
        --shapes 16384x3072x768 --configs "block=256x128x32 warps=8x1 stages=4 mma=wgmma_tf32_m64nNk8 swizzle=128"

For each shape, config and layout (A [M,K] "r" or [K,M] "c"; B [K,N] "r" or [N,K] "c"): jnova's
kernel, the same kernel with its stores of C removed (the main loop alone), and XLA's dot of the same
layouts (transposes inside the jit, which XLA folds into its GEMM). TFLOP/s from median per-call times
(benchmarks/matmul.py's timing). Records to $OUT/matmul_layouts.jsonl when OUT is set.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from matmul import append_records, jnova_call, no_store, relative_error, timed  # noqa: E402

from jnova.codegen.gpu import matmul as matmul_module  # noqa: E402
from jnova.codegen.gpu.matmul import build_matmul  # noqa: E402
from jnova.passes.configure.problem import ContractionProblem  # noqa: E402
from jnova.passes.configure.tile_config import TileConfig  # noqa: E402
from jnova.passes.configure.tile_schedule import choose_tiles  # noqa: E402
from jnova.primitives.gpu_lowering import register_gpu_lowering  # noqa: E402
from jnova.runtime.target import get_target  # noqa: E402

LAYOUT = {"r": "row", "c": "col"}


def build(problem, config, target, stores: bool, name: str):
    original = matmul_module.store_fragments
    if not stores:
        matmul_module.store_fragments = no_store
    try:
        return build_matmul(problem, config, target, name=name)
    finally:
        matmul_module.store_fragments = original


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shapes", default="16384x3072x768,16384x768x3072")
    parser.add_argument("--layouts", default="rr,rc,cr,cc")
    parser.add_argument("--configs", default="", help="';'-separated TileConfigs (default: the configurator's)")
    args = parser.parse_args(argv)
    register_gpu_lowering()
    target = get_target(None)
    device = jax.devices()[0].device_kind
    base = {"bench": "matmul_layouts", "device": device, "date": datetime.date.today().isoformat(),
            "jax": jax.__version__, "jnova": os.environ.get("JNOVA_SHA", "unknown"), "dtype": args.dtype}
    records = []
    for shape in args.shapes.split(","):
        m, n, k = (int(x) for x in shape.split("x"))
        for lay in args.layouts.split(","):
            problem = ContractionProblem(m, n, k, operand_dtype=args.dtype, a_layout=LAYOUT[lay[0]],
                                         b_layout=LAYOUT[lay[1]])
            ka, kb = jax.random.split(jax.random.PRNGKey(m + n + k))
            dt = jnp.dtype(args.dtype)
            a = jax.random.normal(ka, (m, k) if lay[0] == "r" else (k, m), dt)
            b = jax.random.normal(kb, (k, n) if lay[1] == "r" else (n, k), dt)

            def xla(a, b, lay=lay):
                x = a if lay[0] == "r" else a.T
                y = b if lay[1] == "r" else b.T
                return jnp.matmul(x, y, preferred_element_type=jnp.float32)

            with jax.default_matmul_precision("tensorfloat32" if args.dtype == "float32" else "bfloat16"):
                xla_fn = jax.jit(xla)
                want = xla_fn(a, b)
                t_xla = timed(xla_fn, (a, b))
            line = [f"{shape} {lay} xla {problem.flops / t_xla / 1e12:6.1f}"]
            records.append({**base, "case": f"{shape}:{lay}", "impl": "xla", "metric": "tflops",
                            "value": round(problem.flops / t_xla / 1e12, 2)})
            configs = [TileConfig.parse(c) for c in args.configs.split(";") if c] or [choose_tiles(problem, target)]
            for config in configs:
                for stores in (True, False):
                    kernel = build(problem, config, target, stores, f"diag_{lay}_{int(stores)}")
                    call = jnova_call(kernel, problem)
                    if stores:
                        err = relative_error(call(a, b), want)
                        if not err < 2e-3:
                            line.append(f"WRONG {err:.1e} {config}")
                            break
                    t = timed(call, (a, b))
                    impl = "jnova" if stores else "jnova-mainloop"
                    records.append({**base, "case": f"{shape}:{lay}", "impl": impl, "metric": "tflops",
                                    "value": round(problem.flops / t / 1e12, 2), "config": str(config)})
                    line.append(f"{impl} {problem.flops / t / 1e12:6.1f}")
                line.append(f"[{config}]")
            print(" | ".join(line), flush=True)
    append_records("matmul_layouts.jsonl", records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
