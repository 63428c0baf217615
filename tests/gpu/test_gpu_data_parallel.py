"""A jnova step in a data-parallel program over every local GPU matches jax.jit of the same program,
and its all-reduce buckets reach XLA's compiled step (skipped with fewer than two GPUs)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jnova
from helpers.data_parallel import assert_trees_close

pytestmark = pytest.mark.gpu


def mlp_sgd_step(w, x, y):
    def loss(w):
        h = jnp.tanh(x @ w["a"] + w["b"])
        return jnp.mean((h @ w["c"] - y) ** 2)

    value, grads = jax.value_and_grad(loss)(w)
    grads = jax.lax.pmean(grads, "d")
    return jax.tree.map(lambda p, g: p - 0.1 * g, w, grads), jax.lax.pmean(value, "d")


@pytest.mark.parametrize("bucket_bytes", [4 * 2**20, 64 * 2**20])
def test_shard_map_of_a_jnova_step_on_every_gpu(bucket_bytes):
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs two GPUs")
    mesh = Mesh(np.array(devices), ("d",))
    specs = dict(mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()), check_vma=False)
    rng = np.random.default_rng()
    n = 1024  # gradients of 4 MiB (a, c) and 4 KiB (b)
    w = {"a": rng.standard_normal((n, n)) / 32, "b": rng.standard_normal(n), "c": rng.standard_normal((n, n)) / 32}
    w = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), w)
    x = jnp.asarray(rng.standard_normal((64 * len(devices), n)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((64 * len(devices), n)), jnp.float32)
    step = jnova.compile(mlp_sgd_step, bucket_bytes=bucket_bytes)
    run = jax.jit(jax.shard_map(step, **specs))
    with jax.default_matmul_precision("float32"):
        want = jax.jit(jax.shard_map(mlp_sgd_step, **specs))(w, x, y)
    assert_trees_close(run(w, x, y), want, rtol=4 * 2.0**-10)  # jnova's contractions run in TF32
    compiled = run.lower(w, x, y).compile().as_text()
    all_reduces = len(re.findall(r"all-reduce(-start)?\(", compiled))
    print(f"bucket_bytes {bucket_bytes}: buckets {step.stats()[0]['all_reduce_buckets']}, "
          f"all-reduces in XLA's compiled step {all_reduces}")
    assert all_reduces >= 1
