"""Contraction kernels without a GPU: `build_matmul` -> PTX, assembled by ptxas for sm_90a with no
spills (registers printed), and the instructions each main loop is meant to use checked in the PTX:
wgmma + cp.async for bf16 and TF32 on sm_90a (MN-major TF32 operands transposed by 4-byte copies),
mma.sync m16n8k8 TF32 + ldmatrix (never .trans: 32-bit data) for f32 before sm_90.
Numerics are checked on the GPU (tests/gpu/test_gpu_matmul.py)."""
import re

import pytest

from jnova.codegen.gpu.matmul import (
    GpuKernel,
    MatmulEpilogue,
    build_matmul,
    matmul_module,
    persistent_blocks,
)
from jnova.codegen.gpu.matmul_epilogue import staging_bytes
from jnova.codegen.gpu.ptx import assemble_check, ptxas_path
from jnova.errors import LoweringError
from jnova.passes.configure.problem import ContractionProblem
from jnova.passes.configure.tile_config import TileConfig
from jnova.passes.configure.tile_schedule import choose_tiles
from jnova.runtime.target import get_target

H200 = get_target("h200")
requires_ptxas = pytest.mark.skipif(ptxas_path() is None, reason="ptxas is not on PATH")

# (M, N, K, batch, a_layout, b_layout, epilogue): GPT-2 forward and backward shapes, awkward edges
SHAPES = [
    (16384, 3072, 768, 1, "row", "row", None),  # MLP up
    (16384, 768, 3072, 1, "row", "col", None),  # dX = dY @ W^T
    (3072, 768, 16384, 1, "col", "row", None),  # dW = X^T @ dY
    (4096, 768, 3072, 1, "row", "row", MatmulEpilogue(bias="float32", residual="float32")),
    (1000, 77, 33, 1, "row", "row", None),
    (1000, 77, 33, 2, "col", "col", MatmulEpilogue(bias="bfloat16", residual="bfloat16")),
]


def _params(dtype):
    return [pytest.param(dtype, *shape, id=f"{dtype}-{shape[3]}x{shape[0]}x{shape[1]}x{shape[2]}-{shape[4][0]}{shape[5][0]}"
                         + ("-epilogue" if shape[6] else "")) for shape in SHAPES]


def _build(dtype, m, n, k, batch, a_layout, b_layout, epilogue) -> tuple[GpuKernel, TileConfig]:
    problem = ContractionProblem(m, n, k, batch=batch, operand_dtype=dtype, a_layout=a_layout, b_layout=b_layout)
    config = choose_tiles(problem, H200)
    return build_matmul(problem, config, H200, epilogue), config


def _entry_params(ptx: str) -> int:
    """Pointer parameters and by-value tensor maps of the kernel's entry."""
    return len(re.findall(r"\.param \.u64 \.ptr", ptx)) + len(re.findall(r"\.param \.align 64 \.b8 \w+\[128\]", ptx))


@requires_ptxas
@pytest.mark.parametrize("dtype,m,n,k,batch,a_layout,b_layout,epilogue", _params("float32") + _params("bfloat16"))
def test_matmul_ptx_assembles_without_spills(dtype, m, n, k, batch, a_layout, b_layout, epilogue):
    kernel, config = _build(dtype, m, n, k, batch, a_layout, b_layout, epilogue)
    report = assemble_check(kernel.ptx, H200.arch)
    print(f"{kernel.name}: {config}: {report}")
    assert report.spills == 0 and report.stack_frame == 0, report.log
    assert "Potential Performance Loss" not in report.log, report.log  # e.g. serialized wgmma
    assert kernel.shared_mem_bytes <= H200.smem_per_block_optin
    assert _entry_params(kernel.ptx) == len(kernel.params) + len(kernel.tensor_maps)
    assert kernel.params[-1] == ("out", "c") and all(role == "in" for role, _ in kernel.params[:-1])
    assert kernel.block[0] % 32 == 0
    if config.pingpong:  # the warp-specialized kernel: TMA copies complete mbarrier transactions; blocks walk the batch's tiles
        assert "cp.async.bulk.tensor" in kernel.ptx and len(kernel.tensor_maps) >= 2
    else:
        assert kernel.grid[2] == batch and "cp.async" in kernel.ptx and not kernel.tensor_maps
        assert "fence.proxy.async" in kernel.ptx  # cp.async writes, then wgmma reads through the async proxy
    if dtype == "bfloat16":
        assert "wgmma.mma_async.sync.aligned.m64n" in kernel.ptx and ".bf16.bf16" in kernel.ptx
    else:  # TF32 wgmma reads both operands K-major: an MN-major one is transposed by 4-byte copies
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k8\.f32\.tf32\.tf32", kernel.ptx)
        transposed = a_layout == "col" or b_layout == "row"
        assert bool(re.search(r"cp\.async\.ca\.shared\.global \[[^]]+\], \[[^]]+\], 4", kernel.ptx)) == transposed


