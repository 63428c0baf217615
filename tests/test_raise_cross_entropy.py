"""raise_cross_entropy: softmax cross-entropy as users write it (optax's integer-label and one-hot
losses, jax.nn.log_softmax with take_along_axis or a one-hot, an ignored label masked out), forward
and the backward JAX's AD produced, becomes nova.sce and nova.sce_backward; the forward's softmax and
log-softmax are then dead; what is not softmax cross-entropy stays as it was, with the reason logged.

Each step is `jax.value_and_grad` of the loss, compiled with a kernel per fusion group on the CPU
(kernels="fused"), f32 logits and bf16 logits widened to f32 for the loss (as the GPT-2 example
writes it), [N, V] and [B, T, V]; and losses computed in bf16 throughout. Oracle: jax.jit of the
same step (in bf16 throughout: the f32 computation, which jnova must be at least as close to).
"""
import logging
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jnova
from jnova.passes.dce import dce
from jnova.passes.raise_cross_entropy import raise_cross_entropy
from jnova.primitives import backends
from jnova.primitives.nova_to_jax import evaluate_op
from helpers.attention import compare_with_jit
from helpers.nova_funcs import nova_func
from helpers.random_inputs import normal

V = 24
IGNORE = -100
TOL = {"float32": dict(rtol=1e-5, atol=1e-6), "bfloat16": dict(rtol=1e-5, atol=1e-6)}  # the loss is f32 in both


def _ignored_mean(logits, labels):
    keep = labels != IGNORE
    rows = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(keep, labels, 0))
    return jnp.where(keep, rows, 0.0).sum() / jnp.maximum(keep.sum(), 1)


def _ignored_sum(logits, labels):
    keep = labels != IGNORE
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.where(keep, labels, 0)[..., None], axis=-1)[..., 0]
    return -jnp.where(keep, picked, 0.0).sum()


FORMS = {
    "optax_mean": lambda lg, lb: optax.softmax_cross_entropy_with_integer_labels(lg, lb).mean(),
    "optax_sum": lambda lg, lb: optax.softmax_cross_entropy_with_integer_labels(lg, lb).sum(),
    "take_along_mean": lambda lg, lb: -jnp.take_along_axis(jax.nn.log_softmax(lg), lb[..., None], axis=-1).mean(),
    "take_along_sum": lambda lg, lb: -jnp.take_along_axis(jax.nn.log_softmax(lg), lb[..., None], axis=-1).sum(),
    "one_hot_mean": lambda lg, lb: -(jax.nn.one_hot(lb, V) * jax.nn.log_softmax(lg)).sum(-1).mean(),
    "optax_one_hot": lambda lg, lb: optax.softmax_cross_entropy(lg, jax.nn.one_hot(lb, V)).mean(),
    "ignored_mean": _ignored_mean,
    "ignored_sum": _ignored_sum,
}
# nova.sce's reduction and ignore_index for each form: a one-hot of a label outside [0, V) is a row of
# zeros, so the one-hot forms are the sum of the rows whose label is in range (those outside ignored)
REDUCTION = {"optax_sum": "sum", "take_along_sum": "sum", "ignored_sum": "sum", "one_hot_mean": "sum",
             "optax_one_hot": "sum"}
IGNORED = {"ignored_mean": IGNORE, "ignored_sum": IGNORE, "one_hot_mean": -1, "optax_one_hot": -1}
SHAPES = {"NV": (12,), "BTV": (2, 5)}


def _step(form: str, dtype: str):
    loss = FORMS[form]

    def step(logits, labels):
        return jax.value_and_grad(lambda x: loss(x.astype(jnp.float32), labels))(logits)

    return step if dtype == "bfloat16" else jax.value_and_grad(loss)


