"""excess-precision: a 16-bit float value rounded inside a kernel and widened again stays f32, as in XLA.

XLA's default (`--xla_allow_excess_precision=true`) computes bf16 and f16 arithmetic in f32 and then
removes each f32 -> bf16 -> f32 pair of conversions, so `jnp.sum(x @ w)` on bf16 sums the f32 products
and softmax's `exp` enters its sum unrounded. jnova does the same in two steps:

- `widen_16bit_arithmetic` (before fusion) writes what jnova computes anyway explicitly: a 16-bit
  elementwise op, reduction or contraction becomes its f32 form between conversions (widen each
  operand, round the result), the exact same values;
- `fold_rounding_pairs` (on the kernels) lets the readers of a convert(convert(x: f32 -> bf16) -> f32)
  inside one kernel read `x` instead. The rounding stays wherever its bf16 value leaves the kernel
  (another kernel reads it, or the step returns it: what the program can observe).

`jnova.compile(..., excess_precision=False)` (or XLA's flag set to false, in `xla_options` or
XLA_FLAGS) keeps every rounding: what `jax.jit` computes with the flag off.
"""
from __future__ import annotations

import logging

from jnova.dialect.ir import Func, Op, Value
from jnova.dialect.ops import ConvertOp, ElementwiseOp

log = logging.getLogger("jnova.passes")

SIXTEEN_BIT = ("bfloat16", "float16")
# elementwise ops whose 16-bit result is not "the f32 result, rounded": they stay as they are
BIT_EXACT = {"nova.reduce_precision", "nova.nextafter"}
REDUCE_KINDS = ("sum", "prod", "max", "min")


def widen_16bit_arithmetic(func: Func) -> int:
    """Rewrite in place each 16-bit float op into convert(op_f32(convert(operands))); returns how many."""
    ops, count = [], 0
    widened: dict[Value, Value] = {}  # one widening convert per value
    for op in func.ops:
        if not _widenable(op):
            ops.append(op)
            continue
        operands = []
        for v in op.operands:
            if v.type.dtype in SIXTEEN_BIT and _is_float_arithmetic_operand(op):
                if v not in widened:
                    cast = ConvertOp([v], [v.type.with_dtype("float32")], loc=op.loc)
                    ops.append(cast)
                    widened[v] = cast.results[0]
                v = widened[v]
            operands.append(v)
        old = op.results[0]
        wide = type(op)(operands, [old.type.with_dtype("float32")], dict(op.attrs), loc=op.loc)
        narrow = ConvertOp([wide.results[0]], [old.type], loc=op.loc)
        narrow.results[0] = old  # the rounded value keeps its identity: every reader is unchanged
        old.owner, old.index = narrow, 0
        ops += [wide, narrow]
        count += 1
    func.ops = ops
    log.debug("excess-precision: %d 16-bit ops computed in f32 between conversions", count)
    return count


def _widenable(op: Op) -> bool:
    if len(op.results) != 1 or op.results[0].type.dtype not in SIXTEEN_BIT:
        return False
    dtype = op.results[0].type.dtype
    if op.name == "nova.matmul":  # products accumulate in f32: only the result type changes
        return True
    if op.name == "nova.reduce":
        return op.attrs["kind"] in REDUCE_KINDS and op.operands[0].type.dtype == dtype
    return (isinstance(op, ElementwiseOp) and op.name not in BIT_EXACT and op.operands
            and all(v.type.dtype == dtype for v in op.operands))


def _is_float_arithmetic_operand(op: Op) -> bool:
    return op.name != "nova.matmul"  # a contraction reads its 16-bit operands as they are


