"""Whole training steps compiled by jnova equal jax.jit's: an MLP with SGD, a Flax GPT-2 with AdamW, a
jitted value_and_grad; the GPT-2 example's data pipeline and its README command (loss parity with XLA).

Every step runs on fresh random inputs (the seed is printed; JNOVA_TEST_SEED replays it). Tolerances are
f32's: rtol 1e-5, plus an absolute term per leaf from the leaf's magnitude and the longest reduction
(models.sum_order_atol).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnova
from models import RTOL, assert_trees_close, fresh_seed, mlp, sum_order_atol
from models import gpt2

REPO = Path(__file__).resolve().parents[1]
BATCH, SEQ = 2, 32
VOCAB = 50257
GPT2_ATOL = sum_order_atol(VOCAB)   # the LM head's backward contracts over the vocabulary
LR, WEIGHT_DECAY, B1, EPS = 6e-4, 0.1, 0.9, 1e-8   # make_optimizer's AdamW


# --------------------------------------------------------------------------- (a) MLP, SGD
def test_mlp_sgd_step_matches_jit():
    seed = fresh_seed()
    params = mlp.init(jax.random.key(seed))
    x, y = mlp.batch(jax.random.key(seed + 1))
    step = jnova.compile(mlp.sgd_step)
    assert_trees_close(step(params, x, y), jax.jit(mlp.sgd_step)(params, x, y), what="sgd_step")


# --------------------------------------------------------------------------- (b) GPT-2, AdamW
class Gpt2Case:
    """A tiny GPT-2 (2 layers, d_model 64, GPT-2's vocabulary) and one AdamW step on real text."""

    def __init__(self, seed: int):
        m = gpt2.model
        self.config = m.GPTConfig.tiny(vocab_size=VOCAB)
        self.model = m.GPT(self.config)
        assert (self.config.n_layer, self.config.d_model) == (2, 64)
        self.optimizer = m.make_optimizer(LR, WEIGHT_DECAY)
        self.train_step = m.make_train_step(self.model, self.optimizer)
        self.params = m.init_params(self.model, jax.random.key(seed), SEQ)
        self.opt_state = self.optimizer.init(self.params)
        self.tokens, self.targets = map(jnp.asarray, gpt2.text_batch(seed, BATCH, SEQ))
        self.args = (self.params, self.opt_state, self.tokens, self.targets)
        self.step = jnova.compile(self.train_step)
        self.got = self.step(*self.args)
        self.want = jax.jit(self.train_step)(*self.args)


@pytest.fixture(scope="module")
def gpt2_case() -> Gpt2Case:
    return Gpt2Case(fresh_seed())


def adamw_first_step_bound(grad_a: np.ndarray, grad_b: np.ndarray) -> np.ndarray:
    """How far apart AdamW's first step can put a parameter, given two values of its gradient.

    From zero moments, Adam's bias-corrected update is lr * g / (|g| + eps), whose derivative
    lr * eps / (|g| + eps)^2 is largest where |g| is smallest: between the two gradients (mean value
    theorem) it is at most its value at the one nearer zero, or at zero if their signs differ. A gradient
    far above eps (nearly all) moves its parameter by lr whatever its rounding; one within ~eps of zero
    (e.g. the key bias, whose exact gradient is 0 as softmax ignores a constant shift of a row of scores)
    moves it by an amount that rounding decides. Never more than the largest possible move, 2 lr.
    """
    nearest = np.where(np.sign(grad_a) == np.sign(grad_b), np.minimum(np.abs(grad_a), np.abs(grad_b)), 0.0)
    return np.minimum(LR * EPS * np.abs(grad_a - grad_b) / (nearest + EPS) ** 2, 2 * LR)


@pytest.mark.slow
def test_gpt2_adamw_step_matches_jit(gpt2_case):
    (params, opt_state, loss), (want_params, want_state, want_loss) = gpt2_case.got, gpt2_case.want
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    adam, want_adam = opt_state[0], want_state[0]
    assert int(adam.count) == int(want_adam.count) == 1
    # first step from zero moments: mu = (1 - b1) * grad and nu = (1 - b2) * grad**2 (the gradients, checked)
    assert_trees_close(adam.mu, want_adam.mu, atol=GPT2_ATOL, what="mu")
    assert_trees_close(adam.nu, want_adam.nu, atol=GPT2_ATOL, what="nu")
    assert_trees_close(opt_state, want_state, atol=GPT2_ATOL, what="opt_state")
    # new parameters: within f32 tolerance, plus how far AdamW can move them apart given the (checked)
    # difference of the gradients (twice the bound: mu and nu round separately)
    conditioned = 0
    for (path, want), got, mu, want_mu in zip(jax.tree_util.tree_leaves_with_path(want_params), jax.tree.leaves(params),
                                              jax.tree.leaves(adam.mu), jax.tree.leaves(want_adam.mu)):
        want, got, mu, want_mu = (np.asarray(a, np.float64) for a in (want, got, mu, want_mu))
        from_grads = 2 * adamw_first_step_bound(mu / (1 - B1), want_mu / (1 - B1))
        tol = RTOL * np.abs(want) + GPT2_ATOL(want) + from_grads
        bad = np.abs(got - want) > tol
        assert not bad.any(), (f"params{jax.tree_util.keystr(path)}: {bad.sum()} entries differ beyond tolerance, "
                               f"e.g. {got[bad][:3]} vs {want[bad][:3]}")
        conditioned += int(np.sum(from_grads > GPT2_ATOL(want)))
    n_params = sum(p.size for p in jax.tree.leaves(want_params))
    assert conditioned < 1e-3 * n_params, f"{conditioned} of {n_params} parameters have a gradient at noise level"


def test_gpt2_step_holds_the_training_ops(gpt2_case):
    """The MLP's GELU (tanh form), forward and backward, is raised in every block, and every LayerNorm's
    forward (two per block and the final one) (passes/raise_training.py)."""
    text = gpt2_case.step.lower(*gpt2_case.args).as_text("nova")
    n_layer = gpt2_case.config.n_layer
    assert text.count('"nova.gelu"(') == n_layer and text.count('"nova.gelu_backward"(') == n_layer
    assert text.count('"nova.layernorm"(') == 2 * n_layer + 1
    assert 'approximate = "tanh"' in text and '"nova.tanh"' not in text


@pytest.mark.slow
def test_gpt2_step_is_one_function_with_forward_backward_and_update(gpt2_case):
    case = gpt2_case
    text = case.step.lower(*case.args).as_text("nova")
    assert case.step.compile_count == 1, "lowering the same signature again recompiled"
    assert len(re.findall(r"^\s*func\.func\b", text, re.M)) == 1, "the step is not one func.func"
    # every contraction of the forward pass has two in the backward pass (one per operand)
    forward = jax.make_jaxpr(lambda p: gpt2.model.loss_fn(case.model, p, case.tokens, case.targets))(case.params)
    n_forward = str(forward).count("dot_general[")
    assert n_forward == 6 * case.config.n_layer + 1          # qkv, QK^T, PV, proj, fc, proj per block; LM head
    # the attention (QK^T, PV and their four backward matmuls) is raised: one forward and one backward op per block
    assert text.count('"nova.attention"') == text.count('"nova.attention_backward"') == case.config.n_layer
    assert text.count('"nova.matmul"') >= 3 * (n_forward - 2 * case.config.n_layer)
    # AdamW: sqrt(nu_hat) once per parameter leaf, in the same function
    n_leaves = len(jax.tree.leaves(case.params))
    assert text.count('"nova.sqrt"') >= n_leaves
    # the function returns the step's results: new params, new optimizer state, loss
    returned = re.search(r"^\s*func\.return (.*?) : (.*)$", text, re.M)
    spell = {"float32": "f32", "int32": "i32"}
    want_types = [f"tensor<{''.join(f'{d}x' for d in leaf.shape)}{spell[str(leaf.dtype)]}>"
                  for leaf in jax.tree.leaves(case.want)]
    assert returned.group(2).strip().split(", ") == want_types
    assert len(returned.group(1).split(", ")) == len(want_types)


# --------------------------------------------------------------------------- (c) a jitted value_and_grad
def test_jitted_value_and_grad_mlp():
    seed = fresh_seed()
    params = mlp.init(jax.random.key(seed))
    x, y = mlp.batch(jax.random.key(seed + 1))
    fn = jax.jit(jax.value_and_grad(mlp.loss))
    assert_trees_close(jnova.compile(fn)(params, x, y), fn(params, x, y), what="value_and_grad")


@pytest.mark.slow
def test_jitted_value_and_grad_gpt2():
    seed = fresh_seed()
    m = gpt2.model
    model = m.GPT(m.GPTConfig.tiny(vocab_size=VOCAB))
    params = m.init_params(model, jax.random.key(seed), SEQ)
    tokens, targets = map(jnp.asarray, gpt2.text_batch(seed, BATCH, SEQ))
    fn = jax.jit(jax.value_and_grad(lambda p, x, y: m.loss_fn(model, p, x, y)))
    (loss, grads), (want_loss, want_grads) = jnova.compile(fn)(params, tokens, targets), fn(params, tokens, targets)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    assert_trees_close(grads, want_grads, atol=GPT2_ATOL, what="grads")


def test_vocabulary_contraction_as_accurate_as_xla():
    """The LM head's backward, dlogits[64, V] @ wte[V, 64], against float64: jnova within 3x of XLA's error."""
    key = jax.random.key(fresh_seed())
    probs = jax.nn.softmax(jax.random.normal(key, (64, VOCAB)), axis=-1)
    wte = 0.02 * jax.random.normal(jax.random.fold_in(key, 1), (VOCAB, 64))
    exact = np.asarray(probs, np.float64) @ np.asarray(wte, np.float64)

    def error(fn):
        return np.max(np.abs(np.asarray(fn(probs, wte), np.float64) - exact)) / np.max(np.abs(exact))

    matmul = lambda a, b: a @ b    # noqa: E731
    assert error(jnova.compile(matmul)) <= 3 * error(jax.jit(matmul))


# --------------------------------------------------------------------------- the GPT-2 example's data
def test_gpt2_tokenizer_is_gpt2s():
    tokenizer = gpt2.data.gpt2_tokenizer()
    assert tokenizer.encode("Hello world").ids == [15496, 995]
    assert tokenizer.get_vocab_size() == 50257
    assert tokenizer.token_to_id("<|endoftext|>") == gpt2.data.EOT == 50256


def test_packaged_corpora():
    plays = gpt2.data.corpus_documents("shakespeare")
    assert len(plays) == 38 and all(len(p) > 10_000 for p in plays)
    chapters = gpt2.data.corpus_documents("kjv")
    assert chapters[0].startswith("In the beginning God created the heaven and the earth.")
    assert not re.search(r"\b\d+\. ", chapters[0]), "verse numbers left in the text"
    with pytest.raises(ValueError, match="unknown corpus"):
        gpt2.data.corpus_documents("wikipedia")


def test_token_shards_llmc_and_raw(tmp_path):
    data = gpt2.data
    rng = np.random.default_rng(fresh_seed())
    a, b = rng.integers(0, 50257, 1000), rng.integers(0, 50257, 700)
    data.write_shard(str(tmp_path / "train_000.bin"), a)                  # llm.c: header + uint16
    (tmp_path / "train_001.bin").write_bytes(b.astype(np.uint16).tobytes())  # nanoGPT: flat uint16
    np.testing.assert_array_equal(data.read_shard(str(tmp_path / "train_000.bin")), a)
    np.testing.assert_array_equal(data.read_shard(str(tmp_path / "train_001.bin")), b)
    both = np.concatenate([a, b])
    for spec in (str(tmp_path), str(tmp_path / "train_*.bin")):
        np.testing.assert_array_equal(data.load_tokens(spec), both)
    x, y = data.Batches(both, 3, 16, seed=0).next()
    assert x.shape == y.shape == (3, 16) and x.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    with pytest.raises(FileNotFoundError, match="no token shard files"):
        data.load_tokens(str(tmp_path / "missing_*.bin"))
    bad = np.zeros(256, np.int32)
    bad[:3] = (data.LLMC_MAGIC, 1, 5)
    (tmp_path / "short.bin").write_bytes(bad.tobytes() + np.arange(3, dtype=np.uint16).tobytes())
    with pytest.raises(ValueError, match="header says 5 tokens"):
        data.read_shard(str(tmp_path / "short.bin"))


@pytest.mark.slow
def test_readme_main_command_trains_with_loss_parity():
    """`python examples/gpt2/train.py --small`: jnova and jax.jit side by side, parity at every step."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "examples/gpt2/train.py", "--small"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\s*\d+ \|", line)]
    assert len(rows) == 5, proc.stdout
    assert "loss parity OK" in proc.stdout
