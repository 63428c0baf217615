"""Whole training steps compiled for the GPU match jax.jit on the GPU."""
import re

import jax
import numpy as np
import pytest

import jnova
from models import tiny

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
def test_tiny_transformer_step_matches_jit(mixed_precision):
    step, params, state, ids = tiny.setup(batch=4, seq=65, d=64)
    compiled = jnova.compile(step, mixed_precision=mixed_precision)
    got = compiled(params, state, ids)
    stats = compiled.stats()[0]
    assert stats["backend"] == "gpu" and stats["kernels"] > stats["xla_groups"]
    with jax.default_matmul_precision("float32"):
        want = jax.jit(step)(params, state, ids)
    # jnova's contractions run in TF32 on the GPU (wgmma truncates the operands: u = 2**-10; XLA groups
    # follow jax's default GPU matmul precision, TF32 too), and bf16 demotes contraction operands
    rtol = 2e-2 if mixed_precision else 4 * 2.0**-10
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=rtol * (np.abs(np.asarray(b)).max() + 1e-6))


@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
def test_split_k_weight_gradient_matches_float64(mixed_precision):
    """A weight gradient the configurator splits along K (partial products over K/S, then their sum)
    and an update reading it, against float64 NumPy on fresh random inputs."""
    from jnova.passes.configure.operand_transposes import choose_transposes
    from jnova.passes.configure.problem import ContractionProblem
    from jnova.passes.configure.split_k import choose_split_k, explain_split_k
    from jnova.runtime.target import get_target

    def sgd(x, dy, w):
        g = jax.numpy.einsum("btm,btn->mn", x, dy)
        return w - 0.01 * g, g

    rng = np.random.default_rng()
    x, dy = (rng.standard_normal((8, 1024, 768), np.float32) for _ in range(2))
    w = rng.standard_normal((768, 768), np.float32)
    dtype = "bfloat16" if mixed_precision else "float32"
    problem = ContractionProblem(768, 768, 8192, operand_dtype=dtype, a_layout="col", b_layout="row")
    splits = choose_split_k(problem, get_target())
    assert splits > 1, explain_split_k(problem, get_target())  # 768 x 768: 36 tiles of 128 x 128 at most
    compiled = jnova.compile(sgd, mixed_precision=mixed_precision)
    new_w, g = compiled(x, dy, w)
    launches = compiled.lower(x, dy, w).as_text("launches")
    # the partial products: a batched matmul over the splits (on either contraction kernel), then their sum
    assert re.search(rf"matmul\[(wgmma|tma-pingpong)\] {splits}x768x768x{8192 // splits} ", launches), launches
    assert f"column_reduction(rows={splits}," in launches, launches
    if mixed_precision:  # the reference rounds the operands as the kernel does
        x, dy = (np.asarray(jax.numpy.asarray(a, jax.numpy.bfloat16), np.float32) for a in (x, dy))
    want = np.einsum("btm,btn->mn", x.astype(np.float64), dy.astype(np.float64))
    # a sum of 8192 products of N(0,1): |g| ~ 90, up to ~450. TF32 truncates each operand (u = 2**-10,
    # errors of random sign: ~sqrt(K) u per unit product); bf16 operands are exact in the reference and
    # the f32 sums round (2**-24 of the running sum, K times, of random sign)
    k = 8192
    atol = (4 * 2.0**-24 * np.sqrt(k) * np.abs(want).max()) if mixed_precision else 8 * 2.0**-10 * np.sqrt(k)
    np.testing.assert_allclose(np.asarray(g), want, rtol=0, atol=atol)
    np.testing.assert_allclose(np.asarray(new_w), w - 0.01 * want, rtol=0, atol=0.01 * atol + 1e-5)


def test_transposed_tf32_operand_matches_float64():
    """A dense layer whose weight (B as [K, N]) the configurator transposes into a K-major copy before
    the TF32 contraction, against float64 NumPy on fresh random inputs."""
    from jnova.passes.configure.operand_transposes import choose_transposes
    from jnova.passes.configure.problem import ContractionProblem
    from jnova.passes.configure.split_k import choose_split_k, explain_split_k
    from jnova.runtime.target import get_target

    def dense(x, w, b):
        return jax.nn.relu(x @ w + b)

    rng = np.random.default_rng()
    x, w, b = (rng.standard_normal(s, np.float32) for s in ((8192, 768), (768, 3072), (3072,)))
    problem = ContractionProblem(8192, 3072, 768, a_layout="row", b_layout="row")
    assert choose_transposes(problem, get_target()) == (False, True)
    compiled = jnova.compile(dense)
    got = np.asarray(compiled(x, w, b))
    assert "a=row b=col" in compiled.lower(x, w, b).as_text("launches")
    want = np.maximum(x.astype(np.float64) @ w.astype(np.float64) + b, 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=4 * 2.0**-10 * np.sqrt(768.0) * 2)


def test_steps_recorded_as_kernel_nodes_match_jit_as_buffers_move():
    """Where jaxlib's FFI has the record stage (jaxlib 0.11), jnova's launches are recorded into XLA's
    command buffers as kernel nodes and updated when the buffers move: a step called on new inputs
    each time (kept alive, so their addresses differ), results against jax.jit every time."""
    from jnova.runtime import launcher

    step, params, state, ids = tiny.setup(batch=4, seq=65, d=64)
    compiled = jnova.compile(step)
    lib = launcher.load()
    if not lib.has_record_stage:
        pytest.skip("this jaxlib's FFI has no record stage")
    assert lib.mode == "record"
    before = lib.counts()
    rng = np.random.default_rng()
    kept = []
    for i in range(4):
        params_i = jax.tree.map(lambda p: p + np.float32(0.01) * rng.standard_normal(p.shape, np.float32), params)
        got = compiled(params_i, state, ids)
        kept.append((params_i, got))
        with jax.default_matmul_precision("float32"):
            want = jax.jit(step)(params_i, state, ids)
        rtol = 4 * 2.0**-10
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol,
                                       atol=rtol * (np.abs(np.asarray(b)).max() + 1e-6))
    after = lib.counts()
    assert after["record_creates"] > before["record_creates"], (before, after)
    assert after["record_updates"] > before["record_updates"], (before, after)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_global_norm_clipping_split_into_partial_reductions_matches_float64(dtype):
    """optax.clip_by_global_norm's sum of squares of a 2M-element gradient, which the configurator splits
    into partial reductions (`split_reductions`), and the scaled update, against float64 NumPy."""
    import jax.numpy as jnp
    import optax

    from jnova.passes.configure.reduction_split import choose_reduction_splits
    from jnova.runtime.target import get_target

    def clipped(w, g):
        (g,), _ = optax.clip_by_global_norm(1.0).update((g,), optax.EmptyState())
        return w - 0.5 * g, jnp.sum(g * g)

    rng = np.random.default_rng()
    w, g = (rng.standard_normal((2048, 1024)).astype(dtype) for _ in range(2))
    assert choose_reduction_splits(1, g.size, get_target(None)) > 1
    compiled = jnova.compile(clipped)
    launches = compiled.lower(w, g).as_text("launches")
    assert "row_reduction(rows=1, cols=2097152" not in launches, launches
    got_w, got_sq = compiled(w, g)
    g64 = np.asarray(g, np.float64)
    scale = min(1.0, 1.0 / np.sqrt(np.sum(g64 * g64)))
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(np.asarray(got_w, np.float64), np.asarray(w, np.float64) - 0.5 * scale * g64,
                               rtol=tol, atol=tol)
    np.testing.assert_allclose(float(got_sq), np.sum((scale * g64) ** 2), rtol=tol)
