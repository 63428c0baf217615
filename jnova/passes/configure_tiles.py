"""The Analytic Configurator: a contraction's tile schedule derived from its shape and the Target.

`choose_tiles(problem, target)` is pure and deterministic (no search, no GPU, microseconds); its
`TileConfig` prints as one line that `TileConfig.parse` reads back, so a printed config is an override.
The rules (Nova report, section 4.4):

1. Tile family: arithmetic intensity AI = 2MNK / (MK + KN + MN) (FLOP per element), over the machine
   balance point in FLOP per operand element, picks a rung of `TILE_LADDER`; 16-bit operands and
   wgmma go one rung up (half the shared memory per element; a warpgroup reads fewer shared-memory
   bytes per FLOP from a larger tile: TF32 256x128 tiles measured 1.2-1.5x 128x128 on GPT-2 shapes).
2. SM fill: from that rung down, the first whose tiles make at least one full wave with
   `FILL_EFFICIENCY` of the SM slots busy (waves = ceil(tiles / SMs)), or, for a problem too small for
   any, the best fill; within a rung the orientation with the better fill, then intensity, wins.
   wgmma weighs every rung instead: waves x tile area / the rung's measured relative efficiency
   (`WGMMA_TILE_EFFICIENCY`), so a partial wave of 256x128 tiles beats five waves of 64x64 ones.
3. Scoring: the schedule's intensity uses tile-aware traffic (an operand panel that fits in L2 is read
   once, otherwise once per pass the tiling makes over it). Below the balance point (memory side) the
   tile keeps its size and gets twice the warps.
4. Pipeline depth: the deepest of 4, 3, 2 stages that fits the per-block opt-in shared memory
   (halving block_k only when even 2 stages do not fit).
5. MMA kind from the operand dtype and target features; swizzle from the smem tile's row width.
   A kernel's split_k stays 1 (fused epilogues need the whole K sum; larger values come only from
   overrides).
6. Split-K (`choose_split_k`, wgmma targets): a contraction with B as [K, N] (K leading) whose tiles
   leave SMs idle (a weight gradient, A as [K, M]; or a long K with A as [M, K]) is split into S
   partial products over K/S each (a batched contraction, then a sum: `passes/split_contractions.py`),
   S from 1..`SPLIT_K_MAX` minimizing waves x tile time (the weights of the kernel each side would
   get, rule 2's or rule 8's, at the layouts' measured main-loop rate; in TF32 after the transposes
   rule 7 would choose for that side) plus the partial products' DRAM traffic, if that saves 10%.
7. Operand layouts (`choose_transposes`, TF32 on wgmma targets): wgmma reads TF32 operands K-major
   only, so the kernel transposes an MN-major operand into shared memory 4 bytes at a time, which
   slows its main loop (`TF32_LAYOUT_FRACTION`), and rule 8's kernel takes TF32 only K-major. An
   operand is transposed in a kernel of its own first (`passes/transpose_operands.py`) when its DRAM
   round trip costs less than the main loop gains (each layout timed with the kernel it would get),
   and its copy is at most `TRANSPOSE_MAX_BYTES` (memory held until the contraction runs).

8. Warp-specialized kernel (`PINGPONG_TILE_EFFICIENCY`; wgmma on targets with TMA, when the kernel
   can be launched with tensor maps): a persistent block of a TMA producer and two consumer
   warpgroups that take tiles in turn, so one stores its tile while the other computes
   (`codegen/gpu/matmul_tma.py`). Each SM works through ceil(tiles / SMs) consumer tiles; that count
   x tile area / the tile's measured efficiency (rule 2's units) against rule 2's choice picks it.
   It needs rows of A and B in whole 16-byte units (TMA strides), no split-K slices of A, and TF32
   operands both K-major (the TMA copies land as they are; rule 7 decides the copies before).

Attention is the exception (report, section 4.2): `attention_tiles` picks a fixed 64-row query tile and
the largest key tile from a short seed list whose fused-loop footprint fits.
"""

from __future__ import annotations

import dataclasses
import math
import re

from jnova.runtime.target import KiB, Target

OPERAND_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LAYOUTS = ("row", "col")
# N in a wgmma kind is the warpgroup's n extent, block_n // warps_n, fixed at code generation.
MMA_KINDS = ("mma_sync_tf32_16x8x8", "mma_sync_bf16_16x8x16", "mma_sync_f16_16x8x16",
             "wgmma_tf32_m64nNk8", "wgmma_bf16_m64nNk16", "wgmma_f16_m64nNk16")
SWIZZLES = (128, 64, 32)

