"""bucket-all-reduces: a data-parallel step's all-reduces in buckets, each right after its last input.

Inside `shard_map` or `pmap` a step's gradients are summed over the devices by `psum` (pmap, or an
explicit `pmean`) or `psum_invariant` (shard_map's own, after each replicated parameter's gradient).
JAX puts them where the program says: an explicit `pmean(grads)` after the whole backward pass.
jnova plans them at compile time, as DDP does at run time:

- every all-reduce operand is a piece; pieces go, in the order their inputs are produced, into
  buckets of at most `bucket_bytes` (one piece larger than that is a bucket of its own);
- a bucket's pieces are one flat buffer, all-reduced once (`AllReduceBucket`), so that XLA's combiner
  does not merge the buckets back into one all-reduce at the end;
- a bucket runs right after the step that produces its last piece, so that its all-reduce can overlap
  the rest of the backward pass; a bucket is closed early where waiting for the next piece would put
  it after a step that reads one of its results.

Pieces share a bucket only with pieces of the same primitive, parameters (axes) and dtype. Moving an
all-reduce earlier keeps the program's meaning: every device runs the same plan, so the collectives
stay in the same order everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass

from jnova.dialect.ir import Value
from jnova.dialect.ops import FallbackOp
from jnova.passes.plan import AllReduceBucket, Kernel, Plan
from jnova.runtime.jax_internals import source_line

ALL_REDUCES = ("psum", "psum_invariant")


@dataclass
class _Piece:
    site: int
    operand: Value
    result: Value
    ready: int      # index of the plan step producing the operand (-1: an argument)
    deadline: int   # index of the first plan step reading the result (len(steps): only returned)
    order: int      # index of the original all-reduce step


def bucket_all_reduces(plan: Plan, sites: list, bucket_bytes: int) -> Plan:
    """The plan with its all-reduce fallbacks replaced by buckets (see the module's docstring); the
    plan itself when it has none."""
    steps = plan.steps
    if not any(_is_all_reduce(s) for s in steps):
        return plan
    producer, first_reader = {}, {}
    for i, step in enumerate(steps):
        for v in _inputs(step):
            first_reader.setdefault(v, i)
        for v in _outputs(step):
            producer[v] = i
    pieces = [_Piece(s.attrs["site"], operand, result, producer.get(operand, -1),
                     first_reader.get(result, len(steps)), i)
              for i, s in enumerate(steps) if _is_all_reduce(s)
              for operand, result in zip(s.operands, s.results)]
    buckets: list[tuple[int, AllReduceBucket]] = []  # (placement, bucket)
    open_: dict[tuple, _Open] = {}  # one open bucket per primitive, parameters and dtype
    for p in sorted(pieces, key=lambda p: (p.ready, p.order)):
        key = (_params_key(sites[p.site]), p.operand.type.dtype)
        b = open_.get(key)
        nbytes = p.operand.type.nbytes
        too_late = b is not None and max(b.placement, p.ready) >= min(b.deadline, p.deadline)
        if b is not None and (b.bytes + nbytes > bucket_bytes or too_late):
            buckets.append(b.close())
            b = None
        if b is None:
            b = open_[key] = _Open([], 0, -1, len(steps))
        b.members.append(p)
        b.bytes += nbytes
        b.placement, b.deadline = max(b.placement, p.ready), min(b.deadline, p.deadline)
    buckets.extend(b.close() for b in open_.values())
    out: list = [b for placement, b in buckets if placement < 0]
    for i, step in enumerate(steps):
        if not _is_all_reduce(step):
            out.append(step)
        out.extend(b for placement, b in buckets if placement == i)
    return Plan(plan.func, out)


@dataclass
class _Open:
    """A bucket being filled: its pieces, bytes, the step it must follow and the first step reading it."""

    members: list[_Piece]
    bytes: int
    placement: int
    deadline: int

    def close(self) -> tuple[int, AllReduceBucket]:
        m = self.members
        return self.placement, AllReduceBucket(m[0].site, [p.operand for p in m], [p.result for p in m])


def describe_buckets(plan: Plan, sites: list) -> str:
    """The bucket plan as a table (`as_text("buckets")`): for each bucket its bytes, dtype, the
    all-reduced values (the user's all-reduce, by source line, operand and shape) and the plan step it
    starts after, so a user can see which gradients travel together and how early."""
    buckets = [(i, s) for i, s in enumerate(plan.steps) if isinstance(s, AllReduceBucket)]
    if not buckets:
        return "no all-reduce buckets: the step has no psum of jnova's to bucket\n"
    lines = ["bucket | bytes | dtype | values | starts after"]
    for n, (i, bucket) in enumerate(buckets):
        after = next((_step_label(s) for s in reversed(plan.steps[:i]) if not isinstance(s, AllReduceBucket)),
                     "the step's start")
        values = ", ".join(f"{_type_label(v)}" for v in bucket.operands)
        where = source_line(sites[bucket.site]) or f"site {bucket.site}"
        nbytes = sum(v.type.nbytes for v in bucket.operands)
        lines.append(f"{n} | {nbytes} | {bucket.operands[0].type.dtype} | {len(bucket.operands)} of "
                     f"{sites[bucket.site].primitive.name} at {where}: {values} | {after}")
    total = sum(v.type.nbytes for _, b in buckets for v in b.operands)
    lines.append(f"{len(buckets)} buckets, {total} bytes")
    return "\n".join(lines) + "\n"


def _step_label(step) -> str:
    if isinstance(step, Kernel):
        kinds = sorted({op.name.removeprefix("nova.") for op in step.ops})
        return f"{step.name} ({', '.join(kinds[:4])}{', ...' if len(kinds) > 4 else ''})"
    if isinstance(step, FallbackOp):
        return f"the XLA op {step.attrs['primitive']}"
    return step.name


def _type_label(v: Value) -> str:
    return f"{v.type.dtype}[{','.join(map(str, v.type.shape))}]"


def _is_all_reduce(step) -> bool:
    return isinstance(step, FallbackOp) and step.attrs["primitive"] in ALL_REDUCES


def _params_key(eqn) -> tuple:
    """What must match for two all-reduces to share a bucket: the primitive and its parameters."""
    return (eqn.primitive.name, tuple(sorted((k, repr(v)) for k, v in eqn.params.items())))


def _inputs(step) -> list[Value]:
    return step.inputs if isinstance(step, Kernel) else step.operands  # a Kernel, or an op


def _outputs(step) -> list[Value]:
    return step.outputs if isinstance(step, Kernel) else step.results
