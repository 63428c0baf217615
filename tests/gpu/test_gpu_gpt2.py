"""The Flax GPT-2 124M loss and gradients compiled by jnova match jax.jit on the GPU (`pytest -m gpu`).

One forward and backward pass of the example model (12 layers, batch 8 x 1024 tokens) on random
tokens: jnova's plan (its own kernels, TF32 wgmma contractions, bf16 operands with
mixed_precision="bf16") against jax.jit under the matching matmul precision. Both sides round their
contraction operands, independently, so the comparison allows each side's rounding through 12 layers:
relative error in norm per gradient leaf."""
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jnova
from helpers.gpu_launch import TARGET  # noqa: F401 (skips this module without a GPU)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "gpt2"))
import model as gpt2  # noqa: E402

pytestmark = pytest.mark.gpu
# (loss, gradient leaves): relative error vs jax.jit; XLA precision of the same arithmetic
CASES = {None: (2e-3, 2e-2, "tensorfloat32"), "bf16": (2e-2, 6e-2, "bfloat16")}


@pytest.mark.parametrize("mixed_precision", list(CASES))
def test_gpt2_124m_loss_and_gradients_match_jit(mixed_precision):
    loss_tol, grad_tol, precision = CASES[mixed_precision]
    config = gpt2.GPTConfig()
    module = gpt2.GPT(config)
    params = gpt2.init_params(module, jax.random.key(1), 1024)
    rng = np.random.default_rng()
    tokens = rng.integers(0, config.vocab_size, (8, 1025)).astype(np.int32)
    grad_fn = jax.value_and_grad(lambda p, x, y: gpt2.loss_fn(module, p, x, y))
    args = (params, tokens[:, :-1], tokens[:, 1:])

    compiled = jnova.compile(grad_fn, mixed_precision=mixed_precision)
    loss, grads = compiled(*args)
    stats = compiled.stats()[0]
    assert stats["backend"] == "gpu" and stats["kernels"] > 100
    with jax.default_matmul_precision(precision):
        want_loss, want_grads = jax.jit(grad_fn)(*args)

    loss_err = abs(float(loss) - float(want_loss)) / abs(float(want_loss))
    errors = {}
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.isfinite(g).all(), jax.tree_util.keystr(path)
        errors[jax.tree_util.keystr(path)] = np.linalg.norm(g - w) / np.linalg.norm(w)
    worst = max(errors, key=errors.get)
    print(f"mixed_precision={mixed_precision}: loss {float(loss):.6f} vs {float(want_loss):.6f} "
          f"(rel {loss_err:.1e}); gradients: median rel err {np.median(list(errors.values())):.1e}, "
          f"worst {errors[worst]:.1e} at {worst}")
    assert loss_err < loss_tol
    assert errors[worst] < grad_tol, {k: f"{v:.1e}" for k, v in sorted(errors.items(), key=lambda kv: -kv[1])[:8]}


def test_gpt2_124m_adamw_step_matches_jit():
    """The whole training step (loss, gradients, AdamW): the new moments like gradients (relative
    error in norm per leaf), the new parameters within AdamW's step bound. Adam's first update is
    +-lr per element whatever the gradient's size, so where a gradient is rounding noise (the key
    bias: softmax is shift-invariant) its sign, and the update, may differ by 2 lr."""
    config, lr = gpt2.GPTConfig(), 6e-4
    module, optimizer = gpt2.GPT(config), gpt2.make_optimizer(lr)
    params = gpt2.init_params(module, jax.random.key(2), 1024)
    state = optimizer.init(params)
    tokens = np.random.default_rng().integers(0, config.vocab_size, (8, 1025)).astype(np.int32)
    step = gpt2.make_train_step(module, optimizer)
    args = (params, state, tokens[:, :-1], tokens[:, 1:])

    got = jnova.compile(step)(*args)
    with jax.default_matmul_precision("tensorfloat32"):
        want = jax.jit(step)(*args)

    assert abs(float(got[2]) - float(want[2])) < 2e-3 * abs(float(want[2]))
    worst = {"params": 0.0, "mu": 0.0, "nu": 0.0}
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got[:2]), jax.tree.leaves(want[:2])):
        g, w, name = np.asarray(g, np.float64), np.asarray(w, np.float64), jax.tree_util.keystr(path)
        assert np.isfinite(g).all(), name
        if name.startswith("[0]"):  # parameters: |difference| within two updates of lr (+ decay)
            worst["params"] = max(worst["params"], np.abs(g - w).max() / lr)
        elif ".mu" in name or ".nu" in name:
            kind = "mu" if ".mu" in name else "nu"
            worst[kind] = max(worst[kind], np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
        else:  # the step count
            np.testing.assert_array_equal(g, w)
    print(f"AdamW step: loss {float(got[2]):.6f} vs {float(want[2]):.6f}; worst |dparams|/lr "
          f"{worst['params']:.2f}, mu rel err {worst['mu']:.1e}, nu rel err {worst['nu']:.1e}")
    assert worst["params"] <= 2.01 and worst["mu"] < 2e-2 and worst["nu"] < 4e-2
