"""Compile options of `jnova.compile`: checked once, frozen, part of the cache key."""
from __future__ import annotations

from dataclasses import dataclass, fields

BACKENDS = (None, "cpu", "gpu")
FALLBACKS = ("xla", "error")
MIXED_PRECISION = (None, "bf16")
KERNELS = ("auto", "fused", "segments")


@dataclass(frozen=True)
class Options:
    mixed_precision: str | None = None
    backend: str | None = None
    fallback: str = "xla"
    bucket_bytes: int = 25 * 2**20
    target: str | None = None
    kernels: str = "auto"  # "fused": one kernel per fusion group (the GPU plan); "segments": runs between fallbacks

    def __post_init__(self):
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision must be one of {MIXED_PRECISION}, got {self.mixed_precision!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int, got {self.bucket_bytes!r}")

    def hash_items(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
