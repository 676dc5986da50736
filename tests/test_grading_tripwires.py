"""Answers that pass without being the student's own, each shown to score 0 with a message saying why.

In a student edition of chapter 05 (`scripts/release.py`, written once per module), in the build
ch05_ex1 (the book's answers in its other stubs, so that each part fails by its cheat alone): an
allocate and a may_append that call the grader's own stand-ins at run time (`tests/stand_ins.py`'s
tripwires), a decode that calls the chapter's other implementation; and a "from scratch" block
manager (ch05_ex2) that inherits the package's methods (the grader checks where each is written).
In-process (fast): the tripwires themselves, the C++ kernel's entry, and a decode that reads at most
72 keys (the long-context cases).
An answer that pastes a stand-in's text is the student's code to the grader and passes (README's
course section says so): no test here.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import nbformat
import pytest
import torch

from script_loader import load_script
import stand_ins
from minivllm.course import grade as grading

ROOT = Path(__file__).resolve().parent.parent
CH05 = "notebooks/05_paged_attention.ipynb"
TRIPPED = "the grader's own answer was called"

# The cheating answers (a tester's), as a student would put them in the build's stubs: the function
# whose stub they replace -> the answer. The build's other stubs get the book's answers.
# Their names are built from pieces, so that no line names a grader module, `sys.modules` or a stand-in
# (`graders_code_used` reports those from the text): only the tripwires can catch them, at run time.
CHEATS = {
    "allocate": "import importlib\nreturn getattr(importlib.import_module('test_' + 'grading_ch04' + '_06'), "
                "'_Sca' + 'ffold').allocate(self, seq)",
    "may_append": "import sys\nm = getattr(sys, 'mod' + 'ules')['test_' + 'grading_ch04_06']\n"
                  "return getattr(m, '_Scaf' + 'fold').may_append(self, seq)",
    "paged_decode_attention": "return paged_decode_attention_planned(q, k_cache, v_cache, "
                              "plan_decode(block_tables, context_lens, k_cache.shape[1], q.dtype), scale)",
}
INHERITING = '''from minivllm.core.block_manager import BlockManager


class MyBlockManager(BlockManager):
    """Only the watermark written: the rest inherited from the package."""

    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int = 1):
        super().__init__(num_blocks, block_size)
        self.watermark_blocks = watermark_blocks

    @classmethod
    def from_cache_size(cls, num_tokens, block_size, max_model_len):
        return cls(num_tokens // block_size, block_size)

    def can_allocate(self, seq):
        return self.num_free_blocks - seq.num_blocks >= self.watermark_blocks


def paged_decode_attention_window('''


def _release():
    return load_script("release", "_tripwires_release").release


def build_answers(nb_path: Path, ex: str) -> dict[str, str]:
    """The function or method that holds each region of `ex` in the chapter at `nb_path` -> its answer
    (dedented), in the chapter's order."""
    out = {}
    for cell in nbformat.read(nb_path, as_version=4).cells:
        lines = cell.source.split("\n")
        for r in grading.find_regions(cell.source):
            if r.id == ex:
                name = next(line.split("def ")[1].split("(")[0] for line in reversed(lines[:r.marker])
                            if line.lstrip().startswith("def "))
                body = lines[r.begin + 1:r.end]
                cut = min(len(b) - len(b.lstrip()) for b in body if b.strip())
                out[name] = "\n".join(b[cut:] for b in body)
    return out


def fill_build(edition: Path, ex: str, bodies: dict[str, str], chapter: str = CH05) -> None:
    """Replace the stubs of `ex` in the edition's `chapter` by `bodies` (function name -> code; every
    stub must get one), as a student would."""
    nb = nbformat.read(edition / chapter, as_version=4)
    done = []
    for cell in nb.cells:
        lines = cell.source.split("\n")
        for i, line in enumerate(lines):
            if "raise NotImplementedError(" in line and f"{ex}: " in line:
                name = next(x.split("def ")[1].split("(")[0] for x in reversed(lines[:i]) if x.lstrip().startswith("def "))
                indent = line[:len(line) - len(line.lstrip())]
                lines[i] = "\n".join(indent + b for b in bodies[name].split("\n"))
                done.append(name)
        cell.source = "\n".join(lines)
    assert sorted(done) == sorted(bodies), (done, sorted(bodies))
    nbformat.write(nb, edition / chapter)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """Chapter 05's edition with the cheating answers in it, graded once (two pytest runs)."""
    edition = tmp_path_factory.mktemp("tripwires") / "ch05-student"
    _release()(["ch05"], edition)
    fill_build(edition, "ch05_ex1", {**build_answers(ROOT / CH05, "ch05_ex1"), **CHEATS})
    path = edition / "exercises" / "ch05_paged_attention.py"
    text = path.read_text()
    start, end = text.index("class MyBlockManager"), text.index("def paged_decode_attention_window(")
    path.write_text(text[:start] + INHERITING + text[end + len("def paged_decode_attention_window("):])
    return grading.grade(["ch05_ex1", "ch05_ex2"], edition, verbose=False)


