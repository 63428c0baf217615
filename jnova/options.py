"""Compile options of `jnova.compile`: checked once, frozen, part of the cache key (`hash_items`)."""
from __future__ import annotations

import os
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
    excess_precision: bool = True  # 16-bit values rounded and widened inside a kernel stay f32 (as XLA)

    def __post_init__(self):
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision must be one of {MIXED_PRECISION}, got {self.mixed_precision!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.target is not None and self.backend == "cpu":
            raise ValueError(f"target={self.target!r} names a GPU to compile for; it needs backend=None or "
                             "'gpu', not 'cpu'")
        if not isinstance(self.bucket_bytes, int) or isinstance(self.bucket_bytes, bool) or self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int, got {self.bucket_bytes!r}")
        if not isinstance(self.excess_precision, bool):
            raise TypeError(f"excess_precision must be a bool or None, got {self.excess_precision!r}")
        if not all(isinstance(k, str) and k.startswith("xla_") and isinstance(v, str) for k, v in self.xla_options):
            raise ValueError(f"xla_options must map XLA option names (xla_...) to values, got {dict(self.xla_options)!r}")

    @staticmethod
    def excess_precision_default(excess_precision: bool | None, xla_options: dict | None) -> bool:
        """`excess_precision` as given, else XLA's flag where the user set it (`xla_options`, then
        XLA_FLAGS' --xla_allow_excess_precision), else True (XLA's default)."""
        if excess_precision is not None:
            return excess_precision
        flag = (xla_options or {}).get("xla_allow_excess_precision")
        if flag is None:
            for item in os.environ.get("XLA_FLAGS", "").split():
                if item.startswith("--xla_allow_excess_precision"):
                    flag = item.partition("=")[2] or "true"
        if flag is None:
            return True
        return str(flag).lower() not in ("false", "0")

    @staticmethod
    def xla_pairs(xla_options: dict | None) -> tuple[tuple[str, str], ...]:
        """`jnova.compile`'s xla_options dict as the frozen form (values as strings jax.jit's
        compiler_options accept)."""
        if xla_options is None:
            return ()
        if not isinstance(xla_options, dict):
            raise TypeError(f"xla_options must be a dict, got {type(xla_options).__name__}")
        spell = str  # bools as "True" / "False": XLA's compile options reject "false"
        return tuple(sorted((k, spell(v)) for k, v in xla_options.items()))

    def hash_items(self) -> dict:
        """What the kernels depend on: every option but xla_options, which only reaches XLA's compile
        of the step around them (jax.jit's compiler_options; JAX's own cache keys include them)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "xla_options"}
