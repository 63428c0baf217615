"""raise_training: GELU as users write it (jax.nn.gelu, tanh and erf forms, f32 and bf16, with Flax's
converts), forward and the backward JAX's AD produced, becomes nova.gelu and nova.gelu_backward; what
is not a GELU stays as it was; the GPU runs the raised ops' decomposition in no more kernels than the
generic ops took, and those kernels simulate right and assemble with ptxas.

Oracles: jax.jit of the same step; the plan of the step without raising (kernel counts); jax.lax
evaluation of each kernel's ops (the GPU kernels' simulation, poisoned outputs); ptxas.
"""
import dataclasses
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnova
from jnova.codegen.gpu.compile import compile_gpu_kernel
from jnova.codegen.gpu.ptx import assemble_check
from jnova.runtime.target import get_target
from jnova.passes.dce import dce
from jnova.passes.raise_training import raise_training
from jnova.primitives.nova_to_jax import evaluate_op
from helpers.gpu_emulation import check_kernel, gpu_plan
from helpers.kernels import requires_ptxas
from helpers.nova_funcs import nova_func
from helpers.random_inputs import normal

TARGET = get_target("h200")
TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=2e-2, atol=2e-2)}


def _normal(rng, shape, dtype="float32", scale=1.0):
    return normal(rng, shape, dtype, scale)


def _mlp_step(approximate: bool, flax_dtype):
    """value_and_grad of an MLP block written as a Flax user does: x @ w1 + b1, GELU, @ w2, in `flax_dtype`
    from f32 parameters (None: f32)."""
    def loss(params, x):
        w1, b1, w2 = params
        if flax_dtype is not None:
            w1, b1, w2, x = (a.astype(flax_dtype) for a in (w1, b1, w2, x))
        h = jax.nn.gelu(x @ w1 + b1, approximate=approximate)
        return jnp.mean(((h @ w2).astype(jnp.float32)) ** 2)

    return jax.value_and_grad(loss)


def _mlp_args(rng, n=24, c=16, h=64):
    return (_normal(rng, (c, h), scale=0.5), _normal(rng, (h,), scale=0.5), _normal(rng, (h, c), scale=0.3)), \
        _normal(rng, (n, c), scale=1.5)


def _op_names(func) -> list[str]:
    return [op.name for op in func.ops]


