"""Fusion of 16-bit models under excess precision (their arithmetic in f32 between explicit
conversions): values cross between kernels in 16 bits (a widening to f32 is copied into each reader),
constant expressions are never tensors in memory, and a contraction rounds its result to bf16 in its
epilogue, bias and residual included, and stores C in bf16."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jnova
from helpers.gpu_emulation import check_plan_kernels, gpu_plan
from helpers.random_inputs import normal
from jnova.runtime.target import get_target

H200 = get_target("h200")
BF16 = jnp.bfloat16


class Mlp(nn.Module):
    """A transformer MLP block as Flax users write mixed precision: bf16 modules, f32 parameters."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(256, dtype=BF16)(nn.LayerNorm(dtype=BF16)(x))
        return x + nn.Dense(64, dtype=BF16)(nn.gelu(h))


def _step():
    model, opt = Mlp(), optax.adamw(1e-3)
    rng = np.random.default_rng()
    x = jnp.asarray(normal(rng, (4, 32, 64)), BF16)
    params = model.init(jax.random.key(0), x)["params"]

    def step(params, state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply({"params": p}, x).astype(jnp.float32) ** 2))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step, (params, opt.init(params), x)


def test_no_kernel_writes_a_widened_16_bit_value_or_a_constant():
    step, args = _step()
    program, plan = gpu_plan(step, *args, target=H200)
    widened = [(k.name, v.type) for k in plan.kernels for v in k.outputs
               if v.owner is not None and v.owner.name == "nova.convert" and v.type.dtype == "float32"
               and v.owner.operands[0].type.dtype == "bfloat16" and v not in program.func.returns]
    assert not widened, widened
    constants = [k.name for k in plan.kernels if not k.inputs]
    assert not constants, constants


def test_contractions_round_to_bf16_in_their_epilogue():
    step, args = _step()
    launches = jnova.compile(step, target="h200").lower(*args).as_text("launches")
    matmuls = [line for line in launches.splitlines() if " matmul[" in line]
    forward = [m for m in matmuls if re.search(r" 1x128x(256x64|64x256) bfloat16 a=row b=row", m)]
    # the f32 sum rounded to bf16 and widened for the bias add is read unrounded (excess precision
    # inside a kernel); the biased value is rounded once, in the epilogue
    assert forward and all(re.search(r"epilogue=bias\(bfloat16\),.*to:bfloat16 ", m) for m in forward), matmuls
    assert any("residual(bfloat16)" in m for m in forward), matmuls  # x + Dense(...): the residual too


def test_the_16_bit_plan_kernels_compute_what_their_ops_say():
    """Every kernel of the plan whose threads do not talk to each other, run on the CPU from its GPU
    code (the widenings copied into readers, constant expressions in registers) against jax.lax."""
    step, args = _step()
    simulated, problems = check_plan_kernels(step, *args, target=H200)
    assert simulated >= 3 and not problems, problems


def test_the_16_bit_loss_and_gradients_still_equal_jax_jit_on_the_cpu():
    step, (params, _, x) = _step()
    model = Mlp()
    grad = jax.value_and_grad(lambda p, x: jnp.mean(model.apply({"params": p}, x).astype(jnp.float32) ** 2))
    got, want = jnova.compile(grad, kernels="fused")(params, x), jax.jit(grad)(params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * float(np.abs(w).max()))


def test_the_lm_head_writes_bf16_logits_that_the_cross_entropy_reads():
    """GPT-2's tied head in bf16: the logits' rounding (and the view of them as [tokens, vocabulary]
    the cross-entropy takes) is the contraction's epilogue; no kernel of the logits' size besides the
    head and the cross-entropy's own."""
    from models import gpt2

    m = gpt2.model
    model = m.GPT(m.GPTConfig.tiny(dtype=BF16, vocab_size=512, attention="xla"))
    optimizer = m.make_optimizer(6e-4, 0.1)
    params = m.init_params(model, jax.random.key(0), 32)
    tokens, targets = map(jnp.asarray, gpt2.text_batch(0, 3, 32))   # 96 tokens: no weight has the logits' size
    lowered = jnova.compile(m.make_train_step(model, optimizer), target="h200") \
        .lower(params, optimizer.init(params), tokens, targets)
    launches = lowered.as_text("launches").splitlines()
    head = [line for line in launches if " matmul[" in line and " 1x96x512x64 " in line]
    assert len(head) == 1 and "epilogue=to:bfloat16" in head[0], head
    steps = lowered.executable.meta["plan"]["steps"]
    logits_sized = [(shape, dtype) for s in steps if "kernel" in s for shape, dtype in s["out_types"]
                    if int(np.prod(shape)) == 96 * 512]
    assert [dtype for _, dtype in logits_sized] == ["bfloat16", "bfloat16"], logits_sized  # head, dlogits
