"""The GPT-2 example's training script on the GPU (`pytest -m gpu`): a tiny model trains a few steps under
jnova and jax.jit side by side, in each precision and attention a user picks, with the losses of both
compilers within the script's tolerance at every step (2e-3 relative in TF32, 2e-2 with bf16 modules)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers.gpu_launch import TARGET  # noqa: F401 (skips this module without a GPU)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "gpt2"))
import data  # noqa: E402
import train  # noqa: E402

pytestmark = pytest.mark.gpu
VOCAB = 512


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng()
    data.write_shard(str(folder / "r_val_000000.bin"), rng.integers(0, VOCAB, 20_000))
    data.write_shard(str(folder / "r_train_000001.bin"), rng.integers(0, VOCAB, 200_000))
    return str(folder)


@pytest.mark.parametrize("dtype,attention", [("float32", "xla"), ("float32", "manual"), ("bfloat16", "xla"),
                                             ("bfloat16", "cudnn")])
def test_example_trains_with_both_compilers(shards, tmp_path, dtype, attention):
    argv = ["--data", shards, "--vocab-size", str(VOCAB), "--model", "tiny", "--batch", "8", "--seq-len", "64",
            "--steps", "4", "--warmup-steps", "1", "--eval-interval", "2", "--eval-batches", "2", "--sample-tokens",
            "0", "--compiler", "both", "--dtype", dtype, "--attention", attention, "--out", str(tmp_path)]
    assert train.main(argv) == 0
    runs = {c: json.loads((tmp_path / f"{c}-seed0.json").read_text()) for c in ("jnova", "xla")}
    tol = 2e-2 if dtype == "bfloat16" else 2e-3
    np.testing.assert_allclose(runs["jnova"]["final_val_loss"], runs["xla"]["final_val_loss"], rtol=tol)
    assert all(r["mfu"] is not None and r["mfu"] > 0 for r in runs["jnova"]["rows"])