TILE_LADDER = (((64, 64),), ((128, 64), (64, 128)), ((128, 128),), ((256, 128), (128, 256)))
RUNG_THRESHOLDS = (1.0, 2.0, 3.0)  # AI / balance (both per operand element) at which rungs 1, 2, 3 start
FILL_EFFICIENCY = 0.75  # useful fraction of the SM slots over all waves for a rung to be accepted
STAGES = (4, 3, 2)
MAX_WARPS = 16
# registers per thread beyond the accumulators (fragments, addresses, loop state): 124-180 measured
# with ptxas on the TF32 kernels for 64 accumulators a thread
_REGS_OVERHEAD = 160
MMA_SYNC_MAX_RUNG = 2  # 128x128: 8 warps of 64x32 warp tiles
_MBARRIER_BYTES_PER_STAGE = 16  # full + empty mbarrier of a TMA/wgmma pipeline stage
# One SM's throughput on a wgmma tile of each rung, relative to the top rung's (H200, GPT-2 shapes,
# benchmarks/matmul.py --variants, 2026-11-30): TF32 128x64 0.67-0.75, 128x128 0.63-0.75, 64x64 ~0.4
# (MN-major TF32 operands are copied 4 bytes at a time). bf16, measured again with the bulk-copy
# epilogue (2026-12-01, 4096x768x3072 and 4096x768x50304): 128x64 0.49-0.58, 128x128 0.83-0.87 (it was
# 0.78-1.03 and 0.8-1.05 with stores from registers); 64x64 scaled down with 128x64.
WGMMA_TILE_EFFICIENCY = {"tf32": (0.4, 0.7, 0.68, 1.0), "16-bit": (0.35, 0.6, 0.85, 1.0),
                         # TF32 with both operands MN-major (weight gradients; both copied 4 bytes at a
                         # time): 128x64 tiles ran GPT-2's at ~70 TFLOP/s per full wave, 256x128 ones 126-139
                         "tf32-mn": (0.3, 0.55, 0.68, 1.0)}


# The warp-specialized ping-pong kernel's consumer tiles, their throughput relative to rule 2's top
# rung (the 256x128 tile of two warpgroups = 1.0) in the same precision. H200, benchmarks/matmul.py
# --variants on the six GPT-2 shapes, 4 stages:
# - bf16 (2026-12-01, C stored from registers): 128x192 1.08-1.31 (median 1.2), 192x128 0.9-1.22,
#   128x128 1.03-1.23; with TMA stores of C 128x192 ran 1.3-1.4 on the K = 768 shapes;
# - TF32, both operands K-major (2026-12-01, session 12, TMA stores): 128x192 1.06-1.34 (median
#   1.24), 192x128 1.06-1.30, 128x128 0.99-1.19.
# One table serves both. A consumer holds its tile's f32 accumulators: 192 registers at most.
PINGPONG_TILE_EFFICIENCY = {(128, 192): 1.2, (192, 128): 1.1, (128, 128): 1.08}
PINGPONG_STAGES = 4  # 4 stages measured at or above 5 and 6 on those shapes
PINGPONG_K_TILE_BYTES = 128  # a k-tile is one 128-byte swizzle panel: block_k 64 (16-bit), 32 (TF32)

SPLIT_K_MAX = 16
SPLIT_K_MIN_K = 512  # contracting elements per partial product: the pipeline's fill and drain amortized
SPLIT_K_SUM_LAUNCH_S = 4e-6  # the sum over the partial products, when it is a kernel of its own
SPLIT_K_MIN_GAIN = 0.9  # a split must be estimated at most this fraction of the unsplit time
SPLIT_K_DRAM_EFFICIENCY = 0.7  # of the DRAM bandwidth, writing and summing the partial products
# Fraction of the tensor-core peak a top-rung wgmma tile sustains with 16-bit operands, either layout
# (H200: GPT-2's bf16 weight gradients, 128x64 tiles, 322 TFLOP/s in 2.2 waves, ~0.53 at the top rung);
# TF32's depends on the layouts (TF32_LAYOUT_FRACTION)
WGMMA_16BIT_PEAK_FRACTION = 0.5


# TF32 wgmma's main-loop rate by operand layouts (a_layout, b_layout), as a fraction of the tensor-core
# peak (H200, benchmarks/matmul_layouts.py, 256x128x32 tiles, 16384x3072x768 and 16384x768x3072:
# rc 254/291 TFLOP/s, rr 188/207, cc 166/172, cr 126/139 of 495)
TF32_LAYOUT_FRACTION = {("row", "col"): 0.55, ("row", "row"): 0.40, ("col", "col"): 0.34, ("col", "row"): 0.27}
# of the DRAM bandwidth, for a transpose kernel's read and write (H200, codegen/gpu/transpose.py:
# 3184 GB/s on 8192 x 3072 f32, 1277 GB/s on 4 x 2048 x 768, benchmarks/kernels.py)
TRANSPOSE_DRAM_EFFICIENCY = 0.5
TRANSPOSE_LAUNCH_S = 4e-6
TRANSPOSE_MAX_BYTES = 256 * 2**20
TRANSPOSE_MIN_GAIN = 0.9  # transposes must be estimated at most this fraction of the time without


