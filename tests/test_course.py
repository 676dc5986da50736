"""The course tooling, tried as a student and an instructor would: a student edition of chapter 05
(`scripts/release.py`), graded with `minivllm.course.grade` before and after the student's work.

The edition also releases one exercise each of chapters 01 and 02 (the sampling filters' checks,
RMSNorm), which chapter 05's engine graders run through: their stubs must not cost a chapter 05
answer its points (the graders' stand-ins replace them, `tests/stand_ins.py`).

The edition is written once per module into a temporary folder; grading runs one pytest subprocess
per chapter in it (about half a minute each).
"""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import nbformat
import pytest

from script_loader import load_script
from minivllm.course import grade as grading
from minivllm.course.grade import EXERCISES, find_regions, resolve
from test_grading_tripwires import build_answers, fill_build

ROOT = Path(__file__).resolve().parent.parent
CH05 = "notebooks/05_paged_attention.ipynb"
REBUILD = [e for e in resolve(["ch05"]) if EXERCISES[e].kind == "rebuild"]
ELSEWHERE = ["ch01_ex2", "ch02_ex3"]  # released with chapter 05: stubs that its engine graders run through
RELEASED = resolve(ELSEWHERE + ["ch05"])


def _script(name: str):
    return load_script(name, f"_course_{name}")


def _regions(nb_path: Path) -> dict[str, list[str]]:
    """exercise id -> its regions' answers' texts (a build has several), in the chapter at `nb_path`."""
    out: dict[str, list[str]] = {}
    for cell in nbformat.read(nb_path, as_version=4).cells:
        if cell.cell_type == "code":
            lines = cell.source.split("\n")
            for r in find_regions(cell.source):
                out.setdefault(r.id, []).append("\n".join(lines[r.begin + 1:r.end]))
    return out


@pytest.fixture(scope="module")
def edition(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("course") / "ch05-student"
    _script("release").release(ELSEWHERE + ["ch05"], out)
    return out


def test_markers_agree_with_the_table():
    """Every rebuild exercise has a region in a chapter, every region names a rebuild exercise, and
    points are stated as in `EXERCISES` (find_regions raises otherwise)."""
    found = {}
    for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for ex in _regions(nb):
            found[ex] = nb.name
    assert all(EXERCISES[e].kind == "rebuild" for e in found), found
    assert sorted(found) == sorted(e for e in EXERCISES if EXERCISES[e].kind == "rebuild")
    assert len(resolve(["ch05"])) >= 3  # at least three graded exercises; the build has a region per method
    assert len(_regions(ROOT / CH05)["ch05_ex1"]) >= 7
    # the chapter's Exercises section states every exercise of the chapter with the table's points
    text = "\n".join(c.source for c in nbformat.read(ROOT / CH05, as_version=4).cells if c.cell_type == "markdown")
    stated = {m[1]: int(m[2]) for m in re.finditer(r"\(`(ch05_ex\d+)`, (\d+) points?\)", text)}
    assert stated == {e: EXERCISES[e].points for e in resolve(["ch05"])}, stated


def test_exercises_are_fresh():
    """exercises/ is what scripts/make_exercises.py generates from solutions/ (no answer, no drift)."""
    want = _script("make_exercises").expected()
    have = {p.name: p.read_text() for p in (ROOT / "exercises").glob("ch*.py")}
    assert want == have, "exercises/ is stale: run `make exercises`"


def test_unknown_ids_are_refused(tmp_path):
    with pytest.raises(ValueError, match="ch05_ex99"):
        _script("release").release(["ch05_ex99"], tmp_path / "x")
    with pytest.raises(ValueError, match="ch42"):
        resolve(["ch42"])
    assert not (tmp_path / "x").exists()


def test_edition_has_no_answers(edition):
    """No solutions/, and neither the package nor the chapter holds a region's answer; the stubs are there."""
    assert not (edition / "solutions").exists() and not (edition / ".git").exists()
    answers = _regions(ROOT / CH05)
    assert sorted(answers) == REBUILD
    package = "\n".join(p.read_text() for p in (edition / "minivllm").rglob("*.py"))
    chapter = "\n".join(c.source for c in nbformat.read(edition / CH05, as_version=4).cells)
    for ex, texts in answers.items():
        for answer in texts:
            assert answer not in package and answer not in chapter, ex
        exported = "\n".join(p.read_text() for p in (edition / "minivllm").rglob("*.py") if "course" not in p.parts)
        stubs = exported.count(f'NotImplementedError("{ex}: ') + exported.count(f"NotImplementedError('{ex}: ")
        assert stubs == len(texts), (ex, stubs, len(texts))  # one stub per region (course/ quotes one in a docstring)
    assert _regions(edition / CH05) == {}  # the delimiters are gone with the answers
    assert json.loads((edition / "EDITION.json").read_text())["exercises"] == RELEASED
    # earlier chapters keep their code
    assert (edition / "minivllm/core/sched/scheduler.py").read_text() == (ROOT / "minivllm/core/sched/scheduler.py").read_text()


def test_untouched_stubs_fail_with_not_implemented(edition, tmp_path):
    rep = grading.grade(None, edition, json_path=tmp_path / "r.json", junit_path=tmp_path / "r.xml", verbose=False)
    assert list(rep["exercises"]) == RELEASED and rep["total"] == 0
    for ex, r in rep["exercises"].items():
        assert r["tests"] > 0 and not r["passed"], ex
        for f in r["failed"]:
            assert "NotImplementedError" in f["message"], (ex, f["test"], f["message"])
            if ex in REBUILD + ELSEWHERE:  # its own stub, never another chapter's
                assert ex in f["message"], (ex, f["message"])
    build = rep["exercises"]["ch05_ex1"]["groups"]  # the build: every part 0, each with a stub's message
    assert list(build) == [g for g, _ in EXERCISES["ch05_ex1"].groups] and all(
        g["tests"] > 0 and g["points"] == 0 and "NotImplementedError: ch05_ex1: " in g["message"] for g in build.values()), build
    assert json.loads((tmp_path / "r.json").read_text())["max_total"] == sum(EXERCISES[e].points for e in RELEASED)
    suite = ET.parse(tmp_path / "r.xml").getroot()
    assert suite.get("tests") == str(len(RELEASED)) and suite.get("failures") == suite.get("tests")


def _plugin_run(tmp_path: Path, tests_file: Path, *args: str, path: Path | None = None):
    """pytest with the grading plugin on `tests_file`, from `tmp_path` (more pytest `args`; `path` put first
    on PYTHONPATH): the finished process, and the outcomes the plugin saved by test name ({} if none)."""
    results = tmp_path / "outcomes.json"
    env = {**os.environ, grading.RESULTS_ENV: str(results)}
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "minivllm.course.grade", "-p", "no:cacheprovider",
                        *args, "--rootdir", str(tmp_path), str(tests_file)], cwd=tmp_path, capture_output=True,
                       text=True, env=env)
    saved = json.loads(results.read_text()) if results.exists() else {}
    return r, {n.split("::")[1]: o for n, o in saved.items()}


