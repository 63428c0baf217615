"""Text emitter for linalg-on-tensors IR: SSA names, affine maps, linalg.generic and scalar bodies.

Lowering rules (`rules_*.py`) use this to write each nova op as tensor-level MLIR. Integer tensors
are signless here (`ui32` becomes `i32`); the rules pick signed or unsigned arithmetic from the
nova dtype.

Bool tensors and memrefs hold `i8` (one byte per element, NumPy's and XLA's layout; LLVM cannot
store `i1` memrefs). Scalar code always sees `i1`: `generic` truncates bool block arguments on entry
and widens yielded bools, so lowering rules never handle the byte form themselves.
"""
from __future__ import annotations

from typing import Callable, Sequence

from jnova.dialect.ir import format_float
from jnova.dialect.types import FLOAT_DTYPES, TensorType, bitwidth, mlir_element

LOW_PRECISION = frozenset({"float16", "bfloat16"})


def element(dtype: str) -> str:
    """The signless MLIR element type of a nova dtype."""
    e = mlir_element(dtype)
    return e[1:] if e.startswith("ui") else e


def storage(dtype: str) -> str:
    """The element type of a nova dtype inside tensors and memrefs (`i8` for bool)."""
    return "i8" if dtype == "bool" else element(dtype)


def tensor(t: TensorType) -> str:
    return f"tensor<{''.join(f'{d}x' for d in t.shape)}{storage(t.dtype)}>"


def memref(t: TensorType) -> str:
    return f"memref<{''.join(f'{d}x' for d in t.shape)}{storage(t.dtype)}>"


def affine_map(num_dims: int, results: Sequence[str | int]) -> str:
    dims = ", ".join(f"d{i}" for i in range(num_dims))
    res = ", ".join(f"d{r}" if isinstance(r, int) else r for r in results)
    return f"affine_map<({dims}) -> ({res})>"


def identity_map(rank: int) -> str:
    return affine_map(rank, list(range(rank)))


def compute_dtype(dtype: str) -> str:
    """Elementwise math on 16-bit floats runs in f32 and rounds once per op (as XLA does)."""
    return "float32" if dtype in LOW_PRECISION else dtype


class Scalar:
    """Builds the scalar body of a linalg region; each method returns the SSA name it defined."""

    def __init__(self, emitter: "KernelEmitter", indent: str):
        self.em = emitter
        self.indent = indent

    def op(self, text: str, type_: str | None = None) -> str:
        """Emit `%n = <text>` and return `%n` (`type_` only documents the result)."""
        name = self.em.fresh()
        self.em.lines.append(f"{self.indent}{name} = {text}")
        return name

    def const(self, value, dtype: str) -> str:
        e = element(dtype)
        if dtype == "bool":
            return self.op(f"arith.constant {'true' if value else 'false'}")
        if dtype in FLOAT_DTYPES:
            return self.op(f"arith.constant {format_float(float(value), e)} : {e}")
        n = bitwidth(dtype)  # signless: spell the bit pattern as an n-bit two's complement value
        value = int(value) & ((1 << n) - 1)
        return self.op(f"arith.constant {value - (1 << n) if value >> (n - 1) else value} : {e}")

    def index_const(self, value: int) -> str:
        return self.op(f"arith.constant {int(value)} : index")

    def index(self, dim: int) -> str:
        return self.op(f"linalg.index {dim} : index")

    def float_max_min(self, kind: str, a: str, b: str, dtype: str) -> str:
        """IEEE maximum/minimum, as XLA computes max/min: NaN if either is NaN, and -0.0 < +0.0.

        Written on the bit patterns: MLIR canonicalizes a float select of a comparison into
        `arith.maximumf`, which the CPU pipeline's arith-expand lowers without the zero rule.
        """
        e, bits = element(dtype), f"i{bitwidth(dtype)}"
        a_bits, b_bits = self.op(f"arith.bitcast {a} : {e} to {bits}"), self.op(f"arith.bitcast {b} : {e} to {bits}")
        pick = self.op(f"arith.cmpf {'ogt' if kind == 'max' else 'olt'}, {a}, {b} : {e}")
        result = self.op(f"arith.select {pick}, {a_bits}, {b_bits} : {bits}")
        # equal operands differ only as +0.0 / -0.0: max ANDs the sign bits, min ORs them
        merged = self.op(f"arith.{'andi' if kind == 'max' else 'ori'} {a_bits}, {b_bits} : {bits}")
        result = self.op(f"arith.select {self.op(f'arith.cmpf oeq, {a}, {b} : {e}')}, {merged}, {result} : {bits}")
        a_nan = self.op(f"arith.cmpf uno, {a}, {a} : {e}")
        result = self.op(f"arith.select {a_nan}, {a_bits}, {result} : {bits}")
        b_nan = self.op(f"arith.cmpf uno, {b}, {b} : {e}")
        result = self.op(f"arith.select {b_nan}, {b_bits}, {result} : {bits}")
        return self.op(f"arith.bitcast {result} : {bits} to {e}")

    def cast(self, x: str, src: str, dst: str) -> str:
        """Convert a scalar between nova dtypes with JAX's convert_element_type semantics."""
        from jnova.codegen.linalg.casts import emit_cast

        return emit_cast(self, x, src, dst)


