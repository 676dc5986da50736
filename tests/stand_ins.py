"""The grader's stand-ins for graded regions of OTHER chapters, in a student edition that releases
several chapters at once.

Each chapter's graders already grade its exercises one at a time, with the grader's own code standing
in for the chapter's other regions. But the engine also runs code from other chapters: a chapter 05
grader builds `SamplingParams` (chapter 01's `check_sampling_filters`), runs the decoder (chapter 02's
RMSNorm, RoPE and MLP) and lays batches out (chapter 04). In an edition that releases chapters 01 and
05 together, those would be stubs, and a correct chapter 05 answer would fail on chapter 01's
`NotImplementedError`. So, when a grading run selects the exercises of some chapters (`-m ch05_ex1 or
...`; `python -m minivllm.course.grade` runs one chapter's rebuild exercises, then its extend exercises, each
in its own run), `conftest.py` puts the stand-ins below in place of every region the edition released
that the run does not grade (`released_elsewhere`), for the whole run. In the book (no
`EDITION.json`) nothing is replaced.

The stand-ins are the grader's own working code (most of it in the chapters' grader files), written
differently from the book's. Chapter 07's kernels have none: the engine on a CPU does not run them.
"""
from __future__ import annotations

import importlib
import json
import re
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import torch

EXERCISE_ID = re.compile(r"\bch\d\d_ex\d+\b")


