"""The contraction kernels' register epilogue, run by the warp interpreter (tests/helpers/
gpu_warp_interpreter.py) on the TF32 mma.sync main loop (an sm_89 target), against float64 NumPy:
bias and residual adds, roundings of the f32 result to bf16 / f16 and widenings back (Flax's bf16
Dense under excess precision), C stored in the last conversion's dtype, at tile edges (masked
stores) and inside tiles. The wgmma kernels share `store_fragments`; the GPU tests run them."""
import re

import ml_dtypes
import numpy as np
import pytest

from helpers.gpu_warp_interpreter import run_kernel
from helpers.kernels import requires_ptxas
from jnova.codegen.gpu.matmul import build_matmul, matmul_module
from jnova.codegen.gpu.matmul_epilogue import MatmulEpilogue
from jnova.codegen.gpu.ptx import assemble_check
from jnova.passes.configure.problem import ContractionProblem
from jnova.passes.configure.tile_schedule import choose_tiles
from jnova.runtime.target import get_target

SM89 = get_target("rtx6000ada")
H200 = get_target("h200")
NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

EPILOGUES = {
    "plain": MatmulEpilogue(),
    "bias_residual_f32": MatmulEpilogue(bias="float32", residual="float32"),
    "to_bf16": MatmulEpilogue(steps=("to:bfloat16",)),
    "flax_bf16_dense": MatmulEpilogue(bias="bfloat16", steps=("to:bfloat16", "to:float32", "bias", "to:bfloat16")),
    "residual_bf16_then_f16": MatmulEpilogue(residual="bfloat16", steps=("residual", "to:float16")),
    "rounded_f32": MatmulEpilogue(steps=("to:bfloat16", "to:float32")),
}


def _tf32(x: np.ndarray) -> np.ndarray:
    """The value the tensor cores read: the top 19 bits (after the builder's round to nearest)."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    rounded = ((bits & 0x7FFFFFFF) + 0x1000) & 0xFFFFE000 | (bits & 0x80000000)
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)


def _reference(epilogue, a, b, bias, residual) -> np.ndarray:
    value = (_tf32(a) @ _tf32(b)).astype(np.float32)
    for step in epilogue.steps:
        if step == "bias":
            value = value + bias.astype(np.float32)
        elif step == "residual":
            value = value + residual.astype(np.float32)
        else:
            value = value.astype(NP[step.removeprefix("to:")])
    return value


@pytest.mark.parametrize("m, n, k", [(70, 40, 48), (64, 128, 32)])   # edge tiles (masked stores); whole tiles
@pytest.mark.parametrize("name", sorted(EPILOGUES))
def test_epilogue_steps_and_store_dtype(name, m, n, k):
    epilogue = EPILOGUES[name]
    problem = ContractionProblem(m, n, k)
    module = matmul_module(problem, choose_tiles(problem, SM89), SM89, epilogue)
    assert f"%c: memref<{m * n}x{ {'float32': 'f32', 'bfloat16': 'bf16', 'float16': 'f16'}[epilogue.out]}>" \
        in module.text
    rng = np.random.default_rng()
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    buffers = {"a": a, "b": b}
    bias = rng.standard_normal(n).astype(NP[epilogue.bias]) if epilogue.bias else None
    residual = rng.standard_normal((m, n)).astype(NP[epilogue.residual]) if epilogue.residual else None
    if bias is not None:
        buffers["bias"] = bias
    if residual is not None:
        buffers["residual"] = residual
    c = np.full((m, n), np.nan, NP[epilogue.out])  # poisoned: a value never stored stays NaN
    buffers["c"] = c
    run_kernel(module.text, module.grid, module.block, module.shared_mem_bytes, buffers)
    want = _reference(epilogue, a, b, bias, residual)
    assert c.dtype == want.dtype and not np.isnan(np.asarray(c, np.float32)).any()
    # f32: the kernel's f32 sums against f64 products; 16 bits: one rounding step apart at most (of the
    # narrowest type the value passes through: a sum rounded to bf16 and widened may land one bf16 step away)
    types = [epilogue.out] + [step.removeprefix("to:") for step in epilogue.steps if step.startswith("to:")]
    rtol = max({"float32": 1e-5, "bfloat16": 2.0**-7, "float16": 2.0**-10}[t] for t in types)
    np.testing.assert_allclose(np.asarray(c, np.float64), np.asarray(want, np.float64), rtol=rtol,
                               atol=rtol * np.sqrt(k))


def test_steps_are_checked():
    with pytest.raises(ValueError, match="f32 value"):
        MatmulEpilogue(bias="float32", steps=("to:bfloat16", "bias"))
    with pytest.raises(ValueError, match="unknown step"):
        MatmulEpilogue(steps=("gelu",))
    with pytest.raises(ValueError, match="once"):
        MatmulEpilogue(bias="float32", steps=())
    assert MatmulEpilogue(bias="float32", residual="bfloat16").steps == ("bias", "residual")
    assert MatmulEpilogue(steps=("to:bfloat16", "to:float32")).out == "float32"


@requires_ptxas
@pytest.mark.parametrize("m, n, k, b_layout", [(8192, 2304, 768, "row"), (8192, 768, 3072, "col"), (1000, 77, 40, "row")])
def test_16_bit_stores_assemble_for_the_h200_without_spills(m, n, k, b_layout):
    """The kernels as the configurator picks them: the warp-specialized one stages its converted bf16
    tile in shared memory and leaves by TMA stores where a row is whole 16-byte units; otherwise bf16
    leaves from registers, a pair per store where rows allow."""
    problem = ContractionProblem(m, n, k, operand_dtype="bfloat16", b_layout=b_layout)
    kernel = build_matmul(problem, choose_tiles(problem, H200), H200, EPILOGUES["flax_bf16_dense"])
    assert "epilogue=to:bfloat16" in kernel.schedule, kernel.schedule
    report = assemble_check(kernel.ptx, H200.arch)
    assert report.spills == 0 and report.stack_frame == 0, report.log
    register_stores = re.findall(r"st\.global\.(?:b32|v2\.b16|v2\.u16|b16)\s", kernel.ptx)
    if "pingpong" in kernel.schedule and n * 2 % 16 == 0:
        assert "store=tma" in kernel.schedule, kernel.schedule
        assert "cp.async.bulk.tensor" in kernel.ptx and not register_stores
    else:
        assert "store=" not in kernel.schedule, kernel.schedule
        pair_stores = [s for s in register_stores if not s.startswith("st.global.b16")]
        assert pair_stores if n % 2 == 0 else "st.global.b16" in kernel.ptx
