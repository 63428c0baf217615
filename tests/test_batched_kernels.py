"""Horizontal fusion (`form_kernels.batch_terminal_kernels`, `codegen/gpu/batched.py`): the per-leaf
updates of an optimizer, kernels whose results only the step returns, launched as one kernel per batch.
The batched kernel is simulated on the CPU (`gpu_emulation`) with poisoned outputs against its own ops
run by jax.lax, and assembled with ptxas."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jnova
from helpers.gpu_emulation import check_kernel, gpu_plan
from jnova.codegen.gpu.compile import KERNEL_FAMILIES, build_gpu_module, compile_gpu_kernel
from jnova.passes.form_kernels import batch_terminal_kernels
from jnova.passes.plan import BatchedKernel
from jnova.runtime.target import get_target
from helpers.kernels import requires_ptxas

TARGET = get_target("h200")
# leaf sizes: one 16-byte group short, odd, a few blocks, a grid-stride loop, a scalar
SHAPES = {"w1": (64, 48), "b1": (48,), "w2": (48, 7), "b2": (7,), "emb": (1003, 768), "scale": ()}


def adam_step(params, state, x):
    def loss(p):
        h = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        return jnp.mean(h ** 2) + jnp.mean(p["emb"] ** 2) * p["scale"]

    value, grads = jax.value_and_grad(loss)(params)
    updates, state = optax.adamw(1e-3).update(grads, state, params)
    return value, optax.apply_updates(params, updates), state


def arguments(seed=0):
    rng = np.random.default_rng(seed)
    params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}
    x = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    return params, optax.adamw(1e-3).init(params), x


def batched(plan):
    return [k for k in plan.kernels if isinstance(k, BatchedKernel)]


def test_an_optimizers_leaf_updates_are_one_kernel():
    _, plan = gpu_plan(adam_step, *arguments())
    (batch,) = batched(plan)
    # every leaf's update kernel: the biases' are the epilogues of their gradients' column reductions (a
    # sum over the batch), batched with the elementwise ones
    assert sorted(s.outputs[0].type.shape for s in batch.segments) == sorted(SHAPES.values())
    assert sorted(build_gpu_module(s, TARGET).schedule.split("(")[0] for s in batch.segments) == \
        ["column_reduction"] * 2 + ["elementwise"] * 4
    assert all(len(s.outputs) == 3 for s in batch.segments)  # new parameter, mu, nu
    assert len(batch.outputs) == 3 * len(batch.segments)
    assert len(set(batch.inputs)) == len(batch.inputs)  # shared inputs (the step count) passed once
    assert plan.steps[-1] is batch or all(not isinstance(s, BatchedKernel) for s in plan.steps[plan.steps.index(batch) + 1:])


def test_only_kernels_whose_results_only_the_step_returns_are_batched():
    def step(x, y, z, m):  # sin(x) is read by two kernels and a matmul (so not recomputed in its readers):
        c = jnp.sin(x)       # not terminal; c * 3 and the sum: a row program
        return z * 2, y + 1, c * 3, jnp.sum(c), c @ m

    _, plan = gpu_plan(step, jnp.ones((40,)), jnp.ones((9,)), jnp.ones((24,)), jnp.ones((40, 8)))
    (batch,) = batched(plan)
    names = lambda k: {op.name for op in k.ops}  # noqa: E731
    assert sorted(sorted(names(s) - {"nova.constant"}) for s in batch.segments) == [["nova.add"], ["nova.mul"]]
    rest = [k for k in plan.kernels if k is not batch]
    assert sorted(sorted(names(k) - {"nova.constant"}) for k in rest) == \
        [["nova.matmul"], ["nova.mul", "nova.reduce"], ["nova.sin"]]


def test_batches_respect_the_parameter_budget():
    _, plan = gpu_plan(adam_step, *arguments())
    (batch,) = batched(plan)
    unbatched = type(plan)(plan.func, [s for s in plan.steps if s is not batch] + batch.segments)
    params = len(batch.inputs) + len(batch.outputs)
    split = batch_terminal_kernels(unbatched, KERNEL_FAMILIES.batchable, max_params=params - 1)
    batches = batched(split)
    assert len(batches) >= 1 and all(len(b.inputs) + len(b.outputs) < params for b in batches)
    kept = [k for k in split.kernels if any(k is s for s in batch.segments)]  # a batch of one stays a kernel
    assert sum(len(b.segments) for b in batches) + len(kept) == len(batch.segments)
    assert batched(batch_terminal_kernels(unbatched, KERNEL_FAMILIES.batchable, max_params=params))[0].segments == batch.segments


def test_batches_keep_at_most_a_budget_of_memory_alive():
    """A batch runs at its last member's position, so an earlier member's inputs (a bias gradient's
    activation-sized operand) live until then: the batch closes before that exceeds the budget."""
    _, plan = gpu_plan(adam_step, *arguments())
    (batch,) = batched(plan)
    unbatched = type(plan)(plan.func, [s for s in plan.steps if s is not batch] + batch.segments)
    split = batched(batch_terminal_kernels(unbatched, KERNEL_FAMILIES.batchable, max_delayed_bytes=0))
    assert all(not any(v.owner is not None and v not in b.segments[-1].inputs for v in b.inputs) for b in split)
    assert len(batched(batch_terminal_kernels(unbatched, KERNEL_FAMILIES.batchable, max_delayed_bytes=2**30))) == 1


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_kernel_simulated_on_cpu_matches_lax(seed):
    _, plan = gpu_plan(adam_step, *arguments(seed))
    (batch,) = batched(plan)
    simulated, problems = check_kernel(batch, TARGET, np.random.default_rng(seed))
    assert simulated and not problems, problems


def layers_step(params, state, x):  # three layers of one shape: their updates are the same code
    def loss(p):
        h = x
        for i in range(3):
            h = jnp.tanh(h @ p[f"w{i}"] + p[f"b{i}"])
        return jnp.mean(h ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    updates, state = optax.adamw(1e-3).update(grads, state, params)
    return value, optax.apply_updates(params, updates), state


@pytest.mark.parametrize("seed", [0, 1])
def test_segments_of_one_kind_share_their_code(seed):
    """Two layers' weight updates (and bias updates: a column reduction's epilogue) are one body in the
    batch, run by a block range per layer whose arrays are selected by the layer's index: simulated
    against jax.lax, every layer's result is its own."""
    rng = np.random.default_rng(seed)
    params = {f"{k}{i}": jnp.asarray(rng.standard_normal(s), jnp.float32)
              for i in range(3) for k, s in (("w", (40, 40)), ("b", (40,)))}
    x = jnp.asarray(rng.standard_normal((24, 40)), jnp.float32)
    _, plan = gpu_plan(layers_step, params, optax.adamw(1e-3).init(params), x)
    (batch,) = batched(plan)
    launch = compile_gpu_kernel(batch, TARGET)
    schedule = launch.schedule  # bodies of two segments at most (batched.MAX_SHARED), then one
    assert len(batch.segments) == 6 and "2x1600:" in schedule and "2x40:c" in schedule and "1x40:c" in schedule, schedule
    assert launch.gpu_module.count("scf.for") == 2 * (2 + 1)  # two column-reduction bodies (two loops each), two elementwise
    simulated, problems = check_kernel(batch, TARGET, rng)
    assert simulated and not problems, problems


@requires_ptxas
def test_batched_kernel_assembles_and_covers_every_segment():
    from helpers.kernels import assert_assembles_without_spills

    _, plan = gpu_plan(adam_step, *arguments())
    (batch,) = batched(plan)
    launch = assert_assembles_without_spills(batch, "h200", "adamw batch")
    assert launch.schedule.startswith(f"batched_elementwise(segments={len(batch.segments)}")
    assert launch.grid[0] >= len(batch.segments) and launch.block == (256, 1, 1)


def test_compiled_step_launches_fewer_kernels_and_lowers_for_cuda():
    args = arguments()
    lowered = jnova.compile(adam_step, target="h200").lower(*args)
    kernels = lowered.stats()["kernels"]
    hlo = lowered.as_text("hlo")
    assert "batched_elementwise" in lowered.as_text("launches")
    assert 0 < hlo.count("stablehlo.custom_call @") <= kernels  # one kernel call per launch
    _, plan = gpu_plan(adam_step, *args, target=get_target("h200"))
    (batch,) = batched(plan)
    assert kernels == len(plan.kernels) and len(batch.segments) == 6  # six update kernels, one launch
