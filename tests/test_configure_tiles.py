"""The Analytic Configurator: the report's nine matmul shapes, each decision in turn, print/parse round trip."""

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jnova.passes.configure.problem import ContractionProblem
from jnova.passes.configure.tile_config import MMA_KINDS, TileConfig
from jnova.passes.configure.tile_schedule import choose_tiles, explain
from jnova.passes.configure.warp_specialized import PINGPONG_TILE_EFFICIENCY, pingpong_refusal
from jnova.runtime.target import KiB, PRESETS

H200, RTX3060, ADA = PRESETS["h200"], PRESETS["rtx3060"], PRESETS["rtx6000ada"]
H200_MMA_SYNC = dataclasses.replace(H200, features=H200.features - {"wgmma"})  # the fill model, not wgmma's
H200_WITHOUT_TENSOR_MAPS = dataclasses.replace(H200, tensor_maps=False)  # jaxlib's kernel call: no TMA descriptors
# Table 2 of the Nova report: three squares and six GPT-2 contractions (M x N x K)
REPORT_SHAPES = [(512, 512, 512), (1024, 1024, 1024), (5120, 5120, 5120),
                 (16384, 3072, 768), (16384, 768, 3072), (16384, 50304, 768),
                 (16384, 768, 50304), (4096, 768, 50304), (4096, 768, 3072)]
DTYPES = ["float32", "bfloat16"]


