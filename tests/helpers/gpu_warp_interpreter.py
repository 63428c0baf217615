"""A lockstep interpreter of generated `gpu.func`s whose threads talk to each other, for CPU tests.

`run_kernel(module_text, grid, block, shared_bytes, buffers)` parses the kernel's MLIR (the text that
becomes PTX) and runs each block with all of its threads in lockstep: every SSA value is a NumPy array
with one row per thread. Warp-collective ops follow the PTX ISA's definitions, written here
independently of the kernel builders: `nvvm.mma.sync` (bf16 m16n8k16, TF32 m16n8k8: fragments gathered
from the 32 lanes, multiplied in float64), `nvgpu.ldmatrix` (.x1/.x2/.x4, .trans), `gpu.shuffle xor`,
and the warpgroup's Hopper `wgmma.mma_async` (m64nNk16 bf16/f16, m64nNk8 TF32, f32 accumulators):
`nvvm.wgmma.mma_async` with both operands in shared memory through 64-bit matrix descriptors
(128-byte swizzle, K- or MN-major), and the register-A bf16 form as `llvm.inline_asm` (`WGMMA_RS`).
The dynamic shared memory's address is 0: the PTX declares it `.extern .shared .align 1024`, so the
hardware swizzle, a function of absolute address bits, is applied to offsets from its start.
A divergent `scf.if` runs its regions under masks (stores and copies only for active threads; each
thread's results from the side it took); every load and store is bounds-checked for active threads.
Dynamic shared memory and workgroup buffers start poisoned (0x7F bytes) in every block. cp.async copies
and wgmmas complete when issued, and barriers, proxy fences and wgmma fences / commits / waits are
no-ops: the interpreter checks what the kernel computes (fragment layouts, descriptors, swizzles,
masks, indices), not its synchronization, which only the GPU tests can.
"""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
from mlir import ir

BF16 = ml_dtypes.bfloat16
_DTYPES = {"f32": np.float32, "bf16": BF16, "i32": np.int32, "i64": np.int64, "index": np.int64, "i1": np.bool_,
           "i16": np.int16, "i8": np.int8, "f64": np.float64, "f16": np.float16}
_CMP = {0: np.equal, 1: np.not_equal, 2: np.less, 3: np.less_equal, 4: np.greater, 5: np.greater_equal}


_WGMMA_TYPES = {"bf16": (BF16, 2), "f16": (np.float16, 2), "tf32": (np.float32, 4)}
# The register-A bf16 wgmma as kernels write it in inline asm (MLIR's nvvm dialect has no such form):
# operands $0..$<n-1> the accumulators (tied to the inputs), $<n>..$<n+3> A's words, $<n+4> B's
# descriptor, $<n+5> scale-d as an i32 (nonzero: D = A @ B + C), the last field imm-trans-b.
WGMMA_RS = re.compile(r"\{\s*\.reg \.pred p;\s*setp\.ne\.b32 p, \$(\d+), 0;\s*"
                      r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16\s+"
                      r"\{([$\d,\s]*)\},\s*\{([$\d,\s]*)\},\s*\$(\d+),\s*p,\s*1,\s*1,\s*([01]);\s*\}")


def swizzle_128b(addr: np.ndarray) -> np.ndarray:
    """The hardware's 128-byte swizzle of a shared-memory byte address: its 16-byte chunk (bits 4-6)
    XOR its 128-byte row modulo 8 (bits 7-9)."""
    return addr ^ (((addr >> 7) & 7) << 4)