def _dedent(text: str) -> str:
    lines = text.split("\n")
    cut = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    return "\n".join(line[cut:] for line in lines)


def test_a_filled_exercise_passes_and_wrong_ones_fail(edition, tmp_path):
    """The build ch05_ex1, filled part by part (chapters 01 and 02's released regions still stubs):
    first the book's block manager and an empty paged decode (`pass`): the block manager's three parts
    score, the decode's part and the engine's (it decodes through it) do not, and not with the stub's
    NotImplementedError; an instructor's private test (in no part) counts towards the exercise. Then
    the book's decode with a deallocate that leaks the tail block and a may_append that delegates to
    super(): the decode's part scores, the block manager's parts fail, each failure saying why."""
    untouched, edition = edition, shutil.copytree(edition, tmp_path / "submission")  # other tests see the untouched one
    book = build_answers(ROOT / CH05, "ch05_ex1")
    fill_build(edition, "ch05_ex1", {**book, "paged_decode_attention": "pass"})
    private = tmp_path / "private"
    private.mkdir()
    (private / "test_private_ch05.py").write_text(
        "import pytest\nfrom minivllm.core.block_manager import BlockManager\nfrom minivllm.sequence import Sequence\n\n\n"
        "@pytest.mark.ch05_ex1\ndef test_three_tokens_take_two_blocks():\n"
        "    bm, seq = BlockManager(4, 2), Sequence([1, 2, 3], block_size=2)\n"
        "    bm.allocate(seq)\n    assert len(seq.block_table) == 2 and bm.num_free_blocks == 2\n")
    rep = grading.grade(REBUILD, edition, private_tests=private, verbose=False)["exercises"]["ch05_ex1"]
    allocs, appends, preempts, decodes, engine, speed = (g for g, _ in EXERCISES["ch05_ex1"].groups)
    points = {g: r["points"] for g, r in rep["groups"].items()}
    full = dict(EXERCISES["ch05_ex1"].groups)
    assert points == {**full, decodes: 0, engine: 0, speed: 0}, rep["groups"]  # an empty decode is not timed
    assert rep["points"] == sum(points.values()) and not rep["passed"]
    assert rep["tests"] - sum(g["tests"] for g in rep["groups"].values()) == 1  # the private test, in no part
    assert rep["failed"] and all("NotImplementedError" not in f["message"] for f in rep["failed"]), rep["failed"]
    assert "ch05_ex1: paged_decode_attention should return a tensor" in rep["groups"][decodes]["message"], rep["groups"]

    leaky = book["deallocate"].replace("if block.ref_count == 0:", "if block.ref_count == 0 and block_id != seq.block_table[-1]:")
    assert leaky != book["deallocate"]
    second = shutil.copytree(untouched, tmp_path / "second")
    fill_build(second, "ch05_ex1", {**book, "deallocate": leaky, "may_append": "return super().may_append(seq)"})
    rep = grading.grade(REBUILD, second, verbose=False)["exercises"]["ch05_ex1"]
    points = {g: r["points"] for g, r in rep["groups"].items()}
    assert points[speed] > 0, rep["groups"][speed]  # the book's decode: its band depends on this machine's noise
    assert {**points, speed: 0} == {**{g: 0 for g in full}, decodes: full[decodes]}, rep["groups"]
    messages = " ".join(f["message"] for f in rep["failed"])
    assert "ch05_ex1: " in rep["groups"][allocs]["message"] and "never freed" in messages, (rep["groups"], messages)
    details = " ".join(f["details"] for f in rep["failed"])
    assert "ops=[" in details  # hypothesis' smallest failing input is reported
    assert "AttributeError" in rep["groups"][appends]["message"], rep["groups"][appends]  # no parent to call


def test_a_build_scores_by_its_parts(tmp_path):
    """Chapter 04's build (ch04_ex3, the whole scheduler) released alone: the stubs score 0 in every
    part, each with the task's NotImplementedError; then a plausible wrong answer (the book's, with a
    decode that preempts the oldest running sequence instead of the newest) keeps the admission part
    and the engine's tokens (preemption changes when a sequence runs, not what it generates) and loses
    the decode part's points."""
    ch04, ex = "notebooks/04_scheduler.ipynb", "ch04_ex3"
    edition = tmp_path / "ch04-student"
    _script("release").release([ex], edition)
    names = [g for g, _ in EXERCISES[ex].groups]
    rep = grading.grade([ex], edition, verbose=False)["exercises"][ex]
    assert rep["points"] == 0 and list(rep["groups"]) == names, rep["groups"]
    assert all(g["tests"] > 0 and g["points"] == 0 and f"NotImplementedError: {ex}: " in g["message"]
               for g in rep["groups"].values()), rep["groups"]
    nb = nbformat.read(ROOT / ch04, as_version=4)
    answers = {}  # method name -> the book's answer, from the regions of the Scheduler cell
    for cell in nb.cells:
        lines = cell.source.split("\n")
        for r in find_regions(cell.source):
            if r.id == ex:
                method = next(line.split("def ")[1].split("(")[0] for line in reversed(lines[:r.marker]) if " def " in line)
                answers[method] = _dedent("\n".join(lines[r.begin + 1:r.end]))
    assert sorted(answers) == ["schedule", "schedule_decode", "schedule_prefill"], sorted(answers)
    wrong = answers["schedule_decode"].replace("self.preempt(self.running.pop())", "self.preempt(self.running.popleft())")
    assert wrong != answers["schedule_decode"]
    stubs = [answers["schedule"], answers["schedule_prefill"], wrong]  # in the order of the stubs in the chapter
    chapter = nbformat.read(edition / ch04, as_version=4)
    for cell in chapter.cells:
        lines = cell.source.split("\n")
        for i, line in enumerate(lines):
            if f'raise NotImplementedError("{ex}: ' in line or f"raise NotImplementedError('{ex}: " in line:
                indent = line[:len(line) - len(line.lstrip())]
                lines[i] = "\n".join(indent + b for b in stubs.pop(0).split("\n"))
        cell.source = "\n".join(lines)
    assert not stubs
    nbformat.write(chapter, edition / ch04)
    rep = grading.grade([ex], edition, verbose=False)["exercises"][ex]
    groups = {name: g["points"] for name, g in rep["groups"].items()}
    admits, decodes, _, equals = names
    assert groups[admits] == 3 and groups[decodes] == 0 and groups[equals] == 2, rep["groups"]
    assert rep["points"] == sum(groups.values()) and not rep["passed"]
    assert "PART" in grading.format_report({"exercises": {ex: rep}, "total": rep["points"], "max_total": 10})


