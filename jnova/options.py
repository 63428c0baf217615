"""Compile options of `jnova.compile`: checked once, frozen, part of the cache key (`hash_items`)."""
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
    xla_options: tuple[tuple[str, str], ...] = ()  # XLA's compile of the step around the kernels (sorted pairs)

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
        if not all(isinstance(k, str) and k.startswith("xla_") and isinstance(v, str) for k, v in self.xla_options):
            raise ValueError(f"xla_options must map XLA option names (xla_...) to values, got {dict(self.xla_options)!r}")

    @staticmethod
    def xla_pairs(xla_options: dict | None) -> tuple[tuple[str, str], ...]:
        """`jnova.compile`'s xla_options dict as the frozen form (values as XLA_FLAGS would spell them)."""
        if xla_options is None:
            return ()
        if not isinstance(xla_options, dict):
            raise TypeError(f"xla_options must be a dict, got {type(xla_options).__name__}")
        spell = lambda v: str(v).lower() if isinstance(v, bool) else str(v)
        return tuple(sorted((k, spell(v)) for k, v in xla_options.items()))

    def hash_items(self) -> dict:
        """What the kernels depend on: every option but xla_options, which only reaches XLA's compile
        of the step around them (jax.jit's compiler_options; JAX's own cache keys include them)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "xla_options"}
