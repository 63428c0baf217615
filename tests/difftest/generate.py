"""Hypothesis strategies for random training programs (`programs()`), built one statement at a time.

A program starts from one or two parameters and applies `n` operations, each drawn from `OPS`:
elementwise chains (smooth functions, arithmetic with numpy broadcasting against new parameters or
earlier values), reductions over random axes, `dot_general` / einsum with batch and contracting
dimensions in any order, the softmax / log-softmax / layer-norm / RMS-norm / cross-entropy idioms,
slicing, concatenation, layout changes, casts between f32 and bf16, masks and cumulative sums.
Dimensions come from `DIMS` (1, primes, powers of two).

Two facts per value keep every program a fair test of the compiler rather than of rounding:
- `bound`, a rough bound on |value|: an operation that could overflow (exp of a large value, a long
  product chain) is not applied, so results stay finite and meaningful;
- `exact`, whether every correct implementation computes the value's bits alike (parameters, data
  movement, casts and selections of exact values; never arithmetic, whose rounding may differ by
  contraction order or fused multiply-adds). Functions with kinks (relu, abs, max, min, where on a
  comparison, max-reductions) are applied only to exact values: applied to a value that two correct
  compilers round differently, a kink turns a last-bit difference into a different gradient.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import strategies as st

from difftest.program import FLOATS, JNP_DTYPE, Input, Program, Stmt

DIMS = (1, 2, 3, 4, 5, 7, 8, 13, 16)
MAX_ELEMENTS = 2048        # per value (sums add at most a quarter of that many terms)
BOUND_LIMIT = 1e4          # no value may grow beyond this (roughly)


@dataclass
class Value:
    name: str
    shape: tuple[int, ...]
    dtype: str
    exact: bool
    bound: float
    uses: int = 0

    @property
    def rank(self) -> int:
        return len(self.shape)


def _size(shape) -> int:
    return math.prod(shape)


def _promote(a: str, b: str) -> str:
    return a if a == b else "float32"


def _axes_text(axes) -> str:
    return f"({', '.join(map(str, axes))}{',' if len(axes) == 1 else ''})"


class Builder:
    """The program under construction: values so far, inputs, statements, tolerance facts."""

    def __init__(self, draw, dtypes: tuple[str, ...], dims=DIMS, max_elements=MAX_ELEMENTS):
        self.draw = draw
        self.dtypes = dtypes
        self.dims = tuple(dims)
        self.max_elements = max_elements
        self.max_terms = max_elements // 4
        self.kinds: list[str] = []
        self.values: list[Value] = []
        self.inputs: list[Input] = []
        self.stmts: list[Stmt] = []
        self.longest_sum = 1
        self.has_contraction = False

    # ------------------------------------------------------------------ drawing helpers
    def shape(self, min_rank=0, max_rank=4) -> tuple[int, ...]:
        dims = self.draw(st.lists(st.sampled_from(self.dims), min_size=min_rank, max_size=max_rank))
        while _size(dims) > self.max_elements // 4:
            dims[dims.index(max(dims))] //= 2
        return tuple(dims)

    def dtype(self) -> str:
        # f32 twice as often as bf16 where both are allowed
        return self.draw(st.sampled_from(self.dtypes + ("float32",) if len(self.dtypes) > 1 else self.dtypes))

    def pick(self, pred=lambda v: True) -> Value | None:
        """An earlier value satisfying `pred`, the most recent ones first (what shrinking prefers)."""
        pool = [v for v in reversed(self.values) if pred(v)]
        if not pool:
            return None
        return pool[self.draw(st.integers(0, len(pool) - 1))]

    def choice(self, options):
        return self.draw(st.sampled_from(options))

    def flag(self) -> bool:
        return self.draw(st.booleans())

    # ------------------------------------------------------------------ adding inputs and statements
    def param(self, shape, dtype=None) -> Value:
        dtype = dtype or self.dtype()
        name = f"p{sum(i.role == 'param' for i in self.inputs)}"
        self.inputs.append(Input(name, tuple(shape), dtype, "param"))
        v = Value(name, tuple(shape), dtype, exact=True, bound=5.0)
        self.values.append(v)
        return v

    def data(self, prefix: str, shape, dtype: str, high: int = 0) -> str:
        name = f"{prefix}{sum(i.name.startswith(prefix) for i in self.inputs)}"
        self.inputs.append(Input(name, tuple(shape), dtype, "data", high=high))
        return name

    def add(self, expr: str, shape, dtype: str, *, exact: bool, bound: float, reads=()) -> Value:
        for r in reads:
            r.uses += 1
        name = f"v{len(self.stmts)}"
        self.stmts.append(Stmt(name, expr, tuple(shape), dtype))
        v = Value(name, tuple(shape), dtype, exact, bound)
        self.values.append(v)
        return v

    def summed(self, n: int) -> None:
        self.longest_sum = max(self.longest_sum, n)


# ====================================================================== operations
# Each takes the builder and returns the new Value, or None when it does not apply (the caller then
# draws another operation).

# template, bound of the result from the operand's bound, largest operand bound it accepts
UNARY = (
    ("jnp.tanh({x})", lambda b: 1.0, math.inf),
    ("jax.nn.gelu({x})", lambda b: b, math.inf),
    ("jnp.exp({x})", lambda b: math.exp(b), 8.0),
    ("{x} * {x}", lambda b: b * b, 100.0),
    ("jax.nn.sigmoid({x})", lambda b: 1.0, math.inf),
    ("jnp.sin({x})", lambda b: 1.0, math.inf),
    ("jax.nn.silu({x})", lambda b: b, math.inf),
    ("jax.nn.softplus({x})", lambda b: b + 1.0, math.inf),
    ("jax.nn.gelu({x}, approximate=False)", lambda b: b, math.inf),
    ("{x} ** 3", lambda b: b ** 3, 20.0),
    ("jnp.sqrt({x} * {x} + 1.0)", lambda b: b + 1.0, 1e3),
    ("lax.rsqrt({x} * {x} + 0.5)", lambda b: 1.5, 1e3),
    ("jnp.log({x} * {x} + 1.0)", lambda b: 2 * math.log1p(b) + 1.0, 1e3),
    ("jnp.log1p({x} * {x})", lambda b: 2 * math.log1p(b) + 1.0, 1e3),
    ("{x} / (1.0 + {x} * {x})", lambda b: 1.0, 1e3),
    ("jnp.cos({x})", lambda b: 1.0, math.inf),
    ("lax.erf({x})", lambda b: 1.0, math.inf),
    ("jnp.arctan({x})", lambda b: 2.0, math.inf),
    ("{x} * 0.5 + 0.25", lambda b: 0.5 * b + 0.25, math.inf),
)
# functions with a kink: applied to exact values only; the result is a selection of exact values
KINKED = ("jax.nn.relu({x})", "jnp.abs({x})", "jnp.clip({x}, -0.5, 0.5)", "jnp.maximum({x}, 0.25)", "-{x}")


def unary(b: Builder) -> Value | None:
    template, bound, limit = b.choice(UNARY)
    x = b.pick(lambda v: v.bound <= limit)
    if x is None:
        return None
    return b.add(template.format(x=x.name), x.shape, x.dtype, exact=False, bound=bound(x.bound), reads=[x])


def kinked(b: Builder) -> Value | None:
    x = b.pick(lambda v: v.exact)
    if x is None:
        return None
    template = b.choice(KINKED)
    return b.add(template.format(x=x.name), x.shape, x.dtype, exact=True, bound=x.bound, reads=[x])


def _broadcast_partner(b: Builder, x: Value) -> Value:
    """A new parameter that broadcasts against x: some of x's dims set to 1, leading dims dropped or added."""
    keep = [b.choice((n, n, 1)) for n in x.shape]
    drop = b.draw(st.integers(0, x.rank))
    extra = b.draw(st.lists(st.sampled_from(b.dims), max_size=1)) if x.rank < 4 else []
    shape = tuple(keep[drop:])
    if extra and _size(tuple(extra) + x.shape) <= b.max_elements:   # y has more dims: x broadcasts too
        shape = tuple(extra) + tuple(keep)
    return b.param(shape)


