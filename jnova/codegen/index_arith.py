"""Index arithmetic on scalars, shared by the CPU lowering's index rules (`codegen/linalg/rules_index.py`)
and the GPU's gathers, scatters and remaps (`codegen/gpu/remaps.py`, `codegen/gpu/scatter.py`): each
function emits arith ops through a scalar builder (`codegen/linalg/emitter.Scalar` or the GPU
evaluator's) and returns the SSA name of its result."""
from __future__ import annotations

import numpy as np

from jnova.dialect.types import UNSIGNED_DTYPES


def constant(s, value, dtype: str) -> str:
    """A scalar constant; unsigned values are written as their two's-complement bit pattern."""
    if dtype in UNSIGNED_DTYPES:
        value = int(np.array(int(value) % (1 << (8 * np.dtype(dtype).itemsize)), dtype).view(dtype[1:]))
    return s.const(value, dtype)


def clamp(s, v: str, hi: int, unsigned: bool) -> str:
    """`v` (i64) clamped into [0, hi], as an index."""
    top = s.const(hi, "int64")
    if unsigned:
        v = s.op(f"arith.minui {v}, {top} : i64")
    else:
        v = s.op(f"arith.maxsi {s.op(f'arith.minsi {v}, {top} : i64')}, {s.const(0, 'int64')} : i64")
    return s.op(f"arith.index_cast {v} : i64 to index")


def in_range(s, v: str, hi: int) -> str:
    """0 <= v <= hi for an i64 (one unsigned compare: negative values wrap to huge)."""
    return s.op(f"arith.cmpi ule, {v}, {s.const(hi, 'int64')} : i64")


def all_of(s, flags: list[str]) -> str:
    """The conjunction of the i1 `flags`."""
    out = flags[0]
    for f in flags[1:]:
        out = s.op(f"arith.andi {out}, {f} : i1")
    return out


def add_index(s, a: str, b: str | int) -> str:
    """a + b as an index (`b` an SSA index or a Python int; nothing is emitted for 0)."""
    if b == 0:
        return a
    b = s.index_const(b) if isinstance(b, int) else b
    return s.op(f"arith.addi {a}, {b} : index")


def window_at(s, rank: int, start: dict[int, str], offsets: dict[int, str]) -> list[str]:
    """Operand coordinates start[d] + offsets[d], either term absent meaning 0."""
    at = []
    for d in range(rank):
        if d in start and d in offsets:
            at.append(add_index(s, start[d], offsets[d]))
        else:
            at.append(start.get(d) or offsets.get(d) or s.index_const(0))
    return at
