"""Where the fused attention kernels read their operands: `RowView`s into their parameters' buffers.

Every kernel copies rows of D contiguous elements of q, k, v (o, do) into shared memory (or loads
them, for the dQ kernel's delta), so all it needs of an operand is where row t of head h of batch b
starts: `offset + b * batch + h * head + t * row`. An operand in its own buffer has the strides of
its layout (`natural_view`); a slice of a larger buffer (q, k and v of a fused projection, which
`passes/view_attention_operands.py` leaves to the kernels) has that buffer's strides and an offset.
`kernel_operands` finds, for a plan kernel, which input each operand is read from and where.
"""
from __future__ import annotations

from dataclasses import dataclass

from jnova.codegen.gpu.emitter import GpuEmitter
from jnova.codegen.gpu.matmul_smem import ix_add
from jnova.dialect.ops_attention import head_axes
from jnova.passes.configure.attention_tiles import AttentionProblem
from jnova.passes.strided_views import VIEWED_OPERANDS, row_view_refusal, strided_view


def strides(problem: AttentionProblem, heads: int, length: int) -> tuple[int, int, int]:
    """Elements between consecutive (batch, head, row) entries of a [.., heads, length, D] operand."""
    d = problem.head_dim
    if problem.layout == "bthd":
        return length * heads * d, d, heads * d
    return heads * length * d, length * d, d


@dataclass(frozen=True)
class RowView:
    """Where an operand's rows lie in its parameter's buffer: element d of row t of head h of batch b
    at `offset + b * batch + h * head + t * row + d` (a slice of a larger buffer, or the operand's own
    layout: `natural_view`). Rows are D contiguous elements, offset and strides whole 16-byte chunks."""

    offset: int
    batch: int
    head: int
    row: int

    def base(self, em: GpuEmitter, batch: str, head: str) -> str:
        """The element offset of row 0 of (batch, head)."""
        return ix_add(em, self.offset, (batch, self.batch), (head, self.head))


def natural_view(problem: AttentionProblem, heads: int, length: int) -> RowView:
    """The view of an operand in its own buffer, laid out as the problem's layout says."""
    return RowView(0, *strides(problem, heads, length))


def operand_sizes(problem: AttentionProblem) -> dict[str, int]:
    """Elements of each operand and result in its own layout (q, o, do, dq: q's; k, v, dk, dv: k's)."""
    p = problem
    q, kv, rows = p.batch * p.q_heads * p.q_len * p.head_dim, p.batch * p.kv_heads * p.kv_len * p.head_dim, \
        p.batch * p.q_heads * p.q_len
    return {"q": q, "o": q, "do": q, "dq": q, "k": kv, "v": kv, "dk": kv, "dv": kv, "lse": rows, "delta": rows}


def natural_views(problem: AttentionProblem) -> dict[str, RowView]:
    q = natural_view(problem, problem.q_heads, problem.q_len)
    kv = natural_view(problem, problem.kv_heads, problem.kv_len)
    return {"q": q, "o": q, "do": q, "dq": q, "k": kv, "v": kv, "dk": kv, "dv": kv}