MMA_SYNC_TARGET = get_target("rtx6000ada")  # sm_89: TF32 contractions through mma.sync


@requires_ptxas
@pytest.mark.parametrize("dtype,m,n,k,batch,a_layout,b_layout,epilogue", _params("float32"))
def test_tf32_mma_sync_ptx_assembles_without_spills(dtype, m, n, k, batch, a_layout, b_layout, epilogue):
    """Before sm_90 the f32 main loop is mma.sync m16n8k8 with operands rounded to TF32 in registers,
    ldmatrix for K-major tiles and never ldmatrix.trans (32-bit data, report Table 1)."""
    problem = ContractionProblem(m, n, k, batch=batch, a_layout=a_layout, b_layout=b_layout)
    config = choose_tiles(problem, MMA_SYNC_TARGET)
    kernel = build_matmul(problem, config, MMA_SYNC_TARGET, epilogue)
    report = assemble_check(kernel.ptx, MMA_SYNC_TARGET.arch)
    print(f"{kernel.name}: {config}: {report}")
    assert report.spills == 0 and report.stack_frame == 0, report.log
    assert config.mma == "mma_sync_tf32_16x8x8" and "cp.async" in kernel.ptx
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in kernel.ptx
    assert "cvt.rna.tf32.f32" in kernel.ptx
    assert "ldmatrix" not in kernel.ptx or ".trans" not in kernel.ptx
    k_major_operand = a_layout == "row" or b_layout == "col"
    assert ("ldmatrix.sync.aligned.m8n8" in kernel.ptx) == k_major_operand


def test_parameters_follow_the_epilogue():
    problem = ContractionProblem(128, 128, 64, operand_dtype="bfloat16")
    config = TileConfig.parse("block=128x128x64 warps=4x1 stages=3 mma=wgmma_bf16_m64nNk16 swizzle=128")
    module = matmul_module(problem, config, H200, MatmulEpilogue(residual="float32"))
    signature = module.text[module.text.index("gpu.func"):module.text.index(") kernel")]
    assert re.findall(r"(%\w+): memref", signature) == ["%a", "%b", "%residual", "%c"]
    assert module.block == (128, 1, 1)  # one warpgroup: two m64 repeats of 4 k16 steps per k-tile
    assert module.text.count("nvvm.wgmma.mma_async") == 2 * 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pipeline_groups_are_counted_when_k_is_short(dtype):
    """K = 33 is fewer k-tiles than the pipeline runs ahead: the prologue still commits one cp.async
    group per stage it runs ahead (empty ones past the end), since each wait counts groups; and no
    copy is left in flight when the block exits (the next block would find it in its shared memory)."""
    problem = ContractionProblem(1000, 128, 33, operand_dtype=dtype)
    config = choose_tiles(problem, H200)
    text = matmul_module(problem, config, H200).text
    prologue, loop = text.split("scf.for %kt", 1)
    ahead = config.stages - 1 - (1 if config.is_wgmma else 0)
    assert prologue.count("nvvm.cp.async.commit.group") == ahead
    assert loop.split("scf.yield")[-1].count("nvvm.cp.async.wait.group 0") == 1


def test_unaligned_bf16_rows_are_copied_through_registers():
    """K = 33, N = 77 in bf16: rows of 66 and 154 bytes fit no cp.async size; copies go through registers."""
    problem = ContractionProblem(64, 77, 33, operand_dtype="bfloat16")
    module = matmul_module(problem, choose_tiles(problem, H200), H200)
    assert "nvgpu.device_async_copy" not in module.text and "memref.store" in module.text