def test_a_test_process_that_imported_ipykernel_still_grades():
    """The grader skips only inside a chapter's kernel under nbmake (the suite runs those graders itself).
    A test process that merely imported ipykernel (jupyter_client does, to find a kernel's spec) once
    counted as one, and every later grading test in that pytest worker found no exercises graded."""
    pytest.importorskip("ipykernel.kernelspec")
    assert os.environ.get("PYTEST_CURRENT_TEST")
    rep = grading.grade(["ch01_ex2"], ROOT, verbose=False)
    assert "skipped" not in rep and rep["exercises"]["ch01_ex2"]["points"] == EXERCISES["ch01_ex2"].points, rep


def test_a_stopped_run_and_an_unknown_part_score_nothing_loudly(tmp_path):
    """Graded in the book with an instructor's private test: one that ends the grading process
    (`os._exit`, as a crash, the OOM killer or a student's exit would) leaves its part unscored, says
    the run stopped, and the parts it did finish keep their points; one marked with a part the
    exercise does not have fails every part with a message naming the parts there are."""
    ex = "ch04_ex3"
    admits = EXERCISES[ex].groups[0][0]
    exits = tmp_path / "exits"
    exits.mkdir()
    (exits / "test_private_exit.py").write_text(
        f"import os\nimport pytest\n\n\n@pytest.mark.{ex}\n@pytest.mark.group({admits!r})\n"
        "def test_zz_the_process_ends_here():\n    os._exit(0)\n")
    rep = grading.grade([ex], ROOT, private_tests=exits, verbose=False)
    r = rep["exercises"][ex]
    assert r["groups"][admits]["points"] == 0 and "did not run" in r["groups"][admits]["message"], r["groups"]
    assert r["points"] == EXERCISES[ex].points - EXERCISES[ex].groups[0][1] and not r["passed"]
    assert "stopped before it finished" in rep["error"], rep.get("error")
    assert f"{ex} PART" in grading.format_report(rep)
    typo = tmp_path / "typo"
    typo.mkdir()
    (typo / "test_private_typo.py").write_text(
        f"import pytest\n\n\n@pytest.mark.{ex}\n@pytest.mark.group('admits first come first served')\n"
        "def test_passes():\n    pass\n")
    r = grading.grade([ex], ROOT, private_tests=typo, verbose=False)["exercises"][ex]
    assert r["points"] == 0 and all("does not have (its parts:" in g["message"] for g in r["groups"].values()), r


def test_a_crashed_run_names_the_crash_and_keeps_the_maximum(tmp_path):
    """A grading process killed by a signal (a Triton kernel's store out of bounds under the interpreter
    segfaults it; here a private test sends itself SIGSEGV) is reported as a crash, naming the signal and
    what to check, on the test that was running and on the ones after it; the parts it finished keep
    their points, and the maximum stays the one a normal run has (a GPU-only test that never ran where
    there is no GPU leaves it, as it would by skipping)."""
    ex = "ch04_ex3"
    admits = EXERCISES[ex].groups[0][0]
    crashes = tmp_path / "crashes"
    crashes.mkdir()
    (crashes / "test_private_crash.py").write_text(
        f"import os\nimport signal\n\nimport pytest\n\n\n@pytest.mark.{ex}\n@pytest.mark.group({admits!r})\n"
        "def test_zz_segfaults():\n    os.kill(os.getpid(), signal.SIGSEGV)\n\n\n"
        f"@pytest.mark.{ex}\n@pytest.mark.group({admits!r})\ndef test_zzz_after_it():\n    pass\n")
    rep = grading.grade([ex], ROOT, private_tests=crashes, verbose=False)
    r = rep["exercises"][ex]
    assert r["groups"][admits]["points"] == 0 and r["max_points"] == EXERCISES[ex].points, r["groups"]
    assert r["points"] == EXERCISES[ex].points - EXERCISES[ex].groups[0][1], r["groups"]
    msgs = {f["test"].split("::")[-1]: f["message"] for f in r["failed"]}
    assert msgs["test_zz_segfaults"].startswith("crashed in this test: SIGSEGV (signal 11), a segmentation fault"), msgs
    assert "check the masks" in r["groups"][admits]["message"], r["groups"]  # the table's line keeps the hint
    assert msgs["test_zzz_after_it"].startswith("did not run: the process crashed earlier, in test_zz_segfaults: "
                                                "SIGSEGV"), msgs
    assert "exit status -11: it crashed, SIGSEGV" in rep["error"], rep["error"]
    assert grading.crash_message(0) is None and grading.crash_message(1) is None
    assert "out of memory" in grading.crash_message(-9) and "SIGABRT (signal 6)" in grading.crash_message(-6)
    # a speed part whose GPU-only test never ran (the run crashed first) where there is no GPU: not graded here
    part = grading.Exercise("ch99_ex1", 7, "rebuild", "t", "w", (), groups=(("right", 3), ("fast", 4)),
                            speed=(("fast", ((1.5, 4), (3.0, 2))),))
    outcomes = {"a": {"group": "right", "outcome": "notrun", "message": "m", "started": True},
                "b": {"group": "fast", "outcome": "notrun", "message": "m", "gpu_absent": True}}
    groups = grading.score_groups(part, outcomes, borrowed=False)
    assert groups["fast"]["max_points"] == 0 and "needs a CUDA GPU" in groups["fast"]["message"], groups
    assert groups["right"]["max_points"] == 3 and groups["right"]["points"] == 0, groups
    tests_file = tmp_path / "test_gpu_flag.py"
    tests_file.write_text("import pytest\n\n\n@pytest.mark.gpu\ndef test_on_a_gpu():\n    pass\n")
    _, ran = _plugin_run(tmp_path, tests_file, "--co")
    import torch
    flagged = [o.get("gpu_absent", False) for o in ran.values()]
    assert flagged == [not torch.cuda.is_available()], flagged