def wgmma_d_layout(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of D for each of a warpgroup's 128 threads and n / 2 accumulator values: value i
    of lane l in warp w is D[16w + l/4 + 8 * ((i/2) % 2), 2 * (l % 4) + i % 2 + 8 * (i/4)] (PTX ISA,
    wgmma D fragment)."""
    t, i = np.arange(128)[:, None], np.arange(n // 2)[None, :]
    w, lane = t // 32, t % 32
    return 16 * w + lane // 4 + 8 * ((i // 2) % 2), 2 * (lane % 4) + i % 2 + 8 * (i // 4)


def wgmma_a_layout() -> list[tuple[np.ndarray, np.ndarray]]:
    """(row, first column) of A for each of a warpgroup's 128 threads, per 32-bit word of the register-A
    bf16 fragment (two columns per word, the low half the lower): PTX ISA, wgmma A fragment, m64k16."""
    t = np.arange(128)
    row, col = 16 * (t // 32) + (t % 32) // 4, 2 * (t % 4)
    return [(row, col), (row + 8, col), (row, col + 8), (row + 8, col + 8)]


# Ops that only order or wait for other work: no-ops where copies and wgmmas complete when issued.
SYNCHRONIZATION = frozenset({"gpu.barrier", "nvvm.fence.proxy", "nvvm.wgmma.fence.aligned",
                             "nvvm.wgmma.commit.group.sync.aligned", "nvvm.wgmma.wait.group.sync.aligned",
                             "nvvm.cp.async.commit.group", "nvvm.cp.async.wait.group"})


class KernelFault(AssertionError):
    """The kernel did something a GPU would not survive (an access out of bounds, divergent bounds)."""


class Memory:
    """A flat buffer of bytes viewed with one element type at a byte offset."""

    def __init__(self, data: np.ndarray, dtype, offset: int = 0):
        self.bytes, self.dtype, self.offset = data, np.dtype(dtype), offset

    def elements(self) -> np.ndarray:
        return self.bytes[self.offset:].view(self.dtype)

    def view(self, dtype, offset: int) -> "Memory":
        return Memory(self.bytes, dtype, self.offset + offset)


def _type_parts(t: str):
    t = str(t)
    if t.startswith("vector<"):
        inner = t[len("vector<"):-1].split("x")
        return tuple(int(x) for x in inner[:-1]), _DTYPES[inner[-1]]
    if t.startswith("!llvm.struct"):
        return (t.count("f32"),), np.float32
    return (), _DTYPES.get(t, None)


class _Block:
    def __init__(self, func, threads: int, block_id: tuple, buffers: dict, shared: np.ndarray):
        self.threads, self.block_id, self.shared = threads, block_id, shared
        self.values = {}
        arguments = list(func.regions[0].blocks[0].arguments)
        for arg, name in zip(arguments, buffers):
            self.values[arg] = buffers[name]
        for arg in arguments[len(buffers):]:  # workgroup attributions: shared buffers of this block, poisoned
            memref = ir.MemRefType(arg.type)
            _, dtype = _type_parts(memref.element_type)
            size = int(np.prod(memref.shape)) * np.dtype(dtype).itemsize
            self.values[arg] = Memory(np.full(size, 0x7F, np.int8), dtype)
        self.lane = np.arange(threads) % 32

    def get(self, v):
        return self.values[v]

    def run_block(self, block, mask):
        for op in block.operations:
            name = op.operation.name
            if name in ("scf.yield", "gpu.return"):
                return [self.get(x) for x in op.operands]
            if name in SYNCHRONIZATION:  # copies and products complete when issued
                continue
            handler = getattr(self, "op_" + name.replace(".", "_"), None)
            if handler is None:
                raise NotImplementedError(f"the warp interpreter has no rule for {name}")
            out = handler(op, mask)
            if out is not None:
                for r, x in zip(op.results, out if isinstance(out, list) else [out]):
                    self.values[r] = x
        return []

    # -- structure
    def op_scf_for(self, op, mask):
        lo, hi, step = (self._uniform(self.get(x)) for x in op.operands[:3])
        carried = [self.get(x) for x in op.operands[3:]]
        body = op.regions[0].blocks[0]
        for i in range(lo, hi, step):
            self.values[body.arguments[0]] = np.full(self.threads, i, np.int64)
            for a, x in zip(list(body.arguments)[1:], carried):
                self.values[a] = x
            carried = self.run_block(body, mask)
        return carried

    def op_scf_if(self, op, mask):
        cond = self.get(op.operands[0]).astype(bool)
        inner = mask & cond
        then = self.run_block(op.regions[0].blocks[0], inner) if inner.any() else None
        other = None
        if len(op.regions) > 1 and len(op.regions[1].blocks) and (mask & ~cond).any():
            other = self.run_block(op.regions[1].blocks[0], mask & ~cond)
        if not op.results:
            return None
        outs = []  # each thread's results from the side it took (zeros where it took neither)
        for i, r in enumerate(op.results):
            shape, dtype = _type_parts(r.type)
            out = np.zeros((self.threads, *shape), dtype)
            side = cond.reshape(cond.shape + (1,) * len(shape))
            if then is not None:
                out = np.where(side, then[i], out)
            if other is not None:
                out = np.where(side, out, other[i])
            outs.append(out.astype(dtype))
        return outs

    def _uniform(self, x) -> int:
        if not (x == x[0]).all():
            raise KernelFault("a loop bound differs between the threads of a block")
        return int(x[0])

    # -- ids and memory
    def op_gpu_thread_id(self, op, mask):
        assert "x" in str(op.attributes["dimension"])
        return np.arange(self.threads, dtype=np.int64)

    def op_gpu_block_id(self, op, mask):
        axis = "xyz".index(str(op.attributes["dimension"])[-2])
        return np.full(self.threads, self.block_id[axis], np.int64)

    def op_gpu_dynamic_shared_memory(self, op, mask):
        return Memory(self.shared, np.int8)

    def op_memref_view(self, op, mask):
        src, shift = self.get(op.operands[0]), self._uniform(self.get(op.operands[1]))
        _, dtype = _type_parts(ir.MemRefType(op.results[0].type).element_type)
        return src.view(dtype, shift)

    def op_memref_extract_aligned_pointer_as_index(self, op, mask):
        """The byte address of the dynamic shared memory (or of a view into it): its start is 0, a
        1024-byte aligned base as the PTX declares it. Other memrefs have no address here."""
        mem = self.get(op.operands[0])
        if not (isinstance(mem, Memory) and mem.bytes is self.shared):
            raise NotImplementedError(f"the address of a memref other than the dynamic shared memory: {op}")
        return np.full(self.threads, mem.offset, np.int64)

    def _index(self, mem: Memory, idx, mask, count: int = 1):
        elements = mem.elements()
        idx = np.where(mask, idx, 0)
        bad = mask & ((idx < 0) | (idx + count > elements.size))
        if bad.any():
            raise KernelFault(f"access out of bounds: element {idx[bad][0]} of {elements.size}")
        return elements, idx

    def op_memref_load(self, op, mask):
        mem = self.get(op.operands[0])
        elements, idx = self._index(mem, self.get(op.operands[1]), mask)
        return elements[idx].copy()

    def op_memref_store(self, op, mask):
        x, mem = self.get(op.operands[0]), self.get(op.operands[1])
        elements, idx = self._index(mem, self.get(op.operands[2]), mask)
        elements[idx[mask]] = x[mask]

    def op_vector_load(self, op, mask):
        (n,), _ = _type_parts(op.results[0].type)
        mem = self.get(op.operands[0])
        elements, idx = self._index(mem, self.get(op.operands[1]), mask, n)
        return elements[idx[:, None] + np.arange(n)].copy()

    def op_vector_store(self, op, mask):
        x, mem = self.get(op.operands[0]), self.get(op.operands[1])
        n = x.shape[1]
        elements, idx = self._index(mem, self.get(op.operands[2]), mask, n)
        elements[(idx[mask][:, None] + np.arange(n))] = x[mask]

    def _masked_lanes(self, mem: Memory, idx, mask, lanes):
        """The elements and, per thread and vector lane, whether it is accessed and its element."""
        elements = mem.elements()
        at = np.where(mask[:, None], idx[:, None] + np.arange(lanes.shape[1]), 0)
        on = mask[:, None] & lanes.astype(bool)
        bad = on & ((at < 0) | (at >= elements.size))
        if bad.any():
            raise KernelFault(f"masked access out of bounds: element {at[bad][0]} of {elements.size}")
        return elements, at, on

    def op_vector_maskedload(self, op, mask):
        mem, idx, lanes, passthru = (self.get(x) for x in op.operands)
        elements, at, on = self._masked_lanes(mem, idx, mask, lanes)
        out = np.array(passthru, copy=True)
        out[on] = elements[at[on]]
        return out

    def op_vector_maskedstore(self, op, mask):
        mem, idx, lanes, x = (self.get(v) for v in op.operands)
        elements, at, on = self._masked_lanes(mem, idx, mask, lanes)
        elements[at[on]] = x[on]

    def op_nvgpu_device_async_copy(self, op, mask):
        dst, di, src, si = (self.get(x) for x in op.operands[:4])  # ODS order: dst first
        n = ir.IntegerAttr(op.attributes["dstElements"]).value
        count = self.get(op.operands[4]) if len(op.operands) > 4 else np.full(self.threads, n)
        d_el, di = self._index(dst, di, mask, n)
        s_el = src.elements()
        for th in np.nonzero(mask)[0]:
            c = int(count[th])
            if c:
                if si[th] < 0 or si[th] + c > s_el.size:
                    raise KernelFault(f"cp.async reads elements {si[th]}..{si[th] + c} of {s_el.size}")
                d_el[di[th]:di[th] + c] = s_el[si[th]:si[th] + c]
            d_el[di[th] + c:di[th] + n] = 0
        return np.zeros(self.threads, np.int64)  # the token

    # -- warp collectives
    def _warps(self, x):
        return x.reshape(self.threads // 32, 32, *x.shape[1:])

    def op_gpu_shuffle(self, op, mask):
        assert str(op.attributes["mode"]).endswith("xor>"), op.attributes["mode"]
        x = self.get(op.operands[0])
        offset, width = self._uniform(self.get(op.operands[1])), self._uniform(self.get(op.operands[2]))
        assert width == 32
        partner = np.arange(32) ^ offset
        w = self._warps(x)
        return [w[:, partner].reshape(x.shape), np.ones(self.threads, bool)]

    def op_nvgpu_ldmatrix(self, op, mask):
        if not mask.all():
            raise KernelFault("ldmatrix under a divergent branch")
        mem = self.get(op.operands[0])
        idx = self.get(op.operands[1])
        tiles = ir.IntegerAttr(op.attributes["numTiles"]).value
        trans = ir.BoolAttr(op.attributes["transpose"]).value
        shape, dtype = _type_parts(op.results[0].type)
        byte = mem.offset + idx * mem.dtype.itemsize
        if (byte % 16).any():
            raise KernelFault("ldmatrix row address not 16-byte aligned")
        out = np.zeros((self.threads, tiles, 2), np.uint16)
        halves = mem.bytes.view(np.uint8)
        for w in range(self.threads // 32):
            lanes = slice(32 * w, 32 * w + 32)
            rows_addr = byte[lanes]
            for i in range(tiles):
                rows = np.stack([halves[a:a + 16].view(np.uint16) for a in rows_addr[8 * i:8 * i + 8]])
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    if trans:
                        out[32 * w + lane, i] = rows[2 * t, g], rows[2 * t + 1, g]
                    else:
                        out[32 * w + lane, i] = rows[g, 2 * t], rows[g, 2 * t + 1]
        if (byte[:] < 0).any() or (byte + 16 > halves.size).any():
            raise KernelFault("ldmatrix address out of shared memory")
        return out.view(np.uint32).view(np.float32) if dtype == np.float32 else out.view(BF16)

    def op_nvvm_mma_sync(self, op, mask):
        if not mask.all():
            raise KernelFault("mma.sync under a divergent branch")
        kind = str(op.attributes["multiplicandAPtxType"])
        words = [self.get(x) for x in op.operands]
        a, b, c = np.stack(words[:4], 1), np.stack(words[4:6], 1), np.stack(words[6:10], 1).astype(np.float64)
        out = np.zeros((self.threads, 4), np.float32)
        for w in range(self.threads // 32):
            lanes = slice(32 * w, 32 * w + 32)
            if "bf16" in kind:
                A, B = np.zeros((16, 16)), np.zeros((16, 8))
                ah = a[lanes].astype(np.int32).view(np.uint16).reshape(32, 4, 2).view(BF16).astype(np.float64)
                bh = b[lanes].astype(np.int32).view(np.uint16).reshape(32, 2, 2).view(BF16).astype(np.float64)
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for word, (r, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
                        A[r, col:col + 2] = ah[lane, word]
                    for word, k in enumerate((2 * t, 2 * t + 8)):
                        B[k:k + 2, g] = bh[lane, word]
            elif "tf32" in kind:
                A, B = np.zeros((16, 8)), np.zeros((8, 8))
                af = a[lanes].astype(np.int32).view(np.float32).astype(np.float64)
                bf = b[lanes].astype(np.int32).view(np.float32).astype(np.float64)
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for word, (r, col) in enumerate(((g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4))):
                        A[r, col] = af[lane, word]
                    B[t, g], B[t + 4, g] = bf[lane]
            else:
                raise NotImplementedError(kind)
            C = np.zeros((16, 8))
            for lane in range(32):
                g, t = lane // 4, lane % 4
                C[g, 2 * t:2 * t + 2], C[g + 8, 2 * t:2 * t + 2] = c[32 * w + lane, 0:2], c[32 * w + lane, 2:4]
            D = A @ B + C
            for lane in range(32):
                g, t = lane // 4, lane % 4
                out[32 * w + lane] = np.concatenate([D[g, 2 * t:2 * t + 2], D[g + 8, 2 * t:2 * t + 2]])
        return out

    def op_nvgpu_mma_sync(self, op, mask):
        """nvgpu's TF32 m16n8k8 form: A vector<4x1xf32>, B vector<2x1xf32>, C vector<2x2xf32> per lane, in
        the PTX ISA's fragment layout; the hardware reads the top 19 bits of each operand word."""
        if not mask.all():
            raise KernelFault("mma.sync under a divergent branch")
        text = str(op)
        if "tf32Enabled" not in text or "mmaShape = [16, 8, 8]" not in text:
            raise NotImplementedError(f"nvgpu.mma.sync other than TF32 m16n8k8: {op}")
        tf32 = lambda x: (np.ascontiguousarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
        a = tf32(self.get(op.operands[0]).reshape(self.threads, 4)).astype(np.float64)
        b = tf32(self.get(op.operands[1]).reshape(self.threads, 2)).astype(np.float64)
        c = self.get(op.operands[2]).reshape(self.threads, 4).astype(np.float64)
        out = np.zeros((self.threads, 2, 2), np.float32)
        for w in range(self.threads // 32):
            A, B, C = np.zeros((16, 8)), np.zeros((8, 8)), np.zeros((16, 8))
            for lane in range(32):
                g, t, i = lane // 4, lane % 4, 32 * w + lane
                A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4] = a[i]
                B[t, g], B[t + 4, g] = b[i]
                C[g, 2 * t:2 * t + 2], C[g + 8, 2 * t:2 * t + 2] = c[i, 0:2], c[i, 2:4]
            D = A @ B + C
            for lane in range(32):
                g, t = lane // 4, lane % 4
                out[32 * w + lane] = D[g, 2 * t:2 * t + 2], D[g + 8, 2 * t:2 * t + 2]
        return out

    def op_nvvm_convert_float_to_tf32(self, op, mask):
        bits = self.get(op.operands[0]).astype(np.float32).view(np.uint32)
        magnitude = (bits & np.uint32(0x7FFFFFFF)) + np.uint32(0x1000)  # round to nearest, ties away
        return (((bits & np.uint32(0x80000000)) | magnitude) & np.uint32(0xFFFFE000)).view(np.int32)

    # -- warpgroup collectives (wgmma)
    def _warpgroups(self, mask, uniform: dict, what: str) -> list[slice]:
        """The warpgroups (128 threads each) that run a warpgroup-wide op: those whose threads are all
        active (KernelFault where only some are), with `uniform` operands equal over the warpgroup."""
        if self.threads % 128:
            raise KernelFault(f"{what} in a block of {self.threads} threads, not whole warpgroups")
        groups = []
        for g in range(self.threads // 128):
            lanes = slice(128 * g, 128 * g + 128)
            if not mask[lanes].any():
                continue
            if not mask[lanes].all():
                raise KernelFault(f"{what} under a branch that diverges within warpgroup {g}")
            for name, x in uniform.items():
                if not (x[lanes] == x[lanes][0]).all():
                    raise KernelFault(f"{what}: the {name} differs between the threads of warpgroup {g}")
            groups.append(lanes)
        return groups

    def _smem_operand(self, desc: int, mn: int, k: int, k_major: bool, kind: str) -> np.ndarray:
        """The mn x k operand a shared-memory matrix descriptor describes (PTX ISA "Matrix Descriptor
        Format": start address, LBO and SBO in 16-byte units in bits 0-13, 16-29, 32-45, the swizzle mode
        in bits 62-63; only the 128-byte swizzle, mode 1), read as float64. Element addresses, e bytes
        each, P = 128 / e elements per 128-byte row:
          K-major:  start + (mn / 8) * SBO + (mn % 8) * 128 + k * e
          MN-major: start + (mn / P) * LBO + (k / 8) * SBO + (k % 8) * 128 + (mn % P) * e   (16-bit types)
        then swizzled as absolute addresses. TF32 keeps the top 19 bits of each word."""
        desc = int(desc) & ((1 << 64) - 1)
        start, lbo, sbo = (((desc >> s) & 0x3FFF) << 4 for s in (0, 16, 32))
        if desc >> 62 != 1:
            raise NotImplementedError(f"wgmma descriptor swizzle mode {desc >> 62} (only 1, the 128-byte swizzle)")
        if (desc >> 49) & 7:
            raise NotImplementedError(f"wgmma descriptor base offset {(desc >> 49) & 7}")
        dtype, e = _WGMMA_TYPES[kind]
        i, j = np.arange(mn)[:, None], np.arange(k)[None, :]
        if k_major:
            addr = start + (i // 8) * sbo + (i % 8) * 128 + j * e
        else:
            if e != 2:
                raise KernelFault(f"an MN-major {kind} wgmma operand: the PTX ISA transposes only 16-bit types")
            per_row = 128 // e
            addr = start + (i // per_row) * lbo + (j // 8) * sbo + (j % 8) * 128 + (i % per_row) * e
        at = swizzle_128b(addr)
        data = self.shared.view(np.uint8)
        if (at < 0).any() or (at + e > data.size).any():
            bad = at[(at < 0) | (at + e > data.size)][0]
            raise KernelFault(f"wgmma operand byte {bad} out of {data.size} B of shared memory")
        raw = np.ascontiguousarray(data[at[..., None] + np.arange(e)])
        if kind == "tf32":
            return (raw.view(np.uint32)[..., 0] & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)
        return raw.view(dtype)[..., 0].astype(np.float64)

    @staticmethod
    def _wgmma_d(a: np.ndarray, b: np.ndarray, acc: np.ndarray, scale_d: bool) -> np.ndarray:
        """One warpgroup's D = A @ B (+ C), in float64, from and to its accumulator registers."""
        rows, cols = wgmma_d_layout(b.shape[1])
        c = np.zeros((64, b.shape[1]))
        if scale_d:
            c[rows, cols] = acc
        with np.errstate(over="ignore", invalid="ignore"):  # inf past the f32 range, as the tensor cores give
            return (a @ b + c)[rows, cols].astype(np.float32)

    def op_nvvm_wgmma_mma_async(self, op, mask):
        """`wgmma.mma_async` m64nNk16 (bf16, f16) or m64nNk8 (TF32), f32 accumulators, A and B in shared
        memory through descriptors: D = scale-a * A (64 x K) @ scale-b * B (K x N) + (C if scale-d).
        Layouts: A `row` / B `col` are K-major, A `col` / B `row` MN-major."""
        attr = {name: str(op.attributes[name]) for name in ("shape", "typeA", "typeB", "typeD", "layoutA",
                                                             "layoutB", "scaleA", "scaleB", "scaleD")}
        shape = re.fullmatch(r"#nvvm.shape<m = (\d+), n = (\d+), k = (\d+)>", attr["shape"])
        m, n, k = (int(x) for x in shape.groups())
        kind_a, kind_b = (re.fullmatch(r"#nvvm.wgmma_type<(\w+)>", attr[t]).group(1) for t in ("typeA", "typeB"))
        if attr["typeD"] != "#nvvm.wgmma_type<f32>" or kind_a != kind_b or kind_a not in _WGMMA_TYPES:
            raise NotImplementedError(f"wgmma of {kind_a} x {kind_b} into {attr['typeD']}")
        if m != 64 or k != (8 if kind_a == "tf32" else 16) or n % 8 or not 8 <= n <= 256:
            raise KernelFault(f"no wgmma shape m{m}n{n}k{k} for {kind_a}")
        structs = [self.get(x) for x in op.operands if str(x.type).startswith("!llvm.struct")]  # ODS: inouts first
        desc_a, desc_b = (self.get(x) for x in op.operands if str(x.type) == "i64")
        acc = structs[0] if structs else np.zeros((self.threads, n // 2), np.float32)
        if acc.shape != (self.threads, n // 2):
            raise KernelFault(f"m64n{n} wgmma with {acc.shape[1]} accumulator registers per thread")
        signs = [-1.0 if attr[s].endswith("<neg>") else 1.0 for s in ("scaleA", "scaleB")]
        scale_d = attr["scaleD"].endswith("<one>")
        out = np.array(acc, np.float32, copy=True)
        for lanes in self._warpgroups(mask, {"A descriptor": desc_a, "B descriptor": desc_b}, "wgmma.mma_async"):
            a = self._smem_operand(desc_a[lanes][0], 64, k, attr["layoutA"] == "#nvvm.mma_layout<row>", kind_a)
            bt = self._smem_operand(desc_b[lanes][0], n, k, attr["layoutB"] == "#nvvm.mma_layout<col>", kind_b)
            out[lanes] = self._wgmma_d(signs[0] * a, signs[1] * bt.T, acc[lanes], scale_d)
        return out

    def _wgmma_register_a(self, op, mask, found):
        """The register-A bf16 wgmma (`WGMMA_RS`): A (64 x 16) from four 32-bit words per thread (the
        PTX ISA's A fragment, `wgmma_a_layout`), B (16 x N) through its descriptor (imm-trans-b 1: B
        MN-major, 0: K-major), scale-d = its register != 0. The asm's operand numbering and constraints
        must be exactly `WGMMA_RS`'s (anything else: NotImplementedError)."""
        n = int(found.group(2))
        regs = n // 2
        numbers = lambda text: [int(x) for x in re.findall(r"\$(\d+)", text)]
        constraints = ir.StringAttr(op.attributes["constraints"]).value
        want = ",".join(["=f"] * regs + ["r"] * 4 + ["l", "r"] + [str(i) for i in range(regs)])
        if (numbers(found.group(3)) != list(range(regs)) or numbers(found.group(4)) != list(range(regs, regs + 4))
                or int(found.group(5)) != regs + 4 or int(found.group(1)) != regs + 5 or constraints != want
                or len(op.operands) != 6 + regs or n % 8 or not 8 <= n <= 256):
            raise NotImplementedError(f"a register-A wgmma numbered otherwise than the interpreter's form: {op}")
        x = [self.get(v) for v in op.operands]
        words, desc_b, scale_d = np.stack(x[:4], 1), x[4], x[5]
        acc = np.stack(x[6:], 1).astype(np.float32)
        out = acc.copy()
        for lanes in self._warpgroups(mask, {"B descriptor": desc_b, "scale-d": scale_d}, "wgmma.mma_async"):
            halves = np.ascontiguousarray(words[lanes].astype(np.int32)).view(np.uint16).reshape(128, 4, 2)
            halves = halves.view(BF16).astype(np.float64)
            a = np.zeros((64, 16))
            for j, (row, col) in enumerate(wgmma_a_layout()):
                a[row, col], a[row, col + 1] = halves[:, j, 0], halves[:, j, 1]
            bt = self._smem_operand(desc_b[lanes][0], n, 16, found.group(6) == "0", "bf16")
            out[lanes] = self._wgmma_d(a, bt.T, acc[lanes], bool(scale_d[lanes][0] != 0))
        return out

    def op_llvm_mlir_zero(self, op, mask):
        """The zero of an `!llvm.struct` of f32 (accumulator registers)."""
        t = str(op.results[0].type)
        if not t.startswith("!llvm.struct"):
            raise NotImplementedError(f"llvm.mlir.zero of {t}")
        shape, dtype = _type_parts(t)
        return np.zeros((self.threads, *shape), dtype)

    def op_llvm_insertvalue(self, op, mask):
        (pos,) = ir.DenseI64ArrayAttr(op.attributes["position"])
        out = np.array(self.get(op.operands[0]), copy=True)
        out[:, pos] = self.get(op.operands[1])
        return out

    def op_llvm_extractvalue(self, op, mask):
        (pos,) = ir.DenseI64ArrayAttr(op.attributes["position"])
        return self.get(op.operands[0])[:, pos]

    def op_llvm_inline_asm(self, op, mask):
        text = ir.StringAttr(op.attributes["asm_string"]).value
        if text.startswith("ex2.approx"):  # +inf past the f32 range, as the PTX ISA defines it
            with np.errstate(over="ignore"):
                return np.exp2(self.get(op.operands[0]).astype(np.float32))
        if re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16", text):
            found = WGMMA_RS.fullmatch(text.strip())
            if found is None:
                raise NotImplementedError(f"a register-A wgmma other than the interpreter's form: {text}")
            return self._wgmma_register_a(op, mask, found)
        raise NotImplementedError(text)

    # -- vectors
    def op_vector_extract(self, op, mask):
        x = self.get(op.operands[0])
        pos = list(ir.DenseI64ArrayAttr(op.attributes["static_position"]))
        return x[(slice(None), *pos)].copy()

    def op_vector_from_elements(self, op, mask):
        shape, dtype = _type_parts(op.results[0].type)
        return np.stack([self.get(x) for x in op.operands], 1).astype(dtype).reshape(self.threads, *shape)

    def op_vector_bitcast(self, op, mask):
        shape, dtype = _type_parts(op.results[0].type)
        x = np.ascontiguousarray(self.get(op.operands[0]))
        return x.view(dtype).reshape(self.threads, *shape)

    # -- scalars
    def op_arith_constant(self, op, mask):
        attr = op.attributes["value"]
        shape, dtype = _type_parts(op.results[0].type)
        if shape:
            value = np.array(ir.DenseElementsAttr(attr).get_splat_value().value)
        elif isinstance(attr, ir.FloatAttr) or "f" in str(op.results[0].type):
            value = ir.FloatAttr(attr).value
        else:
            value = ir.IntegerAttr(attr).value
        return np.full((self.threads, *shape), value, dtype)

    def _binary(self, op, fn):
        a, b = (self.get(x) for x in op.operands)
        _, dtype = _type_parts(op.results[0].type)
        with np.errstate(all="ignore"):
            return fn(a, b).astype(dtype)

    def op_arith_addi(self, op, mask): return self._binary(op, np.add)
    def op_arith_subi(self, op, mask): return self._binary(op, np.subtract)
    def op_arith_muli(self, op, mask): return self._binary(op, np.multiply)
    def op_arith_andi(self, op, mask): return self._binary(op, np.bitwise_and)
    def op_arith_ori(self, op, mask): return self._binary(op, np.bitwise_or)
    def op_arith_xori(self, op, mask): return self._binary(op, np.bitwise_xor)
    def op_arith_shli(self, op, mask): return self._binary(op, np.left_shift)
    def op_arith_shrui(self, op, mask): return self._binary(op, np.right_shift)
    def op_arith_minui(self, op, mask): return self._binary(op, np.minimum)
    def op_arith_maxui(self, op, mask): return self._binary(op, np.maximum)
    def op_arith_addf(self, op, mask): return self._binary(op, np.add)
    def op_arith_subf(self, op, mask): return self._binary(op, np.subtract)
    def op_arith_mulf(self, op, mask): return self._binary(op, np.multiply)
    def op_arith_divf(self, op, mask): return self._binary(op, np.divide)
    def op_arith_maxnumf(self, op, mask): return self._binary(op, np.fmax)
    def op_arith_maximumf(self, op, mask): return self._binary(op, np.maximum)  # NaN-propagating
    def op_arith_minsi(self, op, mask): return self._binary(op, np.minimum)

    def op_arith_divui(self, op, mask):
        return self._binary(op, lambda a, b: np.floor_divide(a, np.where(b == 0, 1, b)))

    def op_arith_remui(self, op, mask):
        return self._binary(op, lambda a, b: np.remainder(a, np.where(b == 0, 1, b)))

    def op_arith_negf(self, op, mask):
        return -self.get(op.operands[0])

    def op_arith_cmpi(self, op, mask):
        pred = ir.IntegerAttr(op.attributes["predicate"]).value
        a, b = (self.get(x) for x in op.operands)
        if pred >= 6:  # unsigned: ult ule ugt uge
            a, b = a.astype(np.uint64), b.astype(np.uint64)
            pred -= 4
        return _CMP[pred](a, b)

    def op_arith_select(self, op, mask):
        c, a, b = (self.get(x) for x in op.operands)
        return np.where(c.reshape(c.shape + (1,) * (a.ndim - c.ndim)), a, b)

    def op_arith_truncf(self, op, mask):
        _, dtype = _type_parts(op.results[0].type)
        return self.get(op.operands[0]).astype(dtype)

    def op_arith_extf(self, op, mask):
        return self.op_arith_truncf(op, mask)

    def op_arith_bitcast(self, op, mask):
        _, dtype = _type_parts(op.results[0].type)
        return np.ascontiguousarray(self.get(op.operands[0])).view(dtype)

    def op_arith_extui(self, op, mask):
        x = self.get(op.operands[0])
        unsigned = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]) if x.dtype != np.bool_ else x
        _, dtype = _type_parts(op.results[0].type)
        return unsigned.astype(dtype)

    def op_arith_maxsi(self, op, mask): return self._binary(op, np.maximum)

    def op_arith_extsi(self, op, mask):
        _, dtype = _type_parts(op.results[0].type)
        return self.get(op.operands[0]).astype(dtype)

    def op_arith_index_cast(self, op, mask):
        _, dtype = _type_parts(op.results[0].type)
        return self.get(op.operands[0]).astype(dtype)

    def op_math_fma(self, op, mask):
        a, b, c = (self.get(x).astype(np.float64) for x in op.operands)
        return (a * b + c).astype(np.float32)

    def op_math_log2(self, op, mask):
        with np.errstate(all="ignore"):
            return np.log2(self.get(op.operands[0]))


def run_kernel(module_text: str, grid: tuple[int, int, int], block: tuple[int, int, int], shared_bytes: int,
               buffers: dict[str, np.ndarray]) -> None:
    """Run every block of the module's one gpu.func on `buffers` (its arguments in order, by name;
    arrays are updated in place)."""
    memories = {name: Memory(np.ascontiguousarray(a).reshape(-1).view(np.int8), a.dtype) for name, a in buffers.items()}
    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(module_text)
        gpu_module = next(op for op in module.body.operations if op.operation.name == "gpu.module")
        func = next(op for op in gpu_module.regions[0].blocks[0].operations if op.operation.name == "gpu.func")
        threads = block[0]
        for z in range(grid[2]):
            for y in range(grid[1]):
                for x in range(grid[0]):
                    shared = np.full(shared_bytes, 0x7F, np.int8)  # poisoned: NaN-like bytes if read unwritten
                    runner = _Block(func, threads, (x, y, z), memories, shared)
                    runner.run_block(func.regions[0].blocks[0], np.ones(threads, bool))
    for name, a in buffers.items():
        flat = memories[name].bytes.view(a.dtype)
        if not np.shares_memory(flat, a):
            a.reshape(-1)[:] = flat