def kernel_operands(kernel, op, roles: tuple[str, ...], after=frozenset()) -> tuple[dict | None, str | None]:
    """Where a plan kernel of one attention op reads its operands (`roles`: the op's first operands'
    names): (role -> (input index, RowView, or None for a value read whole), None), or (None, why not).

    An operand the kernels read through a view (`strided_views.VIEWED_OPERANDS`) may be computed in the
    kernel by reshapes, slices and transposes of an input (`passes/view_attention_operands.py`); the
    kernel then reads that input's buffer where the view says. The kernel computes nothing else but
    the ops `after` it (`written_concatenation`)."""
    views_ops = set(kernel.ops) - {op} - after
    t_axis, h_axis = head_axes(op.attrs["layout"])
    where, used = {}, set()
    for i, role in enumerate(roles):
        value, row_view = op.operands[i], None
        if i in VIEWED_OPERANDS[op.name]:
            view = strided_view(value, lambda x: x in views_ops)
            reason = "it is not a view of a buffer" if view is None else row_view_refusal(view)
            if reason:
                return None, f"operand '{role}' cannot be read in place: {reason}"
            used.update(view.ops)
            value, st = view.base, view.strides
            row_view = RowView(view.offset, st[0], st[h_axis], st[t_axis])
        if value not in kernel.inputs:
            return None, f"operand '{role}' is not read from a kernel input"
        where[role] = (kernel.inputs.index(value), row_view)
    if used != views_ops:
        return None, "the kernel computes more than the attention op and its operands' views"
    used = {index for index, _ in where.values()}  # and the parts a dK/dV kernel copies into its concatenation
    used |= {i for i, x in enumerate(kernel.inputs) if any(x in a.operands for a in after)}
    if len(used) != len(kernel.inputs):
        return None, "the kernel has inputs the attention op does not read"
    return where, None


@dataclass(frozen=True)
class Concatenation:
    """What a dK/dV kernel that writes the concatenation of its gradients stores
    (`passes/attention_writes_concatenation.py`): dk and dv at their row views in the output's buffer
    (`size` elements), and the other parts copied from their inputs, each `(input index, shape, offset,
    strides)` (element (i, ..., d) of the part at `offset + sum(i_k strides_k)`, rows contiguous)."""

    size: int
    views: dict
    copies: tuple
    ops: frozenset


def written_concatenation(kernel, op) -> tuple[Concatenation | None, str | None]:
    """(the concatenation a plan kernel of `op` writes, None), (None, None) where it writes the op's own
    results, or (None, why not)."""
    from jnova.passes.attention_writes_concatenation import PART_OPS
    from jnova.passes.strided_views import concatenation_views

    if set(kernel.outputs) <= set(op.results):
        return None, None
    inside = set(kernel.ops) - {op}
    tail, stack = set(), list(kernel.outputs)
    while stack:  # the ops the outputs are computed from, back to the op's results and the inputs
        owner = stack.pop().owner
        if owner in inside and owner not in tail:
            tail.add(owner)
            stack.extend(owner.operands)
    concats = [x for x in tail if x.name == "nova.concatenate"]
    if len(kernel.outputs) != 1 or len(concats) != 1:
        return None, "the kernel writes more than one concatenation of the op's results"
    concat, final = concats[0], kernel.outputs[0]
    while final is not concat.results[0]:
        if final.owner not in tail or final.owner.name != "nova.reshape":
            return None, "the kernel's output is not a reshape of the concatenation"
        final = final.owner.operands[0]
    views = concatenation_views(concat, lambda x: x in tail and x.name in PART_OPS)
    if views is None or any(row_view_refusal(v) for v in views):
        return None, "a part of the concatenation is not rows of contiguous, 16-byte aligned elements in it"
    if tail != {x for x in tail if x.name == "nova.reshape"} | {concat} | {x for v in views for x in v.ops}:
        return None, "the kernel computes more than the op, its operands' views and their concatenation"
    t_axis, h_axis = head_axes(op.attrs["layout"])
    written, copies = {}, []
    for v in views:
        if v.value.owner is op:
            role = ("dk", "dv")[op.results.index(v.value)]
            if role in written:
                return None, f"{role} is concatenated twice"
            written[role] = RowView(v.offset, v.strides[0], v.strides[h_axis], v.strides[t_axis])
        elif v.value in kernel.inputs:
            copies.append((kernel.inputs.index(v.value), v.value.type.shape, v.offset, v.strides))
        else:
            return None, "a part of the concatenation is neither dk, dv nor a kernel input"
    if set(written) != {"dk", "dv"}:
        return None, "the concatenation holds only one of dk and dv"
    return Concatenation(concat.results[0].type.size, written, tuple(copies), frozenset(tail)), None