@dataclasses.dataclass(frozen=True)
class ContractionProblem:
    """C[batch, m, n] = A[batch, m, k] @ B[batch, k, n]; a layout is "row" when k (for A) or n (for B)
    is contiguous, "col" otherwise."""

    m: int
    n: int
    k: int
    batch: int = 1
    operand_dtype: str = "float32"
    out_dtype: str = "float32"
    a_layout: str = "row"
    b_layout: str = "row"
    # the batch splits K of one row-major A ([M, batch * k], slice b = columns b*k .. b*k + k - 1):
    # the partial products of a split-K contraction (passes/split_contractions.py); B and C are batched
    a_split_k: bool = False

    def __post_init__(self):
        for name in ("m", "n", "k", "batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"ContractionProblem.{name} must be a positive int, got {getattr(self, name)!r}")
        for name in ("operand_dtype", "out_dtype"):
            if getattr(self, name) not in OPERAND_BYTES:
                raise ValueError(f"ContractionProblem.{name}={getattr(self, name)!r}; expected one of {list(OPERAND_BYTES)}")
        for name in ("a_layout", "b_layout"):
            if getattr(self, name) not in LAYOUTS:
                raise ValueError(f"ContractionProblem.{name}={getattr(self, name)!r}; expected 'row' or 'col'")
        if self.a_split_k and self.a_layout != "row":
            raise ValueError("ContractionProblem.a_split_k needs a_layout='row' (K contiguous in A)")

    @property
    def operand_bytes(self) -> int:
        return OPERAND_BYTES[self.operand_dtype]

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    @property
    def arithmetic_intensity(self) -> float:
        """AI = 2MNK / (MK + KN + MN), in FLOP per element."""
        m, n, k = self.m, self.n, self.k
        return 2 * m * n * k / (m * k + k * n + m * n)


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """A contraction schedule: block tile, warp grid, pipeline depth, MMA instruction, smem swizzle."""

    block_m: int
    block_n: int
    block_k: int
    warps_m: int
    warps_n: int
    stages: int
    mma: str
    swizzle: int
    split_k: int = 1
    pingpong: bool = False  # the warp-specialized TMA kernel (codegen/gpu/matmul_tma.py): a consumer's tile

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in ("mma", "pingpong") and (not isinstance(value, int) or value < 1):
                raise ValueError(f"TileConfig.{f.name} must be a positive int, got {value!r}")
        if self.mma not in MMA_KINDS:
            raise ValueError(f"TileConfig.mma={self.mma!r}; expected one of {MMA_KINDS}")
        if self.swizzle not in SWIZZLES:
            raise ValueError(f"TileConfig.swizzle={self.swizzle}; expected one of {SWIZZLES}")
        # each warp owns whole m16 MMA rows (a warpgroup's 4 warps split wgmma's m64) and n8 columns
        if self.block_m % (16 * self.warps_m) or self.block_n % (8 * self.warps_n):
            raise ValueError(f"TileConfig: block {self.block_m}x{self.block_n} does not split into "
                             f"{self.warps_m}x{self.warps_n} warps of whole 16x8 MMA tiles")
        if self.block_k % self.mma_k:
            raise ValueError(f"TileConfig.block_k={self.block_k} is not a multiple of {self.mma}'s k={self.mma_k}")
        if self.is_wgmma and (self.warps_m % 4 or self.block_n // self.warps_n > 256):
            raise ValueError(f"TileConfig: wgmma needs warps_m in whole warpgroups (multiples of 4) and "
                             f"at most 256 columns per warpgroup, got warps={self.warps_m}x{self.warps_n}")

    @property
    def is_wgmma(self) -> bool:
        return self.mma.startswith("wgmma")

    @property
    def mma_k(self) -> int:
        return 8 if "tf32" in self.mma else 16

    @property
    def operand_bytes(self) -> int:
        return 4 if "tf32" in self.mma else 2

    @property
    def num_warps(self) -> int:
        return self.warps_m * self.warps_n

    @property
    def stage_bytes(self) -> int:
        """Shared memory of one pipeline stage: an A and a B tile (swizzled, so no padding)."""
        tiles = (self.block_m + self.block_n) * self.block_k * self.operand_bytes
        return tiles + (_MBARRIER_BYTES_PER_STAGE if self.is_wgmma else 0)

    @property
    def smem_bytes(self) -> int:
        return self.stages * self.stage_bytes

    def __str__(self) -> str:
        return (f"block={self.block_m}x{self.block_n}x{self.block_k} warps={self.warps_m}x{self.warps_n} "
                f"stages={self.stages} mma={self.mma} swizzle={self.swizzle} split_k={self.split_k}"
                f"{' pingpong' if self.pingpong else ''}")

    @classmethod
    def parse(cls, text: str) -> TileConfig:
        """Read the form `str(cfg)` prints (split_k may be left out)."""
        form = (r"block=(\d+)x(\d+)x(\d+) warps=(\d+)x(\d+) stages=(\d+) mma=(\S+) swizzle=(\d+)(?: split_k=(\d+))?"
                r"( pingpong)?")
        match = re.fullmatch(form, " ".join(text.split()))
        if match is None:
            raise ValueError(f"cannot parse tile config {text!r}; expected e.g. "
                             "'block=128x128x32 warps=2x2 stages=3 mma=mma_sync_tf32_16x8x8 swizzle=128 split_k=1'")
        bm, bn, bk, wm, wn, stages, mma, swizzle, split_k, pingpong = match.groups()
        return cls(int(bm), int(bn), int(bk), int(wm), int(wn), int(stages), mma, int(swizzle), int(split_k or 1),
                   bool(pingpong))


@dataclasses.dataclass(frozen=True)
class _Candidate:
    """One block tile with the numbers that score it."""

    block_m: int
    block_n: int
    tiles: int
    waves: int
    fill: float  # useful output area / (waves * SMs * tile area)
    traffic: int  # DRAM bytes, tile-aware
    intensity: float  # FLOP / traffic byte


@dataclasses.dataclass(frozen=True)
class _Decision:
    ai: float
    balance: float  # FLOP per DRAM byte
    rung: int
    tried: tuple[_Candidate, ...]
    chosen: _Candidate
    memory_side: bool
    config: TileConfig
    time: float = 0.0  # rule 2's weighed time of the chosen tiling (wgmma)
    pingpong: tuple = ()  # ((bm, bn), time) of the ping-pong tiles weighed (rule 8)


def choose_tiles(problem: ContractionProblem, target: Target, tensor_maps: bool = True) -> TileConfig:
    """The tile schedule for `problem` on `target` (rules in the module docstring); `tensor_maps`:
    whether the kernel can take TMA descriptors (jnova's launcher builds them, jaxlib's call does not)."""
    return _decide(problem, target, tensor_maps).config


def explain(problem: ContractionProblem, target: Target, tensor_maps: bool = True) -> str:
    """The numbers behind `choose_tiles(problem, target)`, for debug logs."""
    d = _decide(problem, target, tensor_maps)
    elem = problem.operand_bytes
    lines = [
        f"problem {problem.batch}x{problem.m}x{problem.n}x{problem.k} {problem.operand_dtype} on {target}",
        f"AI {d.ai:.0f} FLOP/elem; balance {d.balance:.1f} FLOP/B = {d.balance * elem:.0f} FLOP/elem "
        f"-> ratio {d.ai / (d.balance * elem):.2f}, rung {d.rung}",
    ]
    for c in d.tried:
        mark = "*" if c is d.chosen else " "
        lines.append(f" {mark} {c.block_m}x{c.block_n}: tiles={c.tiles} waves={c.waves} (on {target.sm_count} SMs) "
                     f"fill={c.fill:.2f} traffic={c.traffic / 1e6:.1f} MB intensity={c.intensity:.1f} FLOP/B")
    side = "memory side: more warps" if d.memory_side else "compute side"
    cfg = d.config
    for (bm, bn), time in d.pingpong:
        lines.append(f"   ping-pong {bm}x{bn}: {time:.0f} against {d.time:.0f} (tile area x tiles per SM / efficiency)")
    lines.append(f"{side}; smem {cfg.stage_bytes} B/stage x {cfg.stages} = {cfg.smem_bytes} B "
                 f"(limit {target.smem_per_block_optin} B/block)")
    lines.append(f"-> {cfg}")
    return "\n".join(lines)


def _decide(problem: ContractionProblem, target: Target, tensor_maps: bool = True) -> _Decision:
    mma = _mma_kind(problem.operand_dtype, target)
    elem = problem.operand_bytes
    balance = target.balance_point(problem.operand_dtype)
    ai = problem.arithmetic_intensity
    rung = sum(ai / (balance * elem) >= t for t in RUNG_THRESHOLDS)
    if elem == 2 or mma.startswith("wgmma"):  # half the smem per element; or wgmma, whose shared-memory
        rung = min(rung + 1, len(TILE_LADDER) - 1)  # reads per FLOP fall as the tile grows (TF32 measured)
    top = rung
    if mma.startswith("mma_sync"):  # 256-wide tiles: accumulators beyond 8 warps' registers (measured spills)
        top = min(rung, MMA_SYNC_MAX_RUNG)
    tried, chosen = [], None
    for r in range(top, -1, -1):
        best = max((_score(problem, target, bm, bn) for bm, bn in TILE_LADDER[r]),
                   key=lambda c: _rank(problem, c, mma))
        tried.append(best)
        if mma.startswith("wgmma"):
            continue  # all rungs are weighed below
        if best.tiles >= target.sm_count and best.fill >= FILL_EFFICIENCY:
            chosen = best
            break
    if mma.startswith("wgmma"):
        chosen = min(tried, key=lambda c: _wgmma_time(c, _family(problem, mma)))
    elif chosen is None:  # too small for a full wave at any rung: the best fill (larger tile on ties)
        chosen = max(tried, key=lambda c: (round(c.fill, 6), c.block_m * c.block_n))
    memory_side = chosen.intensity < balance
    if chosen.block_m % 64:  # wgmma's m is 64
        mma = _mma_sync_form(mma)
    warps_m, warps_n = _warps(chosen.block_m, chosen.block_n, mma, memory_side, target)
    config = _pipeline(problem, chosen.block_m, chosen.block_n, warps_m, warps_n, mma, target)
    if not (mma.startswith("wgmma") and tensor_maps and target.has("tma") and pingpong_refusal(problem) is None):
        return _Decision(ai, balance, rung, tuple(tried), chosen, memory_side, config)
    time = _wgmma_time(chosen, _family(problem, mma))
    weighed = tuple(((bm, bn), _pingpong_time(problem, target, bm, bn)) for bm, bn in PINGPONG_TILE_EFFICIENCY)
    (bm, bn), best = min(weighed, key=lambda w: w[1])
    if best < time:
        block_k = PINGPONG_K_TILE_BYTES // problem.operand_bytes
        pingpong = TileConfig(bm, bn, block_k, 4, 1, PINGPONG_STAGES, mma, 128, pingpong=True)
        if pingpong.smem_bytes <= target.smem_per_block_optin:
            config = pingpong
    return _Decision(ai, balance, rung, tuple(tried), chosen, memory_side, config, time, weighed)


def pingpong_refusal(problem: ContractionProblem) -> str | None:
    """Why rule 8's kernel cannot take `problem`, or None: TMA strides are whole 16-byte units, and
    its producer copies whole operands, not split-K slices of A (`matmul_tma.refusal` adds the
    config's conditions)."""
    p, problems = problem, []
    if p.operand_bytes == 4 and (p.a_layout, p.b_layout) != ("row", "col"):
        problems.append("TF32 operands that are not both K-major (wgmma does not transpose them; rule 7 "
                        "may copy them K-major first)")
    if p.a_split_k:
        problems.append("split-K slices of A")
    inner = {"A": p.k if p.a_layout == "row" else p.m, "B": p.k if p.b_layout == "col" else p.n}
    for name, extent in inner.items():
        if extent * p.operand_bytes % 16:
            problems.append(f"rows of {name} of {extent} elements (TMA strides are multiples of 16 bytes)")
    return "; ".join(problems) or None


def _pingpong_time(problem: ContractionProblem, target: Target, bm: int, bn: int) -> float:
    """Rule 8: consumer tiles per SM x tile area / efficiency, in `_wgmma_time`'s units."""
    tiles = problem.batch * math.ceil(problem.m / bm) * math.ceil(problem.n / bn)
    return math.ceil(tiles / target.sm_count) * bm * bn / PINGPONG_TILE_EFFICIENCY[(bm, bn)]


def choose_split_k(problem: ContractionProblem, target: Target, tensor_maps: bool = True) -> int:
    """How many partial products over K a contraction is split into (rule 6); 1 = not split.
    `tensor_maps` as for `choose_tiles`: each side is timed with the kernel it would get."""
    return _best_split(_split_times(problem, target, tensor_maps))


def explain_split_k(problem: ContractionProblem, target: Target, tensor_maps: bool = True) -> str:
    """The estimated time of every split `choose_split_k` weighed, for debug logs."""
    times = _split_times(problem, target, tensor_maps)
    best = _best_split(times)
    return "; ".join(f"{'*' if s == best else ''}S={s}: {t * 1e6:.1f} us" for s, t in times)


def _best_split(times: list[tuple[int, float]]) -> int:
    """The fastest split, if it saves at least `1 - SPLIT_K_MIN_GAIN` of the unsplit time (the model's
    error is larger than a few percent; a split costs memory and a kernel)."""
    split, seconds = min(times, key=lambda st: (st[1], st[0]))
    return split if seconds <= SPLIT_K_MIN_GAIN * times[0][1] else 1


def _split_times(problem: ContractionProblem, target: Target, tensor_maps: bool = True) -> list[tuple[int, float]]:
    """(S, estimated seconds) for S = 1 and every split that rule 6 allows."""
    mma = _mma_kind(problem.operand_dtype, target)
    if not (mma.startswith("wgmma") and problem.batch == 1 and problem.b_layout == "row"):
        return [(1, 0.0)]  # no split to weigh: no time model needed
    whole = [(1, _planned_seconds(problem, target, mma, tensor_maps))]
    partial_bytes = problem.m * problem.n * OPERAND_BYTES[problem.out_dtype]
    for s in range(2, SPLIT_K_MAX + 1):
        if problem.k % s or problem.k // s < SPLIT_K_MIN_K:
            continue
        if problem.a_layout == "row" and problem.k // s * problem.operand_bytes % 16:
            continue  # A's slices must start 16-byte aligned, as its rows do
        part = dataclasses.replace(problem, batch=s, k=problem.k // s, a_split_k=problem.a_layout == "row")
        # the partial products are written and read back once more than the result would be
        extra = 2 * s * partial_bytes / (SPLIT_K_DRAM_EFFICIENCY * target.dram_bytes_per_s) + SPLIT_K_SUM_LAUNCH_S
        whole.append((s, _planned_seconds(part, target, mma, tensor_maps) + extra))
    return whole


def _planned_seconds(problem: ContractionProblem, target: Target, mma: str, tensor_maps: bool) -> float:
    """The contraction's time as the plan will run it: in TF32, after the transposes rule 7 chooses
    for it (their DRAM round trips included), so a split is weighed against the whole contraction
    with K-major operands on the kernel it would then get, and the other way round."""
    times = _transpose_times(problem, target, tensor_maps)
    if len(times) == 1:  # no transposes to weigh (16-bit operands, or no wgmma)
        return _contraction_seconds(problem, target, mma, tensor_maps)
    return times[_best_transposes(times)]


def choose_transposes(problem: ContractionProblem, target: Target, tensor_maps: bool = True) -> tuple[bool, bool]:
    """Whether A and B are transposed into K-major copies before the contraction (rule 7);
    `tensor_maps` as for `choose_tiles`: each layout is timed with the kernel it would get."""
    return _best_transposes(_transpose_times(problem, target, tensor_maps))


def explain_transposes(problem: ContractionProblem, target: Target, tensor_maps: bool = True) -> str:
    times = _transpose_times(problem, target, tensor_maps)
    chosen = _best_transposes(times)
    return "; ".join(f"{'*' if option == chosen else ''}transpose A={option[0]} B={option[1]}: {t * 1e6:.1f} us"
                     for option, t in times.items())


def _best_transposes(times: dict[tuple[bool, bool], float]) -> tuple[bool, bool]:
    best = min(times, key=lambda option: (times[option], sum(option)))
    return best if times[best] <= TRANSPOSE_MIN_GAIN * times[(False, False)] else (False, False)


def _transpose_times(problem: ContractionProblem, target: Target,
                     tensor_maps: bool = True) -> dict[tuple[bool, bool], float]:
    """Estimated seconds (main loop + transposes) of each allowed choice of operands to transpose:
    the main loop as `_contraction_seconds` times it in the layouts that choice leaves (so K-major
    operands count with rule 8's kernel where it takes them)."""
    if problem.operand_dtype != "float32" or not target.has("wgmma"):
        return {(False, False): 0.0}
    mma = _mma_kind(problem.operand_dtype, target)
    sizes = (problem.batch * problem.m * problem.k * 4, problem.batch * problem.k * problem.n * 4)
    can = (problem.a_layout == "col" and sizes[0] <= TRANSPOSE_MAX_BYTES,
           problem.b_layout == "row" and sizes[1] <= TRANSPOSE_MAX_BYTES)
    times = {}
    for option in ((False, False), (True, False), (False, True), (True, True)):
        if any(t and not c for t, c in zip(option, can)):
            continue
        layouts = ("row" if option[0] else problem.a_layout, "col" if option[1] else problem.b_layout)
        laid_out = dataclasses.replace(problem, a_layout=layouts[0], b_layout=layouts[1])
        seconds = _contraction_seconds(laid_out, target, mma, tensor_maps)
        for transposed, size in zip(option, sizes):
            if transposed:
                seconds += 2 * size / (TRANSPOSE_DRAM_EFFICIENCY * target.dram_bytes_per_s) + TRANSPOSE_LAUNCH_S
        times[option] = seconds
    return times


def _contraction_seconds(problem: ContractionProblem, target: Target, mma: str, tensor_maps: bool = True) -> float:
    """The main loop's time of the tiles `choose_tiles` gives `problem`: waves x one tile's FLOPs at
    the rung's efficiency times the MN-major rate of one SM (rule 8's time where it takes the
    ping-pong kernel: a long K it runs whole need not be split)."""
    d = _decide(problem, target, tensor_maps)
    if "tf32" in mma:  # the layouts' measured rates (MN-major operands are copied 4 bytes at a time)
        fraction = TF32_LAYOUT_FRACTION[(problem.a_layout, problem.b_layout)]
    else:
        fraction = WGMMA_16BIT_PEAK_FRACTION
    per_sm = target.peak_tensor_flops(problem.operand_dtype) / target.sm_count * fraction
    units = min(t for _, t in d.pingpong) if d.config.pingpong else _wgmma_time(d.chosen, _family(problem, mma))
    return units * 2 * problem.k / per_sm


def _family(problem: ContractionProblem, mma: str) -> str:
    """The row of `WGMMA_TILE_EFFICIENCY` for `problem` on `mma`."""
    if "tf32" not in mma:
        return "16-bit"
    return "tf32-mn" if (problem.a_layout, problem.b_layout) == ("col", "row") else "tf32"


def _wgmma_time(c: _Candidate, family: str) -> float:
    """A wgmma tiling's time, in units of one SM's time on a top-rung tile area: waves x tile area /
    the rung's relative efficiency. A small tile finishes sooner but computes slower (fewer FLOP per
    shared-memory byte, more copy work per FLOP), so a partial wave of large tiles can win."""
    rung = next(i for i, tiles in enumerate(TILE_LADDER) if (c.block_m, c.block_n) in tiles)
    return c.waves * c.block_m * c.block_n / WGMMA_TILE_EFFICIENCY[family][rung]


def _mma_kind(operand_dtype: str, target: Target) -> str:
    if not target.has("mma_sync"):
        raise ValueError(f"target {target.name} ({target.arch}) has no mma.sync tensor cores; jnova needs sm_80+")
    if operand_dtype == "float32":
        return "wgmma_tf32_m64nNk8" if target.has("wgmma") else "mma_sync_tf32_16x8x8"
    short = "bf16" if operand_dtype == "bfloat16" else "f16"
    if short == "bf16" and not target.has("bf16_mma"):
        raise ValueError(f"target {target.name} ({target.arch}) has no bf16 tensor-core MMA")
    return f"wgmma_{short}_m64nNk16" if target.has("wgmma") else f"mma_sync_{short}_16x8x16"


def _mma_sync_form(kind: str) -> str:
    """The mma.sync instruction for the same operand type (unchanged if `kind` already is one)."""
    return kind.replace("wgmma", "mma_sync").replace("_m64nNk16", "_16x8x16").replace("_m64nNk8", "_16x8x8")


def _score(problem: ContractionProblem, target: Target, bm: int, bn: int) -> _Candidate:
    """Waves, fill and tile-aware DRAM traffic of a bm x bn block tiling."""
    m, n, k, elem = problem.m, problem.n, problem.k, problem.operand_bytes
    tiles_m, tiles_n = math.ceil(m / bm), math.ceil(n / bn)
    tiles = problem.batch * tiles_m * tiles_n
    waves = math.ceil(tiles / target.sm_count)
    fill = problem.batch * m * n / (waves * target.sm_count * bm * bn)
    # An A panel (bm x K) is reused by the tiles_n tiles of its row if it stays in L2, else each reads it.
    a_passes = 1 if bm * k * elem <= target.l2_bytes else tiles_n
    b_passes = 1 if k * bn * elem <= target.l2_bytes else tiles_m
    per_batch = (m * k * a_passes + k * n * b_passes) * elem + m * n * OPERAND_BYTES[problem.out_dtype]
    traffic = problem.batch * per_batch
    return _Candidate(bm, bn, tiles, waves, fill, traffic, problem.flops / traffic)


def _rank(problem: ContractionProblem, c: _Candidate, mma: str = "") -> tuple:
    """Orientation order within a rung: fill, then (TF32 wgmma) fewer elements of MN-major operands
    per k row, which are transposed by 4-byte copies, then intensity, then the long tile side along
    the long dim."""
    along_long_side = (c.block_m >= c.block_n) == (problem.m >= problem.n)
    transposed = 0
    if "wgmma_tf32" in mma:
        transposed = (c.block_m if problem.a_layout == "col" else 0) + (c.block_n if problem.b_layout == "row" else 0)
    return (round(c.fill, 6), -transposed, round(c.intensity, 6), along_long_side)


def _warps(bm: int, bn: int, mma: str, memory_side: bool, target: Target) -> tuple[int, int]:
    """Warp grid: 64x32 warp tiles (at least 4 warps) for mma.sync, one warpgroup per 128x128 for wgmma
    (at least two for TF32);
    twice as many on the memory side when the smaller warp tiles stay whole MMA tiles and fit registers."""
    if mma.startswith("wgmma"):
        groups = max(1, bm * bn // (128 * 128))
        if "tf32" in mma:  # at least two warpgroups (while each keeps 64 rows): an MN-major TF32 operand
            groups = max(groups, min(2, bm // 64))  # is copied 4 bytes at a time, so more threads copy
        grid = _warpgroup_grid(bm, bn, groups)
        if memory_side and groups < MAX_WARPS // 4:
            wider = _warpgroup_grid(bm, bn, 2 * groups)
            grid = wider if _fits_registers(bm, bn, wider, target) else grid
        return grid
    # 64x32 warp tiles: 64 f32 accumulators a thread. 64x64 ones (128) left too few registers for
    # the fragments of the TF32 kernels: ptxas spilled up to 2 KiB on GPT-2's LM-head backward
    grid = (max(1, bm // 64), max(1, bn // 32))
    while grid[0] * grid[1] < 4:
        grid = _split_warp_tile(bm, bn, grid)
    if memory_side:
        more = _split_warp_tile(bm, bn, grid)
        if bm // more[0] >= 16 and bn // more[1] >= 16 and _fits_registers(bm, bn, more, target):
            grid = more
    return grid


def _split_warp_tile(bm: int, bn: int, grid: tuple[int, int]) -> tuple[int, int]:
    """Twice the warps, halving the longer side of the warp tile (m on ties)."""
    wm, wn = grid
    return (wm * 2, wn) if bm // wm >= bn // wn else (wm, wn * 2)


def _warpgroup_grid(bm: int, bn: int, groups: int) -> tuple[int, int]:
    """Warpgroups along m while each keeps at least wgmma's 64 rows, the rest along n; in warps."""
    groups_m = min(groups, bm // 64)
    groups_n = groups // groups_m
    return 4 * groups_m, groups_n


def _fits_registers(bm: int, bn: int, warps: tuple[int, int], target: Target) -> bool:
    threads = 32 * warps[0] * warps[1]
    per_thread = bm * bn // threads + _REGS_OVERHEAD  # FP32 accumulators + overhead
    if bn // warps[1] < 8 or warps[0] * warps[1] > MAX_WARPS or threads > target.max_threads_per_block:
        return False
    return per_thread <= 255 and per_thread * threads <= target.regs_per_block


def _pipeline(problem: ContractionProblem, bm: int, bn: int, wm: int, wn: int, mma: str,
              target: Target) -> TileConfig:
    """The config with block_k a 128-byte row of K and the deepest of `STAGES` that fits the per-block
    opt-in shared memory; block_k halves (down to the MMA's k) only when even 2 stages do not fit."""
    block_k = 128 // problem.operand_bytes
    min_k = 8 if "tf32" in mma else 16
    while block_k >= min_k:
        swizzle = _swizzle(problem, bm, bn, block_k)
        for stages in STAGES:
            config = TileConfig(bm, bn, block_k, wm, wn, stages, mma, swizzle)
            if config.smem_bytes <= target.smem_per_block_optin:
                return config
        block_k //= 2
    raise ValueError(f"a {bm}x{bn} tile does not fit {target.name}'s {target.smem_per_block_optin} bytes of "
                     f"shared memory per block even with {STAGES[-1]} stages of k={min_k}")


def _swizzle(problem: ContractionProblem, bm: int, bn: int, bk: int) -> int:
    """Widest XOR swizzle (128/64/32 bytes) dividing both smem tiles' contiguous row width."""
    elem = problem.operand_bytes
    a_row = (bk if problem.a_layout == "row" else bm) * elem
    b_row = (bn if problem.b_layout == "row" else bk) * elem
    return next(s for s in SWIZZLES if a_row % s == 0 and b_row % s == 0)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Fused attention schedule: query rows per block, key/value rows per loop step, warps, MMA."""

    head_dim: int
    block_q: int
    block_kv: int
    warps: int
    mma: str
    smem_bytes: int  # Q tile + K and V tiles, staged in shared memory

    def __str__(self) -> str:
        return (f"attention block_q={self.block_q} block_kv={self.block_kv} head_dim={self.head_dim} "
                f"warps={self.warps} mma={self.mma} smem={self.smem_bytes}")


ATTENTION_BLOCK_Q = 64  # 4 warps x 16 query rows of an m16 mma.sync
ATTENTION_KV_SEEDS = (128, 64, 32)
_DRIVER_RESERVE_PER_BLOCK = 1 * KiB  # shared memory the CUDA driver keeps per resident block (sm_80+)


def attention_tiles(head_dim: int, dtype: str, target: Target) -> AttentionConfig:
    """Largest key tile from `ATTENTION_KV_SEEDS` whose footprint (block_q + 2 * block_kv) * d * elem
    leaves room for two resident blocks per SM; failing that, one that fits a block's opt-in limit."""
    if dtype not in OPERAND_BYTES or head_dim < 16 or head_dim % 16:
        raise ValueError(f"attention_tiles: need head_dim a multiple of 16 and dtype in {list(OPERAND_BYTES)}, "
                         f"got head_dim={head_dim}, dtype={dtype!r}")
    elem = OPERAND_BYTES[dtype]
    mma = _mma_sync_form(_mma_kind(dtype, target))  # S and P stay in mma.sync registers
    two_per_sm = target.smem_per_sm // 2 - _DRIVER_RESERVE_PER_BLOCK
    for budget in (min(two_per_sm, target.smem_per_block_optin), target.smem_per_block_optin):
        for block_kv in ATTENTION_KV_SEEDS:
            smem = (ATTENTION_BLOCK_Q + 2 * block_kv) * head_dim * elem
            if smem <= budget:
                return AttentionConfig(head_dim, ATTENTION_BLOCK_Q, block_kv, ATTENTION_BLOCK_Q // 16, mma, smem)
    raise ValueError(f"attention with head_dim={head_dim} in {dtype} does not fit {target.name}'s "
                     f"{target.smem_per_block_optin} bytes of shared memory per block")
