"""Programs in float64 NumPy: the exact results (up to f64 rounding) a compiler's f32 or bf16 result is
measured against. An f32 reference's own rounding is as large as the compilers' errors."""
import numpy as np


def softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def log_softmax(s: np.ndarray) -> np.ndarray:
    shifted = s - s.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
