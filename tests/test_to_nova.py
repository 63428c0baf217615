"""jaxpr -> nova (capture/to_nova.py): what is inlined rather than converted by a rule, and values
no kernel computes with."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jnova
from jnova.capture.to_nova import find_site, to_nova
from jnova.capture.trace import trace


def test_platform_dependent_branches_compile_for_the_steps_platform():
    """`lax.platform_dependent` (behind `jnp.diagonal`, whose gradient is platform-dependent too) is a
    `platform_index` and a `cond` over per-platform branches; they were fallbacks, so a CLIP-style loss
    over a similarity matrix's diagonal did not compile with fallback="error". The branch of the step's
    platform is inlined: here the CPU's, not the default one."""

    def step(a, b):
        def loss(a):
            logits = a @ b.T
            diag = jnp.diagonal(logits)
            picked = lax.platform_dependent(logits, cpu=lambda z: z * 2.0, default=lambda z: z * 3.0)
            return (jax.nn.logsumexp(logits, 0) - diag).mean() + picked.sum()

        return jax.value_and_grad(loss)(a)

    rng = np.random.default_rng()
    a, b = (rng.standard_normal((5, 4), np.float32) for _ in range(2))
    got, want = jnova.compile(step, fallback="error")(a, b), jax.jit(step)(a, b)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_a_fallback_inside_a_platform_branch_is_found_again():
    """A fallback op's site is found again from its path (how a step restored from the disk cache gets
    its XLA ops back); the path passes through the inlined cond and names the branch taken."""

    def f(x):
        return lax.platform_dependent(x, cpu=lambda z: lax.top_k(z, 2)[0] * 2.0, default=lambda z: z[..., :2])

    captured = trace(f, (np.ones((3, 5), np.float32),), {})
    program = to_nova(captured, platforms=("cpu",))
    (site,) = program.sites
    assert site.primitive.name == "top_k"
    assert find_site(captured.jaxpr, program.site_paths[0]) is site


def test_complex_and_fp8_values_run_as_xla_ops(tmp_path, monkeypatch):
    """Values of element types no kernel computes with (an FFT's complex values, an fp8 fake
    quantization) are held by nova values that only fallback ops read and write; a literal of such a
    type (`* 1j`) is an argument of the compiled step. Converting them raised TypeError (and the
    literal, a constant, reached a CPU kernel MLIR could not parse). The literals go into the
    persistent cache's entry: a step restored from it gets them back."""
    monkeypatch.setenv("JNOVA_CACHE_DIR", str(tmp_path))

    def step(x, c):
        def loss(x):
            z = jnp.fft.rfft(x) * 1j + c
            q = x.astype(jnp.float8_e4m3fn).astype(jnp.float32)
            return jnp.abs(z).sum() + (q * x).sum()

        value, grad = jax.value_and_grad(loss)(x)
        return value, grad, c * 2

    rng = np.random.default_rng()
    x = rng.standard_normal((4, 8)).astype(np.float32)
    c = (rng.standard_normal((4, 5)) + 1j * rng.standard_normal((4, 5))).astype(np.complex64)
    want = jax.jit(step)(x, c)
    for restored in (False, True):
        compiled = jnova.compile(step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = compiled(x, c)
        stats = compiled.stats()[0]
        assert stats["cache_hit"] == ("disk" if restored else None)
        assert {"fft", "convert_element_type", "mul"} <= set(stats["fallbacks"])
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_value_preserving_primitives_are_compiled_as_their_operand():
    """checkpoint_name (jax's `name` primitive, for remat policies), stop_gradient and
    optimization_barrier leave their operand's value as it is: compiled, with no fallback warning,
    under a remat policy that saves the named value too."""
    from jax.ad_checkpoint import checkpoint_name

    def loss(x):
        h = checkpoint_name(jnp.tanh(x), "h")
        return jnp.sum(lax.optimization_barrier(h) ** 2 + lax.stop_gradient(h) * x)

    policy = jax.checkpoint_policies.save_only_these_names("h")
    x = jnp.asarray(np.random.default_rng().standard_normal(16), jnp.float32)
    for fn in (jax.grad(loss), jax.grad(jax.checkpoint(loss, policy=policy))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback warns
            got = jnova.compile(fn)(x)
        np.testing.assert_allclose(got, jax.jit(fn)(x), rtol=1e-5, atol=1e-6)
