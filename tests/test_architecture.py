"""The layer contract in pyproject.toml ([tool.importlinter]), checked with import-linter's `lint-imports`:
runtime, dialect -> capture -> passes -> codegen -> primitives -> pipeline -> api, and passes never
import code generation."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root), NO_COLOR="1")
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_layers_import_backwards_only():
    run = _lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


@pytest.mark.parametrize("module, forward_import, contract", [
    ("passes/dce.py", "from jnova.codegen.gpu import compile", "passes never import code generation"),
    ("runtime/dump.py", "import jnova.pipeline", "layers import backwards only"),
])
def test_a_forward_import_breaks_the_contract(tmp_path, module, forward_import, contract):
    shutil.copytree(ROOT / "jnova", tmp_path / "jnova", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / "jnova" / module
    path.write_text(path.read_text() + f"\n{forward_import}  # the forward import this test adds\n")
    run = _lint_imports(tmp_path)
    assert run.returncode != 0, run.stdout
    assert contract in run.stdout and "BROKEN" in run.stdout
