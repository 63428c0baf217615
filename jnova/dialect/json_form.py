"""nova functions as JSON values, read back without MLIR.

The persistent cache keeps the kernels that run as XLA ops (no GPU builder takes them) in this form:
a warm compile rebuilds them without importing MLIR's bindings and parsing their text, which took
most of restoring GPT-2's step. Values are numbered as in `plan_to_json`: arguments, then op results
in program order. An attribute is the JSON value of its kind (the kind its op declares); a dense
constant is its shape and the hex of its bytes in its result's dtype.

Round trip: `func_from_json(func_to_json(f)).print() == f.print()`.
"""
from __future__ import annotations

import numpy as np

from jnova.dialect.ir import Dense, F64, Func, I64Array, Op
from jnova.dialect.ops import OPS
from jnova.dialect.types import TensorType, numpy_dtype
from jnova.errors import VerifyError


def func_to_json(func: Func) -> dict:
    ids: dict = {}
    for i, v in enumerate(func.args):  # a value passed twice (a batch of kernels sharing an input) reads the first
        ids.setdefault(v, i)
    count = len(func.args)
    ops = []
    for op in func.ops:
        ops.append({"op": op.name, "in": [ids[v] for v in op.operands], "out": [_type(r.type) for r in op.results],
                    "attrs": {k: _attr_to_json(op, k) for k in sorted(op.attrs)}})
        for r in op.results:
            ids[r], count = count, count + 1
    return {"name": func.name, "args": [_type(a.type) for a in func.args], "ops": ops,
            "returns": [ids[v] for v in func.returns]}


def func_from_json(data: dict) -> Func:
    """The function `func_to_json` wrote (not verified: call `verify()`)."""
    func = Func(data["name"], [TensorType(tuple(shape), dtype) for shape, dtype in data["args"]])
    values = list(func.args)
    for d in data["ops"]:
        cls = OPS.get(d["op"])
        if cls is None:
            raise VerifyError(f"unknown op '{d['op']}' (not in the nova dialect)")
        types = [TensorType(tuple(shape), dtype) for shape, dtype in d["out"]]
        attrs = {k: _attr_from_json(cls, k, v, types) for k, v in d["attrs"].items()}
        op = func.add(cls([values[i] for i in d["in"]], types, attrs))
        values.extend(op.results)
    func.returns = [values[i] for i in data["returns"]]
    return func


def _type(t: TensorType) -> list:
    return [list(t.shape), t.dtype]


def _attr_to_json(op: Op, key: str):
    kind, value = op.attributes.get(key), op.attrs[key]
    if kind is None:
        raise op.error(f"cannot write unknown attribute '{key}' (expected only {sorted(op.attributes)})")
    if kind is Dense:  # as held (a splat may be one element), broadcast to the result type when read
        array = np.asarray(value, dtype=numpy_dtype(op.results[0].type.dtype))
        return {"shape": list(array.shape), "hex": array.tobytes().hex()}
    if kind is I64Array:
        return [int(v) for v in value]
    if kind is F64:
        return float(value)
    return value.item() if isinstance(value, np.generic) else value  # I64, Bool, Str


def _attr_from_json(cls: type[Op], key: str, value, types: list[TensorType]):
    kind = cls.attributes.get(key)
    if kind is None:
        raise VerifyError(f"'{cls.name}' op: unknown attribute '{key}' (expected only {sorted(cls.attributes)})")
    if kind is Dense:
        t = types[0]
        array = np.frombuffer(bytes.fromhex(value["hex"]), numpy_dtype(t.dtype)).reshape(value["shape"])
        return np.array(np.broadcast_to(array, t.shape))  # a C-contiguous copy, as parse.py reads it
    if kind is I64Array:
        return tuple(value)
    return value
