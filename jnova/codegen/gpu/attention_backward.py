"""The fused attention backward: two kernels that recompute P from the log-sum-exp (the Nova report's
pair, FlashAttention-2's schedule), neither holding a score matrix in memory.

dQ kernel, one block per (batch, q head, `block_m` query rows), warps of 16 query rows:
    delta = rowsum(dO * O) (from global memory, in the accumulator layout) -> delta (f32 [B, Hq, Tq])
    for key tiles up to the diagonal (the forward's bounds; only tiles crossing it or T masked):
        S = Q K^T ; P = 2^(S c - lse log2 e) ; dP = dO V^T ; dS = P (dP - delta) ; dQ += dS K
    dq = dQ * scale
dK/dV kernel, one block per (batch, kv head, `block_m` keys), warps of 16 keys, looping over the q
heads of the kv head's group and the q tiles from the causal lower bound (the first tile holding a
query >= the block's first key):
    S^T = K Q^T ; P^T = 2^(S^T c - lse) ; dV += P^T dO ; dP^T = V dO^T ; dS^T = P^T (dP^T - delta) ;
    dK += dS^T Q          then dk = dK * scale, dv = dV
Q, dO (dQ kernel) and K, V (dK/dV kernel) stay in shared memory; the other pair streams through a
cp.async ring, with the 64 lse and delta values of each q tile beside it in the dK/dV kernel.

Fragments as in `attention.py`: products over D read both operands K-major (ldmatrix); products
over keys or queries take their A operand from the C fragments in registers (dS, P^T, dS^T) and read
B N-major (ldmatrix.trans in bf16; in TF32 32-bit reads with the k8 step's permutation). `Warp`
holds these reads for any [rows][D] tile.

Kernel parameters: dQ: q, k, v, o, lse, do -> dq, delta; dK/dV: q, k, v, lse, delta, do -> dk, dv.
q, k, v, o and do are read through `attention_operands.RowView`s, several from one parameter where they are
views of one buffer (named for their roles: `%q_k_v`); the gradients are written in their own layouts,
or (dK/dV) into the concatenation of the gradients the step makes, with its other parts (dq) copied
there row by row after the key loop (`attention_operands.Concatenation`: dk, dv ->
`%concatenation`, the copied parts read from `%part<i>`).
"""
from __future__ import annotations

import math

from jnova.codegen.gpu.attention import (ELEMENT, FENCE_PROXY_ASYNC, LOG2E, MASKED, RowCopier, RowTile, default_name,
                                         exp2, instruction, ldmatrix, mma, mma_refusal, module_text, shuffle_xor,
                                         tf32, tree)
from jnova.codegen.gpu.attention_wgmma import WarpgroupProducts, pack_bf16
from jnova.codegen.gpu.attention_operands import (kernel_operands, natural_view, natural_views, operand_sizes,
                                                  written_concatenation)
from jnova.codegen.gpu.emitter import GpuEmitter, GpuModule
from jnova.codegen.gpu.matmul import GpuKernel
from jnova.codegen.gpu.matmul_smem import SMEM, ix_add, ix_op
from jnova.codegen.gpu.ptx import to_ptx
from jnova.errors import LoweringError
from jnova.passes.configure.attention_tiles import AttentionConfig, AttentionProblem
from jnova.passes.configure.attention_tiles import attention_refusal as problem_refusal
from jnova.runtime.target import Target

DQ_PARAMS = (("in", "q"), ("in", "k"), ("in", "v"), ("in", "o"), ("in", "lse"), ("in", "do"),
             ("out", "dq"), ("out", "delta"))
DKDV_PARAMS = (("in", "q"), ("in", "k"), ("in", "v"), ("in", "lse"), ("in", "delta"), ("in", "do"),
               ("out", "dk"), ("out", "dv"))


