"""Whether a reduction into a few rows, or over many rows into a few columns, is split into partial
reductions (`passes/split_reductions.py`), GPU plans only.

A row reduction gives each output row to one block (`codegen/gpu/reduction.py`: a team of up to 1024
threads per row). A reduction into fewer rows than the GPU has SMs leaves the others idle: the sum of
squares of one gradient that `optax.clip_by_global_norm` takes (GPT-2's 50304 x 768 embedding
gradient, 38.6M elements, 154 MB in f32) ran as one block on one SM, at that SM's share of the
bandwidth, milliseconds instead of the 50 us the whole chip streams it in.

Model: a block streams its elements at a fixed rate, so the time is the elements of the busiest SM's
blocks. R rows each split into P partial reductions of C/P elements give R * P blocks; the partial
results (R * P values) are reduced again by a second, small row reduction. P is the divisor of C
(the reduced elements per row; a reshape of the reduced dims, which are innermost, moves no data)
nearest to `BLOCKS_PER_SM` blocks per SM over all rows, with every partial reduction at least
`MIN_PART` elements (a team's loads amortize its combine) and a multiple of `VECTOR` (16-byte loads
of f32 and of 16-bit floats alike where C allows). Rows at or above the SM count, or rows shorter than
`MIN_SPLIT_COLS` elements, are left whole: their blocks fill the chip already, or the second launch
(a few microseconds) costs more than an unsplit row.
"""
from __future__ import annotations

import math

from jnova.runtime.target import Target

BLOCKS_PER_SM = 4        # partial reductions per SM: two resident 1024-thread blocks, two waves
MIN_PART = 4096          # elements per partial reduction: a 1024-thread team's 16-byte loads, once
MIN_SPLIT_COLS = 4 * MIN_PART
VECTOR = 8               # a partial reduction's length is a multiple of this where a divisor allows


def choose_reduction_splits(rows: int, cols: int, target: Target) -> int:
    """Into how many partial reductions each of `rows` rows of `cols` elements is split; 1 = not split."""
    if rows >= target.sm_count or cols < MIN_SPLIT_COLS:
        return 1
    want = max(2, math.ceil(BLOCKS_PER_SM * target.sm_count / rows))
    candidates = [p for p in _divisors(cols) if 2 <= p <= cols // MIN_PART]
    if not candidates:
        return 1
    aligned = [p for p in candidates if (cols // p) % VECTOR == 0] or candidates
    return min(aligned, key=lambda p: (abs(math.log(p / want)), -p))


# Column reductions (`codegen/gpu/column_reduction.py`): a block owns a tile of columns and reads every
# row of it, each thread with one load in flight. The columns of a bias gradient (a [B*T, 768] bf16
# value summed over its rows) make 48 blocks of 32-byte column segments: 48 of 132 SMs, each with 4 KB
# in flight, about 0.2 TB/s, where the chip streams 4. Split, the value is viewed as [rows / P, P * cols]
# (a contiguous reshape: row r' holds rows r' * P ... r' * P + P - 1) and column-reduced into P * cols
# partial results, P times the blocks; a second column reduction sums the P partials of each column.
COLUMN_SEGMENT_BYTES = 32  # the column kernel's narrowest tile of columns per block
COLUMN_BLOCKS_PER_SM = 4   # blocks of 256 threads per SM the column kernel aims for: 16 KB in flight per SM
MIN_PART_ROWS = 64         # rows per partial column reduction: its 256 threads fold at least a few rows each
MIN_BLOCK_BYTES = 32 * 1024  # an unsplit block's share below this streams (~8 us) faster than a second launch


def column_blocks(cols: int, item_bytes: int) -> int:
    """The most blocks the column kernel gives `cols` columns of `item_bytes`-byte elements."""
    return max(1, math.ceil(cols * item_bytes / COLUMN_SEGMENT_BYTES))


def choose_column_splits(rows: int, cols: int, item_bytes: int, target: Target) -> int:
    """Into how many partial column reductions a reduction of `rows` rows into `cols` columns is split
    (a divisor of `rows`); 1 = not split. The fewest partials whose columns give the column kernel
    `COLUMN_BLOCKS_PER_SM` blocks per SM, each over at least `MIN_PART_ROWS` rows (else the most that
    keep that many rows); left whole when the columns fill the chip already or each block's share is
    too small to outlast the second launch."""
    want = COLUMN_BLOCKS_PER_SM * target.sm_count
    blocks = column_blocks(cols, item_bytes)
    if blocks >= want or rows * cols * item_bytes < MIN_BLOCK_BYTES * blocks:
        return 1
    candidates = [p for p in _divisors(rows) if p >= 2 and rows // p >= MIN_PART_ROWS]
    if not candidates:
        return 1
    enough = [p for p in candidates if column_blocks(p * cols, item_bytes) >= want]
    return min(enough) if enough else max(candidates)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