def _messages(report: dict, ex: str) -> str:
    return "\n".join(f["message"] for f in report["exercises"][ex]["failed"])


@pytest.mark.parametrize("group", ["allocates and frees", "appends across block boundaries"])
def test_calling_the_graders_answer_at_run_time_scores_0(report, group):
    """allocate (the first part) and may_append (the second) call the grader's `_Scaffold` at run time."""
    r = report["exercises"]["ch05_ex1"]
    assert r["points"] == 0 and r["tests"] > 0 and r["groups"][group]["points"] == 0, r["groups"]
    assert f"ch05_ex1: {TRIPPED}" in r["groups"][group]["message"], r["groups"][group]
    assert "graders_code_used" not in report  # no name to find: the tripwires caught it at run time


def test_the_chapters_other_decode_scores_0(report):
    g = report["exercises"]["ch05_ex1"]["groups"]["paged decode equals the reference"]
    assert g["points"] == 0, g
    assert "ch05_ex1: your paged_decode_attention called the chapter's other implementation" in g["message"], g


def test_an_inherited_block_manager_is_not_from_scratch(report):
    assert report["exercises"]["ch05_ex2"]["points"] == 0
    assert "ch05_ex2: MyBlockManager.allocate is not written in exercises/ch05_paged_attention.py" in \
        _messages(report, "ch05_ex2"), _messages(report, "ch05_ex2")


# --- in-process: the tripwires themselves ------------------------------------------------------------
def _as_answer(fn, *args):
    """Call `fn(*args)` from code whose file is in the package, as the code under grading would."""
    scope = {"fn": fn, "args": args}
    exec(compile("out = fn(*args)", str(ROOT / "minivllm" / "an_answer.py"), "exec"), scope)
    return scope["out"]


def test_a_stand_in_trips_wherever_the_graders_hold_it(monkeypatch):
    """Within a test of ch04_ex2 (the slot mapping), its stand-in fails when the code under grading
    reaches it through its module, the STAND_INS registry (`stand_ins._patches`) or sys.modules;
    called by the graders' own code it works; another exercise's stand-in is left alone."""
    import test_grading_ch04_regions as t

    original, other = t._grader_slots, t._GraderScheduler.schedule_prefill
    args = ([5, 1], 2, 0, 3)  # block_table, block_size, start, end
    want = original(*args)
    with stand_ins.tripwires(["ch04_ex2"]) as tripped:
        for reach in (lambda: sys.modules["test_grading_ch04_regions"]._grader_slots,
                      lambda: getattr(t, "_grader" + "_slots"),
                      lambda: stand_ins._patches("ch04_ex2")[0][2]):
            with pytest.raises(stand_ins.GradersAnswerCalled, match=f"ch04_ex2: {TRIPPED}"):
                _as_answer(reach(), *args)
            assert reach()(*args) == want == [10, 11, 2]  # a grader's own call
        assert t._GraderScheduler.schedule_prefill is other
    assert len(tripped) == 3
    assert t._grader_slots is original  # put back after the test


def test_a_swallowed_tripwire_is_still_recorded():
    """An answer that catches the tripwire's exception and carries on: the trip is recorded, and the
    test's fixture (conftest.py's `_graders_own_answers_trip`) fails the test at teardown."""
    with stand_ins.tripwires(["ch05_ex1"]) as tripped:
        try:
            _as_answer(sys.modules["test_grading_ch04_06"]._Scaffold.allocate, None, None)
        except BaseException:  # noqa: BLE001  (what a cheating answer would do)
            pass
    assert tripped and tripped[0].startswith(f"ch05_ex1: {TRIPPED}"), tripped


def _long_case():
    import test_grading_ch04_06 as t

    return t, t.CH05_LONG[0]


def test_a_decode_that_reads_72_keys_fails_the_long_contexts(monkeypatch):
    t, (lens, block_size, groups, seed) = _long_case()
    from minivllm.attention.paged_attention import paged_decode_attention

    def truncating(q, k_cache, v_cache, block_tables, context_lens, scale):
        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens.clamp(max=72), scale)

    t.test_ch05_ex1_long_contexts(torch.float64, lens, block_size, groups, seed)  # the book's answer passes
    monkeypatch.setattr(t, "paged_decode_attention", truncating)
    with pytest.raises(AssertionError, match="ch05_ex1 .*long contexts"):
        t.test_ch05_ex1_long_contexts(torch.float64, lens, block_size, groups, seed)


