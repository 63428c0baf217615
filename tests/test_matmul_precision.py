"""Matmul precision as JAX defines it: `precision=` of each dot_general and jax.default_matmul_precision.

The CPU backend computes f32 contractions exactly whatever the precision, so these tests check what the
precision decides: the `precision` attribute of each nova.matmul, the cache keys, the GPU plan's MMA
kind (`as_text("launches")`) and the PTX of the split-TF32 kernel; the split's arithmetic is checked
against float64 with TF32 rounding emulated in NumPy (codegen/gpu/split_tf32.py).
"""
import re
import subprocess
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jnova
from jnova.capture.to_nova import to_nova
from jnova.capture.trace import trace
from jnova.codegen.gpu import split_tf32
from jnova.codegen.gpu.matmul import matmul_refusal
from jnova.dialect.parse import parse_module
from jnova.passes.configure.problem import ContractionProblem
from jnova.passes.configure.tile_config import TileConfig
from jnova.passes.configure.tile_schedule import choose_tiles
from jnova.pipeline import capture_key
from jnova.options import Options
from jnova.runtime.target import get_target
from helpers.random_inputs import values


def _precisions(fn, *args) -> list[str]:
    func = to_nova(trace(fn, args, {})).func
    return [op.attrs["precision"] for op in func.ops if op.name == "nova.matmul"]


def _args(*shapes, seed=None):
    rng = np.random.default_rng(seed)
    return [values(s, np.float32, rng) for s in shapes]


@pytest.mark.parametrize("context, want", [(None, "default"), ("default", "default"), ("high", "default"),
                                           ("tensorfloat32", "default"), ("float32", "highest"),
                                           ("highest", "highest"), ("F32_F32_F32", "highest"),
                                           ("bfloat16", "bfloat16"), ("BF16_BF16_F32", "bfloat16")])
def test_context_sets_every_contraction_of_the_step_forward_and_backward(context, want):
    loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) @ w.T)  # noqa: E731
    with jax.default_matmul_precision(context):
        got = _precisions(jax.value_and_grad(loss), *_args((8, 8), (4, 8)))
    assert len(got) >= 4 and set(got) == {want}


def test_precision_of_each_dot_general_wins_over_the_context():
    def f(a, b):
        return (jnp.dot(a, b, precision=lax.Precision.HIGHEST) + jnp.dot(a, b, precision=lax.Precision.DEFAULT)
                + jnp.dot(a, b, precision=(lax.Precision.DEFAULT, lax.Precision.HIGHEST))
                + lax.dot(a, b, precision=lax.DotAlgorithmPreset.TF32_TF32_F32)
                + lax.dot(a, b, precision=lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
                + lax.dot(a, b, precision=lax.DotAlgorithmPreset.BF16_BF16_F32))
    assert _precisions(f, *_args((4, 4), (4, 4))) == ["highest", "default", "highest", "default", "highest", "bfloat16"]
    with jax.default_matmul_precision("float32"):  # an explicit DEFAULT stays DEFAULT
        assert _precisions(f, *_args((4, 4), (4, 4)))[1] == "default"


def test_precision_round_trips_in_the_nova_text():
    with jax.default_matmul_precision("float32"):
        func = to_nova(trace(lambda a, b: a @ b, _args((4, 4), (4, 4)), {})).func
    text = func.print()
    assert 'precision = "highest"' in text
    assert parse_module(text).print() == text


def test_a_new_context_compiles_again_and_changes_the_keys():
    a, b = _args((8, 16), (16, 8))
    step = jnova.compile(lambda a, b: a @ b)
    keys = []
    for context in (None, "float32", "bfloat16", None):
        with jax.default_matmul_precision(context):
            step(a, b)
            keys.append(step.lower(a, b).executable.key)
    assert step.compile_count == 3           # the last call reuses the first signature's step
    assert len(set(keys[:3])) == 3 and keys[3] == keys[0]
    # the persistent cache's key: the jaxpr records "bfloat16" as DEFAULT, the context tells them apart
    disk = []
    for context in (None, "bfloat16"):
        with jax.default_matmul_precision(context):
            disk.append(capture_key(trace(lambda a, b: a @ b, (a, b), {}), Options(), "cpu"))
    assert disk[0] != disk[1]


def test_bfloat16_precision_rounds_f32_operands_to_bf16():
    a, b = _args((16, 64), (64, 8))
    with jax.default_matmul_precision("bfloat16"):
        step = jnova.compile(lambda a, b: a @ b)
        got = np.asarray(step(a, b))
        assert '"nova.convert"' in step.lower(a, b).as_text("nova")
    bf = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)  # noqa: E731
    want_bf16, want_f32 = bf(a) @ bf(b), a.astype(np.float64) @ b
    np.testing.assert_allclose(got, want_bf16, rtol=1e-5, atol=1e-5)
    assert np.abs(got - want_f32).max() > 100 * np.abs(got - want_bf16).max()


