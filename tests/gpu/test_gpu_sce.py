"""The GPU's softmax cross-entropy kernels on a GPU (`pytest -m gpu`), against jax.jit and float64 NumPy.

- `jax.value_and_grad` of optax's cross-entropy (mean over rows; with an ignored label masked out as
  users write it) compiled by jnova equals jax.jit's, f32 and bf16 logits, V = 50257 (rows not on a
  16-byte boundary) and 50304; the compiled step's launches are the two cross-entropy kernels;
- each kernel launched alone (nova.sce rows; nova.sce_backward "none" and "sum"; dlogits in place of
  the logits) with poisoned outputs equals the float64 definition, with rows whose parts' maxima
  differ by more than 80, labels at the first and last class, outside [0, V), and ignored.
The same kernels run on the CPU in the warp interpreter: tests/test_gpu_sce_codegen.py."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from helpers.cross_entropy import IGNORE, sce_reference
from helpers.gpu_launch import TARGET, poisoned_like, run_kernel  # skips this module without a GPU

import jnova
from jnova.codegen.gpu.compile import compile_gpu_kernel
from jnova.dialect.ir import Func
from jnova.dialect.ops_training import sce_backward_op, sce_op
from jnova.dialect.types import TensorType as T
from jnova.passes.plan import Kernel
from jnova.primitives.gpu_lowering import GpuKernelHandle
from jnova.primitives.nova_kernel import nova_kernel_p
from helpers.random_inputs import normal, values

pytestmark = pytest.mark.gpu
NUMPY = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
ROWS = 2053  # kernels launched alone: not a multiple of any team's rows per block


def _logits(rng, n, v, dtype):
    x = normal(rng, (n, v), "float32", scale=3.0)
    x[0, : v // 3] += 90.0     # one part of a row 90 above the rest: the team's merge rescales
    x[1, -1] += 100.0
    x[2] -= 90.0
    return x.astype(NUMPY[dtype])


def _labels(rng, n, v, ignore=True):
    labels = values((n,), np.int32, rng, low=0, high=v)
    labels[:6] = [0, v - 1, IGNORE if ignore else 0, v - 1, 0, v - 1]
    if ignore:
        labels[6:64] = IGNORE
    return labels


# -- whole steps against jax.jit
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vocab", [50257, 50304])
@pytest.mark.parametrize("ignore", [False, True])
def test_value_and_grad_of_optax_cross_entropy_matches_jit(vocab, dtype, ignore):
    rng = np.random.default_rng()
    n = 4096
    logits, labels = _logits(rng, n, vocab, dtype), _labels(rng, n, vocab, ignore)

    def loss(logits, labels):
        per_row = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                                  jnp.where(labels == IGNORE, 0, labels))
        if not ignore:
            return per_row.mean()
        keep = labels != IGNORE
        return jnp.sum(jnp.where(keep, per_row, 0.0)) / jnp.maximum(keep.sum(), 1)

    step = jax.value_and_grad(loss)
    compiled = jnova.compile(step)
    launches = compiled.lower(logits, labels).as_text("launches")
    assert launches.count("sce_rows(") == 2, launches
    (got_loss, got_grad), (want_loss, want_grad) = compiled(logits, labels), jax.jit(step)(logits, labels)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    assert got_grad.dtype == want_grad.dtype == logits.dtype
    got, want = np.asarray(got_grad, np.float64), np.asarray(want_grad, np.float64)
    # relative, plus a few f32 ulps of the rows' cotangent (1 / count, about the largest gradient):
    # where the softmax is near 1, p - 1 keeps only the rounding of p, in XLA's exp as in ex2.approx
    tol = 1e-5 if dtype == "float32" else 2.0**-7
    bound = tol * np.abs(want) + 1e-6 * np.abs(want).max() + 1e-37
    assert (np.abs(got - want) <= bound).all(), f"{int((np.abs(got - want) > bound).sum())} elements differ"


# -- kernels launched alone against float64 NumPy
def _gradient(x, labels, lse, g):
    """dlogits in float64 from the kernel's own (f32) lse."""
    p = np.exp(x.astype(np.float64) - lse.astype(np.float64)[:, None])
    inside = (labels >= 0) & (labels < x.shape[1])
    p[np.nonzero(inside)[0], labels[inside]] -= 1.0
    return p * np.where(labels == IGNORE, 0.0, g)[:, None]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vocab", [50257, 50304, 1000, 7])
