"""Run a program with jnova and with `jax.jit`, and compare every result leaf within the tolerance of the
arithmetic the program uses.

Tolerance of a leaf (`Tolerance.excess`): |jnova - jit| <= rtol * |jit| + atol * max|jit leaf|. The
absolute term is relative to the leaf's scale because a sum of n terms in another order differs by about
sqrt(n) roundoffs of the terms, not of the result (a result that cancels to near zero cannot be held to
rtol); see tests/models/__init__.py. The units of roundoff `u` are those of the least precise arithmetic
in the program:
- f32 programs: u = 2**-24. jnova's transcendental functions differ from XLA's by up to 16 ulp, and the
  backward pass of a chain multiplies such differences, hence rtol = 64 u (~4e-6) and atol = 64 u sqrt(n).
- programs with bf16 values: u = 2**-8. Elementwise bf16 arithmetic rounds alike on both sides (each op
  computes in f32 and rounds once), but XLA's CPU backend accumulates a bf16 reduction (the transpose of a
  broadcast in the backward pass) in bf16, with an error that grows like sqrt(n) u of the terms, where jnova
  accumulates in f32 (docs/bad_inputs.md, "Known differences"); rtol = 4 u and atol = 4 u sqrt(n).
- on a GPU, contractions in f32 run as TF32 in XLA by default and in jnova's tensor-core kernels: the
  comparison runs `jax.jit` at full f32 precision and allows TF32's u = 2**-10 (truncated operands, as
  wgmma reads them; every program contracts: its loss is a vdot of each output with its seed).
- n, the longest sum: of the program's reductions and contractions, and of its loss (the size of the
  largest output).
- where XLA's own result is far from exact (cancellation), or where XLA skips a bf16 rounding the program
  asks for (its default "excess precision": a bf16 intermediate kept in f32 inside a fusion, an f32 value
  cast to bf16 and back left unchanged on the GPU), `rounding_noise` measures by how much, against the
  program computed in f64 and against XLA without excess precision; jnova is allowed NOISE_FACTOR times it.
A structural bug (wrong axis, index, broadcast, missing term) is off by O(1) of the scale and fails all of
these by orders of magnitude.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass

import jax
import numpy as np

import jnova
from difftest.program import Program, widen

# TF32: wgmma (sm_90) drops the 13 low mantissa bits of its f32 operands (truncation: 2**-10, where
# rounding them, as mma.sync kernels and XLA do, gives 2**-11)
F32_U, TF32_U, BF16_U = 2.0**-24, 2.0**-10, 2.0**-8
NOISE_FACTOR = 4
NOISE_SAMPLES = 3


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float          # a fraction of the largest |value| of the leaf
    floor: float = 0.0   # an absolute term, for hand-written cases whose results are zero in exact arithmetic

    def excess(self, got: np.ndarray, want: np.ndarray, noise: float = 0.0) -> tuple[float, int]:
        """(largest |got - want| / allowed, flat index of it); <= 1 passes. NaN and inf must match exactly.
        `noise`: how far bf16 rounding moves this leaf (see `run`); NOISE_FACTOR times it is allowed too."""
        got, want = got.astype(np.float64), want.astype(np.float64)
        special = ~np.isfinite(want) | ~np.isfinite(got)
        if np.any(special & ~((got == want) | (np.isnan(got) & np.isnan(want)))):
            bad = special & ~((got == want) | (np.isnan(got) & np.isnan(want)))
            return math.inf, int(np.flatnonzero(bad)[0])
        finite = np.where(special, 0.0, want)
        scale = np.max(np.abs(finite), initial=0.0)
        allowed = self.rtol * np.abs(finite) + max(self.atol * scale, NOISE_FACTOR * noise, self.floor) + 1e-30
        ratio = np.abs(np.where(special, 0.0, got) - finite) / allowed
        if ratio.size == 0:
            return 0.0, 0
        i = int(np.argmax(ratio))
        return float(ratio.reshape(-1)[i]), i


def tolerance(program: Program, backend: str = "cpu") -> Tolerance:
    if program.has_bf16:
        u, k = BF16_U, 4
    elif backend == "gpu":   # every program has a contraction on the GPU: the loss's vdot
        u, k = TF32_U, 4
    else:
        u, k = F32_U, 64
    return Tolerance(rtol=k * u, atol=k * u * math.sqrt(program.longest_sum))


@dataclass
class Outcome:
    got: object
    want: object
    stats: dict
    mismatches: list[str]


def run(program: Program, seed: int, *, backend: str = "cpu", kernels: str = "auto") -> Outcome:
    """Compile the program with jnova (fallback="error": every primitive must compile) and with jax.jit,
    run both on the same arguments and compare."""
    step = program.step()
    params, data = program.arguments(seed)
    device = jax.devices(backend)[0]
    params, data = jax.device_put((params, data), device)
    compiled = jnova.compile(step, fallback="error", kernels=kernels, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # a fallback warning would mean an op jnova did not compile
        got = compiled(params, data)
    tol = tolerance(program, backend)
    # on a GPU, XLA's reference runs its contractions in full f32 (TF32 is its default there)
    with jax.default_matmul_precision("float32") if backend == "gpu" else contextlib.nullcontext():
        reference = jax.jit(step)
        want = reference(params, data)
        noise = rounding_noise(program, reference, params, data, want)
    return Outcome(got, want, compiled.stats()[0], compare(got, want, tol, noise))


def rounding_noise(program: Program, reference, params, data, want, samples: int = NOISE_SAMPLES) -> list[float]:
    """Per result leaf, how far rounding moves it in XLA's own computation:
    - max |reference(args) - program in f64(args)| over the given arguments and `samples` nearby ones
      (`_nudge`), so that one lucky rounding does not set the bar. A leaf that cancels (a loss summing
      terms of both signs; a variance E[x^2] - E[x]^2 of values far from zero; a gradient that is zero in
      exact arithmetic, like that of a bias followed by a normalization) moves by far more than its own
      scale times u;
    - with bf16 values: |reference - the same under xla_allow_excess_precision=False|. By default XLA may
      skip the rounding of a bf16 intermediate inside a fusion (tanh in f32 fed to a mean unrounded); jnova
      rounds every value to its dtype, as the strict XLA does.
    jnova is held to NOISE_FACTOR times that noise."""
    rng = np.random.default_rng(len(jax.tree.leaves(want)))
    with jax.enable_x64(True):
        wide = jax.jit(program.widened().step())
    noise = None
    for k in range(samples + 1):
        args = (params, data) if k == 0 else jax.tree.map(lambda a: _nudge(np.asarray(a), rng), (params, data))
        got = want if k == 0 else reference(*args)
        with jax.enable_x64(True):
            exact = wide(*widen(args))
        noise = _max_errors(noise, got, exact)
    if program.has_bf16:
        strict = jax.jit(program.step(), compiler_options={"xla_allow_excess_precision": False})(params, data)
        noise = _max_errors(noise, want, strict)
    return noise


def _max_errors(noise, got, want) -> list[float]:
    errors = [float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)), initial=0.0))
              for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    return errors if noise is None else [max(a, b) for a, b in zip(noise, errors)]


def _nudge(a: np.ndarray, rng) -> np.ndarray:
    """a scaled by 1 + e * uniform(-1, 1): e = 1e-3 for f32, a few ulps (2**-6) for bf16, whose values
    a smaller nudge would round back to themselves."""
    if a.dtype.kind not in "fV":
        return a
    e = 1e-3 if a.dtype.kind == "f" else 2.0**-6
    return (a.astype(np.float64) * (1 + e * rng.uniform(-1, 1, a.shape))).astype(a.dtype)


def compare(got, want, tol: Tolerance, noise: list[float] | None = None) -> list[str]:
    """One line per leaf outside tolerance (structure, shape and dtype must match exactly)."""
    if jax.tree.structure(got) != jax.tree.structure(want):
        return [f"tree structure {jax.tree.structure(got)} != {jax.tree.structure(want)}"]
    out = []
    noise = noise or [0.0] * len(jax.tree.leaves(want))
    for (path, w), g, n in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got), noise):
        name = _leaf_name(path)
        g, w = np.asarray(g), np.asarray(w)
        if (g.shape, g.dtype) != (w.shape, w.dtype):
            out.append(f"{name}: {g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}")
            continue
        excess, i = tol.excess(g, w, n)
        if excess > 1:
            at = np.unravel_index(i, w.shape) if w.shape else ()
            out.append(f"{name}: {excess:.3g}x the tolerance at {tuple(map(int, at))}: jnova {g.reshape(-1)[i]!r} vs "
                       f"jax.jit {w.reshape(-1)[i]!r} (leaf scale {np.max(np.abs(w.astype(np.float64)), initial=0):.3g})")
    return out


def _leaf_name(path) -> str:
    """`loss`, `outs[1]` or `grad p0` for a leaf of ((loss, outs), grads)."""
    keys = [getattr(k, "idx", getattr(k, "key", k)) for k in path]
    if keys[0] == 0:
        return "loss" if keys[1] == 0 else f"outs[{keys[2]}]"
    return f"grad {keys[1]}"


def check(program: Program, seed: int, **options) -> Outcome:
    """Run and assert: the failure message holds the program's source and a script that reruns it."""
    outcome = run(program, seed, **options)
    if outcome.mismatches:
        raise AssertionError(
            "jnova differs from jax.jit:\n  " + "\n  ".join(outcome.mismatches)
            + f"\n\nprogram (seed {seed}, options {options}):\n{program.source()}"
            + f"\nrerun from tests/ with:\n{program.repro(seed, **options)}")
    return outcome
