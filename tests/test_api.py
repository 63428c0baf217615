"""The user's contract of `jnova.compile`: options, stages, fallbacks, caching, donation, pytrees, scalars.

Numbers are checked against `jax.jit` of the same function on fresh random inputs (see models/).
"""
from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core
from jax.interpreters import mlir

import jnova
from jnova.capture.to_nova import RULES
from jnova.runtime.cache import ARTIFACTS
from models import F32_ROUNDOFF, assert_trees_close, fresh_seed, mlp


@pytest.fixture
def mlp_args():
    seed = fresh_seed()
    return (mlp.init(jax.random.key(seed)), *mlp.batch(jax.random.key(seed + 1)))


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


# --------------------------------------------------------------------------- options
@pytest.mark.parametrize("options, match", [
    ({"mixed_precision": "fp8"}, "mixed_precision must be one of"),
    ({"backend": "tpu"}, "backend must be one of"),
    ({"fallback": "ignore"}, "fallback must be one of"),
    ({"bucket_bytes": 0}, "bucket_bytes must be a positive int"),
    ({"bucket_bytes": -1}, "bucket_bytes must be a positive int"),
    ({"bucket_bytes": 1.5}, "bucket_bytes must be a positive int"),
    ({"bucket_bytes": True}, "bucket_bytes must be a positive int"),
    ({"kernels": "all"}, "kernels must be one of"),
    ({"xla_options": {"command_buffer": ""}}, "xla_options must map XLA option names"),
])
def test_invalid_options_fail_at_compile(options, match):
    with pytest.raises(ValueError, match=match):
        jnova.compile(mlp.sgd_step, **options)


def test_xla_options_reach_xlas_compile_of_the_step(mlp_args):
    """xla_options go to jax.jit's compiler_options: a valid one compiles and gives jit's numbers, an
    unknown one is XLA's error; the kernels are shared with a step compiled without them."""
    step = jnova.compile(mlp.sgd_step, xla_options={"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL",
                                                    "xla_gpu_graph_min_graph_size": 1})
    assert_trees_close(step(*mlp_args), jax.jit(mlp.sgd_step)(*mlp_args))
    assert step.options.xla_options == (("xla_gpu_enable_command_buffer", "FUSION,CUSTOM_CALL"),
                                        ("xla_gpu_graph_min_graph_size", "1"))
    plain = jnova.compile(mlp.sgd_step)
    assert_trees_close(plain(*mlp_args), jax.jit(mlp.sgd_step)(*mlp_args))
    assert plain.stats()[0]["cache_hit"]  # the kernels do not depend on XLA's options: compiled once
    with pytest.raises(Exception, match="xla_no_such_option"):
        jnova.compile(mlp.sgd_step, xla_options={"xla_no_such_option": True})(*mlp_args)
    with pytest.raises(TypeError, match="xla_options must be a dict"):
        jnova.compile(mlp.sgd_step, xla_options=[("xla_gpu_graph_min_graph_size", 1)])


def test_compile_needs_a_callable():
    with pytest.raises(TypeError, match="expects a callable"):
        jnova.compile(42)


def test_non_array_argument_is_named(mlp_args):
    params, x, y = mlp_args
    with pytest.raises(TypeError, match="argument lr of sgd_step is of type str, not an array"):
        jnova.compile(mlp.sgd_step)(params, x, y, "fast")


# --------------------------------------------------------------------------- stages
def test_lower_as_text_stages(mlp_args):
    step = jnova.compile(mlp.sgd_step)
    lowered = step.lower(*mlp_args)
    assert "dot_general" in lowered.as_text("jaxpr")
    nova = lowered.as_text("nova")
    assert "func.func @step(" in nova and '"nova.matmul"' in nova and "func.return" in nova
    linalg = lowered.as_text("linalg")
    assert "func.func @kernel_0(" in linalg and "linalg." in linalg and "nova." not in linalg
    with pytest.raises(ValueError, match=r"unknown stage 'bogus'.*'jaxpr'.*'linalg'.*'nova'"):
        lowered.as_text("bogus")
    step(*mlp_args)
    assert step.compile_count == 1, "calling after lower() with the same shapes recompiled"