def test_refusals_name_the_reason():
    problem = ContractionProblem(256, 256, 256, operand_dtype="bfloat16")
    ada = get_target("rtx6000ada")
    with pytest.raises(LoweringError, match="16-bit mma.sync"):
        matmul_module(problem, choose_tiles(problem, ada), ada)
    f32 = ContractionProblem(256, 256, 256)
    with pytest.raises(LoweringError, match="wgmma_bf16_m64nNk16 does not take float32 operands"):
        matmul_module(f32, choose_tiles(problem, H200), H200)
    with pytest.raises(LoweringError, match="wgmma_tf32_m64nNk8 does not take bfloat16 operands"):
        matmul_module(problem, choose_tiles(f32, H200), H200)
    with pytest.raises(LoweringError, match="needs wgmma"):
        matmul_module(f32, choose_tiles(f32, H200), ada)
    with pytest.raises(LoweringError, match="split_k"):
        matmul_module(f32, TileConfig.parse("block=64x64x32 warps=2x2 stages=3 mma=mma_sync_tf32_16x8x8 "
                                            "swizzle=128 split_k=2"), H200)


def test_tf32_kernel_for_an_ampere_target():
    """The f32 main loop needs no Hopper feature: it assembles for sm_86 too."""
    target = get_target("rtx3060")
    problem = ContractionProblem(1000, 77, 33)
    kernel = build_matmul(problem, choose_tiles(problem, target), target)
    assert ".target sm_86" in kernel.ptx
    if ptxas_path():
        assert assemble_check(kernel.ptx, target.arch).spills == 0


BF16_128 = "block=128x128x64 warps={} stages={} mma=wgmma_bf16_m64nNk16 swizzle=128"


def test_persistent_form_where_it_keeps_the_blocks_per_sm():
    """bf16 128x128 tiles of 4 stages (one block per SM either way) walk tiles with the staging buffer
    beside the ring; 3 stages (two blocks per SM without it), TF32, and fewer than two waves of tiles
    keep a block per tile."""
    big = ContractionProblem(16384, 3072, 768, operand_dtype="bfloat16")
    config = TileConfig.parse(BF16_128.format("8x1", 4))
    assert persistent_blocks(big, config, H200) == 1
    module = matmul_module(big, config, H200)
    assert module.schedule.endswith("persistent store=async") and module.grid == (H200.sm_count, 1, 1)
    assert module.shared_mem_bytes == 4 * 32 * 1024 + staging_bytes(config)
    # the staging buffer starts after the ring, and its copies are waited for before it is written again
    loop = module.text.split("scf.for %tile", 1)[1]
    assert f"arith.constant {4 * 32 * 1024} : index" in module.text
    assert loop.count("nvvm.cp.async.bulk.wait_group 0 {read}") == 2  # before the writes; at the end
    assert persistent_blocks(big, TileConfig.parse(BF16_128.format("4x1", 3)), H200) == 0
    tf32 = TileConfig.parse("block=128x128x32 warps=8x1 stages=4 mma=wgmma_tf32_m64nNk8 swizzle=128")
    assert persistent_blocks(ContractionProblem(16384, 3072, 768), tf32, H200) == 0
    small = ContractionProblem(1024, 1024, 768, operand_dtype="bfloat16")  # 64 tiles
    assert persistent_blocks(small, config, H200) == 0
    assert "persistent" not in matmul_module(small, config, H200).schedule
    assert matmul_module(small, config, H200, persistent=True).schedule.endswith("persistent store=async")
    assert "store=bulk" in matmul_module(big, config, H200, persistent=False).schedule


def test_persistent_form_is_refused_where_the_staging_buffer_does_not_fit():
    problem = ContractionProblem(16384, 3072, 768, operand_dtype="bfloat16")
    config = TileConfig.parse("block=256x128x64 warps=8x1 stages=4 mma=wgmma_bf16_m64nNk16 swizzle=128")
    assert persistent_blocks(problem, config, H200) == 0
    with pytest.raises(LoweringError, match="no persistent form"):
        matmul_module(problem, config, H200, persistent=True)


