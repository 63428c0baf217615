"""The warp interpreter's Hopper wgmma rules (tests/helpers/gpu_warp_interpreter.py), checked against
kernels proven on an H100/H200 and against float64 NumPy, without a GPU.

- Oracle: the cp.async wgmma contraction kernels of `matmul_wgmma.py` (GPU-tested in
  tests/gpu/test_gpu_matmul.py) run in the interpreter on small problems and match NumPy: bf16 with A
  and B K-major, B MN-major (B given as [K, N]), A MN-major (A given as [K, M]), both MN-major; f16;
  TF32 with both operands K-major in shared memory (MN-major globals transposed by the copies), against
  NumPy on operands truncated to TF32 as the hardware reads them. Tiles of one and two m64 repeats, one,
  two and several warpgroups over M and N, 2 to 4 stages with the ring wrapping, edge tiles, batches,
  the configurator's pick for a small problem.
- The hardware's 128-byte swizzle matters: with it dropped from the interpreter the kernels' results are
  wrong (both operand majors).
- The register-A bf16 wgmma that kernels write as `llvm.inline_asm` (MLIR's nvvm dialect lacks it): a
  hand-written one-warpgroup kernel (A packed from global memory into the fragment layout, B in shared
  memory through a descriptor, K-major and MN-major, with and without C) matches NumPy, and its text
  lowers to PTX that ptxas assembles for sm_90a.
- Faults: a wgmma under a branch that splits a warpgroup, descriptors that differ within a warpgroup, an
  operand past the end of shared memory, an unsupported swizzle mode, a register-A asm numbered
  otherwise, the address of a global memref.
"""
import dataclasses

import numpy as np
import pytest

import helpers.gpu_warp_interpreter as interpreter
from helpers.gpu_warp_interpreter import BF16, KernelFault, run_kernel
from helpers.kernels import requires_ptxas
from jnova.codegen.gpu.emitter import GpuEmitter
from jnova.codegen.gpu.matmul import matmul_module
from jnova.codegen.gpu.ptx import assemble_check, to_ptx
from jnova.passes.configure.problem import ContractionProblem
from jnova.passes.configure.tile_config import TileConfig
from jnova.passes.configure.tile_schedule import choose_tiles
from jnova.runtime.target import get_target

# jaxlib's kernel call passes plain pointers: the configurator keeps to the cp.async kernels
H200 = dataclasses.replace(get_target("h200"), tensor_maps=False)
NP = {"bfloat16": BF16, "float16": np.float16, "float32": np.float32}
SMEM = "#gpu.address_space<workgroup>"


def _tf32_truncated(x: np.ndarray) -> np.ndarray:
    """What wgmma reads of f32 words: the top 19 bits."""
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def _contraction(m, n, k, batch, dtype, a_layout, b_layout, config, seed=0):
    """(C as the interpreted wgmma kernel computes it, A [batch, m, k], B [batch, k, n], the schedule)."""
    problem = ContractionProblem(m, n, k, batch=batch, operand_dtype=dtype, a_layout=a_layout, b_layout=b_layout)
    config = TileConfig.parse(config) if config else choose_tiles(problem, H200)
    module = matmul_module(problem, config, H200)
    assert module.schedule.startswith("matmul[wgmma]") and "nvvm.wgmma.mma_async" in module.text, module.schedule
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((batch, m, k)).astype(NP[dtype])
    b = rng.standard_normal((batch, k, n)).astype(NP[dtype])
    c = np.full((batch, m, n), np.nan, np.float32)  # poisoned: every element must be stored
    buffers = {"a": a if a_layout == "row" else np.ascontiguousarray(a.transpose(0, 2, 1)),
               "b": b if b_layout == "row" else np.ascontiguousarray(b.transpose(0, 2, 1)), "c": c}
    run_kernel(module.text, module.grid, module.block, module.shared_mem_bytes, buffers)
    return c, a, b, module.schedule


def _product(a, b) -> np.ndarray:
    """A @ B in float64 of the operands as wgmma reads them (TF32: truncated)."""
    if a.dtype == np.float32:
        a, b = _tf32_truncated(a), _tf32_truncated(b)
    return a.astype(np.float64) @ b.astype(np.float64)


