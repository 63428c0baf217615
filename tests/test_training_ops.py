"""nova.sce, nova.layernorm, nova.rmsnorm, nova.gelu and their backwards: verifiers naming the operand,
printing/parsing round trip and MLIR (IRDL) acceptance, and their definition (the generic
decomposition of passes/expand_training.py) evaluated as JAX ops and compiled by the CPU backend.

Oracles: the expected message fragments; MLIR's parser; optax, Flax and jax.nn under jax.jit with JAX's
own AD on the same fresh random inputs.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jnova.dialect.ir import Func, print_module
from jnova.dialect.irdl import verify_with_mlir
from jnova.dialect.ops import OPS
from jnova.dialect.ops_training import (TRAINING_OPS, gelu_backward_op, gelu_op, layernorm_backward_op, layernorm_op,
                                        rmsnorm_backward_op, rmsnorm_op, sce_backward_op, sce_op)
from jnova.dialect.parse import parse_module
from jnova.dialect.types import TensorType as T
from jnova.errors import VerifyError
from jnova.passes.form_kernels import form_kernels
from jnova.passes.plan import plan_to_json
from jnova.primitives import backends
from jnova.primitives.executor import step_function
from jnova.primitives.nova_to_jax import evaluate_ops
from helpers.random_inputs import normal

N, V, C = 6, 37, 24
TOL = {"float32": dict(rtol=2e-5, atol=2e-5), "bfloat16": dict(rtol=2e-2, atol=2e-2)}


def _normal(rng, shape, dtype="float32"):
    return normal(rng, shape, dtype, scale=2.0)


def _error(f) -> str:
    with pytest.raises(VerifyError) as e:
        f.verify()
    return str(e.value)


def _all_ops_func(dtype="bfloat16"):
    f = Func("f", [T((N, V), dtype), T((N,), "int32"), T((4, 3, C), dtype), T((C,), "float32")])
    logits, labels, x, w = f.args
    s = f.add(sce_op(logits, labels, reduction="mean", ignore_index=-100))
    sb = f.add(sce_backward_op(logits, labels, s.results[1], s.results[0], reduction="mean", ignore_index=-100))
    ln = f.add(layernorm_op(x, w, w, epsilon=1e-5))
    lb = f.add(layernorm_backward_op(x, ln.results[1], ln.results[2], x, w, has_bias=True, epsilon=1e-5))
    rm = f.add(rmsnorm_op(x, w, epsilon=1e-6, y_dtype="float32"))
    rb = f.add(rmsnorm_backward_op(x, rm.results[1], x, w, epsilon=1e-6))
    g = f.add(gelu_op(x, approximate="tanh"))
    gb = f.add(gelu_backward_op(x, g.results[0], approximate="erf"))
    f.returns = [s.results[0], *sb.results, *lb.results, *rb.results, gb.results[0], rm.results[0]]
    return f


def test_ops_are_registered_and_round_trip_through_mlir():
    assert set(TRAINING_OPS) <= set(OPS)
    f = _all_ops_func()
    f.verify()
    text = print_module([f])
    verify_with_mlir(text)
    g = parse_module(text)
    assert g.print() == f.print()
    assert [op.name for op in g.ops] == list(TRAINING_OPS)
    assert g.ops[0].attrs == {"reduction": "mean", "has_ignore": True, "ignore_index": -100}
    assert [r.type for r in g.ops[2].results] == [T((4, 3, C), "bfloat16"), T((4, 3), "float32"), T((4, 3), "float32")]


def _one(build, *types):
    f = Func("f", list(types))
    op = f.add(build(*f.args))
    f.returns = list(op.results)
    return f


LOGITS, LABELS, X, W = T((N, V), "float32"), T((N,), "int32"), T((4, C), "float32"), T((C,), "float32")


@pytest.mark.parametrize("build, types, expect", [
    (lambda l, y: sce_op(l, y), (T((N, V, 2), "float32"), LABELS), ["'nova.sce' op", "operand 'logits'", "rank-2"]),
    (lambda l, y: sce_op(l, y), (T((N, V), "int32"), LABELS), ["operand 'logits'", "element type int32"]),
    (lambda l, y: sce_op(l, y), (LOGITS, T((N,), "float32")), ["operand 'labels'", "expected an integer type"]),
    (lambda l, y: sce_op(l, y), (LOGITS, T((N + 1,), "int32")), ["operand 'labels'", "shape (7,)", "expected (6,)"]),
    (lambda l, y: sce_op(l, y, reduction="avg"), (LOGITS, LABELS), ["attribute 'reduction' = 'avg'"]),
    (lambda l, y, s, d: sce_backward_op(l, y, s, d, reduction="none"), (LOGITS, LABELS, T((N, 1), "float32"),
     T((N,), "float32")), ["'nova.sce_backward' op", "operand 'lse'", "expected tensor<6xf32>"]),
    (lambda l, y, s, d: sce_backward_op(l, y, s, d, reduction="mean"), (LOGITS, LABELS, T((N,), "float32"),
     T((N,), "float32")), ["operand 'dloss'", "expected tensor<f32>"]),
    (lambda x, w: layernorm_op(x, w, epsilon=1e-5), (X, T((C + 1,), "float32")),
     ["'nova.layernorm' op", "operand 'scale'", "expected (24,) like the last dimension of operand 'x'"]),
    (lambda x, w: layernorm_op(x, w, epsilon=-1.0), (X, W), ["attribute 'epsilon' = -1.0"]),
    (lambda x, w: layernorm_op(x, w, epsilon=1e-5), (T((4, C), "int32"), W), ["operand 'x'", "element type int32"]),
    (lambda x, m, r, d: layernorm_backward_op(x, m, r, d, has_bias=False, epsilon=1e-5),
     (X, T((4,), "float32"), T((4, 1), "float32"), X), ["'nova.layernorm_backward' op", "operand 'rstd'"]),
    (lambda x, r, d: rmsnorm_backward_op(x, r, d, epsilon=1e-5), (X, T((4,), "float32"), T((4, C + 1), "float32")),
     ["'nova.rmsnorm_backward' op", "operand 'dy'"]),
    (lambda x: gelu_op(x, approximate="sigmoid"), (X,), ["'nova.gelu' op", "attribute 'approximate' = 'sigmoid'"]),
    (lambda x, d: gelu_backward_op(x, d, approximate="tanh"), (X, T((4, C), "bfloat16")),
     ["'nova.gelu_backward' op", "operand 'dy'", "expected tensor<4x24xf32>"]),
])
def test_verifier_names_the_operand(build, types, expect):
    message = _error(_one(build, *types))
    for fragment in expect:
        assert fragment in message, message


def test_verifier_counts_the_parameters():
    f = _one(lambda x, w: layernorm_op(x, w, epsilon=1e-5), X, W)
    f.ops[0].attrs["has_bias"] = True
    assert "attributes say the parameters are ['scale', 'bias'], so expected 2 operands 'params', got 1" in _error(f)


# --------------------------------------------------------------------------- definitions
def _cpu(func: Func):
    """`func` compiled by the CPU backend (one kernel: the ops' decompositions lowered in place)."""
    plan = form_kernels(func)
    compiled = backends.compile_cpu(plan)
    return jax.jit(step_function(plan_to_json(plan), [], compiled.handles, []))


def _check(func, args, want, dtype):
    f32 = [np.asarray(w, np.float32) for w in want]
    for name, run in (("jax", evaluate_ops(func.ops, func.args, func.returns)), ("cpu", _cpu(func))):
        got = run(*args)
        assert len(got) == len(f32)
        for i, (g, w) in enumerate(zip(got, f32)):
            scale = max(float(np.abs(w).max()), 1e-6)
            np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=TOL[dtype]["rtol"],
                                       atol=TOL[dtype]["atol"] * scale, err_msg=f"{name} result #{i}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("ignore", [None, 3])
def test_sce_matches_optax_and_its_ad(dtype, reduction, ignore):
    rng = np.random.default_rng()
    logits = _normal(rng, (N, V), dtype) * 4
    logits[0] += 90  # a row whose maximum is far above the others'
    labels = rng.integers(0, V, N).astype(np.int32)
    labels[:2] = [0, V - 1]  # the first and the last class
    if ignore is not None:
        labels[2] = ignore
    dshape = (N,) if reduction == "none" else ()
    dloss = _normal(rng, dshape)

    def loss(lg):
        per_row = optax.softmax_cross_entropy_with_integer_labels(lg.astype(jnp.float32), labels)
        keep = labels != ignore if ignore is not None else jnp.ones(N, bool)
        per_row = jnp.where(keep, per_row, 0.0)
        return {"none": per_row, "sum": per_row.sum(), "mean": per_row.sum() / keep.sum()}[reduction]

    value, vjp = jax.vjp(loss, jnp.asarray(logits))
    lse = jax.nn.logsumexp(jnp.asarray(logits, jnp.float32), axis=1)
    f = Func("f", [T((N, V), dtype), T((N,), "int32"), T(dshape, "float32")])
    fwd = f.add(sce_op(f.args[0], f.args[1], reduction=reduction, ignore_index=ignore))
    bwd = f.add(sce_backward_op(f.args[0], f.args[1], fwd.results[1], f.args[2], reduction=reduction,
                                ignore_index=ignore))
    f.returns = [*fwd.results, bwd.results[0]]
    f.verify()
    _check(f, (logits, labels, dloss), [value, lse, vjp(jnp.asarray(dloss))[0]], dtype)


def _flax_norm(kind, scale, bias, eps, dtype):
    if kind == "layernorm":
        return nn.LayerNorm(epsilon=eps, use_scale=scale, use_bias=bias, dtype=dtype)
    return nn.RMSNorm(epsilon=eps, use_scale=scale, dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind, scale, bias", [("layernorm", True, True), ("layernorm", False, False),
                                               ("layernorm", True, False), ("rmsnorm", True, False),
                                               ("rmsnorm", False, False)])