def test_mixed_precision_leaves_highest_contractions_in_f32():
    a, b = _args((16, 64), (64, 8))
    f = lambda a, b: jnp.dot(a, b, precision="highest") + a[:, :8] @ b[:8]  # noqa: E731
    text = jnova.compile(f, mixed_precision="bf16").lower(a, b).as_text("nova")
    matmuls = [line for line in text.splitlines() if '"nova.matmul"' in line]
    assert len(matmuls) == 2
    highest = next(line for line in matmuls if '"highest"' in line)
    assert "bf16" not in highest.split("->")[0] and "bf16" in next(m for m in matmuls if m != highest)


# --------------------------------------------------------------------------- the GPU plan (ahead of time)
def _launches(fn, args, context):
    with jax.default_matmul_precision(context):
        return jnova.compile(fn, target="h200").lower(*args)


def test_highest_takes_the_split_tf32_kernel_and_default_takes_tf32():
    args = _args((256, 512), (512, 384))
    highest = _launches(lambda a, b: a @ b, args, "float32").as_text("launches")
    default = _launches(lambda a, b: a @ b, args, None).as_text("launches")
    assert "mma=mma_sync_tf32x3_16x8x8" in highest and "tf32x3" not in default
    assert "mma=wgmma_tf32" in default


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas")
def test_split_tf32_kernel_assembles_with_three_products_per_tile(tmp_path):
    args = _args((192, 200), (200, 136))  # odd edges: masked tiles
    lowered = _launches(lambda a, b: a @ b, args, "highest")
    ptx = lowered.as_text("ptx")
    (tmp_path / "k.ptx").write_text(ptx)
    subprocess.run(["ptxas", "-arch=sm_90a", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")], check=True)
    config = TileConfig.parse(re.search(r"block=\S+ warps=\S+ stages=\d+ mma=\S+ swizzle=\d+ split_k=\d+",
                                        lowered.as_text("launches")).group(0))
    mt, nt = config.block_m // config.warps_m // 16, config.block_n // config.warps_n // 8
    steps = config.block_k // 8
    assert ptx.count("mma.sync.aligned.m16n8k8") == 3 * mt * nt * steps
    # every operand word: cvt.rna (hi), sub, cvt.rna (lo); A words 4 per m16 tile, B words 2 per n8 tile
    assert ptx.count("cvt.rna.tf32.f32") == 2 * steps * (4 * mt + 2 * nt)
    # each k-tile's tensor-core sums (4 words per m16n8 tile) join the accumulators in round-to-nearest adds
    assert len(re.findall(r"\badd(\.rn)?\.f32\b", ptx)) >= 4 * mt * nt


def test_configurator_and_kernels_refuse_tf32_for_highest():
    h200 = get_target("h200")
    problem = ContractionProblem(m=1024, n=1024, k=1024, precision="highest")
    config = choose_tiles(problem, h200)
    assert config.mma == "mma_sync_tf32x3_16x8x8"
    assert choose_tiles(ContractionProblem(m=1024, n=1024, k=1024), h200).mma == "wgmma_tf32_m64nNk8"
    override = TileConfig.parse(str(config).replace("tf32x3", "tf32"))
    assert "precision 'highest' needs mma_sync_tf32x3" in matmul_refusal(problem, override, h200)
    with pytest.raises(ValueError, match="precision"):
        ContractionProblem(m=8, n=8, k=8, precision="float32")


# --------------------------------------------------------------------------- the split's arithmetic
def test_round_tf32_is_cvt_rna():
    x = np.array([1.0, 1 + 2**-11, 1 + 2**-10 + 2**-11, -(1 + 2**-11), 1 + 2**-12, 3.0e38, np.inf, -np.inf],
                 np.float32)
    want = np.array([1.0, 1 + 2**-10, 1 + 2**-9, -(1 + 2**-10), 1.0, np.nan, np.inf, -np.inf], np.float32)
    want[5] = np.float32(np.frombuffer(np.uint32((np.float32(3.0e38).view(np.uint32) + 0x1000) & 0xFFFFE000)
                                       .tobytes(), np.float32)[0])
    np.testing.assert_array_equal(split_tf32.round_tf32(x), want)
    assert np.isnan(split_tf32.round_tf32(np.array([np.nan], np.float32))[0])


def test_split_keeps_21_bits_and_the_three_products_are_f32_accurate():
    rng = np.random.default_rng()
    x = (rng.standard_normal(10_000) * np.exp(rng.uniform(-20, 20, 10_000))).astype(np.float32)
    hi, lo = split_tf32.split(x)
    assert np.all(split_tf32.round_tf32(hi) == hi) and np.all(split_tf32.round_tf32(lo) == lo)
    rel = np.abs((hi.astype(np.float64) + lo - x) / x)
    assert rel.max() <= 2**-21
    a, b = rng.standard_normal((64, 512)).astype(np.float32), rng.standard_normal((512, 48)).astype(np.float32)
    exact = a.astype(np.float64) @ b
    scale = np.abs(a).astype(np.float64) @ np.abs(b)  # the error bound's scale for each output
    err = lambda got: np.max(np.abs(got - exact) / scale)  # noqa: E731
    f32 = err((a @ b).astype(np.float32))
    tf32 = err(split_tf32.round_tf32(a).astype(np.float64) @ split_tf32.round_tf32(b))
    x3 = err(split_tf32.matmul_tf32x3(a, b))
    assert x3 <= 4 * f32 and tf32 > 100 * x3
