"""README's figures are generated from results/ (`scripts/readme_figures.py`): a stale table fails `make test`."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "readme_figures.py"


def _script():
    return load_script("readme_figures")


def test_readme_figures_are_those_of_the_records():
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:] + "\nrun: python scripts/readme_figures.py"


def test_every_figure_comes_from_its_record(tmp_path):
    """A changed record changes the table: the check fails on the old README, and a rewrite takes the
    record's figures (and its date)."""
    results = tmp_path / "results"
    shutil.copytree(ROOT / "results", results)
    readme = tmp_path / "README.md"
    shutil.copyfile(ROOT / "README.md", readme)
    head = json.loads((results / "cpu_bench_headline.json").read_text())
    head.update(engine_tok_s=123.456, ratio=9.87, date="2031-02-03T04:05:06+00:00")
    (results / "cpu_bench_headline.json").write_text(json.dumps(head) + "\n")
    m = _script()
    args = ["--readme", str(readme), "--results", str(results)]
    assert m.main([*args, "--check"]) == 1
    assert m.main(args) == 0
    text = readme.read_text()
    assert "**123.5** output tok/s" in text and "**9.87×**" in text and "`cpu_bench_headline.json`, 2031-02-03" in text
    assert m.main([*args, "--check"]) == 0

    def outside(t: str) -> str:
        return t[:t.index(m.BEGIN)] + t[t.index(m.END):]
    assert outside(text) == outside((ROOT / "README.md").read_text())  # nothing else changed


def test_chapter_11_rows_come_from_their_records(tmp_path):
    """The mixed workload's and the chapter-09 comparison's rows carry their records' ratios and dates."""
    results = tmp_path / "results"
    shutil.copytree(ROOT / "results", results)
    readme = tmp_path / "README.md"
    shutil.copyfile(ROOT / "README.md", readme)
    edits = {"cpu_chunked_prefill_mixed.json": lambda r: r["ratios"].update(p99_itl=0.123, output_tok_s=4.567),
             "cpu_bench_ch09_vs_ch11.json": lambda r: r.update(ch09_ratio=8.91)}
    for name, edit in edits.items():
        r = json.loads((results / name).read_text())
        edit(r)
        r["date"] = "2031-02-03T04:05:06+00:00"
        (results / name).write_text(json.dumps(r) + "\n")
    m = _script()
    assert m.main(["--readme", str(readme), "--results", str(results)]) == 0
    text = readme.read_text()
    assert "**0.12×** (target ≤ 0.5×)" in text and "**4.57×** (target ≥ 0.95×)" in text
    assert "**8.91×** (target ≥ 0.97×)" in text
    for name in edits:
        assert f"`{name}`, 2031-02-03" in text


def test_the_gpu_ladder_marks_the_rungs_the_time_limit_stopped():
    m = _script()
    table = m.ladder_table(ROOT / "results")
    record = json.loads((ROOT / "results" / "gpu_bench_ladder.json").read_text())
    for e in record["rungs"].values():
        row = next(line for line in table.splitlines() if line.startswith(f"| {e['label']} ("))
        assert (m.MARK_PARTIAL in row) == (e["status"] == "partial"), row
    if any(e["status"] == "partial" for e in record["rungs"].values()):
        assert f"{m.MARK_PARTIAL} stopped by the {record['time_limit']:g} s time limit" in table


def test_render_needs_the_markers():
    m = _script()
    assert m.render(f"a\n{m.BEGIN}\nold\n{m.END}\nb\n", "new") == f"a\n{m.BEGIN}\nnew\n{m.END}\nb\n"
    for broken in ("no markers", f"{m.END}\n{m.BEGIN}\n", f"{m.BEGIN}\n{m.BEGIN}\n{m.END}\n"):
        with pytest.raises(ValueError, match="figures:begin"):
            m.render(broken, "new")


def test_run_times_come_from_the_notebooks(tmp_path):
    """The run-time table reads the cells' execution metadata: a re-executed chapter changes it (the
    check then fails until the script is rerun), and its grader cells are counted apart."""
    m = _script()
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    stamp = lambda s: f"2026-12-01T10:00:{s:02d}.000000Z"
    cell = lambda src, a, b: {"cell_type": "code", "source": src, "outputs": [], "execution_count": 1,
                              "metadata": {"execution": {"iopub.execute_input": stamp(a), "iopub.status.idle": stamp(b)}}}
    nb = {"cells": [cell("x = 1", 0, 5), cell('grade("ch01_ex1")', 10, 40), {"cell_type": "markdown", "source": "",
                                                                              "metadata": {}}]}
    (nbs / "01_a.ipynb").write_text(json.dumps(nb))
    table = m.run_times(nbs)
    assert "| whole chapter (s) | 35 |" in table and "| without its grader cells (s) | 5 |" in table
    assert "| its longest cell (s) | 30 |" in table


def test_a_cpu_peak_timed_at_one_size_is_marked():
    """Records made before `measure_peaks` timed two sizes say so next to what their peak bounds; a record
    that names the sizes it tried, or a GPU record, carries no such note."""
    m = _script()
    old = {"peaks": {"detail": {"device": "cpu", "matmul_n": 1024}}}
    assert "n = 1024 only" in m.one_size_peak(old)
    assert "n = 1024 only" in m.one_size_peak({"peaks": {"device": "cpu", "matmul_n": 1024}})  # a profile's peaks
    assert m.one_size_peak({"peaks": {"detail": {"device": "cpu", "matmul_n": 2048, "matmul_sizes": [1024, 2048]}}}) == ""
    assert m.one_size_peak({"peaks": {"detail": {"device": "cuda:0", "matmul_n": 8192}}}) == ""
    assert m.one_size_peak({}) == ""
