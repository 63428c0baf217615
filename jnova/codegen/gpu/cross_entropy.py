"""The softmax cross-entropy forward kernel: `nova.sce` (reduction "none") in one pass over each row.

    per thread, over its chunks of the row (row_stream.RowStream; f32 or bf16 logits, 16-byte loads):
        m' = max(m, max of the chunk)                            (NaN-propagating, as XLA's max)
        s  = s 2^((m - m') log2 e) + sum 2^((x - m') log2 e)     (ex2.approx: 2 ulp)
    (x - m' first: exact where x is near m', Sterbenz, so the terms that make up the sum are as
    accurate as exp(x - m) in f32; x log2 e - m' log2 e in one fma would be off by |m'| 2^-24 there)
    the team merges its threads' (m, s) pairs: shuffle-xor butterflies within a warp, then through
    shared memory across the team's warps, each merge by the rescaling rule
        m = max(m1, m2),  s = s1 2^((m1 - m) log2 e) + s2 2^((m2 - m) log2 e)
    the team's first thread:
        lse  = m + log2(s) ln 2
        loss = lse - x[label]    (x[label] = 0 for a label outside [0, V): the decomposition's one-hot
                                  row is then all false), and 0 where label == ignore_index
and writes lse [N] and loss [N] (f32). The running max starts at the finite -1e30, so merging two
threads that saw no element never computes -inf - -inf.

A mean or sum over rows is not computed here: `passes/split_sce_reductions.py` makes such an op this
kernel's "none" form followed by a reduction over the rows (a kernel of the row-reduction family), as
its definition says (dialect/ops_training.py). The schedule is `passes/configure/cross_entropy_rows`.
"""
from __future__ import annotations

from jnova.codegen.gpu.emitter import GpuEmitter, GpuModule, flat_memref, gpu_module_text, kernel_params, scalar_constant
from jnova.codegen.gpu.row_stream import NEG_INF, WARP, RowStream, exp2, f32, load_f32, masked_load_f32, shuffle_xor, tree
from jnova.codegen.linalg.emitter import element
from jnova.dialect.types import UNSIGNED_DTYPES, bitwidth
from jnova.errors import LoweringError
from jnova.passes.configure.cross_entropy_rows import ELEMENT_BYTES, CrossEntropyRows, choose_cross_entropy_rows
from jnova.passes.plan import Kernel
from jnova.runtime.target import Target

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
RUNNING_MAX_INIT = -1.0e30


# -- what the kernels take
def sce_refusal(op, target: Target | None = None) -> str | None:
    """Why the GPU's cross-entropy kernels do not compute this nova.sce or nova.sce_backward op, or
    None: what the pipeline asks before it expands refused training ops (any reduction: a mean or sum
    is split off first, `split_sce_reductions`)."""
    logits, labels = op.operands[0].type, op.operands[1].type
    n, v = logits.shape
    if logits.dtype not in ELEMENT_BYTES:
        return f"logits of {logits.dtype}: the kernels read {' and '.join(ELEMENT_BYTES)}"
    if n == 0:
        return "the logits have no rows"
    bits = bitwidth(labels.dtype) - (labels.dtype not in UNSIGNED_DTYPES)
    if bits < 63 and v - 1 >= 1 << bits:
        return f"labels of {labels.dtype} cannot name each of {v} classes"
    return None


def sce_kernel_refusal(kernel: Kernel) -> str | None:
    """Why a plan kernel is not one nova.sce op with reduction "none", or None (the kernel family's
    refusal in `compile.py`)."""
    return _one_op_refusal(kernel, "nova.sce", ("none",))


def _one_op_refusal(kernel: Kernel, name: str, reductions: tuple[str, ...]) -> str | None:
    if len(kernel.ops) != 1 or kernel.ops[0].name != name:
        return f"not one {name} op"
    op = kernel.ops[0]
    if op.attrs["reduction"] not in reductions:
        return (f"reduction {op.attrs['reduction']!r}: the kernel computes rows ({', '.join(reductions)}); "
                "split_sce_reductions splits the rest off before kernels are formed")
    if not kernel.outputs or not set(kernel.outputs) <= set(op.results):
        return f"the kernel writes other values than {name}'s results"
    return sce_refusal(op)