def _broadcast_shape(a, c):
    try:
        import numpy as np

        return tuple(np.broadcast_shapes(a, c))
    except ValueError:
        return None


ARITHMETIC = (("{x} + {y}", lambda p, q: p + q), ("{x} * {y}", lambda p, q: p * q),
              ("{x} - {y}", lambda p, q: p + q), ("{x} / (1.0 + {y} * {y})", lambda p, q: p))
SELECTING = ("jnp.maximum({x}, {y})", "jnp.minimum({x}, {y})", "jnp.where({x} > {y}, {x}, {y})")


def binary(b: Builder) -> Value | None:
    """x (op) y with numpy broadcasting; y is an earlier value or a new parameter."""
    x = b.pick()
    selecting = x.exact and b.draw(st.integers(0, 3)) == 0
    candidates = [v for v in b.values if _broadcast_shape(v.shape, x.shape) is not None
                  and (v.exact or not selecting)]
    if candidates and b.flag():
        y = candidates[b.draw(st.integers(0, len(candidates) - 1))]
    else:
        y = _broadcast_partner(b, x)
    if b.flag():
        x, y = y, x
    shape = _broadcast_shape(x.shape, y.shape)
    if _size(shape) > b.max_elements:
        return None
    dtype = _promote(x.dtype, y.dtype)
    if selecting:
        template = b.choice(SELECTING)
        return b.add(template.format(x=x.name, y=y.name), shape, dtype, exact=True, bound=max(x.bound, y.bound),
                     reads=[x, y])
    template, bound = b.choice(ARITHMETIC)
    if bound(x.bound, y.bound) > BOUND_LIMIT:
        return None
    return b.add(template.format(x=x.name, y=y.name), shape, dtype, exact=False, bound=bound(x.bound, y.bound),
                 reads=[x, y])


