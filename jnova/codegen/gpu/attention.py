"""The fused attention forward kernel: O = softmax(scale * Q K^T [causal]) V and the log-sum-exp, with
the scores and probabilities only ever in registers (FlashAttention-2's schedule on `mma.sync`).

One block per (batch, q head, `block_m` query rows), `warps` warps of 16 query rows each. Blocks of
the last query tiles start first (x is reversed): under a causal mask they have the longest key loop.

    prologue: cp.async Q tile, K/V tile 0 -> stage 0 ; commit
    for kt over K/V tiles (first the unmasked ones, then those crossing the diagonal or T):
        wait for tile kt ; barrier ; cp.async K/V tile kt+1 -> the other stage ; commit
        S = Q K^T                 mma.sync (bf16 m16n8k16 or TF32 m16n8k8), f32 accumulators
        [masked tiles: keys past Tk or past the query's row -> -1e30, from the indices]
        m' = max(m, rowmax(S) * c)            c = scale * log2(e), rows reduced over the quad (shfl 1, 2)
        P = 2^(S c - m')  (ex2.approx.ftz) ;  l = l 2^(m - m') + rowsum(P) ;  O = O 2^(m - m')
        O += P V                  P repacked from S's C fragments into A fragments in registers
    O / l -> o (q's dtype) ;  lse = (m + log2 l) ln 2 -> lse (f32, natural log)

The causal key loop stops at the diagonal tile (its upper bound is clamped) and only the tiles that
cross the diagonal or the end of the keys are masked; the mask value is finite so no row ever sees
inf - inf (every row's first tile holds key 0). GQA: kv head = q head // (Hq / Hkv). Layouts "bthd"
and "bhtd" only change strides. Rows past T are zero-filled by the copies and never stored.

Shared memory: Q [block_m][D] and a ring of `stages` K and V tiles [block_n][D], rows of 128-byte
panels with 16-byte chunks XOR-swizzled by row (`matmul_smem.OperandTile`, "rows8"), so ldmatrix and
the TF32 path's 32-bit reads of V are bank-conflict free.

Fragments (PTX ISA; g = lane / 4, t = lane % 4), bf16 m16n8k16:
  A: a0a1 (g, 2t) a2a3 (g+8, 2t) a4a5 (g, 2t+8) a6a7 (g+8, 2t+8)   B: b0b1 (k=2t, n=g) b2b3 (k=2t+8, n=g)
  C: c0 c1 (g, 2t..2t+1)  c2 c3 (g+8, 2t..2t+1)
  Q and K are read with ldmatrix.x4, V with ldmatrix.x4.trans (V is N-major for P V). P's A fragment
  for keys 16kk.. is S tile 2kk's (c0 c1, c2 c3) and tile 2kk+1's (c0 c1, c2 c3), each pair as bf16x2.
TF32 m16n8k8: A: a0 (g, t) a1 (g+8, t) a2 (g, t+4) a3 (g+8, t+4); B: b0 (k=t, n=g) b1 (k=t+4, n=g).
  Q and K by ldmatrix.x4 on 32-bit words (as `matmul_mma.py`). P's A fragment for keys 8kk.. is S tile
  kk's (c0, c2, c1, c3): A column t stands for key 2t and column t+4 for key 2t+1, a permutation of the
  keys inside the k8 step that V's fragment follows (b0 = V[2t][g], b1 = V[2t+1][g], 32-bit reads:
  ldmatrix.trans moves 16-bit halves and is wrong for 32-bit data). Operands are rounded to TF32 (rna).

Kernel parameters: q, k, v, o, lse (flat, 16-byte aligned pointers). q, k and v are read through
`attention_operands.RowView`s (offset, batch, head and row strides): a plan kernel whose q, k, v are
slices of one buffer (a fused projection, `passes/view_attention_operands.py`) takes that buffer once
and reads the slices where they lie. o and lse are written in their own layouts.
"""
from __future__ import annotations

import math

from jnova.codegen.gpu.attention_operands import kernel_operands, natural_view, natural_views, operand_sizes
from jnova.codegen.gpu.attention_wgmma import WarpgroupProducts, pack_bf16
from jnova.codegen.gpu.emitter import GpuEmitter, GpuModule, ptx_features
from jnova.codegen.gpu.matmul import ALIGN, GpuKernel
from jnova.codegen.gpu.matmul_smem import SMEM, OperandTile, ix_add, ix_op
from jnova.codegen.gpu.ptx import to_ptx
from jnova.errors import LoweringError
from jnova.passes.configure.attention_tiles import AttentionConfig, AttentionProblem, choose_attention_tiles
from jnova.passes.configure.attention_tiles import attention_refusal as problem_refusal
from jnova.runtime.target import Target

