"""The recorded snapshots are what transformers computes now (so the graders' test data cannot go stale).

tests/data/snapshots/default_model.json holds transformers' greedy completions and top logits on the
default model, written by scripts/record_snapshots.py; the graders in test_grading_default_model.py
compare the package with it and run no oracle. Here transformers runs again on the same prompts and
must give the same prompt ids, the same greedy tokens, and top logits and gaps within
`RECHECK_ATOL` (1e-3: transformers against itself in float32 on another CPU or torch build moves
these logits, of magnitude ~20, by ~1e-5). Skipped where the default model is not installed.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parent.parent


def _recorder():
    return load_script("record_snapshots")


def test_default_model_snapshot_is_what_transformers_computes_now():
    pytest.importorskip("transformers")
    from minivllm.transformers_utils.model_files import resolve_model

    try:
        folder = resolve_model(None)
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"the default model is not installed: {e}")
    rec = _recorder()
    recorded = json.loads(rec.SNAPSHOT.read_text())
    assert [p["text"] for p in recorded["prompts"]] == list(rec.TEXTS), \
        f"the snapshot's prompts are not scripts/record_snapshots.py's TEXTS: run `{rec.COMMAND}`"
    now = rec.record(folder)
    problems = rec.diff_snapshots(recorded, now)
    assert not problems, (f"{rec.SNAPSHOT.relative_to(ROOT)} is stale (recorded with {recorded['versions']}, now "
                          f"{now['versions']}): " + "; ".join(problems) + f". Re-record with `{rec.COMMAND}`")
    for p in recorded["prompts"]:
        gaps = [s["gap"] for s in p["steps"]]
        assert min(gaps) >= recorded["min_gap"] and len(gaps) >= rec.MIN_NEW_TOKENS, (p["text"], gaps)