# (m, n, k, batch, dtype, a_layout, b_layout, config or None for the configurator's). N is never a
# multiple of 4 where a tile lies inside C: such tiles leave by bulk copies from shared memory
# (`cp.async.bulk`, C's global address), which the interpreter does not model.
CONTRACTIONS = [
    # A and B K-major; as chosen: 64x64 tiles, two warpgroups over N (m64n32 pieces), 4 k-tiles, 4 stages
    (128, 130, 256, 1, "bfloat16", "row", "col", None),
    # B MN-major; two warpgroups over M (m64n128 pieces), 4 stages
    (128, 130, 256, 1, "bfloat16", "row", "row", "block=128x128x64 warps=8x1 stages=4"),
    # A and B MN-major; two warpgroups over N (one 64-column B panel each), a batch of 2, 3 stages wrapping
    (64, 130, 256, 2, "bfloat16", "col", "row", "block=64x128x64 warps=4x2 stages=3"),
    # A MN-major, B K-major; one warpgroup of two m64 repeats (two A panels), 2 stages, K not whole k-tiles
    (130, 72, 200, 1, "bfloat16", "col", "col", "block=128x128x64 warps=4x1 stages=2"),
    (120, 64, 128, 1, "float16", "row", "row", "block=128x64x64 warps=4x1 stages=3"),
    # TF32, both K-major in shared memory; two m64 repeats, 5 k-tiles through 3 stages
    (128, 130, 160, 1, "float32", "row", "col", "block=128x128x32 warps=4x1 stages=3"),
    # TF32 with MN-major globals (transposed into K-major tiles by 4-byte copies); as chosen
    (100, 130, 96, 1, "float32", "col", "row", None),
    # schedules of the GPU tests: m64n256 pieces (bf16, TF32); 256-row tiles of two warpgroups with two
    # repeats each; TF32 over three warpgroups along N (12 warps)
    (256, 130, 192, 1, "bfloat16", "row", "row", "block=128x256x64 warps=4x2 stages=2"),
    (128, 254, 40, 1, "float32", "row", "row", "block=128x256x32 warps=4x2 stages=2"),
    (256, 130, 192, 1, "bfloat16", "col", "col", "block=256x128x64 warps=8x1 stages=3"),
    (100, 150, 70, 1, "float32", "col", "row", "block=64x96x32 warps=4x3 stages=3"),
]


def _config(case):
    *_, dtype, _, _, config = case
    if config is None:
        return None
    mma = {"bfloat16": "wgmma_bf16_m64nNk16", "float16": "wgmma_f16_m64nNk16", "float32": "wgmma_tf32_m64nNk8"}
    return f"{config} mma={mma[dtype]} swizzle=128"


@pytest.mark.parametrize("case", CONTRACTIONS, ids=lambda c: f"{c[4]}-{c[5]}{c[6]}-{c[3]}x{c[0]}x{c[1]}x{c[2]}-"
                         f"{c[7].split()[0] if c[7] else 'chosen'}")
def test_wgmma_contraction_kernels_match_numpy(case):
    m, n, k, batch, dtype, a_layout, b_layout, _ = case
    c, a, b, schedule = _contraction(m, n, k, batch, dtype, a_layout, b_layout, _config(case),
                                     seed=CONTRACTIONS.index(case))
    want = _product(a, b)
    assert not np.isnan(c).any(), schedule
    error = np.abs(c - want).max() / np.abs(want).max()
    print(f"{schedule}: max error {error:.1e} of max |C|")
    assert error < 1e-6, schedule  # f32 sums of exact products


def test_tf32_operands_are_read_truncated():
    """wgmma reads TF32 operands as the f32 words' top 19 bits (tests/gpu/test_gpu_matmul.py's
    TF32_TRUNCATED): the kernel's C is the product of truncated operands, far from that of the f32
    operands or of operands rounded to nearest (cvt.rna), so the references above tell them apart."""
    c, a, b, _ = _contraction(64, 62, 64, 1, "float32", "row", "col", None, seed=1)
    bits = a.view(np.uint32), b.view(np.uint32)
    rounded = [((((x & 0x7FFFFFFF) + 0x1000) & 0xFFFFE000) | (x & 0x80000000)).astype(np.uint32).view(np.float32)
               for x in bits]
    assert np.abs(c - _product(a, b)).max() < 1e-5
    assert np.abs(c - a.astype(np.float64) @ b.astype(np.float64)).max() > 1e-3
    assert np.abs(c - rounded[0].astype(np.float64) @ rounded[1].astype(np.float64)).max() > 1e-3


