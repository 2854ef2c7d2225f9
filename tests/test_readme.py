"""Every Python example in the README and in docs/ runs, and what it plans fits its budget.

The examples of one page run in order in one namespace, as a reader would paste them.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = {p: re.findall(r"```python\n(.*?)```", p.read_text(), flags=re.S) for p in PAGES}
EXAMPLES = {p: blocks for p, blocks in EXAMPLES.items() if blocks}


def test_examples_were_found():
    assert {p.name for p in EXAMPLES} >= {"README.md", "index.md", "budget.md", "how-it-works.md"}


@pytest.mark.parametrize("page", sorted(EXAMPLES), ids=lambda p: p.name)
def test_page_examples_run(page):
    namespace = {"__name__": "docs_example"}
    for code in EXAMPLES[page]:
        exec(compile(code, str(page), "exec"), namespace)
    plan = namespace.get("plan") or namespace.get("free")
    if plan is None:
        plan = namespace["smartremat"].explain(namespace["model"], namespace["x"])
    # the compiler's figure when the plan was verified (the default), else smartremat's prediction
    peak = plan.predicted_peak_bytes if plan.compiled_peak_bytes is None else plan.compiled_peak_bytes
    assert 0 < peak <= plan.budget_bytes
