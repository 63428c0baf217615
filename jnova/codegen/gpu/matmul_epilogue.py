"""What both contraction main loops share: the emission context, the cp.async copies of k-tiles into
the stage ring, and the register epilogue.

A main loop hands back its accumulators as `Fragment`s (two horizontally adjacent values of C and
where they go); `store_fragments` adds the bias (per column) and the residual (per element) in
registers and writes C once: 8-byte vector stores when the block tile lies inside C, per-element
masked stores at the edges.

Staged stores (sm_90a, `Context.staged`): a block tile inside C goes to shared memory first (the
stage ring is free once the main loop is done), then each of its rows leaves as one asynchronous bulk
copy (`cp.async.bulk.global.shared::cta`, no tensor-map descriptor needed); the block waits only
until the copies have read shared memory. On the H200 this gained 3-5% on bf16 contractions with
K = 768, whose stores from registers took a third of the time: every block still stores at the same
moment, so the stores remain bursts bounded by DRAM (overlapping them with the next tile's main loop
needs a staging buffer beside the stage ring). Rows of the staging tile are padded by 8 floats: a
warp's 8-byte stores of a fragment row pair then fill the 32 banks twice, no more.
"""
from __future__ import annotations

from dataclasses import dataclass

from jnova.codegen.gpu.emitter import GpuEmitter
from jnova.codegen.gpu.matmul_smem import OperandTile, TileCopier, ix_add
from jnova.passes.configure.problem import ContractionProblem
from jnova.passes.configure.tile_config import TileConfig

ELEMENT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class MatmulEpilogue:
    """What the epilogue does to the accumulators before the store: dtypes of the extra inputs, and
    `steps`, in order: "bias", "residual" (f32 adds) and conversions "to:<dtype>" of the value (a
    rounding to bf16 or f16, a widening back to f32). C is stored in the dtype the last conversion
    leaves (`out`). Without `steps`, the bias then the residual are added to the f32 accumulators."""

    bias: str | None = None  # a [N] vector added to every row
    residual: str | None = None  # a [batch, M, N] array added elementwise
    steps: tuple[str, ...] | None = None

    def __post_init__(self):
        for name in ("bias", "residual"):
            dtype = getattr(self, name)
            if dtype is not None and dtype not in ELEMENT:
                raise ValueError(f"MatmulEpilogue.{name}={dtype!r}; expected one of {list(ELEMENT)} or None")
        if self.steps is None:
            object.__setattr__(self, "steps", tuple(n for n in ("bias", "residual") if getattr(self, n)))
        dtype = "float32"
        for step in self.steps:
            if step in ("bias", "residual"):
                if getattr(self, step) is None or dtype != "float32":
                    raise ValueError(f"MatmulEpilogue: step {step!r} needs the {step}'s dtype and an f32 value "
                                     f"(steps {self.steps})")
            elif step.removeprefix("to:") in ELEMENT and step.startswith("to:"):
                dtype = step.removeprefix("to:")
            else:
                raise ValueError(f"MatmulEpilogue: unknown step {step!r}; expected 'bias', 'residual' or 'to:<dtype>'")
        if sorted(n for n in ("bias", "residual") if getattr(self, n)) != sorted(
                s for s in self.steps if s in ("bias", "residual")):
            raise ValueError(f"MatmulEpilogue: each of bias and residual is given once and added once ({self})")

    @property
    def out(self) -> str:
        """The dtype C is stored in."""
        return next((s.removeprefix("to:") for s in reversed(self.steps) if s.startswith("to:")), "float32")

    @property
    def converts(self) -> bool:
        return any(s.startswith("to:") for s in self.steps)


@dataclass
class Context:
    """What both main loops and the epilogue share while one kernel is emitted."""

    problem: ContractionProblem
    config: TileConfig
    em: GpuEmitter
    threads: int
    tid: str
    batch: str
    m0: str  # the block tile's first row of C
    n0: str  # ... and first column
    a: OperandTile
    b: OperandTile
    smem: str  # the dynamic shared memory (i8)
    a_ring: str  # typed views of the stage rings
    b_ring: str
    a_ring_bytes: int
    memrefs: dict  # parameter name -> (SSA name, memref type)
    staged: bool = False  # interior tiles leave through shared memory and bulk copies (module docstring)
    staging_offset: int = 0  # where the staged tile starts in shared memory (0: over the stage ring)
    store_async: bool = False  # staged copies are not waited for (a persistent kernel, staging beside the ring)


@dataclass(frozen=True)
class Fragment:
    """Two accumulator values of C at (row, col) and (row, col + 1), block-tile relative; `row` and
    `col` are (SSA base, constant) pairs so the per-fragment arithmetic folds into address offsets."""

    row: tuple[str, int]
    col: tuple[str, int]
    values: tuple[str, str]


def batch_strides(problem: ContractionProblem) -> tuple[int, int]:
    """Elements from one batch's A (B) to the next: a split-K A's slices are K/S columns apart."""
    p = problem
    return (p.k if p.a_split_k else p.m * p.k), p.k * p.n


