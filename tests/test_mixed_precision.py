"""mixed_precision="bf16": contraction operands in bf16, everything else in f32."""
import re

import jax
import jax.numpy as jnp
import numpy as np

import jnova


def _loss(w1, w2, x):
    h = jax.nn.gelu(x @ w1)
    return jnp.mean(jax.nn.log_softmax(h @ w2) ** 2)


def _bf16_reference(w1, w2, x):
    """The same loss with every matmul operand rounded to bf16 and f32 accumulation."""
    def mm(a, b):
        return jnp.matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    h = jax.nn.gelu(mm(x, w1))
    return jnp.mean(jax.nn.log_softmax(mm(h, w2)) ** 2)


def _args():
    rng = np.random.default_rng()
    return (rng.standard_normal((16, 32), np.float32) * 0.3, rng.standard_normal((32, 8), np.float32) * 0.3,
            rng.standard_normal((12, 16), np.float32))


def test_bf16_contractions_match_a_bf16_operand_reference():
    args = _args()
    step = jnova.compile(jax.value_and_grad(_loss, argnums=(0, 1)), mixed_precision="bf16")
    got_loss, got_grads = step(*args)
    # the forward pass is exactly the reference's arithmetic (up to f32 summation order)
    np.testing.assert_allclose(got_loss, jax.jit(_bf16_reference)(*args), rtol=1e-5)
    # against full f32, the difference is what bf16 operands cost (~1e-2 relative)
    want_loss, want_grads = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1)))(*args)
    np.testing.assert_allclose(got_loss, want_loss, rtol=2e-2)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=5e-2, atol=5e-2 * np.abs(w).max())
        assert g.dtype == np.float32


def test_only_contraction_operands_are_demoted():
    step = jnova.compile(jax.value_and_grad(_loss, argnums=(0, 1)), mixed_precision="bf16")
    nova = re.sub(r" loc\(.*\)$", "", step.lower(*_args()).as_text("nova"), flags=re.M)  # types end the lines
    converts = [line for line in nova.splitlines() if '"nova.convert"' in line]
    matmuls = [line for line in nova.splitlines() if '"nova.matmul"' in line]
    assert matmuls and all("bf16>, tensor<" in m and "-> tensor<" in m and m.rstrip().endswith("xf32>") for m in matmuls)
    assert all("xf32>) -> tensor<" in c and c.rstrip().endswith("xbf16>") for c in converts)
    # no elementwise op runs in bf16
    assert not [line for line in nova.splitlines() if "bf16" in line and '"nova.convert"' not in line
                and '"nova.matmul"' not in line]


def test_default_keeps_f32():
    step = jnova.compile(jax.value_and_grad(_loss, argnums=(0, 1)))
    assert "bf16" not in step.lower(*_args()).as_text("nova")
