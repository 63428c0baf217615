"""canonicalize, cse and dce: op counts before/after, and results unchanged bit for bit.

Oracle for numerics: a small NumPy evaluator of nova functions (`evaluate`), run on fresh random
inputs before and after each pass; end to end, `jnova.compile` against `jax.jit`.
"""
import logging
import math
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jnova
from jnova.capture.to_nova import to_nova
from jnova.capture.trace import trace
from jnova.dialect.ir import Func, Value
from jnova.dialect.ops import OPS
from jnova.dialect.parse import parse_module
from jnova.dialect.types import TensorType, numpy_dtype
from jnova.passes import TRACE
from jnova.passes.canonicalize import MAX_FOLDED_ELEMENTS, canonicalize, is_exact_conversion
from jnova.passes.cse import cse
from jnova.passes.dce import dce
from helpers.random_inputs import values_for
from models import mlp

F32 = TensorType((4, 6), "float32")


# --------------------------------------------------------------------------- a NumPy evaluator
def _matmul(op, lhs, rhs):
    a = op.attrs
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    ls = [next(letters) for _ in range(lhs.ndim)]
    rs = [next(letters) for _ in range(rhs.ndim)]
    for i, j in zip(a["lhs_batch"] + a["lhs_contract"], a["rhs_batch"] + a["rhs_contract"]):
        rs[j] = ls[i]
    lf, rf = op.free_dims()
    out = [ls[d] for d in a["lhs_batch"]] + [ls[d] for d in lf] + [rs[d] for d in rf]
    return np.einsum(f"{''.join(ls)},{''.join(rs)}->{''.join(out)}", lhs, rhs)


def _broadcast(op, x):
    out = op.results[0].type.shape
    shape = [1] * len(out)
    for i, d in enumerate(op.attrs["dims"]):
        shape[d] = x.shape[i]
    return np.broadcast_to(x.reshape(shape), out)


_COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
            "ge": np.greater_equal}
_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}
EVAL = {
    "nova.constant": lambda op: op.attrs["value"],
    "nova.add": lambda op, a, b: a + b, "nova.sub": lambda op, a, b: a - b, "nova.mul": lambda op, a, b: a * b,
    "nova.div": lambda op, a, b: a / b, "nova.max": lambda op, a, b: np.maximum(a, b),
    "nova.pow": lambda op, a, b: np.power(a, b), "nova.and": lambda op, a, b: a & b,
    "nova.or": lambda op, a, b: a | b, "nova.xor": lambda op, a, b: a ^ b, "nova.not": lambda op, x: ~x,
    "nova.neg": lambda op, x: -x, "nova.abs": lambda op, x: np.abs(x), "nova.tanh": lambda op, x: np.tanh(x),
    "nova.exp": lambda op, x: np.exp(x), "nova.sqrt": lambda op, x: np.sqrt(x),
    "nova.rsqrt": lambda op, x: 1 / np.sqrt(x), "nova.square": lambda op, x: x * x,
    "nova.ipow": lambda op, x: x ** op.attrs["exponent"],
    "nova.compare": lambda op, a, b: _COMPARE[op.attrs["predicate"]](a, b),
    "nova.select": lambda op, which, *cases: np.choose(which.astype(np.int64), cases),
    "nova.convert": lambda op, x: x.astype(numpy_dtype(op.results[0].type.dtype)),
    "nova.reshape": lambda op, x: x.reshape(op.results[0].type.shape),
    "nova.transpose": lambda op, x: np.transpose(x, op.attrs["perm"]),
    "nova.broadcast": _broadcast,
    "nova.reduce": lambda op, x: _REDUCE[op.attrs["kind"]](x, axis=op.attrs["dims"]),
    "nova.matmul": _matmul,
}


def evaluate(func: Func, args) -> list[np.ndarray]:
    env: dict[Value, np.ndarray] = dict(zip(func.args, args))
    with np.errstate(all="ignore"):
        for op in func.ops:
            out = np.asarray(EVAL[op.name](op, *[env[v] for v in op.operands]))
            t = op.results[0].type
            env[op.results[0]] = out.astype(numpy_dtype(t.dtype)).reshape(t.shape)
    return [env[v] for v in func.returns]