REDUCTIONS = ("jnp.sum", "jnp.mean", "jax.nn.logsumexp", "jnp.max", "jnp.var", "jnp.min")


def reduce(b: Builder) -> Value | None:
    kind = b.choice(REDUCTIONS)
    x = b.pick(lambda v: v.rank >= 1 and (v.exact or kind not in ("jnp.max", "jnp.min")))
    if x is None:
        return None
    axes = sorted(b.draw(st.sets(st.integers(0, x.rank - 1), min_size=1, max_size=x.rank)))
    n = _size([x.shape[a] for a in axes])
    keepdims = b.flag()
    shape = tuple(1 if d in axes else n_ for d, n_ in enumerate(x.shape) if keepdims or d not in axes)
    if b.flag():   # negative axes, as users write them
        axes = [a - x.rank for a in axes]
    if n > b.max_terms:
        return None
    bound = {"jnp.sum": n * x.bound, "jnp.mean": x.bound, "jax.nn.logsumexp": x.bound + math.log(n) + 1,
             "jnp.max": x.bound, "jnp.min": x.bound, "jnp.var": x.bound ** 2 * 4}[kind]
    if bound > BOUND_LIMIT:
        return None
    b.summed(n)
    axis = str(axes[0]) if len(axes) == 1 and b.flag() else _axes_text(axes)
    expr = f"{kind}({x.name}, axis={axis}{', keepdims=True' if keepdims else ''})"
    return b.add(expr, shape, x.dtype, exact=kind in ("jnp.max", "jnp.min"), bound=bound, reads=[x])


def _pairs_with_value(b: Builder, x: Value, y: Value):
    """Distinct (x dim, y dim) pairs of equal size, each dim used once: what x and y contract or batch over."""
    pairs = [(i, j) for i in range(x.rank) for j in range(y.rank) if x.shape[i] == y.shape[j]]
    if not pairs:
        return None
    order = b.draw(st.permutations(pairs))
    want = b.draw(st.integers(1, min(3, len(order))))
    used_i, used_j, chosen = set(), set(), []
    for i, j in order:
        if i not in used_i and j not in used_j and len(chosen) < want:
            chosen.append((i, j))
            used_i.add(i)
            used_j.add(j)
    return chosen