ELEMENT = {"float32": "f32", "bfloat16": "bf16"}
MASKED = -1.0e30  # finite: 2^(MASKED - m) is 0 and MASKED - MASKED is no NaN
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
ACC = "!llvm.struct<(f32, f32, f32, f32)>"
FENCE_PROXY_ASYNC = "nvvm.fence.proxy {kind = #nvvm.proxy_kind<async.shared>, space = #nvvm.shared_space<cta>}"
PARAMS = (("in", "q"), ("in", "k"), ("in", "v"), ("out", "o"), ("out", "lse"))


def build_attention_forward(problem: AttentionProblem, config: AttentionConfig, target: Target,
                            name: str | None = None) -> GpuKernel:
    module = attention_forward_module(problem, config, target, name)
    major, minor = target.compute_capability
    return GpuKernel(module.name, to_ptx(module.text), module.grid, module.block, module.shared_mem_bytes, PARAMS,
                     10 * major + minor, module.schedule, module.text)


def default_name(problem: AttentionProblem, config: AttentionConfig, kind: str = "fwd") -> str:
    p = problem
    return (f"attention_{kind}_{ELEMENT[p.dtype]}_{p.layout}_{p.batch}x{p.q_heads}x{p.kv_heads}x{p.q_len}x{p.kv_len}"
            f"x{p.head_dim}{'_causal' if p.causal else ''}_{config.block_m}x{config.block_n}_w{config.warps}"
            f"_s{config.stages}{'_wgmma' if config.mma == 'wgmma' else ''}")


def refusal(problem: AttentionProblem, config: AttentionConfig, target: Target) -> str | None:
    reason = problem_refusal(problem, target)
    if reason:
        return reason
    if config.block_m != 16 * config.warps:
        return f"{config}: each warp owns 16 query rows, so block_m must be 16 x warps"
    if config.block_n % 16 or config.stages < 2:
        return f"{config}: block_n must be a multiple of 16 and stages at least 2"
    reason = mma_refusal(problem, config, target, config.block_n)
    if reason:
        return reason
    if config.smem_bytes(problem) > target.smem_per_block_optin:
        return f"{config}: {config.smem_bytes(problem)} B of shared memory exceed {target.smem_per_block_optin} B"
    return None


def mma_refusal(problem: AttentionProblem, config: AttentionConfig, target: Target, score_columns: int) -> str | None:
    """Why a kernel's products cannot run on the config's MMA instruction (`score_columns`: the n of its
    scores products), or None."""
    if config.mma == "mma.sync":
        return None
    if config.mma != "wgmma":
        return f"{config}: unknown MMA instruction {config.mma!r} (mma.sync or wgmma)"
    if not target.has("wgmma") or problem.dtype != "bfloat16":
        return f"{config}: wgmma products take bf16 operands on a target with wgmma ({target.name}, {problem.dtype})"
    if config.block_m % 64 or score_columns % 16 or score_columns > 256:
        return (f"{config}: wgmma products need warpgroups of 64 rows and scores of 16 to 256 columns "
                f"(block_m {config.block_m}, {score_columns} columns)")
    return None


class RowTile:
    """A [rows][D] tile in shared memory (128-byte panels, rows8 swizzle) and its cp.async copies."""

    def __init__(self, em: GpuEmitter, problem: AttentionProblem, rows: int, view: str, view_type: str, base: int):
        self.em, self.rows, self.view, self.view_type, self.base = em, rows, view, view_type, base
        e = problem.elem_bytes
        self.base_bytes = base * e  # from the start of the dynamic shared memory (the views start there)
        self.layout = OperandTile("t", ELEMENT[problem.dtype], e, rows, problem.head_dim, True, "rows8",
                                  rows, problem.head_dim)
        self.elems = rows * problem.head_dim
        self.anchors = {}

    def offset(self, row_terms: list, col_terms: list) -> str:
        """Element offset (from the view's start, stage 0) of (sum(row_terms), sum(col_terms)): per-lane
        anchors for the parts the swizzle sees, constant shifts for whole 8-row groups and panels."""
        em, layout = self.em, self.layout
        const_r = sum(x for x in row_terms if isinstance(x, int))
        const_c = sum(x for x in col_terms if isinstance(x, int))
        rest_r, rest_c = const_r % 8, const_c % layout.panel_elems
        key = (tuple(x for x in row_terms if not isinstance(x, int)), rest_r,
               tuple(x for x in col_terms if not isinstance(x, int)), rest_c)
        if key not in self.anchors:
            row = ix_add(em, *key[0], rest_r) if key[0] else em.index(rest_r)
            col = ix_add(em, *key[2], rest_c) if key[2] else em.index(rest_c)
            byte = layout.byte_offset(em, row, col)
            self.anchors[key] = ix_add(em, ix_op(em, "divui", byte, layout.elem_bytes), self.base)
        shift = layout.shift_bytes(const_r - rest_r, const_c - rest_c) // layout.elem_bytes
        return ix_add(em, self.anchors[key], shift)