class KernelEmitter:
    """Accumulates the lines of one kernel function and hands out fresh SSA names."""

    def __init__(self):
        self.lines: list[str] = []
        self.counter = 0

    def fresh(self, hint: str = "v") -> str:
        self.counter += 1
        return f"%{hint}{self.counter}"

    def line(self, text: str) -> None:
        self.lines.append("  " + text)

    def op(self, text: str) -> str:
        name = self.fresh()
        self.line(f"{name} = {text}")
        return name

    def empty(self, t: TensorType) -> str:
        return self.op(f"tensor.empty() : {tensor(t)}")

    def bf16_to_f32(self, s: "Scalar", x: str) -> str:
        """`x` (a bf16 register) as f32, exactly; the GPU emitter spells it differently."""
        return s.op(f"arith.extf {x} : bf16 to f32")

    def filled(self, t: TensorType, value) -> str:
        """A tensor of type `t` filled with the scalar `value`."""
        init = self.empty(t)
        s = Scalar(self, "  ")
        c = s.const(int(bool(value)), "int8") if t.dtype == "bool" else s.const(value, t.dtype)
        return self.op(f"linalg.fill ins({c} : {storage(t.dtype)}) outs({init} : {tensor(t)}) -> {tensor(t)}")

    def generic(self, ins: Sequence[tuple[str, TensorType, str]], outs: Sequence[tuple[str, TensorType, str]],
                iterators: Sequence[str], body: Callable[[Scalar, list[str]], list[str] | str]) -> list[str]:
        """A linalg.generic; `ins`/`outs` are (value, type, affine map); body returns yielded names."""
        maps = ", ".join(m for _, _, m in list(ins) + list(outs))
        its = ", ".join(f'"{i}"' for i in iterators)
        results = [self.fresh() for _ in outs]
        lhs = ", ".join(results)
        ins_text = f" ins({', '.join(v for v, _, _ in ins)} : {', '.join(tensor(t) for _, t, _ in ins)})" if ins else ""
        outs_text = f" outs({', '.join(v for v, _, _ in outs)} : {', '.join(tensor(t) for _, t, _ in outs)})"
        out_types = ", ".join(tensor(t) for _, t, _ in outs)
        self.line(f"{lhs} = linalg.generic {{indexing_maps = [{maps}], iterator_types = [{its}]}}{ins_text}{outs_text} {{")
        operand_types = [t for _, t, _ in list(ins) + list(outs)]
        args = [self.fresh("a") for _ in operand_types]
        arg_decl = ", ".join(f"{a}: {storage(t.dtype)}" for a, t in zip(args, operand_types))
        self.lines.append(f"  ^bb0({arg_decl}):")
        s = Scalar(self, "    ")
        args = [s.op(f"arith.trunci {a} : i8 to i1") if t.dtype == "bool" else a for a, t in zip(args, operand_types)]
        yielded = body(s, args)
        yielded = [yielded] if isinstance(yielded, str) else list(yielded)
        yielded = [s.op(f"arith.extui {y} : i1 to i8") if t.dtype == "bool" else y for y, (_, t, _) in zip(yielded, outs)]
        types = ", ".join(storage(t.dtype) for _, t, _ in outs)
        self.lines.append(f"    linalg.yield {', '.join(yielded)} : {types}")
        self.line(f"}} -> {out_types}" if len(outs) == 1 else f"}} -> ({out_types})")
        return results

    def map_elementwise(self, xs: Sequence[tuple[str, TensorType]], out: TensorType,
                        body: Callable[[Scalar, list[str]], str]) -> str:
        """An all-parallel generic over `out`'s shape whose inputs have the same shape."""
        m = identity_map(out.rank)
        return self.generic([(v, t, m) for v, t in xs], [(self.empty(out), out, m)], ["parallel"] * out.rank,
                            lambda s, args: body(s, args[: len(xs)]))[0]
