"""split_sce_reductions: a cross-entropy's mean or sum over rows as a reduction of its own.

Oracle: the function before the split, run by jax.lax (nova_to_jax), on fresh random inputs; and the
ops the split leaves (rows, then a sum and a division by the count of rows not ignored)."""
import numpy as np
import pytest

from helpers.random_inputs import normal, values
from jnova.dialect.ir import Func
from jnova.dialect.ops_training import sce_backward_op, sce_op
from jnova.dialect.types import TensorType as T
from jnova.passes.split_sce_reductions import split_sce_reductions
from jnova.primitives.nova_to_jax import evaluate_ops

IGNORE = -100


def _loss_head(n, v, reduction, ignore):
    f = Func("loss_head", [T((n, v), "float32"), T((n,), "int32"), T((), "float32")])
    x, labels, dloss = f.args
    fwd = f.add(sce_op(x, labels, reduction=reduction, ignore_index=ignore))
    bwd = f.add(sce_backward_op(x, labels, fwd.results[1], dloss, reduction=reduction, ignore_index=ignore))
    f.returns = [fwd.results[0], fwd.results[1], bwd.results[0]]
    return f


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore", [None, IGNORE])
def test_the_split_keeps_the_definition(reduction, ignore):
    rng = np.random.default_rng()
    n, v = 24, 77
    x = normal(rng, (n, v), "float32", scale=3.0)
    labels = values((n,), np.int32, rng, low=0, high=v)
    labels[:5] = [0, v - 1, IGNORE, IGNORE, v + 3]
    dloss = normal(rng, (), "float32")
    f = _loss_head(n, v, reduction, ignore)
    want = evaluate_ops(f.ops, f.args, f.returns)(x, labels, dloss)
    assert split_sce_reductions(f) == (2 if reduction == "mean" else 1)
    f.verify()
    names = [op.name for op in f.ops]
    assert [op.attrs["reduction"] for op in f.ops if op.name.startswith("nova.sce")] == ["none", "sum"]
    assert names.count("nova.reduce") == 1 + (reduction == "mean" and ignore is not None)  # the count, once
    got = evaluate_ops(f.ops, f.args, f.returns)(x, labels, dloss)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)


def test_rows_and_refused_ops_stay():
    f = _loss_head(4, 9, "none", None)
    f.returns = f.returns[:2] + [f.ops[1].results[0]]
    f.ops[1].operands[3] = f.ops[0].results[0]  # dloss per row
    before = f.print()
    assert split_sce_reductions(f) == 0 and f.print() == before
    g = _loss_head(4, 9, "mean", None)
    assert split_sce_reductions(g, accepts=lambda op: False) == 0