def _inputs(rng, rows, dtype, *, ignore=False):
    logits = jnp.asarray(normal(rng, rows + (V,), dtype, scale=2.0))
    labels = rng.integers(0, V, rows).astype(np.int32)
    flat = labels.reshape(-1)
    flat[0], flat[-1] = 0, V - 1          # the first and the last class
    if ignore:
        flat[1] = flat[len(flat) // 2] = IGNORE
    return logits, jnp.asarray(labels)


def _assert_close(got, want, dtype="float32"):
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if dtype == "bfloat16" and i == 1:   # dlogits: computed in f32, rounded once to bf16 (as jax.jit)
            tol = dict(rtol=1e-2, atol=1e-2 * max(float(np.abs(b).max()), 1e-6))
        else:
            tol = dict(rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * max(float(np.abs(b).max()), 1e-6))
        np.testing.assert_allclose(a, b, err_msg=f"leaf #{i}", **tol)


_LINE = re.compile(r'^\s*(%[\w]+)(?::\d+)? = "(nova\.\w+)"\((.*?)\).*-> (.*)$')


def _nova_values(text: str):
    """(op name, result types text) of every op line of the nova text."""
    for line in text.splitlines():
        m = _LINE.match(line.split(" loc(")[0])
        if m:
            yield m.group(2), m.group(4)


def _assert_no_saved_softmax(text: str, rows: int):
    """No f32 value of the logits' size is computed other than the logits themselves (a reshape, a
    convert, the LM head's matmul) and nova.sce_backward's dlogits: the softmax is dead."""
    for name, results in _nova_values(text):
        for body in re.findall(r"tensor<([^>]*)>", results):
            dims, dtype = body.split("x")[:-1], body.split("x")[-1]
            if dtype == "f32" and dims and int(np.prod([int(d) for d in dims])) == rows * V:
                assert name in ("nova.reshape", "nova.convert", "nova.sce_backward", "nova.matmul"), (name, results)
    assert '"nova.exp"' not in text


def _compiled(step, *args):
    compiled = jnova.compile(step, kernels="fused")
    return compiled, compiled(*args), compiled.lower(*args).as_text("nova")


@pytest.mark.parametrize("shape", ["NV", "BTV"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", list(FORMS))
def test_cross_entropy_forms_are_raised_and_match_jit(form, dtype, shape):
    if shape == "NV" and dtype == "bfloat16" and form not in ("optax_mean", "ignored_mean"):
        pytest.skip("bf16 logits are checked at [B, T, V] for every form, at [N, V] for two")
    rng = np.random.default_rng()
    rows = SHAPES[shape]
    args = _inputs(rng, rows, dtype, ignore=form.startswith("ignored"))
    step = _step(form, dtype)
    _, got, text = _compiled(step, *args)
    _assert_close(got, jax.jit(step)(*args), dtype)
    assert '"nova.sce"' in text and '"nova.sce_backward"' in text, text
    sce = next(line for line in text.splitlines() if '"nova.sce"' in line)
    assert f'reduction = "{REDUCTION.get(form, "mean")}"' in sce, sce
    if form in IGNORED:
        assert "has_ignore = true" in sce and f"ignore_index = {IGNORED[form]} " in sce, sce
    else:
        assert "has_ignore = false" in sce, sce
    _assert_no_saved_softmax(text, int(np.prod(rows)))


@pytest.mark.parametrize("form", ["optax_mean", "take_along_sum", "one_hot_mean", "ignored_mean"])
def test_cross_entropy_computed_in_bf16_is_raised(form):
    """The loss in bf16 throughout (every step rounded to bf16, as jax.jit computes it): nova.sce reads the
    bf16 logits and computes in f32, so its results are at least as close to the f32 loss as jax.jit's."""
    rng = np.random.default_rng()
    args = _inputs(rng, (2, 5), "bfloat16", ignore=form.startswith("ignored"))
    lowered = compare_with_jit(jax.value_and_grad(FORMS[form]), *args, dtype="bfloat16", kernels="fused")
    text = lowered.as_text("nova")
    assert '"nova.sce"' in text and '"nova.sce_backward"' in text, text
    sce = next(line for line in text.splitlines() if '"nova.sce"' in line)
    assert "tensor<10x24xbf16>" in sce, sce
    _assert_no_saved_softmax(text, 10)


def test_the_raised_ops_replace_the_loss_and_the_gradient_in_the_nova_function(caplog):
    rng = np.random.default_rng()
    args = _inputs(rng, (2, 5), "float32")
    func = nova_func(_step("optax_mean", "float32"), *args)
    with caplog.at_level(logging.INFO, logger="jnova.passes"):
        assert raise_cross_entropy(func, evaluate_op) == {"nova.sce": 1, "nova.sce_backward": 1}
    dce(func)
    func.verify()
    names = [op.name for op in func.ops]
    assert not {"nova.exp", "nova.log", "nova.gather", "nova.scatter"} & set(names), names
    assert any("nova.sce (reduction mean;" in r.getMessage() and "on tensor<2x5x24xf32>" in r.getMessage()
               for r in caplog.records)
    sce = next(op for op in func.ops if op.name == "nova.sce")
    back = next(op for op in func.ops if op.name == "nova.sce_backward")
    assert back.operands[2] is sce.results[1]          # the backward reads the forward's lse
    assert sce.operands[0].type.shape == (10, V)       # batch and sequence folded into the rows


def test_labels_at_the_first_and_last_class_only():
    rng = np.random.default_rng()
    logits = jnp.asarray(normal(rng, (2, 4, V), scale=3.0))
    step = _step("optax_mean", "float32")
    for labels in (jnp.zeros((2, 4), jnp.int32), jnp.full((2, 4), V - 1, jnp.int32)):
        _, got, text = _compiled(step, logits, labels)
        _assert_close(got, jax.jit(step)(logits, labels))
        assert '"nova.sce"' in text


@pytest.mark.parametrize("form", list(FORMS))
def test_labels_out_of_range_give_what_each_form_gives(form):
    """A negative label, one past the end, the type's extremes: take_along_axis counts negative labels
    from the end and gathers NaN past it (its scatter-add drops the gradient's update), a one-hot of
    them is a row of zeros; the raised ops give the same (NaN where jax.jit has NaN)."""
    rng = np.random.default_rng()
    logits, labels = _inputs(rng, (2, 5), "float32", ignore=form.startswith("ignored"))
    flat = np.asarray(labels).reshape(-1).copy()
    flat[[2, 4, 6, 8]] = [-1, V, -V - 3, 2**31 - 1]
    for outside in (flat, np.where(np.arange(10) == 2, -(2**31), np.where(flat < 0, 1, flat))):
        labels = jnp.asarray(outside.reshape(2, 5).astype(np.int32))
        step = _step(form, "float32")
        _, got, text = _compiled(step, logits, labels)
        assert '"nova.sce"' in text and '"nova.sce_backward"' in text
        _assert_close(got, jax.jit(step)(logits, labels))


def test_a_loss_times_a_constant_and_a_traced_cotangent():
    """2 * mean cross-entropy, inside a function whose output is scaled by a value of the step: the
    loss is nova.sce times 2, the gradient nova.sce_backward of the traced cotangent."""
    rng = np.random.default_rng()
    logits, labels = _inputs(rng, (3, 4), "float32")
    w = jnp.asarray(normal(rng, ()))

    def step(logits, labels, w):
        def loss(x):
            return 2.0 * optax.softmax_cross_entropy_with_integer_labels(x, labels).mean()
        value, pullback = jax.vjp(loss, logits)
        return value, pullback(w)[0]

    _, got, text = _compiled(step, logits, labels, w)
    _assert_close(got, jax.jit(step)(logits, labels, w))
    assert '"nova.sce"' in text and '"nova.sce_backward"' in text, text
    _assert_no_saved_softmax(text, 12)


def test_a_loss_weighted_by_a_float_mask():
    """(ce * mask).sum() / mask.sum(), the mask an input: the rows' loss is nova.sce's (reduction none),
    the gradient nova.sce_backward of the cotangent mask / mask.sum() AD computed for them."""
    rng = np.random.default_rng()
    logits, labels = _inputs(rng, (2, 5), "float32")
    mask = jnp.asarray(rng.integers(0, 2, (2, 5)).astype(np.float32)).at[0, 0].set(1.0)

    def loss(x, labels, mask):
        return (optax.softmax_cross_entropy_with_integer_labels(x, labels) * mask).sum() / mask.sum()

    step = jax.value_and_grad(loss)
    _, got, text = _compiled(step, logits, labels, mask)
    _assert_close(got, jax.jit(step)(logits, labels, mask))
    assert '"nova.sce"' in text and '"nova.sce_backward"' in text, text
    assert 'reduction = "none"' in next(line for line in text.splitlines() if '"nova.sce_backward"' in line)
    _assert_no_saved_softmax(text, 10)


def test_label_smoothing_is_refused_and_stays_correct(caplog):
    rng = np.random.default_rng()
    args = _inputs(rng, (2, 5), "float32")

    def step(logits, labels):
        return jax.value_and_grad(lambda x: optax.softmax_cross_entropy(
            x, optax.smooth_labels(jax.nn.one_hot(labels, V), 0.1)).mean())(logits)

    with caplog.at_level(logging.DEBUG, logger="jnova.passes"):
        _, got, text = _compiled(step, *args)
    _assert_close(got, jax.jit(step)(*args))
    assert '"nova.sce"' not in text
    assert any("raise_cross_entropy" in r.getMessage() and "cross-entropy's values" in r.getMessage()
               for r in caplog.records)


def test_a_log_softmax_read_elsewhere_is_refused_and_stays_correct(caplog):
    """Cross-entropy plus the entropy of the same log-softmax: raising would compute the softmax twice."""
    rng = np.random.default_rng()
    args = _inputs(rng, (2, 5), "float32")

    def loss(logits, labels):
        lsm = jax.nn.log_softmax(logits)
        ce = -jnp.take_along_axis(lsm, labels[..., None], axis=-1).mean()
        return ce + 0.1 * (jnp.exp(lsm) * lsm).sum(-1).mean()

    step = jax.value_and_grad(loss)
    with caplog.at_level(logging.DEBUG, logger="jnova.passes"):
        _, got, text = _compiled(step, *args)
    _assert_close(got, jax.jit(step)(*args))
    assert '"nova.sce"' not in text
    assert any("raise_cross_entropy" in r.getMessage() and "also read by" in r.getMessage() for r in caplog.records)


def test_transposed_logits_are_raised_and_another_axis_is_refused(caplog):
    """Rows of x.T are softmax cross-entropy's rows (raised on the transpose); a softmax over the first
    axis is not nova.sce's (its log-sum-exp is not over the last dimension): refused, logged, correct."""
    rng = np.random.default_rng()
    logits = jnp.asarray(normal(rng, (V, 6)))
    labels = jnp.asarray(rng.integers(0, V, (6,)).astype(np.int32))
    transposed = jax.value_and_grad(lambda x, lb: optax.softmax_cross_entropy_with_integer_labels(x.T, lb).mean())
    _, got, text = _compiled(transposed, logits, labels)
    _assert_close(got, jax.jit(transposed)(logits, labels))
    assert '"nova.sce"' in text and '"nova.sce_backward"' in text
    first_axis = jax.value_and_grad(
        lambda x, lb: optax.softmax_cross_entropy_with_integer_labels(x, lb, axis=0).mean())
    with caplog.at_level(logging.DEBUG, logger="jnova.passes"):
        _, got, text = _compiled(first_axis, logits, labels)
    _assert_close(got, jax.jit(first_axis)(logits, labels))
    assert '"nova.sce"' not in text
    assert any("raise_cross_entropy" in r.getMessage() and "not the last" in r.getMessage() for r in caplog.records)


def test_the_gpu_raises_cross_entropy_and_not_the_norms():
    assert backends.keeps_training_op("nova.sce", "gpu", per_group=True)
    assert backends.keeps_training_op("nova.sce_backward", "gpu", per_group=True)
    assert not backends.keeps_training_ops("gpu", per_group=True)   # GELU and the norms: the decomposition
    assert backends.keeps_training_op("nova.sce", "cpu", per_group=True)
    assert backends.keeps_training_op("nova.sce_backward", "cpu", per_group=False)
    assert not backends.keeps_training_ops("cpu", per_group=True)
    lowered = jnova.compile(_step("optax_mean", "float32"), backend="gpu", target="h200").lower(
        *_inputs(np.random.default_rng(), (2, 5), "float32"))
    assert '"nova.sce"' in lowered.as_text("nova") and '"nova.sce_backward"' in lowered.as_text("nova")
    assert lowered.as_text("launches").count("sce_rows(") == 2  # the GPU's cross-entropy kernels


GPT2 = Path(__file__).resolve().parents[1] / "examples" / "gpt2"


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_gpt2_tiny_step_raises_its_loss(dtype):
    sys.path.insert(0, str(GPT2))
    import model

    rng = np.random.default_rng()
    vocab, t = 96, 16
    gpt = model.GPT(model.GPTConfig.tiny(vocab_size=vocab, dtype=jnp.bfloat16 if dtype else None))
    params = model.init_params(gpt, jax.random.key(int(rng.integers(1 << 30))), t)
    tokens = jnp.asarray(rng.integers(0, vocab, (2, t)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, vocab, (2, t)), jnp.int32)

    def step(params, tokens, targets):
        return jax.value_and_grad(lambda p: model.loss_fn(gpt, p, tokens, targets))(params)

    compiled = jnova.compile(step, kernels="fused")
    got, want = compiled(params, tokens, targets), jax.jit(step)(params, tokens, targets)
    text = compiled.lower(params, tokens, targets).as_text("nova")
    assert '"nova.sce"' in text and '"nova.sce_backward"' in text
    rtol = 1e-4 if dtype is None else 2e-2
    np.testing.assert_allclose(got[0], want[0], rtol=rtol)
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]))):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * max(float(np.abs(b).max()), 1e-6), err_msg=f"grad #{i}")


