"""Target: presets, lookup errors, balance-point maths, hashing, and device queries (with a fake driver)."""

import dataclasses
import enum
import sys
import types

import pytest

from jnova.runtime.target import FEATURES, KiB, MiB, PRESETS, Target, get_target


def test_presets_have_the_published_h200_numbers():
    t = PRESETS["h200"]
    assert t.compute_capability == (9, 0) and t.arch == "sm_90a"
    assert t.sm_count == 132
    assert t.smem_per_sm == 228 * KiB and t.smem_per_block_optin == 227 * KiB and t.smem_per_block == 48 * KiB
    assert t.l2_bytes == 60 * MiB  # read from an H200's driver (H100 SXM: 50 MiB)
    assert t.dram_bytes_per_s == 4.8e12
    assert t.peak_tensor_flops("bfloat16") == pytest.approx(989e12, rel=0.01)
    assert t.peak_tensor_flops("tf32") == pytest.approx(494e12, rel=0.01)
    assert t.features == FEATURES


@pytest.mark.parametrize("name, arch, wgmma", [("h200", "sm_90a", True), ("h100", "sm_90a", True),
                                               ("rtx6000ada", "sm_89", False), ("rtx3060", "sm_86", False)])
def test_presets_arch_and_features(name, arch, wgmma):
    t = PRESETS[name]
    assert t.name == name and t.arch == arch
    assert t.has("wgmma") == wgmma == t.has("tma") == t.has("setmaxnreg")
    assert t.has("mma_sync") and t.has("ldmatrix") and t.has("cp_async") and t.has("bf16_mma")
    # on every preset 16-bit tensor cores run at twice the TF32 rate
    assert t.peak_tensor_flops("bfloat16") == 2 * t.peak_tensor_flops("tf32") == t.peak_tensor_flops("float16")
    assert t.smem_per_block_optin <= t.smem_per_sm and t.regs_per_block <= t.regs_per_sm


def test_arch_string_follows_compute_capability():
    h200 = PRESETS["h200"]
    assert dataclasses.replace(h200, compute_capability=(8, 0)).arch == "sm_80"
    assert dataclasses.replace(h200, compute_capability=(8, 9)).arch == "sm_89"


def test_get_target_by_name_is_case_insensitive():
    assert get_target("H200") is PRESETS["h200"]
    assert get_target("RTX6000Ada") is PRESETS["rtx6000ada"]


def test_get_target_passes_a_target_through():
    custom = dataclasses.replace(PRESETS["h100"], name="mine")
    assert get_target(custom) is custom


def test_get_target_unknown_name_lists_presets():
    with pytest.raises(ValueError, match="unknown target 'a100'.*h100, h200, rtx3060, rtx6000ada"):
        get_target("a100")
    with pytest.raises(TypeError):
        get_target(90)


def test_balance_point_is_peak_over_bandwidth():
    h200 = PRESETS["h200"]
    assert h200.balance_point("bfloat16") == pytest.approx(989.4e12 / 4.8e12)
    assert h200.balance_point("float32") == h200.balance_point("tf32") == pytest.approx(494.7e12 / 4.8e12)
    # same tensor cores, less bandwidth: the H100 needs a higher intensity to be compute-bound
    assert PRESETS["h100"].balance_point("bfloat16") > h200.balance_point("bfloat16")
    with pytest.raises(ValueError, match="no tensor-core rate for 'int8'"):
        h200.balance_point("int8")


def test_unknown_feature_is_an_error():
    with pytest.raises(ValueError, match="unknown feature 'wgmma2'"):
        PRESETS["h200"].has("wgmma2")
    with pytest.raises(ValueError, match="unknown features"):
        dataclasses.replace(PRESETS["h200"], features={"warp_magic"})


def test_targets_are_frozen_and_hashable():
    h200 = PRESETS["h200"]
    assert {h200: 1}[dataclasses.replace(h200)] == 1
    assert hash(h200) == hash(dataclasses.replace(h200))
    assert h200 != dataclasses.replace(h200, smem_per_block_optin=99 * KiB)
    assert len(set(PRESETS.values())) == len(PRESETS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        h200.sm_count = 1


def test_tensor_flops_accepts_a_dict_and_stores_sorted_pairs():
    t = dataclasses.replace(PRESETS["h200"], tensor_flops={"tf32": 1.0, "bfloat16": 2.0})
    assert t.tensor_flops == (("bfloat16", 2.0), ("tf32", 1.0))
    hash(t)


def test_str_is_short():
    text = str(PRESETS["h200"])
    assert text.startswith("h200 (sm_90a, 132 SMs") and "\n" not in text and len(text) < 100


def test_from_device_without_a_gpu_says_so_and_suggests_a_preset():
    try:
        Target.from_device()
    except RuntimeError as e:
        assert 'target="h200"' in str(e)
    else:
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match='target="h200"'):
        get_target(None)


# --- device queries against a fake cuda.bindings.driver --------------------------------------------

