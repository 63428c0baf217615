"""attention_writes_concatenation: the dK/dV kernel writes dk and dv into the concatenation of a fused
projection's gradients (and copies dq there), so no kernel of its own concatenates them.

- `concatenation_views` against NumPy: each part's place in a concatenation's buffer, directly, through
  transposes and through reshapes.
- Plans for the H200 (built on the CPU): the gradient of a step splitting a fused qkv projection is
  the dK/dV kernel's one output (with the pass left out, a kernel of its own writes it), with dq its
  last input; the same for GQA through jax.nn.dot_product_attention's transposes; a concatenation of
  other values than dk and dv (k read elsewhere too) stays a kernel.
- jnova.compile on the CPU (the per-group plan, which takes the same groups) equals jax.jit.
The kernel itself: tests/test_gpu_attention_codegen.py (the warp interpreter, ptxas).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnova
from helpers.attention import addressed, attention_kernel_params, compare_with_jit, h200_plan, split_projection
from helpers.nova_funcs import nova_func
from jnova.passes.strided_views import concatenation_views

B, T, H, D = 2, 77, 4, 64
C = H * D


@pytest.mark.parametrize("name,fn", [
    ("heads", lambda a, b, c: jnp.concatenate([a, b, c], axis=2).reshape(B, T, 3 * C)),
    ("transposed heads", lambda a, b, c: jnp.concatenate([x.transpose(0, 2, 1, 3) for x in (a, b, c)], axis=2)),
    ("flattened rows", lambda a, b, c: jnp.concatenate([x.reshape(B, T, C) for x in (a, b, c)], axis=-1)),
])
def test_concatenation_views_address_each_part(name, fn):
    rng = np.random.default_rng()
    shape = (B, H, T, D) if name == "transposed heads" else (B, T, H, D)
    parts = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    func = nova_func(fn, *parts)
    concat = next(op for op in func.ops if op.name == "nova.concatenate")
    flat = np.asarray(fn(*parts))
    for view, part, arg in zip(concatenation_views(concat), parts, func.args):
        assert view.value is arg and view.base is concat.results[0]
        np.testing.assert_array_equal(addressed(view, flat), part)


def _loss(x, w):
    o = jnova.ops.attention(*split_projection(x @ w, H, D), causal=True)
    return jnp.sum(o.astype(jnp.float32) ** 2)


def _k_read_elsewhere_loss(x, w):  # k's gradient is dk plus a term of its own: no dk in the concatenation
    q, k, v = split_projection(x @ w, H, D)
    o = jnova.ops.attention(q, k, v, causal=True).astype(jnp.float32)
    return jnp.sum(o ** 2) + jnp.sum(k.astype(jnp.float32) ** 2)


def test_the_dkdv_kernel_writes_the_gradient_of_the_projection(monkeypatch):
    x, w = jnp.ones((B, T, C), jnp.bfloat16), jnp.ones((C, 3 * C), jnp.bfloat16)
    grad = jax.grad(_loss, argnums=(0, 1))
    written = h200_plan(grad, x, w)
    assert attention_kernel_params(written, "dkdv")[-2:] == [("%part0", f"memref<{B * T * C}xbf16>"),
                                                            ("%concatenation", f"memref<{B * T * 3 * C}xbf16>")]
    apart = h200_plan(grad, x, w, without=("attention_writes_concatenation",), monkeypatch=monkeypatch)
    assert apart.stats()["kernels"] == written.stats()["kernels"] + 1
    assert [p for p, _ in attention_kernel_params(apart, "dkdv")][-2:] == ["%dk", "%dv"]


def test_grouped_heads_in_the_other_layout_are_read_and_written_in_place(monkeypatch):
    """jax.nn.dot_product_attention's form ([B, H, T, D] through transposes) with 2 kv heads of 4."""
    def loss(x, w):
        q, k, v = jnp.split((x @ w).reshape(B, T, H + 4, D), [H, H + 2], axis=2)
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32) ** 2)
    x, w = jnp.ones((B, T, C), jnp.bfloat16), jnp.ones((C, C + 4 * D), jnp.bfloat16)
    written = h200_plan(jax.grad(loss, argnums=(0, 1)), x, w)
    buffer = f"memref<{B * T * (C + 4 * D)}xbf16>"
    assert ("%q_k_v", buffer) in attention_kernel_params(written, "dq")
    assert attention_kernel_params(written, "dkdv")[-1] == ("%concatenation", buffer)
    apart = h200_plan(jax.grad(loss, argnums=(0, 1)), x, w, without=("attention_writes_concatenation",),
                      monkeypatch=monkeypatch)
    assert apart.stats()["kernels"] == written.stats()["kernels"] + 1


def test_a_concatenation_of_other_values_than_dk_and_dv_stays_a_kernel(monkeypatch):
    x, w = jnp.ones((B, T, C), jnp.bfloat16), jnp.ones((C, 3 * C), jnp.bfloat16)
    grad = jax.grad(_k_read_elsewhere_loss, argnums=(0, 1))
    plan = h200_plan(grad, x, w)
    assert not any(p == "%concatenation" for p, _ in attention_kernel_params(plan, "dkdv"))
    apart = h200_plan(grad, x, w, without=("attention_writes_concatenation",), monkeypatch=monkeypatch)
    assert apart.stats()["kernels"] == plan.stats()["kernels"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("loss", [_loss, _k_read_elsewhere_loss], ids=["written", "k_twice"])
def test_steps_on_the_cpu_equal_jax_jit(dtype, loss):
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((B, T, C)), dtype)
    w = jnp.asarray(rng.standard_normal((C, 3 * C)) / np.sqrt(C), dtype)
    compare_with_jit(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), x, w, dtype=dtype, kernels="fused")
