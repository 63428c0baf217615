"""The plan: the ordered steps of a compiled function, as kernel formation makes them and the
backends compile them (`Kernel`, `BatchedKernel`, `View`, `AllReduceBucket`, fallback ops), and its
JSON form (`plan_to_json`), which the executor runs and the persistent cache stores."""
from __future__ import annotations

from dataclasses import dataclass, field

from jnova.dialect.ir import Func, Op, Value


@dataclass
class Kernel:
    name: str
    ops: list[Op]
    inputs: list[Value]
    outputs: list[Value]
    # (input index, output index) pairs: the output is written into the input's buffer (reuse_buffers.py)
    reuses: tuple[tuple[int, int], ...] = ()


@dataclass
class BatchedKernel(Kernel):
    """Independent kernels launched as one (`batch_terminal_kernels`): `ops`, `inputs` (each once) and
    `outputs` are the segments' together, in order."""

    segments: list[Kernel] = field(default_factory=list)


@dataclass
class View(Kernel):
    """A group that is one reshape: no data moves, so it is no kernel. The step function reshapes the
    array (XLA makes it a bitcast of the same buffer); `Plan.kernels` leaves views out."""


@dataclass
class AllReduceBucket:
    """One all-reduce of the flat concatenation of `operands` (the fallback equation `site` gives the
    primitive and its axes); `results[i]` is operand i's sum, in its shape (bucket_all_reduces.py)."""

    site: int
    operands: list[Value]
    results: list[Value]


@dataclass
class Plan:
    """The ordered steps of a compiled function: `Kernel`s and fallback `Op`s."""

    func: Func
    steps: list["Kernel | Op"] = field(default_factory=list)

    @property
    def kernels(self) -> list[Kernel]:
        return [s for s in self.steps if isinstance(s, Kernel) and not isinstance(s, View)]

    def kernels_json(self) -> list[dict]:
        """The kernel steps of `plan_to_json(self)`."""
        return [s for s in plan_to_json(self)["steps"] if "kernel" in s]


def plan_to_json(plan: Plan) -> dict:
    """The plan with values as integer ids (arguments first, then op results in program order).

    This is what the executor runs and what the persistent cache stores: it needs no nova IR.
    """
    ids: dict[Value, int] = {v: i for i, v in enumerate(plan.func.args)}
    order = {op: i for i, op in enumerate(plan.func.ops)}
    for op in plan.func.ops:
        for r in op.results:
            ids[r] = len(ids)
    steps = []
    for step in plan.steps:
        if isinstance(step, View):
            steps.append({"view": step.name, "in": [ids[step.inputs[0]]], "out": [ids[step.outputs[0]]],
                          "out_types": [[list(step.outputs[0].type.shape), step.outputs[0].type.dtype]]})
        elif isinstance(step, Kernel):
            steps.append({"kernel": step.name, "in": [ids[v] for v in step.inputs], "out": [ids[v] for v in step.outputs],
                          "out_types": [[list(v.type.shape), v.type.dtype] for v in step.outputs],
                          "deps": output_inputs(step, order), "made_by": [made_by(v) for v in step.outputs]})
            if step.reuses:
                steps[-1]["reuses"] = [list(pair) for pair in step.reuses]
        elif isinstance(step, AllReduceBucket):
            steps.append({"bucket": step.site, "in": [ids[v] for v in step.operands],
                          "out": [ids[v] for v in step.results]})
        else:
            steps.append({"fallback": step.attrs["primitive"], "site": step.attrs["site"],
                          "in": [ids[v] for v in step.operands], "out": [ids[v] for v in step.results]})
    return {"num_args": len(plan.func.args), "steps": steps, "returns": [ids[v] for v in plan.func.returns]}


def made_by(value: Value) -> str:
    """The nova op that computes `value` and its source line, as the memory report names it."""
    op = value.owner
    if op is None:
        return "argument"
    return f"{op.name} at {op.loc}" if op.loc else op.name


def output_inputs(kernel: Kernel, order: dict) -> list[list[int]]:
    """For each output of `kernel`, the positions of the inputs it is computed from (`order`: each op's
    position in the function). The kernel's results take their types from these inputs: inside
    shard_map, the mesh axes a result varies over are its inputs' (nova_kernel.py)."""
    deps: dict[Value, frozenset] = {v: frozenset([i]) for i, v in enumerate(kernel.inputs)}
    for op in sorted(kernel.ops, key=order.__getitem__):
        found = frozenset().union(*(deps.get(v, frozenset()) for v in op.operands))
        for r in op.results:
            deps.setdefault(r, found)
    return [sorted(deps.get(v, ())) for v in kernel.outputs]
