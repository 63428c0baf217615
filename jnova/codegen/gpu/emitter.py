"""Text emitter for one `gpu.func` and the `gpu.module` around it.

`GpuEmitter` is also the `em` that the linalg lowering rules (`codegen/linalg/rules_*.py`) are called
with: where a rule asks for a `linalg.generic` over tensors, the emitter runs the rule's scalar body on
the registers it is given and returns the scalar result. So the GPU kernels compute exactly the scalar
math of the CPU path (XLA's special values, f32 math for 16-bit floats) without a second copy of it.

Kernel ABI (see shared/notes/mlir-gpu-codegen.md): one flat memref per array, inputs then outputs,
each a bare pointer aligned to 16 bytes; bools are stored as bytes (`i8`) and are `i1` in registers.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from jnova.codegen.linalg.emitter import KernelEmitter, Scalar, element, storage
from jnova.dialect.types import UNSIGNED_DTYPES, TensorType, bitwidth
from jnova.runtime.target import Target

ARG_ALIGN = 16  # bytes; jaxlib's kernel call checks it (ptr_divisibility) before every launch


@dataclass(frozen=True)
class GpuModule:
    """A kernel builder's product: the `gpu.module` text and how to launch its one kernel."""

    name: str
    text: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem_bytes: int  # dynamic shared memory; static (workgroup) buffers are in the PTX
    schedule: str  # the schedule it was built with, printed
    aliases: tuple[tuple[int, int], ...] = ()  # (input index, output index) pairs sharing a buffer
    tensor_maps: tuple = ()  # launch.TensorMap descriptors passed by value after the buffers


class GpuEmitter(KernelEmitter):
    """Lines of a gpu.func body, indented by region depth; fresh SSA names from KernelEmitter."""

    def __init__(self):
        super().__init__()
        self.depth = 2

    def line(self, text: str) -> None:
        self.lines.append("  " * self.depth + text)

    def scalar(self) -> Scalar:
        return Scalar(self, "  " * self.depth)

    def index(self, value: int) -> str:
        return self.op(f"arith.constant {int(value)} : index")

    def i32(self, value: int) -> str:
        return self.op(f"arith.constant {int(value)} : i32")

    @contextmanager
    def region(self, head: str, tail: str = "}"):
        """`head {` ... `tail`, with the lines emitted inside indented one level deeper."""
        self.line(head)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            self.line(tail)

    # -- the KernelEmitter interface the linalg lowering rules use, applied to scalars in registers
    def map_elementwise(self, xs, out, body):
        return body(self.scalar(), [x for x, _ in xs])

    def generic(self, ins, outs, iterators, body):
        result = body(self.scalar(), [v for v, _, _ in ins] + [None] * len(outs))
        return [result] if isinstance(result, str) else list(result)

    def empty(self, t: TensorType):
        return None  # a rule's destination tensor: nothing to allocate in registers

    def bf16_to_f32(self, s: Scalar, x: str) -> str:
        """bf16 -> f32 as bits (the 16 bits, shifted to the top of an f32), not `arith.extf`.

        With `extf`, LLVM folds f32 math on widened bf16 values back into bf16 instructions
        (`add.rn.bf16`, `setp.gt.bf16`; exact: f32 has more than 2 * 8 + 2 bits), and ptxas (CUDA 13.0,
        V13.0.88, sm_90a) packs those into HADD2.BF16_V2 with a register allocation that overwrites a
        live value: a kernel of a bf16 cummax gave a wrong element on an H200
        (tests/difftest/findings.py). As bits, the math stays f32 and only `cvt.rn.bf16.f32` narrows.
        """
        bits = s.op(f"arith.bitcast {x} : bf16 to i16")
        wide = s.op(f"arith.extui {bits} : i16 to i32")
        top = s.op(f"arith.shli {wide}, {s.const(16, 'int32')} : i32")
        return s.op(f"arith.bitcast {top} : i32 to f32")


