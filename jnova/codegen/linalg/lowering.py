"""nova -> linalg on tensors: the registry of lowering rules and the kernel function around them.

A kernel (a list of nova ops) becomes one `func.func` in destination-passing style: its inputs and
outputs are memrefs, wrapped as tensors with `bufferization.to_tensor` and written back with
`bufferization.materialize_in_destination`, so one-shot bufferization needs no function-boundary
analysis and the caller owns every buffer.
"""
from __future__ import annotations

from typing import Callable

from jnova.codegen.linalg.emitter import KernelEmitter, memref, tensor
from jnova.dialect.ir import Op, Value
from jnova.errors import LoweringError

LoweringRule = Callable[..., "str | list[str]"]
LOWERINGS: dict[str, LoweringRule] = {}


def lowering(*op_names: str):
    """Register `fn(em: KernelEmitter, op: Op, *operand_ssa_names) -> result name(s)`."""

    def wrap(fn):
        for n in op_names:
            LOWERINGS[n] = fn
        return fn

    return wrap


def kernel_to_linalg(name: str, ops: list[Op], inputs: list[Value], outputs: list[Value]) -> str:
    """MLIR text of one kernel: `func.func @name(inputs..., outputs...)` over memrefs."""
    em = KernelEmitter()
    env: dict[Value, str] = {}
    params = []
    for i, v in enumerate(inputs):
        arg = f"%in{i}"
        params.append(f"{arg}: {memref(v.type)}")
        env[v] = em.op(f"bufferization.to_tensor {arg} restrict : {memref(v.type)} to {tensor(v.type)}")
    for op in ops:
        rule = LOWERINGS.get(op.name)
        if rule is None:
            raise LoweringError(f"no linalg lowering for '{op.name}'")
        out = rule(em, op, *[env[v] for v in op.operands])
        out = [out] if isinstance(out, str) else out
        for r, text in zip(op.results, out):
            env[r] = text
    for i, v in enumerate(outputs):
        arg = f"%out{i}"
        params.append(f"{arg}: {memref(v.type)}")
        em.line(f"bufferization.materialize_in_destination {env[v]} in restrict writable {arg} : "
                f"({tensor(v.type)}, {memref(v.type)}) -> ()")
    head = f"func.func @{name}({', '.join(params)}) attributes {{llvm.emit_c_interface}} {{"
    return "\n".join([head] + em.lines + ["  return", "}"])


def lower_decomposition(em, op, operands, decomposition):
    """Lower `op` as the generic nova ops `decomposition(op)` returns ((ops, results)), each with its own
    rule, inside the kernel that holds `op` (the first-class ops' CPU lowering)."""
    ops, results = decomposition(op)
    env = dict(zip(op.operands, operands))
    for inner in ops:
        rule = LOWERINGS.get(inner.name)
        if rule is None:
            raise LoweringError(f"no linalg lowering for '{inner.name}' (in the decomposition of '{op.name}')")
        out = rule(em, inner, *[env[v] for v in inner.operands])
        env.update(zip(inner.results, [out] if isinstance(out, str) else out))
    return [env[r] for r in results]


# importing the rule modules registers their lowerings
from jnova.codegen.linalg import rules_elementwise, rules_index, rules_reduce, rules_shape  # noqa: E402,F401
from jnova.codegen.linalg import rules_attention  # noqa: E402,F401
from jnova.codegen.linalg import rules_training  # noqa: E402,F401