def test_a_skip_or_xfail_from_the_code_under_grading_fails_its_test(tmp_path):
    """Only a grader may skip a test: a `pytest.skip` or `pytest.xfail` asked for by the code under
    grading fails its test, however it is raised (the exception itself, pointed at the grader's file with
    `_use_item_location`, through `exec`, inside a hypothesis test); the graders' own skips (in the
    test, a `skipif` mark) stay skips."""
    (tmp_path / "answer").mkdir()
    (tmp_path / "answer" / "answer.py").write_text(
        "import pytest\nfrom _pytest.outcomes import Skipped\n\n\n"
        "def skip():\n    pytest.skip('not today')\n\n\n"
        "def xfail():\n    pytest.xfail('known')\n\n\n"
        "def raise_skipped():\n    raise Skipped('hidden', _use_item_location=True)\n\n\n"
        "def exec_skip():\n    exec('import pytest; pytest.skip(\"from a string\")')\n")
    (tmp_path / "tests").mkdir()
    tests_file = tmp_path / "tests" / "test_skips.py"
    tests_file.write_text(
        "import pytest\nfrom hypothesis import given, strategies as st\n\nimport answer\n\n\n"
        "@pytest.mark.parametrize('how', ['skip', 'xfail', 'raise_skipped', 'exec_skip'])\n"
        "def test_answer(how):\n    getattr(answer, how)()\n\n\n"
        "@given(st.integers())\ndef test_answer_in_hypothesis(x):\n    answer.skip()\n\n\n"
        "def test_grader_skips():\n    pytest.skip('needs a CUDA GPU')\n\n\n"
        "@pytest.mark.skipif(True, reason='no GPU')\ndef test_grader_mark():\n    answer.skip()\n")
    r, ran = _plugin_run(tmp_path, tests_file, path=tmp_path / "answer")
    assert r.returncode == 1, r.stdout[-2000:]  # pytest itself counts them as failures
    for name, kind in [("test_answer[skip]", "pytest.skip"), ("test_answer[xfail]", "pytest.xfail"),
                       ("test_answer[raise_skipped]", "pytest.skip"), ("test_answer[exec_skip]", "pytest.skip"),
                       ("test_answer_in_hypothesis", "pytest.skip")]:
        assert ran[name]["outcome"] == "failed", (name, ran[name])
        assert ran[name]["message"].startswith(f"{kind} from the code under grading ("), (name, ran[name]["message"])
    assert "<string>" in ran["test_answer[exec_skip]"]["message"], ran["test_answer[exec_skip]"]
    assert ran["test_grader_skips"]["outcome"] == "skipped" and ran["test_grader_mark"]["outcome"] == "skipped", ran


def test_a_hypothesis_grader_stops_at_its_first_example_that_reaches_a_stub(tmp_path):
    """A stub fails every example the same way: a grading run stops a hypothesis test at the first one that
    raises an untouched stub's NotImplementedError (word for word as the edition's code raises it), and
    reports that error as it was, without shrinking; any other NotImplementedError is shrunk as usual."""
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / "stubbed.py").write_text(
        "def task(x):\n    raise NotImplementedError('ch01_ex1: the task\\'s words')\n\n\n"
        "def unfinished(x):\n    raise NotImplementedError(f'not yet: {x}')\n")
    (tmp_path / "tests").mkdir()
    calls = tmp_path / "calls.txt"
    tests_file = tmp_path / "tests" / "test_stubs.py"
    tests_file.write_text(
        "from hypothesis import given, settings, strategies as st\n\nimport stubbed\n\n\n"
        f"def _count(name):\n    with open({str(calls)!r}, 'a') as f:\n        f.write(name + '\\n')\n\n\n"
        "@settings(max_examples=50, derandomize=True, database=None)\n@given(st.integers(0, 10**6))\n"
        "def test_stub(x):\n    _count('stub')\n    stubbed.task(x)\n\n\n"
        "@settings(max_examples=50, derandomize=True, database=None)\n@given(st.integers(0, 10**6))\n"
        "def test_unfinished(x):\n    _count('unfinished')\n    stubbed.unfinished(x)\n")
    _, ran = _plugin_run(tmp_path, tests_file, path=tmp_path / "exercises")
    counts = calls.read_text().split()
    assert ran["test_stub"]["outcome"] == "failed" and counts.count("stub") == 1, (ran["test_stub"], counts.count("stub"))
    assert ran["test_stub"]["message"] == "NotImplementedError: ch01_ex1: the task's words", ran["test_stub"]
    assert ran["test_unfinished"]["message"].startswith("NotImplementedError: not yet: 0"), ran["test_unfinished"]
    assert counts.count("unfinished") > 2  # found, then shrunk to 0


def test_a_speed_part_scores_by_its_bands(tmp_path):
    """A speed part scores the band of the worst ratio its passing tests record (through the grading
    plugin: `record_property(SPEED_RATIO, r)` reaches the outcomes); a failed test, no ratio, or a
    stub scores 0; a part whose tests all skipped (the hardware absent) leaves the run's maximum,
    saying why."""
    ex = grading.Exercise("ch99_ex1", 7, "rebuild", "t", "w", (), groups=(("right", 3), ("fast", 4)),
                          speed=(("fast", ((1.5, 4), (3.0, 2))),))
    tests_file = tmp_path / "test_speed_demo.py"
    tests_file.write_text(
        "import pytest\n\n\n@pytest.mark.parametrize('r', [1.2, 2.5])\n"
        "def test_timed(r, record_property):\n    record_property('speed_ratio', r)\n\n\n"
        "def test_no_gpu():\n    pytest.skip('needs a CUDA GPU')\n")
    r, ran = _plugin_run(tmp_path, tests_file)
    assert r.returncode == 0, r.stdout[-2000:]
    assert ran["test_timed[1.2]"]["speed_ratio"] == 1.2 and ran["test_timed[2.5]"]["speed_ratio"] == 2.5, ran
    assert ran["test_no_gpu"]["outcome"] == "skipped" and ran["test_no_gpu"]["skip_reason"] == "needs a CUDA GPU"

    def outcome(group, outcome="passed", **extra):
        return {"group": group, "outcome": outcome, "message": "", **extra}

    right = {"a": outcome("right")}
    for ratios, want in [([1.2], 4), ([1.2, 2.5], 2), ([1.5], 4), ([3.0], 2), ([3.01], 0), ([40.0], 0)]:
        fast = {f"t{i}": outcome("fast", speed_ratio=r) for i, r in enumerate(ratios)}
        g = grading.score_groups(ex, {**right, **fast}, borrowed=False)["fast"]
        assert (g["points"], g["max_points"], g["passed"]) == (want, 4, want == 4), (ratios, g)
        assert f"{max(ratios):.2f}x the reference's time" in g["message"], g
    for fast, why in [({"t": outcome("fast")}, "no speed was recorded"),
                      ({"t": outcome("fast", "failed", speed_ratio=1.0)}, ""),
                      ({"t": {**outcome("fast", "failed"), "message": "NotImplementedError: ch99_ex1: write it"}},
                       "NotImplementedError: ch99_ex1")]:
        g = grading.score_groups(ex, {**right, **fast}, borrowed=False)["fast"]
        assert g["points"] == 0 and g["max_points"] == 4 and why in g["message"], g
    g = grading.score_groups(ex, {**right, "t": outcome("fast", "skipped", skip_reason="needs a CUDA GPU")},
                             borrowed=False)["fast"]
    assert (g["points"], g["max_points"]) == (0, 0) and "not graded here (needs a CUDA GPU): 4 points" in g["message"]
    with pytest.raises(ValueError, match="speed bands"):
        grading.Exercise("ch99_ex2", 4, "rebuild", "t", "w", (), groups=(("fast", 4),), speed=(("fast", ((3.0, 4), (1.5, 2))),))


