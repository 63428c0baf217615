"""Scalar conversions between nova dtypes, with JAX's convert_element_type semantics."""
from __future__ import annotations

from jnova.dialect.types import FLOAT_DTYPES, UNSIGNED_DTYPES, bitwidth


def emit_cast(s, x: str, src: str, dst: str) -> str:
    from jnova.codegen.linalg.emitter import element

    if src == dst:
        return x
    es, ed = element(src), element(dst)
    if dst == "bool":
        zero = s.const(0, src)
        cmp = "arith.cmpf une" if src in FLOAT_DTYPES else "arith.cmpi ne"
        return s.op(f"{cmp}, {x}, {zero} : {es}")
    if src == "bool":
        if dst in FLOAT_DTYPES:
            return s.op(f"arith.uitofp {x} : i1 to {ed}")
        return s.op(f"arith.extui {x} : i1 to {ed}")
    if dst == "bfloat16" and src not in ("float32", "bfloat16"):  # as XLA: everything reaches bf16 through f32
        return emit_cast(s, emit_cast(s, x, src, "float32"), "float32", dst)
    if src in FLOAT_DTYPES and dst in FLOAT_DTYPES:
        if bitwidth(src) == bitwidth(dst):  # f16 -> bf16 handled above; bf16 -> f16 through f32 (exact)
            return s.op(f"arith.truncf {s.em.bf16_to_f32(s, x)} : f32 to {ed}")
        if src == "bfloat16" and dst == "float32":
            return s.em.bf16_to_f32(s, x)
        op = "arith.extf" if bitwidth(dst) > bitwidth(src) else "arith.truncf"
        return s.op(f"{op} {x} : {es} to {ed}")
    if src in FLOAT_DTYPES:  # float -> int: NaN -> 0, saturate at the integer range (as XLA does)
        return _float_to_int(s, x, src, dst)
    if dst in FLOAT_DTYPES:
        op = "arith.uitofp" if src in UNSIGNED_DTYPES else "arith.sitofp"
        return s.op(f"{op} {x} : {es} to {ed}")
    # int -> int
    if bitwidth(dst) > bitwidth(src):
        op = "arith.extui" if src in UNSIGNED_DTYPES else "arith.extsi"
        return s.op(f"{op} {x} : {es} to {ed}")
    if bitwidth(dst) < bitwidth(src):
        return s.op(f"arith.trunci {x} : {es} to {ed}")
    return x  # same width, signedness only


def _float_to_int(s, x: str, src: str, dst: str) -> str:
    from jnova.codegen.linalg.emitter import element

    import numpy as np

    es, ed = element(src), element(dst)
    if src == "bfloat16":
        x, es, src = s.em.bf16_to_f32(s, x), "f32", "float32"
    elif src != "float32" and src != "float64":
        x = s.op(f"arith.extf {x} : {es} to f32")
        es, src = "f32", "float32"
    info = np.iinfo(dst)
    lo, hi = s.const(float(info.min), src), s.const(float(info.max), src)
    clamped = s.op(f"arith.minimumf {s.op(f'arith.maximumf {x}, {lo} : {es}')}, {hi} : {es}")
    op = "arith.fptoui" if dst in UNSIGNED_DTYPES else "arith.fptosi"
    converted = s.op(f"{op} {clamped} : {es} to {ed}")
    # fptosi of a value at the top of the range rounds past it; pin exact max / NaN -> 0 like XLA
    is_nan = s.op(f"arith.cmpf uno, {x}, {x} : {es}")
    too_big = s.op(f"arith.cmpf oge, {x}, {hi} : {es}")
    top = s.const(int(info.max), dst)
    zero = s.const(0, dst)
    converted = s.op(f"arith.select {too_big}, {top}, {converted} : {ed}")
    return s.op(f"arith.select {is_nan}, {zero}, {converted} : {ed}")