def test_logits_rounded_to_bf16_are_read_after_their_rounding():
    """An LM head's f32 product rounded to bf16 logits, cast to f32 for the loss: nova.sce reads the
    bf16 logits (the cast back is exact), not the product before the user's rounding."""
    rng = np.random.default_rng()
    h, w = normal(rng, (6, 8), "float32"), normal(rng, (8, V), "float32")
    labels = jnp.asarray(rng.integers(0, V, 6).astype(np.int32))

    def loss(h, w, labels):
        logits = (h @ w).astype(jnp.bfloat16)
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()

    step = jax.value_and_grad(loss, argnums=(0, 1))
    _, got, text = _compiled(step, h, w, labels)
    sce = next(line for line in text.splitlines() if '"nova.sce"' in line)
    assert sce.split(" : (")[1].startswith(f"tensor<6x{V}xbf16>"), sce
    with jax.default_matmul_precision("float32"):
        want = jax.jit(step)(h, w, labels)
    _assert_close(got, want, "bfloat16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_masked_mean_of_widened_bf16_logits_divides_by_the_rows_kept(dtype):
    """bf16 logits cast to f32, the ignored rows masked out and the sum divided by the rows kept: an f32
    loss, whose probes match to f32's rounding (at bf16's, a sum times 1 / PROBE_ROWS matched too, on
    the probes of 1000 classes)."""
    rng = np.random.default_rng()
    n, v = 512, 1000
    logits = jnp.asarray(normal(rng, (n, v), dtype, scale=3.0))
    labels = rng.integers(0, v, n).astype(np.int32)
    labels[6:64] = IGNORE

    def loss(logits, labels):
        per_row = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                                  jnp.where(labels == IGNORE, 0, labels))
        keep = labels != IGNORE
        return jnp.sum(jnp.where(keep, per_row, 0.0)) / jnp.maximum(keep.sum(), 1)

    step = jax.value_and_grad(loss)
    _, got, text = _compiled(step, logits, jnp.asarray(labels))
    assert '"nova.sce"' in text and "ignore_index = -100" in text
    _assert_close(got, jax.jit(step)(logits, jnp.asarray(labels)), dtype)