def test_a_long_failure_keeps_what_was_expected_on_the_score_line():
    """A grader's message names the case first and ends with what was expected and what came; past
    `SUMMARY_CHARS` the score table keeps its start and its end, cut between words (a ch01_ex1 tester
    saw "...after th" where the message went on "...the status should be FINISHED_STOPPED, got RUNNING")."""
    case = ", ".join(f"field_{i}={i * 7}" for i in range(40))
    message = (f"AssertionError: ch01_ex1: a 1-token prompt, {case}: after the completion [0] the status should be "
               "FINISHED_STOPPED, got RUNNING\n  more lines of the report")
    line = grading.summarize(message)
    assert len(line) <= grading.SUMMARY_CHARS, len(line)
    assert line.startswith("AssertionError: ch01_ex1: a 1-token prompt,") and " ... " in line, line
    assert line.endswith("the status should be FINISHED_STOPPED, got RUNNING"), line
    words = set(message.split())
    assert all(w in words for w in line.replace(" ... ", " ").split()), line  # no word cut in two
    assert grading.summarize("AssertionError: short\nsecond line") == "AssertionError: short"
    ex = grading.Exercise("ch99_ex3", 4, "rebuild", "t", "w", (), groups=(("part", 4),))
    g = grading.score_groups(ex, {"t": {"group": "part", "outcome": "failed", "message": message}}, borrowed=False)
    assert g["part"]["message"] == line
    rep = {"exercises": {"ch99_ex3": {"title": "t", "passed": False, "points": 0, "max_points": 4, "tests": 1,
                                      "failed": [{"message": message}]}}, "total": 0, "max_total": 4}
    assert grading.format_report(rep).splitlines()[0].endswith(line)


def test_tests_left_out_by_the_marker_are_not_counted_as_not_run(tmp_path):
    """A grading run selects its exercise's tests with `-m`; the tests it leaves out (another
    exercise's, or unmarked ones such as the wrong-answer meta-tests) are not in its outcomes, so a
    run that passed every selected test does not read as one that stopped early (a tester's JSON
    report said "stopped before it finished (exit status 0)" for full points)."""
    tests_file = tmp_path / "test_marker_demo.py"
    tests_file.write_text("import pytest\n\n\n@pytest.mark.ch06_ex1\ndef test_mine():\n    pass\n\n\n"
                          "@pytest.mark.ch06_ex2\ndef test_other():\n    pass\n\n\ndef test_unmarked():\n    pass\n")
    (tmp_path / "conftest.py").write_text("def pytest_configure(config):\n"
                                          "    for m in ('ch06_ex1', 'ch06_ex2'):\n"
                                          "        config.addinivalue_line('markers', m)\n")
    r, ran = _plugin_run(tmp_path, tests_file, "-m", "ch06_ex1")
    assert r.returncode == 0 and {n: o["outcome"] for n, o in ran.items()} == {"test_mine": "passed"}, (r.stdout, ran)


def test_a_class_graded_from_the_book_is_graded_beside_stubs(tmp_path):
    """Grading a class from the book copies each submission into a release of the graded exercises, not
    into a copy of the book: the copy beside the submission holds stubs where its answers would be (an
    answer that read them from there would score); from an edition, the edition as it is."""
    clean = grading.clean_base(ROOT, ["ch13_ex1"], tmp_path / "base")
    record = json.loads((clean / "EDITION.json").read_text())
    assert record["exercises"] == ["ch13_ex1"], record
    chapter = (clean / "notebooks" / "13_scaling_out.ipynb").read_text()
    module = (clean / "minivllm" / "model_executor" / "layers" / "parallel_linear.py").read_text()
    for text in (chapter, module):
        assert "NotImplementedError(" in text and "ch13_ex1: " in text and "BEGIN SOLUTION" not in text
    assert not (clean / "solutions").exists() and not (clean / ".git").exists()
    again = grading.clean_base(clean, ["ch13_ex1"], tmp_path / "again")  # an edition: copied as it is
    assert (again / "notebooks" / "13_scaling_out.ipynb").read_text() == chapter


def test_the_code_under_grading_may_not_reach_into_the_graders(tmp_path):
    """A line of the package or of an exercise that reaches a grader module at run time (by name or
    through `sys.modules`) is reported, as an import of one is."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_grading_ch10_regions.py").write_text("")
    (tmp_path / "minivllm").mkdir()
    (tmp_path / "exercises").mkdir()
    (tmp_path / "minivllm" / "ops.py").write_text("import sys\n\ndef f(x):\n    return sys.modules['test_' + 'grading'].g(x)\n")
    (tmp_path / "exercises" / "ch10.py").write_text("def g(x):\n    return rule(x)  # from test_grading_ch10_regions\n")
    found = grading.graders_code_used(tmp_path)
    assert [f.split(":")[0] for f in found] == ["exercises/ch10.py", "minivllm/ops.py"], found
    # a grader's state read through frames, closures or the garbage collector (its expected value, a stand-in)
    peeks = ["sys._getframe(1).f_locals['want']", "inspect.currentframe().f_back", "err.__traceback__.tb_frame",
             "wire.__closure__[0].cell_contents(x)", "[o for o in gc.get_objects() if callable(o)]",
             "inspect.stack()[2].frame", "frame.f_globals['_expect']"]
    (tmp_path / "minivllm" / "ops.py").write_text("\n".join(f"def f{i}(x):\n    return {p}\n" for i, p in enumerate(peeks)))
    (tmp_path / "exercises" / "ch10.py").write_text("def g(frame_locals, closure):\n    return frame_locals\n")
    found = grading.graders_code_used(tmp_path)
    assert [int(f.split(":")[1]) for f in found] == [3 * i + 2 for i in range(len(peeks))], found


FORGED_CONFTEST = """import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""