# --------------------------------------------------------------------------- fallbacks
# A primitive defined here, so jnova can never have a rule for it: y = cummax(|x|) along axis 0.
no_rule_p = jex_core.Primitive("jnova_test_no_rule")
no_rule_p.def_impl(lambda x: jax.lax.cummax(jnp.abs(x), axis=0))
no_rule_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(no_rule_p, mlir.lower_fun(lambda x: jax.lax.cummax(jnp.abs(x), axis=0), multiple_results=False))


def uses_no_rule(x):
    return no_rule_p.bind(x)


FALLBACK_CASES = {"jnova_test_no_rule": uses_no_rule, "sort": jnp.sort}


def _twice(op):
    """A step that uses `op` twice between compiled ops; the line of the first use is returned too."""
    def step(x, w):
        h = op(jnp.tanh(x @ w))
        return jnp.sum(op(h * 2.0) + 1.0), h
    return step, step.__code__.co_firstlineno + 1


@pytest.mark.parametrize("primitive", sorted(FALLBACK_CASES))
def test_fallback_xla_runs_the_primitive_and_warns_once(primitive):
    if primitive != "jnova_test_no_rule" and primitive in RULES:
        pytest.skip(f"jnova has a rule for '{primitive}' now; the test primitive covers fallbacks")
    step, _ = _twice(FALLBACK_CASES[primitive])
    key = jax.random.key(fresh_seed())
    x, w = jax.random.normal(key, (8, 16)), jax.random.normal(jax.random.fold_in(key, 1), (16, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = jnova.compile(step, fallback="xla")(x, w)
    named = [str(c.message) for c in caught if f"'{primitive}'" in str(c.message)]
    assert len(named) == 1, f"expected one warning naming '{primitive}', got {[str(c.message) for c in caught]}"
    assert "runs as an XLA op" in named[0]
    assert_trees_close(got, jax.jit(step)(x, w), what=primitive)


@pytest.mark.parametrize("primitive", sorted(FALLBACK_CASES))
def test_fallback_error_names_the_primitive_and_the_source_line(primitive):
    if primitive != "jnova_test_no_rule" and primitive in RULES:
        pytest.skip(f"jnova has a rule for '{primitive}' now; the test primitive covers fallbacks")
    step, line = _twice(FALLBACK_CASES[primitive])
    with pytest.raises(jnova.UnsupportedPrimitiveError) as error:
        jnova.compile(step, fallback="error")(jnp.ones((8, 16)), jnp.ones((16, 16)))
    message = str(error.value)
    assert f"'{primitive}'" in message
    if primitive == "jnova_test_no_rule":   # the bind is in this file, inside uses_no_rule
        line = uses_no_rule.__code__.co_firstlineno + 1
    assert f"test_api.py:{line}" in message, message


def test_fallback_error_compiles_a_supported_step(mlp_args):
    assert_trees_close(jnova.compile(mlp.sgd_step, fallback="error")(*mlp_args), jax.jit(mlp.sgd_step)(*mlp_args))


# --------------------------------------------------------------------------- caching
def _sgd_step_again(params, x, y, lr=0.1):
    """mlp.sgd_step, written a second time: a different function with the same structure."""
    value, grads = jax.value_and_grad(mlp.loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), value


def test_compile_once_per_signature_and_artifact_cache_hits():
    ARTIFACTS.clear()
    seed = fresh_seed()
    params = mlp.init(jax.random.key(seed))
    step = jnova.compile(mlp.sgd_step)
    for i in range(3):                  # same shapes, new values: no recompilation, no cache lookup
        x, y = mlp.batch(jax.random.key(seed + i + 1))
        assert_trees_close(step(params, x, y), jax.jit(mlp.sgd_step)(params, x, y))
    assert step.compile_count == 1
    assert (ARTIFACTS.stats.hits, ARTIFACTS.stats.misses) == (0, 1)
    x, y = mlp.batch(jax.random.key(seed), n=24)   # new shapes retrace, as jax.jit does
    assert_trees_close(step(params, x, y), jax.jit(mlp.sgd_step)(params, x, y))
    assert step.compile_count == 2
    assert (ARTIFACTS.stats.hits, ARTIFACTS.stats.misses) == (0, 2)
    other = jnova.compile(_sgd_step_again)   # same structure: the compiled kernels are reused
    assert_trees_close(other(params, x, y), jax.jit(mlp.sgd_step)(params, x, y))
    assert other.compile_count == 1
    assert (ARTIFACTS.stats.hits, ARTIFACTS.stats.misses) == (1, 2)


# --------------------------------------------------------------------------- donation
@pytest.mark.parametrize("donate", [0, (0,), (0, 1)])
def test_donate_argnums_like_jit(mlp_args, donate):
    """Donated buffers are consumed where jax.jit consumes them (an output of the same shape reuses them)."""
    params, x, y = mlp_args
    want_in, got_in = (_copy(params), jnp.copy(x), y), (_copy(params), jnp.copy(x), y)
    with warnings.catch_warnings():   # x has no output of its shape: "some donated buffers were not usable"
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        want = jax.jit(mlp.sgd_step, donate_argnums=donate)(*want_in)
        got = jnova.compile(mlp.sgd_step, donate_argnums=donate)(*got_in)
    assert_trees_close(got, want)
    assert all(p.is_deleted() for p in jax.tree.leaves(got_in[0])), "donated parameters were not consumed"
    assert [a.is_deleted() for a in jax.tree.leaves(got_in)] == [a.is_deleted() for a in jax.tree.leaves(want_in)]


# --------------------------------------------------------------------------- pytrees and scalars
@flax.struct.dataclass
class TrainState:
    params: dict
    step: jax.Array
    name: str = flax.struct.field(pytree_node=False, default="mlp")


class Batch(NamedTuple):
    x: jax.Array
    y: jax.Array


def _structured_step(state: TrainState, batch: Batch, extras: dict):
    loss, grads = jax.value_and_grad(mlp.loss)(state.params, batch.x, batch.y)
    params = jax.tree.map(lambda p, g: p - extras["lr"] * g, state.params, grads)
    metrics = {"loss": loss, "moments": (batch.x.mean(), [batch.y.var()]), "none": None}
    return state.replace(params=params, step=state.step + 1), metrics


def test_pytrees_in_and_out(mlp_args):
    params, x, y = mlp_args
    args = (TrainState(params, jnp.int32(0)), Batch(x, y), {"lr": jnp.float32(0.05), "unused": (None,)})
    got, want = jnova.compile(_structured_step)(*args), jax.jit(_structured_step)(*args)
    assert isinstance(got[0], TrainState) and got[0].name == "mlp" and isinstance(got[1]["moments"][1], list)
    assert_trees_close(got[0], want[0])
    # x.mean() and y.var() cancel: their roundoff scales with the summed terms, not with the result
    # (a mean of 0.00125 over terms of size ~1 differed by 2.6e-8 for seed 926279418)
    terms = max(float(jnp.max(jnp.abs(x))), float(jnp.max(y * y)))
    assert_trees_close(got[1], want[1], atol=2 * math.sqrt(max(x.size, y.size)) * F32_ROUNDOFF * terms)


def test_keyword_arguments(mlp_args):
    params, x, y = mlp_args
    assert_trees_close(jnova.compile(mlp.sgd_step)(params, y=y, x=x), jax.jit(mlp.sgd_step)(params, x, y))


def test_python_scalar_arguments_are_traced_not_baked_in(mlp_args):
    step = jnova.compile(mlp.sgd_step)
    for lr in (0.05, 0.2, 1):    # a new value is a new input, not a new compilation
        assert_trees_close(step(*mlp_args, lr), jax.jit(mlp.sgd_step)(*mlp_args, lr), what=f"lr={lr}")
    assert step.compile_count == 2    # a Python float and a Python int are two signatures, as in jax.jit

    def scale(x, k, flag):
        return jnp.where(flag, x * k, -x), k + 1

    x = mlp_args[1]
    for k, flag in ((3, True), (2.5, False)):
        got, want = jnova.compile(scale)(x, k, flag), jax.jit(scale)(x, k, flag)
        assert [a.dtype for a in got] == [a.dtype for a in want]
        assert_trees_close(got, want)


def test_compiled_step_composes_with_jit(mlp_args):
    step = jnova.compile(mlp.sgd_step)
    outer = jax.jit(lambda params, x, y: step(params, x, y))
    assert_trees_close(outer(*mlp_args), jax.jit(mlp.sgd_step)(*mlp_args))


def test_weakly_typed_array_argument_keeps_jits_dtypes():
    """jnp.asarray(2.0) is weakly typed: times a bf16 array it gives bf16, under jax.jit and jnova alike."""
    def scale(s, y):
        return s * y

    s, y = jnp.asarray(2.0), jnp.arange(4, dtype=jnp.bfloat16)
    assert s.weak_type
    got, want = jnova.compile(scale)(s, y), jax.jit(scale)(s, y)
    assert got.dtype == want.dtype == jnp.bfloat16
    assert_trees_close(got, want)


def test_repeat_calls_dispatch_through_jaxs_compiled_step(monkeypatch):
    """A call with the last call's signature goes straight to jax's compiled step (its C++ dispatch
    checks the types); another signature, or tracers, take jnova's dispatch, and results stay right."""
    def f(x, y):
        return {"s": jnp.tanh(x) * y + 1.0, "t": (x - y).sum()}

    rng = np.random.default_rng()
    x, y = (jnp.asarray(rng.standard_normal(8), jnp.float32) for _ in range(2))
    step = jnova.compile(f)
    assert_trees_close(step(x, y), jax.jit(f)(x, y))
    dispatched = []
    slow = step._executable
    monkeypatch.setattr(step, "_executable", lambda *a, **k: dispatched.append(1) or slow(*a, **k))
    x2, y2 = x + 1, y * 2  # new values, same signature
    assert_trees_close(step(x2, y2), jax.jit(f)(x2, y2))
    assert dispatched == [] and step.compile_count == 1
    assert_trees_close(step(x[:5], y[:5]), jax.jit(f)(x[:5], y[:5]))  # another signature
    assert dispatched == [1] and step.compile_count == 2
    assert_trees_close(step(x2, y2), jax.jit(f)(x2, y2))  # back to the first: dispatched, not recompiled
    assert len(dispatched) == 2 and step.compile_count == 2
    traced = jax.jit(lambda a, b: step(a, b)["s"] * 2)(x, y)  # tracers: jnova's dispatch, inside jax.jit
    assert_trees_close(traced, jax.jit(lambda a, b: f(a, b)["s"] * 2)(x, y))
    with pytest.raises(TypeError):
        step(x)  # a wrong call still fails as jax.jit's would


def test_lowered_compile_is_ahead_of_time_and_reused_by_calls():
    """`step.lower(*args).compile()` compiles with XLA before the first call (as jax.jit's AOT path)
    and returns a callable of that signature; calls of the step then run it without compiling again."""
    def f(x, y):
        return {"s": jnp.tanh(x) * y + 1.0, "t": (x - y).sum()}

    rng = np.random.default_rng()
    x, y = (jnp.asarray(rng.standard_normal(16), jnp.float32) for _ in range(2))
    step = jnova.compile(f)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, y)]
    lowered = step.lower(*shapes)
    compiled = lowered.compile()
    times = step.stats()[0]["compile_s"]
    assert "xla_compile" in times  # compiled now, before any call
    assert_trees_close(compiled(x, y), jax.jit(f)(x, y))
    assert_trees_close(step(x, y), jax.jit(f)(x, y))
    assert step.stats()[0]["compile_s"]["xla_compile"] == times["xla_compile"] and step.compile_count == 1
    assert lowered.compile() is compiled
    with pytest.raises(TypeError):
        compiled(x[:3], y[:3])  # jax's compiled object is for this signature only
