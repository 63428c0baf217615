"""Tiles of the fused attention kernels, chosen from the shared-memory footprint of their key loop.

The forward kernel (`codegen/gpu/attention.py`) runs one block per (batch, q head, `block_m` query
rows); its `warps` warps own 16 query rows each. It keeps its Q tile in shared memory for the whole
loop over keys and streams K and V tiles of `block_n` keys through a ring of `stages` buffers
(cp.async). The footprint per block is therefore

    Q: block_m * D * e   +   stages * (K + V): stages * 2 * block_n * D * e       (e: element bytes)

and the driver keeps `Target.smem_reserved_per_block` (1 KiB on Hopper) beside every resident block:
an SM holds `smem_per_sm // (footprint + reserve)` blocks, not `smem_per_sm // footprint` (the Nova
report's tile search ignored the reserve and was off by one block per SM at its chosen tile).

`choose_attention_tiles` takes the first seed, in order, that keeps at least `MIN_BLOCKS_PER_SM`
blocks on an SM; if none does, the seed with the most blocks (the smallest footprint). The seeds keep
block_m = 64 (4 warps of 16 rows: enough blocks to fill 132 SMs at GPT-2's 8 x 12 heads x 16 tiles)
and shrink block_n before stages: a 32-key tile halves the K/V ring at the cost of twice the loop
trips. Deterministic: the same problem and target always give the same config. The backward kernels
(`codegen/gpu/attention_backward.py`) hold two [block_m][D] tiles and stream two [block_n][D] tiles
(plus 2 x block_n f32 of lse and delta) per stage: `choose_attention_tiles(..., backward=True)` applies
the same rule to that footprint, and a problem is refused unless the backward fits too.

On a GPU with wgmma (sm_90a), bf16 problems run on warpgroup products (`codegen/gpu/attention_wgmma.py`):
warpgroups of 64 rows, two per block (`WGMMA_SEEDS`: block_m = 128, so each K/V tile in shared memory
serves 128 query rows), and the widest score tile (block_n: 128, 64 or 32 columns) whose accumulators
fit a register budget. A wgmma kernel holds its accumulators for whole tiles in registers (a thread
of a warpgroup holds n/2 f32 of a 64 x n product), and it is registers, not shared memory, that bound
it: `AttentionConfig.accumulator_registers` counts them and `WGMMA_ACCUMULATOR_REGISTERS` is the
largest count ptxas compiles without spilling. GPT-2's head dim 64 gets 128-key forward tiles and
64-row backward tiles; head dim 128 a 32-row backward tile (its dK and dV alone take 128 registers).

`attention_refusal` says why no generated kernel computes a problem (head dims other than 64 and 128,
f16, additive bias or boolean masks, causal attention with Tq != Tk, a non-positive scale, kv heads
not dividing q heads); the op then stays on the generic path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jnova.runtime.target import Target

HEAD_DIMS = (64, 128)
DTYPES = {"float32": 4, "bfloat16": 2}
LAYOUTS = ("bthd", "bhtd")
MIN_BLOCKS_PER_SM = 2
# (block_m, block_n, warps, stages), tried in order
SEEDS = ((64, 64, 4, 2), (64, 32, 4, 2))
# bf16 on targets with wgmma: warpgroups of 64 rows (two per block: each K/V tile serves 128 rows),
# the widest score tile whose accumulators fit WGMMA_ACCUMULATOR_REGISTERS
WGMMA_SEEDS = ((128, 128, 8, 2, "wgmma"), (128, 64, 8, 2, "wgmma"), (128, 32, 8, 2, "wgmma"),
               (64, 32, 4, 2, "wgmma"))
# Whether the configurator picks the wgmma kernels for bf16 on its own. They compute what the mma.sync
# kernels do in the CPU interpreter (tests/test_gpu_attention_codegen.py) and assemble without spills,
# but have not run on a GPU yet: until they have, `choose_attention_tiles(..., wgmma=True)` asks for
# them (the tests, and `benchmarks/attention.py --variants wgmma`), and steps run the mma.sync kernels.
WGMMA_BY_DEFAULT = False
# f32 accumulator and packed-operand registers a thread of a wgmma kernel may hold (the model of
# `AttentionConfig.accumulator_registers`). ptxas (CUDA 13.0, sm_90a) puts the kernels at up to 176
# of them in 232-255 registers without spills (the dK/dV kernel: 206 at 160, 236 at 176) and spills
# those at 224 (24 B, head dim 128 with 64-row q tiles) or 256; tests/test_gpu_attention_codegen.py
# assembles every choice
WGMMA_ACCUMULATOR_REGISTERS = 176


@dataclass(frozen=True)
class AttentionProblem:
    """softmax(scale * Q K^T [+ causal mask]) V for q [B, Tq, Hq, D] ("bthd") or [B, Hq, Tq, D] ("bhtd");
    k and v have Hkv heads of Tk keys in the same layout; o is q's shape and dtype, lse f32 [B, Hq, Tq]."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str = "bfloat16"
    causal: bool = False
    scale: float = 0.0  # 0: 1 / sqrt(head_dim)
    layout: str = "bthd"
    bias: bool = False  # an additive bias operand
    mask: bool = False  # a boolean mask operand

    @property
    def softmax_scale(self) -> float:
        return self.scale or 1.0 / math.sqrt(self.head_dim)

    @property
    def group(self) -> int:
        """Q heads per kv head (grouped-query attention)."""
        return self.q_heads // self.kv_heads

    @property
    def elem_bytes(self) -> int:
        return DTYPES[self.dtype]

    def flops(self, backward: bool = False) -> float:
        """Matmul FLOPs of the forward (2 matmuls) or of the backward (5), halved when causal."""
        full = 4.0 * self.batch * self.q_heads * self.q_len * self.kv_len * self.head_dim
        if backward:
            full *= 2.5
        return full / 2 if self.causal else full

    def __str__(self) -> str:
        heads = f"{self.q_heads}" if self.kv_heads == self.q_heads else f"{self.q_heads}:{self.kv_heads}"
        kv = "" if self.kv_len == self.q_len else f"x{self.kv_len}"
        return (f"attention {self.batch}x{heads}x{self.q_len}{kv}x{self.head_dim} {self.dtype} {self.layout}"
                f"{' causal' if self.causal else ''}")


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int = 64  # query rows per block
    block_n: int = 64  # keys per K/V tile
    warps: int = 4  # each owns block_m / warps = 16 query rows
    stages: int = 2  # K/V tiles in the cp.async ring
    mma: str = "mma.sync"  # the products' instruction: mma.sync per warp, or wgmma per warpgroup (bf16, sm_90a)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_bytes(self, problem: AttentionProblem) -> int:
        """Dynamic shared memory of the forward kernel: the Q tile and the K/V ring."""
        tile = problem.head_dim * problem.elem_bytes
        return self.block_m * tile + self.stages * 2 * self.block_n * tile

    def backward_smem_bytes(self, problem: AttentionProblem) -> int:
        """Either backward kernel (`codegen/gpu/attention_backward.py`): two resident [block_m][D] tiles
        (Q and dO, or K and V), a ring of two [block_n][D] tiles per stage and, for the dK/dV kernel,
        the block_n lse and delta values (f32) of each stage's q tile."""
        tile = problem.head_dim * problem.elem_bytes
        return 2 * self.block_m * tile + self.stages * (2 * self.block_n * tile + 2 * self.block_n * 4)

    def accumulator_registers(self, problem: AttentionProblem, backward: bool = False) -> int:
        """Per thread of a warpgroup (64 rows x n columns of f32 are n/2 registers): the forward's S, P
        (bf16 pairs) and O; the dK/dV kernel's S^T, dP^T, P^T and dS^T (bf16 pairs), dK and dV (the
        larger of the two backward kernels: dQ's holds S, dP, dS and dQ)."""
        n, d = self.block_n, problem.head_dim
        if backward:
            return n // 2 + n // 2 + n // 4 + n // 4 + d // 2 + d // 2
        return n // 2 + n // 4 + d // 2

    def blocks_per_sm(self, problem: AttentionProblem, target: Target, backward: bool = False) -> int:
        smem = self.backward_smem_bytes(problem) if backward else self.smem_bytes(problem)
        return min(target.blocks_per_sm_by_smem(smem), 2048 // self.threads)

    def __str__(self) -> str:
        mma = " wgmma" if self.mma == "wgmma" else ""
        return f"block={self.block_m}x{self.block_n} warps={self.warps} stages={self.stages}{mma}"


def attention_refusal(problem: AttentionProblem, target: Target) -> str | None:
    """Why the generated attention kernels do not compute `problem` on `target`, or None."""
    p = problem
    if p.dtype not in DTYPES:
        return f"dtype {p.dtype}: the attention kernels take {' and '.join(DTYPES)}"
    if p.head_dim not in HEAD_DIMS:
        return f"head dim {p.head_dim}: the attention kernels take {' and '.join(map(str, HEAD_DIMS))}"
    if p.layout not in LAYOUTS:
        return f"layout {p.layout!r}: the attention kernels take {' and '.join(LAYOUTS)}"
    if p.bias or p.mask:
        return "an additive bias or boolean mask operand: the attention kernels apply only the causal mask"
    if p.kv_heads <= 0 or p.q_heads % p.kv_heads:
        return f"{p.kv_heads} kv heads do not divide {p.q_heads} q heads"
    if p.causal and p.q_len != p.kv_len:
        return f"causal attention with {p.q_len} queries and {p.kv_len} keys (the kernels align them only when equal)"
    if p.softmax_scale <= 0 or not math.isfinite(p.softmax_scale):
        return f"scale {p.scale}: the kernels' finite mask needs a positive scale"
    if min(p.batch, p.q_len, p.kv_len) <= 0:
        return f"an empty problem ({p})"
    if not (target.has("mma_sync") and target.has("ldmatrix") and target.has("cp_async")):
        return f"{target.name} lacks mma.sync, ldmatrix or cp.async"
    if p.dtype == "bfloat16" and not target.has("bf16_mma"):
        return f"{target.name} has no bf16 tensor cores"
    if all(AttentionConfig(*s).backward_smem_bytes(p) > target.smem_per_block_optin for s in SEEDS):
        return f"no attention tile fits {target.name}'s {target.smem_per_block_optin} B of shared memory per block"
    return None


def choose_attention_tiles(problem: AttentionProblem, target: Target, backward: bool = False,
                           wgmma: bool | None = None) -> AttentionConfig:
    """The first seed that keeps MIN_BLOCKS_PER_SM blocks per SM, else the one with the most blocks (the
    smallest footprint of those: fewer registers too); `backward`: for the backward kernels' footprint.
    `wgmma`: whether bf16 on a target with wgmma takes WGMMA_SEEDS (default `WGMMA_BY_DEFAULT`)."""
    wgmma = WGMMA_BY_DEFAULT if wgmma is None else wgmma
    reason = attention_refusal(problem, target)
    if reason:
        raise ValueError(f"no attention kernel for {problem}: {reason}")
    footprint = AttentionConfig.backward_smem_bytes if backward else AttentionConfig.smem_bytes
    if wgmma and problem.dtype == "bfloat16" and target.has("wgmma"):
        for config in (AttentionConfig(*s) for s in WGMMA_SEEDS):
            if (config.accumulator_registers(problem, backward) <= WGMMA_ACCUMULATOR_REGISTERS
                    and footprint(config, problem) <= target.smem_per_block_optin):
                return config
    fitting = [AttentionConfig(*s) for s in SEEDS]
    fitting = [c for c in fitting if footprint(c, problem) <= target.smem_per_block_optin]
    if not fitting:
        raise ValueError(f"no attention {'backward ' if backward else ''}tile fits {target.name} for {problem}")
    for config in fitting:
        if config.blocks_per_sm(problem, target, backward) >= MIN_BLOCKS_PER_SM:
            return config
    return max(fitting, key=lambda c: (c.blocks_per_sm(problem, target, backward), -footprint(c, problem)))
