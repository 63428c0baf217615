"""Operand tiles of a contraction: their shared-memory layout and the global -> shared copies.

A tile is stored as panels 128 bytes wide (32 f32 or 64 bf16), each panel `rows` x 128 bytes with
its 16-byte chunks XOR-swizzled by row, so the MMA operand reads are bank-conflict free:

  K-major operand (K contiguous in global memory: A as [M, K], B given as [N, K])
      panels along K, each [mn rows][128 B of K];
  MN-major operand (M or N contiguous: B as [K, N], A given as [K, M])
      panels along M or N, each [bk rows][128 B of M or N].

Swizzle `"rows8"` (chunk ^ row % 8) is the hardware's 128-byte swizzle that wgmma descriptors
describe, and what ldmatrix reads conflict-free; `"rows4x2"` (chunk ^ 2 * (row % 4)) is for the
32-bit scalar fragment reads of MN-major TF32 operands (lanes read rows t = 0..3, columns g = 0..7);
`"rows4x5"` (chunk ^ {0, 1, 4, 5}[row % 4]) for their 16-byte reads (each 8-lane phase reads rows
t = 0..3 at chunks c and c + 2).

Copies: every thread moves `vector` consecutive elements per copy (16, 8 or 4 bytes through
`cp.async`, with the bytes past the matrix edge zero-filled), or, when a row of the operand is not
4-byte aligned (odd K or N in bf16), single elements through registers (`sync`).

A `transposed` tile lies MN-major in global memory but K-major in shared memory (wgmma takes TF32
operands only K-major): its copies are 4-byte `cp.async`s that transpose on the way. Each warp moves an
8 (mn) x 4 (k) group: the lanes with one k read 32 consecutive bytes of a global row (one sector),
and the 32 stores land in 8 distinct swizzle chunks at 4 distinct offsets within them, so in 32
distinct banks.
"""
from __future__ import annotations

from dataclasses import dataclass

from jnova.codegen.gpu.emitter import GpuEmitter

PANEL_BYTES = 128
CHUNK_BYTES = 16
SMEM = "#gpu.address_space<workgroup>"


def ix_add(em: GpuEmitter, *terms) -> str:
    """Sum of index terms: SSA names, (SSA, constant factor) pairs and integers."""
    total = None
    const = sum(x for x in terms if isinstance(x, int))
    for x in terms:
        if isinstance(x, tuple):
            x = em.op(f"arith.muli {x[0]}, {em.index(x[1])} : index")
        if isinstance(x, str):
            total = x if total is None else em.op(f"arith.addi {total}, {x} : index")
    if total is None:
        return em.index(const)
    return em.op(f"arith.addi {total}, {em.index(const)} : index") if const else total


def ix_op(em: GpuEmitter, op: str, x: str, constant: int) -> str:
    """`x <op> constant` on index values (op: muli, divui, remui, ...)."""
    return em.op(f"arith.{op} {x}, {em.index(constant)} : index")