def flat_memref(t: TensorType) -> str:
    """Every array is passed as a flat memref; kernels compute row-major offsets themselves."""
    return f"memref<{max(t.size, 1)}x{storage(t.dtype)}>"


def scalar_constant(s: Scalar, value, dtype: str) -> str:
    """A register holding `value` as `dtype` (unsigned values as their two's-complement bit pattern)."""
    if dtype in UNSIGNED_DTYPES:
        n = bitwidth(dtype)
        v = int(value) % (1 << n)
        value = v - (1 << n) if v >> (n - 1) else v
    elif dtype == "bool":
        value = bool(value)
    return s.const(value, dtype)


def is_splat(value: np.ndarray) -> bool:
    """Whether every element has the bit pattern of the first (so NaN constants count as uniform)."""
    flat = np.ascontiguousarray(value).reshape(-1)
    if flat.size <= 1:
        return True
    by_element = flat.view(np.uint8).reshape(flat.size, -1)
    return bool((by_element == by_element[0]).all())


def widen_for_exchange(s: Scalar, x: str, dtype: str) -> tuple[str, str]:
    """`x` in a type shuffles and shared memory take (32 or 64 bits); returns (value, its MLIR type)."""
    e = element(dtype)
    if dtype == "bool" or bitwidth(dtype) < 32:
        if e.startswith("f") or e == "bf16":
            raise TypeError(f"no 16-bit float accumulators (got {dtype}); accumulate in f32")
        return s.op(f"arith.extui {x} : {e} to i32"), "i32"
    return x, e


def narrow_after_exchange(s: Scalar, x: str, dtype: str) -> str:
    e = element(dtype)
    if dtype == "bool" or bitwidth(dtype) < 32:
        return s.op(f"arith.trunci {x} : i32 to {e}")
    return x


def ptx_features(target: Target) -> str:
    """PTX ISA 8.0 covers sm_80 to sm_90a (wgmma, setmaxnreg); newer chips need a newer ISA."""
    return "+ptx80" if target.compute_capability <= (9, 0) else "+ptx86"


def gpu_module_text(name: str, target: Target, params: list[tuple[str, TensorType]], body: list[str],
                    block: int, workgroup: list[str] = ()) -> str:
    """A `gpu.module @<name>_module` with one kernel `@<name>(params...)` whose body is `body`."""
    args = ", ".join(f"{arg}: {flat_memref(t)} {{llvm.align = {ARG_ALIGN} : i64}}" for arg, t in params)
    shared = f" workgroup({', '.join(workgroup)})" if workgroup else ""
    nvvm = f'#nvvm.target<O = 3, chip = "{target.arch}", features = "{ptx_features(target)}">'
    return "\n".join([
        "module attributes {gpu.container_module} {",
        f"gpu.module @{name}_module [{nvvm}] {{",
        f"  gpu.func @{name}({args}){shared} kernel attributes {{known_block_size = array<i32: {block}, 1, 1>}} {{",
        *body,
        "    gpu.return",
        "  }",
        "}",
        "}",
    ]) + "\n"


def kernel_params(inputs, outputs) -> tuple[list[tuple[str, TensorType]], dict, list[str]]:
    """The gpu.func parameters (`%in<i>`, then `%out<i>`), the input memref of each input value, and
    the output memref names, in order."""
    params = [(f"%in{i}", v.type) for i, v in enumerate(inputs)] + [(f"%out{i}", v.type) for i, v in enumerate(outputs)]
    return params, {v: f"%in{i}" for i, v in enumerate(inputs)}, [f"%out{i}" for i in range(len(outputs))]


def global_thread(em: GpuEmitter, block: int) -> tuple[str, str]:
    """(the block's index, this thread's index in the grid), as index values."""
    bid = em.op("gpu.block_id x")
    tid = em.op("gpu.thread_id x")
    return bid, em.op(f"arith.addi {em.op(f'arith.muli {bid}, {em.index(block)} : index')}, {tid} : index")
