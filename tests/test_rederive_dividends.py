"""rederive_dividends: a softmax's exp(x - max), read again by its gradient, dies at the division;
the gradient reads quotient x divisor instead. Checked on the nova function (which reads move,
what the results are), on whole steps against jax.jit, on the GPU plan (one tensor fewer written),
and on the cases the pass must leave alone."""
import math

import jax
import jax.numpy as jnp
import numpy as np

import jnova
from jnova.passes import rederive_dividends as rd
from jnova.primitives.nova_to_jax import evaluate_ops
from helpers.nova_funcs import nova_func as _func
from helpers.random_inputs import f32 as _f32

B, T, D = 8, 256, 32  # the scores: 8 x 256 x 256 f32, 2 MB (at least rd.MIN_BYTES)


def _attention_loss(q, k, v):
    scores = jnp.einsum("bqd,bkd->bqk", q, k) / math.sqrt(D)
    scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -1e9)
    return jnp.sum(jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, axis=-1), v) ** 2)


_attention_step = jax.value_and_grad(_attention_loss, argnums=(0, 1, 2))


def _args():
    return _f32(B, T, D), _f32(B, T, D), _f32(B, T, D)


def _exp(func):
    (op,) = [op for op in func.ops if op.name == "nova.exp" and op.results[0].type.shape[-2:] == (T, T)]
    return op.results[0]


def test_the_softmax_gradient_reads_the_quotient_and_the_results_stay():
    args = _args()
    func = _func(_attention_step, *args)
    e = _exp(func)
    position = {id(op): i for i, op in enumerate(func.ops)}
    (div,) = [op for op in func.ops if op.name == "nova.div" and op.operands[0] is e]
    assert any(position[id(op)] > position[id(div)] for op in func.ops if e in op.operands)  # read late
    assert rd.rederive_dividends(func) == 1
    func.verify()
    position = {id(op): i for i, op in enumerate(func.ops)}
    readers = [op for op in func.ops if e in op.operands]
    assert readers and all(position[id(op)] <= position[id(div)] for op in readers)  # e dies at the division
    late = [op for op in func.ops if op.name == "nova.mul" and div.results[0] in op.operands]
    assert late, "the late reads take quotient x divisor"
    got = jax.jit(evaluate_ops(func.ops, func.args, func.returns))(*args)
    want = jax.tree.leaves(jax.jit(_attention_step)(*args))
    for g, w in zip(got, want):  # q * s is e up to two f32 roundings
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5 * np.abs(np.asarray(w)).max())


def test_a_compiled_step_matches_jit_on_the_cpu():
    args = _args()
    got = jnova.compile(_attention_step, backend="cpu")(*args)
    want = jax.jit(_attention_step)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5 * np.abs(np.asarray(w)).max())


def _unraised(monkeypatch):
    """The softmax stays as written: raise_attention would turn these steps into nova.attention (no
    scores at all); rederive_dividends is for the softmaxes it does not take (a refused attention)."""
    from jnova import pipeline

    monkeypatch.setattr(pipeline, "raise_attention", lambda func, sites: 0)


def _scores_written(monkeypatch, min_bytes: int) -> int:
    _unraised(monkeypatch)
    monkeypatch.setattr(rd, "MIN_BYTES", min_bytes)
    lowered = jnova.compile(_attention_step, target="h200").lower(*_args())
    steps = lowered.executable.meta["plan"]["steps"]
    return sum(tuple(t[0])[-2:] == (T, T) and t[1] == "float32" for s in steps for t in s.get("out_types", []))


def test_the_gpu_plan_writes_one_scores_sized_tensor_less(monkeypatch):
    """Ahead of time for the H200: the softmax's kernel no longer writes exp(x - max) out."""
    taken = _scores_written(monkeypatch, rd.MIN_BYTES)
    assert taken == _scores_written(monkeypatch, 1 << 62) - 1  # a threshold the pass takes nothing at


def _count(fn, *args):
    return rd.rederive_dividends(_func(fn, *args))


