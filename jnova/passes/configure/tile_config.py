"""The configurator's result: `TileConfig`, a contraction schedule (block tile, warp grid, pipeline
depth, MMA instruction, shared-memory swizzle, and whether it is the warp-specialized kernel's).

It prints as one line that `TileConfig.parse` reads back, so a printed config is an override.
"""
from __future__ import annotations

import dataclasses
import re

# N in a wgmma kind is the warpgroup's n extent, block_n // warps_n, fixed at code generation.
MMA_KINDS = ("mma_sync_tf32_16x8x8", "mma_sync_bf16_16x8x16", "mma_sync_f16_16x8x16",
             "wgmma_tf32_m64nNk8", "wgmma_bf16_m64nNk16", "wgmma_f16_m64nNk16",
             "mma_sync_tf32x3_16x8x8")  # f32-accurate: three TF32 products of split operands
SWIZZLES = (128, 64, 32)
MBARRIER_BYTES_PER_STAGE = 16  # full + empty mbarrier of a TMA/wgmma pipeline stage


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
        return tiles + (MBARRIER_BYTES_PER_STAGE if self.is_wgmma else 0)

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
