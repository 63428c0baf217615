"""The persistent cache's key: the jaxpr's fingerprint is the same in every process for the same step,
and changes when anything the compiled step depends on changes."""
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jnova.capture.trace import trace
from jnova.options import Options
from jnova.pipeline import capture_key
from jnova.runtime.hashing import jaxpr_fingerprint

SCRIPT = textwrap.dedent("""
    import json
    import flax.linen as nn
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.extend import core as jex_core
    from jnova.capture.trace import trace
    from jnova.options import Options
    from jnova.pipeline import capture_key
    from jnova.runtime.hashing import jaxpr_fingerprint

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jax.nn.gelu(nn.Dense(16)(x), approximate=False)
            return nn.Dense(4)(jax.jit(lambda h: jax.nn.relu(h) * 2.0)(h))

    model, optimizer = MLP(), optax.adam(1e-3)
    scale = np.array([1.0, 2.0, 3.0, 4.0], np.float32)  # a small constant, compiled in

    def step(params, state, x, y):
        def loss(p):
            return jnp.mean((model.apply(p, x) * scale - y) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        active = jnp.mean(jax.nn.relu(model.apply(params, x)))  # not differentiated: a custom_jvp_call
        logged = jax.pure_callback(lambda v: np.asarray(v), jax.ShapeDtypeStruct((), jnp.float32), value)
        return optax.apply_updates(params, updates), state, value + 0 * logged, active

    x, y = np.ones((8, 6), np.float32), np.ones((8, 4), np.float32)
    params = model.init(jax.random.key(0), x)
    captured = trace(step, (params, optimizer.init(params), x, y), {})

    def primitives(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn.primitive.name
            for sub in jex_core.jaxprs_in_params(eqn.params):
                yield from primitives(sub)

    print(json.dumps({"fingerprint": jaxpr_fingerprint(captured.jaxpr),
                      "key": capture_key(captured, Options(), "cpu"),
                      "primitives": sorted(set(primitives(captured.jaxpr)))}))
""")


def _in_a_process(hash_seed: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONHASHSEED=str(hash_seed))
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_same_step_same_key_in_two_processes():
    """A Flax step with an optax update, a custom_jvp function (relu), a nested jit, a small constant
    and a host callback (its function's address differs per process) gets one key everywhere."""
    first, second = _in_a_process(1), _in_a_process(2)  # other string hashes: no set order leaks in
    assert {"custom_jvp_call", "jit", "pure_callback"} <= set(first["primitives"])
    assert first == second


def _key(fn, *args) -> str:
    return capture_key(trace(fn, args, {}), Options(), "cpu")


x33 = np.arange(9, dtype=np.float32).reshape(3, 3)


def _small(value):
    c = np.array([1.0, 2.0, value], np.float32)
    return lambda x: x * c


def _in_jit(op):
    return lambda x: jax.jit(lambda y: op(y) + 1.0)(x)


def _cond(*branches):
    return lambda x: jax.lax.cond(jnp.sum(x) > 0, *branches, x)


def _const_in_jit(value):
    c = np.array([1.0, 2.0, value], np.float32)
    return lambda x: jax.jit(lambda y: y * c)(x)


# each pair differs in one thing only
DIFFERENT = {
    "reduce axis": ((lambda x: jnp.sum(x, axis=0), x33), (lambda x: jnp.sum(x, axis=1), x33)),
    "literal value": ((lambda x: x * 2.0, x33), (lambda x: x * 3.0, x33)),
    "literal value in a nested jit": ((_in_jit(lambda y: y * 2.0), x33), (_in_jit(lambda y: y * 3.0), x33)),
    "shape": ((lambda x: jnp.sum(x), np.ones((2, 6), np.float32)), (lambda x: jnp.sum(x), np.ones((6, 2), np.float32))),
    "dtype": ((lambda x: x * 2, x33), (lambda x: x * 2, x33.astype(np.int32))),
    "op in a nested jit": ((_in_jit(jnp.sin), x33), (_in_jit(jnp.cos), x33)),
    "op in a cond branch": ((_cond(jnp.sin, jnp.cos), x33), (_cond(jnp.sin, jnp.tan), x33)),
    "small constant's value": ((_small(3.0), x33), (_small(4.0), x33)),
    "small constant's value in a nested jit": ((_const_in_jit(3.0), x33), (_const_in_jit(4.0), x33)),
    "operand order": ((lambda x, y: x - y, x33, x33), (lambda x, y: y - x, x33, x33)),
    "weak type of an argument": ((lambda x, s: x * s, x33, 2.0), (lambda x, s: x * s, x33, np.float32(2.0))),
}


@pytest.mark.parametrize("what", DIFFERENT)
def test_key_changes_with_one_difference(what):
    (f, *a), (g, *b) = DIFFERENT[what]
    assert _key(f, *a) == _key(f, *a)
    assert _key(f, *a) != _key(g, *b)


def test_key_ignores_large_constants_values():
    """A constant too large to compile in is passed to the compiled step: its value is not in the key."""
    big = [np.full((32, 32), v, np.float32) for v in (1.0, 2.0)]
    x = np.ones((32, 32), np.float32)
    assert _key(lambda x: x @ big[0], x) == _key(lambda x: x @ big[1], x)