def test_what_is_left_alone():
    x = _f32(B, T, T)

    def softmax_parts(x):
        e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
        return e, jnp.sum(e, axis=-1, keepdims=True)

    def taken(x, w):  # a contraction reads the probabilities, an elementwise op e later
        e, s = softmax_parts(x)
        return jnp.sum(jnp.einsum("bij,bjk->bik", e / s, w)) + jnp.sum(jnp.sin(w) * e)

    assert _count(taken, x, x) == 1  # for contrast: the form the pass takes
    # a small dividend
    assert _count(_attention_step, _f32(2, T, D), _f32(2, T, D), _f32(2, T, D)) == 0
    # a divisor that is not the dividend's own sum: it could be zero, and q * s NaN where e is not
    assert _count(lambda x, s, w: (lambda e: jnp.sum(jnp.einsum("bij,bjk->bik", e / s, w))
                                   + jnp.sum(jnp.sin(w) * e))(jnp.exp(x)), x, _f32(B, T, 1), x) == 0
    # a dividend that is not an exp (a sum of it may be zero, or smaller than its terms)
    assert _count(lambda x, w: (lambda e: jnp.sum(jnp.einsum("bij,bjk->bik", e / jnp.sum(e, -1, keepdims=True), w))
                                + jnp.sum(jnp.sin(w) * e))(jnp.sin(x)), x, x) == 0

    def contraction_reads_late(x, w):  # quotient x divisor would have to be written out
        e, s = softmax_parts(x)
        return jnp.sum(jnp.einsum("bij,bjk->bik", e / s, w)) + jnp.sum(jnp.einsum("bij,bjk->bik", jnp.sin(w), e))

    assert _count(contraction_reads_late, x, x) == 0

    def fused_away(x, w):  # only elementwise ops read the quotient: it need never be written out
        e, s = softmax_parts(x)
        return jnp.sum(jnp.tanh(e / s)) + jnp.sum(w * e)

    assert _count(fused_away, x, x) == 0

    def returned(x, w):
        e, s = softmax_parts(x)
        return e, jnp.sum(jnp.einsum("bij,bjk->bik", e / s, w)) + jnp.sum(jnp.sin(w) * e)

    assert _count(returned, x, x) == 0


def _bf16_attention_loss(q, k, v):  # bf16 scores, the softmax in f32, its probabilities rounded to bf16
    scores = (jnp.einsum("bqd,bkd->bqk", q, k) / math.sqrt(D)).astype(jnp.float32)
    scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -1e9)
    p = jax.nn.softmax(scores, axis=-1).astype(jnp.bfloat16)
    return jnp.sum(jnp.einsum("bqk,bkd->bqd", p, v).astype(jnp.float32) ** 2)


_bf16_attention_step = jax.value_and_grad(_bf16_attention_loss, argnums=(0, 1, 2))


def _bf16_args():
    return tuple(jnp.asarray(a, jnp.bfloat16) for a in _args())


def test_a_bf16_softmax_keeps_only_its_bf16_probabilities():
    """The f32 exp(x - max) of a softmax whose probabilities are rounded to bf16 for P @ V is not held
    for the backward beside them: the gradient reads f32(bf16(q)) x s."""
    args = _bf16_args()
    func = _func(_bf16_attention_step, *args)
    e = _exp(func)
    assert rd.rederive_dividends(func) == 1
    func.verify()
    (div,) = [op for op in func.ops if op.name == "nova.div" and op.operands[0] is e]
    position = {id(op): i for i, op in enumerate(func.ops)}
    assert all(position[id(op)] <= position[id(div)] for op in func.ops if e in op.operands)
    got = jnova.compile(_bf16_attention_step, backend="cpu")(*args)
    want = jax.jit(_bf16_attention_step)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # bf16 gradients: ~1e-2 of their largest
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=3e-2, atol=3e-2 * np.abs(w).max())


def test_the_bf16_gpu_plan_writes_no_f32_scores_for_the_backward(monkeypatch):
    def f32_scores(min_bytes):
        _unraised(monkeypatch)
        monkeypatch.setattr(rd, "MIN_BYTES", min_bytes)
        steps = jnova.compile(_bf16_attention_step, target="h200").lower(*_bf16_args()).executable.meta["plan"]["steps"]
        return sum(tuple(t[0])[-2:] == (T, T) and t[1] == "float32" for s in steps for t in s.get("out_types", []))

    # no f32 B*H*T*T value crosses memory (rederiving the dividend, or recomputing exp(x - max) from the
    # scores and their row maxima in the backward's kernels, where fusion finds that cheaper)
    assert f32_scores(rd.MIN_BYTES) == 0
