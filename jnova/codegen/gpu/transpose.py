"""Tiled transposes: a kernel that is one `nova.transpose` swapping two trailing groups of dims.

The transposes `passes/transpose_operands.py` inserts (a TF32 contraction operand made K-major) view
the operand as [batch, rows, cols] and write [batch, cols, rows]. Read through the elementwise
builder's remaps, each 16-byte store gathers four elements from four rows: every 32-byte sector of the
input is fetched once per output row that needs it. Here a block moves a `TILE` x `TILE` tile through
shared memory instead: 16-byte loads along the input's rows, 16-byte stores along the output's, each
sector read and written once. The shared-memory rows are padded by one element, so the column reads of
the second phase spread over the banks (two-way conflicts at most, as the row writes of the first).

Every index after the barrier is computed anew from the block and thread ids, so the kernel runs
exactly when its two phases are run one after the other for all of a block's threads (how the tests
emulate it on a CPU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jnova.codegen.gpu.emitter import GpuEmitter, GpuModule, flat_memref, gpu_module_text, kernel_params
from jnova.codegen.linalg.emitter import element
from jnova.errors import LoweringError
from jnova.dialect.types import itemsize
from jnova.passes.plan import Kernel
from jnova.runtime.target import Target

TILE = 64  # rows and columns of a block's tile
BLOCK = 256  # threads
VECTOR = 4  # 4-byte elements per 16-byte access


@dataclass(frozen=True)
class TransposeSchedule:
    batch: int
    rows: int  # of the input's [batch, rows, cols] view
    cols: int

    @property
    def tiles(self) -> tuple[int, int]:
        return math.ceil(self.rows / TILE), math.ceil(self.cols / TILE)

    @property
    def grid(self) -> int:
        return self.batch * self.tiles[0] * self.tiles[1]

    def __str__(self) -> str:
        return f"transpose(batch={self.batch}, rows={self.rows}, cols={self.cols}, tile={TILE}, block={BLOCK})"


def transpose_view(kernel: Kernel) -> tuple[int, int, int] | None:
    """(batch, rows, cols) when `kernel` is one transpose of [batch..., R..., C...] to
    [batch..., C..., R...] (each group of dims kept in order), read through reshapes of its input (the
    same row-major elements: a split-K view, `passes/split_contractions.py`), else None."""
    op = kernel.ops[-1] if kernel.ops else None
    if op is None or op.name != "nova.transpose" or len(kernel.inputs) != 1 or kernel.outputs != op.results:
        return None
    value = op.operands[0]
    for reshape in reversed(kernel.ops[:-1]):
        if reshape.name != "nova.reshape" or reshape.results[0] is not value:
            return None
        value = reshape.operands[0]
    if value is not kernel.inputs[0]:
        return None
    perm, shape = tuple(op.attrs["perm"]), op.operands[0].type.shape
    rank = len(shape)
    nb = next((i for i, p in enumerate(perm) if p != i), rank)
    for nr in range(1, rank - nb):  # rows = dims nb .. nb+nr-1 of the input
        if perm == tuple(range(nb)) + tuple(range(nb + nr, rank)) + tuple(range(nb, nb + nr)):
            return math.prod(shape[:nb]), math.prod(shape[nb:nb + nr]), math.prod(shape[nb + nr:])
    return None


def transpose_refusal(kernel: Kernel) -> str | None:
    """Why `kernel` is not a tiled transpose, or None."""
    view = transpose_view(kernel)
    if view is None:
        return "not one transpose of two trailing groups of dims (after reshapes of its input)"
    dtype = kernel.inputs[0].type.dtype
    if itemsize(dtype) != 4:
        return f"{dtype} elements (4-byte only)"
    _, rows, cols = view
    if rows % VECTOR or cols % VECTOR:
        return f"rows ({rows}) and columns ({cols}) are not whole 16-byte vectors"
    return None


def build_transpose(kernel: Kernel, target: Target) -> GpuModule:
    reason = transpose_refusal(kernel)
    if reason:
        raise LoweringError(f"{kernel.name} is not a tiled transpose: {reason}")
    sched = TransposeSchedule(*transpose_view(kernel))
    params, memrefs, outs = kernel_params(kernel.inputs, kernel.outputs)
    x = kernel.inputs[0]
    e = element(x.type.dtype)
    src, dst = memrefs[x], outs[0]
    src_type = dst_type = flat_memref(x.type)
    tile = "%tile"
    tile_type = f"memref<{TILE * (TILE + 1)}x{e}, #gpu.address_space<workgroup>>"
    vec = f"vector<{VECTOR}x{e}>"
    em = GpuEmitter()
    per_row = TILE // VECTOR  # vectors along a tile row
    passes = TILE * per_row // BLOCK

    def block_origin():
        """(batch offset of the input and output, first row, first column) of this block's tile."""
        bid = em.op("gpu.block_id x")
        tiles_r, tiles_c = sched.tiles
        b = em.op(f"arith.divui {bid}, {em.index(tiles_r * tiles_c)} : index")
        t = em.op(f"arith.remui {bid}, {em.index(tiles_r * tiles_c)} : index")
        r0 = em.op(f"arith.muli {em.op(f'arith.divui {t}, {em.index(tiles_c)} : index')}, {em.index(TILE)} : index")
        c0 = em.op(f"arith.muli {em.op(f'arith.remui {t}, {em.index(tiles_c)} : index')}, {em.index(TILE)} : index")
        return em.op(f"arith.muli {b}, {em.index(sched.rows * sched.cols)} : index"), r0, c0

    def thread_slot(i: int):
        """(tile line 0..TILE-1, first element of its vector along the line) of pass `i`."""
        slot = em.op(f"arith.addi {em.op('gpu.thread_id x')}, {em.index(i * BLOCK)} : index")
        line = em.op(f"arith.divui {slot}, {em.index(per_row)} : index")
        first = em.op(f"arith.muli {em.op(f'arith.remui {slot}, {em.index(per_row)} : index')}, {em.index(VECTOR)} : index")
        return line, first

    def add(a, b):
        return em.op(f"arith.addi {a}, {b} : index")

    def mul(a, k):
        return em.op(f"arith.muli {a}, {em.index(k)} : index")

    def inside(a, limit):
        return em.op(f"arith.cmpi ult, {a}, {em.index(limit)} : index")

    # 1. input rows r0.., columns c0..: 16-byte loads, stored at tile[row][col]
    base, r0, c0 = block_origin()
    for i in range(passes):
        line, first = thread_slot(i)
        r, c = add(r0, line), add(c0, first)
        with em.region(f"scf.if {em.op(f'arith.andi {inside(r, sched.rows)}, {inside(c, sched.cols)} : i1')} {{"):
            v = em.op(f"vector.load {src}[{add(base, add(mul(r, sched.cols), c))}] {{alignment = 16}} : {src_type}, {vec}")
            at = add(mul(line, TILE + 1), first)
            for lane in range(VECTOR):
                value = em.op(f"vector.extract {v}[{lane}] : {e} from {vec}")
                em.line(f"memref.store {value}, {tile}[{at if lane == 0 else add(at, em.index(lane))}] : {tile_type}")
    em.line("gpu.barrier")
    # 2. output rows c0.. (the input's columns), columns r0..: tile[row][col] read down a column
    base, r0, c0 = block_origin()
    for i in range(passes):
        line, first = thread_slot(i)
        c, r = add(c0, line), add(r0, first)
        with em.region(f"scf.if {em.op(f'arith.andi {inside(c, sched.cols)}, {inside(r, sched.rows)} : i1')} {{"):
            values = [em.op(f"memref.load {tile}[{add(mul(add(first, em.index(lane)), TILE + 1), line)}] : {tile_type}")
                      for lane in range(VECTOR)]
            packed = em.op(f"vector.from_elements {', '.join(values)} : {vec}")
            em.line(f"vector.store {packed}, {dst}[{add(base, add(mul(c, sched.rows), r))}] {{alignment = 16}} : "
                    f"{dst_type}, {vec}")
    text = gpu_module_text(kernel.name, target, params, em.lines, BLOCK, [f"{tile} : {tile_type}"])
    return GpuModule(kernel.name, text, (sched.grid, 1, 1), (BLOCK, 1, 1), 0, str(sched))