@pytest.mark.parametrize("entry", ["paged_decode_attention_cpu", "cpu_decode_kernel", "plan_decode"])
def test_the_other_decodes_trip_only_from_the_answer(monkeypatch, entry):
    """ch05_ex1's decode calling the C++ kernel's entry (or the planner) fails; the same function
    called from elsewhere in the test (the engine's backend) works."""
    from minivllm.attention import paged_attention
    from minivllm.attention.backends import cpu_attn

    module = cpu_attn if hasattr(cpu_attn, entry) else importlib.import_module("minivllm.attention.decode_planner")

    def answer(*args):
        return getattr(module, entry)  # looked up at call time, as an answer's import in its body would

    monkeypatch.setattr(paged_attention, "paged_decode_attention", lambda *a: answer()(*a))
    with stand_ins.tripwires(["ch05_ex1"]):
        wire = getattr(module, entry)
        with pytest.raises(stand_ins.GradersAnswerCalled, match=f"ch05_ex1: your paged_decode_attention called "
                                                                f"the chapter's other implementation .*{entry}"):
            paged_attention.paged_decode_attention(None, None, None, None, None, None)
        if entry == "plan_decode":  # from elsewhere (not the answer): the real planner
            plan = wire(torch.tensor([[0, 1]]), torch.tensor([5]), 4, torch.float32)
            assert plan is not None
    assert getattr(module, entry) is not wire  # put back


def test_the_chapters_detokenizer_trips_from_the_exercise_file():
    """ch10_ex3 asks for the offset detokenizer: the package's `IncrementalDetokenizer`, used from the
    exercise's file, fails the test; the grader may still build one."""
    from minivllm.engine.detokenizer import IncrementalDetokenizer

    src = "IncrementalDetokenizer(None, [1], None)"
    with stand_ins.tripwires(["ch10_ex3"]) as tripped:
        with pytest.raises(stand_ins.GradersAnswerCalled, match="ch10_ex3: your ch10_sampling.py called the "
                                                                "chapter's other implementation"):
            exec(compile(src, str(ROOT / "exercises" / "ch10_sampling.py"), "exec"),
                 {"IncrementalDetokenizer": IncrementalDetokenizer})
        with pytest.raises(AttributeError):  # the real __init__ ran (and failed on the None tokenizer)
            IncrementalDetokenizer(None, [1], None)
    assert len(tripped) == 1


def test_the_engines_stop_string_check_trips_from_the_exercise_file():
    """ch01_ex3 asks for `check_stop_strings`: the engine's own (chapter 10's), called from the exercise's
    file, fails the test; called from elsewhere it answers as usual."""
    from minivllm.engine import detokenizer

    src = "check_stop_strings('ab', 1, ['b'], False)"
    with stand_ins.tripwires(["ch01_ex3"]) as tripped:
        with pytest.raises(stand_ins.GradersAnswerCalled, match="ch01_ex3: your ch01_sequences.py called the "
                                                                "chapter's other implementation"):
            exec(compile(src, str(ROOT / "exercises" / "ch01_sequences.py"), "exec"),
                 {"check_stop_strings": detokenizer.check_stop_strings})
        assert detokenizer.check_stop_strings("ab", 1, ["b"], False) == ("b", 1)
    assert len(tripped) == 1


@pytest.mark.parametrize("cheat", ["fused_layers.FusedRMSNorm.forward(self, x)", "fused_layers.cpu_fused_ops()"])
def test_the_fused_small_ops_trip_from_the_decoder_file(monkeypatch, cheat):
    """ch02_ex3 asks for RMSNorm, RoPE and the layer: an answer in llama.py that hands the work to
    appendix B's C++ ops (or their modules) fails the test; the fused modules used from elsewhere
    (the engine's model runner) work as usual."""
    from minivllm.model_executor.models import fused_layers, llama

    norm = llama.RMSNorm(8)
    src = f"def forward(self, x):\n    return {cheat}\n"
    scope = {"fused_layers": fused_layers}  # looked up at call time, as an import in the answer's body would
    exec(compile(src, llama.__file__, "exec"), scope)  # as if written in the student's llama.py
    with stand_ins.tripwires(["ch02_ex3"]) as tripped:
        with pytest.raises(stand_ins.GradersAnswerCalled, match="ch02_ex3: your minivllm.model_executor.models.llama "
                                                                "called the chapter's other implementation"):
            scope["forward"](norm, torch.ones(2, 8))
        if fused_layers.cpu_fused_ops() is not None:  # from here (not llama.py): the real ops
            fused = fused_layers.FusedRMSNorm(8)
            with torch.inference_mode():
                torch.testing.assert_close(fused(torch.ones(2, 8)), torch.ones(2, 8), rtol=1e-5, atol=1e-5)
    assert len(tripped) == 1
