"""The MMA instruction of a contraction: from the operand dtype and the target's features.

wgmma (sm_90a) where the target has it, mma.sync (sm_80+) otherwise; float32 operands run on TF32
tensor cores, and an f32-accurate ("highest") f32 contraction on `mma_sync_tf32x3_16x8x8`: each operand
word splits in registers into a TF32 value and a TF32 remainder, three mma.sync products
(codegen/gpu/split_tf32.py); wgmma reads its operands from shared memory, so it has no such step. A block tile whose m is not a multiple of wgmma's 64 rows takes the mma.sync form of the
same operand type (`tile_schedule`), as does attention, whose S and P stay in mma.sync registers.
"""
from __future__ import annotations

from jnova.runtime.target import Target


def mma_kind(operand_dtype: str, target: Target, precision: str = "default") -> str:
    """The MMA kind (`tile_config.MMA_KINDS`) for operands of `operand_dtype` at `precision` on `target`."""
    if not target.has("mma_sync"):
        raise ValueError(f"target {target.name} ({target.arch}) has no mma.sync tensor cores; jnova needs sm_80+")
    if operand_dtype == "float32" and precision == "highest":
        return "mma_sync_tf32x3_16x8x8"
    if operand_dtype == "float32":
        return "wgmma_tf32_m64nNk8" if target.has("wgmma") else "mma_sync_tf32_16x8x8"
    short = "bf16" if operand_dtype == "bfloat16" else "f16"
    if short == "bf16" and not target.has("bf16_mma"):
        raise ValueError(f"target {target.name} ({target.arch}) has no bf16 tensor-core MMA")
    return f"wgmma_{short}_m64nNk16" if target.has("wgmma") else f"mma_sync_{short}_16x8x16"


def mma_sync_form(kind: str) -> str:
    """The mma.sync instruction for the same operand type (unchanged if `kind` already is one)."""
    return kind.replace("wgmma", "mma_sync").replace("_m64nNk16", "_16x8x16").replace("_m64nNk8", "_16x8x8")