def test_grade_a_class_into_one_csv(edition, tmp_path):
    """Each submission is graded in a fresh copy of the instructor's edition with only its chapter
    copied in: alice's answer to ch05_ex1 scores, while her conftest.py that passes every test and her
    emptied graders change nothing; bob's untouched chapter scores 0 despite a forged conftest.py, a
    pytest.py and an EDITION.json that lists one exercise; carol's folder has no chapter (an error
    row). The submissions are left as they were, and each gets a report."""
    subs = tmp_path / "subs"
    alice = shutil.copytree(edition, subs / "alice")
    fill_build(alice, "ch05_ex1", build_answers(ROOT / CH05, "ch05_ex1"))
    (alice / "conftest.py").write_text(FORGED_CONFTEST)
    (alice / "tests" / "test_grading_ch04_06.py").write_text("# graders edited away\n")
    bob = shutil.copytree(edition, subs / "bob")
    (bob / "conftest.py").write_text(FORGED_CONFTEST)
    (bob / "pytest.py").write_text("raise SystemExit(0)\n")
    record = json.loads((bob / "EDITION.json").read_text())
    (bob / "EDITION.json").write_text(json.dumps({**record, "exercises": ["ch05_ex1"]}))
    (subs / "carol").mkdir()
    grading.grade_class(subs, tmp_path / "scores.csv", ["ch05_ex1", "ch05_ex2"], tests_from=edition,
                        reports=tmp_path / "reports", verbose=False)
    rows = {r["submission"]: r for r in csv.DictReader(open(tmp_path / "scores.csv"))}
    build, extend = EXERCISES["ch05_ex1"].points, EXERCISES["ch05_ex2"].points
    (speed, bands), = EXERCISES["ch05_ex1"].speed  # its band depends on this machine's noise: any band > 0
    correct = {g: str(p) for g, p in EXERCISES["ch05_ex1"].groups if g != speed}
    assert {g: rows["alice"][f"ch05_ex1: {g}"] for g in correct} == correct, rows["alice"]
    assert 0 < int(rows["alice"][f"ch05_ex1: {speed}"]) <= max(p for _, p in bands), rows["alice"]
    assert rows["alice"]["ch05_ex2"] == "0" and rows["alice"]["total"] == rows["alice"]["ch05_ex1"], rows
    assert int(rows["alice"]["ch05_ex1"]) == sum(map(int, correct.values())) + int(rows["alice"][f"ch05_ex1: {speed}"])
    assert rows["bob"]["total"] == "0" and rows["bob"]["max_total"] == str(build + extend), rows["bob"]
    assert "missing " in rows["carol"]["error"] and "notebooks/05_paged_attention.ipynb" in rows["carol"]["error"] \
        and rows["carol"]["total"] == "", rows["carol"]
    assert (alice / "tests" / "test_grading_ch04_06.py").read_text() == "# graders edited away\n"  # left as it was
    report = json.loads((tmp_path / "reports" / "alice.json").read_text())
    assert "NotImplementedError" in report["exercises"]["ch05_ex2"]["failed"][0]["message"]
    assert (tmp_path / "reports" / "bob.xml").exists()


def test_grading_an_exercise_the_edition_did_not_release_says_so(tmp_path, monkeypatch, capsys):
    """A chapter's grader cell of an exercise outside the edition's assignment still grades it, and says
    first that it is not in the assignment (a tester saw only "FAIL 0/5" for an extend exercise)."""
    (tmp_path / "minivllm").mkdir()
    (tmp_path / grading.EDITION_FILE).write_text(json.dumps({"exercises": ["ch06_ex1"]}))
    ran = []
    monkeypatch.setattr(grading, "_run_graders", lambda root, ids, *a: ran.append(ids) or (
        subprocess.CompletedProcess([], 5, "", ""), {}))
    grading.grade("ch06_ex2", root=tmp_path, export=False, verbose=True)
    out = capsys.readouterr().out
    assert "ch06_ex2: not in this edition's assignment" in out and "lists ch06_ex1" in out, out
    assert ran == [["ch06_ex2"]]
    grading.grade("ch06_ex1", root=tmp_path, export=False, verbose=True)
    assert "not in this edition's assignment" not in capsys.readouterr().out


def test_graders_code_is_not_an_answer(tmp_path):
    """An answer that imports a grader's stand-in is found and named (in an edition it scores 0)."""
    root = tmp_path / "ed"
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "test_grading_ch04_regions.py").write_text("def _grader_slots(): ...\n")
    (root / "minivllm" / "core").mkdir(parents=True)
    (root / "minivllm" / "core" / "kv_cache_manager.py").write_text(
        "def slot_mapping(*a):\n    from test_grading_ch04_regions import _grader_slots\n    return _grader_slots(*a)\n")
    (root / "minivllm" / "course").mkdir()  # the grading module names the stand-ins to find them: not an answer
    (root / "minivllm" / "course" / "grade.py").write_text(
        (ROOT / "minivllm" / "course" / "grade.py").read_text())
    (root / "exercises").mkdir()
    assert grading.graders_code_used(root) == [
        "minivllm/core/kv_cache_manager.py:2: from test_grading_ch04_regions import _grader_slots",
        "minivllm/core/kv_cache_manager.py:3: return _grader_slots(*a)"]
    (root / "minivllm" / "core" / "kv_cache_manager.py").write_text("def slot_mapping(*a):\n    return []\n")
    assert grading.graders_code_used(root) == []


# ------------------------------------------------------------------ a release of every chapter at once
CHAPTERS = sorted({e[:4] for e in EXERCISES})
KERNEL_REGIONS = ["ch07_ex1", "ch07_ex2"]  # graded regions inside `@triton.jit` kernels
KERNEL_HELPERS = ["_attend_tile"]  # `@triton.jit` functions with a region that only kernels call (inlined)
HELPER_CALLERS = {"paged_prefill_kernel": "_attend_tile"}  # given kernels that call a stubbed helper: they stop at its stub


@pytest.fixture(scope="module")
def every_chapter(tmp_path_factory) -> Path:
    """A student edition of every chapter's exercises (the release checks it holds no answer line)."""
    out = tmp_path_factory.mktemp("course") / "all-student"
    _script("release").release(CHAPTERS, out)
    return out