@pytest.mark.parametrize("kept", [lambda labels: labels >= 0, lambda labels: labels < V], ids=[">=0", "<V"])
def test_a_mean_over_the_rows_a_comparison_keeps_is_not_a_constant_times_the_sum(kept):
    """One-hot cross-entropy divided by the count of labels >= 0 (or < V): a label past the end (or a
    negative one) adds nothing to the sum but counts. The probes all kept every row where the loss
    was not zero, so the count looked like the constant 1 / PROBE_ROWS, and the loss and its
    gradient were raised as the sum times 0.2; they are no form of nova.sce's and stay as written."""
    rng = np.random.default_rng()
    logits, labels = _inputs(rng, (12,), "float32")
    labels = labels.at[jnp.array([3, 7])].set(jnp.array([-1, V]))

    def loss(x, labels):
        rows = -(jax.nn.one_hot(labels, V) * jax.nn.log_softmax(x)).sum(-1)
        keep = kept(labels)
        return jnp.sum(rows * keep) / jnp.maximum(keep.sum(), 1)

    step = jax.value_and_grad(loss)
    _, got, _ = _compiled(step, logits, labels)
    _assert_close(got, jax.jit(step)(logits, labels))


WIDE_V = 512  # classes enough that random probe labels miss the few a table or a set singles out