def test_forward_kernel_matches_numpy(vocab, dtype):
    rng = np.random.default_rng()
    n = ROWS
    x, labels = _logits(rng, n, vocab, dtype), _labels(rng, n, vocab)
    labels[64:66] = [vocab + 5, -3]  # outside [0, V), not ignored: no logit picked
    f = Func("f", [T((n, vocab), dtype), T((n,), "int32")])
    op = f.add(sce_op(*f.args, reduction="none", ignore_index=IGNORE))
    kernel = Kernel("sce_forward", [op], list(f.args), list(op.results))
    want_lse, want_loss = sce_reference(x, labels)
    loss, lse = run_kernel(compile_gpu_kernel(kernel, TARGET), kernel, [x, labels],
                           [poisoned_like(jnp.zeros(n, jnp.float32)), poisoned_like(jnp.zeros(n, jnp.float32))])
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=2e-6, atol=2e-5)
    np.testing.assert_allclose(np.asarray(loss), want_loss, rtol=2e-6, atol=4e-5)


def _backward(n, vocab, dtype, reduction):
    dloss = T((n,) if reduction == "none" else (), "float32")
    f = Func("f", [T((n, vocab), dtype), T((n,), "int32"), T((n,), "float32"), dloss])
    op = f.add(sce_backward_op(*f.args, reduction=reduction, ignore_index=IGNORE))
    return Kernel("sce_backward", [op], list(f.args), list(op.results))


def _assert_gradient_close(got, want, g, dtype):
    err = np.abs(np.asarray(got, np.float64) - want)
    bound = (1e-5 if dtype == "float32" else 2.0**-8) * np.abs(want) + 4e-7 * np.abs(g)[:, None] + 1e-37
    assert (err <= bound).all(), f"{int((err > bound).sum())} elements differ"


@pytest.mark.parametrize("reduction", ["none", "sum"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vocab", [50257, 50304, 1000, 7])
def test_backward_kernel_matches_numpy(vocab, dtype, reduction):
    rng = np.random.default_rng()
    n = ROWS
    x, labels = _logits(rng, n, vocab, dtype), _labels(rng, n, vocab)
    lse = sce_reference(x, labels)[0].astype(np.float32)
    dloss = normal(rng, (n,) if reduction == "none" else (), "float32")
    kernel = _backward(n, vocab, dtype, reduction)
    (out,) = run_kernel(compile_gpu_kernel(kernel, TARGET), kernel, [x, labels, lse, dloss],
                        [poisoned_like(jnp.zeros((n, vocab), NUMPY[dtype]))])
    g = np.broadcast_to(dloss, (n,))
    _assert_gradient_close(out, _gradient(x, labels, lse, g), g, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backward_kernel_in_place_of_the_logits(dtype):
    """dlogits in the logits' buffer, as reuse_buffers plans it where the logits die at the kernel."""
    rng = np.random.default_rng()
    n, vocab = 2048, 50257
    x, labels = _logits(rng, n, vocab, dtype), _labels(rng, n, vocab)
    lse = sce_reference(x, labels)[0].astype(np.float32)
    dloss = normal(rng, (n,), "float32")
    want = _gradient(x, labels, lse, dloss)
    kernel = _backward(n, vocab, dtype, "none")
    handle = GpuKernelHandle(compile_gpu_kernel(kernel, TARGET), [v.type for v in kernel.outputs], aliases=((0, 0),))
    inputs = [jnp.asarray(x), labels, lse, dloss]
    (out,) = jax.jit(lambda *xs: nova_kernel_p.bind(*xs, kernel=handle), donate_argnums=(0,))(*inputs)
    _assert_gradient_close(out, want, dloss, dtype)
