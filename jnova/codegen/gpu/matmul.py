"""Contraction kernels: C[b, M, N] = A[b] @ B[b] (+ bias[N]) (+ residual[b, M, N]), f32 output.

`build_matmul(problem, config, target, epilogue)` writes one `gpu.func` from the TileConfig the
Analytic Configurator chose and compiles it to PTX. Three kernels (report, section 4.5):

  sm_90a, 16-bit, `pingpong` configs `matmul_tma.py`: warp-specialized and persistent. One producer
                          thread feeds a ring through TMA (`cp.async.bulk.tensor`, descriptors built
                          by jnova's launcher at each launch); two consumer warpgroups take tiles in
                          turn, so one stores its tile (shared memory, then TMA stores) while the
                          other's wgmmas run. What the configurator picks for large 16-bit problems;
  sm_90a (bf16, f16, TF32) `matmul_wgmma.py`: a multi-stage cp.async ring of 128-byte-swizzled tiles
                          read by `wgmma.mma_async` through shared-memory descriptors (the
                          warpgroup grid from the config; one wgmma group kept in flight). wgmma
                          takes TF32 only K-major, so an MN-major f32 operand is transposed by its
                          copies into shared memory (4-byte cp.async, `matmul_smem.py`);
  f32 (TF32) before sm_90 `matmul_mma.py`: a multi-stage cp.async ring read by `mma.sync m16n8k8`
                          with ldmatrix for K-major tiles and 32-bit scalar reads for MN-major ones
                          (never ldmatrix.trans on 32-bit data: report, Table 1).

TMA descriptors depend on the buffers' addresses, so only a launcher that builds them at launch can
run the first kernel (jnova's does; jaxlib's PTX kernel call passes plain pointers, and the
configurator then keeps to the cp.async kernels: `choose_tiles` on a `Target` with `tensor_maps=False`).

Layouts: A is [M, K] (`a_layout="row"`) or [K, M] ("col"); B is [K, N] ("row") or [N, K] ("col",
what the backward pass needs). Any M, N, K: copies past an edge are zero-filled and the epilogue
stores are masked. Batch is the grid's z dimension. The epilogue works on the accumulator registers:
bias (per column) and residual (per element) are added before the one store of C; on sm_90a a tile
inside C is written through shared memory by bulk copies ("store=bulk" in the schedule).

Kernel parameters, in order: a, b, [bias], [residual], c (one pointer each, 16-byte aligned), then
the ping-pong kernel's tensor maps by value (A, B, and C where it leaves by TMA stores).
Shared pieces: `matmul_smem.py` (tile layouts in shared memory, global -> shared copies),
`matmul_epilogue.py` (the emission context, bias/residual and the store of C).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from jnova.codegen.gpu import matmul_mma, matmul_tma, matmul_wgmma
from jnova.codegen.gpu.launch import GpuLaunch, TensorMap
from jnova.codegen.gpu.emitter import GpuEmitter, GpuModule, ptx_features
from jnova.codegen.gpu.matmul_epilogue import (BYTES, ELEMENT, Context, MatmulEpilogue, stages_c, staging_bytes,
                                               store_fragments)
from jnova.codegen.gpu.matmul_smem import SMEM, OperandTile
from jnova.codegen.gpu.ptx import TENSOR_MAP_ALIGN, to_ptx
from jnova.errors import LoweringError
from jnova.passes.configure.problem import ContractionProblem
from jnova.passes.configure.tile_config import TileConfig
from jnova.runtime.target import Target

GROUP_M = 8  # block tiles along M that share a sweep over N (L2 reuse of the B panels)
PERSISTENT_MIN_WAVES = 2  # a persistent kernel needs at least this many tiles per resident block
ALIGN = 16


@dataclass(frozen=True)
class GpuKernel:
    """A compiled kernel and how to launch it; `params` names its buffers in order, ("in"|"out", name)."""

    name: str
    ptx: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem_bytes: int  # dynamic shared memory
    params: tuple[tuple[str, str], ...]
    compute_capability: int
    schedule: str
    gpu_module: str
    tensor_maps: tuple[TensorMap, ...] = ()

    def launch(self) -> GpuLaunch:
        """The form `nova_kernel_p`'s CUDA lowering takes."""
        return GpuLaunch(self.name, self.ptx, self.grid, self.block, self.shared_mem_bytes, self.compute_capability,
                         self.schedule, self.gpu_module, tensor_maps=self.tensor_maps)