def _assert_close(got, want, dtype):
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        scale = max(float(np.abs(b).max()), 1e-6)
        np.testing.assert_allclose(a, b, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * scale,
                                   err_msg=f"leaf #{i}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("approximate", [True, False])
def test_gelu_forward_and_backward_are_raised(approximate, dtype):
    rng = np.random.default_rng()
    params, x = _mlp_args(rng)
    step = _mlp_step(approximate, jnp.bfloat16 if dtype == "bfloat16" else None)
    func = nova_func(step, params, x)
    assert raise_training(func, evaluate_op) == {"nova.gelu": 1, "nova.gelu_backward": 1}
    dce(func)
    func.verify()
    names = _op_names(func)
    assert not {"nova.tanh", "nova.erf", "nova.erfc", "nova.exp"} & set(names), names
    gelu = next(op for op in func.ops if op.name == "nova.gelu")
    assert gelu.attrs["approximate"] == ("tanh" if approximate else "erf")
    assert gelu.operands[0].type.dtype == dtype


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("approximate", [True, False])
def test_raised_gelu_step_matches_jit_on_cpu(approximate, dtype):
    rng = np.random.default_rng()
    params, x = _mlp_args(rng)
    step = _mlp_step(approximate, jnp.bfloat16 if dtype == "bfloat16" else None)
    compiled = jnova.compile(step)
    _assert_close(compiled(params, x), jax.jit(step)(params, x), dtype)
    text = compiled.lower(params, x).as_text("nova")
    assert '"nova.gelu"' in text and '"nova.gelu_backward"' in text


def test_what_is_not_a_gelu_stays_and_is_logged(caplog):
    rng = np.random.default_rng()
    x, w = _normal(rng, (8, 16)), _normal(rng, (16, 4))

    def step(x, w):  # x * tanh(x): a cone of one value through a tanh, but not a GELU
        return jax.value_and_grad(lambda v: jnp.sum((v * jnp.tanh(1.5 * v)) @ w))(x)

    func = nova_func(step, x, w)
    with caplog.at_level(logging.DEBUG, logger="jnova.passes"):
        assert raise_training(func, evaluate_op) == {}
    assert any("not a GELU" in r.getMessage() for r in caplog.records)
    assert "nova.tanh" in _op_names(func)
    _assert_close(jnova.compile(step)(x, w), jax.jit(step)(x, w), "float32")


def test_a_gelu_of_a_shifted_input_is_raised_on_the_shift():
    """GELU of x @ w + b: x is the sum (elementwise itself), not the contraction's output."""
    rng = np.random.default_rng()
    params, x = _mlp_args(rng)
    func = nova_func(_mlp_step(True, None), params, x)
    raise_training(func, evaluate_op)
    gelu = next(op for op in func.ops if op.name == "nova.gelu")
    assert gelu.operands[0].owner.name == "nova.add"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("approximate", [True, False])
def test_gpu_runs_the_raised_gelu_in_no_more_kernels(approximate, dtype):
    rng = np.random.default_rng()
    params, x = _mlp_args(rng)
    step = _mlp_step(approximate, jnp.bfloat16 if dtype == "bfloat16" else None)
    _, generic = gpu_plan(step, params, x, target=TARGET, training_ops=False)
    _, raised = gpu_plan(step, params, x, target=TARGET, training_ops=True)
    assert len(raised.kernels) <= len(generic.kernels), (len(raised.kernels), len(generic.kernels))
    for kernel in raised.kernels:
        ran, problems = check_kernel(kernel, TARGET, rng)
        assert not problems, problems


@requires_ptxas
def test_gpu_kernels_of_the_raised_gelu_assemble_with_ptxas():
    rng = np.random.default_rng()
    params, x = _mlp_args(rng)
    _, plan = gpu_plan(_mlp_step(True, jnp.bfloat16), params, x, target=TARGET, training_ops=True)
    gelu_kernels = [k for k in plan.kernels if any(op.name == "nova.tanh" for op in k.ops)]
    assert len(gelu_kernels) == 2  # the forward (in the c_fc epilogue or its own) and the backward
    for kernel in gelu_kernels:
        launch = compile_gpu_kernel(kernel, TARGET)
        report = assemble_check(launch.ptx, TARGET.arch)
        assert report.spills == 0, report.log


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpt2_step_gpu_plan_has_no_more_kernels_with_the_training_ops(dtype):
    from models import gpt2

    m = gpt2.model
    model = m.GPT(m.GPTConfig.tiny(dtype=m.DTYPES[dtype], attention="manual"))
    optimizer = m.make_optimizer(6e-4, 0.1)
    params = m.init_params(model, jax.random.key(0), 32)
    tokens, targets = map(jnp.asarray, gpt2.text_batch(0, 2, 32))
    args = (params, optimizer.init(params), tokens, targets)
    step = m.make_train_step(model, optimizer)
    _, generic = gpu_plan(step, *args, target=TARGET, training_ops=False)
    _, raised = gpu_plan(step, *args, target=TARGET, training_ops=True)
    assert len(raised.kernels) <= len(generic.kernels), (len(raised.kernels), len(generic.kernels))


# --------------------------------------------------------------------------- LayerNorm, RMSNorm
def _norm_step(kind: str, flax_dtype, input_dtype="float32"):
    """value_and_grad through a norm as users write it: Flax nn.LayerNorm / nn.RMSNorm (in `flax_dtype`),
    or RMSNorm by hand (x * rsqrt(mean(x * x) + eps) * w), followed by a contraction."""
    if kind == "layernorm":
        module = nn.LayerNorm(epsilon=1e-5, dtype=flax_dtype)
    elif kind == "rmsnorm":
        module = nn.RMSNorm(epsilon=1e-6, dtype=flax_dtype)

    def loss(params, x, w2):
        if kind == "handwritten":
            xf = x.astype(jnp.float32)
            y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * params["params"]["scale"]
        else:
            y = module.apply(params, x)
        return jnp.mean(((y @ w2.astype(y.dtype)).astype(jnp.float32)) ** 2)

    def init(rng, x):
        if kind == "handwritten":
            return {"params": {"scale": jnp.asarray(1 + 0.1 * rng.standard_normal(x.shape[-1]), jnp.float32)}}
        params = module.init(jax.random.key(0), x)
        return jax.tree.map(lambda p: p + 0.1 * rng.standard_normal(p.shape).astype(np.float32), params)

    return jax.value_and_grad(loss, argnums=(0, 1)), init


NORM_CASES = [("layernorm", None, "float32", "nova.layernorm"), ("layernorm", jnp.bfloat16, "float32", "nova.layernorm"),
              ("layernorm", jnp.bfloat16, "bfloat16", "nova.layernorm"), ("rmsnorm", None, "float32", "nova.rmsnorm"),
              ("rmsnorm", jnp.bfloat16, "float32", "nova.rmsnorm"), ("handwritten", None, "float32", "nova.rmsnorm")]


@pytest.mark.parametrize("kind, flax_dtype, input_dtype, op_name", NORM_CASES)
def test_norm_forward_is_raised_and_matches_jit(kind, flax_dtype, input_dtype, op_name):
    rng = np.random.default_rng()
    x = _normal(rng, (2, 12, 32), input_dtype, scale=2.0) + 0.5
    w2 = _normal(rng, (32, 8), scale=0.3)
    step, init = _norm_step(kind, flax_dtype)
    params = init(rng, x)
    func = nova_func(step, params, x, w2)
    assert raise_training(func, evaluate_op) == {op_name: 1}
    dce(func)
    func.verify()
    (norm,) = [op for op in func.ops if op.name == op_name]
    assert norm.operands[0].type.shape == x.shape
    # the statistics are computed once: the backward reads the raised op's mean and rstd
    assert sum(op.name == "nova.rsqrt" for op in func.ops) == 0
    dtype = "bfloat16" if "bfloat16" in (input_dtype, str(np.dtype(flax_dtype)) if flax_dtype else "") else "float32"
    compiled = jnova.compile(step)
    _assert_close(compiled(params, x, w2), jax.jit(step)(params, x, w2), dtype)
    assert f'"{op_name}"' in compiled.lower(params, x, w2).as_text("nova")


@pytest.mark.parametrize("kind, flax_dtype, input_dtype, op_name", NORM_CASES[:4])
def test_gpu_runs_the_raised_norm_in_no_more_kernels(kind, flax_dtype, input_dtype, op_name):
    rng = np.random.default_rng()
    x = _normal(rng, (2, 12, 32), input_dtype, scale=2.0) + 0.5
    w2 = _normal(rng, (32, 8), scale=0.3)
    step, init = _norm_step(kind, flax_dtype)
    params = init(rng, x)
    _, generic = gpu_plan(step, params, x, w2, target=TARGET, training_ops=False)
    _, raised = gpu_plan(step, params, x, w2, target=TARGET, training_ops=True)
    assert len(raised.kernels) <= len(generic.kernels), (len(raised.kernels), len(generic.kernels))
    for kernel in raised.kernels:
        _, problems = check_kernel(kernel, TARGET, rng)
        assert not problems, problems


def test_a_norm_without_its_epsilon_stays():
    rng = np.random.default_rng()
    x, w = _normal(rng, (4, 16)), _normal(rng, (16, 3))

    def step(x, w):  # rsqrt(mean(x^2)) without epsilon: not an RMSNorm this pass knows
        return jax.value_and_grad(lambda v: jnp.sum((v * jax.lax.rsqrt(jnp.mean(v * v, -1, keepdims=True))) @ w))(x)

    func = nova_func(step, x, w)
    assert raise_training(func, evaluate_op) == {}
    _assert_close(jnova.compile(step)(x, w), jax.jit(step)(x, w), "float32")


def test_two_pass_layernorm_is_an_rmsnorm_of_the_centered_rows_and_keeps_its_bias():
    """mean((x - m)^2) is E[v^2] of v = x - m: an RMSNorm of v with the scale; the bias stays an add."""
    rng = np.random.default_rng()
    x, w, b, w2 = _normal(rng, (33, 13)), _normal(rng, (13,)), _normal(rng, (13,)), _normal(rng, (13, 4))

    def step(x, w, b):
        def loss(x, w, b):
            v = x - jnp.mean(x, -1, keepdims=True)
            y = v * jax.lax.rsqrt(jnp.mean(v * v, -1, keepdims=True) + 1e-5) * w + b
            return jnp.sum((y @ w2) ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w, b)

    func = nova_func(step, x, w, b)
    assert raise_training(func, evaluate_op) == {"nova.rmsnorm": 1}
    _assert_close(jnova.compile(step)(x, w, b), jax.jit(step)(x, w, b), "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gpu_pipeline_raises_gelu_so_its_backward_reads_x_alone(monkeypatch, dtype):
    """Raised and expanded again on the GPU: the forward writes gelu(x) and nothing else of the
    activation's size (the backward JAX's AD wrote reads the forward's intermediates as well)."""
    from jnova.primitives import backends

    monkeypatch.setenv("JNOVA_CACHE_DIR", "off")
    rng = np.random.default_rng()
    params, x = _mlp_args(rng)
    step = _mlp_step(True, jnp.bfloat16 if dtype == "bfloat16" else None)
    hidden = params[0].shape[1]

    def activation_outputs() -> int:
        steps = jnova.compile(step, target="h200").lower(params, x).executable.meta["plan"]["steps"]
        shapes = [tuple(shape) for s in steps if "kernel" in s for shape, _ in s["out_types"]]
        return sum(shape == (x.shape[0], hidden) for shape in shapes)

    raised = activation_outputs()
    monkeypatch.setattr(backends, "RAISED_FOR_THEIR_BACKWARD", frozenset())
    generic = activation_outputs()
    assert raised < generic, (raised, generic)


def test_a_gelu_gated_where_the_probes_did_not_reach_is_not_a_gelu():
    """gelu(h) * (h < 8): equal to a GELU for every h within [-6, 6], where the probes were, and
    raised as one (silently wrong above 8). The probes reach 1e4 now: the product stays as written."""
    rng = np.random.default_rng()
    w, x = _normal(rng, (8, 8)), _normal(rng, (16, 8), scale=4.0)

    def step(w, x):
        def loss(w):
            h = x @ w
            return jnp.sum((jax.nn.gelu(h) * (h < 8.0)) ** 2)
        return jax.value_and_grad(loss)(w)

    assert float(jnp.max(x @ w)) > 8.0
    _assert_close(jnova.compile(step)(w, x), jax.jit(step)(w, x), "float32")


def test_a_norm_output_masked_where_the_probes_did_not_reach_is_not_the_norm():
    """LayerNorm(x) * (|y| < 50) with a scale up to 100: the probes' normalized values never reached 50,
    so the masked product was raised as the LayerNorm. Probes reach ~1e4 now; the mask stays."""
    rng = np.random.default_rng()
    x, w2 = _normal(rng, (2, 12, 32), scale=2.0) + 0.5, _normal(rng, (32, 8))
    params = {"scale": jnp.linspace(1.0, 100.0, 32), "bias": jnp.full(32, 0.1)}

    def step(params, x, w2):
        def loss(params):
            y = nn.LayerNorm().apply({"params": params}, x)
            return jnp.sum((y * (jnp.abs(y) < 50.0)) @ w2)
        return jax.value_and_grad(loss)(params)

    _assert_close(jnova.compile(step)(params, x, w2), jax.jit(step)(params, x, w2), "float32")


K_GELU = float(np.sqrt(2 / np.pi))


@pytest.mark.parametrize("activation, dtype", [
    (lambda x: 0.5 * x * (1 + jnp.tanh(K_GELU * (x + 0.0446 * x ** 3))), "float32"),  # another coefficient
    (lambda x: 0.5 * x * (1 + jnp.tanh(K_GELU * (x + 0.0447 * x ** 3))), "float32"),
    (lambda x: 0.5 * x * (1 + jnp.tanh(K_GELU * x)), "bfloat16"),                     # no cubic term
    (lambda x: 0.5 * x * (1 + jnp.tanh(K_GELU * (x + 0.03 * x ** 3))), "bfloat16")],
    ids=["f32-0.0446", "f32-0.0447", "bf16-no-cubic", "bf16-0.03"])
def test_an_activation_near_gelu_is_not_taken_for_it(activation, dtype):
    """Functions within the old probe tolerance of GELU (1e-4 in f32, 4e-2 in bf16, with a floor of a
    quarter of the largest value) but farther from it than their type's rounding were raised as GELU.
    The cone is now evaluated in f32 (its constants rounded as the program has them) and held to that
    rounding: they stay as written, and jnova is as close to the written function as jax.jit."""
    rng = np.random.default_rng()
    x, w = _normal(rng, (64, 16), dtype, scale=2.0), _normal(rng, (16, 4), dtype)

    def step(x, w):
        return jax.value_and_grad(lambda v: jnp.sum(activation(v) @ w).astype(jnp.float32))(x)

    func = nova_func(step, x, w)
    assert "nova.gelu" not in raise_training(func, evaluate_op)
    _assert_close(jnova.compile(step)(x, w), jax.jit(step)(x, w), dtype)


def test_every_layers_gelu_backward_of_a_bf16_gpt2_is_raised_once():
    """Flax bf16 GPT-2: each layer's GELU gradient is one nova.gelu_backward. The probes drawn for the
    cones rounded each bf16 step, and some layers' backwards (3 of 12 in the 124M step) fell outside
    the tolerance and stayed generic; evaluated as the function they define, all are raised, and the
    f32 widening of the raised gradient (the bias gradient's sum reads it) is a convert of it, not a
    second nova.gelu_backward."""
    from models import gpt2

    m = gpt2.model
    config = dataclasses.replace(m.GPTConfig.tiny(dtype=m.DTYPES["bfloat16"], attention="manual"), n_layer=12)
    model = m.GPT(config)
    optimizer = m.make_optimizer(6e-4, 0.1)
    params = jax.eval_shape(lambda: m.init_params(model, jax.random.key(0), 32))
    tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    step = m.make_train_step(model, optimizer)
    func = nova_func(step, params, jax.eval_shape(optimizer.init, params), tokens, tokens)
    raised = raise_training(func, evaluate_op)
    assert {k: raised.get(k) for k in ("nova.gelu", "nova.gelu_backward")} == \
        {"nova.gelu": config.n_layer, "nova.gelu_backward": config.n_layer}, raised
