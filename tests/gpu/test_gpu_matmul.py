"""Contraction kernels on the GPU (`pytest -m gpu`): `build_matmul` against float64 NumPy on fresh
random inputs, for every main loop (TF32 mma.sync; TF32 and bf16 wgmma; the warp-specialized TMA
kernel in bf16 and TF32), every operand layout, awkward shapes (M=1000, N=77, K=33: masked edges,
unaligned rows), a batch, the bias/residual epilogue, and split-K partial products of a row-major A
read in place.

Launch: through `nova_kernel_p`'s CUDA lowering (jaxlib's PTX kernel call) inside `jax.jit`. The
output is poisoned: it aliases a donated NaN-filled operand, so an element the kernel does not
write fails the comparison. Kernels are compiled up front in parallel processes (MLIR is slow and
single-threaded)."""
import concurrent.futures
import multiprocessing
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.gpu_launch import TARGET  # skips this module without a GPU; registers the CUDA lowering

from jnova.codegen.gpu.matmul import GpuKernel, MatmulEpilogue, build_matmul
from jnova.dialect.types import TensorType
from jnova.passes.configure.problem import ContractionProblem
from jnova.passes.configure.tile_config import TileConfig
from jnova.passes.configure.tile_schedule import choose_tiles
from jnova.primitives.gpu_lowering import GpuKernelHandle
from jnova.primitives.nova_kernel import nova_kernel_p

pytestmark = pytest.mark.gpu
TOLERANCE = {"float32": 1e-3, "bfloat16": 1e-2}  # relative error in norm: TF32 rounding; bf16 inputs
# wgmma reads TF32 operands straight from the f32 bits in shared memory: the 13 low mantissa bits are
# dropped (truncation, unit roundoff 2**-10) where mma.sync's operands are rounded first (2**-11)
TF32_TRUNCATED = 2e-3
BOTH = MatmulEpilogue(bias="float32", residual="float32")
FLAX_DENSE = MatmulEpilogue(bias="bfloat16", steps=("to:bfloat16", "to:float32", "bias", "to:bfloat16"))
ROUNDED = MatmulEpilogue(steps=("to:bfloat16", "to:float32"))
RESIDUAL_TO_BF16 = MatmulEpilogue(residual="bfloat16", steps=("residual", "to:bfloat16"))
TO_BF16 = MatmulEpilogue(steps=("to:bfloat16",))