@dataclass(frozen=True)
class OperandTile:
    """One operand's `mn` x `bk` tile per pipeline stage (`mn` rows of M for A, of N for B)."""

    name: str  # "a" or "b"
    element: str  # MLIR element type: f32, bf16, f16
    elem_bytes: int
    mn: int  # tile extent along M (A) or N (B)
    bk: int  # tile extent along K
    k_major: bool  # K contiguous within the smem panels (and in global memory unless `transposed`)
    swizzle: str  # "rows8" or "rows4x2"
    extent_mn: int  # the matrix's full M (A) or N (B)
    extent_k: int  # the matrix's K
    transposed: bool = False  # global memory has the other layout: copied element by element
    stride: int = 0  # elements between rows in global memory when not the matrix's own width (split-K A)

    def __post_init__(self):
        inner = self.bk if self.k_major else self.mn
        if inner * self.elem_bytes % PANEL_BYTES:
            raise ValueError(f"operand {self.name}: a tile row of {inner} x {self.elem_bytes} B is not a whole number "
                             f"of {PANEL_BYTES}-byte panels")
        if self.transposed and not (self.k_major and self.elem_bytes == 4 and self.mn % 8 == 0 and self.bk % 4 == 0):
            raise ValueError(f"operand {self.name}: transposing copies take 4-byte elements into a K-major tile of "
                             f"whole 8 x 4 groups (tile {self.mn}x{self.bk}, {self.elem_bytes} B)")

    @property
    def global_k_major(self) -> bool:
        """K contiguous in global memory."""
        return self.k_major != self.transposed

    @property
    def panel_elems(self) -> int:
        return PANEL_BYTES // self.elem_bytes

    @property
    def panel_rows(self) -> int:
        return self.mn if self.k_major else self.bk

    @property
    def panel_bytes(self) -> int:
        return self.panel_rows * PANEL_BYTES

    @property
    def bytes(self) -> int:
        return self.mn * self.bk * self.elem_bytes

    @property
    def leading(self) -> int:
        """Elements between consecutive rows in global memory."""
        if self.stride:
            return self.stride
        return self.extent_k if self.global_k_major else self.extent_mn

    @property
    def global_rows(self) -> int:
        """Rows of the tile as it lies in global memory (its contiguous dimension is `global_cols`)."""
        return self.mn if self.global_k_major else self.bk

    @property
    def global_cols(self) -> int:
        return self.bk if self.global_k_major else self.mn

    @property
    def vector(self) -> int:
        """Elements per copy: the widest of 16/8/4 bytes that keeps every row start aligned, else 1
        (always 1 for a transposed tile)."""
        if self.transposed:
            return 1
        row_bytes = self.leading * self.elem_bytes
        for nbytes in (16, 8, 4):
            if row_bytes % nbytes == 0 and self.global_cols * self.elem_bytes % nbytes == 0:
                return nbytes // self.elem_bytes
        return 1

    def invariant_shift(self) -> tuple[int, int]:
        """(mn, k) steps that move an element by a constant number of bytes: whole swizzle periods
        of rows, whole panels of columns."""
        rows = 8 if self.swizzle == "rows8" else 4
        return (rows, self.panel_elems) if self.k_major else (self.panel_elems, rows)

    def shift_bytes(self, d_mn: int, d_k: int) -> int:
        """The byte distance of a shift by (d_mn, d_k), multiples of `invariant_shift()`."""
        rows, cols = (d_mn, d_k) if self.k_major else (d_k, d_mn)
        return rows * PANEL_BYTES + cols // self.panel_elems * self.panel_bytes

    def memref(self, stages: int) -> str:
        return f"memref<{stages * self.mn * self.bk}x{self.element}, {SMEM}>"

    def swizzled_offset(self, em: GpuEmitter, row: str, col_bytes: str) -> str:
        """Byte offset within a panel of byte `col_bytes` (< 128) of panel row `row` (index values)."""
        chunk = em.op(f"arith.shrui {col_bytes}, {em.index(4)} : index")
        within = em.op(f"arith.andi {col_bytes}, {em.index(CHUNK_BYTES - 1)} : index")
        if self.swizzle == "rows8":
            key = em.op(f"arith.andi {row}, {em.index(7)} : index")
        elif self.swizzle == "rows4x5":  # row % 4 -> 0, 1, 4, 5
            two = em.op(f"arith.andi {row}, {em.index(2)} : index")
            key = em.op(f"arith.addi {em.op(f'arith.andi {row}, {em.index(3)} : index')}, {two} : index")
        else:
            key = em.op(f"arith.shli {em.op(f'arith.andi {row}, {em.index(3)} : index')}, {em.index(1)} : index")
        chunk = em.op(f"arith.xori {chunk}, {key} : index")
        at = em.op(f"arith.addi {em.op(f'arith.muli {row}, {em.index(PANEL_BYTES)} : index')}, "
                   f"{em.op(f'arith.shli {chunk}, {em.index(4)} : index')} : index")
        return em.op(f"arith.addi {at}, {within} : index")

    def byte_offset(self, em: GpuEmitter, mn: str, k: str) -> str:
        """Byte offset in a stage of element (mn, k) of the tile (tile-relative index values)."""
        if self.k_major:
            panel_of, row, inner = k, mn, k
        else:
            panel_of, row, inner = mn, k, mn
        per_panel = em.index(self.panel_elems)
        panel = em.op(f"arith.divui {panel_of}, {per_panel} : index")
        col_bytes = em.op(f"arith.muli {em.op(f'arith.remui {inner}, {per_panel} : index')}, "
                          f"{em.index(self.elem_bytes)} : index")
        base = em.op(f"arith.muli {panel}, {em.index(self.panel_bytes)} : index")
        return em.op(f"arith.addi {base}, {self.swizzled_offset(em, row, col_bytes)} : index")