def build_matmul(problem: ContractionProblem, config: TileConfig, target: Target,
                 epilogue: MatmulEpilogue | None = None, name: str | None = None,
                 persistent: bool | None = None) -> GpuKernel:
    """The kernel computing `problem` with `config` on `target` (LoweringError if it cannot);
    `persistent` forces the persistent form on or off (None: where `persistent_blocks` allows it)."""
    module = matmul_module(problem, config, target, epilogue, name, persistent)
    major, minor = target.compute_capability
    return GpuKernel(module.name, to_ptx(module.text), module.grid, module.block, module.shared_mem_bytes,
                     kernel_params(epilogue), 10 * major + minor, module.schedule, module.text, module.tensor_maps)


def kernel_params(epilogue: MatmulEpilogue | None) -> tuple[tuple[str, str], ...]:
    extra = [] if epilogue is None else [n for n in ("bias", "residual") if getattr(epilogue, n)]
    return (("in", "a"), ("in", "b"), *(("in", n) for n in extra), ("out", "c"))


def matmul_refusal(problem: ContractionProblem, config: TileConfig, target: Target) -> str | None:
    """Why no kernel of this module computes `problem` with `config` on `target`, or None."""
    if problem.out_dtype != "float32":
        return f"output dtype {problem.out_dtype}: the contraction kernels write f32"
    wants = "tf32" if problem.operand_dtype == "float32" else ELEMENT[problem.operand_dtype]
    if config.mma.split("_")[-2 if config.is_wgmma else 2].removesuffix("x3") != wants:
        return f"{config.mma} does not take {problem.operand_dtype} operands"
    if wants == "tf32" and problem.precision == "highest" and "tf32x3" not in config.mma:
        return f"{config.mma} rounds operands to TF32; precision 'highest' needs mma_sync_tf32x3_16x8x8"
    if config.is_wgmma and not target.has("wgmma"):
        return f"{config.mma} needs wgmma, which {target.name} ({target.arch}) lacks"
    if not config.is_wgmma and wants != "tf32":
        return f"{config.mma}: 16-bit mma.sync contractions are not generated yet (only wgmma on sm_90a)"
    if config.split_k != 1:
        return f"split_k={config.split_k}: the epilogue needs the whole K sum in one block"
    if config.pingpong:
        if not target.has("tma"):
            return f"the ping-pong kernel needs TMA, which {target.name} ({target.arch}) lacks"
        return matmul_tma.refusal(problem, config)
    return None


def operand_tiles(problem: ContractionProblem, config: TileConfig, swizzle_a: str, swizzle_b: str,
                  k_major_only: bool = False):
    """The A and B tiles; with `k_major_only` an MN-major operand is transposed into a K-major tile."""
    e, nbytes = ELEMENT[problem.operand_dtype], BYTES[problem.operand_dtype]
    a_k, b_k = problem.a_layout == "row", problem.b_layout == "col"
    a = OperandTile("a", e, nbytes, config.block_m, config.block_k, a_k or k_major_only, swizzle_a,
                    problem.m, problem.k, transposed=k_major_only and not a_k,
                    stride=problem.k * problem.batch if problem.a_split_k else 0)
    b = OperandTile("b", e, nbytes, config.block_n, config.block_k, b_k or k_major_only, swizzle_b,
                    problem.n, problem.k, transposed=k_major_only and not b_k)
    return a, b


