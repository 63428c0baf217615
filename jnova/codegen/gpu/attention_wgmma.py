"""The products of the attention kernels on Hopper tensor cores: `wgmma.mma_async` per warpgroup.

The forward and backward kernels (`attention.py`, `attention_backward.py`) compute two kinds of
products over a warp's 16 rows; with `WarpgroupProducts` a warpgroup (4 warps, 64 rows) issues each as
one asynchronous instruction per k16 step instead of 8 x n/8 mma.sync per warp:

  scores      C = A B^T, A a [rows][D] tile (the warpgroup's 64 rows), B a [n][D] tile, both read by
              the tensor cores from shared memory (two K-major matrix descriptors): S = Q K^T,
              dP = dO V^T, S^T = K Q^T, dP^T = V dO^T.  m64nNk16, N = n.
  accumulate  acc += C B, C (64 x k) in registers (P, dS, P^T, dS^T packed to bf16 in the accumulator
              layout, which is the A operand's register layout), B a [k][D] tile read N-major
              through one descriptor (the "transposed B" of 16-bit wgmma):  O += P V, dQ += dS K,
              dV += P^T dO, dK += dS^T Q.  m64nNk16, N = D.

Both return values in the accumulator layout, which for a warp is mma.sync's C fragment layout: value
4j + w of lane l in warp w' of the warpgroup is C[16w' + l/4 + 8(w / 2), 8j + 2(l % 4) + w % 2]. So the
kernels' softmax, masks and stores work on the same lists of values either way, and warp w' of the
block owns rows 16w' .. 16w' + 15 as with mma.sync (warpgroup g holds warps 4g .. 4g + 3).

Shared-memory descriptors (PTX ISA, "Matrix Descriptor Format"), the tiles being `attention.RowTile`s:
panels 128 bytes wide (64 bf16 of D), each [rows][128 B] with 16-byte chunks XOR-swizzled by row % 8,
the hardware's 128-byte swizzle when a tile starts 1024-byte aligned (every tile does: rows are
multiples of 8 and the dynamic shared memory is aligned to 1024). Offsets in 16-byte units:
  K-major (scores, both operands): start + 32 B per k16 step inside a panel, + panel bytes per 64
      columns of D; SBO = 1024 (8 rows of 128 B); LBO unused (1).
  N-major (accumulate's B, [k][D]): start + 16 rows x 128 B per k16 step; LBO = panel bytes (the
      next 64 columns of D); SBO = 1024 (8 rows of k).
The register-A form has no MLIR op (nvgpu and nvvm expose the shared-memory form only): it is one
line of inline PTX per instruction, `wgmma_rs`. A `wgmma.fence` precedes every batch whose A or
accumulator registers ordinary instructions wrote; `commit` + `wait 0` precede every read of a result.
"""
from __future__ import annotations

from jnova.codegen.gpu.emitter import GpuEmitter
from jnova.codegen.gpu.matmul_smem import PANEL_BYTES
from jnova.codegen.gpu.matmul_wgmma import GROUP_ROWS_BYTES, SWIZZLE_128B, WGMMA_M

K_STEP = 16  # bf16 wgmma: k16 per instruction


def descriptor_bits(leading: int, stride: int) -> int:
    """The constant fields of a 128-byte-swizzled descriptor (LBO, SBO in bytes), as a signed i64."""
    bits = ((leading >> 4) << 16) | ((stride >> 4) << 32) | (SWIZZLE_128B << 62)
    return bits - (1 << 64) if bits >= 1 << 63 else bits