def fold_rounding_pairs(func: Func, kernels, untouched=()) -> int:
    """In each kernel (with `ops` and `outputs`), a widening convert of a rounded value, read directly or
    through copies of it (broadcast, reshape, transpose, slice, reverse), is replaced by the f32 value
    through f32 copies, so every reader in the kernel sees the same unrounded value (softmax's
    `x - max(x)` stays 0 where x is the max). Conversions and copies nothing reads any more leave the
    kernel. `untouched`: other kernels (batches) that share copies of recomputed ops with these and
    keep their rounding. Returns how many widenings were folded."""
    folded, dropped = 0, set()
    position = {id(op): i for i, op in enumerate(func.ops)}
    inserted: dict[int, list[Op]] = {}  # func.ops index -> f32 copies to insert before it
    kernels = list(kernels)
    in_kernels: dict[Op, int] = {}  # how many kernels hold each op (a recomputed op's copies are shared)
    for kernel in kernels + list(untouched):
        for op in kernel.ops:
            in_kernels[op] = in_kernels.get(op, 0) + 1
    for kernel in kernels:
        members = set(kernel.ops)
        replace: dict[Value, Value] = {}
        ops = []
        for op in kernel.ops:
            found = _rounded_source(op, members)
            if found is not None:
                x, copies = found
                clones = _f32_copies(x, copies)
                ops += clones
                inserted.setdefault(position.get(id(op), len(func.ops)), []).extend(clones)
                replace[op.results[0]] = clones[-1].results[0] if clones else x
            ops.append(op)
        if not replace:
            continue
        folded += len(replace)
        outputs = set(kernel.outputs)
        def resolved(v: Value) -> Value:  # a folded widening's source may itself be cloned below
            while v in replace:
                v = replace[v]
            return v

        for i, op in enumerate(ops):
            operands = [resolved(v) for v in op.operands]
            if operands == op.operands:
                continue
            if in_kernels.get(op, 0) > 1 and not any(r in outputs for r in op.results):
                # a copy other kernels share (a recomputed value): this kernel's own, reading the f32 value
                clone = type(op)(operands, [r.type for r in op.results], dict(op.attrs), loc=op.loc)
                replace.update(zip(op.results, clone.results))
                inserted.setdefault(position[id(op)], []).append(clone)
                ops[i] = clone
            else:
                op.operands = operands
        kept = _drop_unread(ops, set(kernel.outputs))
        dropped |= {op for op in set(ops) - set(kept) if op.name == "nova.convert"}
        kernel.ops = kept
    if folded:
        dropped -= {op for kernel in kernels + list(untouched) for op in kernel.ops}  # copied into other kernels too
        read = {v for op in func.ops if op not in dropped for v in op.operands} | set(func.returns)
        dropped = {op for op in dropped if not any(r in read for r in op.results)}  # or read by any other op
        new_ops = []
        for i, op in enumerate(func.ops):
            new_ops += inserted.get(i, [])
            if op not in dropped:
                new_ops.append(op)
        func.ops = new_ops + inserted.get(len(func.ops), [])
    log.debug("excess-precision: %d rounded values read unrounded inside kernels", folded)
    return folded


# ops whose every element is one element of their single operand: a value's copies
COPIES = ("nova.broadcast", "nova.reshape", "nova.transpose", "nova.slice", "nova.reverse")


def _rounded_source(op: Op, members: set):
    """(x, copies) when `op` widens copies (outermost last) of convert(x -> 16-bit) back to x's type,
    all in the kernel; else None."""
    if op.name != "nova.convert" or op.operands[0].type.dtype not in SIXTEEN_BIT:
        return None
    copies, v = [], op.operands[0]
    while v.owner in members and getattr(v.owner, "name", None) in COPIES:
        copies.append(v.owner)
        v = v.owner.operands[0]
    narrow = v.owner
    if narrow not in members or getattr(narrow, "name", None) != "nova.convert":
        return None
    x = narrow.operands[0]
    if x.type.dtype != op.results[0].type.dtype or x.type.dtype not in ("float32", "float64"):
        return None
    return x, copies[::-1]


def _f32_copies(x: Value, copies: list[Op]) -> list[Op]:
    """The copy ops applied to `x` in its own type, innermost first."""
    clones, v = [], x
    for op in copies:
        clone = type(op)([v], [op.results[0].type.with_dtype(x.type.dtype)], dict(op.attrs), loc=op.loc)
        clones.append(clone)
        v = clone.results[0]
    return clones


def _drop_unread(ops: list[Op], outputs: set) -> list[Op]:
    """`ops` without the conversions and copies whose results nothing in the kernel reads and the kernel
    does not write (to a fixpoint: a chain goes together)."""
    droppable = ("nova.convert",) + COPIES
    while True:
        read = {v for op in ops for v in op.operands}
        kept = [op for op in ops if op.name not in droppable or op.results[0] in read or op.results[0] in outputs]
        if len(kept) == len(ops):
            return kept
        ops = kept
