"""What the configurator decides about: a contraction C[batch, m, n] = A[batch, m, k] @ B[batch, k, n]
(`ContractionProblem`), and the `nova.matmul`s that are one (`contraction_problem`).

`nova.matmul` has general dot_general dimension numbers; the kernels take A as [M,K] or [K,M] and
B as [K,N] or [N,K] with leading batch dims. A matmul fits when its batch dims lead (in order) on
both sides and its free and contracting dims are each contiguous runs (several dims flatten into
one: the weight gradient contracts over batch and sequence together).
"""
from __future__ import annotations

import dataclasses
from math import prod

from jnova.dialect.ir import Op

OPERAND_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LAYOUTS = ("row", "col")
OPERAND_DTYPES = ("float32", "bfloat16", "float16")
PRECISIONS = ("default", "highest")  # of f32 operands: TF32 allowed, or f32-accurate


@dataclasses.dataclass(frozen=True)
class ContractionProblem:
    """C[batch, m, n] = A[batch, m, k] @ B[batch, k, n]; a layout is "row" when k (for A) or n (for B)
    is contiguous, "col" otherwise."""

    m: int
    n: int
    k: int
    batch: int = 1
    operand_dtype: str = "float32"
    out_dtype: str = "float32"
    a_layout: str = "row"
    b_layout: str = "row"
    # the batch splits K of one row-major A ([M, batch * k], slice b = columns b*k .. b*k + k - 1):
    # the partial products of a split-K contraction (passes/split_contractions.py); B and C are batched
    a_split_k: bool = False
    precision: str = "default"  # "highest": f32 operands need f32-accurate products (`mma_instruction`)

    def __post_init__(self):
        for name in ("m", "n", "k", "batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"ContractionProblem.{name} must be a positive int, got {getattr(self, name)!r}")
        for name in ("operand_dtype", "out_dtype"):
            if getattr(self, name) not in OPERAND_BYTES:
                raise ValueError(f"ContractionProblem.{name}={getattr(self, name)!r}; expected one of {list(OPERAND_BYTES)}")
        for name in ("a_layout", "b_layout"):
            if getattr(self, name) not in LAYOUTS:
                raise ValueError(f"ContractionProblem.{name}={getattr(self, name)!r}; expected 'row' or 'col'")
        if self.precision not in PRECISIONS:
            raise ValueError(f"ContractionProblem.precision={self.precision!r}; expected one of {PRECISIONS}")
        if self.a_split_k and self.a_layout != "row":
            raise ValueError("ContractionProblem.a_split_k needs a_layout='row' (K contiguous in A)")

    @property
    def operand_bytes(self) -> int:
        return OPERAND_BYTES[self.operand_dtype]

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    @property
    def arithmetic_intensity(self) -> float:
        """AI = 2MNK / (MK + KN + MN), in FLOP per element."""
        m, n, k = self.m, self.n, self.k
        return 2 * m * n * k / (m * k + k * n + m * n)


def _run(dims) -> bool:
    return list(dims) == list(range(dims[0], dims[0] + len(dims))) if dims else False


def _side(rank: int, batch, contract, free_first_layout: str, contract_first_layout: str):
    """(layout, free dims) of one operand, or a reason it does not fit."""
    nb = len(batch)
    if list(batch) != list(range(nb)):
        return None, "batch dims do not lead"
    free = [d for d in range(nb, rank) if d not in contract]
    if not free:
        return free_first_layout, free  # refused by the caller: a matrix-vector product
    if not _run(list(contract)) or not _run(free):
        return None, "free or contracting dims are not contiguous runs in order"
    return (free_first_layout if free[0] < contract[0] else contract_first_layout), free


def contraction_problem(op: Op):
    """(ContractionProblem, None) for a matmul the kernels take, or (None, reason)."""
    a = op.attrs
    lhs, rhs, out = op.operands[0].type, op.operands[1].type, op.results[0].type
    if lhs.dtype != rhs.dtype or lhs.dtype not in OPERAND_DTYPES:
        return None, f"operands {lhs.dtype} x {rhs.dtype}"
    if out.dtype != "float32":
        return None, f"result {out.dtype} (the kernels write f32)"
    if not a["lhs_contract"]:
        return None, "no contracting dimension (an outer product)"
    if list(a["lhs_contract"]) != sorted(a["lhs_contract"]) or list(a["rhs_contract"]) != sorted(a["rhs_contract"]):
        return None, "contracting dims in a different order on the two sides"
    a_split_k = _split_k_lhs(lhs.rank, a["lhs_batch"], a["lhs_contract"])
    if a_split_k:  # A as [M..., S, K/S]: the batch splits K of a row-major A (the kernel reads it in place)
        a_layout, lfree = "row", list(range(a["lhs_batch"][0]))
    else:
        a_layout, lfree = _side(lhs.rank, a["lhs_batch"], a["lhs_contract"], "row", "col")
    if a_layout is None:
        return None, f"lhs: {lfree}"
    b_layout, rfree = _side(rhs.rank, a["rhs_batch"], a["rhs_contract"], "col", "row")
    if b_layout is None:
        return None, f"rhs: {rfree}"
    if not lfree or not rfree:
        return None, "a side without free dims (a matrix-vector product)"
    problem = ContractionProblem(
        m=prod(lhs.shape[d] for d in lfree), n=prod(rhs.shape[d] for d in rfree),
        k=prod(lhs.shape[d] for d in a["lhs_contract"]), batch=prod(lhs.shape[d] for d in a["lhs_batch"]),
        operand_dtype=lhs.dtype, out_dtype="float32", a_layout=a_layout, b_layout=b_layout, a_split_k=a_split_k,
        precision="highest" if a["precision"] == "highest" and lhs.dtype == "float32" else "default")
    return problem, None


def _split_k_lhs(rank: int, batch, contract) -> bool:
    """Whether the lhs is [free..., S, K...] with one batch dim S between its free and contracting dims
    (a split-K view of a row-major A, `passes/split_contractions.py`)."""
    return (len(batch) == 1 and batch[0] >= 1 and bool(contract)
            and list(contract) == list(range(batch[0] + 1, rank)))