class WarpgroupProducts:
    """The two products of the attention kernels for the warpgroup of thread `tid`, on bf16 tiles in
    the dynamic shared memory `smem` (the `RowTile`s' elements are bf16 offsets from its start)."""

    def __init__(self, em: GpuEmitter, smem: str, tid: str, head_dim: int):
        self.em, self.d = em, head_dim
        base = em.op(f"memref.extract_aligned_pointer_as_index {smem} : memref<?xi8, #gpu.address_space<workgroup>> "
                     f"-> index")
        self.base = em.op(f"arith.index_cast {base} : index to i64")
        group = em.op(f"arith.divui {tid}, {em.index(128)} : index")
        self.group_rows = em.op(f"arith.index_cast {em.op(f'arith.muli {group}, {em.index(WGMMA_M)} : index')} "
                                f": index to i64")
        self.k_major_bits = descriptor_bits(16, GROUP_ROWS_BYTES)
        self.one = em.i32(1)

    # -- descriptors
    def _i64(self, value: int) -> str:
        return self.em.op(f"arith.constant {value} : i64")

    def _descriptor(self, tile, stage: str | None, offset_bytes: int, bits: int, own_rows: bool) -> str:
        """The descriptor of `tile` (its ring stage `stage`, an element offset, or None), `offset_bytes`
        further, from the warpgroup's first row when `own_rows`."""
        em = self.em
        address = em.op(f"arith.addi {self.base}, {self._i64(tile.base_bytes + offset_bytes)} : i64")
        if own_rows:  # the warpgroup's 64 rows: 64 x 128 B into every panel
            address = em.op(f"arith.addi {address}, {em.op(f'arith.muli {self.group_rows}, {self._i64(PANEL_BYTES)} : i64')} : i64")
        if stage is not None:
            stage_bytes = em.op(f"arith.index_cast {em.op(f'arith.muli {stage}, {em.index(2)} : index')} : index to i64")
            address = em.op(f"arith.addi {address}, {stage_bytes} : i64")
        field = em.op(f"arith.andi {em.op(f'arith.shrui {address}, {self._i64(4)} : i64')}, {self._i64(0x3FFF)} : i64")
        return em.op(f"arith.ori {field}, {self._i64(bits)} : i64")

    def _k_offset(self, tile, k: int) -> int:
        """Bytes from a K-major tile's start to column k of D (64 bf16 per panel)."""
        return (k // 64) * tile.layout.panel_bytes + (k % 64) * 2

    # -- products
    def scores(self, pairs, n: int) -> list[list[list[str]]]:
        """For each (a_tile, a_stage, b_tile, b_stage): C = A B^T over D for the warpgroup's 64 rows of A
        and the n rows of B, issued together and waited for once; each C as n/8 tiles of 4 values."""
        pending = self.issue_scores(pairs, n)
        return [self.ready(p, 0) for p in pending]

    def issue_scores(self, pairs, n: int) -> list[tuple[str, str, int]]:
        """The products of `scores`, each committed as a group of its own and not waited for: handles
        for `ready`, which the groups reach in this order."""
        em = self.em
        acc_type = "!llvm.struct<(" + ", ".join(["f32"] * (n // 2)) + ")>"
        em.line("nvvm.wgmma.fence.aligned")
        pending = []
        for a, a_stage, b, b_stage in pairs:
            acc = em.op(f"llvm.mlir.zero : {acc_type}")
            for ks in range(self.d // K_STEP):
                da = self._descriptor(a, a_stage, self._k_offset(a, ks * K_STEP), self.k_major_bits, True)
                db = self._descriptor(b, b_stage, self._k_offset(b, ks * K_STEP), self.k_major_bits, False)
                acc = em.op(f"nvvm.wgmma.mma_async {da}, {db}, {acc}, #nvvm.shape<m = {WGMMA_M}, n = {n}, k = {K_STEP}>, "
                            f"D [<f32>, #nvvm.wgmma_scale_out<{'zero' if ks == 0 else 'one'}>, <wrapped>], "
                            f"A [<bf16>, #nvvm.wgmma_scale_in<one>, <row>], B [<bf16>, #nvvm.wgmma_scale_in<one>, <col>] "
                            f": {acc_type} -> {acc_type}")
            em.line("nvvm.wgmma.commit.group.sync.aligned")
            pending.append((acc, acc_type, n))
        return pending

    def ready(self, pending: tuple[str, str, int], in_flight: int) -> list[list[str]]:
        """A product of `issue_scores` as n/8 tiles of 4 values, after waiting until at most `in_flight`
        groups committed after it (or not yet waited for) are still running."""
        acc, acc_type, n = pending
        self.wait(in_flight)
        return [[self.em.op(f"llvm.extractvalue {acc}[{4 * j + w}] : {acc_type}") for w in range(4)]
                for j in range(n // 8)]

    def accumulate(self, c_tiles: list[list[str]], b, b_stage: str | None, acc: list[str],
                   wait: bool = True) -> list[str]:
        """acc (D/2 values, accumulator layout) += C B: C's n/8 tiles of 4 f32 (n keys or queries) packed
        to bf16 as A fragments, B the [n][D] tile `b` read N-major. Committed; waited for (every group in
        flight) only when `wait`."""
        em, d = self.em, self.d
        bits = descriptor_bits(b.layout.panel_bytes, GROUP_ROWS_BYTES)
        words = [[pack_bf16(em, c_tiles[2 * kk + h][2 * w], c_tiles[2 * kk + h][2 * w + 1])
                  for h in range(2) for w in range(2)] for kk in range(len(c_tiles) // 2)]
        em.line("nvvm.wgmma.fence.aligned")
        acc = list(acc)
        for kk, a in enumerate(words):
            db = self._descriptor(b, b_stage, kk * K_STEP * PANEL_BYTES, bits, False)
            acc = wgmma_rs(em, a, db, acc, self.one, d)
        em.line("nvvm.wgmma.commit.group.sync.aligned")
        if wait:
            self.wait()
        return acc

    def wait(self, in_flight: int = 0) -> None:
        """Until at most `in_flight` committed groups of this warpgroup are still running."""
        self.em.line(f"nvvm.wgmma.wait.group.sync.aligned {in_flight}")


def pack_bf16(em: GpuEmitter, lo: str, hi: str) -> str:
    """Two f32 values as one i32 of two bf16 (lo in the low half: the lower column)."""
    pair = em.op(f"vector.from_elements {em.op(f'arith.truncf {lo} : f32 to bf16')}, "
                 f"{em.op(f'arith.truncf {hi} : f32 to bf16')} : vector<2xbf16>")
    return em.op(f"vector.extract {em.op(f'vector.bitcast {pair} : vector<2xbf16> to vector<1xi32>')}[0] : "
                 f"i32 from vector<1xi32>")


def wgmma_rs(em: GpuEmitter, a: list[str], b_desc: str, acc: list[str], scale_d: str, n: int) -> list[str]:
    """acc += A B, m64nNk16 bf16: A as 4 i32 words per lane (accumulator layout), B N-major through
    `b_desc`; inline PTX (the register-A form), the accumulators tied in and out."""
    regs = n // 2
    outs = ", ".join(f"${i}" for i in range(regs))
    asm = (f"{{ .reg .pred p; setp.ne.b32 p, ${regs + 5}, 0; wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 "
           f"{{{outs}}}, {{${regs}, ${regs + 1}, ${regs + 2}, ${regs + 3}}}, ${regs + 4}, p, 1, 1, 1; }}")
    constraints = ",".join(["=f"] * regs + ["r"] * 4 + ["l", "r"] + [str(i) for i in range(regs)])
    struct = "!llvm.struct<(" + ", ".join(["f32"] * regs) + ")>"
    types = ", ".join(["i32"] * 4 + ["i64", "i32"] + ["f32"] * regs)
    out = em.op(f'llvm.inline_asm has_side_effects "{asm}", "{constraints}" {", ".join([*a, b_desc, scale_d, *acc])} '
                f": ({types}) -> {struct}")
    return [em.op(f"llvm.extractvalue {out}[{i}] : {struct}") for i in range(regs)]
