"""Which nova.matmul ops the GPU contraction kernels take, and as which problem."""
import re

import jax.numpy as jnp
import numpy as np
import pytest

from jnova.capture.to_nova import to_nova
from jnova.capture.trace import trace
from jnova.passes.configure.problem import contraction_problem


def _matmul(spec, a_shape, b_shape, dtype=np.float32):
    args = (np.zeros(a_shape, dtype), np.zeros(b_shape, dtype))
    func = to_nova(trace(lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=jnp.float32), args, {})).func
    (op,) = [o for o in func.ops if o.name == "nova.matmul"]
    return contraction_problem(op)


@pytest.mark.parametrize("spec,a,b,want", [
    ("mk,kn->mn", (64, 32), (32, 48), (64, 48, 32, 1, "row", "row")),
    ("mk,nk->mn", (64, 32), (48, 32), (64, 48, 32, 1, "row", "col")),        # x @ w.T (data gradient)
    ("km,kn->mn", (32, 64), (32, 48), (64, 48, 32, 1, "col", "row")),
    ("btc,cn->btn", (2, 8, 32), (32, 48), (16, 48, 32, 1, "row", "row")),   # a Dense layer: B*T rows
    ("btc,btn->cn", (2, 8, 32), (2, 8, 48), (32, 48, 16, 1, "col", "row")),  # its weight gradient
    ("bmk,bkn->bmn", (3, 64, 32), (3, 32, 48), (64, 48, 32, 3, "row", "row")),
])
def test_contractions_the_kernels_take(spec, a, b, want):
    problem, reason = _matmul(spec, a, b)
    assert reason is None
    assert (problem.m, problem.n, problem.k, problem.batch, problem.a_layout, problem.b_layout) == want


@pytest.mark.parametrize("spec,a,b,why", [
    ("bqhd,bkhd->bhqk", (2, 8, 4, 16), (2, 8, 4, 16), "batch dims do not lead"),  # attention scores
    ("mk,k->m", (64, 32), (32,), "without free dims"),
    ("m,n->mn", (64,), (48,), "outer product"),
])
def test_contractions_left_to_xla_say_why(spec, a, b, why):
    problem, reason = _matmul(spec, a, b)
    assert problem is None and why in reason


def test_bf16_operands_accumulate_in_f32():
    problem, reason = _matmul("mk,kn->mn", (64, 32), (32, 48), jnp.bfloat16)
    assert reason is None and problem.operand_dtype == "bfloat16" and problem.out_dtype == "float32"


def _gpu_plan(fn, *shapes):
    import jnova

    args = [np.random.default_rng().standard_normal(s, np.float32) for s in shapes]
    return jnova.compile(fn, target="h200").lower(*args)


@pytest.mark.parametrize("fn,shapes,extras", [
    (lambda x, w, b: x @ w + b, [(2, 64, 32), (32, 48), (48,)], ["%bias"]),
    (lambda x, w, b, r: r + (x @ w + b), [(2, 64, 32), (32, 48), (48,), (2, 64, 48)], ["%bias", "%residual"]),
    (lambda x, w, r: x @ w + r, [(64, 32), (32, 48), (64, 48)], ["%residual"]),
])
def test_bias_and_residual_are_the_contraction_kernels_epilogue(fn, shapes, extras):
    """A Dense layer's bias (and a residual) are added in the contraction kernel's registers: one
    kernel, whose parameters are A, B, bias, residual, C."""
    lowered = _gpu_plan(fn, *shapes)
    assert lowered.stats()["kernels"] == 1
    (line,) = lowered.as_text("launches").splitlines()
    assert "matmul[wgmma]" in line
    assert _params(lowered.as_text("gpu"))[0] == ["%a", "%b", *extras, "%c"]


def _params(gpu: str) -> list[list[str]]:
    """Each gpu.func's parameter names."""
    return [re.findall(r"(%\w+): memref", f.split(") kernel")[0]) for f in gpu.split("gpu.func @")[1:]]


def test_other_epilogues_are_a_kernel_of_their_own():
    lowered = _gpu_plan(lambda x, w, b: jnp.tanh(x @ w + b), (64, 32), (32, 48), (48,))
    assert lowered.stats()["kernels"] == 2
    assert ["%a", "%b", "%c"] in _params(lowered.as_text("gpu"))


def test_a_bias_over_part_of_the_columns_is_not_the_kernels():
    """B with two free dims: the result's last dim is 8 of its 48 columns, so a bias over it is not
    the kernel's per-column bias (the epilogue stays a kernel of its own)."""
    lowered = _gpu_plan(lambda x, w, b: jnp.einsum("mk,kpq->mpq", x, w) + b, (64, 32), (32, 6, 8), (8,))
    assert lowered.stats()["kernels"] == 2