@requires_ptxas
def test_persistent_kernel_assembles_without_spills():
    problem = ContractionProblem(1000, 1000, 72, batch=3, operand_dtype="bfloat16")
    kernel = build_matmul(problem, TileConfig.parse(BF16_128.format("8x1", 4)), H200,
                          MatmulEpilogue(bias="float32", residual="float32"), persistent=True)
    report = assemble_check(kernel.ptx, "sm_90a")
    print(kernel.schedule, report)
    assert "persistent" in kernel.schedule and report.spill_stores == report.spill_loads == 0


PINGPONG = "block={} warps=4x1 stages={} mma=wgmma_bf16_m64nNk16 swizzle=128 pingpong"


@requires_ptxas
@pytest.mark.parametrize("m, n, k, batch, a_layout, b_layout, epilogue", [
    (16384, 3072, 768, 1, "row", "row", None),
    (16384, 768, 3072, 1, "row", "col", MatmulEpilogue(bias="float32", residual="float32")),
    (3072, 768, 8192, 1, "col", "row", None),
    (1000, 200, 72, 3, "col", "col", PINGPONG.format("128x128x64", 5)),  # masked edges, batches (an override)
])
def test_warp_specialized_kernel_takes_tensor_maps_and_assembles_without_spills(m, n, k, batch, a_layout, b_layout,
                                                                                epilogue):
    """The configurator's ping-pong kernel: one producer thread issues TMA copies through two by-value
    descriptors that follow the buffers; consumers change their register budget (setmaxnreg) and
    run wgmma without the serialization ptxas falls back to under a branch it cannot prove uniform."""
    problem = ContractionProblem(m, n, k, batch=batch, operand_dtype="bfloat16", a_layout=a_layout, b_layout=b_layout)
    if isinstance(epilogue, str):
        config, epilogue = TileConfig.parse(epilogue), MatmulEpilogue(bias="bfloat16", residual="float32")
    else:
        config = choose_tiles(problem, H200)
    assert config.pingpong, config
    kernel = build_matmul(problem, config, H200, epilogue)
    buffers = len(kernel.params)
    assert [(t.buffer, t.param) for t in kernel.tensor_maps[:2]] == [(0, buffers), (1, buffers + 1)]
    maps = 2 + (epilogue is None)  # C leaves by TMA stores unless the epilogue adds a residual
    assert [(t.buffer, t.param) for t in kernel.tensor_maps[2:]] == [(buffers - 1, buffers + 2)] * (maps - 2)
    assert kernel.ptx.count(".param .align 64 .b8") == maps and kernel.ptx.count("cvta.param.u64") == maps
    assert "cp.async.bulk.tensor" in kernel.ptx and "mbarrier.arrive.expect_tx" in kernel.ptx
    assert re.search(r"setmaxnreg.dec.sync.aligned.u32\s+40;", kernel.ptx)
    assert re.search(r"setmaxnreg.inc.sync.aligned.u32\s+232;", kernel.ptx)
    assert kernel.block == (384, 1, 1) and kernel.grid[0] <= H200.sm_count
    report = assemble_check(kernel.ptx, "sm_90a")
    assert report.spill_stores == report.spill_loads == 0


TO_BF16 = MatmulEpilogue(steps=("to:bfloat16",))
FLAX_DENSE = MatmulEpilogue(bias="bfloat16", steps=("to:bfloat16", "to:float32", "bias", "to:bfloat16"))


