"""raise_attention: attention as users write it becomes nova.attention and nova.attention_backward.

For each recognized form a small training step (value_and_grad) is compiled: its nova IR holds both
ops, neither the IR nor the plan holds a B*H*Tq*Tk value, and the results equal jax.jit's (f32 rtol
1e-5, bf16 at bf16 tolerance). Refused forms log their reason (logger jnova.passes) and still equal
jax.jit. Oracle: jax.jit of the same step.
"""
import logging
import re

import flax.linen as nn
import jnova
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.attention import assert_no_score_buffer, assert_raised, compare_with_jit, nova_op_names
from helpers.random_inputs import normal

B, T, H, D = 2, 16, 4, 8


def _manual(scale_where="after", fill="finfo", mask="causal"):
    def attend(q, k, v):
        if scale_where == "before":
            q = q / np.sqrt(D).astype(q.dtype)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        if scale_where == "after":
            s = s / np.sqrt(D)
        elif scale_where == "mul":
            s = s * (1 / np.sqrt(D))
        elif scale_where == "traced":  # as nanoGPT ports write it: the scale is computed by jnp in the step
            s = s / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        tril = jnp.tril(jnp.ones((T, T), bool))
        if mask == "causal":
            s = jnp.where(tril, s, jnp.finfo(s.dtype).min if fill == "finfo" else -jnp.inf)
        elif mask == "additive":
            s = s + jnp.where(tril, 0.0, -1e9).astype(s.dtype)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return attend


def _matmul_form(q, k, v):
    """[B, H, T, D] inputs, q @ k^T, a causal mask from the bottom-left triangle."""
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    s = (q @ jnp.swapaxes(k, -1, -2)) * D ** -0.5
    s = jnp.where(jnp.arange(T)[:, None] >= jnp.arange(T)[None, :], s, -1e30)
    return jnp.swapaxes(jax.nn.softmax(s, axis=-1) @ v, 1, 2)


def _dpa(**kwargs):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kwargs)


def _step(attend, w):
    def step(q, k, v):
        loss = lambda q, k, v: ((attend(q, k, v).astype(jnp.float32) - w) ** 2).sum()  # noqa: E731  (no cancellation)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    return step


def _qkv(rng, dtype, hkv=H):
    return normal(rng, (B, T, H, D), dtype), normal(rng, (B, T, hkv, D), dtype), normal(rng, (B, T, hkv, D), dtype)


def _check(attend, dtype="float32", hkv=H, backward=True):
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, dtype, hkv)
    lowered = compare_with_jit(_step(attend, normal(rng, q.shape)), q, k, v, dtype=dtype)
    assert_raised(lowered, backward=backward)
    assert_no_score_buffer(lowered, B * H * T * T)
    return lowered