def contract(b: Builder) -> Value | None:
    """dot_general (or einsum) of x with a new parameter or an earlier value, batch and contracting
    dimensions in any order on either side."""
    x = b.pick(lambda v: v.rank >= 1)
    if x is None:
        return None
    y = b.pick(lambda v: v.rank >= 1) if b.draw(st.integers(0, 2)) == 0 else None
    pairs = _pairs_with_value(b, x, y) if y is not None else None
    if pairs is None:   # a new parameter: contract 1-2 of x's dims, batch 0-1 more, add 0-2 free dims
        dims = b.draw(st.permutations(range(x.rank)))
        n_contract = b.draw(st.integers(1, min(2, x.rank)))
        n_batch = b.draw(st.integers(0, min(1, x.rank - n_contract)))
        contract_x, batch_x = list(dims[:n_contract]), list(dims[n_contract:n_contract + n_batch])
        free = b.draw(st.lists(st.sampled_from(b.dims), max_size=2))
        slots = [("b", d) for d in batch_x] + [("c", d) for d in contract_x] + [("f", n) for n in free]
        slots = b.draw(st.permutations(slots))
        y = b.param(tuple(x.shape[d] if k != "f" else d for k, d in slots))
        where = {(k, d): j for j, (k, d) in enumerate(slots) if k != "f"}
        pairs_c = [(d, where[("c", d)]) for d in contract_x]
        pairs_b = [(d, where[("b", d)]) for d in batch_x]
    else:
        is_batch = [b.flag() for _ in pairs]
        pairs_c = [p for p, isb in zip(pairs, is_batch) if not isb]
        pairs_b = [p for p, isb in zip(pairs, is_batch) if isb]
    k = _size([x.shape[i] for i, _ in pairs_c])
    x_free = [d for d in range(x.rank) if d not in {i for i, _ in pairs_c + pairs_b}]
    y_free = [d for d in range(y.rank) if d not in {j for _, j in pairs_c + pairs_b}]
    shape = tuple([x.shape[i] for i, _ in pairs_b] + [x.shape[d] for d in x_free] + [y.shape[d] for d in y_free])
    bound = max(k, 1) * x.bound * y.bound
    if _size(shape) > b.max_elements or k > b.max_terms or len(shape) > 5 or bound > BOUND_LIMIT:
        return None
    b.summed(k)
    b.has_contraction = True
    dtype = _promote(x.dtype, y.dtype)
    if b.flag():
        return _einsum(b, x, y, pairs_c, pairs_b, x_free, y_free, dtype, bound)
    xs, ys = x.name, y.name
    if x.dtype != y.dtype:
        xs, ys = (f"{n}.astype(jnp.float32)" if v.dtype != "float32" else n for n, v in ((xs, x), (ys, y)))
    preferred = ""
    if dtype == "bfloat16" and b.flag():
        preferred, dtype = ", preferred_element_type=jnp.float32", "float32"
    dn = (f"(({_axes_text([i for i, _ in pairs_c])}, {_axes_text([j for _, j in pairs_c])}), "
          f"({_axes_text([i for i, _ in pairs_b])}, {_axes_text([j for _, j in pairs_b])}))")
    return b.add(f"lax.dot_general({xs}, {ys}, {dn}{preferred})", shape, dtype, exact=False, bound=bound, reads=[x, y])


def _einsum(b, x, y, pairs_c, pairs_b, x_free, y_free, dtype, bound) -> Value:
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    xl = [next(letters) for _ in range(x.rank)]
    yl = [next(letters) for _ in range(y.rank)]
    for i, j in pairs_c + pairs_b:
        yl[j] = xl[i]
    out = [xl[i] for i, _ in pairs_b] + [xl[d] for d in x_free] + [yl[d] for d in y_free]
    sizes = dict(zip(xl, x.shape)) | dict(zip(yl, y.shape))
    out = b.draw(st.permutations(out))   # einsum may order its output any way: a transpose
    expr = f"jnp.einsum('{''.join(xl)},{''.join(yl)}->{''.join(out)}', {x.name}, {y.name})"
    return b.add(expr, tuple(sizes[c] for c in out), dtype, exact=False, bound=bound, reads=[x, y])


