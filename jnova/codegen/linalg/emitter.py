"""Text emitter for linalg-on-tensors IR: SSA names, affine maps, linalg.generic and scalar bodies.

Lowering rules (`rules_*.py`) use this to write each nova op as tensor-level MLIR. Integer tensors
are signless here (`ui32` becomes `i32`); the rules pick signed or unsigned arithmetic from the
nova dtype.
"""
from __future__ import annotations

from typing import Callable, Sequence

from jnova.dialect.ir import format_float
from jnova.dialect.types import FLOAT_DTYPES, TensorType, mlir_element

LOW_PRECISION = frozenset({"float16", "bfloat16"})


def element(dtype: str) -> str:
    """The signless MLIR element type of a nova dtype."""
    e = mlir_element(dtype)
    return e[1:] if e.startswith("ui") else e


def tensor(t: TensorType) -> str:
    return f"tensor<{''.join(f'{d}x' for d in t.shape)}{element(t.dtype)}>"


def memref(t: TensorType) -> str:
    return f"memref<{''.join(f'{d}x' for d in t.shape)}{element(t.dtype)}>"


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
        return self.op(f"arith.constant {int(value)} : {e}")

    def index_const(self, value: int) -> str:
        return self.op(f"arith.constant {int(value)} : index")

    def index(self, dim: int) -> str:
        return self.op(f"linalg.index {dim} : index")

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

    def filled(self, t: TensorType, value) -> str:
        """A tensor of type `t` filled with the scalar `value`."""
        init = self.empty(t)
        s = Scalar(self, "  ")
        c = s.const(value, t.dtype)
        return self.op(f"linalg.fill ins({c} : {element(t.dtype)}) outs({init} : {tensor(t)}) -> {tensor(t)}")

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
        args = [self.fresh("a") for _ in list(ins) + list(outs)]
        arg_decl = ", ".join(f"{a}: {element(t.dtype)}" for a, (_, t, _) in zip(args, list(ins) + list(outs)))
        self.lines.append(f"  ^bb0({arg_decl}):")
        yielded = body(Scalar(self, "    "), args)
        yielded = [yielded] if isinstance(yielded, str) else list(yielded)
        types = ", ".join(element(t.dtype) for _, t, _ in outs)
        self.lines.append(f"    linalg.yield {', '.join(yielded)} : {types}")
        self.line(f"}} -> {out_types}")
        return results

    def map_elementwise(self, xs: Sequence[tuple[str, TensorType]], out: TensorType,
                        body: Callable[[Scalar, list[str]], str]) -> str:
        """An all-parallel generic over `out`'s shape whose inputs have the same shape."""
        m = identity_map(out.rank)
        return self.generic([(v, t, m) for v, t in xs], [(self.empty(out), out, m)], ["parallel"] * out.rank,
                            lambda s, args: body(s, args[: len(xs)]))[0]
