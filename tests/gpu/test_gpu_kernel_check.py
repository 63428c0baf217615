"""Every kernel of the Flax GPT-2 step's GPU plan computes what its own ops say, on the step's own values.

benchmarks/kernel_check.py runs the compiled plan step by step and each kernel's nova ops through XLA
on the same inputs. A kernel that writes an output over an input it still reads (a buffer reused
where it must not be), or whose builder mis-indexes, differs there by far more than its rounding.
"""
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_kernel_of_the_gpt2_step_matches_its_ops(dtype):
    import kernel_check

    assert kernel_check.main(["--layers", "2", "--dtype", dtype, "--batch", "4", "--tol", "0.02"]) == 0
