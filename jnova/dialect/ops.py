"""The ops of the nova dialect, each with its operands, attributes and verifier.

Elementwise ops are declared from tables; every other op is a class whose `verify_` names the
offending operand and what was expected. `OPS` maps op names to classes (used by the parser and
the IRDL registration).
"""
from __future__ import annotations

from typing import ClassVar

from jnova.dialect.ir import Dense, F64, I64, I64Array, Op, Str
from jnova.dialect.types import FLOAT_DTYPES, INTEGER_DTYPES, TensorType, bitwidth, numpy_dtype

OPS: dict[str, type[Op]] = {}


def register(cls: type[Op]) -> type[Op]:
    if cls.name in OPS:
        raise ValueError(f"nova op {cls.name} registered twice")
    OPS[cls.name] = cls
    return cls


def _same_shape(op: Op, which: str, got: TensorType, want: TensorType):
    if got.shape != want.shape:
        raise op.error(f"{which} has shape {got.shape}, expected {want.shape}")


def _perm_check(op: Op, name: str, perm, rank: int):
    if sorted(perm) != list(range(rank)):
        raise op.error(f"attribute '{name}' = {perm} is not a permutation of 0..{rank - 1}")


def _starts_check(op: Op, starts, first: int):
    """Start indices are integer scalars of one type (as JAX requires, and as IRDL checks a variadic list)."""
    for i, s in enumerate(starts):
        if s.type.shape != () or s.type.dtype not in INTEGER_DTYPES:
            raise op.error(f"{op.operand_label(first + i)} has type {s.type}, expected an integer scalar")
        if s.type != starts[0].type:
            raise op.error(f"{op.operand_label(first + i)} has type {s.type}, expected {starts[0].type} like "
                           f"{op.operand_label(first)}")


def _dims_check(op: Op, name: str, dims, rank: int, *, unique=True):
    for d in dims:
        if not 0 <= d < rank:
            raise op.error(f"attribute '{name}' = {dims} has dimension {d} out of range for rank {rank}")
    if unique and len(set(dims)) != len(dims):
        raise op.error(f"attribute '{name}' = {dims} repeats a dimension")


# --------------------------------------------------------------------------- elementwise
class ElementwiseOp(Op):
    """Same-shape operands and result; `float_only` ops reject integer element types."""

    float_only: ClassVar[bool] = False
    result_dtype: ClassVar[str | None] = None  # fixed result dtype (e.g. bool for comparisons)

    def verify_(self):
        out, first = self.results[0].type, self.operands[0].type
        for i, v in enumerate(self.operands):
            _same_shape(self, self.operand_label(i), v.type, out)
            if v.type.dtype != first.dtype:
                raise self.error(f"{self.operand_label(i)} has element type {v.type.dtype}, expected {first.dtype} "
                                 f"like {self.operand_label(0)}")
        if self.float_only and first.dtype not in FLOAT_DTYPES:
            raise self.error(f"{self.operand_label(0)} has element type {first.dtype}, expected a float type")
        want = self.result_dtype or first.dtype
        if out.dtype != want:
            raise self.error(f"result has element type {out.dtype}, expected {want}")


def _elementwise(name: str, arity: int, *, float_only=False, result_dtype=None, attributes=None, summary=""):
    operands = ("x",) if arity == 1 else ("lhs", "rhs")
    cls = type(
        "".join(p.capitalize() for p in name.split("_")) + "Op",
        (ElementwiseOp,),
        {"name": f"nova.{name}", "operands_spec": operands, "float_only": float_only,
         "result_dtype": result_dtype, "attributes": dict(attributes or {}), "summary": summary,
         "__slots__": ()},
    )
    return register(cls)


UNARY_FLOAT = ("exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "erf", "erfc", "erf_inv", "sqrt",
               "rsqrt", "cbrt", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh",
               "acosh", "atanh", "floor", "ceil")
UNARY_ANY = ("neg", "abs", "sign", "square", "not", "population_count", "clz")
BINARY_ANY = ("add", "sub", "mul", "div", "rem", "max", "min", "pow", "and", "or", "xor",
              "shift_left", "shift_right_logical", "shift_right_arithmetic")