def _cases():
    cases = []
    for dtype in ("float32", "bfloat16"):
        for a_layout in ("row", "col"):
            for b_layout in ("row", "col"):
                cases.append((dtype, (1, 1000, 77, 33), a_layout, b_layout, None, None))
                cases.append((dtype, (1, 256, 384, 520), a_layout, b_layout, None, None))
        cases.append((dtype, (3, 200, 136, 264), "row", "row", BOTH, None))
        cases.append((dtype, (1, 1000, 77, 33), "row", "col", MatmulEpilogue(bias="bfloat16", residual="bfloat16"), None))
        cases.append((dtype, (1, 512, 512, 512), "row", "row", None, None))
        cases.append((dtype, (1, 4096, 768, 3072), "row", "row", BOTH, None))  # a GPT-2 shape, as chosen
        # conversions in the epilogue (Flax's bf16 Dense under excess precision), C stored in 16 bits
        cases.append((dtype, (1, 1000, 77, 33), "row", "row", FLAX_DENSE, None))
        cases.append((dtype, (3, 200, 136, 264), "row", "col", ROUNDED, None))
        cases.append((dtype, (1, 8192, 2304, 768), "row", "row", FLAX_DENSE, None))  # ping-pong, as chosen
        cases.append((dtype, (1, 4096, 768, 3072), "row", "col", RESIDUAL_TO_BF16, None))
    # other schedules than the configurator's: 2 stages, several warpgroups / warps, one k-tile
    cases.append(("bfloat16", (1, 384, 256, 192), "row", "row", None,
                  "block=128x256x64 warps=4x2 stages=2 mma=wgmma_bf16_m64nNk16 swizzle=128"))
    cases.append(("bfloat16", (1, 384, 256, 64), "col", "col", None,
                  "block=256x128x64 warps=8x1 stages=3 mma=wgmma_bf16_m64nNk16 swizzle=128"))
    cases.append(("float32", (1, 300, 200, 100), "row", "row", None,
                  "block=128x64x32 warps=2x2 stages=2 mma=mma_sync_tf32_16x8x8 swizzle=128"))
    cases.append(("float32", (1, 300, 200, 100), "col", "col", None,
                  "block=128x128x32 warps=4x2 stages=3 mma=mma_sync_tf32_16x8x8 swizzle=128"))
    # TF32 wgmma: MN-major operands transposed by 4-byte copies; 2 stages, 4 warpgroups over N, and
    # 12 warps (copy rounds that are not whole rows of groups, a last round with idle warps)
    cases.append(("float32", (2, 300, 200, 100), "col", "row", BOTH,
                  "block=256x128x32 warps=8x1 stages=3 mma=wgmma_tf32_m64nNk8 swizzle=128"))
    cases.append(("float32", (1, 384, 256, 40), "row", "row", None,
                  "block=128x256x32 warps=4x2 stages=2 mma=wgmma_tf32_m64nNk8 swizzle=128"))
    cases.append(("float32", (1, 200, 150, 70), "col", "row", None,
                  "block=64x96x32 warps=4x3 stages=3 mma=wgmma_tf32_m64nNk8 swizzle=128"))
    for a_layout in ("row", "col"):  # N-major B read 16 bytes at a time (64-column warp pieces)
        cases.append(("float32", (2, 300, 200, 100), a_layout, "row", BOTH,
                      "block=128x128x32 warps=2x2 stages=3 mma=mma_sync_tf32_16x8x8 swizzle=128"))
    # split-K partial products of a row-major A read in place ([M, S*K], slices K columns apart)
    for dtype in ("float32", "bfloat16"):
        for b_layout in ("row", "col"):
            cases.append((dtype, (3, 1000, 77, 520), "row", b_layout, None, None, True))
    cases.append(("float32", (4, 300, 200, 96), "row", "row", None,
                  "block=128x64x32 warps=2x2 stages=3 mma=mma_sync_tf32_16x8x8 swizzle=128", True))
    # persistent kernels (blocks walk tiles; staged stores left in flight while the next tile computes):
    # masked edge tiles, batches folded into the tile index, K not whole k-tiles, blocks with 1 or 2 tiles
    for warps in ("8x1", "4x1"):
        config = f"block=128x128x64 warps={warps} stages=4 mma=wgmma_bf16_m64nNk16 swizzle=128"
        cases.append(("bfloat16", (3, 1000, 1000, 72), "row", "row", BOTH, config, False, True))
        cases.append(("bfloat16", (2, 2000, 1040, 200), "col", "col", None, config, False, True))
    cases.append(("bfloat16", (1, 2048, 1024, 136), "row", "col", None,
                  "block=128x128x64 warps=8x1 stages=4 mma=wgmma_bf16_m64nNk16 swizzle=128", False, True))
    # the warp-specialized kernel fed by TMA (a producer thread, two consumers taking tiles in turn):
    # boxes past every edge (M, N, K; MN-major panels half outside), batches, all layouts, bias and
    # residual, blocks with one tile and with many
    pingpong = "block=128x128x64 warps=4x1 stages={} mma=wgmma_bf16_m64nNk16 swizzle=128 pingpong"
    cases.append(("bfloat16", (3, 1000, 1000, 72), "row", "row", BOTH, pingpong.format(6)))
    cases.append(("bfloat16", (2, 2000, 1040, 200), "col", "col", None, pingpong.format(4)))
    cases.append(("bfloat16", (2, 1000, 200, 72), "col", "row", BOTH, pingpong.format(5)))
    cases.append(("bfloat16", (1, 2048, 1024, 136), "row", "col", None, pingpong.format(5)))
    cases.append(("bfloat16", (1, 1000, 200, 40), "row", "row", None, pingpong.format(3)))
    cases.append(("bfloat16", (1, 4096, 768, 3072), "row", "row", BOTH, pingpong.format(6)))
    cases.append(("bfloat16", (1, 16384, 3072, 768), "row", "row", None, pingpong.format(6)))
    wide = "block={} warps=4x1 stages={} mma=wgmma_bf16_m64nNk16 swizzle=128 pingpong"  # 192 accumulators
    cases.append(("bfloat16", (3, 1000, 1000, 72), "row", "row", BOTH, wide.format("128x192x64", 5)))
    cases.append(("bfloat16", (2, 2000, 1040, 200), "col", "col", None, wide.format("192x128x64", 4)))
    cases.append(("bfloat16", (1, 16384, 3072, 768), "row", "row", None, wide.format("128x192x64", 5)))
    # C rounded to bf16 (or to bf16 and back) by the epilogue, through shared memory and TMA stores in
    # 64- (32-) column boxes: edges of M and N, batches, 2 k-tiles, all layouts, as chosen for GPT-2
    cases.append(("bfloat16", (3, 1000, 1000, 72), "row", "row", TO_BF16, wide.format("128x192x64", 4)))
    cases.append(("bfloat16", (2, 2000, 1040, 200), "col", "col", TO_BF16, pingpong.format(4)))
    cases.append(("bfloat16", (1, 1000, 200, 72), "col", "row", ROUNDED, pingpong.format(3)))
    cases.append(("bfloat16", (1, 1024, 1024, 128), "row", "row", TO_BF16, wide.format("128x192x64", 4)))
    cases.append(("bfloat16", (1, 8192, 3072, 768), "row", "col", TO_BF16, None))
    cases.append(("bfloat16", (1, 3072, 768, 8192), "col", "row", TO_BF16, None))
    # the same kernel with TF32 operands, both K-major (k-tiles of 32 elements: one 128-byte panel)
    tf32 = "block={} warps=4x1 stages={} mma=wgmma_tf32_m64nNk8 swizzle=128 pingpong"
    cases.append(("float32", (3, 1000, 1000, 72), "row", "col", BOTH, tf32.format("128x128x32", 5)))
    cases.append(("float32", (1, 1000, 200, 40), "row", "col", None, tf32.format("128x128x32", 3)))
    cases.append(("float32", (2, 2000, 1040, 200), "row", "col", None, tf32.format("128x192x32", 4)))
    cases.append(("float32", (1, 16384, 3072, 768), "row", "col", None, tf32.format("128x192x32", 4)))
    cases.append(("float32", (1, 4096, 768, 3072), "row", "col", BOTH, tf32.format("192x128x32", 4)))
    cases.append(("float32", (2, 2000, 1040, 200), "row", "col", TO_BF16, tf32.format("128x192x32", 4)))
    return cases