def persistent_blocks(problem: ContractionProblem, config: TileConfig, target: Target,
                      min_waves: int = PERSISTENT_MIN_WAVES) -> int:
    """Blocks per SM of the persistent form of this kernel, 0 where it has none.

    Each block walks tiles; a tile's interior leaves through a staging buffer beside the stage ring
    by bulk copies that nobody waits for, so its stores drain while the block computes the next tile
    (whose first k-tiles were copied before the store). Taken on sm_90a for 16-bit operands when the
    staging buffer fits without lowering the blocks per SM, with at least `min_waves` tiles per
    resident block. On the H200 (GPT-2 shapes, benchmarks/matmul.py --variants) this gained 4-17% on
    bf16 128x128 tiles of 4 stages; where it halved the blocks per SM (128x128 of 3 stages, 128x64) it
    changed them by -38% to +12%, and TF32 128x128 tiles by -13% to +18% (their MN-major operands'
    4-byte copies are the limit; the configurator's TF32 tiles, 256x128, leave no room for the buffer)."""
    if not config.is_wgmma or "tf32" in config.mma or problem.n % 4 or config.pingpong:
        return 0
    a, b = operand_tiles(problem, config, *matmul_wgmma.SWIZZLES(problem, config), matmul_wgmma.k_major_only(config))
    ring = config.stages * (a.bytes + b.bytes)
    smem = ring + staging_bytes(config)
    if smem > target.smem_per_block_optin:
        return 0
    threads = matmul_wgmma.threads(problem, config)
    per_sm = lambda nbytes: max(1, min(target.smem_per_sm // (nbytes + 1024), 2048 // threads))  # 2048 threads/SM
    resident = per_sm(smem)
    if resident < per_sm(max(ring, staging_bytes(config))):
        return 0
    tiles = problem.batch * math.ceil(problem.m / config.block_m) * math.ceil(problem.n / config.block_n)
    return resident if tiles >= min_waves * resident * target.sm_count else 0


def matmul_module(problem: ContractionProblem, config: TileConfig, target: Target,
                  epilogue: MatmulEpilogue | None = None, name: str | None = None,
                  persistent: bool | None = None) -> GpuModule:
    """The gpu.module text of the kernel (no compilation)."""
    reason = matmul_refusal(problem, config, target)
    if reason:
        raise LoweringError(f"cannot build a contraction kernel for {problem}: {reason}")
    family = matmul_wgmma if config.is_wgmma else matmul_mma
    epilogue = epilogue or MatmulEpilogue()
    name = name or default_name(problem, config, epilogue)
    try:
        a, b = operand_tiles(problem, config, *family.SWIZZLES(problem, config), family.k_major_only(config))
    except ValueError as e:
        raise LoweringError(f"cannot build a contraction kernel for {problem} with {config}: {e}") from None
    threads = family.threads(problem, config)
    tiles_m, tiles_n = math.ceil(problem.m / config.block_m), math.ceil(problem.n / config.block_n)
    smem_bytes = config.stages * (a.bytes + b.bytes)
    if smem_bytes > target.smem_per_block_optin:
        raise LoweringError(f"{config}: {smem_bytes} B of shared memory exceed {target.name}'s "
                            f"{target.smem_per_block_optin} B per block")

    if config.pingpong:
        return _pingpong_module(problem, config, target, epilogue, name, a, b, tiles_m, tiles_n, smem_bytes)

    # sm_90a: interior tiles leave through shared memory and bulk copies (16-byte aligned rows of C);
    # persistent (see `persistent_blocks`) with the staging buffer beside the ring, else over it
    resident = 0 if persistent is False else persistent_blocks(problem, config, target, 0 if persistent else
                                                                PERSISTENT_MIN_WAVES)
    if persistent and not resident:
        raise LoweringError(f"{config} has no persistent form for {problem} on {target.name}")
    if not stages_c(epilogue):  # the persistent form's stores go through the staging tile
        if persistent:
            raise LoweringError(f"{config} has no persistent form for an epilogue storing {epilogue.out}")
        resident = 0
    staged = config.is_wgmma and problem.n % 4 == 0 and staging_bytes(config) <= target.smem_per_block_optin \
        and stages_c(epilogue)
    ring_bytes = smem_bytes
    if resident:
        smem_bytes = ring_bytes + staging_bytes(config)
    elif staged:
        smem_bytes = max(smem_bytes, staging_bytes(config))

    em = GpuEmitter()
    memrefs = _parameters(problem, epilogue)
    ctx = _prologue(em, problem, config, a, b, threads, tiles_m, tiles_n, memrefs)
    ctx.staged = staged
    grid = (tiles_m * tiles_n, 1, problem.batch)
    if resident:
        ctx.staging_offset, ctx.store_async = ring_bytes, True
        total = problem.batch * tiles_m * tiles_n
        grid = (min(total, resident * target.sm_count), 1, 1)
        _persistent_tiles(ctx, family, epilogue, tiles_m, tiles_n, total, grid[0])
    else:
        fragments = family.main_loop(ctx)
        store_fragments(ctx, epilogue, fragments)

    # minctasm = 1 (.minnctapersm 1): without it ptxas aims at several blocks per SM and spills,
    # though shared memory allows one or two
    text = _module_text(name, memrefs, em.lines, threads, target, "nvvm.minctasm = 1 : i32")
    schedule = f"matmul[{family.__name__.rsplit('_', 1)[-1]}] {problem.batch}x{problem.m}x{problem.n}x{problem.k} " \
               f"{problem.operand_dtype} a={problem.a_layout}{'/split_k' if problem.a_split_k else ''} " \
               f"b={problem.b_layout} {config}" \
               f"{' store=bulk' if staged and not resident else ''}{' persistent store=async' if resident else ''}" \
               f"{epilogue_label(epilogue)}"
    return GpuModule(name, text, grid, (threads, 1, 1), smem_bytes, schedule)


def _pingpong_module(problem, config, target, epilogue, name, a, b, tiles_m, tiles_n, ring_bytes) -> GpuModule:
    """The warp-specialized kernel fed by TMA (`matmul_tma.py`): `config` is one consumer's tile."""
    threads = matmul_tma.THREADS
    staged = matmul_tma.stores_by_tma(problem, epilogue) and \
        matmul_tma.smem_bytes(ring_bytes, config.stages, config) <= target.smem_per_block_optin
    smem_bytes = matmul_tma.smem_bytes(ring_bytes, config.stages, config if staged else None)
    if smem_bytes > target.smem_per_block_optin:
        raise LoweringError(f"{config}: {smem_bytes} B of shared memory exceed {target.name}'s "
                            f"{target.smem_per_block_optin} B per block")
    em = GpuEmitter()
    memrefs = _parameters(problem, epilogue)
    maps = matmul_tma.tensor_maps(problem, config, len(memrefs))
    names = ("%tma_a", "%tma_b")
    if staged:  # C's buffer is the kernel's last before the maps (an aliased result shares its operand's)
        maps += (matmul_tma.c_tensor_map(problem, config, len(memrefs) - 1, len(memrefs) + 2, epilogue.out),)
        names += ("%tma_c",)
    ctx = _prologue(em, problem, config, a, b, threads, tiles_m, tiles_n, memrefs)
    total = problem.batch * tiles_m * tiles_n
    grid = (min(total, target.sm_count), 1, 1)
    matmul_tma.emit(ctx, epilogue, tiles_m, tiles_n, total, grid[0], ring_bytes,
                    lambda c, t: _tile_context(c, t, tiles_m, tiles_n), names)
    text = _module_text(name, memrefs, em.lines, threads, target, f"nvvm.maxnreg = {matmul_tma.LAUNCH_REGS} : i32",
                        tensor_maps=names)
    schedule = f"matmul[tma-pingpong] {problem.batch}x{problem.m}x{problem.n}x{problem.k} " \
               f"{problem.operand_dtype} a={problem.a_layout} b={problem.b_layout} {config}" \
               f"{' store=tma' if staged else ''}{epilogue_label(epilogue)}"
    return GpuModule(name, text, grid, (threads, 1, 1), smem_bytes, schedule, tensor_maps=maps)


def epilogue_label(epilogue: MatmulEpilogue) -> str:
    """The epilogue's steps as the schedule prints them (nothing for the plain store of f32)."""
    names = {"bias": f"bias({epilogue.bias})", "residual": f"residual({epilogue.residual})"}
    return f" epilogue={','.join(names.get(s, s) for s in epilogue.steps)}" if epilogue.steps else ""


def _module_text(name: str, memrefs: dict, lines: list[str], threads: int, target: Target, attributes: str,
                 tensor_maps: tuple[str, ...] = ()) -> str:
    args = ", ".join([f"{ssa}: {t} {{llvm.align = {ALIGN} : i64}}" for ssa, t in memrefs.values()]
                     + [f"{ssa}: !llvm.ptr {{llvm.align = {TENSOR_MAP_ALIGN} : i64}}" for ssa in tensor_maps])
    nvvm = f'#nvvm.target<O = 3, chip = "{target.arch}", features = "{ptx_features(target)}">'
    return "\n".join([
        "module attributes {gpu.container_module} {",
        f"gpu.module @{name}_module [{nvvm}] {{",
        f"  gpu.func @{name}({args}) kernel attributes {{known_block_size = array<i32: {threads}, 1, 1>, {attributes}}} {{",
        *lines,
        "    gpu.return",
        "  }",
        "}",
        "}",
    ]) + "\n"


def default_name(problem: ContractionProblem, config: TileConfig, epilogue: MatmulEpilogue) -> str:
    extras = "".join(["_bias" if epilogue.bias else "", "_res" if epilogue.residual else "",
                      f"_to_{ELEMENT[epilogue.out]}" if epilogue.converts else ""])
    text = (f"matmul_{ELEMENT[problem.operand_dtype]}_{problem.a_layout[0]}{problem.b_layout[0]}_"
            f"{problem.batch}x{problem.m}x{problem.n}x{problem.k}_{config.block_m}x{config.block_n}x{config.block_k}"
            f"_w{config.warps_m}x{config.warps_n}_s{config.stages}{extras}")
    return re.sub(r"\W", "_", text)


def _parameters(problem: ContractionProblem, epilogue: MatmulEpilogue) -> dict:
    p, e = problem, ELEMENT[problem.operand_dtype]
    params = {"a": ("%a", f"memref<{p.batch * p.m * p.k}x{e}>"), "b": ("%b", f"memref<{p.batch * p.k * p.n}x{e}>")}
    if epilogue.bias:
        params["bias"] = ("%bias", f"memref<{p.n}x{ELEMENT[epilogue.bias]}>")
    if epilogue.residual:
        params["residual"] = ("%residual", f"memref<{p.batch * p.m * p.n}x{ELEMENT[epilogue.residual]}>")
    params["c"] = ("%c", f"memref<{p.batch * p.m * p.n}x{ELEMENT[epilogue.out]}>")
    return params


def _persistent_tiles(ctx: Context, family, epilogue: MatmulEpilogue, tiles_m: int, tiles_n: int, total: int,
                      blocks: int) -> None:
    """Block b computes tiles b, b + blocks, ... (batch-major, grouped rasterization within a batch).
    After a tile's last wgmma the block copies the next tile's first k-tiles, then stores this one
    through the staging buffer; its bulk copies are waited for (shared memory read) only before the
    staging buffer is written again, and at the end."""
    em = ctx.em
    first = em.op("gpu.block_id x")
    family.prefetch(_tile_context(ctx, first, tiles_m, tiles_n))
    t = em.fresh("tile")
    with em.region(f"scf.for {t} = {first} to {em.index(total)} step {em.index(blocks)} {{"):
        here = _tile_context(ctx, t, tiles_m, tiles_n)
        fragments = family.main_loop(here, prefetched=True)
        em.line("gpu.barrier")  # every warpgroup is done with the ring: the next tile's copies may land
        following = em.op(f"arith.addi {t}, {em.index(blocks)} : index")
        more = em.op(f"arith.cmpi ult, {following}, {em.index(total)} : index")
        with em.region(f"scf.if {more} {{"):
            family.prefetch(_tile_context(ctx, following, tiles_m, tiles_n))
        store_fragments(here, epilogue, fragments)
    em.line("nvvm.cp.async.bulk.wait_group 0 {read}")  # the last staged tile read: the block may exit


def _tile_context(ctx: Context, t: str, tiles_m: int, tiles_n: int) -> Context:
    """`ctx` for tile index `t` of a persistent kernel (batch-major)."""
    em = ctx.em
    per_batch = tiles_m * tiles_n
    batch = em.op(f"arith.divui {t}, {em.index(per_batch)} : index")
    m0, n0 = _tile_origin(em, ctx.config, em.op(f"arith.remui {t}, {em.index(per_batch)} : index"), tiles_m, tiles_n)
    return dataclasses.replace(ctx, batch=batch, m0=m0, n0=n0)


def _tile_origin(em, config, pid: str, tiles_m: int, tiles_n: int) -> tuple[str, str]:
    """(first row, first column) of tile `pid` of a batch: GROUP_M tiles along M share a sweep over N."""
    group = GROUP_M * tiles_n
    group_id = em.op(f"arith.divui {pid}, {em.index(group)} : index")
    first_m = em.op(f"arith.muli {group_id}, {em.index(GROUP_M)} : index")
    size_m = em.op(f"arith.minui {em.op(f'arith.subi {em.index(tiles_m)}, {first_m} : index')}, "
                   f"{em.index(GROUP_M)} : index")
    in_group = em.op(f"arith.remui {pid}, {em.index(group)} : index")
    pid_m = em.op(f"arith.addi {first_m}, {em.op(f'arith.remui {in_group}, {size_m} : index')} : index")
    pid_n = em.op(f"arith.divui {in_group}, {size_m} : index")
    return (em.op(f"arith.muli {pid_m}, {em.index(config.block_m)} : index"),
            em.op(f"arith.muli {pid_n}, {em.index(config.block_n)} : index"))


def _prologue(em, problem, config, a, b, threads, tiles_m, tiles_n, memrefs) -> Context:
    """Block -> (batch, tile) with grouped rasterization, thread id, shared-memory views."""
    tid = em.op("gpu.thread_id x")
    pid = em.op("gpu.block_id x")
    batch = em.op("gpu.block_id z")
    m0, n0 = _tile_origin(em, config, pid, tiles_m, tiles_n)
    smem = em.op(f"gpu.dynamic_shared_memory : memref<?xi8, {SMEM}>")
    stages = config.stages
    a_ring = em.op(f"memref.view {smem}[{em.index(0)}][] : memref<?xi8, {SMEM}> to {a.memref(stages)}")
    b_ring = em.op(f"memref.view {smem}[{em.index(stages * a.bytes)}][] : memref<?xi8, {SMEM}> to {b.memref(stages)}")
    return Context(problem, config, em, threads, tid, batch, m0, n0, a, b, smem, a_ring, b_ring, stages * a.bytes,
                   memrefs)
