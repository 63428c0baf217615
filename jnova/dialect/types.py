"""Tensor types of the nova dialect and their MLIR spelling.

nova values are ranked tensors with static shapes. Element types are named by their NumPy/JAX
dtype name; `mlir_element` gives the MLIR spelling. Unsigned integers keep their signedness in nova
(`ui32`); codegen maps them to signless integers with unsigned arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_MLIR_ELEMENT = {
    "bool": "i1",
    "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
    "uint8": "ui8", "uint16": "ui16", "uint32": "ui32", "uint64": "ui64",
    "float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64",
}
# element types a nova value may have that no nova op computes with: only fallback ops (XLA's) read
# and write them, so a step with complex values (an FFT) or fp8 ones (fake quantization) still compiles
_HELD_ELEMENT = {
    "complex64": "complex<f32>", "complex128": "complex<f64>",
    "float8_e3m4": "f8E3M4", "float8_e4m3": "f8E4M3", "float8_e4m3b11fnuz": "f8E4M3B11FNUZ",
    "float8_e4m3fn": "f8E4M3FN", "float8_e4m3fnuz": "f8E4M3FNUZ", "float8_e5m2": "f8E5M2",
    "float8_e5m2fnuz": "f8E5M2FNUZ", "float8_e8m0fnu": "f8E8M0FNU", "float4_e2m1fn": "f4E2M1FN",
    "int2": "i2", "int4": "i4", "uint2": "ui2", "uint4": "ui4",
}
_DTYPE_OF_ELEMENT = {v: k for k, v in {**_MLIR_ELEMENT, **_HELD_ELEMENT}.items()}

FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
SIGNED_DTYPES = frozenset({"int8", "int16", "int32", "int64"})
UNSIGNED_DTYPES = frozenset({"uint8", "uint16", "uint32", "uint64"})
INTEGER_DTYPES = SIGNED_DTYPES | UNSIGNED_DTYPES
COMPUTED_DTYPES = frozenset(_MLIR_ELEMENT)
HELD_DTYPES = frozenset(_HELD_ELEMENT)
ALL_DTYPES = COMPUTED_DTYPES | HELD_DTYPES


def dtype_name(dtype) -> str:
    """The canonical name of a NumPy/JAX dtype (`float32`, `bfloat16`, `bool`, ...)."""
    name = np.dtype(dtype).name
    if name not in ALL_DTYPES:
        raise TypeError(f"jnova does not support the element type {name}")
    return name


def mlir_element(dtype: str) -> str:
    return _MLIR_ELEMENT.get(dtype) or _HELD_ELEMENT[dtype]


def dtype_of_element(element: str) -> str:
    try:
        return _DTYPE_OF_ELEMENT[element]
    except KeyError:
        raise TypeError(f"jnova does not support the MLIR element type {element}") from None


def bitwidth(dtype: str) -> int:
    return 1 if dtype == "bool" else np.dtype(_numpy_dtype(dtype)).itemsize * 8


def itemsize(dtype: str) -> int:
    return np.dtype(_numpy_dtype(dtype)).itemsize


def numpy_dtype(dtype: str) -> np.dtype:
    return np.dtype(_numpy_dtype(dtype))


def _numpy_dtype(dtype: str):
    if dtype == "bfloat16" or (dtype in HELD_DTYPES and not dtype.startswith("complex")):
        import ml_dtypes

        return getattr(ml_dtypes, dtype)
    return dtype


@dataclass(frozen=True)
class TensorType:
    """A static-shaped tensor type: `tensor<8x1024xf32>`."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.dtype not in ALL_DTYPES:
            raise TypeError(f"jnova does not support the element type {self.dtype}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * itemsize(self.dtype)

    def with_dtype(self, dtype: str) -> "TensorType":
        return TensorType(self.shape, dtype)

    def with_shape(self, shape) -> "TensorType":
        return TensorType(tuple(shape), self.dtype)

    def mlir(self) -> str:
        dims = "".join(f"{d}x" for d in self.shape)
        return f"tensor<{dims}{mlir_element(self.dtype)}>"

    def __str__(self) -> str:
        return self.mlir()

    @staticmethod
    def of(aval) -> "TensorType":
        """The nova type of a JAX abstract value (or anything with .shape and .dtype).

        A typed PRNG key is its raw data: uint32 with the key's data shape appended.
        """
        from jnova.runtime.jax_internals import is_key, key_data_shape

        if is_key(aval.dtype):
            return TensorType(tuple(aval.shape) + key_data_shape(aval.dtype), "uint32")
        return TensorType(tuple(aval.shape), dtype_name(aval.dtype))
