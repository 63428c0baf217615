"""Precision on the GPU: jnova's training steps equal jax.jit's under the same matmul precision, and
bf16 programs are as close to the f32 result as jax.jit's (excess precision).

Under `jax.default_matmul_precision("float32")` XLA runs f32 contractions f32-accurate and jnova runs
its split-TF32 kernels (three TF32 products of split operands): the two agree to f32's tolerance
(rtol 1e-5) on the loss and the gradients. Under the default both may use TF32 (u = 2**-10 per operand).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jnova
from models import llama, mlp, tiny
from helpers import float64_forms

pytestmark = pytest.mark.gpu

F32 = 1e-5
TF32 = 4 * 2.0**-10


def _close(got, want, rtol, what):
    for path, (a, b) in zip(jax.tree_util.tree_leaves_with_path(got), zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * (np.abs(b).max() + 1e-30),
                                   err_msg=f"{what} {jax.tree_util.keystr(path[0])}")


def _mlp_momentum():
    """A jitted value_and_grad with an SGD-momentum update around it. The tanh MLP: a ReLU's mask
    flips where a pre-activation lies within TF32's rounding of zero, and the flipped sample's share
    of the bias gradient (measured on the H200: up to 40% of an element) is no rounding error."""
    key = jax.random.key(np.random.default_rng().integers(1 << 30))
    params = mlp.init(key, d_in=24, d_hidden=200, d_out=10)
    x, y = mlp.batch(jax.random.fold_in(key, 1), n=96, d_in=24, d_out=10)
    grad = jax.jit(jax.value_and_grad(mlp.tanh_loss))
    optimizer = optax.sgd(0.05, momentum=0.9)

    def step(params, state, x, y):
        value, grads = grad(params, x, y)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value, grads

    return step, (params, optimizer.init(params), x, y)


def _llama_adamw():
    step, params, state, ids = llama.setup()
    grad = jax.value_and_grad(llama.loss)

    def with_grads(params, state, ids):
        return (*step(params, state, ids), grad(params, ids)[1])

    return with_grads, (params, state, ids)


def _adamw_update(params, state, grads):
    """llama.setup's optimizer step from given gradients."""
    updates, state = optax.adamw(1e-3, weight_decay=0.1).update(grads, state, params)
    return optax.apply_updates(params, updates), state


def _tiny_gpt():  # odd shapes: vocab 97, 65 positions, d 40
    step, params, state, ids = tiny.setup(batch=3, seq=66, d=40, vocab=97)

    def with_grads(params, state, ids):
        def loss(p):
            logits = tiny.Tiny(d=40, vocab=97).apply(p, ids[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
        return (*step(params, state, ids), jax.grad(loss)(params))

    return with_grads, (params, state, ids)


STEPS = {"mlp_sgd_momentum": _mlp_momentum, "llama_adamw": _llama_adamw, "tiny_gpt": _tiny_gpt}
ADAM_UPDATES = {"llama_adamw": _adamw_update}


@pytest.mark.parametrize("name", STEPS)
def test_float32_precision_step_equals_jit(name):
    step, args = STEPS[name]()
    with jax.default_matmul_precision("float32"):
        compiled = jnova.compile(step)
        got = compiled(*args)
        want = jax.jit(step)(*args)
        launches = compiled.lower(*args).as_text("launches")
    assert "tf32x3" in launches and "mma=wgmma_tf32" not in launches and "mma=mma_sync_tf32_" not in launches
    *updated, loss, grads = got
    *want_updated, want_loss, want_grads = want
    _close(loss, want_loss, F32, "loss")
    _close(grads, want_grads, F32, "gradient")
    if name in ADAM_UPDATES:
        # Adam's first step moves each parameter by lr * g / (|g| + eps): where |g| is within a few
        # hundred eps (1e-8) of zero, a gradient equal to jax.jit's at f32's tolerance of the largest
        # gradient moves the parameter by a visible fraction of lr. So the update is checked from
        # jnova's own gradients, the gradients against jax.jit's above.
        want_updated = list(jax.jit(ADAM_UPDATES[name])(args[0], args[1], grads))
    _close(updated, want_updated, F32, "updated")


@pytest.mark.parametrize("name", STEPS)
def test_default_precision_step_is_within_tf32_of_jit(name):
    """Under the default both compilers run TF32, each rounding its own way: wgmma reads TF32 from the
    f32 bits in shared memory, dropping 13 mantissa bits (u = 2**-10, one direction), where XLA's GEMMs
    round (docs/bad_inputs.md). Measured on the H200 against the f32-accurate step, jnova's gradients
    are 1.6-4x further than XLA's (normwise 7e-4 to 6e-3 per array, XLA's 2.5e-4 to 1.7e-3), and an
    element where a sum cancels differs by more than TF32's rounding of the array's largest. So each
    gradient array is compared in norm, within 16 u of jax.jit's: a step's chain of TF32 contractions,
    well short of bf16 operands (u = 2**-8)."""
    step, args = STEPS[name]()
    got = jnova.compile(step)(*args)
    want = jax.jit(step)(*args)
    _close(got[-2], want[-2], TF32, "loss")
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(got[-1]), jax.tree.leaves(got[-1]),
                          jax.tree.leaves(want[-1])):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30)
        assert np.isfinite(a).all() and err <= 16 * 2.0**-10, (jax.tree_util.keystr(path[0]), err)


