"""The hardware description every scheduling decision reads: one frozen, hashable `Target`.

A target comes from a named preset (to compile ahead of time, no GPU needed) or from the CUDA driver
(`Target.from_device`). Hardware facts live here and nowhere else: passes ask `target.has("wgmma")`
or `target.balance_point("bfloat16")` instead of branching on compute capability.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

KiB = 1024
MiB = 1024 * KiB

FEATURES = frozenset({"mma_sync", "ldmatrix", "cp_async", "wgmma", "tma", "setmaxnreg", "bf16_mma"})
TENSOR_DTYPES = ("tf32", "bfloat16", "float16")
# Operand dtype names accepted by `peak_tensor_flops`: float32 contractions run on TF32 tensor cores.
_TENSOR_DTYPE_ALIASES = {"float32": "tf32", "bf16": "bfloat16", "f16": "float16"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """One GPU: limits in bytes, bandwidth in bytes/s, throughput in FLOP/s (dense, FP32 accumulate)."""

    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    max_threads_per_block: int = 1024
    max_threads_per_sm: int = 2048  # resident threads per SM (1536 on sm_86 and sm_89)
    smem_per_block: int = 48 * KiB  # without opt-in
    smem_per_block_optin: int
    smem_per_sm: int
    # Shared memory the driver keeps for itself in every resident block (CUDA's "reserved shared memory
    # per block", 1 KiB from sm_80 on): a block using S bytes takes S + this much of its SM's smem_per_sm.
    smem_reserved_per_block: int = 1 * KiB
    regs_per_sm: int = 64 * 1024
    regs_per_block: int = 64 * 1024
    l2_bytes: int
    dram_bytes_per_s: float
    # Peak tensor-core FLOP/s per operand dtype; a dict is accepted and stored as sorted pairs.
    tensor_flops: tuple[tuple[str, float], ...]
    fp32_flops: float  # peak FP32 FMA throughput (CUDA cores, not tensor cores)
    features: frozenset[str]
    # Whether kernels compiled for this target may take TMA descriptors (tensor maps): only jnova's
    # launcher builds them, so the pipeline sets this from `launcher.tensor_maps_available()`.
    tensor_maps: bool = True

    def __post_init__(self):
        pairs = self.tensor_flops.items() if isinstance(self.tensor_flops, Mapping) else self.tensor_flops
        object.__setattr__(self, "tensor_flops", tuple(sorted((str(k), float(v)) for k, v in pairs)))
        object.__setattr__(self, "features", frozenset(self.features))
        object.__setattr__(self, "compute_capability", tuple(self.compute_capability))
        unknown = sorted(self.features - FEATURES)
        if unknown:
            raise ValueError(f"target {self.name}: unknown features {unknown}; known: {sorted(FEATURES)}")
        bad = sorted(k for k, _ in self.tensor_flops if k not in TENSOR_DTYPES)
        if bad:
            raise ValueError(f"target {self.name}: unknown tensor dtypes {bad}; known: {TENSOR_DTYPES}")

    @property
    def arch(self) -> str:
        """The PTX target: `sm_90a` on compute capability 9.0 (wgmma, setmaxnreg), else `sm_XY`."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")

    def has(self, feature: str) -> bool:
        if feature not in FEATURES:
            raise ValueError(f"unknown feature {feature!r}; known: {sorted(FEATURES)}")
        return feature in self.features

    def peak_tensor_flops(self, dtype: str) -> float:
        """Peak dense tensor-core FLOP/s for operands of `dtype` ("float32" means TF32)."""
        key = _TENSOR_DTYPE_ALIASES.get(dtype, dtype)
        for name, flops in self.tensor_flops:
            if name == key:
                return flops
        raise ValueError(f"target {self.name} has no tensor-core rate for {dtype!r}; "
                         f"it has {[name for name, _ in self.tensor_flops]}")

    def blocks_per_sm_by_smem(self, smem_bytes: int) -> int:
        """Blocks of `smem_bytes` dynamic shared memory one SM holds at once, the driver's reserve counted."""
        return self.smem_per_sm // (smem_bytes + self.smem_reserved_per_block)

    def balance_point(self, dtype: str) -> float:
        """Machine balance in FLOP/byte: peak tensor FLOP/s for `dtype` over DRAM bytes/s."""
        return self.peak_tensor_flops(dtype) / self.dram_bytes_per_s

    @property
    def cache_key(self) -> str:
        """Every fact of the target, in a fixed order: what the compile caches key a step's target by,
        so steps compiled for targets that differ in anything a decision reads never share an entry."""
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            parts.append(f"{f.name}={sorted(value) if isinstance(value, frozenset) else value}")
        return " ".join(parts)

    def __str__(self) -> str:
        return (f"{self.name} ({self.arch}, {self.sm_count} SMs, {self.smem_per_block_optin // KiB} KiB smem/block, "
                f"{self.l2_bytes / MiB:g} MiB L2, {self.dram_bytes_per_s / 1e12:.3g} TB/s)")

    @classmethod
    def from_device(cls, ordinal: int = 0) -> Target:
        """Query CUDA device `ordinal` through the driver API (cuda-python)."""
        return _query_device(ordinal)