def random_args(func: Func, rng):
    """Integers in [-100, 100) (unsigned: [0, 100)), standard normal floats, random bools."""
    return values_for([a.type for a in func.args], rng, low=-100, high=100)


def assert_same_results(before: list, after: list):
    assert len(before) == len(after)
    for a, b in zip(before, after):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def run_pass(pass_fn, func: Func, *args, **kwargs):
    """Apply the pass; check the function still verifies, round-trips and computes the same bits."""
    rng = np.random.default_rng()
    inputs = random_args(func, rng)
    before = evaluate(func, inputs)
    changes = pass_fn(func, *args, **kwargs)
    func.verify()
    assert parse_module(func.print()).print() == func.print()
    assert_same_results(before, evaluate(func, inputs))
    return changes


def counts(func: Func) -> Counter:
    return Counter(op.name for op in func.ops)


class Builder:
    def __init__(self, *arg_types):
        self.func = Func("f", list(arg_types))

    def __call__(self, name, operands, out, **attrs):
        op = OPS[name](operands, out if isinstance(out, list) else [out], attrs)
        self.func.add(op)
        return op.results if isinstance(out, list) else op.result

    def const(self, value, dtype, shape=()):
        array = np.broadcast_to(np.asarray(value, dtype=numpy_dtype(dtype)), shape).copy()
        return self("nova.constant", [], TensorType(shape, dtype), value=array)

    def done(self, *returns):
        self.func.returns = list(returns)
        self.func.verify()
        return self.func


# --------------------------------------------------------------------------- canonicalize
def test_transpose_of_transpose_becomes_one_transpose_or_none():
    b = Builder(TensorType((2, 3, 4), "float32"))
    x = b.func.args[0]
    t1 = b("nova.transpose", [x], TensorType((3, 4, 2), "float32"), perm=(1, 2, 0))
    t2 = b("nova.transpose", [t1], TensorType((4, 2, 3), "float32"), perm=(1, 2, 0))
    back = b("nova.transpose", [t2], TensorType((2, 3, 4), "float32"), perm=(1, 2, 0))
    f = b.done(t2, back)
    assert counts(f)["nova.transpose"] == 3
    assert run_pass(canonicalize, f) >= 3
    dce(f)
    assert counts(f)["nova.transpose"] == 1
    (t,) = f.ops
    assert t.operands[0] is x and t.attrs["perm"] == (2, 0, 1)
    assert f.returns[1] is x


def test_identity_shape_ops_disappear():
    b = Builder(F32)
    x = b.func.args[0]
    r = b("nova.reshape", [x], F32)
    c = b("nova.convert", [r], F32)
    br = b("nova.broadcast", [c], F32, dims=(0, 1))
    t = b("nova.transpose", [br], F32, perm=(0, 1))
    f = b.done(b("nova.neg", [t], F32))
    assert run_pass(canonicalize, f) == 4
    assert [op.name for op in f.ops] == ["nova.neg"] and f.ops[0].operands[0] is x


def test_reshape_of_reshape_becomes_one_reshape():
    b = Builder(F32)
    x = b.func.args[0]
    r1 = b("nova.reshape", [x], TensorType((24,), "float32"))
    r2 = b("nova.reshape", [r1], TensorType((2, 12), "float32"))
    r3 = b("nova.reshape", [r2], F32)
    f = b.done(r2, r3)
    run_pass(canonicalize, f)
    dce(f)
    assert counts(f) == {"nova.reshape": 1}
    assert f.ops[0].operands[0] is x and f.returns[1] is x


