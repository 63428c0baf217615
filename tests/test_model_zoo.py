"""The model zoo: whole training steps compiled by jnova against jax.jit on the CPU.

- an MLP with optax SGD + momentum, and with AdamW;
- a Llama-style decoder in flax.linen (RMSNorm, SwiGLU, rotary embeddings, grouped-query causal
  attention) with AdamW: in f32, and with bf16 compute over f32 master weights;
- layers under `nn.scan` (the Llama blocks) and under `lax.scan` (a residual MLP): jnova has no rule for
  control flow yet, so the scans run as XLA fallback ops, with a warning, listed in `stats()["fallbacks"]`;
  the step must still be right.
(GPT-2 with AdamW is in tests/test_models.py.)

Each step returns its gradients too, and runs twice: from the initial optimizer state, then both
implementations again from jax.jit's first result, so the second step exercises nonzero moments and
momentum without compounding the first step's rounding. Loss, gradients and optimizer state are held to
f32 tolerance (`models.sum_order_atol` for the longest sum); with bf16 compute, to a few times each leaf's
rounding noise, measured against the same step computed in f64. Updated parameters under AdamW: see
difftest/steps.py (a gradient at the rounding floor moves its parameter by +-lr with a sign that rounding
decides; the Llama here has no biases, so no gradient is zero in exact arithmetic, but the check does
not rely on that).
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jnova
from difftest import steps, zoo
from difftest.compare import BF16_U, Tolerance
from difftest.program import widen
from models import RTOL, fresh_seed, mlp, sum_order_atol

LR, B1, B2, EPS, WEIGHT_DECAY = 1e-3, 0.9, 0.999, 1e-8, 0.1
ADAMW = optax.adamw(LR, B1, B2, EPS, weight_decay=WEIGHT_DECAY)
SGD_MOMENTUM = optax.sgd(0.05, momentum=0.9)


def f32_tolerance(longest_sum: int) -> Tolerance:
    """rtol 1e-5 and 2 sqrt(n) roundoffs of each leaf's scale (tests/models/__init__.py)."""
    return Tolerance(rtol=RTOL, atol=sum_order_atol(longest_sum)(np.ones(1)))


def run_twice(step, args, *, expect_fallbacks=()):
    """(jnova results, jax.jit results) of two steps: from `args`, then from jax.jit's first results."""
    compiled = jnova.compile(step, fallback="xla" if expect_fallbacks else "error")
    reference = jax.jit(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = compiled(*args)
    want_first = reference(*args)
    fallback_warnings = [str(w.message) for w in caught if "is not compiled" in str(w.message)]
    for primitive in expect_fallbacks:
        assert any(f"'{primitive}'" in m for m in fallback_warnings), f"no fallback warning for {primitive}"
    assert sorted(set(compiled.stats()[0]["fallbacks"])) == sorted(expect_fallbacks)
    args2 = (want_first[0], want_first[1]) + tuple(args[2:])
    second, want_second = compiled(*args2), reference(*args2)
    assert compiled.compile_count == 1, "the second step recompiled"
    return (first, want_first, args), (second, want_second, args2)


def check_step(got, want, tol: Tolerance, *, adamw: bool, noise=None, what=""):
    """Loss, grads, optimizer state within tolerance; params too (AdamW: plus the allowance of steps.py)."""
    (params, state, loss, grads), (w_params, w_state, w_loss, w_grads) = got, want
    noise = noise or [0.0] * len(jax.tree.leaves(want))
    parts = {}   # leaf name -> its noise values, in the order of want's leaves
    for name, tree in zip(("params", "opt_state", "loss", "grads"), want):
        parts[name], noise = noise[:len(jax.tree.leaves(tree))], noise[len(jax.tree.leaves(tree)):]
    errors = []
    for name, g, w in (("opt_state", state, w_state), ("loss", loss, w_loss), ("grads", grads, w_grads)):
        errors += steps.leaf_errors(g, w, tol, parts[name], what=f"{what}{name}")
    if adamw:
        errors += steps.adamw_param_errors(params, w_params, state, w_state, lr=LR, b1=B1, b2=B2, eps=EPS, tol=tol)
    else:
        errors += steps.leaf_errors(params, w_params, tol, parts["params"], what=f"{what}params")
    assert not errors, "jnova's step differs from jax.jit's:\n  " + "\n  ".join(errors)


# --------------------------------------------------------------------------- MLP
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adamw"])
def test_mlp_step_matches_jit(optimizer):
    seed = fresh_seed()
    opt = SGD_MOMENTUM if optimizer == "sgd_momentum" else ADAMW
    params = mlp.init(jax.random.key(seed))
    x, y = mlp.batch(jax.random.key(seed + 1))
    step = zoo.supervised_step(mlp.loss, opt)
    for i, (got, want, _) in enumerate(run_twice(step, (params, opt.init(params), x, y))):
        check_step(got, want, f32_tolerance(64), adamw=optimizer == "adamw", what=f"step {i + 1}: ")


# --------------------------------------------------------------------------- Llama
LLAMA_LONGEST_SUM = 61 * 2 * 9   # the LM head's weight gradient sums over batch x time; the vocabulary is 61


def test_llama_adamw_f32_matches_jit():
    model, params, ids = zoo.llama_setup(fresh_seed())
    step = zoo.language_model_step(model, ADAMW)
    for i, (got, want, _) in enumerate(run_twice(step, (params, ADAMW.init(params), ids))):
        check_step(got, want, f32_tolerance(LLAMA_LONGEST_SUM), adamw=True, what=f"step {i + 1}: ")


def test_llama_bf16_compute_with_f32_master_weights_matches_jit():
    """Parameters, gradients and AdamW state in f32; matmuls, activations and attention in bf16."""
    model, params, ids = zoo.llama_setup(fresh_seed(), dtype=jnp.bfloat16)
    step = zoo.language_model_step(model, ADAMW)
    with jax.enable_x64(True):
        exact_step = jax.jit(zoo.language_model_step(model.clone(dtype=jnp.float64), ADAMW))
    tol = Tolerance(rtol=4 * BF16_U, atol=4 * BF16_U)
    for i, (got, want, args) in enumerate(run_twice(step, (params, ADAMW.init(params), ids))):
        assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves((got[0], got[3])))
        with jax.enable_x64(True):
            exact = exact_step(*widen(args))
        check_step(got, want, tol, adamw=True, noise=steps.noise_against(want, exact), what=f"step {i + 1}: ")


def test_llama_layers_under_nn_scan_run_as_fallback_and_match_jit():
    model, params, ids = zoo.llama_setup(fresh_seed(), scan_layers=True)
    step = zoo.language_model_step(model, SGD_MOMENTUM)
    runs = run_twice(step, (params, SGD_MOMENTUM.init(params), ids), expect_fallbacks=("scan",))
    for i, (got, want, _) in enumerate(runs):
        check_step(got, want, f32_tolerance(LLAMA_LONGEST_SUM), adamw=False, what=f"step {i + 1}: ")


def test_layers_under_lax_scan_run_as_fallback_and_match_jit():
    seed = fresh_seed()
    params = zoo.scanned_mlp_init(seed)
    rng = np.random.default_rng(seed)
    x, y = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32), jnp.asarray(rng.standard_normal((6, 5)), jnp.float32)
    step = zoo.supervised_step(zoo.scanned_mlp_loss, ADAMW)
    runs = run_twice(step, (params, ADAMW.init(params), x, y), expect_fallbacks=("scan",))
    for i, (got, want, _) in enumerate(runs):
        check_step(got, want, f32_tolerance(64), adamw=True, what=f"step {i + 1}: ")