def _paged_decode_stand_in(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Paged decode attention as a batch: each sequence's keys gathered by slot (block id * block_size
    + offset) as far as the block tables reach, past its context masked, one `F.scaled_dot_product_attention`
    call with grouped-query heads. Also the reference of ch05_ex1's speed part. It reads no tensor's value on
    the host (the longest context would be one): chapter 08 captures it in a CUDA graph."""
    n, _, d = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    t = torch.arange(block_tables.shape[1] * block_size, device=q.device)
    slots = block_tables.long().clamp(min=0).gather(1, (t // block_size).expand(n, -1)) * block_size + t % block_size
    k = k_cache.reshape(num_blocks * block_size, kv_heads, d)[slots].transpose(1, 2)
    v = v_cache.reshape(num_blocks * block_size, kv_heads, d)[slots].transpose(1, 2)
    keep = (t[None, :] < context_lens.to(t.device)[:, None])[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=keep, scale=scale,
                                                            enable_gqa=True).squeeze(2)


def _patches(ex: str) -> list[tuple[object, str, object]]:
    """(owner, attribute, stand-in) for exercise `ex`; [] where the grader has none."""
    ch = ex[:4]
    if ch == "ch01":
        return list(importlib.import_module("test_grading_ch01_regions").STAND_INS.get(ex, []))
    if ch == "ch02":  # ch02_ex3, the decoder layer: one stand-in per method of the build
        return list(importlib.import_module("test_grading_ch02_regions").STAND_INS.get(ex, []))
    if ch == "ch03":
        return list(importlib.import_module("test_grading_ch03_regions").STAND_INS.get(ex, []))
    if ch == "ch04":
        t = importlib.import_module("test_grading_ch04_regions")
        kvm, mr = importlib.import_module("minivllm.core.kv_cache_manager"), importlib.import_module("minivllm.worker.model_runner")
        from minivllm.core.sched.scheduler import Scheduler
        return {"ch04_ex2": [(kvm, "slot_mapping", t._grader_slots)],
                "ch04_ex3": [(Scheduler, name, getattr(t._GraderScheduler, name))
                             for name in ("schedule", "schedule_prefill", "schedule_decode")],
                "ch04_ex4": [(mr, "prepare_batch", t._grader_prepare_batch)]}.get(ex, [])
    if ch == "ch05":
        from minivllm.attention import paged_attention
        from minivllm.core.block_manager import BlockManager
        t = importlib.import_module("test_grading_ch04_06")
        return {"ch05_ex1": [(BlockManager, name, getattr(t._Scaffold, name)) for name in t.CH05_BUILD_METHODS]
                + [(paged_attention, "paged_decode_attention", _paged_decode_stand_in)]}.get(ex, [])
    if ch == "ch06":  # ch06_ex1, the prefix cache: compute_hash and one stand-in per method of the build
        return list(importlib.import_module("test_grading_ch06_regions").STAND_INS.get(ex, []))
    if ch == "ch08":
        return list(importlib.import_module("test_grading_ch08_regions").STAND_INS.get(ex, []))
    if ch == "ch09":
        return list(importlib.import_module("test_grading_ch09_regions").STAND_INS.get(ex, []))
    if ch == "ch10":
        t = importlib.import_module("test_grading_ch10_regions")
        return list(getattr(t, "STAND_INS", {}).get(ex, []))
    if ch == "ch11":
        return list(importlib.import_module("test_grading_ch11_regions").STAND_INS.get(ex, []))
    if ch == "ch13":
        return list(importlib.import_module("grading_ch13_ranks").STAND_INS.get(ex, []))
    if ch == "ch14":
        return list(importlib.import_module("test_grading_ch14_regions").STAND_INS.get(ex, []))
    if ch == "ch15":
        return list(importlib.import_module("test_grading_ch15_regions").STAND_INS.get(ex, []))
    return []


ROOT = Path(__file__).resolve().parent.parent


def _ours(name: str, module) -> bool:
    """A module of this edition: the package, or a file under its root (an extend exercise)."""
    where = getattr(module, "__file__", None) or ""
    return name.startswith("minivllm.") or (where.startswith(str(ROOT)) and "site-packages" not in where)


@contextmanager
def stand_ins_for(exercises: list[str]):
    """Within: the grader's stand-ins replace the package's code of `exercises` (rebuild regions),
    in their module and in every module that imported the same function by name (the package's, an
    extend exercise's)."""
    with ExitStack() as stack:
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        for ex in exercises:
            for owner, name, fn in _patches(ex):
                original = owner.__dict__.get(name)
                mp.setattr(owner, name, fn)
                for mod_name, module in list(sys.modules.items()):
                    if module is not owner and original is not None and _ours(mod_name, module) \
                            and getattr(module, name, None) is original:
                        mp.setattr(module, name, fn)
        yield


def released_elsewhere(root: Path, markexpr: str) -> list[str]:
    """The rebuild exercises an edition at `root` released that the run selected by `markexpr`
    (pytest's `-m`) does not grade: those of chapters with no rebuild exercise selected (a chapter's
    own graders stand in for its other regions). An extend exercise builds on its chapter's regions,
    so a run of extend exercises only gets stand-ins for all of them. [] in the book, or when `-m`
    names no exercise."""
    edition = root / "EDITION.json"
    selected = set(EXERCISE_ID.findall(markexpr or ""))
    if not edition.exists() or not selected:
        return []
    from minivllm.course.grade import EXERCISES

    rebuilding = {e[:4] for e in selected if e in EXERCISES and EXERCISES[e].kind == "rebuild"}
    released = json.loads(edition.read_text())["exercises"]
    return [e for e in released if e in EXERCISES and EXERCISES[e].kind == "rebuild" and e not in selected
            and e[:4] not in rebuilding]


# --- tripwires: the grader's own answers, and the chapter's other implementations ---------------------
# While a test of exercise X runs, the grader's stand-ins FOR X (they stand in for X only in other
# exercises' tests) are replaced, wherever the graders' files hold them (a module's function, a class's
# method, an entry of a STAND_INS table), by a tripwire that fails the test when the code under grading
# calls it: an answer that reaches the grader's code at run time (`importlib`, `sys.modules`, `getattr`
# on a built name) is not the student's. Called from the graders' own files (a grader comparing with
# its stand-in) it is the stand-in. `minivllm.course.grade.graders_code_used` finds the answers that name them; neither catches a
# stand-in's text pasted into the answer (README's course section says so).

# The chapter's other implementations of a graded function, which its answer must not call: X ->
# (the graded function (module, name), an extend exercise's file, or a module whose graded regions
# fill it; [the functions, `Class.method` included, it must not call while it runs]). Called from elsewhere (the engine's own backend, the
# grader's reference in the same test) they work as usual.
OTHER_IMPLEMENTATIONS = {
    "ch01_ex3": ("ch01_sequences.py", [("minivllm.engine.detokenizer", "check_stop_strings")]),
    "ch10_ex3": ("ch10_sampling.py", [("minivllm.engine.detokenizer", "IncrementalDetokenizer.__init__"),
                                      ("minivllm.engine.detokenizer", "IncrementalDetokenizer.decode_next"),
                                      ("minivllm.engine.detokenizer", "IncrementalDetokenizer._step")]),
    # ch02_ex3's regions are methods all over llama.py: its whole file is the graded code
    "ch02_ex3": ("minivllm.model_executor.models.llama",
                 [("minivllm.model_executor.models.fused_layers", "cpu_fused_ops"),  # the C++ small ops
                  ("minivllm.model_executor.models.fused_layers", "FusedRMSNorm.forward"),
                  ("minivllm.model_executor.models.fused_layers", "FusedRotaryEmbedding.forward"),
                  ("minivllm.model_executor.models.fused_layers", "FusedDecoderLayer.forward")]),
    "ch05_ex1": (("minivllm.attention.paged_attention", "paged_decode_attention"),
                 [("minivllm.attention.decode_planner", "paged_decode_attention_planned"),
                  ("minivllm.attention.decode_planner", "plan_decode"),
                  ("minivllm.attention.backends.cpu_attn", "paged_decode_attention_cpu"),
                  ("minivllm.attention.backends.cpu_attn", "cpu_decode_kernel"),  # the C++ kernel's entry
                  ("minivllm.model_executor.cpp_extension", "load_library")]),
}


class GradersAnswerCalled(BaseException):
    """The code under grading called a tripwire (a BaseException: an answer's `except Exception`
    does not swallow it, and hypothesis does not shrink it; the test fails at teardown anyway)."""


def stand_in_functions(ex: str) -> list:
    """The grader's stand-ins for rebuild exercise `ex` (the functions `_patches` plugs in for it)."""
    from minivllm.course.grade import EXERCISES

    if ex not in EXERCISES or EXERCISES[ex].kind != "rebuild":
        return []
    try:
        return [fn for _, _, fn in _patches(ex)]
    except (KeyError, ImportError):  # a chapter whose graders this edition lacks
        return []


def _graders_modules() -> list:
    """The graders' modules loaded now: every module from tests/ (this one included)."""
    tests = str(ROOT / "tests")
    return [m for m in list(sys.modules.values()) if (getattr(m, "__file__", None) or "").startswith(tests)]


def _swap_entry(entry, fn, wire):
    """A STAND_INS table's entry (a tuple, or a list of tuples) with `fn` replaced by `wire`; None if it lacks `fn`."""
    if isinstance(entry, tuple):
        return tuple(wire if x is fn else x for x in entry) if any(x is fn for x in entry) else None
    if isinstance(entry, list):
        swapped = [_swap_entry(x, fn, wire) for x in entry]
        return [s if s is not None else x for s, x in zip(swapped, entry)] if any(s is not None for s in swapped) \
            else None
    return None


def _tripwire(message: str, tripped: list[str], call_through, graded=None):
    """A function that records `message` and raises `GradersAnswerCalled`, or calls `call_through`
    instead: without `graded`, when its caller is the graders' own code (a file of tests/: a grader
    may use its stand-in as the reference it compares with); with `graded` (a code object, or a set
    of file names), unless called (directly or not) from that code."""
    tests = str(ROOT / "tests")

    def tripwire(*args, **kwargs):
        if graded is None and sys._getframe(1).f_code.co_filename.startswith(tests):
            return call_through(*args, **kwargs)
        if graded is not None:
            frame = sys._getframe(1)
            while frame is not None and not (frame.f_code is graded or (
                    isinstance(graded, set) and frame.f_code.co_filename in graded)):
                frame = frame.f_back
            if frame is None:
                return call_through(*args, **kwargs)
        tripped.append(message)
        raise GradersAnswerCalled(message)
    return tripwire


def _wire_stand_ins(mp, ex: str, tripped: list[str]) -> None:
    """Replace the grader's stand-ins for `ex` by tripwires wherever the graders' modules hold them."""
    for fn in stand_in_functions(ex):
        what = getattr(fn, "__qualname__", repr(fn))
        wire = _tripwire(f"{ex}: the grader's own answer was called ({what}, the grader's stand-in for "
                         f"{ex}): it is not your answer", tripped, fn)
        for module in _graders_modules():
            for name, value in list(vars(module).items()):
                if value is fn:
                    mp.setattr(module, name, wire)
                elif isinstance(value, type) and value.__module__ == module.__name__:
                    for attr, member in list(vars(value).items()):
                        if member is fn or getattr(member, "__func__", None) is fn:
                            mp.setattr(value, attr, staticmethod(wire) if isinstance(member, staticmethod) else wire)
                elif isinstance(value, dict) and name == "STAND_INS":
                    for key, entry in list(value.items()):
                        swapped = _swap_entry(entry, fn, wire)
                        if swapped is not None:
                            mp.setitem(value, key, swapped)


def _wire_other_implementations(mp, ex: str, tripped: list[str]) -> None:
    """Replace `OTHER_IMPLEMENTATIONS[ex]`'s functions by tripwires that go off when the graded code calls them."""
    graded, forbidden = OTHER_IMPLEMENTATIONS[ex]
    if isinstance(graded, str) and graded.endswith(".py"):  # an extend exercise's file, in either implementation
        yours, graded = f"your {graded}", {str(ROOT / d / graded) for d in ("exercises", "solutions")}
    elif isinstance(graded, str):  # a module whose regions are all graded: code anywhere in its file
        yours, graded = f"your {graded}", {importlib.import_module(graded).__file__}
    else:
        yours = f"your {graded[1]}"
        graded = getattr(getattr(importlib.import_module(graded[0]), graded[1]), "__code__", None)
    for mod_name, name in forbidden:
        owner, attr = importlib.import_module(mod_name), name
        while "." in attr:
            first, attr = attr.split(".", 1)
            owner = getattr(owner, first)
        original = getattr(owner, attr)
        wire = _tripwire(f"{ex}: {yours} called the chapter's other implementation {mod_name}.{name}: "
                         "write the computation yourself", tripped, original, graded)
        if isinstance(owner, type):
            mp.setattr(owner, attr, wire)
            continue
        for m_name, module in list(sys.modules.items()):
            if module is not None and _ours(m_name, module):
                for key, value in list(vars(module).items()):
                    if value is original:
                        mp.setattr(module, key, wire)


@contextmanager
def tripwires(exercises: list[str]):
    """Within (a test of `exercises`): the grader's stand-ins for them, and the implementations of
    `OTHER_IMPLEMENTATIONS` when called from the graded function, fail the test. Yields the list of
    messages of the tripwires that went off (the caller fails the test if the answer swallowed them)."""
    tripped: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        for ex in exercises:
            _wire_stand_ins(mp, ex, tripped)
            if ex in OTHER_IMPLEMENTATIONS:
                _wire_other_implementations(mp, ex, tripped)
        yield tripped
