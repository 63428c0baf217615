"""jnova's elementwise and reduction kernels against XLA's fusion of the same function, one process.

    python benchmarks/kernels.py        # on the GPU machine; records to $OUT/kernels.jsonl when OUT is set
"""
import datetime, json, os, sys, time

import jax, jax.numpy as jnp, numpy as np

for folder in ("tests", os.path.join("tests", "gpu")):  # test_gpu_kernels imports test_row_programs
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", folder))
from test_gpu_kernels import TARGET, GpuKernelHandle, compile_gpu_kernel, kernel_of, nova_kernel_p  # noqa: E402
from jnova.codegen.gpu.ptx import assemble_check  # noqa: E402

device = jax.devices()[0].device_kind
base = {"bench": "gpu_kernels", "device": device, "date": datetime.date.today().isoformat(),
        "jax": jax.__version__, "jnova": os.environ.get("JNOVA_SHA", "unknown")}
CASES = [  # name, function, argument shapes and dtype
    ("axpby_64M", lambda x, y: x * 0.9 + y * 0.1, [(64 * 2**20,)] * 2, jnp.float32),
    ("tanh_gate_bf16_8192x8192", lambda x, y: jnp.tanh(x) * y + x, [(8192, 8192)] * 2, jnp.bfloat16),
    ("bias_rows_4096x4096", lambda x, b: x * 2 + b, [(4096, 4096), (4096,)], jnp.float32),
    ("row_max_bf16_4096x50304", lambda x: jnp.max(x, axis=-1), [(4096, 50304)], jnp.bfloat16),
    ("row_sum_f32_65536x1024", lambda x: jnp.sum(x, axis=-1), [(65536, 1024)], jnp.float32),
    ("transpose_f32_8192x3072", lambda x: x.T, [(8192, 3072)], jnp.float32),
    ("transpose_f32_4x2048x768", lambda x: x.transpose(0, 2, 1), [(4, 2048, 768)], jnp.float32),
    ("axpby_64M_again", lambda x, y: x * 0.9 + y * 0.1, [(64 * 2**20,)] * 2, jnp.float32),  # the first case warmed
]


def seconds(f, args, iters=20):
    jax.block_until_ready(f(*args))
    start = time.perf_counter()
    for _ in range(iters):
        result = f(*args)
    jax.block_until_ready(result)
    return (time.perf_counter() - start) / iters


records = []
for name, fn, shapes, dtype in CASES:
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.standard_normal(s, np.float32), dtype) for s in shapes]
    try:
        kernel, inputs = kernel_of(fn, *args)
        launch = compile_gpu_kernel(kernel, TARGET)
        report = assemble_check(launch.ptx, TARGET.arch)
        handle = GpuKernelHandle(launch, [v.type for v in kernel.outputs])
        call = jax.jit(lambda *xs: nova_kernel_p.bind(*xs, kernel=handle)[0])
        want = jax.jit(fn)(*args)
        nbytes = sum(a.nbytes for a in args) + want.nbytes
        jnova_s, xla_s = seconds(call, inputs), seconds(jax.jit(fn), args)
        got = call(*inputs)
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    except Exception as e:  # a benchmark failure is reported, the others still run
        print(f"{name}: FAILED {type(e).__name__}: {e}"[:2000])
        records.append({**base, "case": name, "impl": "jnova", "metric": "error", "value": str(e)[:500]})
        continue
    print(f"{name}: {launch.schedule} | {report} | jnova {nbytes / jnova_s / 1e9:.0f} GB/s "
          f"({jnova_s * 1e3:.3f} ms), xla {nbytes / xla_s / 1e9:.0f} GB/s ({xla_s * 1e3:.3f} ms), max |err| {err:.3g}")
    common = {**base, "case": name, "dtype": jnp.dtype(dtype).name}
    records += [{**common, "impl": "jnova", "metric": "gbps", "value": nbytes / jnova_s / 1e9},
                {**common, "impl": "xla", "metric": "gbps", "value": nbytes / xla_s / 1e9},
                {**common, "impl": "jnova", "metric": "ms", "value": jnova_s * 1e3},
                {**common, "impl": "xla", "metric": "ms", "value": xla_s * 1e3},
                {**common, "impl": "jnova", "metric": "max_abs_err", "value": err}]
    if report is not None:
        records += [{**common, "impl": "jnova", "metric": "registers", "value": report.registers},
                    {**common, "impl": "jnova", "metric": "spill_bytes", "value": report.spills}]

if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "kernels.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