BINARY_FLOAT = ("atan2", "nextafter")

for _n in UNARY_FLOAT:
    _elementwise(_n, 1, float_only=True)
for _n in UNARY_ANY:
    _elementwise(_n, 1)
for _n in BINARY_ANY:
    _elementwise(_n, 2)
for _n in BINARY_FLOAT:
    _elementwise(_n, 2, float_only=True)
_elementwise("is_finite", 1, float_only=True, result_dtype="bool")
_elementwise("round", 1, float_only=True, attributes={"method": Str},
             summary="method: 'away_from_zero' or 'to_nearest_even'")
_elementwise("reduce_precision", 1, float_only=True, attributes={"exponent_bits": I64, "mantissa_bits": I64})
_elementwise("ipow", 1, attributes={"exponent": I64}, summary="x ** exponent for an integer exponent")

COMPARE_PREDICATES = ("eq", "ne", "lt", "le", "gt", "ge")


@register
class CompareOp(ElementwiseOp):
    name = "nova.compare"
    operands_spec = ("lhs", "rhs")
    attributes = {"predicate": Str}
    result_dtype = "bool"

    def verify_(self):
        super().verify_()
        if self.attrs["predicate"] not in COMPARE_PREDICATES:
            raise self.error(f"attribute 'predicate' = {self.attrs['predicate']!r}, expected one of {COMPARE_PREDICATES}")


@register
class SelectOp(Op):
    """JAX's select_n: the result takes cases[which] elementwise (bool which: false -> 0, true -> 1)."""

    name = "nova.select"
    operands_spec = ("which", "*cases")

    def verify_(self):
        which, cases, out = self.operands[0].type, self.variadic_operands(), self.results[0].type
        if not cases:
            raise self.error("expected at least one operand 'cases'")
        if which.dtype != "bool" and which.dtype not in INTEGER_DTYPES:
            raise self.error(f"operand 'which' has element type {which.dtype}, expected bool or an integer")
        if which.dtype == "bool" and len(cases) > 2:
            raise self.error(f"operand 'which' is bool, so expected at most 2 operands 'cases', got {len(cases)}")
        if which.shape not in ((), out.shape):
            raise self.error(f"operand 'which' has shape {which.shape}, expected () or {out.shape}")
        for i, c in enumerate(cases):
            if c.type != out:
                raise self.error(f"operand 'cases' #{i} has type {c.type}, expected the result type {out}")


@register
class ConvertOp(Op):
    """Element type conversion with JAX's convert_element_type semantics."""

    name = "nova.convert"
    operands_spec = ("x",)

    def verify_(self):
        _same_shape(self, "result", self.results[0].type, self.operands[0].type)


@register
class BitcastOp(ConvertOp):
    """Reinterpret each element's bits as another type of the same width (bitcast_convert_type)."""

    name = "nova.bitcast"

    def verify_(self):
        super().verify_()
        src, dst = self.operands[0].type.dtype, self.results[0].type.dtype
        if "bool" in (src, dst) or bitwidth(src) != bitwidth(dst):
            raise self.error(f"cannot bitcast {src} to {dst}: expected two non-bool types of the same width")


# --------------------------------------------------------------------------- shapes
@register
class BroadcastOp(Op):
    """broadcast_in_dim: operand dimension i becomes result dimension dims[i]."""

    name = "nova.broadcast"
    operands_spec = ("x",)
    attributes = {"dims": I64Array}

    def verify_(self):
        x, out, dims = self.operands[0].type, self.results[0].type, self.attrs["dims"]
        if len(dims) != x.rank:
            raise self.error(f"attribute 'dims' has {len(dims)} entries, expected the operand rank {x.rank}")
        _dims_check(self, "dims", dims, out.rank)
        if list(dims) != sorted(dims):
            raise self.error(f"attribute 'dims' = {dims} must be increasing")
        for i, d in enumerate(dims):
            if x.shape[i] not in (1, out.shape[d]):
                raise self.error(f"operand dimension {i} has size {x.shape[i]}, expected 1 or {out.shape[d]}")
        if x.dtype != out.dtype:
            raise self.error(f"result has element type {out.dtype}, expected {x.dtype}")


