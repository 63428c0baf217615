"""view_attention_operands and strided views: attention kernels read q, k, v where they lie in a fused
projection's buffer.

- `strided_view` against NumPy: the elements the view addresses in the base buffer are the value the
  reshapes, slices and transposes compute (fresh random buffers); a reshape that would copy has none;
  views the kernels cannot read say why.
- Plans for the H200 (built on the CPU): a step splitting a fused qkv projection has no kernel
  copying the slices (with the pass left out, it has), and its attention kernels (forward, dQ, dK/dV)
  take the projection's buffer; q, k, v given as separate arrays, a slice read by another op too, or
  one that is not 16-byte aligned keep their plans.
- jnova.compile on the CPU (the per-group plan, which takes the same groups) equals jax.jit, for the
  split and for basic slices.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnova
from jnova.passes.configure.attention_tiles import WGMMA_BY_DEFAULT
from helpers.attention import addressed, attention_kernel_params, compare_with_jit, h200_plan, split_projection
from helpers.nova_funcs import nova_func
from jnova.passes.strided_views import row_view_refusal, strided_view

B, T, H, D = 2, 77, 4, 64
C = H * D
QKV = f"memref<{B * T * 3 * C}xbf16>"


@pytest.mark.parametrize("name,fn", [
    ("heads of a reshape", lambda x: x.reshape(B, T, 3 * H, D)[:, :, H:2 * H]),
    ("columns, then heads", lambda x: x[..., 2 * C:].reshape(B, T, H, D)),
    ("heads, transposed", lambda x: x[..., C:2 * C].reshape(B, T, H, D).transpose(0, 2, 1, 3)),
    ("every other time step", lambda x: x[:, ::2, :C].reshape(B, (T + 1) // 2, H, D)),
])
def test_strided_views_address_what_the_ops_compute(name, fn):
    x = np.random.default_rng().standard_normal((B, T, 3 * C)).astype(np.float32)
    func = nova_func(fn, x)
    view = strided_view(func.returns[0])
    assert view is not None and view.base is func.args[0], name
    np.testing.assert_array_equal(addressed(view, x), np.asarray(fn(x)))
    assert row_view_refusal(view) is None


def test_a_reshape_that_copies_has_no_view():
    x = np.zeros((B, T, 3 * C), np.float32)
    func = nova_func(lambda x: x[..., :C].reshape(B, T, H, D).transpose(0, 2, 1, 3).reshape(B, H * T, D), x)
    assert strided_view(func.returns[0]) is None


def test_views_the_kernels_cannot_read_say_why():
    x = np.zeros((B, T, 3 * C + 4), np.float32)
    func = nova_func(lambda x: x[..., 4:4 + C].reshape(B, T, H, D), x)  # 16 bytes in: fine for f32
    assert row_view_refusal(strided_view(func.returns[0])) is None
    func = nova_func(lambda x: x[..., 2:2 + C].reshape(B, T, H, D), x)
    assert "16-byte chunks" in row_view_refusal(strided_view(func.returns[0]))
    func = nova_func(lambda x: x[..., :C].reshape(B, T, H, D).transpose(0, 1, 3, 2), x)
    assert "last axis has stride" in row_view_refusal(strided_view(func.returns[0]))


# -- plans

def _fused_step(x, w, offset=0):
    return jnova.ops.attention(*split_projection(x @ w, H, D, offset), causal=True)


def _loss(x, w):
    return jnp.sum(_fused_step(x, w).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
def test_a_fused_projection_is_read_in_place(grad, monkeypatch):
    x, w = jnp.ones((B, T, C), jnp.bfloat16), jnp.ones((C, 3 * C), jnp.bfloat16)
    fn = jax.grad(_loss, argnums=(0, 1)) if grad else _fused_step
    viewed = h200_plan(fn, x, w)
    launches = viewed.as_text("launches")
    assert all(launches.count(f"attention[{kind} {'wgmma' if WGMMA_BY_DEFAULT else 'mma.sync'} bf16] attention {B}x{H}x{T}x{D}") == 1
               for kind in (("fwd", "dq", "dkdv") if grad else ("fwd",))), launches
    assert attention_kernel_params(viewed, "fwd")[0] == ("%in0", QKV)  # one parameter for q, k and v
    assert attention_kernel_params(viewed, "fwd")[1] != ("%in1", QKV)
    if grad:
        for kind in ("dq", "dkdv"):  # one parameter for q, k and v, named for the three
            assert ("%q_k_v", QKV) in attention_kernel_params(viewed, kind)
    copied = h200_plan(fn, x, w, without=("view_attention_operands",), monkeypatch=monkeypatch)
    assert copied.stats()["kernels"] == viewed.stats()["kernels"] + 1  # the copies of the slices
    assert [p for p, _ in attention_kernel_params(copied, "fwd")][:3] == ["%in0", "%in1", "%in2"]


def test_separate_q_k_v_keep_their_own_parameters():
    q = jnp.ones((B, T, H, D), jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(jnova.ops.attention(q, k, v, causal=True).astype(jnp.float32) ** 2)
    gpu = jnova.compile(jax.grad(loss, argnums=(0, 1, 2)), target="h200").lower(q, q + 1, q + 2).as_text("gpu")
    size = B * T * H * D
    assert gpu.count(f"%q: memref<{size}xbf16>") == 2 and gpu.count(f"%k: memref<{size}xbf16>") == 2


@pytest.mark.parametrize("case", ["read elsewhere", "misaligned"])
def test_slices_the_kernels_cannot_share_stay_copies(case, monkeypatch):
    if case == "read elsewhere":  # q is returned too: its copy is made anyway
        def fn(x, w):
            q, k, v = split_projection(x @ w, H, D)
            return jnova.ops.attention(q, k, v, causal=True), q
        w = jnp.ones((C, 3 * C), jnp.bfloat16)
    else:  # the slices start 2 elements (4 bytes) into each row
        fn, w = (lambda x, w: _fused_step(x, w, offset=2)), jnp.ones((C, 3 * C + 8), jnp.bfloat16)
    x = jnp.ones((B, T, C), jnp.bfloat16)
    viewed = h200_plan(fn, x, w)
    copied = h200_plan(fn, x, w, without=("view_attention_operands",), monkeypatch=monkeypatch)
    assert viewed.stats()["kernels"] == copied.stats()["kernels"]
    assert viewed.as_text("launches") == copied.as_text("launches")


# -- numerics: the CPU's per-group plan

def _sliced_loss(x, w):  # q, k, v as basic slices 16 bytes into each row
    return jnp.sum(_fused_step(x, w, offset=8).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("loss", [_loss, _sliced_loss], ids=["split", "sliced"])
def test_fused_projection_step_on_the_cpu_equals_jax_jit(dtype, loss):
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((B, T, C)), dtype)
    w = jnp.asarray(rng.standard_normal((C, 3 * C + (16 if loss is _sliced_loss else 0))) / np.sqrt(C), dtype)
    lowered = compare_with_jit(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), x, w, dtype=dtype,
                               kernels="fused")
    assert lowered.stats()["kernels"] >= 3