@requires_ptxas
@pytest.mark.parametrize("m, n, k, batch, a_layout, b_layout, epilogue, config", [
    (8192, 3072, 768, 1, "row", "col", TO_BF16, None),  # GPT-2's backward contractions, as chosen
    (3072, 768, 8192, 1, "col", "row", TO_BF16, None),
    (1000, 1000, 72, 3, "row", "row", TO_BF16, PINGPONG.format("128x192x64", 4)),  # edges, batches
    (1000, 200, 72, 1, "col", "col", MatmulEpilogue(steps=("to:bfloat16", "to:float32")), PINGPONG.format("128x128x64", 3)),
    (1024, 1024, 128, 1, "row", "row", TO_BF16, PINGPONG.format("128x192x64", 4)),  # 2 k-tiles: spilled once
    (8192, 3072, 768, 1, "row", "row", FLAX_DENSE, None),  # Flax's bf16 Dense: bias added in shared-memory stores
    (1000, 1000, 72, 3, "row", "row", FLAX_DENSE, PINGPONG.format("128x192x64", 4)),  # clamped bias loads
])
def test_a_converting_epilogue_leaves_by_tma_stores_in_the_dtype_it_stores(m, n, k, batch, a_layout, b_layout,
                                                                          epilogue, config):
    """C rounded to bf16 (bias added or not) leaves as 64-column boxes through shared memory and TMA
    stores, as f32 C does in 32-column ones: no store to global memory from registers, no spills."""
    problem = ContractionProblem(m, n, k, batch=batch, operand_dtype="bfloat16", a_layout=a_layout, b_layout=b_layout)
    config = TileConfig.parse(config) if config else choose_tiles(problem, H200)
    assert config.pingpong, config
    kernel = build_matmul(problem, config, H200, epilogue)
    assert "store=tma" in kernel.schedule and len(kernel.tensor_maps) == 3, kernel.schedule
    c = kernel.tensor_maps[2]
    elem = 2 if epilogue.out == "bfloat16" else 4
    assert (c.dtype, c.dims[:2], c.strides[0], c.box[:2]) == (epilogue.out, (n, m), n * elem, (128 // elem, config.block_m))
    assert not re.search(r"\bst\.global", kernel.ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.[23]d\.global\.shared", kernel.ptx)
    if elem == 2:
        assert kernel.ptx.count("cvt.rn.bf16x2.f32") == config.block_n * config.block_m // 256
    report = assemble_check(kernel.ptx, "sm_90a")
    assert report.spill_stores == report.spill_loads == 0 and report.stack_frame == 0, report.log


def test_residual_epilogues_and_unaligned_rows_store_from_registers():
    from jnova.codegen.gpu import matmul_tma

    aligned, unaligned = ContractionProblem(1000, 1000, 72), ContractionProblem(1000, 1004, 72)
    assert matmul_tma.stores_by_tma(aligned, TO_BF16) and matmul_tma.stores_by_tma(unaligned, MatmulEpilogue())
    assert not matmul_tma.stores_by_tma(unaligned, TO_BF16)  # 2008-byte rows: not whole 16-byte units
    assert matmul_tma.stores_by_tma(aligned, MatmulEpilogue(bias="bfloat16", steps=("bias", "to:bfloat16")))
    assert not matmul_tma.stores_by_tma(aligned, MatmulEpilogue(residual="float32"))
    assert not matmul_tma.stores_by_tma(aligned, MatmulEpilogue(bias="float32", residual="float32"))


@requires_ptxas
@pytest.mark.parametrize("m, n, k, batch, epilogue, config", [
    (16384, 768, 3072, 1, MatmulEpilogue(bias="float32", residual="float32"), None),  # as choose_warp_specialized chooses
    (1000, 200, 72, 3, None, "block=192x128x32 warps=4x1 stages=4 mma=wgmma_tf32_m64nNk8 swizzle=128 pingpong"),
])
def test_warp_specialized_tf32_kernel_reads_k_major_panels_of_32_elements(m, n, k, batch, epilogue, config):
    """TF32 operands, both K-major: a k-tile is one 128-byte panel of 32 elements, each operand one TMA
    box of 32 x the tile's rows, and the consumers run TF32 wgmma (k = 8) without spills."""
    from jnova.codegen.gpu import matmul_tma

    problem = ContractionProblem(m, n, k, batch=batch, a_layout="row", b_layout="col")
    config = TileConfig.parse(config) if config else choose_tiles(problem, H200)
    assert config.pingpong and config.block_k == 32, config
    a, b = matmul_tma.tensor_maps(problem, config, 3)
    assert (a.dtype, a.dims[:2], a.strides[0], a.box[:2]) == ("float32", (k, m), k * 4, (32, config.block_m))
    assert (b.dtype, b.dims[:2], b.strides[0], b.box[:2]) == ("float32", (k, n), k * 4, (32, config.block_n))
    if batch > 1:
        assert (a.strides[1], b.strides[1]) == (m * k * 4, n * k * 4)
    kernel = build_matmul(problem, config, H200, epilogue)
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k8\.f32\.tf32\.tf32", kernel.ptx)
    assert kernel.ptx.count("cp.async.bulk.tensor") >= 2 and "cp.async.ca" not in kernel.ptx
    report = assemble_check(kernel.ptx, "sm_90a")
    assert report.spill_stores == report.spill_loads == 0 and "Potential Performance Loss" not in report.log


@pytest.mark.parametrize("a_layout, b_layout, batch", [("row", "row", 1), ("col", "col", 3), ("col", "row", 2)])
def test_tensor_maps_describe_the_operands_as_the_tiles_lie_in_shared_memory(a_layout, b_layout, batch):
    """A K-major operand's box is its whole k-tile (64 elements of K by the tile's rows); an MN-major
    one's is one 128-byte panel (64 elements of M or N by 64 of K), copied once per panel; the batch is
    the outer dimension."""
    from jnova.codegen.gpu import matmul_tma

    problem = ContractionProblem(1000, 200, 72, batch=batch, operand_dtype="bfloat16", a_layout=a_layout,
                                 b_layout=b_layout)
    config = TileConfig.parse(PINGPONG.format("128x192x64", 4))
    a, b = matmul_tma.tensor_maps(problem, config, 3)
    outer = lambda dims, stride: (dims + (batch,), (stride,)) if batch > 1 else (dims, ())
    want_a = ((72, 1000), (64, 128)) if a_layout == "row" else ((1000, 72), (64, 64))
    want_b = ((72, 200), (64, 192)) if b_layout == "col" else ((200, 72), (64, 64))
    for got, (dims, box), param in ((a, want_a, 3), (b, want_b, 4)):
        extra_dims, extra_strides = outer((), 1000 * 72 * 2 if got.buffer == 0 else 72 * 200 * 2)
        assert got.param == param and got.dims == dims + extra_dims and got.box == box + ((1,) if batch > 1 else ())
        assert got.strides == (dims[0] * 2,) + extra_strides and got.swizzle == 128 and got.dtype == "bfloat16"
    c = matmul_tma.c_tensor_map(problem, config, 2, 5)  # C: 32 f32 columns (128 bytes) by the tile's rows
    assert (c.buffer, c.param, c.dtype, c.box[:2], c.swizzle) == (2, 5, "float32", (32, 128), 128)
    assert (c.dims, c.strides) == (((200, 1000, 3), (800, 800000)) if batch == 3 else
                                   ((200, 1000, 2), (800, 800000)) if batch == 2 else ((200, 1000), (800,)))
    module = matmul_module(problem, config, H200)
    assert module.schedule.endswith("pingpong store=tma") and len(module.tensor_maps) == 3
    panels = {"row": 1, "col": 2}  # copies per k-tile: the 128-row A tile is two 64-column panels M-major
    copies = panels[a_layout] + (1 if b_layout == "col" else 3)
    assert module.text.count("nvvm.cp.async.bulk.tensor.shared.cluster.global") == copies


def test_warp_specialized_kernel_refusals_name_the_reason():
    config = TileConfig.parse(PINGPONG.format("128x128x64", 4))
    odd = ContractionProblem(1000, 77, 64, operand_dtype="bfloat16")
    with pytest.raises(LoweringError, match="rows of B of 77 elements"):
        matmul_module(odd, config, H200)
    with pytest.raises(LoweringError, match="a consumer is one warpgroup"):
        matmul_module(ContractionProblem(1024, 1024, 64, operand_dtype="bfloat16"),
                      TileConfig.parse("block=128x128x64 warps=8x1 stages=4 mma=wgmma_bf16_m64nNk16 swizzle=128 "
                                       "pingpong"), H200)
    with pytest.raises(LoweringError, match="256 accumulators a consumer thread"):
        matmul_module(ContractionProblem(1024, 1024, 64, operand_dtype="bfloat16"),
                      TileConfig.parse(PINGPONG.format("128x256x64", 3)), H200)
    with pytest.raises(LoweringError, match="TF32 operands that are not both K-major"):
        matmul_module(ContractionProblem(1024, 1024, 64), TileConfig.parse(
            "block=128x128x32 warps=4x1 stages=4 mma=wgmma_tf32_m64nNk8 swizzle=128 pingpong"), H200)
    with pytest.raises(LoweringError, match="needs wgmma"):
        matmul_module(ContractionProblem(1024, 1024, 64, operand_dtype="bfloat16"), config, get_target("rtx6000ada"))