CASES = _cases()


def _case_id(case):
    dtype, (batch, m, n, k), a_layout, b_layout, epilogue, config = case[:6]
    extra = "" if epilogue is None else \
        f"-bias_{epilogue.bias}-res_{epilogue.residual}-{'_'.join(s.replace('to:', 'to_') for s in epilogue.steps)}"
    split = "-split_k" if _split(case) else ""
    persistent = "-persistent" if _persistent(case) else ""
    return (f"{dtype}-{batch}x{m}x{n}x{k}-{a_layout[0]}{b_layout[0]}{extra}{'-override' if config else ''}"
            f"{split}{persistent}")


def _persistent(case) -> bool | None:
    """True: the persistent form forced; None: as `build_matmul` decides."""
    return True if len(case) > 7 and case[7] else None


def _split(case) -> bool:
    return len(case) > 6 and case[6]


def _problem(case) -> ContractionProblem:
    dtype, (batch, m, n, k), a_layout, b_layout, _, _ = case[:6]
    return ContractionProblem(m, n, k, batch=batch, operand_dtype=dtype, a_layout=a_layout, b_layout=b_layout,
                              a_split_k=_split(case))


def _config(case) -> TileConfig:
    return TileConfig.parse(case[5]) if case[5] else choose_tiles(_problem(case), TARGET)


@pytest.fixture(scope="module")
def kernels():
    """Every case's kernel (or the exception its build raised), compiled in parallel processes."""
    workers = min(len(CASES), os.cpu_count() or 1, 16)
    context = multiprocessing.get_context("spawn")  # never fork a process that holds a CUDA context
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = [pool.submit(build_matmul, _problem(c), _config(c), TARGET, c[4], None, _persistent(c))
                   for c in CASES]
        return [f.exception() or f.result() for f in futures]


def operands(problem: ContractionProblem, epilogue: MatmulEpilogue | None, rng) -> list[np.ndarray]:
    """Random inputs in kernel parameter order, as NumPy arrays of the operand dtypes."""
    p = problem
    a_shape = (p.batch, p.m, p.k) if p.a_layout == "row" else (p.batch, p.k, p.m)
    if p.a_split_k:  # one [M, S*K] matrix
        a_shape = (p.m, p.batch * p.k)
    b_shape = (p.batch, p.k, p.n) if p.b_layout == "row" else (p.batch, p.n, p.k)
    dtype = jnp.dtype(p.operand_dtype)
    xs = [rng.standard_normal(a_shape).astype(dtype), rng.standard_normal(b_shape).astype(dtype)]
    if epilogue is not None and epilogue.bias:
        xs.append(rng.standard_normal((p.n,)).astype(jnp.dtype(epilogue.bias)))
    if epilogue is not None and epilogue.residual:
        xs.append(rng.standard_normal((p.batch, p.m, p.n)).astype(jnp.dtype(epilogue.residual)))
    return xs


