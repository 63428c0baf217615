"""jnova-compiled steps in data-parallel programs: shard_map and pmap around jnova.compile, and
jnova.compile around them, against jax.jit of the same program.

Inside shard_map (check_vma=True) every value's type says which mesh axes it varies over, and JAX
inserts `pvary` where an invariant value meets a varying one. A jnova step traced there keeps those
types, and each kernel result takes the axes of the operands it is computed from (a result of
constants only is invariant), so the collectives JAX placed still type-check when the step runs.
The in-process tests use a one-device mesh (the types are the same); a subprocess with two host
devices checks the numbers of real all-reduces."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jnova
from helpers.data_parallel import assert_trees_close, mlp_problem, mlp_sgd_step, problem, sgd_step


def test_jnova_step_inside_shard_map_keeps_the_varying_axes():
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    specs = dict(mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))
    w, x, y = problem(np.random.default_rng(), 1)
    inner = jnova.compile(sgd_step)
    want = jax.jit(jax.shard_map(sgd_step, **specs))(w, x, y)
    assert_trees_close(jax.jit(jax.shard_map(inner, **specs))(w, x, y), want)
    assert inner.stats()[0]["kernels"] > 0  # jnova compiled the step inside, collectives run as XLA ops
    assert "pvary" in inner.stats()[0]["fallbacks"] and inner.stats()[0]["all_reduce_buckets"]
    # Without check_vma the same shapes are another signature: no value's type varies there.
    assert_trees_close(jax.jit(jax.shard_map(inner, check_vma=False, **specs))(w, x, y), want)
    assert inner.compile_count == 2


def test_kernel_results_vary_over_the_axes_of_their_operands():
    """One kernel with a result from its varying operand, one from its invariant operand and one from
    constants only: each result varies over the axes of what it is computed from (`out_deps`)."""
    from jnova.dialect.types import TensorType
    from jnova.primitives.nova_kernel import KernelHandle, nova_kernel_p
    from jnova.runtime.jax_internals import varying_axes

    def run_host(w, x):
        return [np.asarray(x) * 2, np.asarray(w) * 3, np.full(3, 4.0, np.float32)]

    types = [TensorType((6,), "float32"), TensorType((3,), "float32"), TensorType((3,), "float32")]
    kernel = KernelHandle("mixed", types, "cpu", run_host, out_deps=[[1], [0], []])
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    seen = []

    def inner(w, x):
        outs = nova_kernel_p.bind(w, x, kernel=kernel)
        seen.append([sorted(varying_axes(jax.typeof(o))) for o in outs])
        return tuple(outs)

    w, x = jnp.arange(3.0), jnp.arange(6.0)
    got = jax.shard_map(inner, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P("d"), P(), P()))(w, x)
    assert seen[0] == [["d"], [], []]
    assert_trees_close(got, run_host(w, x))
    unknown = KernelHandle("unknown", types, "cpu", run_host)  # no out_deps: every result from every operand
    with pytest.raises(ValueError, match="out_specs"):  # then the invariant results vary: P() refuses them
        jax.shard_map(lambda w, x: tuple(nova_kernel_p.bind(w, x, kernel=unknown)), mesh=mesh,
                      in_specs=(P(), P("d")), out_specs=(P("d"), P(), P()))(w, x)


def test_jnova_compile_of_a_shard_map_runs_it_as_one_xla_op():
    """jnova.compile(shard_map(step)): the shard_map is a primitive jnova has no rule for, so it runs as
    one XLA op (with a warning) and gives jax.jit's results; compile the step inside instead."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    program = jax.shard_map(sgd_step, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))
    w, x, y = problem(np.random.default_rng(), 1)
    with pytest.warns(UserWarning, match=r"'shard_map' is not compiled .*jax.shard_map\(jnova.compile\(step\)"):
        step = jnova.compile(program)
        got = step(w, x, y)
    assert_trees_close(got, jax.jit(program)(w, x, y), rtol=1e-6)
    assert step.stats()[0]["fallbacks"] == ["shard_map"]


