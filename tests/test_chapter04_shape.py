"""Chapter 04 reads as steps: the scheduler, the runner and the engine loop first, the plumbing
(settings, request checks, outputs) in an appendix. (Short export cells with prose or a check between
them, in every chapter: tests/test_pipeline.py.)"""
from __future__ import annotations

import json
import pathlib

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "04_scheduler.ipynb"
PLUMBING = ("config", "outputs", "engine.processor")


def _cells():
    return [(c["cell_type"], "".join(c["source"])) for c in json.loads(NOTEBOOK.read_text())["cells"]]


def _export_target(source: str) -> str | None:
    """The module an export cell writes to (the chapter's default one for a bare `#| export`), else None."""
    first = source.splitlines()[0] if source else ""
    if not first.startswith("#| export"):
        return None
    return first.removeprefix("#| export").strip() or "core.sched.scheduler"


def test_the_plumbing_comes_after_the_engine_loop_in_an_appendix():
    cells = _cells()
    targets = [(_export_target(s) if k == "code" else None) for k, s in cells]
    appendix = next(i for i, (k, s) in enumerate(cells) if k == "markdown" and s.startswith("## Appendix"))
    loop = targets.index("engine.core")
    assert loop < appendix
    for i, target in enumerate(targets):
        if target in PLUMBING or (target == "engine.llm_engine" and "class SimpleOutputProcessor" in cells[i][1]):
            assert i > appendix, f"{target} exported at cell {i}, before the appendix (cell {appendix})"