def test_the_leak_check_finds_an_answer_line_and_ignores_the_books_own():
    """`find_leaks` reports a line of a stubbed region's answer wherever it is (here: the given code
    of an extend exercise), not a trivial line, nor one the book also has outside every region."""
    release = _script("release")
    answer = ("        self.block_manager.allocate(seq)  # the answer's line\n        return\n"
              "        self.block_manager.deallocate(seq)\n        ])")
    leaking = release.answer_lines([("ch04_ex3", answer)])
    assert leaking == {"ch04_ex3": {"self.block_manager.allocate(seq)"}}, leaking  # deallocate: the book's


def test_every_chapter_at_once_holds_no_answer_line(every_chapter):
    """The release of all chapters passed its check; a real answer's line put back into the given
    code of an extend exercise (as exercises/ch04_scheduler.py's `_admit` had ch04_ex3's
    `self.block_manager.allocate(seq)`) is found by it."""
    release = _script("release")
    record = json.loads((every_chapter / "EDITION.json").read_text())
    assert record["stubbed_regions"] == sorted(e for e in EXERCISES if EXERCISES[e].kind == "rebuild")
    answers = [(ex, a) for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
               for ex, texts in _regions(nb).items() for a in texts]
    release.check_edition(every_chapter, answers)  # as the release did: no error
    line = sorted(release.answer_lines(answers)["ch06_ex1"])[0]  # a line of the chapter's build
    given = every_chapter / "exercises" / "ch06_prefix_caching.py"
    text = given.read_text()
    try:
        given.write_text(text + "\n" + line + "\n")
        with pytest.raises(RuntimeError, match=rf"exercises/ch06_prefix_caching.py:\d+: ch06_ex1: {re.escape(line)}"):
            release.check_edition(every_chapter, answers)
    finally:
        given.write_text(text)


def test_every_build_stub_scores_0_in_each_part_with_its_task(every_chapter):
    """In the release of every chapter at once, each build assignment (an exercise graded in parts)
    scores 0 in every part, and each part's first failure is the build's own NotImplementedError
    (never another chapter's stub: the graders' stand-ins replace those)."""
    builds = [e for e in EXERCISES if EXERCISES[e].groups]
    assert len(builds) >= 4, builds
    rep = grading.grade(builds, every_chapter, verbose=False)
    ungraded = {(ex, name): pts for ex in builds for name, pts in EXERCISES[ex].groups
                if name in dict(EXERCISES[ex].speed) and rep["exercises"][ex]["groups"][name]["max_points"] == 0}
    assert rep["total"] == 0 and rep["max_total"] == sum(EXERCISES[e].points for e in builds) - sum(ungraded.values())
    for ex in builds:
        groups = rep["exercises"][ex]["groups"]
        assert list(groups) == [g for g, _ in EXERCISES[ex].groups], (ex, groups)
        for name, g in groups.items():
            assert g["tests"] > 0 and g["points"] == 0, (ex, name, g)
            if (ex, name) in ungraded:  # a speed part whose hardware this machine lacks (a GPU)
                assert g["message"].startswith("not graded here ("), (ex, name, g["message"])
                continue
            assert g["message"].startswith(f"NotImplementedError: {ex}: "), (ex, name, g["message"])