def _class_weighted(x, labels):
    weights = jnp.ones(WIDE_V).at[jnp.array([1, 2])].set(0.0).at[7].set(3.0)[labels]  # per-class weights
    rows = optax.softmax_cross_entropy_with_integer_labels(x, labels)
    return jnp.sum(rows * weights) / jnp.sum(weights)


def _special_ids_masked(x, labels):
    keep = ~jnp.isin(labels, jnp.array([1, 2]))   # no loss at the BOS / EOS targets
    rows = optax.softmax_cross_entropy_with_integer_labels(x, labels)
    return jnp.where(keep, rows, 0.0).sum() / keep.sum()


def _labels_below(x, labels):
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(x, labels) * (labels < 9)) / labels.size


def _clipped_probabilities(x, labels):
    probs = jnp.clip(jax.nn.softmax(x), 1e-7, 1.0)  # a "safe log", Keras style
    return -jnp.mean(jnp.sum(jax.nn.one_hot(labels, WIDE_V) * jnp.log(probs), axis=-1))


@pytest.mark.parametrize("loss", [_class_weighted, _special_ids_masked, _labels_below, _clipped_probabilities])
def test_what_random_probe_rows_cannot_tell_from_cross_entropy_stays_as_written(loss):
    """Losses that equal softmax cross-entropy on rows of random labels and moderate logits, and not
    on others: weights looked up per class, a mask of a few special labels (its count divided by), an
    ordering comparison of the labels, a clip of the probabilities that binds only for logits far
    apart. The first two and the last were raised as a constant times nova.sce, silently wrong; each
    stays as written."""
    rng = np.random.default_rng()
    logits = jnp.asarray(normal(rng, (12, WIDE_V), "float32", scale=16.0))   # probabilities below the clip
    labels = jnp.asarray(rng.integers(0, WIDE_V, 12).astype(np.int32)).at[:4].set(jnp.array([1, 2, 7, 3]))
    step = jax.value_and_grad(loss)
    for compiled in (jnova.compile(step), jnova.compile(step, kernels="fused")):
        _assert_close(compiled(logits, labels), jax.jit(step)(logits, labels))
