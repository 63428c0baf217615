"""Differential testing of jnova against XLA: random training programs, compiled both ways, compared.

- `program.py`: a program as data (inputs, one line of Python per statement, outputs) and as runnable
  source (`Program.source()`), the same text that runs, so a failure prints a paste-able reproduction;
- `generate.py`: the hypothesis strategy `programs()` that builds them;
- `compare.py`: running jnova and `jax.jit` on the same arguments, and the tolerance of each result leaf.

The number of examples per test comes from a profile, chosen with `JNOVA_DIFF_PROFILE`:
- `ci` (the default): bounded, derandomized, a couple of minutes on two CPU cores;
- `gpu`: for the GPU machine (`tests/gpu/test_gpu_differential.py`, at least 1000 programs), with larger
  dimensions that span several thread blocks; CPU tests run their `ci` counts;
- `long`: ten times more of everything, for a soak run (`JNOVA_DIFF_PROFILE=long pytest tests/test_differential.py`).
Every profile is derandomized (the same programs on every run: a CI failure reproduces locally); the
GPU test's shards draw from fixed seeds of their own.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from hypothesis import HealthCheck

from difftest.generate import DIMS


@dataclass(frozen=True)
class Profile:
    cpu: int            # examples of the CPU differential test (default kernel plan)
    fused: int          # examples compiled with kernels="fused" on the CPU (the GPU's kernel plan)
    gpu: int            # programs of the GPU differential test (all shards together)
    max_ops: int = 8
    dims: tuple[int, ...] = DIMS
    max_elements: int = 2048


PROFILES = {
    "ci": Profile(cpu=80, fused=30, gpu=1000),
    "gpu": Profile(cpu=80, fused=30, gpu=1000, dims=DIMS + (32, 33, 67, 128), max_elements=65536),
    "long": Profile(cpu=1000, fused=400, gpu=10000, max_ops=12),
}


def profile(default: str = "ci") -> Profile:
    name = os.environ.get("JNOVA_DIFF_PROFILE", default)
    if name not in PROFILES:
        raise ValueError(f"JNOVA_DIFF_PROFILE={name!r}: expected one of {sorted(PROFILES)}")
    return PROFILES[name]


def settings_for(max_examples: int, **overrides) -> dict:
    """Keyword arguments of `hypothesis.settings` for a differential test: derandomized, no deadline
    (one example compiles twice), no example database (derandomized runs need none)."""
    return {"max_examples": max_examples, "derandomize": True, "deadline": None, "database": None,
            "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
            "print_blob": True, **overrides}
