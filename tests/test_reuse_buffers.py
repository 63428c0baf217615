"""reuse_buffers: kernel outputs written into the buffers of inputs that die at the kernel."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jnova
from jnova.passes.form_kernels import Kernel
from models import tiny

N = 512  # two 512 x 512 f32 weights: 1 MiB each, so the update dominates the step's memory


def adam_step():
    rng = np.random.default_rng()
    params = {"w": jnp.asarray(rng.standard_normal((N, N)) / N**0.5, jnp.float32),
              "u": jnp.asarray(rng.standard_normal((N, N)) / N**0.5, jnp.float32)}
    opt = optax.adam(1e-3)
    state = opt.update(jax.tree.map(jnp.ones_like, params), opt.init(params), params)[1]  # moments not zero
    x = jnp.asarray(rng.standard_normal((4, N)), jnp.float32)

    def step(params, state, x):
        def loss(p):
            return jnp.sum(jnp.tanh(x @ p["w"]) @ p["u"])

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return step, params, state, x


def _copy(tree):
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


@pytest.mark.parametrize("kernels", ["fused", "segments"])
def test_donated_moments_are_updated_in_place(kernels):
    step, params, state, x = adam_step()
    lowered = jnova.compile(step, kernels=kernels, donate_argnums=(0, 1)).lower(params, state, x)
    moments = 2 * 2 * N * N * 4  # mu and nu of both weights
    report = lowered.memory()
    # Without the reuse, each update kernel writes the new moments beside the donated old ones and XLA
    # copies them back: 6.3 MB of temporaries (fused plan). With it, the moments take their own buffers.
    assert report.analysis["temp"] < moments, report
    pairs = [pair for s in lowered.executable.meta["plan"]["steps"] for pair in s.get("reuses", ())]
    assert len(pairs) >= 4  # at least mu and nu of both weights


@pytest.mark.parametrize("kernels", ["fused", "segments"])
def test_in_place_step_matches_jax_jit(kernels):
    step, params, state, x = adam_step()
    expected = jax.jit(step)(params, state, x)
    compiled = jnova.compile(step, kernels=kernels, donate_argnums=(0, 1))
    p, s = _copy(params), _copy(state)
    for _ in range(2):  # the second call reads what the first wrote in place
        p, s, value = compiled(p, s, x)
        if _ == 0:
            got = jax.tree.map(np.asarray, (p, s, value))  # read before the next call takes the buffers
    # the loss sums 2048 tanh terms of either sign to about 1: its f32 rounding (in whichever order a
    # kernel adds) is about 1e-5 of the sum of the terms' magnitudes, not of the result
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,  # noqa: E731
                                                    atol=1e-4 if np.ndim(b) == 0 else 1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        close(a, b)
    again = jax.jit(step)(*expected[:2], x)
    for a, b in zip(jax.tree.leaves((p, s, value)), jax.tree.leaves(again)):
        close(a, b)


def test_only_last_readers_of_the_same_type_read_in_place():
    step, params, state, x = adam_step()
    lowered = jnova.compile(step, kernels="fused", donate_argnums=(0, 1)).lower(params, state, x)
    plan = lowered.executable.meta["plan"]
    readers = {}
    for n, s in enumerate(plan["steps"]):
        for i in s["in"]:
            readers.setdefault(i, set()).add(n)
    types = {}
    for s in plan["steps"]:
        types.update(zip(s["out"], map(tuple, map(str, s.get("out_types", [])))))
    for n, s in enumerate(plan["steps"]):
        for a, b in s.get("reuses", ()):
            assert max(readers[s["in"][a]]) == n  # nothing reads the buffer after it is overwritten
            assert s["in"][a] not in plan["returns"]


def test_without_donation_arguments_are_never_overwritten():
    step, params, state, x = adam_step()
    lowered = jnova.compile(step, kernels="fused").lower(params, state, x)
    plan = lowered.executable.meta["plan"]
    for s in plan["steps"]:
        for a, _ in s.get("reuses", ()):
            assert s["in"][a] >= plan["num_args"]  # a value the step computed, not a caller's argument


def test_gpu_update_kernels_alias_the_moments():
    """The GPU plan (ahead of time): the optimizer's elementwise update kernels launch with their moments
    aliased to the new moments (input_output_aliases in the custom call)."""
    step, params, state, ids = tiny.setup(seed=int(np.random.default_rng().integers(1 << 30)),
                                          optimizer=optax.adamw(1e-3))
    lowered = jnova.compile(step, target="h200", donate_argnums=(0, 1)).lower(params, state, ids)
    plan = lowered.executable.meta["plan"]
    reused = [s for s in plan["steps"] if s.get("reuses")]
    assert reused
    hlo = lowered.as_text("hlo")
    assert hlo.count("output_operand_aliases") >= len(reused) - sum("scatter" in s.get("kernel", "") for s in reused)


def test_a_kernel_after_every_other_reader_of_its_input_takes_its_buffer():
    """exp(l - max(l)): the max kernel reads l too, but the exp kernel reads what it computed, so XLA
    runs it first; the exp kernel writes its result into l's buffer. Without the reuse, l and the
    result (4 MiB each) are both live."""
    rng = np.random.default_rng()
    x, w = (jnp.asarray(rng.standard_normal(s) / 8, jnp.float32) for s in ((1024, 64), (64, 1024)))
    fn = lambda x, w: 2.0 * jnp.exp((x @ w) - (x @ w).max(-1, keepdims=True))  # noqa: E731
    lowered = jnova.compile(fn, kernels="fused").lower(x, w)
    plan = lowered.executable.meta["plan"]
    readers = {}
    for n, s in enumerate(plan["steps"]):
        for i in s["in"]:
            readers.setdefault(i, set()).add(n)
    taken = [(n, s["in"][a]) for n, s in enumerate(plan["steps"]) for a, _ in s.get("reuses", ())]
    assert any(len(readers[v]) > 1 and n == max(readers[v]) for n, v in taken), plan["steps"]
    assert lowered.memory().analysis["temp"] < 2 * 1024 * 1024 * 4
    np.testing.assert_allclose(np.asarray(jnova.compile(fn, kernels="fused")(x, w)), np.asarray(jax.jit(fn)(x, w)),
                               rtol=1e-5, atol=1e-6)


def test_the_logits_gradient_takes_the_logits_buffer():
    """GPT-2's cross-entropy (the GPU plan): the backward kernel, after the forward kernel that read the
    logits for their statistics, writes the logits' gradient in place: the two never live together."""
    from models import gpt2

    m = gpt2.model
    model = m.GPT(m.GPTConfig.tiny(dtype=jnp.bfloat16, vocab_size=512, attention="xla"))
    optimizer = m.make_optimizer(6e-4, 0.1)
    params = m.init_params(model, jax.random.key(0), 32)
    tokens, targets = map(jnp.asarray, gpt2.text_batch(0, 3, 32))
    plan = jnova.compile(m.make_train_step(model, optimizer), target="h200") \
        .lower(params, optimizer.init(params), tokens, targets).executable.meta["plan"]
    (backward,) = [s for s in plan["steps"] if "kernel" in s and any(b.startswith("nova.sce_backward") for b in s["made_by"])]
    logits = backward["in"][0]
    assert sum(logits in s["in"] for s in plan["steps"]) >= 2  # the forward kernel reads them too
    assert [backward["in"][a] for a, _ in backward.get("reuses", ())] == [logits]


def test_a_transpose_of_a_convert_never_writes_over_what_it_reads():
    """A kernel reading a dying value through a convert and then a transpose (a batch of terminal
    kernels keeps both: Flax's bf16 weight gradients, rounded, transposed back and widened) reads each
    element at another element's offset: its output must not take that value's buffer. (Writing the
    transpose in place gave GPT-2's attention-projection gradients on the H200 a 54% error.)"""
    def fn(a, b):
        x, z = jnp.sum(a, axis=0), jnp.sum(b, axis=0)
        return tuple(v.astype(jnp.bfloat16).T.astype(jnp.float32) for v in (x, z))

    rng = np.random.default_rng()
    a, b = (jnp.asarray(rng.standard_normal((4, 256, 256)), jnp.float32) for _ in range(2))
    for excess_precision in (True, False):
        plan = jnova.compile(fn, target="h200", excess_precision=excess_precision).lower(a, b) \
            .executable.meta["plan"]
        transposing = [s for s in plan["steps"] if "kernel" in s and s["in"] and
                       any(t == [[256, 256], "float32"] for t in s["out_types"]) and "batch" in s["kernel"]]
        assert transposing, plan["steps"]
        assert all(not s.get("reuses") for s in transposing), transposing
