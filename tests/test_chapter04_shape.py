"""Chapter 04 reads as steps: the scheduler, the runner and the engine loop first, the plumbing
(settings, request checks, outputs) in an appendix; short export cells with prose or a check between."""
from __future__ import annotations

import json
import pathlib

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "04_scheduler.ipynb"
MAX_EXPORT_LINES = 60
PLUMBING = ("config", "outputs", "engine.processor")


def _cells():
    return [(c["cell_type"], "".join(c["source"])) for c in json.loads(NOTEBOOK.read_text())["cells"]]


def _export_target(source: str) -> str | None:
    """The module an export cell writes to (the chapter's default one for a bare `#| export`), else None."""
    first = source.splitlines()[0] if source else ""
    if not first.startswith("#| export"):
        return None
    return first.removeprefix("#| export").strip() or "core.sched.scheduler"


def test_export_cells_are_short_and_never_more_than_two_in_a_row():
    run = 0
    for kind, source in _cells():
        exported = kind == "code" and _export_target(source) is not None
        if exported:
            assert len(source.splitlines()) <= MAX_EXPORT_LINES, source.splitlines()[:3]
        run = run + 1 if exported else 0
        assert run <= 2, f"three export cells in a row, the last: {source.splitlines()[:2]}"


def test_the_plumbing_comes_after_the_engine_loop_in_an_appendix():
    cells = _cells()
    targets = [(_export_target(s) if k == "code" else None) for k, s in cells]
    appendix = next(i for i, (k, s) in enumerate(cells) if k == "markdown" and s.startswith("## Appendix"))
    loop = targets.index("engine.core")
    assert loop < appendix
    for i, target in enumerate(targets):
        if target in PLUMBING or (target == "engine.llm_engine" and "class SimpleOutputProcessor" in cells[i][1]):
            assert i > appendix, f"{target} exported at cell {i}, before the appendix (cell {appendix})"