def test_bf16_programs_are_as_close_to_f32_as_jit():
    """XLA keeps excess precision inside a fusion: sum(x @ w) sums the f32 products, and softmax's
    exp stays f32 into its sum. jnova's kernels must be as close to the exact result of the bf16
    inputs as jax.jit's. The reference is float64 NumPy: an f32 reference's own rounding is as large
    as either compiler's error, and would count a more accurate sum as wrong."""
    rng = np.random.default_rng()
    x, w = rng.standard_normal((8, 32)).astype(np.float32), rng.standard_normal((32, 32)).astype(np.float32)
    s = (rng.standard_normal((16, 200)) * 3).astype(np.float32)
    cases = [(lambda x, w: jnp.sum(x @ w), (x, w), lambda x, w: np.sum(x @ w)),
             (lambda x, w: jnp.sum(x @ w, dtype=jnp.float32), (x, w), lambda x, w: np.sum(x @ w)),
             (lambda s: jax.nn.softmax(s), (s,), float64_forms.softmax),
             (lambda s: jax.nn.log_softmax(s), (s,), float64_forms.log_softmax)]
    for fn, args, exact in cases:
        bf16 = [jnp.asarray(a, jnp.bfloat16) for a in args]
        want = exact(*[np.asarray(a, np.float64) for a in bf16])
        err = lambda got: np.abs(np.asarray(got, np.float64) - want).max()  # noqa: E731
        f32_roundoff = 2.0**-20 * max(1.0, np.abs(want).max())
        ours, xla = err(jnova.compile(fn)(*bf16)), err(jax.jit(fn)(*bf16))
        assert ours <= 1.5 * xla + f32_roundoff, (ours, xla)


@pytest.mark.parametrize("k", [1024, 16384])
def test_highest_contraction_is_f32_accurate_at_long_k(k):
    """Under precision "highest" a contraction is f32-accurate however long K is: the split-TF32
    kernels' rounding must not grow with K (tensor cores accumulate rounding toward zero; the kernels
    add each k-tile's sums in f32 round-to-nearest). Against float64, beside XLA's precision=HIGHEST."""
    rng = np.random.default_rng()
    a = rng.standard_normal((256, k)).astype(np.float32)
    b = rng.standard_normal((k, 384)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    with jax.default_matmul_precision("float32"):
        got = np.asarray(jnova.compile(lambda x, y: x @ y)(a, b), np.float64)
        xla = np.asarray(jax.jit(lambda x, y: x @ y)(a, b), np.float64)
    err, xla_err = (np.linalg.norm(c - exact) / np.linalg.norm(exact) for c in (got, xla))
    assert err <= 3e-6, (err, xla_err)