@pytest.mark.parametrize("b_layout", ["col", "row"])  # B K-major, MN-major
def test_the_interpreter_catches_a_dropped_swizzle(monkeypatch, b_layout):
    """The hardware swizzle left out of the interpreter's operand reads: the kernels' results are wrong."""
    monkeypatch.setattr(interpreter, "swizzle_128b", lambda addr: addr)
    c, a, b, _ = _contraction(64, 62, 64, 1, "bfloat16", "row", b_layout, None)
    want = _product(a, b)
    assert np.linalg.norm(c - want) / np.linalg.norm(want) > 0.5


# -- the register-A form (inline asm)

B_AT = 2048  # B's byte offset in shared memory: a descriptor start address other than 0


def wgmma_register_a_asm(n: int, trans_b: int) -> tuple[str, str]:
    """(asm string, constraints) of the register-A bf16 wgmma with n / 2 accumulators."""
    r = n // 2
    d, a = ", ".join(f"${i}" for i in range(r)), ", ".join(f"${r + i}" for i in range(4))
    asm = (f"{{ .reg .pred p; setp.ne.b32 p, ${r + 5}, 0; wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 "
           f"{{{d}}}, {{{a}}}, ${r + 4}, p, 1, 1, {trans_b}; }}")
    return asm, ",".join(["=f"] * r + ["r"] * 4 + ["l", "r"] + [str(i) for i in range(r)])