SEVERAL_DEVICES = """
import json, os
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jnova
from helpers.data_parallel import assert_trees_close, mlp_problem, mlp_sgd_step, problem, sgd_step
from helpers.data_parallel import mlp_problem, mlp_sgd_step, problem, sgd_step

n = int(os.environ["JNOVA_TEST_DEVICES"])
assert len(jax.devices()) == n
mesh = Mesh(np.array(jax.devices()), ("d",))
specs = dict(mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))
w, x, y = problem(np.random.default_rng(), n)
xs, ys = x.reshape(n, 8, 16), y.reshape(n, 8, 8)
pmapped = dict(axis_name="d", in_axes=(None, 0, 0), out_axes=(None, None))
# (shard_map with check_vma sums a replicated parameter's gradient itself: its pmean then averages
# equal values, and the step differs from pmap's; each is compared with jax.jit of its own program)
want = {"shard_map": jax.jit(jax.shard_map(sgd_step, **specs))(w, x, y),
        "pmap": jax.pmap(sgd_step, **pmapped)(w, xs, ys)}
inner = jnova.compile(sgd_step)
runs = {
    "shard_map(jnova)": ("shard_map", jax.jit(jax.shard_map(inner, **specs))(w, x, y)),
    "jnova(shard_map)": ("shard_map", jnova.compile(jax.shard_map(sgd_step, **specs))(w, x, y)),
    "pmap(jnova)": ("pmap", jax.pmap(jnova.compile(sgd_step), **pmapped)(w, xs, ys)),
    "jnova(pmap)": ("pmap", jnova.compile(jax.pmap(sgd_step, **pmapped))(w, xs, ys)),
}
# errors relative to the largest value of each leaf
report = {name: max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) / float(np.abs(np.asarray(b)).max())
                    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want[kind]), strict=True))
          for name, (kind, got) in runs.items()}
for bucket_bytes in (1, 2**20):  # data-parallel steps with their all-reduces bucketed both ways
    specs_nv = dict(specs, check_vma=False)
    w2, x2, y2 = mlp_problem(np.random.default_rng(1), n)
    want2 = jax.jit(jax.shard_map(mlp_sgd_step, **specs_nv))(w2, x2, y2)
    step2 = jax.jit(jax.shard_map(jnova.compile(mlp_sgd_step, bucket_bytes=bucket_bytes), **specs_nv))
    report[f"buckets of {bucket_bytes} bytes"] = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) / float(np.abs(np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(step2(w2, x2, y2)), jax.tree.leaves(want2), strict=True))
    report[f"all_reduces with {bucket_bytes}"] = step2.lower(w2, x2, y2).as_text().count("all_reduce")
# a shard's step without the all-reduce is another result: the collectives did run
shard0 = jax.jit(jax.shard_map(sgd_step, **specs))(w, x[:8].repeat(n, 0), y[:8].repeat(n, 0))
report["all_reduce_mattered"] = float(np.max(np.abs(np.asarray(shard0[1]) - np.asarray(want["shard_map"][1]))))
report["kernels_inside"] = inner.stats()[0]["kernels"]
print(json.dumps(report))
"""


@pytest.mark.parametrize("devices", [2, 4])
def test_several_devices_all_reduce_as_jax_jit(devices):
    """Two and four host devices, real all-reduces: each way of putting a jnova step into a
    data-parallel program matches jax.jit of the shard_map program."""
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
           "JNOVA_TEST_DEVICES": str(devices),
           "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SEVERAL_DEVICES], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report.pop("kernels_inside") > 0
    assert report.pop("all_reduce_mattered") > 1e-3
    # one all-reduce per bucket in the step's HLO: five of one value each, or one of all five
    assert (report.pop("all_reduces with 1"), report.pop(f"all_reduces with {2**20}")) == (5, 1), report
    assert all(err <= 1e-5 for err in report.values()), report


def test_plan_records_which_inputs_each_kernel_result_is_computed_from():
    def f(w, x):
        return x * 2.0 + 1.0, jnp.exp(w * 3.0), jnp.sin(jnp.ones(3) * 4.0)

    lowered = jnova.compile(f).lower(jnp.ones(3), jnp.ones(6))  # the CPU's plan: one kernel for the run
    plan = lowered.executable.meta["plan"]
    (kernel,) = [s for s in plan["steps"] if "kernel" in s]
    deps = {out: sorted(kernel["in"][j] for j in d) for out, d in zip(kernel["out"], kernel["deps"])}
    assert [deps[r] for r in plan["returns"]] == [[1], [0], []]  # arguments w = 0, x = 1


