"""Models and helpers shared by the tests: fresh random seeds and tree comparisons with leaf paths.

Tolerances (f32): rtol 1e-5, plus an absolute term per leaf. Two f32 sums of the same n terms in
different orders (jnova's loops, XLA's blocked kernels) differ by about sqrt(n) units of roundoff of
the terms' scale, not of each result: an entry that cancels to near zero cannot be held to rtol. So
each leaf gets atol = 2 * sqrt(n) * 2**-24 * max|leaf|, n being the longest reduction in the step
(`sum_order_atol(n)`): about 1e-6 of the leaf's scale for the MLP (n = 64), 2.7e-5 for a GPT-2 whose
LM head contracts over the 50257-token vocabulary.
"""
from __future__ import annotations

import math
import os

import jax
import numpy as np

RTOL = 1e-5
F32_ROUNDOFF = 2.0**-24


def fresh_seed() -> int:
    """A new random seed per run, printed so that a failure can be replayed (JNOVA_TEST_SEED=<seed>)."""
    seed = int(os.environ.get("JNOVA_TEST_SEED") or np.random.SeedSequence().entropy % 2**31)
    print(f"seed = {seed} (replay with JNOVA_TEST_SEED={seed})")
    return seed


def sum_order_atol(n_terms: int):
    """atol(leaf) for results of f32 sums of up to n_terms terms: 2 sqrt(n) roundoffs of max|leaf|."""
    scale = 2 * math.sqrt(n_terms) * F32_ROUNDOFF

    def atol(want: np.ndarray) -> float:
        return scale * float(np.max(np.abs(want))) if want.size else 0.0

    return atol


SMALL_MODEL_ATOL = sum_order_atol(64)   # the MLP's and the small test functions' reductions


def assert_trees_close(got, want, *, rtol: float = RTOL, atol=SMALL_MODEL_ATOL, what: str = "result"):
    """Same tree structure, dtypes and shapes; values within rtol and `atol(want_leaf)` (a number or a function)."""
    assert jax.tree.structure(got) == jax.tree.structure(want), \
        f"{what}: tree structure {jax.tree.structure(got)} != {jax.tree.structure(want)}"
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
        name = f"{what}{jax.tree_util.keystr(path)}"
        g, w = np.asarray(g), np.asarray(w)
        assert (g.shape, g.dtype) == (w.shape, w.dtype), f"{name}: {g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}"
        if w.dtype.kind in "biu":
            np.testing.assert_array_equal(g, w, err_msg=name)
        else:
            tol = atol(w) if callable(atol) else atol
            np.testing.assert_allclose(g, w, rtol=rtol, atol=tol, err_msg=name)