def register_a_kernel(n: int, trans_b: bool, scale_d: int, desc_skew: bool = False) -> tuple[str, int]:
    """(module text, shared bytes) of one warpgroup computing D (64 x n) = A (64 x 16) @ B (16 x n) (+ C):
    A's fragment words loaded from %a (row-major), B copied from %b ([n, 16] when K-major, [16, n]
    when MN-major) into shared memory at B_AT with the 128-byte swizzle, C (row-major) from %c into the
    accumulators, D stored to %d. `desc_skew`: the second half of the warpgroup gets another descriptor."""
    em = GpuEmitter()
    ix = lambda v: em.op(f"arith.constant {v} : index")
    op = lambda name, x, y: em.op(f"arith.{name} {x}, {ix(y) if isinstance(y, int) else y} : index")
    smem_bytes = B_AT + (16 * 128 * (n // 64) if trans_b else n * 128)
    tid = em.op("gpu.thread_id x")
    smem = em.op(f"gpu.dynamic_shared_memory : memref<?xi8, {SMEM}>")
    view_type = f"memref<{smem_bytes // 2}xbf16, {SMEM}>"
    view = em.op(f"memref.view {smem}[{ix(0)}][] : memref<?xi8, {SMEM}> to {view_type}")
    for i in range(16 * n // 128):  # B: MN-major panels of 64 columns x 16 k-rows, or K-major rows of 128 B
        at = op("addi", tid, 128 * i)
        if trans_b:
            kk, col = op("divui", at, n), op("remui", at, n)
            addr = op("addi", op("muli", op("divui", col, 64), 16 * 128), op("muli", op("remui", col, 64), 2))
            addr = op("addi", addr, op("muli", kk, 128))
        else:
            row, kk = op("divui", at, 16), op("remui", at, 16)
            addr = op("addi", op("muli", op("divui", row, 8), 1024), op("muli", op("remui", row, 8), 128))
            addr = op("addi", addr, op("muli", kk, 2))
        addr = op("addi", addr, B_AT)
        swizzled = op("xori", addr, op("shli", op("andi", op("shrui", addr, 7), 7), 4))
        x = em.op(f"memref.load %b[{at}] : memref<{16 * n}xbf16>")
        em.line(f"memref.store {x}, {view}[{op('divui', swizzled, 2)}] : {view_type}")
    warp, lane = op("divui", tid, 32), op("remui", tid, 32)
    row0, col0 = op("addi", op("muli", warp, 16), op("divui", lane, 4)), op("muli", op("remui", lane, 4), 2)
    words = []
    for j in range(4):  # A: rows 16w + l/4 (+ 8), columns 2 (l % 4) (+ 8), two per word
        at = op("addi", op("muli", op("addi", row0, 8 * (j % 2)), 16), op("addi", col0, 8 * (j // 2)))
        pair = em.op(f"vector.load %a[{at}] : memref<1024xbf16>, vector<2xbf16>")
        bits = em.op(f"vector.bitcast {pair} : vector<2xbf16> to vector<1xi32>")
        words.append(em.op(f"vector.extract {bits}[0] : i32 from vector<1xi32>"))
    # D: value i at row 16w + l/4 + 8 ((i/2) % 2), column 2 (l % 4) + i % 2 + 8 (i/4)
    places = [op("addi", op("muli", op("addi", row0, 8 * ((i // 2) % 2)), n), op("addi", col0, i % 2 + 8 * (i // 4)))
              for i in range(n // 2)]
    c = [em.op(f"memref.load %c[{p}] : memref<{64 * n}xf32>") for p in places]
    em.line("gpu.barrier")
    em.line("nvvm.fence.proxy {kind = #nvvm.proxy_kind<async.shared>, space = #nvvm.shared_space<cta>}")
    base = em.op(f"memref.extract_aligned_pointer_as_index {smem} : memref<?xi8, {SMEM}> -> index")
    if desc_skew:
        base = op("addi", base, op("muli", op("divui", tid, 64), 1024))
    i64 = lambda v: em.op(f"arith.constant {v} : i64")
    addr = em.op(f"arith.index_cast {op('addi', base, B_AT)} : index to i64")
    lbo, sbo = (16 * 128 if trans_b else 16), 1024
    field = em.op(f"arith.andi {em.op(f'arith.shrui {addr}, {i64(4)} : i64')}, {i64(0x3FFF)} : i64")
    desc = em.op(f"arith.ori {field}, {i64(((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (1 << 62))} : i64")
    scale = em.op(f"arith.constant {scale_d} : i32")
    acc = "!llvm.struct<(" + ", ".join(["f32"] * (n // 2)) + ")>"
    asm, constraints = wgmma_register_a_asm(n, int(trans_b))
    em.line("nvvm.wgmma.fence.aligned")
    d = em.op(f'llvm.inline_asm has_side_effects "{asm}", "{constraints}" {", ".join(words + [desc, scale] + c)} : '
              f'({", ".join(["i32"] * 4 + ["i64", "i32"] + ["f32"] * (n // 2))}) -> {acc}')
    em.line("nvvm.wgmma.commit.group.sync.aligned")
    em.line("nvvm.wgmma.wait.group.sync.aligned 0")
    for i, p in enumerate(places):
        em.line(f"memref.store {em.op(f'llvm.extractvalue {d}[{i}] : {acc}')}, %d[{p}] : memref<{64 * n}xf32>")
    args = f"%a: memref<1024xbf16>, %b: memref<{16 * n}xbf16>, %c: memref<{64 * n}xf32>, %d: memref<{64 * n}xf32>"
    return "\n".join([
        "module attributes {gpu.container_module} {",
        'gpu.module @wgmma_rs_module [#nvvm.target<O = 3, chip = "sm_90a", features = "+ptx80">] {',
        f"  gpu.func @wgmma_rs({args}) kernel attributes {{known_block_size = array<i32: 128, 1, 1>}} {{",
        *em.lines, "    gpu.return", "  }", "}", "}"]) + "\n", smem_bytes


def _run_register_a(text: str, smem_bytes: int, n: int, trans_b: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((64, 16)).astype(BF16), rng.standard_normal((16, n)).astype(BF16)
    c, d = rng.standard_normal((64, n)).astype(np.float32), np.full((64, n), np.nan, np.float32)
    run_kernel(text, (1, 1, 1), (128, 1, 1), smem_bytes,
               {"a": a, "b": b if trans_b else np.ascontiguousarray(b.T), "c": c, "d": d})
    return d, a.astype(np.float64) @ b.astype(np.float64), c


@pytest.mark.parametrize("n, trans_b, scale_d", [(64, False, 1), (64, True, 0), (128, True, 1), (128, False, 0)])
def test_register_a_wgmma_matches_numpy(n, trans_b, scale_d):
    d, product, c = _run_register_a(*register_a_kernel(n, trans_b, scale_d), n, trans_b, seed=n + trans_b)
    np.testing.assert_allclose(d, product + scale_d * c, rtol=1e-6, atol=1e-5)


@requires_ptxas
@pytest.mark.parametrize("trans_b", [False, True])
def test_register_a_wgmma_text_assembles_for_sm_90a(trans_b):
    text, _ = register_a_kernel(64, trans_b, 1)
    ptx = to_ptx(text)
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx and f", p, 1, 1, {int(trans_b)}; }}" in ptx
    report = assemble_check(ptx, "sm_90a")
    assert report.spills == 0, report.log


# -- faults

def _tiny_wgmma(desc: list[str], guard: str | None) -> str:
    """A kernel of one m64n8k16 bf16 wgmma (A and B K-major through descriptor %desc, the last of the
    lines `desc`, which may read the thread id %t64 and the constant %k_major), under `scf.if` on
    `guard` (an i1 of the thread id %t) when given."""
    acc = "!llvm.struct<(f32, f32, f32, f32)>"
    wgmma = (f"%r = nvvm.wgmma.mma_async %desc, %desc, %z, #nvvm.shape<m = 64, n = 8, k = 16>, "
             f"D [<f32>, #nvvm.wgmma_scale_out<one>, <wrapped>], A [<bf16>, #nvvm.wgmma_scale_in<one>, <row>], "
             f"B [<bf16>, #nvvm.wgmma_scale_in<one>, <col>] : {acc} -> {acc}")
    body = [f"%g = {guard}", "scf.if %g {", wgmma, "}"] if guard else [wgmma]
    return "\n".join([
        "module attributes {gpu.container_module} {", "gpu.module @k_module {", "  gpu.func @k() kernel {",
        "%t = gpu.thread_id x", "%c64 = arith.constant 64 : index", "%c128 = arith.constant 128 : index",
        f"%z = llvm.mlir.zero : {acc}", "%t64 = arith.index_cast %t : index to i64",
        f"%k_major = arith.constant {K_MAJOR_DESC} : i64", *desc, *body, "gpu.return", "}", "}", "}"])


K_MAJOR_DESC = (1 << 62) | (64 << 32) | (1 << 16)  # start 0, SBO 1024 B, LBO 16 B, 128-byte swizzle
SAME_DESC = ["%desc = arith.ori %k_major, %k_major : i64"]  # that descriptor in every thread


@pytest.mark.parametrize("desc, guard, smem_bytes, fault, match", [
    (SAME_DESC, "arith.cmpi ult, %t, %c64 : index", 8192, KernelFault, "diverges"),
    (["%desc = arith.addi %k_major, %t64 : i64"], None, 8192, KernelFault, "differs"),  # start addresses
    (SAME_DESC, None, 4096, KernelFault, "out of"),  # A's eight 8-row groups span 8 KiB
    ([f"%bit63 = arith.constant {-(1 << 63)} : i64",  # mode 3: the 32-byte swizzle
      "%desc = arith.xori %k_major, %bit63 : i64"], None, 8192, NotImplementedError, "swizzle mode 3"),
], ids=["divergent", "non-uniform", "out-of-bounds", "swizzle-mode"])
def test_wgmma_faults(desc, guard, smem_bytes, fault, match):
    with pytest.raises(fault, match=match):
        run_kernel(_tiny_wgmma(desc, guard), (1, 1, 1), (128, 1, 1), smem_bytes, {})


def test_a_branch_over_whole_warpgroups_runs_its_wgmma():
    """Warpgroup 0 runs the wgmma, warpgroup 1 skips it: no fault (the branch splits no warpgroup)."""
    text = _tiny_wgmma(SAME_DESC, "arith.cmpi ult, %t, %c128 : index")
    run_kernel(text, (1, 1, 1), (256, 1, 1), 8192, {})


def test_register_a_faults_and_other_forms():
    text, smem_bytes = register_a_kernel(64, False, 1, desc_skew=True)
    with pytest.raises(KernelFault, match="B descriptor differs"):
        _run_register_a(text, smem_bytes, 64, False)
    text, smem_bytes = register_a_kernel(64, False, 1)
    renumbered = text.replace("setp.ne.b32 p, $37, 0", "setp.ne.b32 p, $36, 0")
    assert renumbered != text
    with pytest.raises(NotImplementedError, match="numbered otherwise"):
        _run_register_a(renumbered, smem_bytes, 64, False)
    with pytest.raises(NotImplementedError, match="other than the interpreter's form"):
        _run_register_a(text.replace("p, 1, 1, 0;", "p, 1, -1, 0;"), smem_bytes, 64, False)


def test_only_the_dynamic_shared_memory_has_an_address():
    text = """module attributes {gpu.container_module} {
gpu.module @k_module {
  gpu.func @k(%a: memref<4xf32>) kernel {
    %p = memref.extract_aligned_pointer_as_index %a : memref<4xf32> -> index
    gpu.return
  }
}
}"""
    with pytest.raises(NotImplementedError, match="other than the dynamic shared memory"):
        run_kernel(text, (1, 1, 1), (32, 1, 1), 0, {"a": np.ones(4, np.float32)})
