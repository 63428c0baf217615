"""The schedule of the softmax cross-entropy row kernels (`codegen/gpu/cross_entropy.py`): how many
threads own a row, how wide their loads are, and how many loads each keeps in flight.

Both kernels stream each row of logits [N, V] once and reuse nothing: the forward reads V * e bytes
per row (e: the logits' element bytes) and writes 8 (lse and the row's loss); the backward reads
V * e and writes V * e (dlogits). They are bound by DRAM bandwidth, so the schedule has to (1) keep
enough bytes in flight on every SM to cover DRAM latency (Little's law), (2) spread the rows over all
SMs, and (3) keep the team's combine (the forward's log2(team) shuffle rounds of (max, sum) pairs and
one barrier) small against the row's loads.

The model, every number from `Target`:
- vector = 16 / e elements: one 16-byte load per group of the row (a row that does not start on a
  16-byte boundary, V not a multiple of the vector, reads its first and last elements with scalar
  loads; the kernels handle that tail, no V is refused for it).
- team: the power of two that gives each thread about `GROUPS_PER_THREAD` groups of the row (the
  combine is then amortized over as many loads), at most `max_threads_per_block`; doubled, keeping at
  least `MIN_GROUPS_PER_THREAD` groups per thread, while the grid's threads (N * team) fill less than
  one wave of the machine (`sm_count * max_threads_per_sm`): few long rows get more threads each.
- block = max(team, `MIN_BLOCK`): small teams share a block (several rows per block).
- occupancy: resident threads per SM = whole blocks within `max_threads_per_sm` and within the
  registers (`regs_per_sm / REGISTERS`, the kernels' register budget, which the ptxas tests check).
- unroll: loads a thread issues per loop trip before it uses them, the smallest power of two (at most
  `MAX_UNROLL`) with resident threads * unroll * 16 bytes >= the SM's share of DRAM bandwidth times
  `DRAM_LATENCY_S`. H200: 4.8e12 / 132 * 1 us = 36 KB per SM; 1024 resident threads (64 registers
  each) * 16 bytes = 16 KB per load: unroll 4.

For GPT-2's loss (N = 8192, V = 50304): bf16 rows of 6288 groups, teams of 256 threads (24.6 groups
each), 8192 blocks; f32 rows of 12576 groups, teams of 512.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jnova.runtime.target import Target

LOAD_BYTES = 16
GROUPS_PER_THREAD = 16
MIN_GROUPS_PER_THREAD = 4
MIN_BLOCK = 128  # threads: below this, several rows share a block
REGISTERS = 64  # per thread: the budget the kernels assemble within (tests/test_gpu_sce_codegen.py)
DRAM_LATENCY_S = 1e-6  # loaded DRAM latency (Hopper: 600 ns - 1 us under load)
MAX_UNROLL = 4
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class CrossEntropyRows:
    """A row kernel's schedule: `team` threads (a power of two) per row, `block // team` rows per block,
    `vector` elements per load, `unroll` loads per thread per loop trip."""

    rows: int
    classes: int
    vector: int
    team: int
    unroll: int
    block: int
    grid: int

    @property
    def rows_per_block(self) -> int:
        return self.block // self.team

    def __str__(self) -> str:
        return (f"sce_rows(rows={self.rows}, classes={self.classes}, vector={self.vector}, team={self.team}, "
                f"unroll={self.unroll}, block={self.block}, grid={self.grid})")


def choose_cross_entropy_rows(rows: int, classes: int, dtype: str, target: Target, team: int | None = None,
                              unroll: int | None = None) -> CrossEntropyRows:
    """The schedule of the model above for logits [rows, classes] of `dtype`; `team` and `unroll`
    override the model's choice (a power of two each; the tests run small rows with big teams)."""
    vector = LOAD_BYTES // ELEMENT_BYTES[dtype]
    groups = max(1, classes // vector)
    limit = target.max_threads_per_block
    if team is None:
        team = min(limit, _floor_pow2(max(1, groups // GROUPS_PER_THREAD)))
        wave = target.sm_count * target.max_threads_per_sm
        while rows * team < wave and team < limit and groups // (2 * team) >= MIN_GROUPS_PER_THREAD:
            team *= 2
    if team & (team - 1) or not 1 <= team <= limit:
        raise ValueError(f"a team of {team} threads: expected a power of two up to {limit}")
    block = max(team, MIN_BLOCK)
    if unroll is None:
        unroll = _unroll(block, target)
    return CrossEntropyRows(rows, classes, vector, team, unroll, block, math.ceil(rows / (block // team)))


def resident_threads(block: int, target: Target) -> int:
    """Threads of whole blocks an SM holds at once, within its thread and register limits."""
    per_sm = min(target.max_threads_per_sm, target.regs_per_sm // REGISTERS)
    return max(1, per_sm // block) * block


def _unroll(block: int, target: Target) -> int:
    needed = target.dram_bytes_per_s / target.sm_count * DRAM_LATENCY_S
    unroll = 1
    while unroll < MAX_UNROLL and resident_threads(block, target) * unroll * LOAD_BYTES < needed:
        unroll *= 2
    return unroll


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)