def test_norms_match_flax_and_their_ad(kind, scale, bias, dtype):
    rng = np.random.default_rng()
    x = _normal(rng, (4, 3, C), dtype) + 1.5
    w, b = _normal(rng, (C,)), _normal(rng, (C,))
    dy = _normal(rng, (4, 3, C), dtype)
    eps = 1e-5
    module = _flax_norm(kind, scale, bias, eps, jnp.bfloat16 if dtype == "bfloat16" else None)
    params = {"params": {k: v for k, v in (("scale", w), ("bias", b)) if (k == "scale" and scale) or
                         (k == "bias" and bias)}}

    def apply(xx, p):
        return module.apply({"params": p}, xx)

    y, vjp = jax.vjp(apply, jnp.asarray(x), params["params"])
    dx, dp = vjp(jnp.asarray(dy, y.dtype))
    xf = np.asarray(x, np.float64)
    mean = xf.mean(-1)
    rstd = 1 / np.sqrt((xf ** 2).mean(-1) - (mean ** 2 if kind == "layernorm" else 0) + eps)
    param_types = [T((C,), "float32")] * (scale + bias)
    f = Func("f", [T((4, 3, C), dtype), *param_types, T((4, 3, C), dtype)])
    xv, *pv, dyv = f.args
    sv, bv = (pv[0] if scale else None), (pv[-1] if bias else None)
    if kind == "layernorm":
        fwd = f.add(layernorm_op(xv, sv, bv, epsilon=eps))
        bwd = f.add(layernorm_backward_op(xv, fwd.results[1], fwd.results[2], dyv, sv, has_bias=bias, epsilon=eps))
        want = [y, mean, rstd, dx]
    else:
        fwd = f.add(rmsnorm_op(xv, sv, epsilon=eps))
        bwd = f.add(rmsnorm_backward_op(xv, fwd.results[1], dyv, sv, epsilon=eps))
        want = [y, rstd, dx]
    want += [dp[k] for k in ("scale", "bias") if k in dp]
    f.returns = [*fwd.results, *bwd.results]
    f.verify()
    _check(f, (x, *([w] if scale else []), *([b] if bias else []), dy), want, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("approximate", ["tanh", "erf"])
def test_gelu_matches_jax_nn_gelu_and_its_ad(approximate, dtype):
    rng = np.random.default_rng()
    x, dy = _normal(rng, (5, C), dtype), _normal(rng, (5, C), dtype)
    # the definition computes in f32 whatever the operands' type: so does the oracle (from the same inputs)
    y, vjp = jax.vjp(lambda v: jax.nn.gelu(v, approximate=approximate == "tanh"), jnp.asarray(x, jnp.float32))
    f = Func("f", [T((5, C), dtype), T((5, C), dtype)])
    fwd = f.add(gelu_op(f.args[0], approximate=approximate))
    bwd = f.add(gelu_backward_op(f.args[0], f.args[1], approximate=approximate))
    f.returns = [fwd.results[0], bwd.results[0]]
    f.verify()
    _check(f, (x, dy), [y, vjp(jnp.asarray(dy, jnp.float32))[0]], dtype)