@pytest.mark.parametrize("chain, remaining", [
    (("float32", "float64", "float32"), 0),
    (("bfloat16", "float32", "bfloat16"), 0),
    (("float16", "float64", "float16"), 0),
    (("int8", "int32", "int8"), 0),
    (("uint8", "int16", "uint8"), 0),
    (("bool", "float32", "bool"), 0),
    (("int16", "float32", "int16"), 0),
    (("bfloat16", "float32", "float64"), 1),   # two exact widenings: one convert
    (("float32", "bfloat16", "float32"), 2),   # rounds: kept
    (("float32", "float16", "float32"), 2),
    (("int32", "float32", "int32"), 2),        # 2**24 + 1 is not exact in f32
    (("float32", "int32", "float32"), 2),
    (("int8", "uint8", "int8"), 2),
    (("float16", "bfloat16", "float16"), 2),
])
def test_convert_chains_fold_only_where_exact(chain, remaining):
    a, mid, c = chain
    b = Builder(TensorType((8,), a))
    x = b.func.args[0]
    y = b("nova.convert", [x], TensorType((8,), mid))
    f = b.done(b("nova.convert", [y], TensorType((8,), c)))
    run_pass(canonicalize, f)
    dce(f)
    assert counts(f)["nova.convert"] == remaining


def test_exact_conversion_table():
    assert is_exact_conversion("float32", "float64") and is_exact_conversion("bfloat16", "float32")
    assert not is_exact_conversion("float32", "bfloat16") and not is_exact_conversion("float16", "bfloat16")
    assert is_exact_conversion("int16", "float32") and not is_exact_conversion("int32", "float32")
    assert is_exact_conversion("uint8", "bfloat16") and not is_exact_conversion("int16", "bfloat16")
    assert is_exact_conversion("uint32", "int64") and not is_exact_conversion("int32", "uint64")
    assert not is_exact_conversion("float32", "bool") and is_exact_conversion("bool", "int8")


def test_empty_results_and_reductions_of_empty_operands_become_constants():
    b = Builder()
    empty = b.const(np.ones((0, 3), np.float32), "float32", (0, 3))
    ints = b.const(np.ones((2, 0), np.int32), "int32", (2, 0))
    sums = b("nova.reduce", [empty], TensorType((3,), "float32"), kind="sum", dims=(0,))
    maxes = b("nova.reduce", [empty], TensorType((3,), "float32"), kind="max", dims=(0,))
    mins = b("nova.reduce", [ints], TensorType((2,), "int32"), kind="min", dims=(1,))
    tanh = b("nova.tanh", [empty], TensorType((0, 3), "float32"))
    dot = b("nova.matmul", [b.const(np.ones((2, 0), np.float32), "float32", (2, 0)), empty],
            TensorType((2, 3), "float32"), lhs_batch=(), rhs_batch=(), lhs_contract=(1,), rhs_contract=(0,),
            precision="default")
    f = b.done(sums, maxes, mins, tanh, dot)
    assert canonicalize(f) == 5   # (NumPy, the oracle of run_pass, has no max of an empty array)
    dce(f)
    f.verify()
    assert counts(f) == {"nova.constant": 5}
    values = [v.owner.attrs["value"] for v in f.returns]
    assert values[0].tolist() == [0.0] * 3 and values[1].tolist() == [-np.inf] * 3
    assert values[2].tolist() == [np.iinfo(np.int32).max] * 2 and values[3].shape == (0, 3)
    assert values[4].tolist() == [[0.0] * 3] * 2


def test_broadcast_of_splat_constant_becomes_a_constant_when_small():
    nan = np.array([0x7FC00123], np.uint32).view(np.float32)[0]
    b = Builder()
    small = b("nova.broadcast", [b.const(nan, "float32")], TensorType((4, 8), "float32"), dims=())
    big = b("nova.broadcast", [b.const(1.0, "float32")], TensorType((MAX_FOLDED_ELEMENTS + 1,), "float32"), dims=())
    not_splat = b("nova.broadcast", [b.const([1.0, 2.0], "float32", (2,))], TensorType((3, 2), "float32"), dims=(1,))
    f = b.done(small, big, not_splat)
    assert run_pass(canonicalize, f) == 1
    dce(f)
    assert counts(f) == {"nova.constant": 3, "nova.broadcast": 2}
    folded = f.returns[0].owner
    assert folded.name == "nova.constant" and folded.results[0].type == TensorType((4, 8), "float32")
    assert (folded.attrs["value"].view(np.uint32) == 0x7FC00123).all()


