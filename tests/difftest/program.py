"""A random training program as data: its inputs, its statements (Python source, one line each) and the
values its loss reads. `Program.source()` is the program as a runnable Python function, the same text
that `Program.step()` executes, so a failing example prints exactly what ran and pastes into a
regression test.

The loss is `sum(vdot(out, seed))` over the program's outputs, with a random cotangent seed per output
(data, not a parameter): the backward pass starts from random cotangents, not from ones. The step is
`jax.value_and_grad(loss, has_aux=True)` over the float parameters; its aux result is the outputs
themselves, so a mismatch can be told apart between forward and backward.
"""
from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from jax import lax

FLOATS = ("float32", "bfloat16")
JNP_DTYPE = {"float64": "jnp.float64", "float32": "jnp.float32", "bfloat16": "jnp.bfloat16", "int32": "jnp.int32",
             "bool": "jnp.bool_"}
NUMPY_DTYPE = {"float64": np.float64, "float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "int32": np.int32,
               "bool": np.bool_}


@dataclass(frozen=True)
class Input:
    """A parameter (`role="param"`: differentiated) or data (`"data"`: labels, masks, cotangent seeds).

    Integer data are labels in [0, high); bool data are masks; floats are standard normal (times `scale`).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    high: int = 0
    scale: float = 1.0

    def sample(self, rng: np.random.Generator) -> np.ndarray:
        if self.dtype == "int32":
            return rng.integers(0, max(self.high, 1), self.shape).astype(np.int32)
        if self.dtype == "bool":
            return rng.random(self.shape) < 0.7
        x = self.scale * rng.standard_normal(self.shape)
        return np.asarray(x.astype(np.float32)).astype(NUMPY_DTYPE[self.dtype])


def widen(tree):
    """The float arrays of a pytree as f64 (exactly: every f32 and bf16 value is an f64 value)."""
    return jax.tree.map(lambda a: np.asarray(a, np.float64) if np.asarray(a).dtype.kind == "f" or
                        np.asarray(a).dtype == ml_dtypes.bfloat16 else np.asarray(a), tree)


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d.strip())


def _wide_expr(expr: str) -> str:
    expr = expr.replace(".astype(jnp.bfloat16)", ".astype(jnp.bfloat16).astype(jnp.float64)")
    return expr.replace("jnp.float32", "jnp.float64")


@dataclass(frozen=True)
class Stmt:
    """`name = expr`, with the shape and dtype the generator computed for it (checked by `check_shapes`)."""

    name: str
    expr: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class Program:
    inputs: list[Input]
    stmts: list[Stmt]
    outputs: list[str]
    # facts the comparison's tolerance depends on
    longest_sum: int = 1          # the most terms any sum (reduction, contraction) adds
    has_bf16: bool = False
    has_contraction: bool = False
    loss_dtype: str = "float32"   # "float64" in the widened reference
    kinds: tuple[str, ...] = ()   # the generator's operations, in order (for coverage statistics)

    @property
    def params(self) -> list[Input]:
        return [i for i in self.inputs if i.role == "param"]

    @property
    def data(self) -> list[Input]:
        return [i for i in self.inputs if i.role == "data"]

    def seeds(self) -> list[str]:
        return [f"s_{name}" for name in self.outputs]

    def source(self) -> str:
        """The program as Python: `loss(params, data) -> (loss, outputs)` and `step`. The comments hold
        what `Program.parse` needs to rebuild the program from this text (shapes, dtypes, label ranges,
        the tolerance facts)."""
        facts = f"longest_sum={self.longest_sum} has_bf16={self.has_bf16} has_contraction={self.has_contraction}"
        lines = [f"# difftest program: {facts}", "def loss(params, data):"]
        lines += [f"    {i.name} = params[{i.name!r}]  # {i.dtype}{list(i.shape)}" for i in self.params]
        lines += [f"    {i.name} = data[{i.name!r}]  # {i.dtype}{list(i.shape)}" + (f" in [0, {i.high})" if i.high else "")
                  for i in self.data]
        lines += [f"    {s.name} = {s.expr}  # {s.dtype}{list(s.shape)}" for s in self.stmts]
        lines.append(f"    outs = [{', '.join(self.outputs)}]")
        lines.append(f"    seeds = [{', '.join(self.seeds())}]")
        lines.append(f"    total = sum(jnp.vdot(o.astype(jnp.{self.loss_dtype}), s) for o, s in zip(outs, seeds))")
        lines.append("    return total, outs")
        lines.append("")
        lines.append("step = jax.value_and_grad(loss, has_aux=True)")
        return "\n".join(lines) + "\n"

    @staticmethod
    def parse(source: str) -> "Program":
        """The program whose `source()` is `source` (as printed by a failing example)."""
        inputs, stmts, outputs = [], [], []
        facts = {"longest_sum": "1", "has_bf16": "False", "has_contraction": "False"}
        for line in source.splitlines():
            if m := re.match(r"# difftest program: (.*)", line.strip()):
                facts.update(kv.split("=") for kv in m.group(1).split())
            elif m := re.match(r"\s+(\w+) = (params|data)\['\w+'\]  # (\w+)\[([\d, ]*)\](?: in \[0, (\d+)\))?$", line):
                name, role, dtype, shape, high = m.groups()
                inputs.append(Input(name, _shape(shape), dtype, "param" if role == "params" else "data", int(high or 0)))
            elif m := re.match(r"\s+outs = \[(.*)\]$", line):
                outputs = [o.strip() for o in m.group(1).split(",")]
            elif m := re.match(r"\s+(v\d+) = (.*)  # (\w+)\[([\d, ]*)\]$", line):
                stmts.append(Stmt(m.group(1), m.group(2), _shape(m.group(4)), m.group(3)))
        return Program(inputs, stmts, outputs, int(facts["longest_sum"]), facts["has_bf16"] == "True",
                       facts["has_contraction"] == "True")

    def step(self):
        """`step(params, data) -> ((loss, outputs), grads)`, executed from `source()`."""
        namespace = {"jax": jax, "jnp": jnp, "lax": lax, "optax": optax, "np": np}
        exec(compile(self.source(), "<difftest program>", "exec"), namespace)
        return namespace["step"]

    def arguments(self, seed: int) -> tuple[dict, dict]:
        """(params, data) drawn from `seed`: the same arrays for every backend."""
        rng = np.random.default_rng(seed)
        params = {i.name: i.sample(rng) for i in self.params}
        data = {i.name: i.sample(rng) for i in self.data}
        return params, data

    def widened(self) -> "Program":
        """The same program computed in f64 (run it under `jax.enable_x64(True)` on `widen(args)`): the
        reference that measures how far f32 and bf16 rounding move each result. An explicit cast to bf16
        stays a rounding (to bf16 and back to f64): it is what the program says, not noise."""
        f64 = lambda dtype: "float64" if dtype in FLOATS else dtype  # noqa: E731
        inputs = [Input(i.name, i.shape, f64(i.dtype), i.role, i.high, i.scale) for i in self.inputs]
        stmts = [Stmt(s.name, _wide_expr(s.expr), s.shape, f64(s.dtype)) for s in self.stmts]
        return Program(inputs, stmts, list(self.outputs), self.longest_sum, self.has_bf16, self.has_contraction,
                       loss_dtype="float64")

    def check_shapes(self) -> None:
        """The generator's shape bookkeeping agrees with JAX's (a disagreement is a generator bug)."""
        params, data = self.arguments(0)
        out = jax.eval_shape(self.step(), params, data)
        (_, outs), _ = out
        want = {s.name: s for s in self.stmts} | {i.name: i for i in self.inputs}
        for name, got in zip(self.outputs, outs):
            spec = want[name]
            assert (tuple(got.shape), str(got.dtype)) == (tuple(spec.shape), spec.dtype), (
                f"generator bug: {name} is {got.dtype}{got.shape}, recorded {spec.dtype}{spec.shape}\n{self.source()}")

    def repro(self, seed: int, **compile_options) -> str:
        """A standalone script (run from tests/) that reruns this example: jnova against jax.jit."""
        options = "".join(f", {k}={v!r}" for k, v in compile_options.items())
        return textwrap.dedent(f"""\
            from difftest import compare
            from difftest.program import Program

            SOURCE = \'\'\'
            {{source}}\'\'\'
            outcome = compare.run(Program.parse(SOURCE), {seed}{options})
            print("\\n".join(outcome.mismatches) or "jnova matches jax.jit")
            """).replace("{source}", self.source())