def copy_tile(ctx: Context, copiers: list[TileCopier], kt: str) -> None:
    """Copy k-tile `kt` of A and B into stage kt % stages, as one cp.async group."""
    em = ctx.em
    stage = em.op(f"arith.remui {kt}, {em.index(ctx.config.stages)} : index")
    for c in copiers:
        c.issue(em, kt, em.op(f"arith.muli {stage}, {em.index(c.tile.mn * c.tile.bk)} : index"))
    em.line("nvvm.cp.async.commit.group")


def copy_ahead(ctx: Context, copiers: list[TileCopier], ahead: int, k_tiles: int) -> None:
    """The pipeline's prologue: k-tiles 0 .. ahead - 1, always `ahead` groups (empty ones past the last
    tile), since the main loop's waits count groups."""
    for t in range(ahead):
        if t < k_tiles:
            copy_tile(ctx, copiers, ctx.em.index(t))
        else:
            ctx.em.line("nvvm.cp.async.commit.group")


def store_fragments(ctx: Context, epilogue: MatmulEpilogue, fragments: list[Fragment]) -> None:
    """The epilogue's steps (bias, residual, conversions) and the store of every fragment; unmasked
    (a vector of the pair) when the block tile lies inside C, masked per element otherwise."""
    em, p, cfg = ctx.em, ctx.problem, ctx.config
    interior_m = em.op(f"arith.cmpi ule, {em.op(f'arith.addi {ctx.m0}, {em.index(cfg.block_m)} : index')}, "
                       f"{em.index(p.m)} : index")
    interior_n = em.op(f"arith.cmpi ule, {em.op(f'arith.addi {ctx.n0}, {em.index(cfg.block_n)} : index')}, "
                       f"{em.index(p.n)} : index")
    interior = em.op(f"arith.andi {interior_m}, {interior_n} : i1")
    c_base = em.op(f"arith.muli {ctx.batch}, {em.index(p.m * p.n)} : index")
    with em.region(f"scf.if {interior} {{", "} else {"):
        if ctx.staged:
            _store_staged(ctx, epilogue, fragments, c_base)
        else:
            for f in fragments:
                _store_pair(ctx, epilogue, f, c_base, masked=False)
    em.depth += 1
    for f in fragments:
        _store_pair(ctx, epilogue, f, c_base, masked=True)
    em.depth -= 1
    em.line("}")


STAGE_PAD = 8  # floats after each staged row (see the module docstring)


def stages_c(epilogue: MatmulEpilogue) -> bool:
    """Whether C may leave through the f32 staging tile: the epilogue stores f32."""
    return epilogue.out == "float32"


def staging_bytes(config: TileConfig) -> int:
    """Shared memory a staged epilogue needs: the block tile of C in f32, rows padded."""
    return config.block_m * (config.block_n + STAGE_PAD) * 4


def _store_staged(ctx: Context, epilogue: MatmulEpilogue, fragments: list[Fragment], c_base: str) -> None:
    """The block tile through shared memory, then a bulk copy per row (an interior tile: no masks); C
    in f32 only (`stages_c`)."""
    assert epilogue.out == "float32", epilogue
    em, p, cfg = ctx.em, ctx.problem, ctx.config
    width = cfg.block_n + STAGE_PAD
    tile_type = f"memref<{cfg.block_m * width}xf32, #gpu.address_space<workgroup>>"
    tile = em.op(f"memref.view {ctx.smem}[{em.index(ctx.staging_offset)}][] : "
                 f"memref<?xi8, #gpu.address_space<workgroup>> to {tile_type}")
    if ctx.store_async:  # the previous tile's copies (each thread's own bulk group) have read the staging tile
        em.line("nvvm.cp.async.bulk.wait_group 0 {read}")
    em.line("gpu.barrier")  # every warpgroup's last wgmma has read the ring
    for f in fragments:
        value, _, _ = _pair_value(ctx, epilogue, f, c_base, masked=False)
        at = ix_add(em, (f.row[0], width), f.row[1] * width, f.col[0], f.col[1])
        em.line(f"vector.store {value}, {tile}[{at}] {{alignment = 8}} : {tile_type}, vector<2xf32>")
    em.line("nvvm.fence.proxy {kind = #nvvm.proxy_kind<async.shared>, space = #nvvm.shared_space<cta>}")
    em.line("gpu.barrier")
    c, c_type = ctx.memrefs["c"]
    c_addr = em.op(f"memref.extract_aligned_pointer_as_index {c} : {c_type} -> index")
    s_addr = em.op(f"memref.extract_aligned_pointer_as_index {ctx.smem} : memref<?xi8, #gpu.address_space<workgroup>> "
                   f"-> index")
    row = em.fresh("row")
    with em.region(f"scf.for {row} = {ctx.tid} to {em.index(cfg.block_m)} step {em.index(ctx.threads)} {{"):
        global_ofs = ix_add(em, c_base, (em.op(f"arith.addi {ctx.m0}, {row} : index"), p.n), ctx.n0)
        dst = pointer(em, ix_add(em, c_addr, (global_ofs, 4)), "1")
        src = pointer(em, ix_add(em, s_addr, (row, width * 4), ctx.staging_offset), "3")
        em.line(f"nvvm.cp.async.bulk.global.shared.cta {dst}, {src}, {em.i32(cfg.block_n * 4)} : "
                f"!llvm.ptr<1>, !llvm.ptr<3>")
    em.line("nvvm.cp.async.bulk.commit.group")
    if not ctx.store_async:
        em.line("nvvm.cp.async.bulk.wait_group 0 {read}")  # shared memory read: the block may exit