@pytest.mark.parametrize("name, dtype, lhs, rhs, folds", [
    ("nova.add", "int8", [127, -128], [1, -1], True),          # wraps like the compiled op
    ("nova.mul", "uint32", [2 ** 31, 3], [2, 5], True),
    ("nova.xor", "bool", [True, False], [True, True], True),
    ("nova.add", "float32", [0.1, 1e30], [0.2, 1e30], True),
    ("nova.div", "float64", [1.0, -1.0], [3.0, 0.0], True),    # -inf is fine
    ("nova.sub", "float32", [np.inf, 1.0], [np.inf, 1.0], False),  # NaN result: bits depend on the CPU
    ("nova.mul", "float32", [1e-30, 1.0], [1e-10, 1.0], False),   # subnormal result: may be flushed
    ("nova.add", "bfloat16", [1.0, 2.0], [0.5, 0.25], False),   # narrow floats: not folded
    ("nova.div", "int32", [7, 8], [2, 0], False),               # integer division: not folded
    ("nova.max", "float32", [0.0, 1.0], [-0.0, 2.0], False),    # max(0, -0): not folded
])
def test_constant_folding_only_where_bit_exact(name, dtype, lhs, rhs, folds):
    b = Builder()
    t = TensorType((2,), dtype)
    out = b(name, [b.const(lhs, dtype, (2,)), b.const(rhs, dtype, (2,))], t)
    f = b.done(out)
    assert (run_pass(canonicalize, f) == 1) == folds
    dce(f)
    assert counts(f) == ({"nova.constant": 1} if folds else {"nova.constant": 2, name: 1})


def test_compare_and_unary_ops_fold_on_constants():
    b = Builder()
    x = b.const([1.5, -2.0, 0.0], "float32", (3,))
    y = b.const([1.5, 3.0, -0.0], "float32", (3,))
    eq = b("nova.compare", [x, y], TensorType((3,), "bool"), predicate="eq")
    neg = b("nova.neg", [x], TensorType((3,), "float32"))
    f = b.done(eq, neg)
    assert run_pass(canonicalize, f) == 2
    assert f.returns[0].owner.attrs["value"].tolist() == [True, False, True]
    assert np.signbit(f.returns[1].owner.attrs["value"][2])