@register
class ReshapeOp(Op):
    name = "nova.reshape"
    operands_spec = ("x",)

    def verify_(self):
        x, out = self.operands[0].type, self.results[0].type
        if x.size != out.size or x.dtype != out.dtype:
            raise self.error(f"result type {out} must have the element count ({x.size}) and element type "
                             f"({x.dtype}) of operand 'x' {x}")


@register
class TransposeOp(Op):
    """Result dimension i is operand dimension perm[i]."""

    name = "nova.transpose"
    operands_spec = ("x",)
    attributes = {"perm": I64Array}

    def verify_(self):
        x, out, perm = self.operands[0].type, self.results[0].type, self.attrs["perm"]
        _perm_check(self, "perm", perm, x.rank)
        want = TensorType(tuple(x.shape[p] for p in perm), x.dtype)
        if out != want:
            raise self.error(f"result has type {out}, expected {want} (operand 'x' {x} permuted by {perm})")


@register
class SliceOp(Op):
    name = "nova.slice"
    operands_spec = ("x",)
    attributes = {"start": I64Array, "limit": I64Array, "strides": I64Array}

    def verify_(self):
        x, out = self.operands[0].type, self.results[0].type
        start, limit, strides = self.attrs["start"], self.attrs["limit"], self.attrs["strides"]
        if not len(start) == len(limit) == len(strides) == x.rank:
            raise self.error(f"attributes 'start', 'limit' and 'strides' have {len(start)}, {len(limit)} and "
                             f"{len(strides)} entries, expected {x.rank} each (the rank of operand 'x')")
        for d in range(x.rank):
            if not (0 <= start[d] <= limit[d] <= x.shape[d]) or strides[d] < 1:
                raise self.error(f"attributes 'start', 'limit' and 'strides' slice dimension {d} of operand 'x' "
                                 f"(size {x.shape[d]}) as {start[d]}:{limit[d]}:{strides[d]}, expected "
                                 "0 <= start <= limit <= size and stride >= 1")
        want = TensorType(tuple(-(-(limit[d] - start[d]) // strides[d]) for d in range(x.rank)), x.dtype)
        if out != want:
            raise self.error(f"result has type {out}, expected {want}")


@register
class DynamicSliceOp(Op):
    """A `sizes` window at runtime start indices (one scalar operand per dimension), clamped in bounds."""

    name = "nova.dynamic_slice"
    operands_spec = ("x", "*starts")
    attributes = {"sizes": I64Array}

    def verify_(self):
        x, starts, sizes = self.operands[0].type, self.variadic_operands(), self.attrs["sizes"]
        if len(starts) != x.rank or len(sizes) != x.rank:
            raise self.error(f"expected {x.rank} operands 'starts' and {x.rank} entries in attribute 'sizes' (the rank "
                             f"of operand 'x'), got {len(starts)} and {len(sizes)}")
        _starts_check(self, starts, first=1)
        out = self.results[0].type
        if out.shape != tuple(sizes) or out.dtype != x.dtype or any(z > d for z, d in zip(sizes, x.shape)):
            raise self.error(f"result has type {out}, expected {TensorType(tuple(sizes), x.dtype)} with attribute "
                             f"'sizes' {sizes} within the shape {x.shape} of operand 'x'")


@register
class DynamicUpdateSliceOp(Op):
    name = "nova.dynamic_update_slice"
    operands_spec = ("x", "update", "*starts")

    def verify_(self):
        x, u, starts = self.operands[0].type, self.operands[1].type, self.variadic_operands()
        if len(starts) != x.rank:
            raise self.error(f"expected {x.rank} operands 'starts' (the rank of operand 'x'), got {len(starts)}")
        _starts_check(self, starts, first=2)
        if u.rank != x.rank or any(a > b for a, b in zip(u.shape, x.shape)) or u.dtype != x.dtype:
            raise self.error(f"operand 'update' has type {u}, expected a {x.dtype} tensor of rank {x.rank} that "
                             f"fits in operand 'x' {x}")
        if self.results[0].type != x:
            raise self.error(f"result has type {self.results[0].type}, expected the type of operand 'x' {x}")


@register
class ConcatenateOp(Op):
    name = "nova.concatenate"
    operands_spec = ("*inputs",)
    attributes = {"dim": I64}

    def verify_(self):
        ins, out, dim = self.operands, self.results[0].type, self.attrs["dim"]
        if not ins:
            raise self.error("expected at least one operand 'inputs'")
        if not 0 <= dim < out.rank:
            raise self.error(f"attribute 'dim' = {dim} is out of range for the result rank {out.rank}")
        total = 0
        for i, v in enumerate(ins):
            t = v.type
            if t.rank != out.rank or t.dtype != out.dtype or any(t.shape[d] != out.shape[d] for d in range(out.rank) if d != dim):
                raise self.error(f"operand 'inputs' #{i} has type {t}, expected the result's element type and sizes "
                                 f"({out}) except along dim {dim}")
            total += t.shape[dim]
        if total != out.shape[dim]:
            raise self.error(f"operands 'inputs' add up to {total} along dim {dim}, expected the result's size {out.shape[dim]}")


@register
class PadOp(Op):
    """lax.pad: low/high padding (may be negative) and interior padding per dimension."""

    name = "nova.pad"
    operands_spec = ("x", "value")
    attributes = {"low": I64Array, "high": I64Array, "interior": I64Array}

    def verify_(self):
        x, value, out = self.operands[0].type, self.operands[1].type, self.results[0].type
        lo, hi, inner = self.attrs["low"], self.attrs["high"], self.attrs["interior"]
        if value.shape != () or value.dtype != x.dtype:
            raise self.error(f"operand 'value' has type {value}, expected a {x.dtype} scalar")
        if not len(lo) == len(hi) == len(inner) == x.rank:
            raise self.error(f"attributes 'low', 'high' and 'interior' have {len(lo)}, {len(hi)} and {len(inner)} "
                             f"entries, expected {x.rank} each (the rank of operand 'x')")
        if any(i < 0 for i in inner):
            raise self.error(f"attribute 'interior' = {inner}, expected non-negative entries")
        want = TensorType(tuple(lo[d] + hi[d] + x.shape[d] + max(x.shape[d] - 1, 0) * inner[d] for d in range(x.rank)), x.dtype)
        if out != want:
            raise self.error(f"result has type {out}, expected {want}")


@register
class IotaOp(Op):
    name = "nova.iota"
    attributes = {"dim": I64}

    def verify_(self):
        if not 0 <= self.attrs["dim"] < max(self.results[0].type.rank, 1):
            raise self.error(f"attribute 'dim' = {self.attrs['dim']} is out of range for the result type {self.results[0].type}")


@register
class ReverseOp(Op):
    name = "nova.reverse"
    operands_spec = ("x",)
    attributes = {"dims": I64Array}

    def verify_(self):
        _dims_check(self, "dims", self.attrs["dims"], self.operands[0].type.rank)
        if self.results[0].type != self.operands[0].type:
            raise self.error(f"result has type {self.results[0].type}, expected the type of operand 'x' {self.operands[0].type}")


@register
class ConstantOp(Op):
    name = "nova.constant"
    attributes = {"value": Dense}

    def verify_(self):
        value, out = self.attrs["value"], self.results[0].type
        if tuple(value.shape) != out.shape:
            raise self.error(f"attribute 'value' has shape {tuple(value.shape)}, expected the result shape {out.shape}")
        if value.dtype != numpy_dtype(out.dtype):
            raise self.error(f"attribute 'value' has element type {value.dtype}, expected the result element type {out.dtype}")


# --------------------------------------------------------------------------- reductions
REDUCE_KINDS = ("sum", "prod", "max", "min", "and", "or", "xor")


@register
class ReduceOp(Op):
    name = "nova.reduce"
    operands_spec = ("x",)
    attributes = {"kind": Str, "dims": I64Array}

    def verify_(self):
        x, out, dims = self.operands[0].type, self.results[0].type, self.attrs["dims"]
        if self.attrs["kind"] not in REDUCE_KINDS:
            raise self.error(f"attribute 'kind' = {self.attrs['kind']!r}, expected one of {REDUCE_KINDS}")
        _dims_check(self, "dims", dims, x.rank)
        want = tuple(s for d, s in enumerate(x.shape) if d not in dims)
        if out.shape != want or out.dtype != x.dtype:
            raise self.error(f"result has type {out}, expected {TensorType(want, x.dtype)}")


@register
class ArgReduceOp(Op):
    """Index of the max/min along `axis` (first occurrence; NaN wins like XLA)."""

    name = "nova.argreduce"
    operands_spec = ("x",)
    attributes = {"kind": Str, "axis": I64}

    def verify_(self):
        x, out, axis = self.operands[0].type, self.results[0].type, self.attrs["axis"]
        if self.attrs["kind"] not in ("max", "min"):
            raise self.error(f"attribute 'kind' = {self.attrs['kind']!r}, expected 'max' or 'min'")
        _dims_check(self, "axis", (axis,), x.rank)
        want = tuple(s for d, s in enumerate(x.shape) if d != axis)
        if out.shape != want or out.dtype not in INTEGER_DTYPES:
            raise self.error(f"result has type {out}, expected integer indices of shape {want}")


# --------------------------------------------------------------------------- contraction
# What a contraction's arithmetic must be, in JAX's terms (`precision=` of dot_general and
# `jax.default_matmul_precision`): "default" lets f32 operands round to TF32 (as XLA does on NVIDIA
# GPUs), "highest" asks for f32-accurate products, "bfloat16" rounds f32 operands to bf16. Products
# always accumulate in f32; operands of other types are used as they are.
MATMUL_PRECISIONS = ("default", "highest", "bfloat16")


@register
class MatmulOp(Op):
    """dot_general: result dims are batch, then lhs free dims, then rhs free dims (in order)."""

    name = "nova.matmul"
    operands_spec = ("lhs", "rhs")
    attributes = {"lhs_batch": I64Array, "rhs_batch": I64Array, "lhs_contract": I64Array, "rhs_contract": I64Array,
                  "precision": Str}

    def free_dims(self):
        a = self.attrs
        lhs, rhs = self.operands[0].type, self.operands[1].type
        lf = [d for d in range(lhs.rank) if d not in a["lhs_batch"] and d not in a["lhs_contract"]]
        rf = [d for d in range(rhs.rank) if d not in a["rhs_batch"] and d not in a["rhs_contract"]]
        return lf, rf

    def verify_(self):
        a = self.attrs
        lhs, rhs, out = self.operands[0].type, self.operands[1].type, self.results[0].type
        if a["precision"] not in MATMUL_PRECISIONS:
            raise self.error(f"attribute 'precision' = {a['precision']!r}, expected one of {MATMUL_PRECISIONS}")
        for side, t in (("lhs", lhs), ("rhs", rhs)):
            batch, contract = a[f"{side}_batch"], a[f"{side}_contract"]
            _dims_check(self, f"{side}_batch", batch, t.rank)
            _dims_check(self, f"{side}_contract", contract, t.rank)
            if set(batch) & set(contract):
                raise self.error(f"attributes '{side}_batch' = {batch} and '{side}_contract' = {contract} share "
                                 f"dimensions {sorted(set(batch) & set(contract))}, expected disjoint sets")
        for kind in ("batch", "contract"):
            if len(a[f"lhs_{kind}"]) != len(a[f"rhs_{kind}"]):
                raise self.error(f"attributes 'lhs_{kind}' = {a[f'lhs_{kind}']} and 'rhs_{kind}' = {a[f'rhs_{kind}']} "
                                 "have different lengths, expected one rhs dimension per lhs dimension")
        for kind, ld, rd in (("batch", a["lhs_batch"], a["rhs_batch"]), ("contract", a["lhs_contract"], a["rhs_contract"])):
            for i, j in zip(ld, rd):
                if lhs.shape[i] != rhs.shape[j]:
                    raise self.error(f"'{kind}' dimension {i} of operand 'lhs' has size {lhs.shape[i]}, expected "
                                     f"{rhs.shape[j]} like dimension {j} of operand 'rhs'")
        lf, rf = self.free_dims()
        want = tuple(lhs.shape[d] for d in a["lhs_batch"]) + tuple(lhs.shape[d] for d in lf) + tuple(rhs.shape[d] for d in rf)
        if out.shape != want:
            raise self.error(f"result has shape {out.shape}, expected {want}")


# --------------------------------------------------------------------------- indexing
GATHER_MODES = ("clip", "fill", "promise_in_bounds")


@register
class GatherOp(Op):
    """XLA gather (all dimension numbers); mode 'fill' yields `fill` where a window is out of bounds."""

    name = "nova.gather"
    operands_spec = ("x", "indices")
    attributes = {"offset_dims": I64Array, "collapsed_slice_dims": I64Array, "start_index_map": I64Array,
                  "operand_batching_dims": I64Array, "start_indices_batching_dims": I64Array,
                  "slice_sizes": I64Array, "mode": Str, "fill": F64}

    def verify_(self):
        a, x, idx = self.attrs, self.operands[0].type, self.operands[1].type
        if a["mode"] not in GATHER_MODES:
            raise self.error(f"attribute 'mode' = {a['mode']!r}, expected one of {GATHER_MODES}")
        if idx.dtype not in INTEGER_DTYPES:
            raise self.error(f"operand 'indices' has element type {idx.dtype}, expected an integer type")
        if len(a["slice_sizes"]) != x.rank:
            raise self.error(f"attribute 'slice_sizes' has {len(a['slice_sizes'])} entries, expected {x.rank} "
                             "(the rank of operand 'x')")
        if idx.rank == 0 or idx.shape[-1] != len(a["start_index_map"]):
            raise self.error(f"operand 'indices' has shape {idx.shape}, expected its last dimension to equal "
                             f"len(start_index_map) = {len(a['start_index_map'])}")
        _dims_check(self, "start_index_map", a["start_index_map"], x.rank)
        _dims_check(self, "collapsed_slice_dims", a["collapsed_slice_dims"], x.rank)
        if self.results[0].type.dtype != x.dtype:
            raise self.error(f"result has element type {self.results[0].type.dtype}, expected {x.dtype} like operand 'x'")


SCATTER_KINDS = ("add", "set", "mul", "min", "max")


@register
class ScatterOp(Op):
    """XLA scatter with a fixed combiner `kind`; mode 'fill' drops out-of-bounds updates."""

    name = "nova.scatter"
    operands_spec = ("x", "indices", "updates")
    attributes = {"kind": Str, "update_window_dims": I64Array, "inserted_window_dims": I64Array,
                  "scatter_dims_to_operand_dims": I64Array, "operand_batching_dims": I64Array,
                  "scatter_indices_batching_dims": I64Array, "mode": Str}

    def verify_(self):
        a, x, idx, upd = self.attrs, self.operands[0].type, self.operands[1].type, self.operands[2].type
        if a["kind"] not in SCATTER_KINDS:
            raise self.error(f"attribute 'kind' = {a['kind']!r}, expected one of {SCATTER_KINDS}")
        if a["mode"] not in GATHER_MODES:
            raise self.error(f"attribute 'mode' = {a['mode']!r}, expected one of {GATHER_MODES}")
        if idx.dtype not in INTEGER_DTYPES:
            raise self.error(f"operand 'indices' has element type {idx.dtype}, expected an integer type")
        if upd.dtype != x.dtype:
            raise self.error(f"operand 'updates' has element type {upd.dtype}, expected {x.dtype}")
        if self.results[0].type != x:
            raise self.error(f"result has type {self.results[0].type}, expected the type of operand 'x' {x}")


# --------------------------------------------------------------------------- fallback
@register
class FallbackOp(Op):
    """A JAX primitive jnova does not compile: it runs as an ordinary JAX op between kernels.

    `site` indexes the side table of original equations kept with the function.
    """

    name = "nova.fallback"
    operands_spec = ("*inputs",)
    results_spec = ("*outputs",)
    attributes = {"primitive": Str, "site": I64}
    pure = False


# --------------------------------------------------------------------------- attention (its own module)
from jnova.dialect import ops_attention  # noqa: E402,F401  (registers nova.attention and its backward)
from jnova.dialect import ops_training  # noqa: E402,F401  (registers nova.sce, nova.layernorm, ... and backwards)