@dataclass
class TileCopier:
    """Emits the copies of one operand's k-th tile into a stage, for `threads` threads.

    Per-thread state (its rows, columns and shared-memory offsets) is computed once, before the main
    loop; `issue` then only adds the k-tile's offset and the stage's base.
    """

    tile: OperandTile
    threads: int
    src: str  # the operand's memref (global)
    src_type: str
    dst: str  # the operand's stage ring (shared, typed)
    dst_type: str
    batch_offset: str  # elements to the start of this batch's matrix
    mn0: str  # first M (A) or N (B) index of the block's tile
    elements: int = 0  # elements in the whole operand buffer (all batches)
    copies: list = None

    def prepare(self, em: GpuEmitter, tid: str) -> None:
        """Per copy round: (smem element offset, global offset, k within the tile, mn in range, active,
        mn index). Rounds after the first are the first shifted by whole rows, written as constant
        offsets so they fold into the addresses instead of holding registers."""
        t = self.tile
        if t.transposed:
            if self.elements <= 0:
                raise ValueError(f"operand {t.name}: a transposed tile's copier needs the buffer's element count")
            self._prepare_transposed(em, tid)
            return
        vec = t.vector
        per_row = t.global_cols // vec
        chunks = t.global_rows * per_row
        rounds = -(-chunks // self.threads)
        step = self.threads // per_row  # rows between rounds
        regular = self.threads % per_row == 0 and step % 8 == 0
        self.copies = []
        first = None
        for i in range(rounds):
            c = ix_add(em, tid, i * self.threads)
            if regular and first is not None:
                smem0, gofs0, k0, _, _, mn0 = first
                shift = i * step
                smem = ix_add(em, smem0, shift * PANEL_BYTES // t.elem_bytes)
                gofs = ix_add(em, gofs0, shift * t.leading)
                k = k0 if t.k_major else ix_add(em, k0, shift)
                mn_abs = ix_add(em, mn0, shift) if t.k_major else mn0
            else:
                row = ix_op(em, "divui", c, per_row)
                col = ix_op(em, "muli", ix_op(em, "remui", c, per_row), vec)
                mn, k = (row, col) if t.k_major else (col, row)
                smem = ix_op(em, "divui", t.byte_offset(em, mn, k), t.elem_bytes)
                mn_abs = ix_add(em, self.mn0, mn)
                outer = ix_add(em, self.mn0, row) if t.k_major else row
                inner = col if t.k_major else ix_add(em, self.mn0, col)
                gofs = ix_add(em, self.batch_offset, (outer, t.leading), inner)
            active = None
            if (i + 1) * self.threads > chunks:  # the last round: only the first threads have a chunk
                active = em.op(f"arith.cmpi ult, {c}, {em.index(chunks)} : index")
            mn_ok = em.op(f"arith.cmpi ult, {mn_abs}, {em.index(t.extent_mn)} : index")
            self.copies.append((smem, gofs, k, mn_ok, active, mn_abs))
            if first is None:
                first = self.copies[0]

    def _prepare_transposed(self, em: GpuEmitter, tid: str) -> None:
        """Copy rounds of a transposed tile: round i's warp w moves 8 x 4 group i * warps + w, groups
        numbered along k first; when the warps cover whole rows of groups, later rounds are the first
        shifted by whole multiples of 8 rows of mn (constant offsets, the swizzle unchanged).

        Rows past the M (N) edge are not masked: they read whatever lies at their flat address, clamped
        into the buffer, and only reach rows (columns) of C that the epilogue does not store; a
        predicate per round would be a live register per round through the main loop."""
        t = self.tile
        warps, k_groups = self.threads // 32, t.bk // 4
        groups = k_groups * (t.mn // 8)
        rounds = -(-groups // warps)
        lane, warp = ix_op(em, "remui", tid, 32), ix_op(em, "divui", tid, 32)
        regular = warps % k_groups == 0
        self.copies, first = [], None
        for i in range(rounds):
            if regular and first is not None:
                smem0, gofs0, k0, _, _, mn0 = first
                shift = i * warps // k_groups * 8
                smem = ix_add(em, smem0, t.shift_bytes(shift, 0) // t.elem_bytes)
                gofs, k, mn_abs = ix_add(em, gofs0, shift), k0, ix_add(em, mn0, shift)
            else:
                group = ix_add(em, warp, i * warps)
                k = ix_add(em, (ix_op(em, "remui", group, k_groups), 4), ix_op(em, "divui", lane, 8))
                mn = ix_add(em, (ix_op(em, "divui", group, k_groups), 8), ix_op(em, "remui", lane, 8))
                smem = ix_op(em, "divui", t.byte_offset(em, mn, k), t.elem_bytes)
                mn_abs = ix_add(em, self.mn0, mn)
                gofs = ix_add(em, self.batch_offset, (k, t.leading), mn_abs)
            active = None
            if (i + 1) * warps > groups:
                active = em.op(f"arith.cmpi ult, {ix_add(em, warp, i * warps)}, {em.index(groups)} : index")
            self.copies.append((smem, gofs, k, None, active, mn_abs))
            if first is None:
                first = self.copies[0]

    def issue(self, em: GpuEmitter, kt: str, stage_elems: str) -> None:
        """Copy k-tile `kt` (an index value) into the stage starting at element `stage_elems`."""
        t = self.tile
        vec = t.vector
        k0 = em.op(f"arith.muli {kt}, {em.index(t.bk)} : index")
        step = t.bk if t.global_k_major else t.bk * t.leading
        kofs = em.op(f"arith.muli {kt}, {em.index(step)} : index")
        k_inside = {}  # transposed tiles: k row -> whether it lies before the K edge (shared by rounds)
        for smem, gofs, k, mn_ok, active, mn_abs in self.copies:
            if t.transposed:  # one element; zero past the K edge, past the M (N) edge anything in the buffer
                if k not in k_inside:
                    k_inside[k] = em.op(f"arith.cmpi ult, {em.op(f'arith.addi {k0}, {k} : index')}, "
                                        f"{em.index(t.extent_k)} : index")
                keep = k_inside[k]
                count = em.op(f"arith.select {keep}, {em.index(1)}, {em.index(0)} : index")
                src = em.op(f"arith.minui {em.op(f'arith.addi {gofs}, {kofs} : index')}, "
                            f"{em.index(self.elements - 1)} : index")
            else:
                k_abs = em.op(f"arith.addi {k0}, {k} : index")
                if t.global_k_major:  # the vector runs along K: partial at the K edge
                    left = em.op(f"arith.subi {em.index(t.extent_k)}, {em.op(f'arith.minui {k_abs}, {em.index(t.extent_k)} : index')} : index")
                    count = em.op(f"arith.select {mn_ok}, {em.op(f'arith.minui {left}, {em.index(vec)} : index')}, {em.index(0)} : index")
                else:  # the vector runs along M or N: partial at that edge
                    k_ok = em.op(f"arith.cmpi ult, {k_abs}, {em.index(t.extent_k)} : index")
                    left = em.op(f"arith.subi {em.index(t.extent_mn)}, {em.op(f'arith.minui {mn_abs}, {em.index(t.extent_mn)} : index')} : index")
                    count = em.op(f"arith.select {k_ok}, {em.op(f'arith.minui {left}, {em.index(vec)} : index')}, {em.index(0)} : index")
                src = em.op(f"arith.addi {gofs}, {kofs} : index")
                keep = em.op(f"arith.cmpi ne, {count}, {em.index(0)} : index")
            src = em.op(f"arith.select {keep}, {src}, {em.index(0)} : index")
            dst = em.op(f"arith.addi {stage_elems}, {smem} : index")
            if active is not None:
                with em.region(f"scf.if {active} {{"):
                    self._copy(em, src, dst, count, vec)
            else:
                self._copy(em, src, dst, count, vec)

    def _copy(self, em: GpuEmitter, src: str, dst: str, count: str, vec: int) -> None:
        t = self.tile
        if vec > 1 or t.elem_bytes >= 4:
            bypass = " {bypassL1}" if vec * t.elem_bytes == 16 else ""
            em.op(f"nvgpu.device_async_copy {self.src}[{src}], {self.dst}[{dst}], {vec}, {count}{bypass} : "
                  f"{self.src_type} to {self.dst_type}")
            return
        # 2-byte elements on rows that are not 4-byte aligned: through registers (no cp.async size fits)
        x = em.op(f"memref.load {self.src}[{src}] : {self.src_type}")
        zero = em.op(f"arith.constant 0.0 : {t.element}")
        ok = em.op(f"arith.cmpi ne, {count}, {em.index(0)} : index")
        em.line(f"memref.store {em.op(f'arith.select {ok}, {x}, {zero} : {t.element}')}, {self.dst}[{dst}] : "
                f"{self.dst_type}")
