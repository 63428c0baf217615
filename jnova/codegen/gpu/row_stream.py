"""One pass over each row of a [rows, cols] array: a team of threads per row, 16-byte loads, any cols.

The cross-entropy kernels (`cross_entropy.py`, `cross_entropy_backward.py`) read every element of
their row once, in chunks: `RowStream.stream(init, update)` calls `update(state, chunks)` for

  1. the body of a loop of `full` trips (uniform bounds), each trip `unroll` chunks of `vector`
     consecutive elements per thread, none masked: chunk u of trip k of lane l is the row's aligned
     group first + l + (k * unroll + u) * team;
  2. the remainder: at most `unroll` more chunks per thread, each masked by whether its group is one
     of the row's;
  3. where rows are not whole groups (cols % vector != 0: row r starts at element r * cols, not at a
     multiple of the vector), the row's first and last elements outside its aligned groups, at most
     vector - 1 at each end, as single-element chunks of lanes 0 .. 2 vector - 1, masked.

so a state (the forward's running max and sum) can be carried through all three, and every load is
a whole aligned vector (`vector.load` with 16-byte alignment: `ld.global.v4`) or a masked scalar.
Rows past the last (the last block's teams when rows are not a multiple of the rows per block) read
the last row again; `chunk.inside` includes the row's validity where `guard_rows` asks for it (a
kernel that stores per chunk), and `valid` says it for a team's row statistics.

Loads give f32 registers: bf16 as its bits shifted into the top of an f32 (two per 32-bit word of the
vector; see `GpuEmitter.bf16_to_f32` for why not `arith.extf`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from jnova.codegen.gpu.emitter import GpuEmitter, flat_memref
from jnova.dialect.types import TensorType
from jnova.passes.configure.cross_entropy_rows import CrossEntropyRows

WARP = 32
NEG_INF = "0xFF800000"  # f32 -inf as an MLIR float literal


@dataclass(frozen=True)
class Chunk:
    offset: str  # index: the flat element offset of the chunk's first element
    lanes: int
    inside: str | None  # i1: whether the chunk is part of this thread's row (None: always)


class RowStream:
    """The row a thread's team owns and the chunks of it the thread reads (module docstring)."""

    def __init__(self, em: GpuEmitter, sched: CrossEntropyRows, guard_rows: bool = False):
        self.em, self.sched = em, sched
        cols, vec, team = sched.classes, sched.vector, sched.team
        self.tid = em.op("gpu.thread_id x")
        per_block = sched.rows_per_block
        self.lane = self.tid if per_block == 1 else em.op(f"arith.remui {self.tid}, {em.index(team)} : index")
        row = em.op("gpu.block_id x")
        if per_block > 1:
            row = em.op(f"arith.addi {em.op(f'arith.muli {row}, {em.index(per_block)} : index')}, "
                        f"{em.op(f'arith.divui {self.tid}, {em.index(team)} : index')} : index")
        self.valid = None  # i1, or None where every team's row exists
        if sched.rows % per_block:
            self.valid = em.op(f"arith.cmpi ult, {row}, {em.index(sched.rows)} : index")
            row = em.op(f"arith.select {self.valid}, {row}, {em.index(sched.rows - 1)} : index")
        self.row = row
        self.base = em.op(f"arith.muli {row}, {em.index(cols)} : index")  # the row's first element
        self.guard = self.valid if guard_rows else None
        self.ragged = cols % vec != 0
        if self.ragged:  # aligned groups g0 .. g1 - 1 lie inside the row; the ends are single elements
            self.end = em.op(f"arith.addi {self.base}, {em.index(cols)} : index")
            self.g0 = em.op(f"arith.divui {em.op(f'arith.addi {self.base}, {em.index(vec - 1)} : index')}, "
                            f"{em.index(vec)} : index")
            self.g1 = em.op(f"arith.divui {self.end}, {em.index(vec)} : index")
            self.groups = em.op(f"arith.maxsi {em.op(f'arith.subi {self.g1}, {self.g0} : index')}, "
                                f"{em.index(0)} : index")
            self.fewest, self.most = max(cols // vec - 1, 0), cols // vec
        else:
            self.g0 = em.op(f"arith.muli {row}, {em.index(cols // vec)} : index")
            self.groups = em.index(cols // vec)
            self.fewest = self.most = cols // vec
        self.first = em.op(f"arith.addi {self.g0}, {self.lane} : index")  # this lane's first group

    # -- the chunks
    def stream(self, types: list[str], init: list[str], update) -> list[str]:
        """The state after `update(state, chunks) -> state` has seen every chunk of the thread's row."""
        em, s = self.em, self.sched
        step = s.unroll * s.team  # groups per trip of the team
        full = self.fewest // step
        state = list(init)
        if full:
            k, args, results = em.fresh("k"), [em.fresh("carried") for _ in types], [em.fresh("state") for _ in types]
            head = f"scf.for {k} = {em.index(0)} to {em.index(full)} step {em.index(1)}"
            if types:
                head = (f"{', '.join(results)} = {head} iter_args("
                        f"{', '.join(f'{a} = {x}' for a, x in zip(args, state))}) -> ({', '.join(types)})")
            with em.region(head + " {"):
                start = em.op(f"arith.addi {self.first}, {em.op(f'arith.muli {k}, {em.index(step)} : index')} : index")
                chunks = [self._group_chunk(start if u == 0 else em.op(f"arith.addi {start}, {em.index(u * s.team)} : index"),
                                            self.guard) for u in range(s.unroll)]
                new = update(args, chunks)
                if types:
                    em.line(f"scf.yield {', '.join(new)} : {', '.join(types)}")
            state = results
        done, chunks = full * step, []
        for j in range(math.ceil((self.most - done) / s.team)):
            at = done + j * s.team  # groups before this chunk's lane 0
            inside = None
            if at + s.team > self.fewest:  # some lanes of the last rows' teams are past the row's groups
                rel = em.op(f"arith.addi {self.lane}, {em.index(at)} : index")
                inside = em.op(f"arith.cmpi ult, {rel}, {self.groups} : index")
            g = em.op(f"arith.addi {self.first}, {em.index(at)} : index") if at else self.first
            chunks.append(self._group_chunk(g, self._both(inside, self.guard)))
        if chunks:
            state = update(state, chunks)
        if self.ragged:
            state = update(state, self._end_chunks())
        return state

    def _group_chunk(self, group: str, inside: str | None) -> Chunk:
        em = self.em
        return Chunk(em.op(f"arith.muli {group}, {em.index(self.sched.vector)} : index"), self.sched.vector, inside)

    def _end_chunks(self) -> list[Chunk]:
        """Slot e of 0 .. vector - 1: element g0 * vector - vector + e (the row's head, before its first
        aligned group); slot vector + e: element max(g1, g0) * vector + e (its tail); each inside the
        row or masked. Slot e is lane e mod team's, in turn e // team."""
        em, vec, team = self.em, self.sched.vector, self.sched.team
        head = em.op(f"arith.subi {em.op(f'arith.muli {self.g0}, {em.index(vec)} : index')}, {em.index(vec)} : index")
        tail_group = em.op(f"arith.maxsi {self.g1}, {self.g0} : index")
        tail = em.op(f"arith.subi {em.op(f'arith.muli {tail_group}, {em.index(vec)} : index')}, {em.index(vec)} : index")
        chunks = []
        for j in range(math.ceil(2 * vec / team)):
            slot = em.op(f"arith.addi {self.lane}, {em.index(j * team)} : index") if j else self.lane
            is_head = em.op(f"arith.cmpi ult, {slot}, {em.index(vec)} : index")
            flat = em.op(f"arith.addi {em.op(f'arith.select {is_head}, {head}, {tail} : index')}, {slot} : index")
            inside = em.op(f"arith.andi {em.op(f'arith.cmpi sge, {flat}, {self.base} : index')}, "
                           f"{em.op(f'arith.cmpi slt, {flat}, {self.end} : index')} : i1")
            if (j + 1) * team > 2 * vec:
                inside = em.op(f"arith.andi {inside}, {em.op(f'arith.cmpi ult, {slot}, {em.index(2 * vec)} : index')} : i1")
            chunks.append(Chunk(flat, 1, self._both(inside, self.guard)))
        return chunks

    def _both(self, a: str | None, b: str | None) -> str | None:
        if a is None or b is None:
            return a or b
        return self.em.op(f"arith.andi {a}, {b} : i1")


# -- loads and stores of f32 registers
def load_f32(em: GpuEmitter, mem: str, t: TensorType, offset: str, lanes: int) -> list[str]:
    """`lanes` consecutive elements of `mem` (of type `t`, f32 or bf16) from `offset`, as f32."""
    memref = flat_memref(t)
    if lanes == 1:
        x = em.op(f"memref.load {mem}[{offset}] : {memref}")
        return [x] if t.dtype == "float32" else [em.bf16_to_f32(em.scalar(), x)]
    if t.dtype == "float32":
        vec = f"vector<{lanes}xf32>"
        v = em.op(f"vector.load {mem}[{offset}] {{alignment = 16}} : {memref}, {vec}")
        return [em.op(f"vector.extract {v}[{i}] : f32 from {vec}") for i in range(lanes)]
    words = lanes // 2  # bf16: element 2i is the low half of word i, 2i + 1 the high half
    v = em.op(f"vector.load {mem}[{offset}] {{alignment = 16}} : {memref}, vector<{lanes}xbf16>")
    w = em.op(f"vector.bitcast {v} : vector<{lanes}xbf16> to vector<{words}xi32>")
    high_half = em.i32(-65536)  # 0xFFFF0000
    sixteen = em.i32(16)
    out = []
    for i in range(words):
        word = em.op(f"vector.extract {w}[{i}] : i32 from vector<{words}xi32>")
        out.append(em.op(f"arith.bitcast {em.op(f'arith.shli {word}, {sixteen} : i32')} : i32 to f32"))
        out.append(em.op(f"arith.bitcast {em.op(f'arith.andi {word}, {high_half} : i32')} : i32 to f32"))
    return out


def masked_load_f32(em: GpuEmitter, mem: str, t: TensorType, chunk: Chunk, fill: str) -> list[str]:
    """The chunk's elements as f32; `fill` (an f32 register) for each where the chunk is not inside."""
    if chunk.inside is None:
        return load_f32(em, mem, t, chunk.offset, chunk.lanes)
    names = [em.fresh("x") for _ in range(chunk.lanes)]
    types = ", ".join(["f32"] * chunk.lanes)
    em.line(f"{', '.join(names)} = scf.if {chunk.inside} -> ({types}) {{")
    em.depth += 1
    em.line(f"scf.yield {', '.join(load_f32(em, mem, t, chunk.offset, chunk.lanes))} : {types}")
    em.depth -= 1
    em.line("} else {")
    em.depth += 1
    em.line(f"scf.yield {', '.join([fill] * chunk.lanes)} : {types}")
    em.depth -= 1
    em.line("}")
    return names


def store_f32(em: GpuEmitter, values: list[str], mem: str, t: TensorType, offset: str) -> None:
    """Store f32 registers as `t`'s elements (bf16 rounded to nearest even) from `offset`."""
    memref, e = flat_memref(t), "f32" if t.dtype == "float32" else "bf16"
    if e == "bf16":
        values = [em.op(f"arith.truncf {x} : f32 to bf16") for x in values]
    if len(values) == 1:
        em.line(f"memref.store {values[0]}, {mem}[{offset}] : {memref}")
        return
    vec = f"vector<{len(values)}x{e}>"
    packed = em.op(f"vector.from_elements {', '.join(values)} : {vec}")
    em.line(f"vector.store {packed}, {mem}[{offset}] {{alignment = 16}} : {memref}, {vec}")


# -- arithmetic the kernels share
def f32(em: GpuEmitter, value: float) -> str:
    """A register holding the f32 constant `value`."""
    return em.scalar().const(value, "float32")


def exp2(em: GpuEmitter, x: str) -> str:
    """2^x by the SFU (`ex2.approx.ftz.f32`: 2 ulp; 2^-inf = 0)."""
    return em.op(f'llvm.inline_asm "ex2.approx.ftz.f32 $0, $1;", "=f,f" {x} : (f32) -> f32')


def tree(em: GpuEmitter, op: str, xs: list[str]) -> str:
    """A balanced reduction of f32 registers by the binary `op` (`arith.addf`, `arith.maximumf`)."""
    while len(xs) > 1:
        xs = [em.op(f"{op} {xs[i]}, {xs[i + 1]} : f32") if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


def shuffle_xor(em: GpuEmitter, x: str, offset: int) -> str:
    out = em.fresh("shfl")
    em.line(f"{out}, {em.fresh('ok')} = gpu.shuffle xor {x}, {em.i32(offset)}, {em.i32(WARP)} : f32")
    return out
