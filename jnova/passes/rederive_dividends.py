"""rederive_dividends: let a large dividend die at its division when the quotient outlives it anyway.

A softmax divides e = exp(x - max) by its row sums, q = e / s, and its gradient reads e again in the
backward pass, long after the forward used it. Both e and q are then held from the forward to the
backward: in GPT-2 124M at 8 x 1024 tokens, two f32 tensors of 8 x 12 x 1024 x 1024 (403 MB) per
layer, 4.8 GB more than the step needs. Since q is kept too (the backward reads it), each late read
of e can take q * s instead: one multiply in the kernel that reads it, the same bytes
read, and e is gone after the division (its kernel no longer writes it out).

Taken only for a softmax's division, and only where that cannot cost traffic or memory:
- the dividend is an `exp` (so never negative) and the divisor a broadcast of its own sum over
  some dims (through reshapes and broadcasts), so the divisor is positive wherever a dividend of
  its row is, and q * s gives e back. A general divisor can be zero: q * s would be NaN where e
  was finite. The sum is at most 1/16 of the dividend's size (a row sum), so reading it again is
  cheap;
- the dividend is at least `MIN_BYTES`, computed by the step and not one of its results (an
  argument or a result is held for the whole step anyway);
- every read of the dividend after the division is an elementwise op (the multiply fuses into its
  kernel; a contraction operand would need it written out);
- the quotient is written out anyway: a contraction reads it (nothing is fused into a contraction;
  in attention P @ V and dV = P^T dO) or the step returns it.

Then no point of the step holds more than before: where the quotient is now held longer, it takes
the dividend's place, of the same size. Where both were held (from the division to the quotient's
last read; in GPT-2, from the forward to the backward), only the quotient is.

Where the quotient itself is not kept, but only a narrower copy of it (a softmax computed in f32 from
bf16 attention scores and rounded to bf16 for P @ V: every read of q is a convert to a narrower float,
and a contraction reads that copy), the late reads take widen(bf16(q)) * s instead. The model already
rounds the probabilities to bf16 there, and the f32 dividend, twice the copy's bytes, is no longer
held from the forward to the backward (GPT-2 124M with Flax dtype bf16: 403 MB per layer). The
rederived e then carries bf16's rounding (a relative 2**-9) into the softmax's gradient, as the
bf16 model's other gradients do.

Each late read gets its own broadcast and multiply (single use, so fusion takes them into the
reader's kernel). q * s equals e up to two roundings (a relative error of about 2**-23 in f32),
well inside what the step's contractions round.
"""
from __future__ import annotations

import logging
from collections import defaultdict

from jnova.dialect.ir import Func, Op, Value
from jnova.dialect.ops import OPS, BroadcastOp, ConvertOp, ElementwiseOp
from jnova.dialect.types import FLOAT_DTYPES, itemsize

log = logging.getLogger("jnova.passes")

MIN_BYTES = 1 << 20  # smaller dividends free too little to be worth the multiply
DIVISOR_RATIO = 16  # the broadcast divisor's source is at most 1/16 of the dividend


def rederive_dividends(func: Func) -> int:
    """Rewrite in place; returns how many divisions let their dividend die early."""
    reads: dict[Value, list[tuple[int, Op, int]]] = defaultdict(list)  # value -> (op index, op, operand)
    for i, op in enumerate(func.ops):
        for k, v in enumerate(op.operands):
            reads[v].append((i, op, k))
    returned = set(func.returns)
    before: dict[int, list[Op]] = defaultdict(list)  # op index -> new ops to insert ahead of it
    count, freed = 0, 0
    for i, op in enumerate(func.ops):
        found = _late_reads(op, i, reads, returned)
        if found is None:
            continue
        late, kept = found
        dividend, divisor = op.operands
        spread = divisor.owner
        for j, reader, k in late:
            again = BroadcastOp([spread.operands[0]], [divisor.type], dict(spread.attrs), loc=spread.loc)
            quotient = [kept]
            if kept is not op.results[0]:  # the kept bf16 probabilities, widened back
                widen = ConvertOp([kept], [dividend.type], loc=op.loc)
                before[j].append(widen)
                quotient = widen.results
            product = OPS["nova.mul"]([quotient[0], again.results[0]], [dividend.type], loc=op.loc)
            reader.operands[k] = product.results[0]
            before[j] += [again, product]
        count += 1
        freed += dividend.type.nbytes
    if count:
        ops = []
        for i, op in enumerate(func.ops):
            ops += before.get(i, [])
            ops.append(op)
        func.ops = ops
        log.debug("rederive_dividends: %d dividends (%.1f MB) die at their division in func @%s",
                  count, freed / 1e6, func.name)
    return count


def _late_reads(op: Op, i: int, reads, returned: set) -> tuple[list[tuple[int, Op, int]], Value] | None:
    """The reads of `op`'s dividend after it, if they can take quotient x divisor instead (module
    docstring), and the form of the quotient they read (the quotient, or its narrowed copy); else None."""
    if op.name != "nova.div":
        return None
    dividend, divisor = op.operands
    quotient = op.results[0]
    if dividend.owner is None or dividend in returned:  # a step's argument or result is held anyway
        return None
    if dividend.type.dtype not in FLOAT_DTYPES or dividend.type.nbytes < MIN_BYTES:
        return None
    if dividend.owner.name != "nova.exp" or divisor.owner is None or divisor.owner.name != "nova.broadcast":
        return None
    if divisor.owner.operands[0].type.size * DIVISOR_RATIO > dividend.type.size:
        return None
    if not _sum_of(divisor.owner.operands[0], dividend):
        return None
    late = [(j, reader, k) for j, reader, k in reads[dividend] if j > i]
    if not late or not all(isinstance(reader, ElementwiseOp) for _, reader, _ in late):
        return None
    if quotient in returned or any(reader.name == "nova.matmul" for _, reader, _ in reads[quotient]):
        return late, quotient
    narrowed = _narrowed_for_contraction(quotient, reads, returned)
    if narrowed is None:
        return None  # the quotient may live only inside the division's kernel: e's reads would write it out
    return late, narrowed


def _narrowed_for_contraction(quotient: Value, reads, returned: set) -> Value | None:
    """The quotient's narrower float copy that is kept anyway (a contraction reads it, or the step returns
    it), when every read of the quotient is a conversion: a softmax of bf16 attention scores, computed in
    f32 and rounded to bf16 for P @ V. Else None."""
    width = itemsize(quotient.type.dtype)
    copies = [reader for _, reader, _ in reads[quotient]]
    if not copies or not all(c.name == "nova.convert" and c.results[0].type.dtype in FLOAT_DTYPES
                             and itemsize(c.results[0].type.dtype) < width for c in copies):
        return None
    for c in copies:
        r = c.results[0]
        if r in returned or any(reader.name == "nova.matmul" for _, reader, _ in reads[r]):
            return r
    return None


def _sum_of(value: Value, dividend: Value) -> bool:
    """Whether `value` is a sum of `dividend` over some dims, reshaped or broadcast."""
    while value.owner is not None and value.owner.name in ("nova.broadcast", "nova.reshape"):
        value = value.owner.operands[0]
    op = value.owner
    return op is not None and op.name == "nova.reduce" and op.attrs["kind"] == "sum" and op.operands[0] is dividend