def test_canonicalize_logs_each_rewrite_below_debug(caplog):
    b = Builder(F32)
    f = b.done(b("nova.reshape", [b.func.args[0]], F32))
    with caplog.at_level(logging.DEBUG, logger="jnova.passes"):
        canonicalize(f)
    assert not any("identity_same_type" in r.getMessage() for r in caplog.records)
    f = b.done(b("nova.reshape", [b.func.args[0]], F32))
    with caplog.at_level(TRACE, logger="jnova.passes"):
        canonicalize(f)
    assert any("identity_same_type" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- cse
def test_cse_merges_duplicate_constants_and_broadcasts():
    b = Builder(F32)
    x = b.func.args[0]
    outs = []
    for _ in range(3):
        two = b.const(2.0, "float32")
        outs.append(b("nova.mul", [x, b("nova.broadcast", [two], F32, dims=())], F32))
    f = b.done(*outs)
    assert counts(f) == {"nova.constant": 3, "nova.broadcast": 3, "nova.mul": 3}
    assert run_pass(cse, f) == 6
    assert counts(f) == {"nova.constant": 1, "nova.broadcast": 1, "nova.mul": 1}
    assert f.returns[0] is f.returns[1] is f.returns[2]


def test_cse_keeps_values_that_differ_only_in_bits():
    nan_a = np.array([0x7FC00001], np.uint32).view(np.float32)[0]
    nan_b = np.array([0x7FC00002], np.uint32).view(np.float32)[0]
    b = Builder(TensorType((5, 3), "float32"), TensorType((4, 1), "int32"))
    table, idx = b.func.args
    consts = [b.const(v, "float32") for v in (0.0, -0.0, 0.0, nan_a, nan_b, nan_a)]
    gathers = [b("nova.gather", [table, idx], TensorType((4, 3), "float32"), offset_dims=(1,),
                 collapsed_slice_dims=(0,), start_index_map=(0,), operand_batching_dims=(),
                 start_indices_batching_dims=(), slice_sizes=(1, 3), mode="fill", fill=fill)
               for fill in (0.0, -0.0, math.nan, math.nan, 0)]
    f = b.done(*consts, *gathers)
    assert cse(f) == 4  # 0.0, nan_a repeat; fill nan repeats, fill 0 (int) means 0.0
    assert counts(f) == {"nova.constant": 4, "nova.gather": 3}


def test_cse_never_merges_fallbacks():
    b = Builder(F32)
    x = b.func.args[0]
    r1 = b("nova.fallback", [x], [F32], primitive="random_bits", site=0)
    r2 = b("nova.fallback", [x], [F32], primitive="random_bits", site=0)
    f = b.done(r1[0], r2[0])
    assert cse(f) == 0 and len(f.ops) == 2


# --------------------------------------------------------------------------- dce
def test_dce_removes_an_unused_chain_but_keeps_effectful_fallbacks():
    b = Builder(F32)
    x = b.func.args[0]
    dead = b("nova.exp", [b("nova.neg", [x], F32)], F32)  # noqa: F841
    b("nova.fallback", [x], [], primitive="debug_callback", site=0)           # effects: kept
    b("nova.fallback", [x], [F32], primitive="random_bits", site=1)           # unused, no effects
    b("nova.fallback", [b("nova.abs", [x], F32)], [F32], primitive="custom", site=2)  # effects: kept
    f = b.done(b("nova.tanh", [x], F32))
    assert len(f.ops) == 7
    assert dce(f, keep_sites={0, 2}) == 3
    assert [op.name for op in f.ops] == ["nova.fallback", "nova.abs", "nova.fallback", "nova.tanh"]
    assert [op.attrs["site"] for op in f.ops if op.name == "nova.fallback"] == [0, 2]


# --------------------------------------------------------------------------- captured steps
def _mlp_func():
    params = mlp.init(jax.random.key(0), d_in=8, d_hidden=16, d_out=4)
    x, y = mlp.batch(jax.random.key(1), n=32, d_in=8, d_out=4)
    return to_nova(trace(mlp.tanh_sgd_step, (params, x, y), {})).func


def test_passes_on_the_mlp_step_shrink_it_and_keep_its_results():
    func = _mlp_func()
    before = counts(func)
    changed = run_pass(canonicalize, func) + run_pass(cse, func) + run_pass(dce, func)
    after = counts(func)
    assert changed > 0
    assert after["nova.constant"] < before["nova.constant"]
    assert after["nova.matmul"] == before["nova.matmul"]
    assert sum(after.values()) < sum(before.values())


def test_jnova_compile_matches_jit_on_folded_chains():
    def fn(x, w):
        y = (x.T.reshape(6, 4).reshape(4, 6).T @ w).astype(jnp.float32)
        z = x.astype(jnp.bfloat16).astype(jnp.float32).astype(jnp.bfloat16)
        return jnp.tanh(y) * 2.0 + 1.0, z

    rng = np.random.default_rng()
    x = rng.standard_normal((6, 4)).astype(np.float32)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    compiled = jnova.compile(fn)
    (y, z), (y_jit, z_jit) = compiled(x, w), jax.jit(fn)(x, w)
    np.testing.assert_allclose(y, y_jit, rtol=1e-6, atol=1e-6)
    assert z.dtype == z_jit.dtype and np.asarray(z).tobytes() == np.asarray(z_jit).tobytes()
    nova = counts(parse_module(compiled.lower(x, w).as_text("nova")))
    assert nova["nova.transpose"] == nova["nova.reshape"] == nova["nova.broadcast"] == 0
    assert nova["nova.convert"] == 1  # f32 -> bf16 rounds; the bf16 -> f32 -> bf16 round trip is gone