def fill_with_the_books_answers(edition: Path) -> None:
    """Answer every exercise of `edition` as the book does, as a student would: each stub in a chapter
    (the line under its `# EXERCISE` marker) becomes the book's region of the same cell, in order, and
    each extend exercise's file becomes the book's solution."""
    for nb_path in sorted((edition / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        book = {c.get("id"): c.source for c in nbformat.read(ROOT / "notebooks" / nb_path.name, as_version=4).cells}
        for cell in nb.cells:
            lines = cell.source.split("\n")
            if cell.cell_type != "code" or not any(grading.REGION_MARKER.match(x) for x in lines):
                continue
            book_lines, answers = book[cell.get("id")].split("\n"), {}
            for r in find_regions(book[cell.get("id")]):
                answers.setdefault(r.id, []).append(book_lines[r.begin + 1:r.end])
            filled, stubbed = [], set()
            for i, line in enumerate(lines):
                m = grading.REGION_MARKER.match(lines[i - 1]) if i else None
                region = m and grading.Region(m["id"], int(m["points"]), m["task"].strip(), m["indent"], i - 1, i, i)
                if region and line == grading.stub_line(region, kernel=grading.in_triton_kernel(lines, i)):
                    line = "\n".join(answers[region.id].pop(0))  # the stub's place: the book's answer
                    stubbed.add(region.id)
                filled.append(line)
            assert not any(answers[ex] for ex in stubbed), (nb_path.name, cell.get("id"), answers)
            cell.source = "\n".join(filled)
        nbformat.write(nb, nb_path)
    for ex in EXERCISES.values():
        if ex.kind == "extend":
            shutil.copyfile(ROOT / "solutions" / Path(ex.where).name, edition / ex.where)


def test_the_books_answers_score_every_point_in_the_release_of_every_chapter(every_chapter, tmp_path):
    """A class that answers every exercise of every chapter as the book does scores every point. In an
    edition each exercise is graded with the graders' stand-ins in place of the other exercises' regions,
    so this is where a stand-in that differs from the book in a way a later chapter relies on shows (chapter
    05's freeing order, which chapter 06's prefix cache checks; a decode stand-in that read a length on the
    host, which chapter 08's graph capture refuses). Speed parts this machine cannot time are not graded."""
    answered = tmp_path / "answered"
    shutil.copytree(every_chapter, answered, symlinks=True)
    fill_with_the_books_answers(answered)
    rep = grading.grade(None, answered, verbose=False)
    lost = {ex: (r["points"], r["max_points"], [f["message"][:300] for f in r["failed"][:2]]
                 or [g["message"][:300] for g in r.get("groups", {}).values() if not g["passed"]])
            for ex, r in rep["exercises"].items() if not r["passed"]}
    assert not lost and rep["total"] == rep["max_total"] > 0, (rep["total"], rep["max_total"], lost)
    assert set(rep["exercises"]) == set(EXERCISES)

LOWER_STUBS = """
import json, sys
import torch
import triton_lowering as tl_
import minivllm.attention.ops.triton_attention as ta
from adapters import load

launches = []
for name in tl_.KERNELS:
    setattr(ta, name, tl_.Recorder(name, getattr(ta, name), launches))
t = lambda *s: torch.zeros(*s, dtype=torch.float16)
k_cache, q = t(6, 16, 2, 64), t(3, 4, 64)
tables, lens = torch.zeros(3, 64, dtype=torch.int64), torch.ones(3, dtype=torch.int64)
ta.store_kvcache(q[:, :2], q[:, :2], k_cache, k_cache.clone(), torch.zeros(3, dtype=torch.int64))
ta.paged_decode_attention_triton(q, k_cache, k_cache.clone(), tables, lens, 0.1, num_splits=3)
ta.paged_prefill_attention_triton(q, k_cache, k_cache.clone(), tables, lens, torch.arange(4, dtype=torch.int64), 0.1)
launches.append(("copy_blocks_kernel", load("ch07_triton_kernels", "exercises").copy_blocks_kernel,
                 (torch.zeros(64), torch.zeros(1, 2, dtype=torch.int64), 32, 16), {"BLOCK_NUMEL": 16, "TILE": 8}))
errors = {}
for name, kernel, args, kwargs in launches:
    try:
        tl_.lower(kernel, args, kwargs)
        errors[name] = None
    except Exception as e:
        while type(e).__name__ == "CompilationError" and e.__cause__ is not None:  # at a call: the error inside
            e = e.__cause__
        errors[name] = f"{type(e).__name__}: {e}"
json.dump(errors, sys.stdout)
"""


def _kernel_tasks(root: Path) -> dict[str, str]:
    """kernel name -> the task its stub must state, in the edition at `root`: `chNN_exK: task` from
    the `# EXERCISE` line left above a chapter's stub, `<file>.<kernel>: todo` from an exercise's
    `# TODO:` line (as scripts/make_exercises.py words it)."""
    found = {}
    for f in [root / "minivllm/attention/ops/triton_attention.py", root / "exercises/ch07_triton_kernels.py"]:
        lines, name = f.read_text().split("\n"), None
        for i, line in enumerate(lines):
            if m := re.match(r"def (\w+)", line):
                name = m[1] if grading.in_triton_kernel(lines, i + 1) else None  # its next line is in its body
            elif name and (m := grading.REGION_MARKER.match(line)):
                found.setdefault(name, f"{m['id']}: {m['task'].strip()}")
            elif name and f.parent.name == "exercises" and line.strip().startswith("# TODO:"):
                found.setdefault(name, f"{f.stem}.{name}: {line.strip()[len('# TODO:'):].strip()}")
    return found


def test_kernel_stubs_compile_to_their_task_on_a_gpu(every_chapter):
    """Triton's compiler refuses `raise` ("unsupported AST node type: Raise"): a region inside a
    `@triton.jit` kernel (chapter 07's, and exercises/ch07's copy_blocks_kernel) is stubbed with
    `tl.static_assert(False, task)`. Lowered through Triton's front end for an sm_90 GPU (no GPU
    needed, as tests/triton_lowering.py does), each stubbed kernel stops at its stub with its task."""
    stubs = _kernel_tasks(every_chapter)
    assert sorted(stubs) == ["_attend_tile", "copy_blocks_kernel", "paged_decode_kernel", "reduce_splits_kernel",
                             "store_kvcache_kernel"], stubs
    assert {m["id"] for m in grading.STUB.finditer((every_chapter / "minivllm/attention/ops/triton_attention.py")
                                                   .read_text())} == set(KERNEL_REGIONS)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([str(every_chapter), str(every_chapter / "tests")]),
               TRITON_DEFAULT_FP_FUSION="1", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", LOWER_STUBS], cwd=every_chapter, env=env, capture_output=True,
                         text=True, timeout=600)
    if run.returncode == 3:
        pytest.skip(run.stderr.strip())
    assert run.returncode == 0, run.stderr[-3000:]
    errors = json.loads(run.stdout)
    expected = {name: task for name, task in stubs.items() if name not in KERNEL_HELPERS}
    expected.update({kernel: stubs[helper] for kernel, helper in HELPER_CALLERS.items()})  # lowered in its callers
    assert sorted(errors) == sorted(expected)
    for name, error in errors.items():
        assert error and error.startswith("CompileTimeAssertionFailure") and error.endswith(expected[name]), (name, error)


def test_kernel_stubs_state_their_task_under_the_interpreter(every_chapter):
    """On a CPU (TRITON_INTERPRET=1) the stubbed KV-store kernel stops with its task, and a grading
    run reports such a failure as the stub's NotImplementedError (`grade._as_kernel_stub`)."""
    task = _kernel_tasks(every_chapter)["store_kvcache_kernel"]
    code = ("import torch\nimport minivllm.attention.ops.triton_attention as ta\n"
            "k, c = torch.ones(3, 2, 8), torch.zeros(6, 4, 2, 8)\n"
            "ta.store_kvcache(k, k, c, c.clone(), torch.zeros(3, dtype=torch.int64))\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(every_chapter), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", code], cwd=every_chapter, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode != 0 and task in run.stderr.strip().splitlines()[-1], run.stderr[-2000:]
    saved = list(grading._root)
    try:
        grading._root[:] = [every_chapter]
        message = f"AssertionError: ch07_ex1: the kernel raised under Triton's interpreter: AssertionError({task!r})"
        assert grading._as_kernel_stub(message).startswith(f"NotImplementedError: {task} (a Triton kernel's stub")
        assert grading._as_kernel_stub("AssertionError: ch07_ex1: wrong value") == "AssertionError: ch07_ex1: wrong value"
    finally:
        grading._root[:] = saved


def test_grade_command_refuses_unknown_ids(capsys):
    assert grading.main(["ch05_ex42", "--root", str(ROOT)]) == 2
    assert "unknown exercise" in capsys.readouterr().err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_each_saved_edit_of_a_chapter_is_exported_again(edition, tmp_path):
    """A student saves the chapter, grades, edits again and grades again: each time the package is
    re-exported from the chapter (the edition's record follows the last export), never refused."""
    edition = shutil.copytree(edition, tmp_path / "editing")
    nb_path = edition / CH05
    for k in range(2):
        nb = nbformat.read(nb_path, as_version=4)
        nb.cells[0].source += f"\n\nA note of my own, number {k}."
        nbformat.write(nb, nb_path)
        note = grading.sync_package(edition)
        assert note.startswith("re-exported minivllm/ from the chapters") and "notebooks are the source" in note
    assert grading.sync_package(edition) == "chapters unchanged since the last export: grading minivllm/ as it is"
    # an edit made in minivllm/ itself is graded as it is, and the line says the notebooks are the source
    exported = edition / "minivllm" / "sequence.py"
    exported.write_text(exported.read_text() + "\n# an edit of my own\n")
    note = grading.sync_package(edition)
    assert note.startswith("chapters unchanged") and "edits made in it directly" in note and "notebook" in note, note
    assert exported.read_text().endswith("# an edit of my own\n")
