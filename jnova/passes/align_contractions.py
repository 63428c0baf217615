"""align_contractions: pad a contraction operand whose rows are not whole 16-byte chunks.

The GPU contraction kernels copy operand tiles into shared memory 16 bytes at a time when every row of
an operand starts 16-byte aligned; otherwise they fall back to 4-byte copies (f32) or to copies through
registers (bf16 and f16 rows of odd length). GPT-2's vocabulary (50257) made its LM-head gradient
contraction 10x slower in bf16 (66.5 ms of a 126 ms step on an H200) and about 2x in f32. This pass
pads the operand's contiguous dim, when it is the operand's last dim, a contraction kernel takes the
matmul and it does at least `MIN_FLOPS` of work, to a multiple of 16 bytes with zeros:
  - the contracting dim K: both operands are padded along K (zero terms: the product is unchanged);
  - a free dim (M of A given as [K, M], N of B given as [K, N]): the operand is padded and the
    result sliced back (the extra rows or columns of C are never read).
A value padded the same way for several contractions is padded once. The pads are kernels of their
own (a matmul does not read through a remap); the operand's producer can fuse into its pad, so the
padded array is written where the unpadded one was.
"""
from __future__ import annotations

import logging

import numpy as np

from jnova.dialect.ir import Func, Op, Value
from jnova.dialect.ops import ConstantOp, PadOp, SliceOp
from jnova.dialect.types import TensorType, numpy_dtype
from jnova.passes.configure.problem import contraction_problem

log = logging.getLogger("jnova.passes")

ALIGN_BYTES = 16
ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# below this a contraction is cheap whatever its copies; a pad would only add a kernel
MIN_FLOPS = 2**30


def align_contractions(func: Func, min_flops: int | None = None) -> int:
    """Rewrite in place; returns how many contractions had an operand padded."""
    min_flops = MIN_FLOPS if min_flops is None else min_flops
    ops, count, padded = [], 0, {}
    for op in func.ops:
        problem = contraction_problem(op)[0] if op.name == "nova.matmul" else None
        if problem is not None and problem.flops >= min_flops:
            new, after = _align(op, padded)
            ops += new
            ops.append(op)
            ops += after
            count += bool(new)
            continue
        ops.append(op)
    func.ops = ops
    log.debug("align_contractions: %d contractions take padded operands", count)
    return count


def _align(op: Op, padded: dict) -> tuple[list[Op], list[Op]]:
    """(ops to insert before `op`, ops to insert after it): the pads of its operands and the slice
    of its result."""
    a = op.attrs
    lhs, rhs = op.operands
    item = ITEM_BYTES.get(lhs.type.dtype)
    if item is None:
        return [], []
    per_chunk = ALIGN_BYTES // item
    lhs_free, rhs_free = op.free_dims()
    last_l, last_r = lhs.type.rank - 1, rhs.type.rank - 1
    pads = {0: {}, 1: {}}  # operand -> {dim: new size}
    slice_dim = None

    def rounded(size: int) -> int:
        return -(-size // per_chunk) * per_chunk

    # K: one contracting dim, contiguous in A (A as [M, K]) or in B (B as [N, K])
    if len(a["lhs_contract"]) == 1:
        (li,), (ri,) = a["lhs_contract"], a["rhs_contract"]
        if li == last_l or ri == last_r:
            if lhs.type.shape[li] % per_chunk:
                pads[0][li] = pads[1][ri] = rounded(lhs.type.shape[li])
    nb = len(a["lhs_batch"])
    if lhs_free == [last_l] and lhs.type.shape[last_l] % per_chunk:  # A as [K, M]: M contiguous
        pads[0][last_l] = padded_size = rounded(lhs.type.shape[last_l])
        slice_dim = nb
    elif rhs_free == [last_r] and rhs.type.shape[last_r] % per_chunk:  # B as [K, N]: N contiguous
        pads[1][last_r] = padded_size = rounded(rhs.type.shape[last_r])
        slice_dim = nb + len(lhs_free)
    if not pads[0] and not pads[1]:
        return [], []
    before = []
    for i in (0, 1):
        if pads[i]:
            v = op.operands[i]
            key = (v, tuple(sorted(pads[i].items())))
            if key not in padded:
                zero = ConstantOp([], [TensorType((), v.type.dtype)],
                                  {"value": np.zeros((), numpy_dtype(v.type.dtype))}, loc=op.loc)
                high = [pads[i].get(d, s) - s for d, s in enumerate(v.type.shape)]
                shape = tuple(s + h for s, h in zip(v.type.shape, high))
                pad = PadOp([v, zero.results[0]], [TensorType(shape, v.type.dtype)],
                            {"low": (0,) * v.type.rank, "high": tuple(high), "interior": (0,) * v.type.rank}, loc=op.loc)
                before += [zero, pad]
                padded[key] = pad.results[0]
            op.operands[i] = padded[key]
    if slice_dim is None:
        return before, []
    old = op.results[0]
    shape = list(old.type.shape)
    shape[slice_dim] = padded_size
    op.results[0] = Value(TensorType(tuple(shape), old.type.dtype), op, 0)
    cut = SliceOp([op.results[0]], [old.type], {"start": (0,) * len(shape), "limit": tuple(old.type.shape),
                                                "strides": (1,) * len(shape)}, loc=op.loc)
    old.owner, old.index = cut, 0  # the consumers keep reading the value they read
    cut.results[0] = old
    return before, [cut]