@pytest.mark.parametrize("bucket_bytes", [1, 1200, 2**20])
def test_all_reduces_run_in_buckets_right_after_their_last_operand(bucket_bytes):
    """pmean(grads) after the backward pass becomes buckets of at most `bucket_bytes` (a larger
    gradient alone), filled in the order the gradients are computed, each placed right after the step
    computing its last gradient; results as jax.jit's."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    specs = dict(mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()), check_vma=False)
    w, x, y = mlp_problem(np.random.default_rng(), 1)
    inner = jnova.compile(mlp_sgd_step, bucket_bytes=bucket_bytes)
    seen = []

    def traced(w, x, y):
        seen.append(inner.lower(w, x, y).executable.meta["plan"])
        return inner(w, x, y)

    got = jax.jit(jax.shard_map(traced, **specs))(w, x, y)
    assert_trees_close(got, jax.jit(jax.shard_map(mlp_sgd_step, **specs))(w, x, y))
    steps = seen[0]["steps"]
    assert not any(s.get("fallback") == "psum" for s in steps)  # every psum is in a bucket
    buckets = [(i, s) for i, s in enumerate(steps) if "bucket" in s]
    sizes = [len(s["in"]) for _, s in buckets]
    assert sum(sizes) == 5  # four gradients and the loss
    if bucket_bytes == 1:
        assert sizes == [1] * 5
    if bucket_bytes == 2**20:
        assert len(buckets) <= 2  # all in one, unless a reader of a result comes before the last operand
    produced_by = {v: i for i, s in enumerate(steps) for v in s["out"]}
    for i, bucket in buckets:
        last = max(produced_by.get(v, -1) for v in bucket["in"])
        assert all("bucket" in s for s in steps[last + 1:i])  # right after it (other buckets aside)
    first_bucket, last_reader = buckets[0][0], max(i for i, s in enumerate(steps) if "kernel" in s)
    assert first_bucket < last_reader  # the first all-reduce runs before the backward's end


def test_bucket_plan_prints_each_bucket_with_its_bytes_values_and_start():
    """as_text("buckets"): one line per bucket of the plan, with its bytes, its values and the plan
    step it starts after; a step without all-reduces says so."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    specs = dict(mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()), check_vma=False)
    w, x, y = mlp_problem(np.random.default_rng(), 1)
    for bucket_bytes, rows in ((1, 5), (2**20, None)):
        inner = jnova.compile(mlp_sgd_step, bucket_bytes=bucket_bytes)
        seen = []

        def traced(w, x, y):
            seen.append(inner.lower(w, x, y))
            return inner(w, x, y)

        jax.jit(jax.shard_map(traced, **specs))(w, x, y)
        lowered = seen[0]
        assert "buckets" in lowered.stages
        table = lowered.as_text("buckets").splitlines()
        buckets = [s for s in lowered.executable.meta["plan"]["steps"] if "bucket" in s]
        body = table[1:-1]
        assert len(body) == len(buckets) == (rows or len(buckets))
        want_bytes = 4 * (16 * 32 + 32 + 32 * 8 + 8 + 1)  # the four gradients and the loss, f32
        assert sum(int(line.split(" | ")[1]) for line in body) == want_bytes
        assert table[-1] == f"{len(buckets)} buckets, {want_bytes} bytes"
        assert all("psum at " in line and "mlp_sgd_step" in line and "kernel_" in line.split(" | ")[-1]
                   for line in body), table
    no_buckets = jnova.compile(lambda a: a * 2.0).lower(jnp.ones(3)).as_text("buckets")
    assert no_buckets.startswith("no all-reduce buckets")


PLACEMENTS = """
import json, os, warnings
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jnova
from helpers.data_parallel import problem, sgd_step

warnings.simplefilter("ignore")  # the shard_map primitive runs as an XLA op, with a warning
report = {}
rng = np.random.default_rng()
# the same step on arrays committed to one device, then to the other: jax.jit compiles for each
f = lambda x: jnp.tanh(x) * 2
step = jnova.compile(f)
x = jnp.asarray(rng.standard_normal(8), jnp.float32)
for d in jax.devices():
    got = step(jax.device_put(x, d))
    report[f"device {d.id} error"] = float(np.abs(np.asarray(got) - np.asarray(jax.jit(f)(x))).max())
    report[f"device {d.id} placed"] = [g.id for g in got.devices()] == [d.id]
report["compiles"] = step.compile_count
# jax.make_mesh's axes are Explicit: the arrays' sharding is part of their type
mesh = jax.make_mesh((2,), ("d",))
report["axis_types"] = str(mesh.axis_types)
w, x, y = problem(rng, 2)
w = jax.device_put(w, NamedSharding(mesh, P()))
x, y = (jax.device_put(a, NamedSharding(mesh, P("d"))) for a in (x, y))
specs = dict(mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))
want = jax.jit(jax.shard_map(sgd_step, **specs))(w, x, y)
runs = {"jnova(shard_map)": jnova.compile(jax.shard_map(sgd_step, **specs))(w, x, y),
        "shard_map(jnova)": jax.jit(jax.shard_map(jnova.compile(sgd_step), **specs))(w, x, y)}
for name, got in runs.items():
    report[name] = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) / float(np.abs(np.asarray(b)).max())
                       for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
# a plain step (no shard_map) on explicitly sharded arrays: the same values as jax.jit's
plain = lambda w, x: (jnp.sum(jnp.tanh(x @ w["a"] + w["b"])), jnp.sin(x) * 2)
got, want = jnova.compile(plain)(w, x), jax.jit(plain)(w, x)
report["plain"] = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) / float(np.abs(np.asarray(b)).max())
                      for a, b in zip(got, want))
report["elementwise keeps the sharding"] = got[1].sharding.spec == want[1].sharding.spec
print(json.dumps(report))
"""


def test_placements_and_explicit_meshes_like_jax_jit():
    """What jax.jit keys on and checks besides shapes: a step called on another device compiles for it
    (jnova's key had no device: the second call raised); arrays sharded over `jax.make_mesh`'s Explicit
    axes carry their sharding in their type, which shard_map checks while tracing (jnova traced them
    unsharded: shard_map refused its in_specs) and which a kernel's result keeps."""
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", PLACEMENTS], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report.pop("axis_types") == "(Explicit,)", "jax.make_mesh's default axes changed: the test needs Explicit"
    assert report.pop("compiles") == 2 and report.pop("device 0 placed") and report.pop("device 1 placed")
    assert report.pop("elementwise keeps the sharding")
    assert all(err <= 1e-5 for err in report.values()), report