H200_ATTRIBUTES = {
    "COMPUTE_CAPABILITY_MAJOR": 9, "COMPUTE_CAPABILITY_MINOR": 0, "MULTIPROCESSOR_COUNT": 132,
    "MAX_THREADS_PER_BLOCK": 1024, "MAX_THREADS_PER_MULTIPROCESSOR": 2048, "MAX_SHARED_MEMORY_PER_BLOCK": 48 * KiB,
    "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 227 * KiB, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 228 * KiB,
    "RESERVED_SHARED_MEMORY_PER_BLOCK": 1 * KiB,
    "MAX_REGISTERS_PER_MULTIPROCESSOR": 65536, "MAX_REGISTERS_PER_BLOCK": 65536, "L2_CACHE_SIZE": 60 * MiB,
    "MEMORY_CLOCK_RATE": 3_201_000, "GLOBAL_MEMORY_BUS_WIDTH": 6144, "CLOCK_RATE": 1_980_000,
}


def fake_driver(attributes, init_error="CUDA_SUCCESS"):
    CUresult = enum.Enum("CUresult", ["CUDA_SUCCESS", "CUDA_ERROR_NO_DEVICE"])
    CUdevice_attribute = enum.Enum("CUdevice_attribute", ["CU_DEVICE_ATTRIBUTE_" + a for a in attributes])
    ok = CUresult.CUDA_SUCCESS
    driver = types.SimpleNamespace(
        CUresult=CUresult, CUdevice_attribute=CUdevice_attribute,
        cuInit=lambda flags: (CUresult[init_error],),
        cuDeviceGet=lambda ordinal: (ok, ordinal),
        cuDeviceGetName=lambda length, device: (ok, b"NVIDIA Fake GPU\0\0\0"),
        cuDeviceGetAttribute=lambda a, device: (ok, attributes[a.name.removeprefix("CU_DEVICE_ATTRIBUTE_")]),
    )
    return types.SimpleNamespace(driver=driver)


def test_from_device_reads_the_driver_and_takes_peaks_from_the_matching_preset(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", fake_driver(H200_ATTRIBUTES))
    t = Target.from_device()
    assert t.name == "NVIDIA Fake GPU" and t.arch == "sm_90a" and t.sm_count == 132
    assert t.smem_per_block_optin == 227 * KiB and t.l2_bytes == 60 * MiB and t.smem_reserved_per_block == 1 * KiB
    assert t.max_threads_per_sm == PRESETS["h200"].max_threads_per_sm == 2048
    assert t.dram_bytes_per_s == pytest.approx(3.201e9 * 768 * 2)  # clock x bus bytes x 2 (DDR)
    assert t.tensor_flops == PRESETS["h200"].tensor_flops
    assert t.features == PRESETS["h200"].features


def test_from_device_estimates_peaks_without_a_matching_preset(monkeypatch):
    attributes = dict(H200_ATTRIBUTES, MULTIPROCESSOR_COUNT=114, CLOCK_RATE=1_755_000)  # an H100 PCIe
    monkeypatch.setitem(sys.modules, "cuda.bindings", fake_driver(attributes))
    t = Target.from_device()
    assert t.peak_tensor_flops("bfloat16") == pytest.approx(114 * 1.755e9 * 4096)
    assert t.peak_tensor_flops("tf32") == pytest.approx(114 * 1.755e9 * 2048)
    assert t.fp32_flops == pytest.approx(114 * 1.755e9 * 2 * 128)


def test_from_device_driver_errors_are_clear(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", fake_driver(H200_ATTRIBUTES, "CUDA_ERROR_NO_DEVICE"))
    with pytest.raises(RuntimeError, match='CUDA_ERROR_NO_DEVICE.*target="h200"'):
        Target.from_device()
    old = dict(H200_ATTRIBUTES, COMPUTE_CAPABILITY_MAJOR=7, COMPUTE_CAPABILITY_MINOR=5)
    monkeypatch.setitem(sys.modules, "cuda.bindings", fake_driver(old))
    with pytest.raises(RuntimeError, match="compute capability 7.5; jnova needs 8.0"):
        Target.from_device()


def test_from_device_without_cuda_python(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # makes the import fail
    with pytest.raises(RuntimeError, match='cuda-python is not installed.*target="h200"'):
        Target.from_device()


@pytest.mark.gpu
def test_from_device_on_a_gpu():
    t = Target.from_device()
    assert t.compute_capability >= (8, 0) and t.sm_count > 0 and t.has("mma_sync")
    assert t.smem_per_block <= t.smem_per_block_optin <= t.smem_per_sm
    assert 1e11 < t.dram_bytes_per_s < 1e14 and t.balance_point("bfloat16") > 10
    if "H200" in t.name:  # the preset's limits are the ones an H200's driver reports
        h200 = PRESETS["h200"]
        assert (t.sm_count, t.smem_per_block_optin, t.smem_per_sm, t.l2_bytes) == (
            h200.sm_count, h200.smem_per_block_optin, h200.smem_per_sm, h200.l2_bytes)
        assert t.tensor_flops == h200.tensor_flops