def pointer(em: GpuEmitter, address: str, space: str) -> str:
    as_int = em.op(f"arith.index_cast {address} : index to i64")
    if space == "3":
        return em.op(f"llvm.inttoptr {em.op(f'arith.trunci {as_int} : i64 to i32')} : i32 to !llvm.ptr<3>")
    return em.op(f"llvm.addrspacecast {em.op(f'llvm.inttoptr {as_int} : i64 to !llvm.ptr')} : !llvm.ptr to !llvm.ptr<1>")


def _pair_value(ctx: Context, epilogue: MatmulEpilogue, f: Fragment, c_base: str, masked: bool):
    """(the fragment's two values with bias and residual added, the mask or None, C's offset)."""
    em, p = ctx.em, ctx.problem
    row = em.op(f"arith.addi {ctx.m0}, {em.op(f'arith.addi {f.row[0]}, {em.index(f.row[1])} : index')} : index")
    col = em.op(f"arith.addi {ctx.n0}, {em.op(f'arith.addi {f.col[0]}, {em.index(f.col[1])} : index')} : index")
    ofs = ix_add(em, c_base, (row, p.n), col)
    mask = None
    if masked:
        row_ok = em.op(f"arith.cmpi ult, {row}, {em.index(p.m)} : index")
        ok0 = em.op(f"arith.andi {row_ok}, {em.op(f'arith.cmpi ult, {col}, {em.index(p.n)} : index')} : i1")
        col1 = em.op(f"arith.addi {col}, {em.index(1)} : index")
        ok1 = em.op(f"arith.andi {row_ok}, {em.op(f'arith.cmpi ult, {col1}, {em.index(p.n)} : index')} : i1")
        mask = em.op(f"vector.from_elements {ok0}, {ok1} : vector<2xi1>")
    value = em.op(f"vector.from_elements {f.values[0]}, {f.values[1]} : vector<2xf32>")
    e = "f32"
    for step in epilogue.steps:
        if step == "bias":
            value = add_loaded(ctx, "bias", epilogue.bias, col, value, mask, 2 * BYTES[epilogue.bias])
        elif step == "residual":
            nbytes = BYTES[epilogue.residual]
            value = add_loaded(ctx, "residual", epilogue.residual, ofs, value, mask,
                                nbytes * (2 if p.n % 2 == 0 else 1))
        else:
            value, e = convert(em, step, value, e)
    return value, mask, ofs


def convert(em: GpuEmitter, step: str, value: str, e: str) -> tuple[str, str]:
    """A conversion step of a pair of element type `e`: f32 to a 16-bit float rounds to nearest even,
    16-bit to f32 is exact. (the pair, its element type)"""
    to = ELEMENT[step.removeprefix("to:")]
    if to == e:
        return value, e
    how = "arith.truncf" if to != "f32" else "arith.extf"
    return em.op(f"{how} {value} : vector<2x{e}> to vector<2x{to}>"), to


def _store_pair(ctx: Context, epilogue: MatmulEpilogue, f: Fragment, c_base: str, masked: bool) -> None:
    em, p = ctx.em, ctx.problem
    value, mask, ofs = _pair_value(ctx, epilogue, f, c_base, masked)
    e = ELEMENT[epilogue.out]
    pair_align = 2 * BYTES[epilogue.out] if p.n % 2 == 0 else BYTES[epilogue.out]
    c, c_type = ctx.memrefs["c"]
    if mask is None:
        em.line(f"vector.store {value}, {c}[{ofs}] {{alignment = {pair_align}}} : {c_type}, vector<2x{e}>")
    else:
        em.line(f"vector.maskedstore {c}[{ofs}], {mask}, {value} : {c_type}, vector<2xi1>, vector<2x{e}>")


def add_loaded(ctx: Context, param: str, dtype: str, ofs: str, value: str, mask: str | None, align: int) -> str:
    em = ctx.em
    ssa, t = ctx.memrefs[param]
    e = ELEMENT[dtype]
    if mask is None:
        x = em.op(f"vector.load {ssa}[{ofs}] {{alignment = {align}}} : {t}, vector<2x{e}>")
    else:
        zero = em.op(f"arith.constant dense<0.0> : vector<2x{e}>")
        x = em.op(f"vector.maskedload {ssa}[{ofs}], {mask}, {zero} : {t}, vector<2xi1>, vector<2x{e}> into vector<2x{e}>")
    if e != "f32":
        x = em.op(f"arith.extf {x} : vector<2x{e}> to vector<2xf32>")
    return em.op(f"arith.addf {value}, {x} : vector<2xf32>")