class Warp:
    """Per-lane fragment reads and the two products of a warp's 16-row strip."""

    def __init__(self, em: GpuEmitter, view: str, view_type: str, bf16: bool, tid: str):
        self.em, self.view, self.view_type, self.bf16 = em, view, view_type, bf16
        self.warp, lane = ix_op(em, "divui", tid, 32), ix_op(em, "remui", tid, 32)
        self.g, self.t = ix_op(em, "divui", lane, 4), ix_op(em, "remui", lane, 4)
        self.r8 = ix_op(em, "remui", lane, 8)
        self.odd8 = ix_op(em, "remui", ix_op(em, "divui", lane, 8), 2)
        self.half16 = ix_op(em, "divui", lane, 16)
        self.t2 = ix_op(em, "muli", self.t, 2)
        self.wrow = ix_op(em, "muli", self.warp, 16)
        self.kstep = 16 if bf16 else 8
        self.col_unit = 8 if bf16 else 4

    def a_reads(self, tile: RowTile, d: int) -> list[str]:
        """A fragments of the warp's 16 rows of `tile` ([rows][D]), per k step over D."""
        return [tile.offset([self.wrow, self.r8, (self.odd8, 8)], [ks * self.kstep, (self.half16, self.col_unit)])
                for ks in range(d // self.kstep)]

    def k_major_reads(self, tile: RowTile, d: int, n: int) -> list[list[str]]:
        """B fragments of A @ tile^T (tile [n][D]): per k step over D, per pair of n8 tiles."""
        return [[tile.offset([self.r8, (self.half16, 8), 16 * jp], [ks * self.kstep, (self.odd8, self.col_unit)])
                 for jp in range(n // 16)] for ks in range(d // self.kstep)]

    def n_major_reads(self, tile: RowTile, k: int, d: int) -> list[list]:
        """B fragments of C @ tile (tile [k][D]): per k step over the tile's rows, per d8 tile (TF32) or
        pair of d8 tiles (bf16, ldmatrix.trans)."""
        if self.bf16:
            return [[tile.offset([self.r8, (self.odd8, 8), 16 * kk], [(self.half16, 8), 16 * jp]) for jp in range(d // 16)]
                    for kk in range(k // 16)]
        return [[(tile.offset([self.t2, 8 * kk], [self.g, 8 * j]), tile.offset([self.t2, 8 * kk + 1], [self.g, 8 * j]))
                 for j in range(d // 8)] for kk in range(k // 8)]

    def rows_by_tile(self, a_reads, a_stage, b_reads, b_stage, n: int) -> list[list[str]]:
        """C = A B^T as n/8 accumulator tiles of 4 values (A: the strip, B: a [n][D] tile)."""
        em, bf16 = self.em, self.bf16
        zero = em.op("arith.constant 0.0 : f32")
        c = [[zero] * 4 for _ in range(n // 8)]
        for ks, at in enumerate(a_reads):
            a = ldmatrix(em, self.view, self.view_type, _plus(em, at, a_stage), 4, False, bf16)
            a = a if bf16 else tf32(em, a)
            for jp in range(n // 16):
                b = ldmatrix(em, self.view, self.view_type, _plus(em, b_reads[ks][jp], b_stage), 4, False, bf16)
                b = b if bf16 else tf32(em, b)
                for h in range(2):
                    c[2 * jp + h] = mma(em, a, b[2 * h:2 * h + 2], c[2 * jp + h], bf16)
        return c

    def accumulate(self, c_tiles: list[list[str]], b_reads, b_stage, acc: list[str], d: int) -> list[str]:
        """acc (d/8 tiles of 4, flat) += C @ B with C in registers (repacked into A fragments) and B a
        [k][D] tile read N-major."""
        em, bf16 = self.em, self.bf16
        acc = list(acc)
        for kk, reads in enumerate(b_reads):
            if bf16:
                a = [pack_bf16(em, c_tiles[2 * kk + h][2 * w], c_tiles[2 * kk + h][2 * w + 1])
                     for h in range(2) for w in range(2)]
            else:
                s = c_tiles[kk]
                a = tf32(em, [s[0], s[2], s[1], s[3]])
            for jd, read in enumerate(reads):
                if bf16:
                    b = ldmatrix(em, self.view, self.view_type, _plus(em, read, b_stage), 4, True, True)
                    pairs = [(2 * jd, b[0:2]), (2 * jd + 1, b[2:4])]
                else:
                    words = [em.op(f"memref.load {self.view}[{_plus(em, at, b_stage)}] : {self.view_type}") for at in read]
                    pairs = [(jd, tf32(em, words))]
                for j, bj in pairs:
                    acc[4 * j:4 * j + 4] = mma(em, a, bj, acc[4 * j:4 * j + 4], bf16)
        return acc


def _plus(em, at: str, stage: str | None) -> str:
    return at if stage is None else em.op(f"arith.addi {at}, {stage} : index")


def backward_smem_bytes(problem: AttentionProblem, config: AttentionConfig) -> int:
    return config.backward_smem_bytes(problem)


def backward_refusal(problem: AttentionProblem, config: AttentionConfig, target: Target) -> str | None:
    reason = problem_refusal(problem, target)
    if reason:
        return reason
    if config.block_m != 16 * config.warps or config.block_n % 16 or config.stages < 2:
        return f"{config}: warps of 16 rows, block_n a multiple of 16 and at least 2 stages"
    reason = mma_refusal(problem, config, target, config.block_n)
    if reason:
        return reason
    if config.threads < 2 * config.block_n:
        return f"{config}: the dK/dV kernel copies a q tile's lse and delta with one thread per value"
    if backward_smem_bytes(problem, config) > target.smem_per_block_optin:
        return f"{config}: {backward_smem_bytes(problem, config)} B of shared memory exceed {target.smem_per_block_optin} B"
    return None


def _setup(problem, config, target, name, kind, params, writes=None, inputs=None, views=None, input_sizes=None,
           concatenation=None):
    """What both kernels start with: parameters and their memrefs, the dynamic shared memory view, the
    thread id. `inputs`: the roles of each input parameter (default: each its own); `views`: where the
    operands lie in those parameters' buffers (`attention_operands.RowView`; default each its own layout);
    `input_sizes`: the elements of each input parameter's buffer (default: its first role's own size);
    `concatenation` (`attention_operands.Concatenation`, dK/dV only): dk and dv are written into one
    output buffer, `%concatenation`, beside the parts copied from the inputs with roles "part<i>"."""
    reason = backward_refusal(problem, config, target)
    if reason:
        raise LoweringError(f"cannot build an attention backward kernel for {problem}: {reason}")
    p = problem
    el = ELEMENT[p.dtype]
    sizes = operand_sizes(p)
    reads = [n for role, n in params if role == "in"]
    inputs = inputs or tuple((n,) for n in reads)
    parts = [f"part{i}" for i in range(len(concatenation.copies))] if concatenation else []
    if sorted(r for group in inputs for r in group) != sorted(reads + parts):
        raise LoweringError(f"attention {kind} kernel parameters {inputs}: expected {', '.join(reads + parts)} "
                            "each once")
    input_sizes = input_sizes or tuple(sizes[group[0]] for group in inputs)

    def memref(role, size):
        return f"memref<{size}x{'f32' if role in ('lse', 'delta') else el}>"
    memrefs = {r: (f"%{'_'.join(group)}", memref(group[0], input_sizes[i])) for i, group in enumerate(inputs)
               for r in group}
    if concatenation is not None:
        memrefs.update({r: ("%concatenation", memref(r, concatenation.size)) for r in ("dk", "dv")})
    else:
        outputs = [n for role, n in params if role == "out"] if writes is None else list(writes)
        memrefs.update({r: (f"%{r}", memref(r, sizes[r])) for r in outputs})
    views = {**natural_views(p), **(views or {})}
    em = GpuEmitter()
    smem = em.op(f"gpu.dynamic_shared_memory : memref<?xi8, {SMEM}>")
    total = backward_smem_bytes(p, config) // p.elem_bytes
    view_type = f"memref<{total}x{el}, {SMEM}>"
    view = em.op(f"memref.view {smem}[{em.index(0)}][] : memref<?xi8, {SMEM}> to {view_type}")
    tid = em.op("gpu.thread_id x")
    return em, memrefs, views, smem, view, view_type, tid, name or default_name(p, config, kind)


def _parameters(memrefs: dict) -> dict:
    """The kernel's parameters in order, each once (roles read from one buffer share one)."""
    return {ssa: (ssa, t) for ssa, t in memrefs.values()}


def _store_rows(em, memrefs, out: str, acc, scale, base, row_stride, row_g, t, limit, d, el, bf16):
    """acc (the warp's C fragments over D, rows row_g and row_g + 8) * scale -> out rows < limit (if written)."""
    if out not in memrefs:
        return
    for r in range(2):
        row = ix_add(em, row_g, 8 * r)
        inside = em.op(f"arith.cmpi ult, {row}, {em.index(limit)} : index")
        with em.region(f"scf.if {inside} {{"):
            at = ix_add(em, base, (row, row_stride), (t, 2))
            for j in range(d // 8):
                vals = [acc[4 * j + 2 * r + w] for w in range(2)]
                if scale is not None:
                    vals = [em.op(f"arith.mulf {x}, {scale} : f32") for x in vals]
                if bf16:
                    vals = [em.op(f"arith.truncf {x} : f32 to bf16") for x in vals]
                vec = em.op(f"vector.from_elements {vals[0]}, {vals[1]} : vector<2x{el}>")
                em.line(f"vector.store {vec}, {memrefs[out][0]}[{ix_add(em, at, 8 * j)}] : {memrefs[out][1]}, "
                        f"vector<2x{el}>")


def attention_dq_module(problem: AttentionProblem, config: AttentionConfig, target: Target,
                        name: str | None = None, writes=None, inputs=None, views=None,
                        input_sizes=None) -> GpuModule:
    """dq and delta (module docstring); `writes`: the outputs, in parameter order (default both);
    `inputs`, `views`, `input_sizes`: where the operands are read (`_setup`). LoweringError if it cannot."""
    p, cfg = problem, config
    em, memrefs, views, smem, view, view_type, tid, name = _setup(p, cfg, target, name, "dq", DQ_PARAMS, writes,
                                                                  inputs, views, input_sizes)
    el, bf16 = ELEMENT[p.dtype], p.dtype == "bfloat16"
    wgmma = cfg.mma == "wgmma"
    d, bm, bn = p.head_dim, cfg.block_m, cfg.block_n
    q_tiles, k_tiles = math.ceil(p.q_len / bm), math.ceil(p.kv_len / bn)
    q_tile = em.op(f"arith.subi {em.index(q_tiles - 1)}, {em.op('gpu.block_id x')} : index")
    head, batch = em.op("gpu.block_id y"), em.op("gpu.block_id z")
    kv_head = ix_op(em, "divui", head, p.group)
    q0 = ix_op(em, "muli", q_tile, bm)
    base = {r: views[r].base(em, batch, kv_head if r in ("k", "v") else head) for r in ("q", "k", "v", "o", "do")}
    dq_view = natural_view(p, p.q_heads, p.q_len)
    stage_elems = bn * d
    q_tile_s = RowTile(em, p, bm, view, view_type, 0)
    do_tile = RowTile(em, p, bm, view, view_type, bm * d)
    k_tile = RowTile(em, p, bn, view, view_type, 2 * bm * d)
    v_tile = RowTile(em, p, bn, view, view_type, 2 * bm * d + cfg.stages * stage_elems)
    q_copy = RowCopier(em, q_tile_s, p, cfg.threads, tid, *memrefs["q"], views["q"].row, p.q_len)
    do_copy = RowCopier(em, do_tile, p, cfg.threads, tid, *memrefs["do"], views["do"].row, p.q_len)
    k_copy = RowCopier(em, k_tile, p, cfg.threads, tid, *memrefs["k"], views["k"].row, p.kv_len)
    v_copy = RowCopier(em, v_tile, p, cfg.threads, tid, *memrefs["v"], views["v"].row, p.kv_len)
    w = Warp(em, view, view_type, bf16, tid)

    if p.causal:
        rows_end = em.op(f"arith.minui {ix_add(em, q0, bm)}, {em.index(p.q_len)} : index")
        end = em.op(f"arith.minui {ix_op(em, 'divui', ix_add(em, rows_end, bn - 1), bn)}, {em.index(k_tiles)} : index")
        full = em.op(f"arith.minui {ix_op(em, 'divui', ix_add(em, q0, 1), bn)}, {em.index(p.kv_len // bn)} : index")
        full = em.op(f"arith.minui {full}, {end} : index")
    else:
        end, full = em.index(k_tiles), em.index(p.kv_len // bn)

    q_copy.issue(base["q"], q0, None)
    do_copy.issue(base["do"], q0, None)
    k_copy.issue(base["k"], em.index(0), None)
    v_copy.issue(base["v"], em.index(0), None)
    em.line("nvvm.cp.async.commit.group")

    # delta = rowsum(dO * O) and lse * log2(e) for rows row_g, row_g + 8 (while the copies land)
    zero = em.op("arith.constant 0.0 : f32")
    log2e = em.op(f"arith.constant {LOG2E!r} : f32")
    row_g = ix_add(em, q0, w.wrow, w.g)
    rows_base = ix_op(em, "muli", ix_add(em, (batch, p.q_heads), head), p.q_len)
    deltas, lse2 = [], []
    for r in range(2):
        row = ix_add(em, row_g, 8 * r)
        inside = em.op(f"arith.cmpi ult, {row}, {em.index(p.q_len)} : index")
        safe = em.op(f"arith.select {inside}, {row}, {em.index(0)} : index")
        at = {r: ix_add(em, base[r], (safe, views[r].row), (w.t, 2)) for r in ("o", "do")}
        products = []
        for j in range(d // 8):
            pair = []
            for name_ in ("o", "do"):
                vec = em.op(f"vector.load {memrefs[name_][0]}[{ix_add(em, at[name_], 8 * j)}] : {memrefs[name_][1]}, "
                            f"vector<2x{el}>")
                pair.append([_widen(em, em.op(f"vector.extract {vec}[{i}] : {el} from vector<2x{el}>"), bf16)
                             for i in range(2)])
            products += [em.op(f"arith.mulf {pair[0][i]}, {pair[1][i]} : f32") for i in range(2)]
        total = tree(em, "arith.addf", products)
        for offset in (1, 2):
            total = em.op(f"arith.addf {total}, {shuffle_xor(em, total, offset)} : f32")
        deltas.append(em.op(f"arith.select {inside}, {total}, {zero} : f32"))
        lse = em.op(f"memref.load {memrefs['lse'][0]}[{ix_add(em, rows_base, safe)}] : {memrefs['lse'][1]}")
        lse2.append(em.op(f"arith.select {inside}, {em.op(f'arith.mulf {lse}, {log2e} : f32')}, {zero} : f32"))
        first = em.op(f"arith.cmpi eq, {w.t}, {em.index(0)} : index")
        store = em.op(f"arith.andi {inside}, {first} : i1")
        if "delta" in memrefs:
            with em.region(f"scf.if {store} {{"):
                em.line(f"memref.store {total}, {memrefs['delta'][0]}[{ix_add(em, rows_base, row)}] : {memrefs['delta'][1]}")

    c = em.op(f"arith.constant {p.softmax_scale * LOG2E!r} : f32")
    masked = em.op(f"arith.constant {MASKED:e} : f32")
    minus_lse2 = [em.op(f"arith.negf {x} : f32") for x in lse2]
    if wgmma:
        products = WarpgroupProducts(em, smem, tid, d)
    else:
        q_reads, do_reads = w.a_reads(q_tile_s, d), w.a_reads(do_tile, d)
        k_by_d, v_by_d = w.k_major_reads(k_tile, d, bn), w.k_major_reads(v_tile, d, bn)
        k_by_keys = w.n_major_reads(k_tile, bn, d)
    state = [zero] * (4 * (d // 8))
    types = ", ".join(["f32"] * len(state))

    def body(kt, acc, mask):
        em.line("nvvm.cp.async.wait.group 0")
        if wgmma:
            em.line(FENCE_PROXY_ASYNC)
        em.line("gpu.barrier")
        nxt = ix_add(em, kt, 1)
        with em.region(f"scf.if {em.op(f'arith.cmpi ult, {nxt}, {end} : index')} {{"):
            stage = ix_op(em, "muli", ix_op(em, "remui", nxt, cfg.stages), stage_elems)
            row0 = ix_op(em, "muli", nxt, bn)
            k_copy.issue(base["k"], row0, stage)
            v_copy.issue(base["v"], row0, stage)
        em.line("nvvm.cp.async.commit.group")
        stage = ix_op(em, "muli", ix_op(em, "remui", kt, cfg.stages), stage_elems)
        if wgmma:  # P is formed while dP's products run
            pending = products.issue_scores([(q_tile_s, None, k_tile, stage), (do_tile, None, v_tile, stage)], bn)
            s = products.ready(pending[0], 1)
        else:
            s = w.rows_by_tile(q_reads, None, k_by_d, stage, bn)
        if mask:
            _mask(em, s, ix_op(em, "muli", kt, bn), w.t, [row_g, ix_add(em, row_g, 8)], p, masked, keys_are_columns=True)
        prob = [[exp2(em, em.op(f"math.fma {s[j][i]}, {c}, {minus_lse2[i // 2]} : f32")) for i in range(4)]
                for j in range(bn // 8)]
        dp = products.ready(pending[1], 0) if wgmma else w.rows_by_tile(do_reads, None, v_by_d, stage, bn)
        ds = [[em.op(f"arith.mulf {prob[j][i]}, {em.op(f'arith.subf {dp[j][i]}, {deltas[i // 2]} : f32')} : f32")
               for i in range(4)] for j in range(bn // 8)]
        if wgmma:
            return products.accumulate(ds, k_tile, stage, acc)
        return w.accumulate(ds, k_by_keys, stage, acc, d)

    state = _loops(em, state, types, [(em.index(0), full, False), (full, end, True)], body)
    em.line("nvvm.cp.async.wait.group 0")
    scale = em.op(f"arith.constant {p.softmax_scale!r} : f32")
    _store_rows(em, memrefs, "dq", state, scale, dq_view.base(em, batch, head), dq_view.row, row_g, w.t, p.q_len,
                d, el, bf16)
    text = module_text(name, _parameters(memrefs), em.lines, cfg.threads, target)
    schedule = f"attention[dq {instruction(cfg, bf16)}] {p} {cfg}"
    return GpuModule(name, text, (q_tiles, p.q_heads, p.batch), (cfg.threads, 1, 1), backward_smem_bytes(p, cfg),
                     schedule)


def attention_dkdv_module(problem: AttentionProblem, config: AttentionConfig, target: Target,
                          name: str | None = None, writes=None, inputs=None, views=None,
                          input_sizes=None, concatenation=None) -> GpuModule:
    """dk and dv (module docstring): block_m keys per block, q tiles of block_n rows streamed;
    `writes`: the outputs, in parameter order (default both); `inputs`, `views`, `input_sizes`: where
    the operands are read; `concatenation`: dk and dv written into it, its other parts copied (`_setup`)."""
    p, cfg = problem, config
    em, memrefs, views, smem, view, view_type, tid, name = _setup(p, cfg, target, name, "dkdv", DKDV_PARAMS, writes,
                                                                  inputs, views, input_sizes, concatenation)
    el, bf16 = ELEMENT[p.dtype], p.dtype == "bfloat16"
    wgmma = cfg.mma == "wgmma"
    d, bk, bq = p.head_dim, cfg.block_m, cfg.block_n
    key_tiles, q_tiles = math.ceil(p.kv_len / bk), math.ceil(p.q_len / bq)
    key_tile = em.op("gpu.block_id x")
    kv_head, batch = em.op("gpu.block_id y"), em.op("gpu.block_id z")
    n0 = ix_op(em, "muli", key_tile, bk)
    if concatenation is not None:  # where dk and dv are stored: their places in it, or their own layout
        out_views = concatenation.views
    else:
        out_views = dict.fromkeys(("dk", "dv"), natural_view(p, p.kv_heads, p.kv_len))
    bases = {r: v.base(em, batch, kv_head) for r, v in (("k", views["k"]), ("v", views["v"]), *out_views.items())}
    stage_elems = bq * d
    k_tile = RowTile(em, p, bk, view, view_type, 0)
    v_tile = RowTile(em, p, bk, view, view_type, bk * d)
    q_ring = RowTile(em, p, bq, view, view_type, 2 * bk * d)
    do_ring = RowTile(em, p, bq, view, view_type, 2 * bk * d + cfg.stages * stage_elems)
    vec_base = (2 * bk * d + 2 * cfg.stages * stage_elems) * p.elem_bytes  # bytes: lse and delta per stage
    k_copy = RowCopier(em, k_tile, p, cfg.threads, tid, *memrefs["k"], views["k"].row, p.kv_len)
    v_copy = RowCopier(em, v_tile, p, cfg.threads, tid, *memrefs["v"], views["v"].row, p.kv_len)
    q_copy = RowCopier(em, q_ring, p, cfg.threads, tid, *memrefs["q"], views["q"].row, p.q_len)
    do_copy = RowCopier(em, do_ring, p, cfg.threads, tid, *memrefs["do"], views["do"].row, p.q_len)
    rows_view_type = f"memref<{cfg.stages * 2 * bq}xf32, {SMEM}>"
    rows_view = em.op(f"memref.view {smem}[{em.index(vec_base)}][] : memref<?xi8, {SMEM}> to {rows_view_type}")
    w = Warp(em, view, view_type, bf16, tid)

    # iterations: (q head of the group, q tile from the causal lower bound), flattened
    lo = ix_op(em, "divui", n0, bq) if p.causal else em.index(0)
    per_head = em.op(f"arith.subi {em.index(q_tiles)}, {lo} : index")
    total = ix_op(em, "muli", per_head, p.group)
    first_head = ix_op(em, "muli", kv_head, p.group)
    rows_per_batch = p.q_heads * p.q_len

    def tile_of(it):
        head = ix_add(em, first_head, em.op(f"arith.divui {it}, {per_head} : index"))
        qtile = ix_add(em, lo, em.op(f"arith.remui {it}, {per_head} : index"))
        return head, ix_op(em, "muli", qtile, bq)

    def issue(it, stage_index):
        head, q0 = tile_of(it)
        stage = ix_op(em, "muli", stage_index, stage_elems)
        q_copy.issue(views["q"].base(em, batch, head), q0, stage)
        do_copy.issue(views["do"].base(em, batch, head), q0, stage)
        # lse and delta of the tile's rows, one f32 per thread (4-byte copies: the rows need not be aligned)
        which = ix_op(em, "divui", tid, bq)  # 0: lse, 1: delta
        row = ix_op(em, "remui", tid, bq)
        inside = em.op(f"arith.cmpi ult, {ix_add(em, q0, row)}, {em.index(p.q_len)} : index")
        count = em.op(f"arith.select {inside}, {em.index(1)}, {em.index(0)} : index")
        src_at = em.op(f"arith.select {inside}, {ix_add(em, (batch, rows_per_batch), (head, p.q_len), q0, row)}, "
                       f"{em.index(0)} : index")
        dst = ix_add(em, (stage_index, 2 * bq), (which, bq), row)
        for k, name_ in enumerate(("lse", "delta")):
            mine = em.op(f"arith.cmpi eq, {which}, {em.index(k)} : index")
            with em.region(f"scf.if {mine} {{"):
                em.op(f"nvgpu.device_async_copy {memrefs[name_][0]}[{src_at}], {rows_view}[{dst}], 1, {count} : "
                      f"{memrefs[name_][1]} to {rows_view_type}")

    k_copy.issue(bases["k"], n0, None)
    v_copy.issue(bases["v"], n0, None)
    with em.region(f"scf.if {em.op(f'arith.cmpi ugt, {total}, {em.index(0)} : index')} {{"):
        issue(em.index(0), em.index(0))
    em.line("nvvm.cp.async.commit.group")

    zero = em.op("arith.constant 0.0 : f32")
    c = em.op(f"arith.constant {p.softmax_scale * LOG2E!r} : f32")
    log2e = em.op(f"arith.constant {LOG2E!r} : f32")
    masked = em.op(f"arith.constant {MASKED:e} : f32")
    key_g = ix_add(em, n0, w.wrow, w.g)
    if wgmma:
        products = WarpgroupProducts(em, smem, tid, d)
    else:
        k_reads, v_reads = w.a_reads(k_tile, d), w.a_reads(v_tile, d)
        q_by_d, do_by_d = w.k_major_reads(q_ring, d, bq), w.k_major_reads(do_ring, d, bq)
        q_by_rows, do_by_rows = w.n_major_reads(q_ring, bq, d), w.n_major_reads(do_ring, bq, d)
    n_acc = 4 * (d // 8)
    state = [zero] * (2 * n_acc)  # dK, dV
    types = ", ".join(["f32"] * len(state))

    def body(it, acc, _masked_loop):
        em.line("nvvm.cp.async.wait.group 0")
        if wgmma:
            em.line(FENCE_PROXY_ASYNC)
        em.line("gpu.barrier")
        nxt = ix_add(em, it, 1)
        with em.region(f"scf.if {em.op(f'arith.cmpi ult, {nxt}, {total} : index')} {{"):
            issue(nxt, ix_op(em, "remui", nxt, cfg.stages))
        em.line("nvvm.cp.async.commit.group")
        stage_index = ix_op(em, "remui", it, cfg.stages)
        stage = ix_op(em, "muli", stage_index, stage_elems)
        _, q0 = tile_of(it)
        # lse * log2 e and delta of this lane's columns 8j + 2t, 8j + 2t + 1
        col_at = ix_add(em, (stage_index, 2 * bq), (w.t, 2))
        lse2, delta = [], []
        for j in range(bq // 8):
            for which, out in ((0, lse2), (bq, delta)):
                vec = em.op(f"vector.load {rows_view}[{ix_add(em, col_at, which + 8 * j)}] : {rows_view_type}, "
                            f"vector<2xf32>")
                out.append([em.op(f"vector.extract {vec}[{i}] : f32 from vector<2xf32>") for i in range(2)])
        if wgmma:  # P^T is formed while dP^T's products run, dS^T while dV's do
            pending = products.issue_scores([(k_tile, None, q_ring, stage), (v_tile, None, do_ring, stage)], bq)
            s = products.ready(pending[0], 1)
        else:
            s = w.rows_by_tile(k_reads, None, q_by_d, stage, bq)
        _mask(em, s, q0, w.t, [key_g, ix_add(em, key_g, 8)], p, masked, keys_are_columns=False)
        minus_lse2 = [[em.op(f"arith.negf {em.op(f'arith.mulf {x}, {log2e} : f32')} : f32") for x in pair]
                      for pair in lse2]
        prob = [[exp2(em, em.op(f"math.fma {s[j][i]}, {c}, {minus_lse2[j][i % 2]} : f32")) for i in range(4)]
                for j in range(bq // 8)]
        if wgmma:  # dV's products run while dS^T is formed; dK's wait for both
            dv = products.accumulate(prob, do_ring, stage, acc[n_acc:], wait=False)
            dp = products.ready(pending[1], 1)
        else:
            dv = w.accumulate(prob, do_by_rows, stage, acc[n_acc:], d)
            dp = w.rows_by_tile(v_reads, None, do_by_d, stage, bq)
        ds = [[em.op(f"arith.mulf {prob[j][i]}, {em.op(f'arith.subf {dp[j][i]}, {delta[j][i % 2]} : f32')} : f32")
               for i in range(4)] for j in range(bq // 8)]
        if wgmma:
            dk = products.accumulate(ds, q_ring, stage, acc[:n_acc])
        else:
            dk = w.accumulate(ds, q_by_rows, stage, acc[:n_acc], d)
        return dk + dv

    state = _loops(em, state, types, [(em.index(0), total, True)], body)
    em.line("nvvm.cp.async.wait.group 0")
    scale = em.op(f"arith.constant {p.softmax_scale!r} : f32")
    for role, acc, factor in (("dk", state[:n_acc], scale), ("dv", state[n_acc:], None)):
        _store_rows(em, memrefs, role, acc, factor, bases[role], out_views[role].row, key_g, w.t, p.kv_len, d, el,
                    bf16)
    grid = (key_tiles, p.kv_heads, p.batch)
    for i, (_, shape, offset, strides) in enumerate(concatenation.copies if concatenation is not None else ()):
        block = ix_add(em, key_tile, (kv_head, grid[0]), (batch, grid[0] * grid[1]))
        _copy_rows(em, memrefs[f"part{i}"], memrefs["dk"], shape, offset, strides, el, p.elem_bytes,
                   ix_add(em, (block, cfg.threads), tid), math.prod(grid) * cfg.threads)
    text = module_text(name, _parameters(memrefs), em.lines, cfg.threads, target)
    schedule = f"attention[dkdv {instruction(cfg, bf16)}] {p} {cfg}"
    return GpuModule(name, text, grid, (cfg.threads, 1, 1), backward_smem_bytes(p, cfg), schedule)


def _copy_rows(em, src, dst, shape, offset: int, strides, el: str, elem_bytes: int, thread: str, threads: int):
    """Every row of the part `src` (row-major, `shape`) into `dst` at `offset + sum(i_k strides_k)`, in
    16-byte chunks spread over all `threads` of the grid (`thread`: this one's index among them)."""
    vec = 16 // elem_bytes
    row_len = shape[-1]
    per_row = row_len // vec
    total = math.prod(shape[:-1]) * per_row
    vtype = f"vector<{vec}x{el}>"
    it = em.fresh("copy")
    with em.region(f"scf.for {it} = {em.index(0)} to {em.index(-(-total // threads))} step {em.index(1)} {{"):
        chunk = ix_add(em, (it, threads), thread)
        with em.region(f"scf.if {em.op(f'arith.cmpi ult, {chunk}, {em.index(total)} : index')} {{"):
            row, col = ix_op(em, "divui", chunk, per_row), ix_op(em, "muli", ix_op(em, "remui", chunk, per_row), vec)
            terms, rest = [], row
            for k in reversed(range(len(shape) - 1)):
                terms.append((ix_op(em, "remui", rest, shape[k]), strides[k]))
                rest = ix_op(em, "divui", rest, shape[k])
            x = em.op(f"vector.load {src[0]}[{ix_add(em, (row, row_len), col)}] : {src[1]}, {vtype}")
            em.line(f"vector.store {x}, {dst[0]}[{ix_add(em, offset, *terms, col)}] : {dst[1]}, {vtype}")


def _widen(em, x: str, bf16: bool) -> str:
    """bf16 -> f32 as bits (see `GpuEmitter.bf16_to_f32`: no extf, whose math LLVM folds into bf16)."""
    if not bf16:
        return x
    wide = em.op(f"arith.extui {em.op(f'arith.bitcast {x} : bf16 to i16')} : i16 to i32")
    return em.op(f"arith.bitcast {em.op(f'arith.shli {wide}, {em.i32(16)} : i32')} : i32 to f32")


def _mask(em, s, first_col: str, t: str, rows: list[str], p: AttentionProblem, masked: str, keys_are_columns: bool):
    """Scores past the columns' end, or (causal) with key > query, become `masked` (from the indices).
    keys_are_columns: columns are keys and rows queries (dQ kernel), else the transpose (dK/dV)."""
    col_t = ix_add(em, first_col, (t, 2))
    limit = p.kv_len if keys_are_columns else p.q_len
    for j in range(len(s)):
        for i in range(4):
            col = ix_add(em, col_t, 8 * j + i % 2)
            bad = em.op(f"arith.cmpi uge, {col}, {em.index(limit)} : index")
            if p.causal:
                key, query = (col, rows[i // 2]) if keys_are_columns else (rows[i // 2], col)
                bad = em.op(f"arith.ori {bad}, {em.op(f'arith.cmpi ugt, {key}, {query} : index')} : i1")
            s[j][i] = em.op(f"arith.select {bad}, {masked}, {s[j][i]} : f32")


def _loops(em, state, types, ranges, body):
    for lo, hi, mask in ranges:
        kt, args = em.fresh("kt"), [em.fresh("st") for _ in state]
        result = em.fresh("loop")
        with em.region(f"{result}:{len(state)} = scf.for {kt} = {lo} to {hi} step {em.index(1)} "
                       f"iter_args({', '.join(f'{a} = {v}' for a, v in zip(args, state))}) -> ({types}) {{"):
            em.line(f"scf.yield {', '.join(body(kt, args, mask))} : {types}")
        state = [f"{result}#{i}" for i in range(len(state))]
    return state


def build_attention_dq(problem, config, target, name=None) -> GpuKernel:
    module = attention_dq_module(problem, config, target, name)
    major, minor = target.compute_capability
    return GpuKernel(module.name, to_ptx(module.text), module.grid, module.block, module.shared_mem_bytes, DQ_PARAMS,
                     10 * major + minor, module.schedule, module.text)


def build_attention_dkdv(problem, config, target, name=None) -> GpuKernel:
    module = attention_dkdv_module(problem, config, target, name)
    major, minor = target.compute_capability
    return GpuKernel(module.name, to_ptx(module.text), module.grid, module.block, module.shared_mem_bytes,
                     DKDV_PARAMS, 10 * major + minor, module.schedule, module.text)


# -- nova.attention_dq / nova.attention_dkdv plan kernels (the kernel families in compile.py)

ROLES = {"nova.attention_dq": ("q", "k", "v", "o", "lse", "do"),
         "nova.attention_dkdv": ("q", "k", "v", "lse", "delta", "do")}


def _half_refusal(kernel, op_name: str) -> str | None:
    from jnova.codegen.gpu.attention import attention_problem

    ops = [op for op in kernel.ops if op.name.startswith("nova.attention")]
    if len(ops) != 1 or ops[0].name != op_name:
        return f"not one {op_name} op"
    op = ops[0]
    if len(set(map(id, op.operands))) != len(op.operands):
        return "the op's operands are not distinct values"
    concatenation, reason = written_concatenation(kernel, op) if op_name == "nova.attention_dkdv" else (None, None)
    if reason:
        return reason
    if not kernel.outputs or (concatenation is None and not set(kernel.outputs) <= set(op.results)):
        return "the kernel writes other values than the op's results"
    _, reason = kernel_operands(kernel, op, ROLES[op_name], concatenation.ops if concatenation else frozenset())
    return reason or attention_problem(op)[1]


def attention_dq_kernel_refusal(kernel) -> str | None:
    return _half_refusal(kernel, "nova.attention_dq")


def attention_dkdv_kernel_refusal(kernel) -> str | None:
    return _half_refusal(kernel, "nova.attention_dkdv")


def _half_module(kernel, target: Target, module_of, names):
    from jnova.codegen.gpu.attention import attention_problem
    from jnova.passes.configure.attention_tiles import choose_attention_tiles

    op = next(op for op in kernel.ops if op.name in ROLES)
    problem, _ = attention_problem(op)
    concatenation, _ = written_concatenation(kernel, op)
    where, _ = kernel_operands(kernel, op, ROLES[op.name], concatenation.ops if concatenation else frozenset())
    parts = {index: f"part{i}" for i, (index, *_) in enumerate(concatenation.copies if concatenation else ())}
    inputs = tuple(tuple(role for role, (index, _) in where.items() if index == i) + ((parts[i],) if i in parts else ())
                   for i in range(len(kernel.inputs)))
    views = {role: view for role, (_, view) in where.items() if view is not None}
    config = choose_attention_tiles(problem, target, backward=True)
    sizes = tuple(v.type.size for v in kernel.inputs)
    if concatenation is not None:
        return module_of(problem, config, target, kernel.name, None, inputs, views, sizes, concatenation)
    writes = tuple(names[op.results.index(r)] for r in kernel.outputs)
    return module_of(problem, config, target, kernel.name, writes, inputs, views, sizes)


def build_attention_dq_kernel(kernel, target: Target) -> GpuModule:
    return _half_module(kernel, target, attention_dq_module, ("dq", "delta"))


def build_attention_dkdv_kernel(kernel, target: Target) -> GpuModule:
    return _half_module(kernel, target, attention_dkdv_module, ("dk", "dv"))