def tiles_of(problem, cfg):
    return problem.batch * math.ceil(problem.m / cfg.block_m) * math.ceil(problem.n / cfg.block_n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", REPORT_SHAPES)
def test_report_shapes_fit_smem_and_fill_the_sms(m, n, k, dtype):
    problem = ContractionProblem(m, n, k, operand_dtype=dtype)
    cfg = choose_tiles(problem, H200)
    assert cfg.smem_bytes <= H200.smem_per_block_optin
    assert 32 * cfg.num_warps <= H200.max_threads_per_block
    assert cfg.split_k == 1
    # mma.sync: large enough for 64x64 tiles to fill the SMs -> at least one full wave
    mma_sync = choose_tiles(problem, H200_MMA_SYNC)
    if tiles_of(problem, TileConfig(64, 64, 32, 2, 2, 2, MMA_KINDS[0], 128)) >= H200.sm_count:
        assert tiles_of(problem, mma_sync) >= H200.sm_count


@pytest.mark.parametrize("m, n, k", REPORT_SHAPES)
def test_wgmma_weighs_a_partial_wave_of_large_tiles(m, n, k):
    """wgmma: the chosen tiling is the fastest by waves x tile area / rung efficiency, so it never
    takes more waves of a smaller tile than the time model allows."""
    from jnova.passes.configure.tile_schedule import decide
    from jnova.passes.configure.tile_shape import tile_family, wgmma_time

    for dtype in DTYPES:
        for layouts in (("row", "row"), ("col", "row")):
            problem = ContractionProblem(m, n, k, operand_dtype=dtype, a_layout=layouts[0], b_layout=layouts[1])
            d = decide(problem, H200)
            family = tile_family(problem, d.config.mma)
            assert d.config.is_wgmma
            assert all(wgmma_time(d.chosen, family) <= wgmma_time(c, family) for c in d.tried)


def test_wgmma_tiles_measured_on_the_h200():
    """Decisions the efficiency table encodes (H200 measurements): 4096x768x3072 TF32 in one partial
    wave of 256x128 (162 TFLOP/s against 122 for three waves of 128x64); the GPT-2 weight gradient
    768x3072 (K = 8192) on a top-rung tile, not in five waves of 64x64 (49 TFLOP/s in a profile)."""
    cfg = choose_tiles(ContractionProblem(4096, 768, 3072), H200)
    assert (cfg.block_m, cfg.block_n) == (256, 128)
    cfg = choose_tiles(ContractionProblem(768, 3072, 8192, a_layout="col"), H200)
    assert cfg.block_m * cfg.block_n == 256 * 128


@pytest.mark.parametrize("m, n, k", REPORT_SHAPES)
def test_bf16_tiles_at_least_as_large_as_f32(m, n, k):
    f32 = choose_tiles(ContractionProblem(m, n, k), H200_MMA_SYNC)
    bf16 = choose_tiles(ContractionProblem(m, n, k, operand_dtype="bfloat16"), H200_MMA_SYNC)
    assert bf16.block_m * bf16.block_n >= f32.block_m * f32.block_n
    assert bf16.block_k * 2 == f32.block_k * 4  # both a 128-byte row of K


@pytest.mark.parametrize("m, n, k", REPORT_SHAPES)
def test_mma_kind_follows_dtype_and_target(m, n, k):
    assert choose_tiles(ContractionProblem(m, n, k), H200).mma == "wgmma_tf32_m64nNk8"
    assert choose_tiles(ContractionProblem(m, n, k, operand_dtype="bfloat16"), H200).mma == "wgmma_bf16_m64nNk16"
    assert choose_tiles(ContractionProblem(m, n, k, operand_dtype="float16"), H200).mma == "wgmma_f16_m64nNk16"
    assert choose_tiles(ContractionProblem(m, n, k, operand_dtype="bfloat16"), RTX3060).mma == "mma_sync_bf16_16x8x16"
    assert choose_tiles(ContractionProblem(m, n, k), RTX3060).mma == "mma_sync_tf32_16x8x8"


def test_wgmma_warps_come_in_warpgroups():
    for m, n, k in REPORT_SHAPES:
        cfg = choose_tiles(ContractionProblem(m, n, k, operand_dtype="bfloat16"), H200)
        assert cfg.warps_m % 4 == 0 and cfg.block_m % 64 == 0


def test_tile_family_grows_with_arithmetic_intensity():
    small = choose_tiles(ContractionProblem(512, 512, 512), H200)
    large = choose_tiles(ContractionProblem(5120, 5120, 5120, operand_dtype="bfloat16"), H200_WITHOUT_TENSOR_MAPS)
    assert (small.block_m, small.block_n) == (64, 64)
    assert (large.block_m, large.block_n) == (256, 128)


def test_mma_sync_tiles_stop_at_128x128():
    """jnova's TF32 mma.sync kernel spills with a 256-wide tile's accumulators (ptxas, measured):
    the top rung is capped at 128x128 over 8 warps of 64x32. TF32 wgmma takes the whole rung."""
    cfg = choose_tiles(ContractionProblem(5120, 5120, 5120), ADA)
    assert "rung 3" in explain(ContractionProblem(5120, 5120, 5120), ADA)
    assert (cfg.block_m, cfg.block_n, cfg.warps_m, cfg.warps_n) == (128, 128, 2, 4)
    hopper = choose_tiles(ContractionProblem(5120, 5120, 5120), H200)
    assert (hopper.block_m * hopper.block_n, hopper.mma) == (256 * 128, "wgmma_tf32_m64nNk8")


def test_tf32_wgmma_tiles_take_two_warpgroups():
    """MN-major TF32 operands are copied 4 bytes at a time: a 128-row tile gets two warpgroups."""
    cfg = choose_tiles(ContractionProblem(4096, 4096, 256), H200)
    assert (cfg.block_m, cfg.warps_m, cfg.warps_n) == (128, 8, 1)


def test_wgmma_goes_one_rung_up():
    """TF32 wgmma takes the 16-bit types' rung: 256x128 where mma.sync stops at 128x128."""
    for m, n, k in [(16384, 3072, 768), (16384, 768, 3072), (16384, 50304, 768)]:
        cfg = choose_tiles(ContractionProblem(m, n, k), H200)
        assert cfg.block_m * cfg.block_n == 256 * 128 and cfg.mma == "wgmma_tf32_m64nNk8"


def test_report_example_4096_cube_on_rtx6000ada():
    """Section 4.4: 4096^3 TF32 on the RTX 6000 Ada is compute-bound and classified into the largest
    tile family (the report's kernel uses 256x128 over 4x2 warps; jnova's TF32 kernel caps at 128x128,
    see test_mma_sync_tiles_stop_at_128x128)."""
    assert "rung 3" in explain(ContractionProblem(4096, 4096, 4096), ADA)
    cfg = choose_tiles(ContractionProblem(4096, 4096, 4096), ADA)
    assert (cfg.block_m, cfg.block_n, cfg.warps_m, cfg.warps_n) == (128, 128, 2, 4)
    assert cfg.mma == "mma_sync_tf32_16x8x8"
    assert cfg.smem_bytes <= ADA.smem_per_block_optin


def test_small_problems_trade_tile_size_for_sm_fill():
    # 1024x768 makes 24 tiles of 256x128 on 132 SMs (18% busy), 96 of 128x64 (one wave, 73% busy)
    cfg = choose_tiles(ContractionProblem(1024, 768, 3072, operand_dtype="bfloat16"), H200)
    assert cfg.block_m * cfg.block_n == 128 * 64
    assert tiles_of(ContractionProblem(1024, 768, 3072), cfg) == 96


def test_a_partial_wave_of_large_bf16_tiles_beats_waves_of_small_ones():
    # 4096x768: 96 tiles of 256x128 (one wave, 73% busy) against 384 of 128x64 (three waves): the
    # large tiles ran 1.3-1.5x faster on the H200 (bf16 128x64 tiles at 0.49-0.58 of 256x128's rate)
    cfg = choose_tiles(ContractionProblem(4096, 768, 3072, operand_dtype="bfloat16"), H200_WITHOUT_TENSOR_MAPS)
    assert cfg.block_m * cfg.block_n == 256 * 128


GPT2_BF16 = [(16384, 3072, 768, "row", "row"), (16384, 768, 3072, "row", "col"), (16384, 50304, 768, "row", "row"),
             (16384, 768, 50304, "row", "col"), (4096, 768, 50304, "row", "row"), (4096, 768, 3072, "row", "row"),
             (3072, 768, 8192, "col", "row")]


@pytest.mark.parametrize("m, n, k, a_layout, b_layout", GPT2_BF16)
def test_gpt2_bf16_contractions_take_the_warp_specialized_kernel(m, n, k, a_layout, b_layout):
    """The warp-specialized kernel: on the H200 the TMA-fed ping-pong kernel's 128x192 consumer tiles ran every GPT-2 bf16
    shape 1.08-1.31x faster than the tile-shape decision's choice (benchmarks/matmul.py --variants, 2026-12-01); without
    tensor maps (jaxlib's kernel call), the tile-shape decision stands. In TF32 it takes only K-major operands."""
    problem = ContractionProblem(m, n, k, operand_dtype="bfloat16", a_layout=a_layout, b_layout=b_layout)
    cfg = choose_tiles(problem, H200)
    assert cfg.pingpong and (cfg.warps_m, cfg.warps_n, cfg.block_k) == (4, 1, 64)
    assert (cfg.block_m, cfg.block_n) in PINGPONG_TILE_EFFICIENCY and cfg.smem_bytes <= H200.smem_per_block_optin
    assert not choose_tiles(problem, H200_WITHOUT_TENSOR_MAPS).pingpong
    tf32 = choose_tiles(dataclasses.replace(problem, operand_dtype="float32"), H200)
    assert tf32.pingpong == ((a_layout, b_layout) == ("row", "col")), tf32
    assert "ping-pong 128x192" in explain(problem, H200)


@pytest.mark.parametrize("m, n, k", [(16384, 3072, 768), (16384, 768, 3072), (16384, 50304, 768), (16384, 768, 50304),
                                     (4096, 768, 50304), (4096, 768, 3072)])
def test_gpt2_tf32_contractions_with_k_major_operands_take_the_warp_specialized_kernel(m, n, k):
    """The warp-specialized kernel in TF32: with both operands K-major (as the operand-transpose decision leaves them) 128x192 consumer tiles ran the
    six GPT-2 shapes 1.06-1.34x faster than the tile-shape decision's 256x128 tiles on the H200 (2026-12-01); a k-tile
    is one 128-byte panel, 32 elements. MN-major TF32 operands stay with the tile-shape decision (wgmma reads TF32
    K-major only, and the TMA copies land as they are)."""
    problem = ContractionProblem(m, n, k, a_layout="row", b_layout="col")
    cfg = choose_tiles(problem, H200)
    assert cfg.pingpong and (cfg.block_m, cfg.block_n, cfg.block_k) == (128, 192, 32), cfg
    assert cfg.mma == "wgmma_tf32_m64nNk8" and cfg.smem_bytes <= H200.smem_per_block_optin
    assert not choose_tiles(problem, H200_WITHOUT_TENSOR_MAPS).pingpong
    for layouts in (("row", "row"), ("col", "col"), ("col", "row")):
        other = dataclasses.replace(problem, a_layout=layouts[0], b_layout=layouts[1])
        assert not choose_tiles(other, H200).pingpong
        assert "not both K-major" in pingpong_refusal(other)


def test_the_warp_specialized_kernel_needs_tma_and_whole_16_byte_rows():
    big = dict(m=16384, n=3072, k=768, operand_dtype="bfloat16")
    assert choose_tiles(ContractionProblem(**big), H200).pingpong
    assert not choose_tiles(ContractionProblem(**big), PRESETS["rtx6000ada"]).pingpong  # sm_89: no wgmma
    assert not choose_tiles(ContractionProblem(**{**big, "k": 770}), H200).pingpong  # rows of A: 1540 B
    assert not choose_tiles(ContractionProblem(**{**big, "n": 3070}), H200).pingpong  # rows of B
    assert choose_tiles(ContractionProblem(**{**big, "n": 3070}, b_layout="col"), H200).pingpong  # B K-major
    split = ContractionProblem(768, 768, 1024, batch=8, operand_dtype="bfloat16", a_split_k=True)
    assert not choose_tiles(split, H200).pingpong


def test_few_large_tiles_keep_the_two_warpgroup_kernel():
    """1024x768 (K = 3072): 32 consumer tiles leave most SMs idle either way, and the tile-shape decision's 128x64
    tiles fill them (96 blocks)."""
    cfg = choose_tiles(ContractionProblem(1024, 768, 3072, operand_dtype="bfloat16"), H200)
    assert not cfg.pingpong and (cfg.block_m, cfg.block_n) == (128, 64)


def test_stages_fall_back_4_3_2_with_the_smem_limit():
    problem = ContractionProblem(16384, 3072, 768)  # 128x128x32 f32 mma.sync tiles: 32 KiB per stage
    stages = {}
    for limit_kib in (227, 100, 70, 40):
        cfg = choose_tiles(problem, dataclasses.replace(H200_MMA_SYNC, smem_per_block_optin=limit_kib * KiB))
        assert (cfg.block_m, cfg.block_n) == (128, 128)
        assert cfg.smem_bytes <= limit_kib * KiB
        stages[limit_kib] = (cfg.stages, cfg.block_k, cfg.swizzle)
    # 40 KiB fits no 2 stages of k=32: block_k halves (a 64-byte row, so a 64-byte swizzle)
    assert stages == {227: (4, 32, 128), 100: (3, 32, 128), 70: (2, 32, 128), 40: (2, 16, 64)}
    with pytest.raises(ValueError, match="does not fit"):
        choose_tiles(problem, dataclasses.replace(H200_MMA_SYNC, smem_per_block_optin=4 * KiB))


def test_memory_side_gets_more_warps_not_a_smaller_tile():
    problem = ContractionProblem(512, 512, 512)  # 85 FLOP/B against the H200's TF32 balance of 103
    memory_side = choose_tiles(problem, H200)
    fast_memory = dataclasses.replace(H200, dram_bytes_per_s=1e15)
    compute_side = choose_tiles(problem, fast_memory)
    assert (memory_side.block_m, memory_side.block_n) == (compute_side.block_m, compute_side.block_n)
    assert memory_side.num_warps == 2 * compute_side.num_warps


def test_panels_that_overflow_l2_count_once_per_pass():
    problem = ContractionProblem(16384, 768, 50304, operand_dtype="bfloat16")  # a 256-row A panel is 26 MB
    roomy = choose_tiles(problem, H200)
    cramped = choose_tiles(problem, dataclasses.replace(H200, l2_bytes=1 << 20))
    assert roomy.block_m * roomy.block_n == cramped.block_m * cramped.block_n  # never a smaller tile
    # (twice the warps would not fit the register file here: the warp count stays)
    assert cramped.num_warps >= roomy.num_warps
    assert "memory side" in explain(problem, dataclasses.replace(H200, l2_bytes=1 << 20))
    assert "compute side" in explain(problem, H200)


def test_swizzle_follows_the_contiguous_row_width():
    bf16_col = ContractionProblem(4096, 4096, 4096, operand_dtype="bfloat16", a_layout="col", b_layout="col")
    assert choose_tiles(bf16_col, H200).swizzle == 128
    tiny_limit = dataclasses.replace(H200, smem_per_block_optin=12 * KiB)  # forces block_k = 8 (32 bytes)
    cfg = choose_tiles(ContractionProblem(512, 512, 512), tiny_limit)
    assert (cfg.block_k, cfg.swizzle) == (8, 32)


def test_batch_counts_toward_the_waves():
    single = choose_tiles(ContractionProblem(1024, 1024, 1024), H200_MMA_SYNC)
    batched = choose_tiles(ContractionProblem(1024, 1024, 1024, batch=16), H200_MMA_SYNC)
    assert batched.block_m * batched.block_n > single.block_m * single.block_n


def test_targets_without_tensor_cores_are_refused():
    volta = dataclasses.replace(H200, compute_capability=(7, 0), features=frozenset())
    with pytest.raises(ValueError, match="no mma.sync"):
        choose_tiles(ContractionProblem(512, 512, 512), volta)


def test_decisions_are_deterministic_and_hashable():
    problems = [ContractionProblem(m, n, k, operand_dtype=d) for m, n, k in REPORT_SHAPES for d in DTYPES]
    first = [choose_tiles(p, H200) for p in problems]
    again = [choose_tiles(p, H200) for p in problems]
    assert first == again and [hash(c) for c in first] == [hash(c) for c in again]
    assert len({(p, H200): c for p, c in zip(problems, first)}) == len(problems)  # usable in a cache key


@pytest.mark.parametrize("target", [H200, RTX3060, ADA], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chosen_configs_round_trip_through_text(target, dtype):
    for m, n, k in REPORT_SHAPES:
        cfg = choose_tiles(ContractionProblem(m, n, k, operand_dtype=dtype), target)
        assert TileConfig.parse(str(cfg)) == cfg


def test_printed_form():
    cfg = TileConfig(128, 128, 32, 2, 2, 3, "mma_sync_tf32_16x8x8", 128)
    text = "block=128x128x32 warps=2x2 stages=3 mma=mma_sync_tf32_16x8x8 swizzle=128 split_k=1"
    assert str(cfg) == text and TileConfig.parse(text) == cfg
    assert TileConfig.parse(text.replace(" split_k=1", "")) == cfg
    assert TileConfig.parse(text.replace("split_k=1", "split_k=4")).split_k == 4
    pingpong = TileConfig(128, 192, 64, 4, 1, 4, "wgmma_bf16_m64nNk16", 128, pingpong=True)
    assert str(pingpong).endswith("split_k=1 pingpong") and TileConfig.parse(str(pingpong)) == pingpong


@st.composite
def tile_configs(draw):
    mma = draw(st.sampled_from(MMA_KINDS))
    warps_m = draw(st.sampled_from([4, 8] if mma.startswith("wgmma") else [1, 2, 4, 8]))
    warps_n = draw(st.sampled_from([1, 2, 4]))
    mma_k = 8 if "tf32" in mma else 16
    return TileConfig(
        block_m=16 * warps_m * draw(st.integers(1, 4)), block_n=8 * warps_n * draw(st.integers(1, 16)),
        block_k=mma_k * draw(st.integers(1, 8)), warps_m=warps_m, warps_n=warps_n,
        stages=draw(st.integers(1, 4)), mma=mma, swizzle=draw(st.sampled_from([128, 64, 32])),
        split_k=draw(st.integers(1, 8)), pingpong=draw(st.booleans()))


@given(tile_configs())
def test_any_valid_config_round_trips(cfg):
    assert TileConfig.parse(str(cfg)) == cfg
    assert hash(TileConfig.parse(str(cfg))) == hash(cfg)


@pytest.mark.parametrize("text, message", [
    ("block=128x128 warps=2x2 stages=3 mma=mma_sync_tf32_16x8x8 swizzle=128", "cannot parse"),
    ("block=128x128x32 warps=2x2 stages=3 mma=mma_magic swizzle=128", "mma='mma_magic'"),
    ("block=128x128x32 warps=2x2 stages=3 mma=mma_sync_tf32_16x8x8 swizzle=16", "swizzle=16"),
    ("block=100x128x32 warps=2x2 stages=3 mma=mma_sync_tf32_16x8x8 swizzle=128", "does not split"),
    ("block=128x128x12 warps=2x2 stages=3 mma=mma_sync_tf32_16x8x8 swizzle=128", "block_k=12"),
    ("block=128x128x64 warps=2x2 stages=3 mma=wgmma_bf16_m64nNk16 swizzle=128", "warpgroups"),
    ("block=128x128x64 warps=4x1 stages=3 mma=wgmma_bf16_m64nNk16 swizzle=128 pingpong2", "cannot parse"),
])
def test_bad_overrides_are_rejected(text, message):
    with pytest.raises(ValueError, match=message):
        TileConfig.parse(text)


def test_bad_problems_are_rejected():
    with pytest.raises(ValueError, match="ContractionProblem.k must be a positive int"):
        ContractionProblem(16, 16, 0)
    with pytest.raises(ValueError, match="operand_dtype='int8'"):
        ContractionProblem(16, 16, 16, operand_dtype="int8")
    with pytest.raises(ValueError, match="a_layout='diag'"):
        ContractionProblem(16, 16, 16, a_layout="diag")


def test_explain_gives_the_numbers_behind_the_decision():
    problem = ContractionProblem(4096, 768, 3072, operand_dtype="bfloat16")
    text = explain(problem, H200)
    assert f"AI {problem.arithmetic_intensity:.0f} FLOP/elem" in text
    assert f"balance {H200.balance_point('bfloat16'):.1f} FLOP/B" in text
    assert "waves=3" in text and "traffic=" in text and "B/stage" in text
    assert text.splitlines()[-1] == f"-> {choose_tiles(problem, H200)}"
