"""Comparing whole training steps `(params, opt_state, ...) -> (params, opt_state, loss, grads)` of jnova
and jax.jit (tests/test_model_zoo.py).

Loss, gradients and optimizer state are compared leaf by leaf with the tolerance of `difftest.compare`
(f32: rtol + sqrt(n) roundoffs of each leaf's scale; with bf16 compute, a few times the leaf's rounding
noise, measured against the same step computed in f64).

Updated parameters under AdamW need more care: Adam's step lr * m_hat / (sqrt(v_hat) + eps) is
insensitive to the size of a gradient but not to its sign, so a parameter whose gradient is zero in
exact arithmetic (the key bias of attention: softmax ignores a constant shift of its scores) or at the
rounding floor moves by +-lr with a sign that rounding decides, in ANY implementation. The parameters are
therefore held to f32 tolerance plus what the (separately checked) difference of the moments can do to
the update, to first order and element by element:
    |d update| <= lr * (|d m_hat| / (sqrt(v_hat) + eps) + |m_hat| |d v_hat| / (2 sqrt(v_hat) (sqrt(v_hat) + eps)^2)),
doubled for safety. Where the moments agree to f32 precision (almost everywhere) that is f32 tolerance;
where a gradient is at its rounding floor it allows up to the +-lr of a flipped sign.
"""
from __future__ import annotations

import jax
import numpy as np

from difftest.compare import Tolerance


def leaf_errors(got, want, tol: Tolerance, noise=None, what: str = "") -> list[str]:
    """One line per leaf of `want` that `got` misses (same structure, shapes and dtypes required)."""
    assert jax.tree.structure(got) == jax.tree.structure(want), f"{what}: tree structures differ"
    noise = noise if noise is not None else [0.0] * len(jax.tree.leaves(want))
    out = []
    for (path, w), g, n in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got), noise):
        g, w = np.asarray(g), np.asarray(w)
        name = f"{what}{jax.tree_util.keystr(path)}"
        if (g.shape, g.dtype) != (w.shape, w.dtype):
            out.append(f"{name}: {g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}")
        elif w.dtype.kind in "biu":
            if not np.array_equal(g, w):
                out.append(f"{name}: integers differ")
        else:
            excess, i = tol.excess(g, w, n)
            if excess > 1:
                out.append(f"{name}: {excess:.3g}x the tolerance: jnova {g.reshape(-1)[i]} vs jax.jit {w.reshape(-1)[i]}")
    return out


def noise_against(want, exact) -> list[float]:
    """Per leaf, max |want - exact| (exact: the same step computed in f64)."""
    return [float(np.max(np.abs(np.asarray(w, np.float64) - np.asarray(e, np.float64)), initial=0.0))
            for w, e in zip(jax.tree.leaves(want), jax.tree.leaves(exact))]


def adamw_update_allowance(mu_got, mu_want, nu_got, nu_want, count: int, lr: float, b1: float, b2: float,
                           eps: float) -> np.ndarray:
    """How far two AdamW updates may differ given the two states' moments after the update (see above)."""
    mu_got, mu_want, nu_got, nu_want = (np.asarray(a, np.float64) for a in (mu_got, mu_want, nu_got, nu_want))
    m_hat, v_hat = mu_want / (1 - b1**count), np.maximum(nu_want, 0) / (1 - b2**count)
    dm, dv = np.abs(mu_got - mu_want) / (1 - b1**count), np.abs(nu_got - nu_want) / (1 - b2**count)
    root = np.sqrt(v_hat)
    first = dm / (root + eps)
    second = np.abs(m_hat) * dv / (2 * np.maximum(root, eps) * (root + eps) ** 2)
    return 2 * lr * (first + second)


def adamw_param_errors(params_got, params_want, state_got, state_want, *, lr: float, b1: float, b2: float,
                       eps: float, tol: Tolerance) -> list[str]:
    """Updated parameters within f32 tolerance plus `adamw_update_allowance` (optax.adamw's state)."""
    adam_got, adam_want = state_got[0], state_want[0]
    count = int(adam_want.count)
    out = []
    leaves = zip(jax.tree_util.tree_leaves_with_path(params_want), *(jax.tree.leaves(t) for t in (
        params_got, adam_got.mu, adam_want.mu, adam_got.nu, adam_want.nu)))
    for (path, want), got, mu_g, mu_w, nu_g, nu_w in leaves:
        want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
        allowed = (tol.rtol * np.abs(want) + tol.atol * np.max(np.abs(want), initial=0)
                   + adamw_update_allowance(mu_g, mu_w, nu_g, nu_w, count, lr, b1, b2, eps))
        bad = np.abs(got - want) > allowed
        if bad.any():
            out.append(f"params{jax.tree_util.keystr(path)}: {bad.sum()} entries beyond tolerance, e.g. "
                       f"{got[bad][:3]} vs {want[bad][:3]} (allowed {allowed[bad][:3]})")
    return out