FORMS = {
    "manual": _manual(),
    "manual_scale_before": _manual("before"),
    "manual_mul_inf": _manual("mul", fill="inf"),
    "manual_traced_scale": _manual("traced"),
    "manual_additive_mask": _manual(mask="additive"),
    "manual_no_mask": _manual(mask=None),
    "matmul_bhtd": _matmul_form,
    "dpa_causal": _dpa(is_causal=True),
    "dpa_plain": _dpa(),
    "dpa_scale": _dpa(is_causal=True, scale=0.2),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_recognized_forms_raise_and_match_jit(form, dtype):
    _check(FORMS[form], dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hkv", [2, 1])
def test_dot_product_attention_grouped_query(hkv, dtype):
    lowered = _check(_dpa(is_causal=True), dtype, hkv=hkv)
    attention = next(line for line in lowered.as_text("nova").splitlines() if '"nova.attention"' in line)
    k_type = re.findall(r"tensor<[^>]*>", attention)[1]  # the op's types: q, k, v, then o and lse
    assert k_type in (f"tensor<{B}x{T}x{hkv}x{D}xf32>", f"tensor<{B}x{hkv}x{T}x{D}xf32>",
                      f"tensor<{B}x{T}x{hkv}x{D}xbf16>", f"tensor<{B}x{hkv}x{T}x{D}xbf16>")  # k keeps its own heads


def test_dot_product_attention_with_a_mask():
    rng = np.random.default_rng()
    mask = rng.random((B, 1, T, T)) < 0.8
    mask[..., np.arange(T), np.arange(T)] = True
    lowered = _check(_dpa(mask=mask))
    assert 'optional_operand = "mask"' in lowered.as_text("nova")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("operand", ["mask", "bias"])
def test_dot_product_attention_grouped_query_with_a_mask_or_bias_shared_by_the_heads(operand, dtype):
    """GQA 4:2 with a [B, 1, T, T] mask (or bias): dot_product_attention broadcasts it over the group and
    transposes it with the scores inside its `where`; it was refused as "a mask that differs between the
    query heads of one kv head"."""
    rng = np.random.default_rng()
    if operand == "mask":
        value = rng.random((B, 1, T, T)) < 0.8
        value[..., np.arange(T), np.arange(T)] = True
    else:
        value = jnp.asarray(normal(rng, (B, 1, T, T)), dtype)
    lowered = _check(_dpa(**{operand: value}), dtype, hkv=2)
    assert f'optional_operand = "{operand}"' in lowered.as_text("nova")


def _grouped_einsum(k_first: bool):
    """GQA written with the query heads grouped, [B, T, Hkv, G, D], as Llama ports write it."""
    def attend(q, k, v):
        b, t, h, d = q.shape
        hkv = k.shape[2]
        qg = q.reshape(b, t, hkv, h // hkv, d)
        s = (jnp.einsum("bskd,bqkgd->bkgqs", k, qg) if k_first else jnp.einsum("bqkgd,bskd->bkgqs", qg, k)) / np.sqrt(d)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(s.dtype).min)
        o = jnp.einsum("bkgqs,bskd->bqkgd", jax.nn.softmax(s, -1), v)
        return o.reshape(b, t, h, d)
    return attend


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k_first", [False, True], ids=["q_first", "k_first"])
def test_grouped_query_attention_written_with_grouped_query_heads(k_first, dtype):
    """The scores' matmul may take k as its first operand (einsum orders them): the side with two free
    axes is the query's. It was refused: "the key side of the scores has more than one free axis"."""
    lowered = _check(_grouped_einsum(k_first), dtype, hkv=2)
    attention = next(line for line in lowered.as_text("nova").splitlines() if '"nova.attention"' in line)
    assert "causal = true" in attention


@pytest.mark.parametrize("hkv", [H, 2])
@pytest.mark.parametrize("window,causal", [((4, 4), False), ((5, 0), True), (6, True)],
                         ids=["both_sides", "left_causal", "symmetric_causal"])
def test_dot_product_attention_with_a_local_window(window, causal, hkv):
    """`local_window_size` is a constant [T, T] mask, the `and` of its two bounds: one mask operand (it was
    refused as "a mask made of several masks"); a window that keeps no key past the query (with
    `is_causal`) also makes the op causal."""
    lowered = _check(_dpa(is_causal=causal, local_window_size=window), hkv=hkv)
    attention = next(line for line in lowered.as_text("nova").splitlines() if '"nova.attention"' in line)
    assert 'optional_operand = "mask"' in attention and ("causal = true" in attention) == causal


def test_a_mask_per_query_head_under_grouped_query_attention_is_refused_with_its_reason(caplog):
    rng = np.random.default_rng()
    mask = rng.random((B, H, T, T)) < 0.8
    mask[..., np.arange(T), np.arange(T)] = True
    q, k, v = _qkv(rng, "float32", 2)
    with caplog.at_level(logging.INFO, logger="jnova"):
        lowered = compare_with_jit(_step(_dpa(mask=mask), normal(rng, q.shape)), q, k, v)
    assert "nova.attention" not in lowered.as_text("nova")
    assert "a mask that differs between the query heads of one kv head" in caplog.text


@pytest.mark.parametrize("masked_output", [False, True], ids=["o", "where(valid, o, 0)"])
def test_a_padding_mask_of_minus_inf_with_an_empty_sequence_gives_nan_as_jit(masked_output):
    """Scores masked to -inf by a padding mask, one sequence of length 0: jax.nn.softmax of its rows of
    -inf is NaN, in o and (p^T dO reads the NaN probabilities, even where dO is zero) in every dv of
    its heads. nova.attention's masked scores are finite, so those rows attended uniformly and the
    step returned numbers where jax.jit returns NaN; the raised attention now makes them NaN too."""
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, "float32")
    valid = jnp.asarray(np.arange(T)[None] < np.array([T - 5, 0])[:, None])

    def attend(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(valid[:, None, None, :], s, -jnp.inf), -1), v)
        return jnp.where(valid[:, :, None, None], o, 0.0) if masked_output else o

    step = _step(attend, normal(rng, q.shape))
    got, want = jnova.compile(step)(q, k, v), jax.jit(step)(q, k, v)
    (loss, (dq, dk, dv)), (want_loss, (want_dq, want_dk, want_dv)) = got, want
    assert np.isnan(want_loss) != masked_output and np.isnan(want_dv[1]).all()   # (what the test is about)
    for name, a, b in zip(("loss", "dq", "dk", "dv"), (loss, dq, dk, dv), (want_loss, want_dq, want_dk, want_dv)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.array_equal(np.isnan(a), np.isnan(b)), name
        np.testing.assert_allclose(np.nan_to_num(a), np.nan_to_num(b), rtol=1e-5, atol=1e-5, err_msg=name)
    assert_raised(jnova.compile(step).lower(q, k, v))


def test_forward_only_raises_the_forward():
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, "float32")
    lowered = compare_with_jit(lambda q, k, v: _manual()(q, k, v) * 2.0, q, k, v)
    names = nova_op_names(lowered)
    assert "nova.attention" in names and "nova.attention_backward" not in names