class RowCopier:
    """One thread's 16-byte cp.async copies of a [rows][D] tile from rows `row0 ..` of an operand."""

    def __init__(self, em: GpuEmitter, tile: RowTile, problem: AttentionProblem, threads: int, tid: str,
                 src: str, src_type: str, row_stride: int, extent: int):
        self.em, self.tile, self.src, self.src_type, self.extent = em, tile, src, src_type, extent
        self.row_stride = row_stride
        d, e = problem.head_dim, problem.elem_bytes
        self.vec = 16 // e
        per_row = d // self.vec
        chunks = tile.rows * per_row
        if chunks % threads or threads % per_row:
            raise LoweringError(f"a {tile.rows}x{d} tile is not a whole number of copy rounds for {threads} threads")
        self.rounds = chunks // threads
        self.step = threads // per_row  # rows between rounds
        self.row = ix_op(em, "divui", tid, per_row)
        self.col = ix_op(em, "muli", ix_op(em, "remui", tid, per_row), self.vec)
        self.smem = [tile.offset([self.row, r * self.step], [self.col]) for r in range(self.rounds)]

    def issue(self, base: str, row0: str, stage_elems: str | None) -> None:
        """Copy rows row0 .. row0 + rows of the operand starting at element `base` (rows past `extent`
        are zero-filled) into the stage starting `stage_elems` elements after the tile's first."""
        em = self.em
        first = ix_add(em, base, (ix_add(em, row0, self.row), self.row_stride), self.col)
        left = em.op(f"arith.subi {em.index(self.extent)}, {row0} : index")  # rows of the operand from row0 on
        for r in range(self.rounds):
            ok = em.op(f"arith.cmpi slt, {ix_add(em, self.row, r * self.step)}, {left} : index")
            src = em.op(f"arith.select {ok}, {ix_add(em, first, r * self.step * self.row_stride)}, {em.index(0)} : index")
            count = em.op(f"arith.select {ok}, {em.index(self.vec)}, {em.index(0)} : index")
            dst = self.smem[r] if stage_elems is None else em.op(f"arith.addi {self.smem[r]}, {stage_elems} : index")
            em.op(f"nvgpu.device_async_copy {self.src}[{src}], {self.tile.view}[{dst}], {self.vec}, {count} "
                  f"{{bypassL1}} : {self.src_type} to {self.tile.view_type}")


