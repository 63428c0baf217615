"""align_contractions: contraction operands whose contiguous rows are not whole 16-byte chunks are
padded with zeros (K on both sides; a free dim with the result sliced back), for the GPU plan."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnova
from jnova.capture.to_nova import to_nova
from jnova.capture.trace import trace
from jnova.passes.configure.problem import contraction_problem
from jnova.passes import align_contractions as align
from helpers.nova_funcs import nova_func
from helpers.random_inputs import f32 as _f32


def _aligned_func(fn, *args):
    func = nova_func(fn, *args)
    count = align.align_contractions(func, min_flops=0)
    func.verify()
    return func, count


def _problems(func):
    return [contraction_problem(op)[0] for op in func.ops if op.name == "nova.matmul"]


def _lm_head(x, w, dlogits):
    """GPT-2's LM head with a 77-token vocabulary: logits (B given as [K, N], N odd), the input
    gradient (A as [M, K], K odd) and the weight gradient (A as [K, M], M odd)."""
    return x @ w, dlogits @ w.T, dlogits.T @ x


def test_odd_vocabulary_rows_are_padded_to_16_bytes():
    func, count = _aligned_func(_lm_head, _f32(64, 32), _f32(32, 77), _f32(64, 77))
    # the weight gradient reads dlogits through a transpose of its own ([77, 64]: aligned rows)
    assert count == 2
    for p in _problems(func):
        assert p is not None
        # every operand row now starts 16-byte aligned: its contiguous extent is a multiple of 4 f32
        assert (p.k if p.a_layout == "row" else p.m) % 4 == 0
        assert (p.k if p.b_layout == "col" else p.n) % 4 == 0
    pads = [op for op in func.ops if op.name == "nova.pad"]
    assert sum(op.operands[0].type.shape == (64, 77) for op in pads) == 1  # dlogits, along K
    assert func.returns[0].type.shape == (64, 77) and func.returns[2].type.shape == (77, 32)


def test_bf16_rows_pad_to_8_elements():
    bf = lambda *s: _f32(*s).astype(jnp.bfloat16)  # noqa: E731
    func, count = _aligned_func(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32),
                                bf(16, 50), bf(50, 24))
    assert count == 1
    (p,) = _problems(func)
    assert p.k == 56


def test_aligned_and_small_contractions_are_left_alone():
    func, count = _aligned_func(lambda a, b: a @ b, _f32(64, 128), _f32(128, 96))
    assert count == 0 and not any(op.name == "nova.pad" for op in func.ops)
    func = to_nova(trace(_lm_head, (_f32(64, 32), _f32(32, 77), _f32(64, 77)), {}), fallback="error").func
    assert align.align_contractions(func) == 0  # far below MIN_FLOPS


def test_padded_plan_matches_jit(monkeypatch):
    monkeypatch.setattr(align, "MIN_FLOPS", 0)
    args = (_f32(64, 32), _f32(32, 77), _f32(64, 77))
    step = jnova.compile(_lm_head, backend="cpu", kernels="fused")
    got = step(*args)
    assert "nova.pad" in step.lower(*args).as_text("nova")
    want = jax.jit(_lm_head)(*args)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_gpt2_lm_head_contractions_take_16_byte_rows():
    """The GPT-2 124M step for the H200: no contraction kernel falls back to 4-byte or register
    copies of the 50257-wide vocabulary."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from gpt2_step import setup

    _, step, batch = setup(8, 1024, 12)
    launches = jnova.compile(step, target="h200", mixed_precision="bf16").lower(*batch).as_text("launches")
    matmuls = [line for line in launches.splitlines() if "matmul[" in line]
    assert matmuls and not any("50257" in line for line in matmuls), [m for m in matmuls if "50257" in m]