# -- the kernel
def build_sce(kernel: Kernel, target: Target, schedule: CrossEntropyRows | None = None) -> GpuModule:
    reason = sce_kernel_refusal(kernel)
    if reason:
        raise LoweringError(f"{kernel.name} is not a cross-entropy forward kernel: {reason}")
    op = kernel.ops[0]
    logits, labels = op.operands
    n, v = logits.type.shape
    sched = schedule or choose_cross_entropy_rows(n, v, logits.type.dtype, target)
    params, memrefs, outs = kernel_params(kernel.inputs, kernel.outputs)
    em = GpuEmitter()
    rows = RowStream(em, sched)
    log2e = f32(em, LOG2E)
    neg_inf = em.op(f"arith.constant {NEG_INF} : f32")

    def update(state: list[str], chunks) -> list[str]:
        m, s = state
        xs = [x for c in chunks for x in masked_load_f32(em, memrefs[logits], logits.type, c, neg_inf)]
        m_new = em.op(f"arith.maximumf {m}, {tree(em, 'arith.maximumf', xs)} : f32")
        terms = [exp2(em, em.op(f"arith.mulf {em.op(f'arith.subf {x}, {m_new} : f32')}, {log2e} : f32")) for x in xs]
        rescale = exp2(em, em.op(f"arith.mulf {em.op(f'arith.subf {m}, {m_new} : f32')}, {log2e} : f32"))
        return [m_new, em.op(f"math.fma {s}, {rescale}, {tree(em, 'arith.addf', terms)} : f32")]

    init = [f32(em, RUNNING_MAX_INIT), f32(em, 0.0)]
    m, s = rows.stream(["f32", "f32"], init, update)
    m, s, workgroup = merge_team(em, sched, rows.tid, m, s, log2e)

    leader = em.op(f"arith.cmpi eq, {rows.lane}, {em.index(0)} : index")
    if rows.valid is not None:
        leader = em.op(f"arith.andi {leader}, {rows.valid} : i1")
    with em.region(f"scf.if {leader} {{"):
        label, raw = load_label(em, memrefs[labels], labels.type, rows.row)
        lse = em.op(f"math.fma {em.op(f'math.log2 {s} : f32')}, {f32(em, LN2)}, {m} : f32")
        loss = em.op(f"arith.subf {lse}, {_label_logit(em, memrefs[logits], logits.type, rows.base, label, v)} : f32")
        if op.attrs["has_ignore"]:
            loss = em.op(f"arith.select {ignored(em, raw, labels.type.dtype, op.attrs['ignore_index'])}, "
                         f"{f32(em, 0.0)}, {loss} : f32")
        for value, mem in zip(kernel.outputs, outs):
            result = loss if value is op.results[0] else lse
            em.line(f"memref.store {result}, {mem}[{rows.row}] : {flat_memref(value.type)}")
    text = gpu_module_text(kernel.name, target, params, em.lines, sched.block, workgroup)
    return GpuModule(kernel.name, text, (sched.grid, 1, 1), (sched.block, 1, 1), 0, str(sched))


def merge(em: GpuEmitter, m1: str, s1: str, m2: str, s2: str, log2e: str) -> tuple[str, str]:
    """The statistics of two parts of a row: m = max(m1, m2), s = s1 2^((m1-m) log2 e) + s2 2^((m2-m) log2 e)."""
    m = em.op(f"arith.maximumf {m1}, {m2} : f32")
    a1 = exp2(em, em.op(f"arith.mulf {em.op(f'arith.subf {m1}, {m} : f32')}, {log2e} : f32"))
    a2 = exp2(em, em.op(f"arith.mulf {em.op(f'arith.subf {m2}, {m} : f32')}, {log2e} : f32"))
    return m, em.op(f"math.fma {s1}, {a1}, {em.op(f'arith.mulf {s2}, {a2} : f32')} : f32")


