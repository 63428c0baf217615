"""How far each compiler's default-precision (TF32) gradients lie from the f32-accurate ones.

    JAX_PLATFORMS=cuda python benchmarks/tf32_error.py        # ~1 min on an H200

The three small training steps of tests/gpu/test_gpu_precision.py (an MLP with SGD momentum, a 2-layer
Llama block with AdamW, a tiny GPT with odd shapes), on fresh inputs: jnova and jax.jit under the default
precision, jax.jit under "tensorfloat32", and jax.jit under "float32" as the reference. Per gradient array
the relative error in norm, ||g - g_ref|| / ||g_ref||, printed per array, and the loss of each. XLA's
default equals its "tensorfloat32" where it runs every contraction in TF32.

Writes records (bench `tf32_error`; case the step, metrics `max_rel_err` and `median_rel_err` over its
gradient arrays and `loss_rel_err`; impl `jnova`, `xla`) to $OUT/tf32_error.jsonl when OUT is set,
tagged with JNOVA_SHA.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for folder in ("tests", "tests/gpu"):
    sys.path.insert(0, str(REPO / folder))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jnova  # noqa: E402
from test_gpu_precision import STEPS  # noqa: E402


def relative_error(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / (np.linalg.norm(ref) + 1e-30))


def main() -> None:
    records = []
    for name, make in STEPS.items():
        step, args = make()
        got = jnova.compile(step)(*args)
        want = jax.jit(step)(*args)
        with jax.default_matmul_precision("tensorfloat32"):
            tf32 = jax.jit(step)(*args)
        with jax.default_matmul_precision("float32"):
            exact = jax.jit(step)(*args)
        errors = {"jnova": [], "xla": []}
        for path, a, b, t, e in zip(jax.tree_util.tree_leaves_with_path(got[-1]),
                                    *(jax.tree.leaves(z[-1]) for z in (got, want, tf32, exact))):
            errors["jnova"].append(relative_error(a, e))
            errors["xla"].append(relative_error(b, e))
            print(f"{name} {jax.tree_util.keystr(path[0])}: jnova {errors['jnova'][-1]:.2e}  "
                  f"xla {errors['xla'][-1]:.2e}  xla tensorfloat32 {relative_error(t, e):.2e}  "
                  f"jnova - xla {relative_error(a, b):.2e}")
        for impl, result in (("jnova", got), ("xla", want)):
            loss = abs(float(result[-2]) - float(exact[-2])) / abs(float(exact[-2]))
            print(f"{name} {impl}: gradients {min(errors[impl]):.2e}..{max(errors[impl]):.2e}, loss {loss:.2e}")
            for metric, value in (("max_rel_err", max(errors[impl])), ("median_rel_err", float(np.median(errors[impl]))),
                                  ("loss_rel_err", loss)):
                records.append({"bench": "tf32_error", "device": jax.devices()[0].device_kind,
                                "date": datetime.date.today().isoformat(), "jax": jax.__version__,
                                "jnova": os.environ.get("JNOVA_SHA", "unknown"), "case": name,
                                "dtype": "float32", "impl": impl, "metric": metric, "value": value})
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "tf32_error.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
