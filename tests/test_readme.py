"""Every Python example in the README runs."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code):
    namespace = {"__name__": "readme_example"}
    exec(compile(code, str(README), "exec"), namespace)
    plan = namespace["smartremat"].explain(namespace["model"], namespace["x"])
    assert plan.compiled_peak_bytes <= plan.budget_bytes
