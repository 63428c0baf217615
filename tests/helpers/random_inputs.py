"""Fresh random inputs for the tests: every array a test feeds to jnova or to its reference comes from
`values` (standard normal floats, uniform integers, fair-coin bools), never zeros.

`rng` is a numpy Generator, a seed, or None for fresh entropy (`np.random.default_rng` takes all three)."""
import jax.numpy as jnp
import numpy as np

from jnova.dialect.types import numpy_dtype


def values(shape, dtype, rng=None, *, scale: float = 1.0, low: int = -1000, high: int = 1000) -> np.ndarray:
    """A numpy array of `shape` and `dtype`: bools by a fair coin; integers uniform in [low, high) cut to
    the type's range; floats standard normal times `scale`, drawn in float64 and rounded to `dtype`."""
    rng = np.random.default_rng(rng)
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if jnp.issubdtype(dtype, jnp.integer):
        info = np.iinfo(dtype)
        return rng.integers(max(int(info.min), low), min(int(info.max) + 1, high), shape).astype(dtype)
    return (rng.standard_normal(shape) * scale).astype(dtype)


def rand(shape, dtype, rng=None) -> jnp.ndarray:
    """`values` as a jax array."""
    return jnp.asarray(values(shape, dtype, rng))


def normal(rng, shape, dtype="float32", scale: float = 1.0) -> np.ndarray:
    """Standard normal values (times `scale`) of `dtype`, a numpy array."""
    return values(shape, dtype, rng, scale=scale)


def f32(*shape) -> np.ndarray:
    """Fresh standard normal float32 values of `shape`."""
    return values(shape, np.float32)


def values_for(types, rng=None, *, low: int, high: int) -> list[np.ndarray]:
    """One array for each nova tensor type in `types` (its `.shape` and `.dtype`); integers in [low, high)."""
    rng = np.random.default_rng(rng)
    return [values(t.shape, bool if t.dtype == "bool" else numpy_dtype(t.dtype), rng, low=low, high=high)
            for t in types]
