"""Values recomputed in the kernels that read them instead of crossing memory (passes/fuse.py), and
contraction results that cross memory in 16 bits: the GPU plans of bf16 steps as Flax users write them,
their kernels run on the CPU from their GPU code, and the steps' results against jax.jit."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jnova
from helpers.gpu_emulation import check_plan_kernels, gpu_plan
from helpers.random_inputs import normal
from jnova.runtime.target import get_target

H200 = get_target("h200")
BF16 = jnp.bfloat16
ROWS, C = (4, 32), 64


class ResidualNorm(nn.Module):
    """x + r, then a bf16 LayerNorm and a projection: a pre-LN block's residual stream."""

    @nn.compact
    def __call__(self, x, r):
        return nn.Dense(x.shape[-1], dtype=BF16)(nn.LayerNorm(dtype=BF16)(x + r))


def _norm_step(shape=ROWS + (C,)):
    model = ResidualNorm()
    rng = np.random.default_rng()
    x, r = (jnp.asarray(normal(rng, shape), BF16) for _ in range(2))
    params = model.init(jax.random.key(0), x, r)["params"]
    loss = lambda p, x, r: jnp.mean(model.apply({"params": p}, x, r).astype(jnp.float32) ** 2)  # noqa: E731
    return jax.value_and_grad(loss, argnums=(0, 1)), (params, x, r)


def _activation_outputs(plan, func):
    """(kernel, dtype) of each value of an activation's shape a kernel writes and the step does not return."""
    return [(k.name, v.type.dtype) for k in plan.kernels for v in k.outputs
            if v.type.shape[:2] == ROWS and v.type.shape[2:] >= (C,) and v not in func.returns]


def test_a_bf16_layer_norm_saves_no_f32_tensor_for_its_backward():
    """The centred and normalized input the backward reads are recomputed there from the bf16 sum
    x + r and two row statistics: every activation-sized value crosses memory in bf16."""
    step, args = _norm_step()
    program, plan = gpu_plan(step, *args, target=H200)
    written = _activation_outputs(plan, program.func)
    assert written and all(dtype == "bfloat16" for _, dtype in written), written


def test_recomputed_values_compute_what_their_ops_say_on_the_gpu_and_the_cpu():
    step, args = _norm_step((2, 4, 32))  # the emulated kernels run a thread at a time
    simulated, problems = check_plan_kernels(step, *args, target=H200)
    assert simulated >= 2 and not problems, problems
    got, want = jnova.compile(step, kernels="fused")(*args), jax.jit(step)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * float(np.abs(w).max()))


def test_a_contraction_rounds_its_result_when_its_reader_is_a_reduction():
    """sum(tanh(round(x @ w))) in bf16, the product in f32 (as JAX's AD writes a bf16 Dense's dX): the
    reduction takes the tanh as its prologue; the contraction, which cannot share its kernel, takes the
    rounding to bf16 before its result crosses memory."""
    rng = np.random.default_rng()
    x, w = jnp.asarray(normal(rng, (256, 64)), BF16), jnp.asarray(normal(rng, (64, 128)), BF16)
    fn = lambda x, w: jnp.tanh(jax.lax.dot(x, w, preferred_element_type=jnp.float32).astype(BF16)) \
        .astype(jnp.float32).sum(-1)  # noqa: E731
    _, plan = gpu_plan(fn, x, w, target=H200)
    (matmul,) = [k for k in plan.kernels if any(op.name == "nova.matmul" for op in k.ops)]
    assert [v.type.dtype for v in matmul.outputs] == ["bfloat16"], matmul.outputs
    got = jnova.compile(fn, kernels="fused")(x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(fn)(x, w)), rtol=2e-2, atol=2e-2)


def test_gpt2_activations_cross_memory_in_bf16():
    """GPT-2 with Flax's bf16 modules: every [batch, T, d_model] and [batch, T, 4 d_model] value a
    kernel writes is bf16, as in jax.jit's step. (The gradient entering GELU's backward is the MLP
    projection's dX rounded to bf16: the raised backward keeps the rounding, so the contraction stores
    bf16; each LayerNorm's backward recomputes its normalized input from the bf16 residual stream.)"""
    from models import gpt2

    m = gpt2.model
    config = m.GPTConfig.tiny(dtype=BF16, vocab_size=512, attention="xla")
    model, optimizer = m.GPT(config), m.make_optimizer(6e-4, 0.1)
    params = m.init_params(model, jax.random.key(0), 32)
    tokens, targets = map(jnp.asarray, gpt2.text_batch(0, 3, 32))
    lowered = jnova.compile(m.make_train_step(model, optimizer), target="h200") \
        .lower(params, optimizer.init(params), tokens, targets)
    activations = {(3, 32, config.d_model), (3, 32, 4 * config.d_model)}
    written = [(s["kernel"], dtype) for s in lowered.executable.meta["plan"]["steps"] if "kernel" in s
               for shape, dtype in s["out_types"] if tuple(shape) in activations]
    assert written and all(dtype == "bfloat16" for _, dtype in written), written


def test_a_rounding_folded_in_one_kernel_leaves_the_others_copies_alone():
    """bf16 log_softmax's exp(x - max) is recomputed in the sum's kernel and the gradient's; where one
    kernel reads it unrounded (excess precision), it has its own copies of the ops it rewrites."""
    def loss(p, labels, s):
        v = -jnp.sum(jax.nn.one_hot(labels, 16, dtype=p.dtype) * jax.nn.log_softmax(p), axis=-1)
        return jnp.vdot(v.astype(jnp.float32), s)

    rng = np.random.default_rng()
    args = (jnp.asarray(normal(rng, (1, 4, 16)), BF16), jnp.asarray(rng.integers(0, 16, (1, 4)), jnp.int32),
            jnp.asarray(normal(rng, (1, 4)), jnp.float32))
    step = jax.value_and_grad(loss)
    got, want = jnova.compile(step, kernels="fused")(*args), jax.jit(step)(*args)
    # the loss sums terms of both signs (s is random): its bf16 rounding is relative to the terms, not to
    # a sum that may nearly cancel
    logits = np.asarray(args[0], np.float64)
    log_p = logits - logits.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    terms = -np.take_along_axis(log_p, np.asarray(args[1])[..., None], -1)[..., 0] * np.asarray(args[2], np.float64)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        scale = float(np.abs(terms).sum()) if w.ndim == 0 else float(np.abs(w).max())
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * scale)