def _features_for(cc: tuple[int, int]) -> frozenset[str]:
    """Features jnova's kernels use, by compute capability (PTX ISA: mma.sync m16n8k16/k8 bf16/tf32,
    cp.async and ldmatrix from sm_80; wgmma and setmaxnreg need sm_90a; TMA from sm_90)."""
    features = set()
    if cc >= (8, 0):
        features |= {"mma_sync", "ldmatrix", "cp_async", "bf16_mma"}
    if cc >= (9, 0):
        features.add("tma")
    if cc == (9, 0):
        features |= {"wgmma", "setmaxnreg"}
    return frozenset(features)


def _tensor_rates(bf16_flops: float) -> dict[str, float]:
    """On sm_80 to sm_90 dense TF32 runs at half the 16-bit rate, fp16 at the bf16 rate."""
    return {"tf32": bf16_flops / 2, "bfloat16": bf16_flops, "float16": bf16_flops}


# Dense numbers are half of the "with sparsity" numbers the datasheets print. Shared memory and register
# limits: CUDA C++ Programming Guide, "Technical Specifications per Compute Capability".
PRESETS: dict[str, Target] = {
    # NVIDIA H200 datasheet (SXM): 141 GB HBM3e at 4.8 TB/s; BF16/FP16 1979 TFLOPS sparse, TF32 989
    # sparse, FP32 67 TFLOPS; 132 SMs. L2: 60 MiB, as the driver reports it on an H200 (CU_DEVICE_ATTRIBUTE_
    # L2_CACHE_SIZE = 62914560, driver 580), so that ahead-of-time and on-device configs agree.
    "h200": Target(
        name="h200", compute_capability=(9, 0), sm_count=132,
        smem_per_block_optin=227 * KiB, smem_per_sm=228 * KiB, l2_bytes=60 * MiB,
        dram_bytes_per_s=4.8e12, tensor_flops=_tensor_rates(989.4e12), fp32_flops=66.9e12,
        features=_features_for((9, 0)),
    ),
    # NVIDIA H100 datasheet / Hopper whitepaper (SXM5): 80 GB HBM3 at 3.35 TB/s; BF16/FP16 989.4 TFLOPS
    # dense (at 1830 MHz), TF32 494.7, FP32 66.9; 132 SMs, 50 MiB L2.
    "h100": Target(
        name="h100", compute_capability=(9, 0), sm_count=132,
        smem_per_block_optin=227 * KiB, smem_per_sm=228 * KiB, l2_bytes=50 * MiB,
        dram_bytes_per_s=3.35e12, tensor_flops=_tensor_rates(989.4e12), fp32_flops=66.9e12,
        features=_features_for((9, 0)),
    ),
    # Ada Lovelace whitepaper / RTX 6000 Ada datasheet: 142 SMs, 96 MiB L2, 48 GB GDDR6 at 20 Gbps on
    # 384 bits = 960 GB/s; FP16/BF16 tensor with FP32 accumulate 364.2 TFLOPS dense, TF32 182.1, FP32 91.1.
    "rtx6000ada": Target(
        name="rtx6000ada", compute_capability=(8, 9), sm_count=142,
        smem_per_block_optin=99 * KiB, smem_per_sm=100 * KiB, l2_bytes=96 * MiB,
        dram_bytes_per_s=960e9, tensor_flops=_tensor_rates(364.2e12), fp32_flops=91.1e12,
        features=_features_for((8, 9)), max_threads_per_sm=1536,
    ),
    # GeForce RTX 3060 (12 GB, GA106): 28 SMs at 1777 MHz boost, 3 MiB L2, GDDR6 at 15 Gbps on 192 bits
    # = 360 GB/s. Ampere GA102 whitepaper: a GeForce SM does 512 dense FP16/BF16 FLOP/clk with FP32
    # accumulate, so 28 * 512 * 1.777e9 = 25.5 TFLOPS; TF32 half that; FP32 3584 lanes * 2 * 1.777e9.
    "rtx3060": Target(
        name="rtx3060", compute_capability=(8, 6), sm_count=28,
        smem_per_block_optin=99 * KiB, smem_per_sm=100 * KiB, l2_bytes=3 * MiB,
        dram_bytes_per_s=360e9, tensor_flops=_tensor_rates(25.5e12), fp32_flops=12.7e12,
        features=_features_for((8, 6)), max_threads_per_sm=1536,
    ),
}