def softmax(b: Builder) -> Value | None:
    x = b.pick(lambda v: v.rank >= 1)
    if x is None:
        return None
    axis = b.draw(st.integers(-x.rank, x.rank - 1))
    n = x.shape[axis]
    b.summed(n)
    if b.flag():
        return b.add(f"jax.nn.softmax({x.name}, axis={axis})", x.shape, x.dtype, exact=False, bound=1.0, reads=[x])
    return b.add(f"jax.nn.log_softmax({x.name}, axis={axis})", x.shape, x.dtype, exact=False,
                 bound=2 * x.bound + math.log(n) + 1, reads=[x])


def layer_norm(b: Builder) -> Value | None:
    """Layer norm over the last axis, with scale and bias parameters: the two-pass variance, or
    Flax's fast variance E[x^2] - E[x]^2 (clamped at 0)."""
    x = b.pick(lambda v: v.rank >= 1)
    if x is None:
        return None
    n = x.shape[-1]
    b.summed(n)
    g, beta = b.param((n,), x.dtype), b.param((n,), x.dtype)
    if b.flag():
        mean = b.add(f"jnp.mean({x.name}, axis=-1, keepdims=True)", x.shape[:-1] + (1,), x.dtype, exact=False,
                     bound=x.bound, reads=[x])
        centred = b.add(f"{x.name} - {mean.name}", x.shape, x.dtype, exact=False, bound=2 * x.bound, reads=[x, mean])
        var = f"jnp.mean({centred.name} * {centred.name}, axis=-1, keepdims=True)"
        expr = f"{centred.name} * lax.rsqrt({var} + 1e-5) * {g.name} + {beta.name}"
        reads = [centred, g, beta]
    else:
        m = f"jnp.mean({x.name}, axis=-1, keepdims=True)"
        var = f"jnp.maximum(0.0, jnp.mean(jnp.square({x.name}), axis=-1, keepdims=True) - jnp.square({m}))"
        expr = f"({x.name} - {m}) * lax.rsqrt({var} + 1e-5) * {g.name} + {beta.name}"
        reads = [x, g, beta]
    return b.add(expr, x.shape, x.dtype, exact=False, bound=5 * (math.sqrt(n) + 1) * 5, reads=reads)


def rms_norm(b: Builder) -> Value | None:
    x = b.pick(lambda v: v.rank >= 1)
    if x is None:
        return None
    n = x.shape[-1]
    b.summed(n)
    g = b.param((n,), x.dtype)
    expr = f"{x.name} * lax.rsqrt(jnp.mean({x.name} * {x.name}, axis=-1, keepdims=True) + 1e-6) * {g.name}"
    return b.add(expr, x.shape, x.dtype, exact=False, bound=5 * (math.sqrt(n) + 1), reads=[x, g])


CROSS_ENTROPY = (
    "optax.softmax_cross_entropy_with_integer_labels({x}, {labels})",
    "-jnp.sum(jax.nn.one_hot({labels}, {n}, dtype={x}.dtype) * jax.nn.log_softmax({x}), axis=-1)",
    "-jnp.take_along_axis(jax.nn.log_softmax({x}), {labels}[..., None], axis=-1)[..., 0]",
)


def cross_entropy(b: Builder) -> Value | None:
    """Softmax cross-entropy of logits x (classes on the last axis) with integer labels (data)."""
    x = b.pick(lambda v: v.rank >= 1)
    if x is None:
        return None
    n = x.shape[-1]
    b.summed(n)
    labels = b.data("labels", x.shape[:-1], "int32", high=n)
    template = b.choice(CROSS_ENTROPY)
    x.uses += 1
    return b.add(template.format(x=x.name, labels=labels, n=n), x.shape[:-1], x.dtype, exact=False,
                 bound=2 * x.bound + math.log(n) + 1)