class _SelfAttention(nn.Module):
    """Causal self-attention as a Flax user writes it (flax.linen's attention, mixed precision). No biases:
    the key bias's gradient is zero (softmax ignores a constant per row), so both sides would be noise."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        attention = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * D, dtype=self.dtype, use_bias=False,
                                                    deterministic=True)
        return attention(x, x, mask=mask)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flax_multi_head_attention_training_step(dtype):
    rng = np.random.default_rng()
    module = _SelfAttention(jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
    x = normal(rng, (B, T, 32))
    params = module.init(jax.random.key(0), x)

    def step_of(module):
        def step(params, x):
            loss = lambda p: (module.apply(p, x).astype(jnp.float32) ** 2).mean()  # noqa: E731
            return jax.value_and_grad(loss)(params)
        return step

    lowered = compare_with_jit(step_of(module), params, x, dtype=dtype, reference=step_of(_SelfAttention()))
    assert_raised(lowered)
    assert_no_score_buffer(lowered, B * H * T * T)


# --------------------------------------------------------------------------- refusals
def _refused(attend, caplog, reason, dtype="float32"):
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, dtype)
    with caplog.at_level(logging.INFO, logger="jnova.passes"):
        lowered = compare_with_jit(_step(attend, normal(rng, q.shape)), q, k, v, dtype=dtype)
    assert "nova.attention" not in nova_op_names(lowered)
    messages = [r.getMessage() for r in caplog.records if r.name == "jnova.passes" and "stays as it is" in r.getMessage()]
    assert any(reason in m for m in messages), messages


def _with_dropout(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    p = jax.nn.softmax(s, axis=-1)
    keep = jax.random.bernoulli(jax.random.key(1), 0.9, p.shape)
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(keep, p / 0.9, 0.0), v)


def _softmax_over_queries(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-2), v)


def _probabilities_returned_too(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v) + 0.01 * (p * jnp.log(p + 1e-9)).sum((1, 3))[:, :, None, None]


_CONSTANT_BIAS = np.random.default_rng(0).standard_normal((1, H, T, T)).astype(np.float32)


_PADDING = np.arange(T) < T - 3  # the last three keys are padding


def _biased_and_masked(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, bias=_CONSTANT_BIAS, mask=jnp.broadcast_to(_PADDING, (1, 1, T, T)))


def _scaled_by_a_tensor(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.tanh(q[:, :, :, :1].transpose(0, 2, 1, 3))
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("attend, reason", [
    (_with_dropout, "dropout"),
    (_softmax_over_queries, "does not contract the keys"),
    (_probabilities_returned_too, "a value of the softmax is"),
    (_scaled_by_a_tensor, "a score value (of a matmul) has 2 readers"),
    (_biased_and_masked, "a bias and a mask together"),  # was a matching failure, logged as a warning
])
def test_refused_forms_log_their_reason_and_stay_correct(attend, reason, caplog):
    _refused(attend, caplog, reason)


def test_a_trainable_bias_is_refused_and_stays_correct(caplog):
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, "float32")
    bias = normal(rng, (1, H, T, T))
    w = normal(rng, q.shape)

    def step(q, k, v, bias):
        def loss(q, k, v, bias):
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D) + bias
            return (jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v) * w).sum()
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)

    with caplog.at_level(logging.INFO, logger="jnova.passes"):
        lowered = compare_with_jit(step, q, k, v, bias)
    assert "nova.attention" not in nova_op_names(lowered)
    assert any("gradient of the bias" in r.getMessage() for r in caplog.records if r.name == "jnova.passes")


def test_a_constant_bias_is_raised():
    rng = np.random.default_rng()
    bias = normal(rng, (1, H, T, T))

    def attend(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D) + bias
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    lowered = _check(attend)
    assert 'optional_operand = "bias"' in lowered.as_text("nova")


def test_linear_layers_are_not_refusals(caplog):
    rng = np.random.default_rng()
    x, w = normal(rng, (8, 16)), normal(rng, (16, 32))
    with caplog.at_level(logging.INFO, logger="jnova.passes"):
        compare_with_jit(lambda x, w: jax.grad(lambda w: jax.nn.logsumexp(x @ w, -1).sum())(w), x, w)
    assert not [r for r in caplog.records if r.name == "jnova.passes" and "raise_attention" in r.getMessage()]


# --------------------------------------------------------------------------- the cuDNN form
@pytest.fixture
def cudnn_traceable(monkeypatch):
    """Let jax.nn.dot_product_attention(implementation="cudnn") trace on a machine without cuDNN (its
    primitives are replaced by nova ops before anything would run them)."""
    import jax._src.cudnn.fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_is_flash_attention", lambda *a, **k: None)


@pytest.mark.parametrize("kwargs", [dict(is_causal=True), dict(), dict(mask="random")], ids=["causal", "plain", "mask"])
def test_cudnn_primitives_become_nova_attention(kwargs, cudnn_traceable):
    dtype = "bfloat16"  # cuDNN takes fp16, bf16 and fp8 only
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, dtype, hkv=2)
    if kwargs.get("mask") == "random":
        mask = rng.random((B, 1, T, T)) < 0.8
        mask[..., np.arange(T), np.arange(T)] = True
        kwargs = dict(mask=mask)
    w = normal(rng, q.shape)
    step = jnova.compile(_step(_dpa(implementation="cudnn", **kwargs), w))
    got = step(q, k, v)
    want = jax.jit(_step(_dpa(implementation="xla", **kwargs), w))(q, k, v)  # the same attention, by XLA
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        tol = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(np.abs(b).max()))
    lowered = step.lower(q, k, v)
    assert_raised(lowered)
    assert not lowered.stats()["fallbacks"]
    assert_no_score_buffer(lowered, B * H * T * T if "mask" not in kwargs else B * H * T * T + 1)


def test_cudnn_dropout_is_refused_with_its_reason(cudnn_traceable, caplog):
    from jnova.capture.to_nova import to_nova
    from jnova.capture.trace import trace
    from jnova.passes.raise_attention import raise_attention

    rng = np.random.default_rng()
    q, k, v = _qkv(rng, "bfloat16")
    import jax._src.cudnn.fused_attention_stablehlo as cudnn

    def loss(q, k, v):
        return cudnn.dot_product_attention(q, k, v, scale=0.3, dropout_rate=0.1).astype(jnp.float32).sum()

    program = to_nova(trace(jax.grad(loss, argnums=(0, 1, 2)), (q, k, v), {}))
    with caplog.at_level(logging.INFO, logger="jnova.passes"):
        raised = raise_attention(program.func, program.sites)
    assert not raised and len(raised.refused) == 2
    assert all("dropout (rate 0.1)" in m for m in raised.refused)
    assert sum("dropout" in r.getMessage() for r in caplog.records if r.name == "jnova.passes") == 2


def test_f32_accurate_precision_keeps_the_attention_as_written(caplog):
    """Under jax.default_matmul_precision("float32") the user asked for f32-accurate contractions: the
    attention is not raised (its kernels are TF32), and its matmuls keep precision highest."""
    rng = np.random.default_rng()
    q, k, v = _qkv(rng, "float32")
    with jax.default_matmul_precision("float32"), caplog.at_level("INFO", logger="jnova.passes"):
        lowered = compare_with_jit(_step(_manual(), normal(rng, q.shape)), q, k, v)
    names = nova_op_names(lowered)
    assert "nova.attention" not in names and "nova.attention_backward" not in names
    assert "precision highest" in caplog.text
    assert 'precision = "highest"' in lowered.as_text("nova")