def get_target(spec: str | Target | None = None) -> Target:
    """None: the current CUDA device; a preset name (any case); or a Target, returned as is."""
    if spec is None:
        return Target.from_device()
    if isinstance(spec, Target):
        return spec
    if isinstance(spec, str):
        try:
            return PRESETS[spec.lower()]
        except KeyError:
            raise ValueError(f"unknown target {spec!r}; presets: {', '.join(sorted(PRESETS))}") from None
    raise TypeError(f"target must be None, a preset name or a Target, got {type(spec).__name__}")


# Used only when no preset matches a queried device. Dense 16-bit tensor FLOP per clock per SM with FP32
# accumulate (A100: 312e12 / (108 SMs * 1.41 GHz) = 2048; H100 SXM: 989.4e12 / (132 * 1.83 GHz) = 4096;
# professional sm_86/sm_89 boards 1024, GeForce boards half that) and FP32 lanes per SM.
_MMA_FLOP_PER_CLOCK_PER_SM = {(8, 0): 2048, (8, 6): 1024, (8, 7): 1024, (8, 9): 1024, (9, 0): 4096}
_FP32_LANES_PER_SM = {(8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128, (9, 0): 128}


def _estimate_rates(cc: tuple[int, int], sm_count: int, clock_hz: float) -> tuple[dict[str, float], float]:
    """Peak (tensor rates, FP32 FLOP/s) = SM count x clock x per-SM rate of the newest known cc <= `cc`."""
    known = max(k for k in _MMA_FLOP_PER_CLOCK_PER_SM if k <= cc)
    bf16 = sm_count * clock_hz * _MMA_FLOP_PER_CLOCK_PER_SM[known]
    return _tensor_rates(bf16), sm_count * clock_hz * 2 * _FP32_LANES_PER_SM[known]


def _no_device(reason: str) -> RuntimeError:
    return RuntimeError(f"cannot read the GPU's description: {reason}. To compile ahead of time without a "
                        f"GPU, name a target, e.g. target=\"h200\" (presets: {', '.join(sorted(PRESETS))}).")


def _query_device(ordinal: int) -> Target:
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise _no_device(f"cuda-python is not installed ({e})") from e

    def check(result):
        err, *values = result
        if err != driver.CUresult.CUDA_SUCCESS:
            raise _no_device(f"the CUDA driver returned {err.name} for device {ordinal}")
        return values[0] if values else None

    try:
        init_result = driver.cuInit(0)
    except Exception as e:  # the driver library itself is missing; the exception type varies by version
        raise _no_device(f"no CUDA driver ({e})") from e
    check(init_result)
    device = check(driver.cuDeviceGet(ordinal))
    attr = driver.CUdevice_attribute

    def get(name: str) -> int:
        return check(driver.cuDeviceGetAttribute(getattr(attr, "CU_DEVICE_ATTRIBUTE_" + name), device))

    cc = (get("COMPUTE_CAPABILITY_MAJOR"), get("COMPUTE_CAPABILITY_MINOR"))
    if cc < (8, 0):
        raise _no_device(f"device {ordinal} has compute capability {cc[0]}.{cc[1]}; jnova needs 8.0 or newer")
    sm_count = get("MULTIPROCESSOR_COUNT")
    name = check(driver.cuDeviceGetName(256, device)).split(b"\0", 1)[0].decode()
    preset = next((p for p in PRESETS.values() if (p.compute_capability, p.sm_count) == (cc, sm_count)), None)
    if preset is not None:
        tensor_flops, fp32_flops = dict(preset.tensor_flops), preset.fp32_flops
    else:
        tensor_flops, fp32_flops = _estimate_rates(cc, sm_count, get("CLOCK_RATE") * 1e3)
    return Target(
        name=name, compute_capability=cc, sm_count=sm_count,
        max_threads_per_block=get("MAX_THREADS_PER_BLOCK"),
        max_threads_per_sm=get("MAX_THREADS_PER_MULTIPROCESSOR"),
        smem_per_block=get("MAX_SHARED_MEMORY_PER_BLOCK"),
        smem_per_block_optin=get("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
        smem_per_sm=get("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"),
        smem_reserved_per_block=get("RESERVED_SHARED_MEMORY_PER_BLOCK"),
        regs_per_sm=get("MAX_REGISTERS_PER_MULTIPROCESSOR"),
        regs_per_block=get("MAX_REGISTERS_PER_BLOCK"),
        l2_bytes=get("L2_CACHE_SIZE"),
        # memory clock (kHz) x bus width (bytes) x 2 transfers per clock (DDR)
        dram_bytes_per_s=get("MEMORY_CLOCK_RATE") * 1e3 * get("GLOBAL_MEMORY_BUS_WIDTH") / 8 * 2,
        tensor_flops=tensor_flops, fp32_flops=fp32_flops, features=_features_for(cc),
    )