def reference(problem: ContractionProblem, epilogue: MatmulEpilogue | None, xs) -> np.ndarray:
    a, b = (np.asarray(x, np.float64) for x in xs[:2])
    if problem.a_split_k:  # batch s: columns s*K .. s*K + K - 1
        a = a.reshape(problem.m, problem.batch, problem.k).transpose(1, 0, 2)
    if problem.a_layout == "col":
        a = a.transpose(0, 2, 1)
    if problem.b_layout == "col":
        b = b.transpose(0, 2, 1)
    out = a @ b
    if epilogue is None:
        return out
    extra = dict(zip([n for n in ("bias", "residual") if getattr(epilogue, n)], xs[2:]))
    for step in epilogue.steps:  # in f64, rounded to 16 bits where the epilogue rounds
        if step in extra:
            out = out + np.asarray(extra[step], np.float64)
        else:
            out = np.asarray(out.astype(jnp.dtype(step.removeprefix("to:"))), np.float64)
    return out


def run_kernel(kernel: GpuKernel, problem: ContractionProblem, xs, epilogue: MatmulEpilogue | None = None) -> np.ndarray:
    """C from the kernel, launched on device copies of `xs` with a NaN-poisoned output buffer."""
    out_dtype = (epilogue or MatmulEpilogue()).out
    out_type = TensorType((problem.batch, problem.m, problem.n), out_dtype)
    n = len(xs)
    handle = GpuKernelHandle(kernel.launch(), [out_type], aliases=((n, 0),))
    call = jax.jit(lambda *args: nova_kernel_p.bind(*args, kernel=handle)[0], donate_argnums=(n,))
    poison = jnp.full(out_type.shape, jnp.nan, jnp.dtype(out_dtype))
    return np.asarray(call(*[jnp.asarray(x) for x in xs], poison), np.float64)


def describe_mismatch(out: np.ndarray, want: np.ndarray, tol: float) -> str:
    """Where the kernel is wrong: counts, the first bad elements, and the bad rows/columns modulo the
    MMA fragment sizes (a wrong fragment mapping shows up as a pattern there)."""
    scale = np.abs(want).max() or 1.0
    bad = ~(np.abs(out - want) <= tol * 10 * scale)
    where = np.argwhere(bad)
    lines = [f"{bad.sum()} of {bad.size} elements wrong ({np.isnan(out).sum()} NaN)"]
    for idx in where[:6]:
        lines.append(f"  at {tuple(int(i) for i in idx)}: got {out[tuple(idx)]:.5g}, want {want[tuple(idx)]:.5g}")
    if len(where):
        rows, cols = where[:, 1], where[:, 2]
        lines.append(f"  bad rows % 64: {np.bincount(rows % 64, minlength=64).nonzero()[0].tolist()}")
        lines.append(f"  bad cols % 64: {np.bincount(cols % 64, minlength=64).nonzero()[0].tolist()}")
    return "\n".join(lines)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_matmul_matches_float64(kernels, index):
    case = CASES[index]
    kernel = kernels[index]
    if isinstance(kernel, BaseException):
        raise kernel
    problem, epilogue = _problem(case), case[4]
    assert ("persistent" in kernel.schedule) == bool(_persistent(case)) or _persistent(case) is None, kernel.schedule
    rng = np.random.default_rng(1000 + index)
    xs = operands(problem, epilogue, rng)
    out = run_kernel(kernel, problem, xs, epilogue)
    want = reference(problem, epilogue, xs)
    error = np.linalg.norm(np.nan_to_num(out, nan=1e30) - want) / np.linalg.norm(want)
    print(f"{_case_id(case)}: {kernel.schedule}: relative error {error:.2e}")
    tol = TF32_TRUNCATED if "wgmma_tf32" in kernel.schedule else TOLERANCE[problem.operand_dtype]
    if epilogue is not None and epilogue.converts:  # a TF32 or summation difference may round to the next bf16
        tol = max(tol, 8e-3)
    assert not np.isnan(out).any() and error < tol, describe_mismatch(out, want, tol)
