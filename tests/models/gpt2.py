"""The GPT-2 of examples/gpt2 (one definition for the example and the tests) and batches of real text.

`examples/` is not a package, so its modules are loaded from their files. The tiny configuration is the
issue's: 2 layers, d_model 64, 4 heads, GPT-2's vocabulary; batches are random windows of a random
Shakespeare play encoded with GPT-2's BPE (the data packages of the README's install command).
"""
from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import numpy as np

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "gpt2"


def _load(name: str):
    module_name = f"gpt2_example_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, EXAMPLE_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


model = _load("model")     # GPT, GPTConfig, make_optimizer, make_train_step, loss_fn, init_params
data = _load("data")       # gpt2_tokenizer, corpus_documents, encode_documents, read_shard, ...


@functools.lru_cache(maxsize=1)
def _plays() -> list[str]:
    return data.corpus_documents("shakespeare")


@functools.lru_cache(maxsize=4)
def _play_tokens(index: int) -> np.ndarray:
    return data.encode_documents([_plays()[index]])


def text_batch(seed: int, batch: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) int32 [batch, seq_len]: random windows of a random play, as GPT-2 token ids."""
    rng = np.random.default_rng(seed)
    tokens = _play_tokens(int(rng.integers(len(_plays()))))
    return data.Batches(tokens, batch, seq_len, seed=seed).next()