def merge_team(em: GpuEmitter, sched: CrossEntropyRows, tid: str, m: str, s: str,
               log2e: str) -> tuple[str, str, list[str]]:
    """Every thread of the team with the team's (m, s), and the workgroup buffers used: butterflies over
    the warp's lanes of the team, then, for teams of several warps, each warp's lane 0 writes its pair
    to shared memory and lane l of every warp of the team merges the pairs of warps l mod (warps per
    team) by a second butterfly."""
    def butterfly(m: str, s: str, lanes: int) -> tuple[str, str]:
        offset = lanes // 2
        while offset:
            m, s = merge(em, m, s, shuffle_xor(em, m, offset), shuffle_xor(em, s, offset), log2e)
            offset //= 2
        return m, s

    m, s = butterfly(m, s, min(sched.team, WARP))
    if sched.team <= WARP:
        return m, s, []
    warps = sched.team // WARP
    buffer = f"memref<{sched.block // WARP}xf32, #gpu.address_space<workgroup>>"
    maxima, sums = em.fresh("team_max"), em.fresh("team_sum")
    lane = em.op(f"arith.remui {tid}, {em.index(WARP)} : index")
    warp = em.op(f"arith.divui {tid}, {em.index(WARP)} : index")
    with em.region(f"scf.if {em.op(f'arith.cmpi eq, {lane}, {em.index(0)} : index')} {{"):
        em.line(f"memref.store {m}, {maxima}[{warp}] : {buffer}")
        em.line(f"memref.store {s}, {sums}[{warp}] : {buffer}")
    em.line("gpu.barrier")
    first_warp = em.op(f"arith.muli {em.op(f'arith.divui {tid}, {em.index(sched.team)} : index')}, {em.index(warps)} : index")
    slot = em.op(f"arith.addi {first_warp}, {em.op(f'arith.remui {lane}, {em.index(warps)} : index')} : index")
    m, s = butterfly(em.op(f"memref.load {maxima}[{slot}] : {buffer}"), em.op(f"memref.load {sums}[{slot}] : {buffer}"),
                     warps)
    return m, s, [f"{maxima} : {buffer}", f"{sums} : {buffer}"]


def load_label(em: GpuEmitter, mem: str, t, row: str) -> tuple[str, str]:
    """(the row's label as a signed index, the label as stored)."""
    raw = em.op(f"memref.load {mem}[{row}] : {flat_memref(t)}")
    e, bits = element(t.dtype), bitwidth(t.dtype)
    wide = raw
    if bits < 64:
        ext = "arith.extui" if t.dtype in UNSIGNED_DTYPES else "arith.extsi"
        wide = em.op(f"{ext} {raw} : {e} to i64")
    return em.op(f"arith.index_cast {wide} : i64 to index"), raw


def ignored(em: GpuEmitter, raw: str, dtype: str, ignore_index: int) -> str:
    """i1: the stored label equals `ignore_index` (compared in the labels' type, as the definition does)."""
    return em.op(f"arith.cmpi eq, {raw}, {scalar_constant(em.scalar(), ignore_index, dtype)} : {element(dtype)}")


def _label_logit(em: GpuEmitter, mem: str, t, base: str, label: str, classes: int) -> str:
    """x[row, label] as f32, or 0 for a label outside [0, classes)."""
    inside = em.op(f"arith.andi {em.op(f'arith.cmpi sge, {label}, {em.index(0)} : index')}, "
                   f"{em.op(f'arith.cmpi slt, {label}, {em.index(classes)} : index')} : i1")
    picked = em.fresh("picked")
    with em.region(f"{picked} = scf.if {inside} -> (f32) {{", "}"):
        at = em.op(f"arith.addi {base}, {label} : index")
        em.line(f"scf.yield {load_f32(em, mem, t, at, 1)[0]} : f32")
        em.depth -= 1
        em.line("} else {")
        em.depth += 1
        em.line(f"scf.yield {f32(em, 0.0)} : f32")
    return picked
