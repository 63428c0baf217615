"""GELU, LayerNorm, RMSNorm and softmax cross-entropy on the GPU (`pytest -m gpu`), forward and backward,
as users write them (jax.nn.gelu, Flax nn.LayerNorm / nn.RMSNorm, optax), in f32 and bf16.

Two checks per case, both against fresh random inputs:
- the step compiled by jnova equals jax.jit's on the GPU (the raised ops run as their decomposition in
  the row-reduction and elementwise kernels: passes/expand_training.py);
- every kernel of its GPU plan, launched alone with poisoned outputs (each output aliases a donated
  buffer of values far from the expected ones), equals its ops run by jax.lax.
Cross-entropy covers vocabularies 50257 (not a tile multiple) and 50304, labels at the first and last
class and ignored rows (label -100, masked as users do)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from helpers.gpu_launch import TARGET, poisoned_like, run_kernel  # skips this module without a GPU

import jnova
from jnova.codegen.gpu.compile import compile_gpu_kernel
from helpers.gpu_emulation import gpu_plan, reference
from helpers.random_inputs import normal

pytestmark = pytest.mark.gpu
TOL = {"float32": 4 * 2.0**-10, "bfloat16": 3e-2}   # TF32 contractions; bf16 rounding
IGNORE = -100


def _normal(rng, shape, dtype="float32", scale=1.0):
    return normal(rng, shape, dtype, scale)


def _close(got, want, dtype, what):
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        tol = TOL[dtype]
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * (np.abs(b).max() + 1e-6), err_msg=f"{what} leaf #{i}")


def _check(step, args, dtype):
    compiled = jnova.compile(step)
    got = compiled(*args)
    with jax.default_matmul_precision("float32"):
        want = jax.jit(step)(*args)
    _close(got, want, dtype, "step")
    _, plan = gpu_plan(step, *args, target=TARGET, training_ops=True)
    for kernel in plan.kernels:
        if any(op.name == "nova.matmul" for op in kernel.ops):
            continue  # the contractions have their own GPU tests
        inputs = _kernel_inputs(kernel)
        expect = [np.asarray(w) for w in reference(kernel)(*inputs)]
        out = run_kernel(compile_gpu_kernel(kernel, TARGET), kernel, inputs, [poisoned_like(w) for w in expect])
        _close(out, expect, "bfloat16" if any(v.type.dtype == "bfloat16" for v in kernel.inputs) else "float32",
               kernel.name)
    return compiled


def _kernel_inputs(kernel):
    """Random inputs of each kernel's input types (a kernel alone: any values of the right type)."""
    rng = np.random.default_rng()
    out = []
    for v in kernel.inputs:
        dt = np.dtype(ml_dtypes.bfloat16) if v.type.dtype == "bfloat16" else np.dtype(v.type.dtype)
        if dt.kind in "iu":
            out.append(rng.integers(0, 7, v.type.shape).astype(dt))
        elif dt == np.bool_:
            out.append(rng.random(v.type.shape) < 0.5)
        else:
            out.append(rng.uniform(0.5, 1.5, v.type.shape).astype(dt))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("approximate", [True, False])
def test_gelu_mlp_matches_jit(approximate, dtype):
    rng = np.random.default_rng()
    n, c, h = 2048, 768, 3072
    w1, b1, w2 = _normal(rng, (c, h), scale=0.03), _normal(rng, (h,), scale=0.5), _normal(rng, (h, c), scale=0.02)
    x = _normal(rng, (n, c))
    flax_dtype = jnp.bfloat16 if dtype == "bfloat16" else None

    def loss(params, x):
        w1, b1, w2 = params if flax_dtype is None else [p.astype(flax_dtype) for p in params]
        xx = x if flax_dtype is None else x.astype(flax_dtype)
        return jnp.mean(((jax.nn.gelu(xx @ w1 + b1, approximate=approximate) @ w2).astype(jnp.float32)) ** 2)

    _check(jax.value_and_grad(loss), ((w1, b1, w2), x), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "handwritten"])
def test_norms_match_jit(kind, dtype):
    rng = np.random.default_rng()
    x = _normal(rng, (16, 1024, 768), dtype, scale=2.0) + 0.5
    w2 = _normal(rng, (768, 64), scale=0.03)
    flax_dtype = jnp.bfloat16 if dtype == "bfloat16" else None
    module = nn.LayerNorm(epsilon=1e-5, dtype=flax_dtype) if kind == "layernorm" else nn.RMSNorm(epsilon=1e-6,
                                                                                                dtype=flax_dtype)
    params = {"params": {"scale": jnp.asarray(1 + 0.1 * rng.standard_normal(768), jnp.float32),
                         **({"bias": jnp.asarray(0.1 * rng.standard_normal(768), jnp.float32)}
                            if kind == "layernorm" else {})}}

    def loss(params, x):
        if kind == "handwritten":
            xf = x.astype(jnp.float32)
            y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * params["params"]["scale"])
            y = y.astype(x.dtype)
        else:
            y = module.apply(params, x)
        return jnp.mean(((y @ w2.astype(y.dtype)).astype(jnp.float32)) ** 2)

    _check(jax.value_and_grad(loss, argnums=(0, 1)), (params, x), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vocab", [50257, 50304])
@pytest.mark.parametrize("ignore", [False, True])
def test_cross_entropy_matches_jit(vocab, dtype, ignore):
    rng = np.random.default_rng()
    n = 2048
    logits = _normal(rng, (n, vocab), dtype, scale=3.0)
    logits[:8] += np.asarray(90.0, logits.dtype)  # rows whose maxima are far above the others'
    labels = rng.integers(0, vocab, n).astype(np.int32)
    labels[:4] = [0, vocab - 1, 0, vocab - 1]      # the first and the last class
    if ignore:
        labels[4:64] = IGNORE

    def loss(logits, labels):
        per_row = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                                  jnp.where(labels == IGNORE, 0, labels))
        keep = labels != IGNORE
        return jnp.sum(jnp.where(keep, per_row, 0.0)) / jnp.maximum(keep.sum(), 1)

    _check(jax.value_and_grad(loss), (logits, labels), dtype)
