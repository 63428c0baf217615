"""The pipeline's stage list (`pipeline.STAGES`) against its docstring and the stages the code times."""
import ast
import inspect
import re

import pytest

from jnova import pipeline
from jnova.primitives import backends


def _docstring_stages() -> list[str]:
    """The first word of each line of the docstring's stage table (indented four spaces)."""
    return [m.group(1) for m in re.finditer(r"^    ([a-z_]+)  ", pipeline.__doc__, re.M)]


def _timed_stages(module) -> list[str]:
    """Stage names in `stage("name")` / `_stage(times, "name")` calls, in source order."""
    names = []
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("stage", "_stage"):
            literal = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            names += literal
    return sorted(set(names), key=names.index)


def test_the_docstring_lists_the_stages_in_order():
    assert _docstring_stages() == list(pipeline.STAGES)


def test_every_timed_stage_is_listed_and_every_listed_stage_is_timed():
    timed = _timed_stages(pipeline) + _timed_stages(backends)
    assert sorted(set(timed)) == sorted(pipeline.STAGES)


def test_compile_step_runs_its_stages_in_the_listed_order():
    source = inspect.getsource(pipeline.compile_step)
    called = [m.group(1) for m in re.finditer(r'stage\("([a-z_]+)"\)', source)]
    assert called == [s for s in pipeline.STAGES if s in called]


def test_an_unlisted_stage_name_is_refused():
    with pytest.raises(ValueError, match="not a compile stage"):
        with pipeline._stage({}, "split_k"):
            pass
