"""The form of tests/test_user_models.py's training steps (user_steps.py and more_user_steps.py build
them): a step, its arguments, and how its results are compared with jax.jit's (user_steps.py says why)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import optax


@dataclass
class UserStep:
    step: Callable
    args: tuple
    n_state: int                # leading results that are the next step's leading arguments
    adam_lr: float | None = None
    options: dict = field(default_factory=dict)   # jnova.compile / jax.jit keyword arguments
    fallbacks: tuple = ()       # the primitives that run as XLA ops
    rtol: float = 1e-5          # of each value, and (scale_atol) of the largest of its leaf
    scale_atol: float = 2e-5    # (16-bit arithmetic: technique_steps.BF16_RTOL)
    atol: dict = field(default_factory=dict)   # result index -> an absolute floor, for a result that
                                               # cancels (2 - 2 cos: the rounding of its terms, not of it)


def _normal(rng, *shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def _with_grads(loss_fn, opt, has_aux=False):
    """(params, opt_state, *batch) -> (params, opt_state, loss, grads)."""

    def step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, *batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return step


def _labels(rng, n, classes):
    return jnp.asarray(rng.integers(0, classes, (n,)), jnp.int32)