def slicing(b: Builder) -> Value | None:
    x = b.pick(lambda v: v.rank >= 1 and max(v.shape) >= 2)
    if x is None:
        return None
    axis = b.choice([d for d in range(x.rank) if x.shape[d] >= 2])
    n = x.shape[axis]
    kind = b.choice(("slice", "index", "dynamic", "flip", "split"))
    if kind == "slice":
        start = b.draw(st.integers(0, n - 1))
        stop = b.draw(st.integers(start + 1, n))
        step = b.draw(st.integers(1, 3))
        size = -(-(stop - start) // step)
        shape = x.shape[:axis] + (size,) + x.shape[axis + 1:]
        if b.flag():
            index = ", ".join([":"] * axis + [f"{start}:{stop}" + (f":{step}" if step > 1 else "")])
            expr = f"{x.name}[{index}]"
        else:
            expr = f"lax.slice_in_dim({x.name}, {start}, {stop}, {step}, axis={axis})"
    elif kind == "index":
        i = b.draw(st.integers(-n, n - 1))
        expr = f"{x.name}[{', '.join([':'] * axis + [str(i)])}]"
        shape = x.shape[:axis] + x.shape[axis + 1:]
    elif kind == "dynamic":
        size = b.draw(st.integers(1, n))
        start = b.draw(st.integers(0, n))   # past the end is clamped, as in XLA
        expr = f"lax.dynamic_slice_in_dim({x.name}, {start}, {size}, axis={axis})"
        shape = x.shape[:axis] + (size,) + x.shape[axis + 1:]
    elif kind == "flip":
        expr = f"jnp.flip({x.name}, axis={axis})"
        shape = x.shape
    else:
        cut = b.draw(st.integers(1, n - 1))
        which = b.draw(st.integers(0, 1))
        expr = f"jnp.split({x.name}, [{cut}], axis={axis})[{which}]"
        shape = x.shape[:axis] + ((cut, n - cut)[which],) + x.shape[axis + 1:]
    return b.add(expr, shape, x.dtype, exact=x.exact, bound=x.bound, reads=[x])


def concat(b: Builder) -> Value | None:
    """jnp.concatenate of x with an earlier value, a new parameter, a function of x or x itself; or
    jnp.stack of x with a same-shaped piece."""
    x = b.pick(lambda v: v.rank >= 1)
    if x is None:
        return None
    axis = b.draw(st.integers(0, x.rank - 1))
    stack = b.draw(st.integers(0, 3)) == 0
    fits = (lambda v: v.shape == x.shape) if stack else \
        (lambda v: v.rank == x.rank and all(v.shape[d] == x.shape[d] for d in range(x.rank) if d != axis))
    source = b.choice(("param", "value", "self", "function"))
    if source == "value" and b.pick(fits) is not None:
        y = b.pick(fits)
        other, exact, bound = y.name, y.exact, y.bound
        y.uses += 1
        size, dtype = y.shape[axis], y.dtype
    elif source == "self":
        other, exact, bound, size, dtype = x.name, x.exact, x.bound, x.shape[axis], x.dtype
    elif source == "function":
        other, exact, bound, size, dtype = f"jnp.tanh({x.name})", False, 1.0, x.shape[axis], x.dtype
    else:
        shape = x.shape if stack else x.shape[:axis] + (b.choice(b.dims),) + x.shape[axis + 1:]
        y = b.param(shape)
        y.uses += 1
        other, exact, bound, size, dtype = y.name, True, y.bound, shape[axis], y.dtype
    if stack:
        shape = x.shape[:axis] + (2,) + x.shape[axis:]
        expr = f"jnp.stack([{x.name}, {other}], axis={axis})"
    else:
        shape = x.shape[:axis] + (x.shape[axis] + size,) + x.shape[axis + 1:]
        expr = f"jnp.concatenate([{x.name}, {other}], axis={axis})"
    if _size(shape) > b.max_elements:
        return None
    return b.add(expr, shape, _promote(x.dtype, dtype), exact=x.exact and exact, bound=max(x.bound, bound), reads=[x])


def layout(b: Builder) -> Value | None:
    """transpose, reshape (merge or split dims), broadcast along a new axis, pad, repeat."""
    x = b.pick()
    kind = b.choice(("transpose", "reshape", "broadcast", "pad", "repeat"))
    if kind == "transpose" and x.rank >= 2:
        perm = tuple(b.draw(st.permutations(range(x.rank))))
        expr = f"{x.name}.T" if perm == tuple(reversed(range(x.rank))) and b.flag() else f"jnp.transpose({x.name}, {perm})"
        shape = tuple(x.shape[p] for p in perm)
    elif kind == "reshape" and x.rank >= 1:
        shape = _reshaped(b, x.shape)
        expr = f"{x.name}.reshape({shape})" if shape else f"{x.name}.reshape(())"
    elif kind == "broadcast":
        axis = b.draw(st.integers(0, x.rank))
        n = b.choice(b.dims)
        shape = x.shape[:axis] + (n,) + x.shape[axis:]
        expr = f"jnp.broadcast_to(jnp.expand_dims({x.name}, {axis}), {shape})"
    elif kind == "pad" and x.rank >= 1:
        widths = [(b.draw(st.integers(0, 2)), b.draw(st.integers(0, 2))) for _ in x.shape]
        shape = tuple(n + lo + hi for n, (lo, hi) in zip(x.shape, widths))
        expr = f"jnp.pad({x.name}, {tuple(widths)})"
    elif kind == "repeat" and x.rank >= 1:
        axis = b.draw(st.integers(0, x.rank - 1))
        shape = x.shape[:axis] + (2 * x.shape[axis],) + x.shape[axis + 1:]
        expr = f"jnp.repeat({x.name}, 2, axis={axis})"
    else:
        return None
    if _size(shape) > b.max_elements:
        return None
    return b.add(expr, shape, x.dtype, exact=x.exact, bound=x.bound, reads=[x])


def _reshaped(b: Builder, shape) -> tuple[int, ...]:
    kind = b.choice(("merge", "split", "flatten", "unit"))
    if kind == "merge" and len(shape) >= 2:
        d = b.draw(st.integers(0, len(shape) - 2))
        return shape[:d] + (shape[d] * shape[d + 1],) + shape[d + 2:]
    if kind == "split":
        splittable = [d for d, n in enumerate(shape) if any(n % f == 0 for f in (2, 3, 5) if f < n)]
        if splittable:
            d = b.choice(splittable)
            f = b.choice([f for f in (2, 3, 5) if f < shape[d] and shape[d] % f == 0])
            return shape[:d] + (f, shape[d] // f) + shape[d + 1:]
    if kind == "unit":
        d = b.draw(st.integers(0, len(shape)))
        return shape[:d] + (1,) + shape[d:]
    return (_size(shape),)


def cast(b: Builder) -> Value | None:
    if len(b.dtypes) < 2:
        return None
    x = b.pick()
    dtype = "float32" if x.dtype == "bfloat16" else "bfloat16"
    return b.add(f"{x.name}.astype({JNP_DTYPE[dtype]})", x.shape, dtype, exact=x.exact, bound=x.bound, reads=[x])


def mask(b: Builder) -> Value | None:
    """jnp.where with a boolean mask (data) that broadcasts against x."""
    x = b.pick(lambda v: v.rank >= 1)
    if x is None:
        return None
    shape = tuple(b.choice((n, 1)) for n in x.shape)
    m = b.data("mask", shape, "bool")
    x.uses += 1
    return b.add(f"jnp.where({m}, {x.name}, 0.0)", x.shape, x.dtype, exact=x.exact, bound=x.bound)


def cumulative(b: Builder) -> Value | None:
    x = b.pick(lambda v: v.rank >= 1)
    if x is None:
        return None
    axis = b.draw(st.integers(0, x.rank - 1))
    n = x.shape[axis]
    if x.exact and b.flag():
        return b.add(f"lax.cummax({x.name}, axis={axis})", x.shape, x.dtype, exact=True, bound=x.bound, reads=[x])
    if n * x.bound > BOUND_LIMIT:
        return None
    b.summed(n)
    return b.add(f"jnp.cumsum({x.name}, axis={axis})", x.shape, x.dtype, exact=False, bound=n * x.bound, reads=[x])


def embedding(b: Builder) -> Value | None:
    """Rows (or columns) of a table picked by integer ids (data): a gather forward, a scatter-add backward."""
    table = b.pick(lambda v: v.rank == 2) if b.flag() else None
    if table is None:
        table = b.param((b.choice(b.dims), b.choice(b.dims)))
    axis = b.draw(st.integers(0, 1))
    ids_shape = b.shape(max_rank=2)
    ids = b.data("ids", ids_shape, "int32", high=table.shape[axis])
    shape = ids_shape + table.shape[1:] if axis == 0 else table.shape[:1] + ids_shape
    if _size(shape) > b.max_elements:
        return None
    table.uses += 1
    expr = f"{table.name}[{ids}]" if axis == 0 and b.flag() else f"jnp.take({table.name}, {ids}, axis={axis})"
    return b.add(expr, shape, table.dtype, exact=table.exact, bound=table.bound)


def attention(b: Builder) -> Value | None:
    """jax.nn.dot_product_attention (its XLA form) of queries (B, T, N, H) with new key and value
    parameters (B, S, K, H), K dividing N (grouped-query attention); causal or not."""
    q = b.pick(lambda v: v.rank == 4 and v.bound <= 10)
    if q is None:
        q = b.param(b.shape(min_rank=4, max_rank=4))
    batch, t, n, h = q.shape
    causal = b.flag()
    s_len = t if causal else b.choice(b.dims)
    k_heads = b.choice([d for d in range(1, n + 1) if n % d == 0])
    k, v = b.param((batch, s_len, k_heads, h), q.dtype), b.param((batch, s_len, k_heads, h), q.dtype)
    if batch * n * t * s_len > b.max_elements or h * q.bound * k.bound > BOUND_LIMIT:
        return None
    b.summed(max(h, s_len))
    b.has_contraction = True
    scale = "" if b.flag() else ", scale=0.5"
    expr = f"jax.nn.dot_product_attention({q.name}, {k.name}, {v.name}, is_causal={causal}{scale})"
    return b.add(expr, q.shape, q.dtype, exact=False, bound=v.bound, reads=[q, k, v])


# in the order shrinking prefers (simplest first), with the common ones repeated to weight them
OPS = (unary, binary, reduce, contract, unary, binary, contract, softmax, layer_norm, rms_norm, cross_entropy,
       slicing, concat, layout, cast, kinked, mask, cumulative, reduce, slicing, embedding, attention)


@st.composite
def programs(draw, max_ops: int = 8, dtypes: tuple[str, ...] = FLOATS, dims: tuple[int, ...] = DIMS,
             max_elements: int = MAX_ELEMENTS) -> Program:
    """A random training program of 1..max_ops operations over float parameters of `dtypes`, with
    dimensions from `dims` and at most `max_elements` elements per value."""
    b = Builder(draw, tuple(dtypes), dims, max_elements)
    b.param(b.shape(min_rank=1))
    if b.flag():
        b.param(b.shape())
    for _ in range(draw(st.integers(1, max_ops))):
        for _attempt in range(4):
            op = b.choice(OPS)
            if op(b) is not None:
                b.kinds.append(op.__name__)
                break
        else:
            x = b.pick()
            b.add(f"jnp.tanh({x.name})", x.shape, x.dtype, exact=False, bound=1.0, reads=[x])
    computed = [v for v in b.values if v.name.startswith("v")]
    last = computed[-1]
    leaves = [v for v in computed[:-1] if v.uses == 0][-3:]
    outputs = leaves + [last]
    inputs = b.inputs + [Input(f"s_{v.name}", v.shape, "float32", "data") for v in outputs]
    longest_sum = max([b.longest_sum] + [_size(v.shape) for v in outputs])   # the loss sums each output
    return Program(inputs, b.stmts, [v.name for v in outputs], longest_sum=longest_sum,
                   has_bf16=any(i.dtype == "bfloat16" for i in b.inputs) or any(s.dtype == "bfloat16" for s in b.stmts),
                   has_contraction=b.has_contraction, kinds=tuple(b.kinds))