def attention_forward_module(problem: AttentionProblem, config: AttentionConfig, target: Target,
                             name: str | None = None, inputs=(("q",), ("k",), ("v",)),
                             outputs=("o", "lse"), views: dict | None = None,
                             input_sizes: tuple[int, ...] | None = None) -> GpuModule:
    """The gpu.module text of the forward kernel (no compilation); LoweringError if it cannot.

    `inputs`: the roles of each input parameter, in order (("q", "k"), ("v",) where q is k, or
    ("q", "k", "v"), where all three are views of one buffer); `outputs`: the results written, in
    parameter order (a result nobody reads may be left out); `views`: where q, k and v lie in their
    parameters' buffers (`attention_operands.RowView`, default: each its own layout); `input_sizes`:
    the elements of each input parameter's buffer (default: its first role's own size)."""
    reason = refusal(problem, config, target)
    if reason:
        raise LoweringError(f"cannot build an attention kernel for {problem}: {reason}")
    roles = [r for group in inputs for r in group]
    if sorted(roles) != ["k", "q", "v"] or not outputs or not set(outputs) <= {"o", "lse"} \
            or len(set(outputs)) != len(outputs):
        raise LoweringError(f"attention kernel parameters {inputs} -> {outputs}: expected q, k and v each once "
                            "and some of o and lse")
    p, cfg = problem, config
    name = name or default_name(p, cfg)
    e, el = p.elem_bytes, ELEMENT[p.dtype]
    bf16 = p.dtype == "bfloat16"
    wgmma = cfg.mma == "wgmma"
    d, bm, bn = p.head_dim, cfg.block_m, cfg.block_n
    em = GpuEmitter()
    sizes = operand_sizes(p)
    input_sizes = input_sizes or tuple(sizes[group[0]] for group in inputs)
    types = {r: f"memref<{sizes[r]}x{el if r != 'lse' else 'f32'}>" for r in ("o", "lse")}
    params = {f"in{i}": (f"%in{i}", f"memref<{input_sizes[i]}x{el}>") for i in range(len(inputs))}
    params.update({f"out{i}": (f"%out{i}", types[r]) for i, r in enumerate(outputs)})
    memrefs = {r: params[f"in{i}"] for i, group in enumerate(inputs) for r in group}
    memrefs.update({r: (f"%out{i}", types[r]) for i, r in enumerate(outputs)})
    views = {**natural_views(p), **(views or {})}
    q_tiles = math.ceil(p.q_len / bm)
    k_tiles = math.ceil(p.kv_len / bn)

    tid = em.op("gpu.thread_id x")
    q_tile = em.op(f"arith.subi {em.index(q_tiles - 1)}, {em.op('gpu.block_id x')} : index")
    head = em.op("gpu.block_id y")
    batch = em.op("gpu.block_id z")
    kv_head = ix_op(em, "divui", head, p.group)
    warp, lane = ix_op(em, "divui", tid, 32), ix_op(em, "remui", tid, 32)
    g, t = ix_op(em, "divui", lane, 4), ix_op(em, "remui", lane, 4)
    q0 = ix_op(em, "muli", q_tile, bm)
    q_base, k_base, v_base = (views[r].base(em, batch, h) for r, h in (("q", head), ("k", kv_head), ("v", kv_head)))
    o_view = natural_view(p, p.q_heads, p.q_len)
    o_base = o_view.base(em, batch, head)

    smem = em.op(f"gpu.dynamic_shared_memory : memref<?xi8, {SMEM}>")
    total = cfg.smem_bytes(p) // e
    view_type = f"memref<{total}x{el}, {SMEM}>"
    view = em.op(f"memref.view {smem}[{em.index(0)}][] : memref<?xi8, {SMEM}> to {view_type}")
    stage_elems = bn * d
    q_tile_smem = RowTile(em, p, bm, view, view_type, 0)
    k_tile = RowTile(em, p, bn, view, view_type, bm * d)
    v_tile = RowTile(em, p, bn, view, view_type, bm * d + cfg.stages * stage_elems)

    q_copy = RowCopier(em, q_tile_smem, p, cfg.threads, tid, *memrefs["q"], views["q"].row, p.q_len)
    k_copy = RowCopier(em, k_tile, p, cfg.threads, tid, *memrefs["k"], views["k"].row, p.kv_len)
    v_copy = RowCopier(em, v_tile, p, cfg.threads, tid, *memrefs["v"], views["v"].row, p.kv_len)

    # the key loop's bounds: tiles [0, full) need no mask, [full, end) do
    if p.causal:
        rows_end = em.op(f"arith.minui {ix_add(em, q0, bm)}, {em.index(p.q_len)} : index")
        end = em.op(f"arith.minui {ix_op(em, 'divui', ix_add(em, rows_end, bn - 1), bn)}, {em.index(k_tiles)} : index")
        full = em.op(f"arith.minui {ix_op(em, 'divui', ix_add(em, q0, 1), bn)}, "
                     f"{em.index(min(p.kv_len // bn, k_tiles))} : index")
        full = em.op(f"arith.minui {full}, {end} : index")
    else:
        end, full = em.index(k_tiles), em.index(p.kv_len // bn)

    q_copy.issue(q_base, q0, None)
    k_copy.issue(k_base, em.index(0), None)
    v_copy.issue(v_base, em.index(0), None)
    em.line("nvvm.cp.async.commit.group")

    if wgmma:  # the warpgroup's products read the tiles through descriptors
        products = WarpgroupProducts(em, smem, tid, d)
        wrow = ix_op(em, "muli", warp, 16)
    else:
        q_reads, k_reads, v_reads, wrow = _fragment_reads(em, q_tile_smem, k_tile, v_tile, lane, warp, g, t, d, bn,
                                                          bf16)
    kstep = 16 if bf16 else 8

    c = p.softmax_scale * LOG2E
    zero = em.op("arith.constant 0.0 : f32")
    masked = em.op(f"arith.constant {MASKED:e} : f32")
    scale_log2 = em.op(f"arith.constant {c!r} : f32")
    row_g = ix_add(em, q0, wrow, g)  # this lane's rows: row_g and row_g + 8
    n_tiles = d // 8
    state = [masked, masked, zero, zero] + [zero] * (4 * n_tiles)  # m (2 rows), l (2 rows), O accumulators
    state_types = ", ".join(["f32"] * len(state))

    def body(kt: str, values: list[str], mask: bool) -> list[str]:
        m_old, l_old, o = values[0:2], values[2:4], values[4:]
        em.line("nvvm.cp.async.wait.group 0")
        if wgmma:  # the copies' writes, seen by the tensor cores' (async proxy) reads
            em.line(FENCE_PROXY_ASYNC)
        em.line("gpu.barrier")
        nxt = ix_add(em, kt, 1)
        more = em.op(f"arith.cmpi ult, {nxt}, {end} : index")
        with em.region(f"scf.if {more} {{"):
            stage = ix_op(em, "muli", ix_op(em, "remui", nxt, cfg.stages), stage_elems)
            row0 = ix_op(em, "muli", nxt, bn)
            k_copy.issue(k_base, row0, stage)
            v_copy.issue(v_base, row0, stage)
        em.line("nvvm.cp.async.commit.group")
        stage = ix_op(em, "muli", ix_op(em, "remui", kt, cfg.stages), stage_elems)

        # S = Q K^T
        if wgmma:
            s = products.scores([(q_tile_smem, None, k_tile, stage)], bn)[0]
        else:
            s = _scores_mma_sync(em, view, view_type, q_reads, k_reads, stage, zero, d, bn, bf16)
        if mask:
            key0 = ix_op(em, "muli", kt, bn)
            key_t = ix_add(em, key0, (t, 2))
            rows = [row_g, ix_add(em, row_g, 8)]
            for j in range(bn // 8):
                for w in range(4):
                    key = ix_add(em, key_t, 8 * j + w % 2)
                    bad = em.op(f"arith.cmpi uge, {key}, {em.index(p.kv_len)} : index")
                    if p.causal:
                        future = em.op(f"arith.cmpi ugt, {key}, {rows[w // 2]} : index")
                        bad = em.op(f"arith.ori {bad}, {future} : i1")
                    s[j][w] = em.op(f"arith.select {bad}, {masked}, {s[j][w]} : f32")

        # online softmax, base 2
        m_new, alpha, l_new = [], [], []
        for r in range(2):
            row_max = tree(em, "arith.maxnumf", [s[j][2 * r + w] for j in range(bn // 8) for w in range(2)])
            for offset in (1, 2):
                row_max = em.op(f"arith.maxnumf {row_max}, {shuffle_xor(em, row_max, offset)} : f32")
            m = em.op(f"arith.maxnumf {m_old[r]}, {em.op(f'arith.mulf {row_max}, {scale_log2} : f32')} : f32")
            m_new.append(m)
            alpha.append(exp2(em, em.op(f"arith.subf {m_old[r]}, {m} : f32")))
        minus_m = [em.op(f"arith.negf {m} : f32") for m in m_new]
        for j in range(bn // 8):
            for w in range(4):
                s[j][w] = exp2(em, em.op(f"math.fma {s[j][w]}, {scale_log2}, {minus_m[w // 2]} : f32"))
        for r in range(2):
            row_sum = tree(em, "arith.addf", [s[j][2 * r + w] for j in range(bn // 8) for w in range(2)])
            l_new.append(em.op(f"math.fma {l_old[r]}, {alpha[r]}, {row_sum} : f32"))
        o = [em.op(f"arith.mulf {o[i]}, {alpha[(i % 4) // 2]} : f32") for i in range(len(o))]

        # O += P V
        if wgmma:
            return m_new + l_new + products.accumulate(s, v_tile, stage, o)
        for kk in range(bn // kstep):
            if bf16:
                a = [pack_bf16(em, s[2 * kk + h][2 * w], s[2 * kk + h][2 * w + 1]) for h in range(2) for w in range(2)]
            else:
                a = tf32(em, [s[kk][0], s[kk][2], s[kk][1], s[kk][3]])
            for jd in range(n_tiles if not bf16 else n_tiles // 2):
                if bf16:
                    b = ldmatrix(em, view, view_type, ix_add(em, v_reads[kk][jd], stage), 4, True, True)
                    pairs = [(2 * jd, b[0:2]), (2 * jd + 1, b[2:4])]
                else:
                    words = [em.op(f"memref.load {view}[{ix_add(em, at, stage)}] : {view_type}") for at in v_reads[kk][jd]]
                    pairs = [(jd, tf32(em, words))]
                for j, bj in pairs:
                    o[4 * j:4 * j + 4] = mma(em, a, bj, o[4 * j:4 * j + 4], bf16)
        return m_new + l_new + o

    for lo, hi, mask in ((em.index(0), full, False), (full, end, True)):
        kt, args = em.fresh("kt"), [em.fresh("st") for _ in state]
        result = em.fresh("loop")
        with em.region(f"{result}:{len(state)} = scf.for {kt} = {lo} to {hi} step {em.index(1)} "
                       f"iter_args({', '.join(f'{a} = {v}' for a, v in zip(args, state))}) -> ({state_types}) {{"):
            em.line(f"scf.yield {', '.join(body(kt, args, mask))} : {state_types}")
        state = [f"{result}#{i}" for i in range(len(state))]
    em.line("nvvm.cp.async.wait.group 0")

    # epilogue: O / l, lse
    m, l, o = state[0:2], state[2:4], state[4:]
    for r in range(2):
        for offset in (1, 2):
            l[r] = em.op(f"arith.addf {l[r]}, {shuffle_xor(em, l[r], offset)} : f32")
    inv = [em.op(f"arith.divf {em.op('arith.constant 1.0 : f32')}, {x} : f32") for x in l]
    ln2 = em.op(f"arith.constant {LN2!r} : f32")
    lse_base = ix_op(em, "muli", ix_add(em, (batch, p.q_heads), head), p.q_len)
    for r in range(2):
        row = ix_add(em, row_g, 8 * r)
        inside = em.op(f"arith.cmpi ult, {row}, {em.index(p.q_len)} : index")
        with em.region(f"scf.if {inside} {{"):
            out_row = ix_add(em, o_base, (row, o_view.row), (t, 2))
            for j in range(n_tiles if "o" in memrefs else 0):
                vals = [em.op(f"arith.mulf {o[4 * j + 2 * r + w]}, {inv[r]} : f32") for w in range(2)]
                if bf16:
                    vals = [em.op(f"arith.truncf {x} : f32 to bf16") for x in vals]
                vec = em.op(f"vector.from_elements {vals[0]}, {vals[1]} : vector<2x{el}>")
                em.line(f"vector.store {vec}, {memrefs['o'][0]}[{ix_add(em, out_row, 8 * j)}] : {memrefs['o'][1]}, "
                        f"vector<2x{el}>")
            first = em.op(f"arith.cmpi eq, {t}, {em.index(0)} : index")
            with em.region(f"scf.if {first} {{"):
                if "lse" in memrefs:
                    log2l = em.op(f"math.log2 {l[r]} : f32")
                    lse = em.op(f"arith.mulf {em.op(f'arith.addf {m[r]}, {log2l} : f32')}, {ln2} : f32")
                    em.line(f"memref.store {lse}, {memrefs['lse'][0]}[{ix_add(em, lse_base, row)}] : {memrefs['lse'][1]}")

    text = module_text(name, params, em.lines, cfg.threads, target)
    schedule = f"attention[fwd {instruction(cfg, bf16)}] {p} {cfg}"
    return GpuModule(name, text, (q_tiles, p.q_heads, p.batch), (cfg.threads, 1, 1), cfg.smem_bytes(p), schedule)


def _scores_mma_sync(em: GpuEmitter, view: str, view_type: str, q_reads, k_reads, stage: str, zero: str, d: int,
                     bn: int, bf16: bool) -> list[list[str]]:
    """S = Q K^T for the warp's 16 rows and the bn keys of ring stage `stage`, as bn/8 C fragments."""
    kstep = 16 if bf16 else 8
    s = [[zero] * 4 for _ in range(bn // 8)]
    for ks in range(d // kstep):
        a = ldmatrix(em, view, view_type, q_reads[ks], 4, False, bf16)
        if not bf16:
            a = tf32(em, a)
        for jp in range(bn // 16):
            b = ldmatrix(em, view, view_type, ix_add(em, k_reads[ks][jp], stage), 4, False, bf16)
            if not bf16:
                b = tf32(em, b)
            for h in range(2):
                s[2 * jp + h] = mma(em, a, b[2 * h:2 * h + 2], s[2 * jp + h], bf16)
    return s


def _fragment_reads(em: GpuEmitter, q_tile: RowTile, k_tile: RowTile, v_tile: RowTile, lane: str, warp: str, g: str,
                    t: str, d: int, bn: int, bf16: bool):
    """mma.sync's per-lane fragment reads (element offsets in stage 0) of Q, K and V, and the warp's
    first row: (q_reads, k_reads, v_reads, wrow)."""
    q8 = ix_op(em, "divui", lane, 8)
    r8 = ix_op(em, "remui", lane, 8)
    odd8 = ix_op(em, "remui", q8, 2)
    half16 = ix_op(em, "divui", lane, 16)
    wrow = ix_op(em, "muli", warp, 16)
    kstep = 16 if bf16 else 8
    col_unit = 8 if bf16 else 4  # columns of one 8x8 b16 matrix (8 bf16 or 4 f32)
    q_reads = [q_tile.offset([wrow, r8, (odd8, 8)], [ks * kstep, (half16, col_unit)]) for ks in range(d // kstep)]
    k_reads = [[k_tile.offset([r8, (half16, 8), 16 * jp], [ks * kstep, (odd8, col_unit)]) for jp in range(bn // 16)]
               for ks in range(d // kstep)]
    if bf16:  # ldmatrix.trans x4: keys r8 + 8 * odd8 of step kk, d columns 8 * half16 of d-tile pair jp
        v_reads = [[v_tile.offset([r8, (odd8, 8), 16 * kk], [(half16, 8), 16 * jp]) for jp in range(d // 16)]
                   for kk in range(bn // 16)]
    else:  # b0 = V[8kk + 2t][8j + g], b1 = V[8kk + 2t + 1][8j + g]
        t2 = ix_op(em, "muli", t, 2)
        v_reads = [[(v_tile.offset([t2, 8 * kk], [g, 8 * j]), v_tile.offset([t2, 8 * kk + 1], [g, 8 * j]))
                    for j in range(d // 8)] for kk in range(bn // 8)]
    return q_reads, k_reads, v_reads, wrow


def module_text(name: str, memrefs: dict, lines: list[str], threads: int, target: Target) -> str:
    args = ", ".join(f"{ssa}: {t} {{llvm.align = {ALIGN} : i64}}" for ssa, t in memrefs.values())
    nvvm = f'#nvvm.target<O = 3, chip = "{target.arch}", features = "{ptx_features(target)}">'
    return "\n".join([
        "module attributes {gpu.container_module} {",
        f"gpu.module @{name}_module [{nvvm}] {{",
        f"  gpu.func @{name}({args}) kernel attributes {{known_block_size = array<i32: {threads}, 1, 1>, "
        f"nvvm.minctasm = 1 : i32}} {{",
        *lines,
        "    gpu.return",
        "  }",
        "}",
        "}",
    ]) + "\n"


def instruction(config: AttentionConfig, bf16: bool) -> str:
    """The MMA instruction a kernel's products run on, as schedules print it."""
    return "wgmma bf16" if config.mma == "wgmma" else f"mma.sync {'bf16' if bf16 else 'tf32'}"


def ldmatrix(em: GpuEmitter, view: str, view_type: str, at: str, count: int, transpose: bool, bf16: bool) -> list[str]:
    """`count` 32-bit words per lane: i32 (two bf16) for 16-bit data, f32 for 32-bit data."""
    if bf16:
        x = em.op(f"nvgpu.ldmatrix {view}[{at}] {{numTiles = {count} : i32, transpose = {str(transpose).lower()}}} : "
                  f"{view_type} -> vector<{count}x2xbf16>")
        words = []
        for w in range(count):
            pair = em.op(f"vector.extract {x}[{w}] : vector<2xbf16> from vector<{count}x2xbf16>")
            bits = em.op(f"vector.bitcast {pair} : vector<2xbf16> to vector<1xi32>")
            words.append(em.op(f"vector.extract {bits}[0] : i32 from vector<1xi32>"))
        return words
    x = em.op(f"nvgpu.ldmatrix {view}[{at}] {{numTiles = {count} : i32, transpose = false}} : {view_type} "
              f"-> vector<{count}x1xf32>")
    return [em.op(f"vector.extract {x}[{w}, 0] : f32 from vector<{count}x1xf32>") for w in range(count)]


def tf32(em: GpuEmitter, words: list[str]) -> list[str]:
    """f32 words rounded to TF32 (cvt.rna), as i32 bit patterns for mma.sync."""
    return [em.op(f"nvvm.convert.float.to.tf32 {w} {{rnd = #nvvm.fp_rnd_mode<rna>}}") for w in words]


def mma(em: GpuEmitter, a: list[str], b: list[str], c: list[str], bf16: bool) -> list[str]:
    """D = A B + C on one m16n8 tile: bf16 m16n8k16 (a: 4 x i32, b: 2 x i32) or TF32 m16n8k8 (a: 4, b: 2)."""
    kind, k = ("bf16", 16) if bf16 else ("tf32", 8)
    d = em.op(f"nvvm.mma.sync A[{', '.join(a)}] B[{', '.join(b)}] C[{', '.join(c)}] "
              f"{{layoutA = #nvvm.mma_layout<row>, layoutB = #nvvm.mma_layout<col>, "
              f"multiplicandAPtxType = #nvvm.mma_type<{kind}>, multiplicandBPtxType = #nvvm.mma_type<{kind}>, "
              f"shape = #nvvm.shape<m = 16, n = 8, k = {k}>}} : (i32, i32, f32) -> {ACC}")
    return [em.op(f"llvm.extractvalue {d}[{i}] : {ACC}") for i in range(4)]


def exp2(em: GpuEmitter, x: str) -> str:
    return em.op(f'llvm.inline_asm "ex2.approx.ftz.f32 $0, $1;", "=f,f" {x} : (f32) -> f32')


def shuffle_xor(em: GpuEmitter, x: str, offset: int) -> str:
    out = em.fresh("shfl")
    em.line(f"{out}, {em.fresh('ok')} = gpu.shuffle xor {x}, {em.i32(offset)}, {em.i32(32)} : f32")
    return out


def tree(em: GpuEmitter, op: str, xs: list[str]) -> str:
    """A balanced reduction (shorter dependency chains than a left fold)."""
    while len(xs) > 1:
        xs = [em.op(f"{op} {xs[i]}, {xs[i + 1]} : f32") if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


# -- nova.attention ops and plan kernels

def attention_problem(op) -> tuple[AttentionProblem | None, str | None]:
    """(the AttentionProblem of a nova.attention or nova.attention_backward op, None), or (None, why not)."""
    d, a = op.dims(), op.attrs
    if not a["scale"] > 0:
        return None, f"scale {a['scale']}: the kernels' finite mask needs a positive scale"
    problem = AttentionProblem(d["B"], d["Hq"], d["Hkv"], d["Tq"], d["Tk"], d["D"], op.operands[0].type.dtype,
                               a["causal"], a["scale"], a["layout"], bias=op.bias is not None, mask=op.mask is not None)
    return problem, None


def attention_refusal(op, target: Target | None) -> str | None:
    """Why the GPU compiles this attention op (nova.attention, nova.attention_backward) other than as
    one fused kernel of its own, or None: what `passes/expand_attention.py` asks before fusion."""
    if op.name != "nova.attention":  # the backward: its two kernels read each operand through its own parameter
        q, k, v, o, lse, do = op.operands[:6]
        if len({id(x) for x in (q, k, v, o, lse, do)}) != 6:
            return "q, k, v, o and do are not distinct values (the backward kernels take each once)"
    problem, reason = attention_problem(op)
    if reason:
        return reason
    if target is not None:
        reason = problem_refusal(problem, target)
    return reason


def attention_kernel_refusal(kernel) -> str | None:
    """Why a plan kernel is not one nova.attention op (reading its operands through views) the forward
    kernel computes, or None (the kernel family's refusal in `compile.py`)."""
    ops = [op for op in kernel.ops if op.name.startswith("nova.attention")]
    if len(ops) != 1 or ops[0].name != "nova.attention":
        return "not one nova.attention op"
    op = ops[0]
    if not kernel.outputs or not set(kernel.outputs) <= set(op.results):
        return "the kernel writes other values than o and lse"
    _, reason = kernel_operands(kernel, op, ("q", "k", "v"))
    return reason or attention_problem(op)[1]


def build_attention(kernel, target: Target) -> GpuModule:
    op = next(op for op in kernel.ops if op.name == "nova.attention")
    problem, _ = attention_problem(op)
    where, _ = kernel_operands(kernel, op, ("q", "k", "v"))
    inputs = tuple(tuple(role for role, (index, _) in where.items() if index == i) for i in range(len(kernel.inputs)))
    views = {role: view for role, (_, view) in where.items()}
    outputs = tuple("o" if r is op.results[0] else "lse" for r in kernel.outputs)
    return attention_forward_module(problem, choose_attention_tiles(problem, target), target, kernel.name, inputs,
                                    outputs, views, tuple(v.type.size for v in kernel.inputs))
