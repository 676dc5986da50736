"""Grade the exercises: run their graders (pytest, one marker per exercise) in the book or in a
student edition, and write points per exercise and the total (JSON, JUnit XML; a class as one CSV).

    python -m minivllm.course.grade                        # every exercise of this edition (the book: all)
    python -m minivllm.course.grade ch05_ex1 ch05_ex2      # some exercises; `ch05`: all of chapter 05's
    python -m minivllm.course.grade ch05 --json report.json --junit report.xml
    python -m minivllm.course.grade ch05 --private-tests ~/course/private   # the instructor's extra tests
    python -m minivllm.course.grade ch05 --class submissions/ --csv scores.csv  # one edition per subfolder

Hand-written, not exported from a chapter: it is the course's tooling, like `scripts/release.py`.
`EXERCISES` is the one place where exercises and their points are defined. An exercise scores its
points when every test carrying its marker passes (public and private tests alike), nothing otherwise;
an exercise with named test groups (`Exercise.groups`, e.g. "admits first come, first served") scores
each group's points when that group's tests pass, so a student sees which part of a build works.

Graded regions (rebuild exercises) sit in the chapters' export cells, between nbgrader's markers,
under one line that names the exercise, its points and the task (`REGION_MARKER`):

    # EXERCISE ch05_ex1 (20 points): give `seq` one fresh block per block it needs
    ### BEGIN SOLUTION
    ...the book's answer...
    ### END SOLUTION

A student edition (`scripts/release.py`) replaces such a region by
`raise NotImplementedError("ch05_ex1: <the task>")` in the chapter and in the package exported from it
(in a Triton kernel by `tl.static_assert(False, "ch07_ex1: <the task>")`, `kernel_stub`).
In an edition, `grade` first re-exports the package from the chapters when they changed since the
release (the student works in the notebooks). The idea of graded regions and stubs is nbgrader's;
the snapshot-free, contract-only graders follow CS336's and minitorch's course tests.
"""
from __future__ import annotations

import argparse
import ast
import csv
import functools
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree as ET

try:
    import pytest as _pytest
except ImportError:  # the table and the release work without pytest; grading needs it
    _pytest = None


@dataclass(frozen=True)
class Exercise:
    """One graded exercise.

    Attributes:
        id: `chNN_exK`, also its pytest marker.
        points: what it scores when all its tests pass.
        kind: "rebuild" (a core piece of the package, a graded region in a chapter's export cell) or
            "extend" (beyond the text, in `exercises/chNN_*.py`).
        title: a few words.
        where: the file a student edits.
        tests: the test files (relative to the edition's root) that hold its graders.
        groups: for partial credit, `(name, points)` pairs whose points add up to `points`: a test
            marked `@pytest.mark.group(name)` belongs to that group, and a group scores its points when
            every test in it passes; a test of the exercise in no group must pass for any points. Empty:
            all or nothing.
        speed: for a performance part, `(group, bands)` pairs: `group` (one of `groups`) scores by
            the speed its passing tests record (`record_property(SPEED_RATIO, ratio)`: the student's
            time over the grader's reference's, measured side by side in the same run, so a noisy
            machine changes both), the points of the first `(max_ratio, points)` band whose
            `max_ratio` the worst recorded ratio does not exceed (bands in increasing ratio, the
            first worth the group's points), 0 past the last. A speed group whose tests all skipped
            (the hardware is absent) is not graded in that run: its points leave the run's maximum.
    Raises:
        ValueError: groups whose points do not add up to `points`, a group named twice, or speed bands
            that name no group, do not start at the group's points or are not in increasing ratio.
    """

    id: str
    points: int
    kind: str
    title: str
    where: str
    tests: tuple[str, ...]
    groups: tuple[tuple[str, int], ...] = ()
    speed: tuple[tuple[str, tuple[tuple[float, int], ...]], ...] = ()

    def __post_init__(self):
        names = [g for g, _ in self.groups]
        if self.groups and (sum(p for _, p in self.groups) != self.points or len(set(names)) != len(names)):
            raise ValueError(f"{self.id}: groups {self.groups} should name each group once and add up to {self.points}")
        for group, bands in self.speed:
            ratios, pts = [r for r, _ in bands], [p for _, p in bands]
            if group not in dict(self.groups) or not bands or pts[0] != dict(self.groups)[group] \
                    or ratios != sorted(set(ratios)) or pts != sorted(pts, reverse=True):
                raise ValueError(f"{self.id}: speed bands {bands} of {group!r} should name one of its groups, start "
                                 "at that group's points and list increasing ratios with decreasing points")


_CH05_NB, _CH05_EX = "notebooks/05_paged_attention.ipynb", "exercises/ch05_paged_attention.py"
_T1, _T3, _T46, _T10 = ("tests/test_grading.py",), ("tests/test_grading_ch03.py",), \
    ("tests/test_grading_ch04_06.py",), ("tests/test_grading_ch10.py",)

EXERCISES: dict[str, Exercise] = {e.id: e for e in [
    Exercise("ch01_ex1", 12, "rebuild", "build the sequence: its token views, the Sequence's constructor and "
             "append_token, the block arithmetic (blocks_needed, token_block) and its views, the stop rules (check_stop)",
             "notebooks/01_sequences.ipynb", ("tests/test_grading_ch01_regions.py",),
             groups=(("tokens and lengths", 4),
                     ("blocks of the sequence", 4),
                     ("stops by the rules", 4))),
    Exercise("ch01_ex2", 3, "rebuild", "the sampling filters' ranges (check_sampling_filters)",
             "notebooks/01_sequences.ipynb", ("tests/test_grading_ch01_regions.py",)),
    Exercise("ch01_ex3", 3, "extend", "stop strings, checked in the new text and a tail (check_stop_strings)",
             "exercises/ch01_sequences.py", ("tests/test_grading_ch01_extend.py",)),
    Exercise("ch02_ex1", 4, "extend", "Gemma's RMSNorm and RoPE over adjacent pairs (gemma_rms_norm, "
             "apply_rope_interleaved)", "exercises/ch02_model.py", _T1),
    Exercise("ch02_ex2", 4, "extend", "attention with grouped-query heads, the causal rule and a sliding "
             "window (attention)", "exercises/ch02_model.py", _T1),
    Exercise("ch02_ex3", 15, "rebuild", "build the decoder layer: RMSNorm, rotary embedding, attention with GQA "
             "(Attention.forward, qkv), the SwiGLU MLP, DecoderLayer.forward", "notebooks/02_model.ipynb",
             ("tests/test_grading_ch02_regions.py", "tests/test_grading_default_model.py"),
             groups=(("RMSNorm equals transformers'", 2),
                     ("rotary embedding equals transformers'", 3),
                     ("attention with GQA equals the reference", 3),
                     ("MLP equals transformers'", 2),
                     ("the decoder layer's residuals and norms equal transformers'", 2),
                     ("the decoder equals transformers' logits", 3))),
    Exercise("ch03_ex1", 4, "extend", "batch without padding: prompts end to end in one flat list (varlen_attention)",
             "exercises/ch03_batching.py", _T3),
    Exercise("ch03_ex2", 10, "rebuild", "build static batching: left padding and positions (pad_batch), the padded "
             "attention with its mask (padded_attention), the loop over a static batch (static_generate)",
             "notebooks/03_batching.ipynb", ("tests/test_grading_ch03_regions.py",),
             groups=(("left padding and positions", 3),
                     ("the mask hides padding and the future", 4),
                     ("the loop runs each row to its own end", 3))),
    Exercise("ch03_ex3", 4, "extend", "sort before batching: the batches that pad least, outputs in arrival order "
             "(length_sorted_batches, sorted_static_generate)", "exercises/ch03_batching.py", _T3),
    Exercise("ch04_ex1", 5, "extend", "shortest-prompt-first admission", "exercises/ch04_scheduler.py", _T46),
    Exercise("ch04_ex2", 2, "rebuild", "the slot mapping", "notebooks/04_scheduler.ipynb",
             ("tests/test_grading_ch04_regions.py", "tests/test_grading_default_model.py")),
    Exercise("ch04_ex3", 10, "rebuild", "build the scheduler: Scheduler.schedule, schedule_prefill (admission), "
             "schedule_decode (preemption)", "notebooks/04_scheduler.ipynb", ("tests/test_grading_ch04_regions.py",),
             groups=(("admits first come, first served within the limits", 3),
                     ("decodes the oldest, preempts the newest", 3),
                     ("survives random adds, steps and aborts", 2),
                     ("equals transformers under memory pressure", 2))),
    Exercise("ch04_ex4", 3, "rebuild", "prepare_batch's flat layout", "notebooks/04_scheduler.ipynb",
             ("tests/test_grading_ch04_regions.py", "tests/test_grading_default_model.py")),
    Exercise("ch05_ex1", 20, "rebuild", "build the paged KV cache: BlockManager (can_allocate, allocate, deallocate, "
             "needs_new_block, can_append, may_append) and paged_decode_attention", _CH05_NB,
             (*_T46, "tests/test_grading_default_model.py"),
             groups=(("allocates and frees", 4),
                     ("appends across block boundaries", 3),
                     ("survives preemption", 2),
                     ("paged decode equals the reference", 4),
                     ("the engine equals transformers", 3),
                     ("paged decode keeps the reference's speed", 4)),
             speed=(("paged decode keeps the reference's speed", ((1.5, 4), (3.0, 3), (6.0, 2), (12.0, 1))),)),
    Exercise("ch05_ex2", 5, "extend", "a block manager with a watermark, from scratch", _CH05_EX, _T46),
    Exercise("ch05_ex3", 3, "extend", "sliding-window paged decode", _CH05_EX, _T46),
    Exercise("ch06_ex1", 12, "rebuild", "build the prefix cache: compute_hash, the cache's forest and eviction (_cache, "
             "_uncache, _free_block, _allocate_block, discard_unwritten), the lookup (_is_hit, allocate, may_append)",
             "notebooks/06_prefix_caching.ipynb", ("tests/test_grading_ch06_regions.py",),
             groups=(("hashes chain the whole prefix", 3),
                     ("allocates with cache hits and reference counts", 4),
                     ("keeps freed blocks cached and evicts the least recently freed", 3),
                     ("the engine equals transformers with prefix caching", 2))),
    Exercise("ch06_ex2", 5, "extend", "token-granular prefix caching", "exercises/ch06_prefix_caching.py", _T46),
    Exercise("ch06_ex3", 4, "extend", "cache isolation: requests share cached blocks only within their cache_salt",
             "exercises/ch06_prefix_caching.py", ("tests/test_grading_ch06_extend.py",)),
    Exercise("ch07_ex1", 3, "rebuild", "the KV-store kernel", "notebooks/07_triton_kernels.ipynb",
             ("tests/test_grading_ch07_regions.py",)),
    Exercise("ch07_ex2", 16, "rebuild", "build paged decode attention with split-K in Triton: the online-softmax "
             "step (_attend_tile), the per-split kernel (paged_decode_kernel), the reduction (reduce_splits_kernel)",
             "notebooks/07_triton_kernels.ipynb", ("tests/test_grading_ch07_regions.py",),
             groups=(("the online-softmax step equals the reference", 3),
                     ("one split equals the reference", 3),
                     ("split-K partials merge to the reference", 3),
                     ("the reduction merges partials to the reference", 2),
                     ("the engine equals transformers with the Triton backend", 2),
                     ("decodes at the reference kernels' speed on a GPU", 3)),
             speed=(("decodes at the reference kernels' speed on a GPU", ((1.5, 3), (3.0, 2), (6.0, 1))),)),
    Exercise("ch07_ex3", 3, "extend", "copy_blocks as a Triton kernel (copy-on-write)",
             "exercises/ch07_triton_kernels.py", ("tests/test_grading_ch07_extend.py",)),
    Exercise("ch08_ex1", 17, "rebuild", "build the capture-and-replay runner: cudagraph_capture_sizes, "
             "padded_batch_size, prepare_decode_inputs, DecodeGraphs (capture, step, run), CUDAGraphModelRunner's "
             "allocate_kv_cache and forward_logits", "notebooks/08_cuda_graphs.ipynb",
             ("tests/test_grading_ch08_regions.py",),
             groups=(("capture sizes and padding", 3),
                     ("static buffers hold the batch, padding rows are inert", 4),
                     ("replay equals the eager step", 4),
                     ("the engine equals transformers with graphs", 3),
                     ("a decode step at the reference's speed on a GPU", 3)),
             speed=(("a decode step at the reference's speed on a GPU", ((1.5, 3), (3.0, 2), (6.0, 1))),)),
    Exercise("ch08_ex2", 3, "extend", "capture sizes chosen from observed batch sizes",
             "exercises/ch08_cuda_graphs.py", ("tests/test_grading_ch08_extend.py",)),
    Exercise("ch08_ex3", 3, "extend", "the graphs' static tensors in bytes, and the capture size a memory budget "
             "affords", "exercises/ch08_cuda_graphs.py", ("tests/test_grading_ch08_extend.py",)),
    Exercise("ch09_ex1", 11, "rebuild", "build the roofline from a model config: model_cost, step_cost, roofline, "
             "workload_bound", "notebooks/09_benchmark.ipynb", ("tests/test_grading_ch09_regions.py",),
             groups=(("weights and KV bytes per token from the config", 4),
                     ("a step's FLOPs and bytes", 3),
                     ("the roofline of a run", 2),
                     ("the least time of a workload", 2))),
    Exercise("ch09_ex2", 4, "extend", "how many sequences fit, and from which batch decode is compute-bound",
             "exercises/ch09_benchmark.py", ("tests/test_grading_ch09_extend.py",)),
    Exercise("ch09_ex3", 4, "extend", "the prefill chunk that rides along a decode step for free",
             "exercises/ch09_benchmark.py", ("tests/test_grading_ch09_extend.py",)),
    Exercise("ch10_ex1", 11, "rebuild", "build the sampler's filters: apply_penalties, apply_min_p, apply_top_k_top_p, "
             "the pivot draw's ranking and keep test (ranked_before, mass_ranked_before)", "notebooks/10_sampling.ipynb",
             ("tests/test_grading_ch10_regions.py",),
             groups=(("the penalties equal transformers' and OpenAI's", 3),
                     ("min-p equals transformers'", 2),
                     ("top-k and top-p equal transformers'", 3),
                     ("the pivot draw ranks ties and keeps only filtered tokens", 3))),
    Exercise("ch10_ex2", 3, "extend", "typical-p sampling", "exercises/ch10_sampling.py", _T10),
    Exercise("ch10_ex3", 3, "extend", "the offset detokenizer", "exercises/ch10_sampling.py", _T10),
    Exercise("ch10_ex4", 3, "extend", "no-repeat n-grams", "exercises/ch10_sampling.py", _T10),
    Exercise("ch11_ex1", 10, "rebuild", "the token-budget scheduler (ChunkedPrefillScheduler.schedule)",
             "notebooks/11_chunked_prefill.ipynb", ("tests/test_grading_ch11_regions.py",),
             groups=(("never over budget", 2),
                     ("running before waiting", 2),
                     ("survives preemption", 2),
                     ("starts at the prefix-cache hit", 2),
                     ("equals transformers", 2))),
    Exercise("ch11_ex2", 5, "rebuild", "the mixed batch's layout (prepare_mixed_batch)", "notebooks/11_chunked_prefill.ipynb",
             ("tests/test_grading_ch11_regions.py",)),
    Exercise("ch11_ex3", 4, "extend", "short prompts overtake long ones (max_num_partial_prefills)",
             "exercises/ch11_chunked_prefill.py", ("tests/test_grading_ch11.py",)),
    Exercise("ch12_ex1", 10, "rebuild", "a request's path through AsyncLLM (merge_delta, RequestOutputCollector, "
             "generate)", "notebooks/12_serving.ipynb", ("tests/test_grading_ch12_regions.py",),
             groups=(("replaces final and cumulative outputs", 1),
                     ("merges deltas without loss", 2),
                     ("raises errors", 1),
                     ("wakes a waiting consumer", 2),
                     ("streams through AsyncLLM", 2),
                     ("aborts leave the engine idle", 2))),
    Exercise("ch12_ex2", 5, "rebuild", "the SSE chunk writer (sse_event, sse_stream, completion_chunks)",
             "notebooks/12_serving.ipynb", ("tests/test_grading_ch12_regions.py",)),
    Exercise("ch12_ex3", 5, "extend", "goodput as DistServe measures it: SLO attainment and the highest rate "
             "that keeps it", "exercises/ch12_serving.py", ("tests/test_grading_ch12.py",)),
    Exercise("ch13_ex1", 10, "rebuild", "column- and row-parallel linear layers with their shard loaders "
             "(ColumnParallelLinear, RowParallelLinear)", "notebooks/13_scaling_out.ipynb",
             ("tests/test_grading_ch13_regions.py",),
             groups=(("splits and refuses", 3),
                     ("equals nn.Linear", 7))),
    Exercise("ch13_ex2", 5, "rebuild", "the vocabulary split: VocabParallelEmbedding and ParallelLMHead with padding",
             "notebooks/13_scaling_out.ipynb", ("tests/test_grading_ch13_regions.py",)),
    Exercise("ch13_ex3", 5, "rebuild", "heads per rank and KV-head replication (kv_head_replicas, parallelize)",
             "notebooks/13_scaling_out.ipynb", ("tests/test_grading_ch13_regions.py",)),
    Exercise("ch14_ex1", 10, "rebuild", "the rejection sampler (greedy_verify, rejection_sample)",
             "notebooks/14_speculative_decoding.ipynb", ("tests/test_grading_ch14_regions.py",),
             groups=(("greedy is exact", 3),
                     ("follows p", 4),
                     ("uses each uniform once", 3))),
    Exercise("ch14_ex2", 5, "rebuild", "prompt lookup (ngram_lookup)", "notebooks/14_speculative_decoding.ipynb",
             ("tests/test_grading_ch14_regions.py",)),
    Exercise("ch14_ex3", 5, "extend", "k adapted per request from its acceptance (AdaptiveNgramProposer)",
             "exercises/ch14_speculative_decoding.py", ("tests/test_grading_ch14.py",)),
    Exercise("ch15_ex1", 5, "rebuild", "applying a packed token bitmask (apply_token_bitmask)",
             "notebooks/15_structured_outputs.ipynb", ("tests/test_grading_ch15_regions.py",)),
    Exercise("ch15_ex2", 10, "rebuild", "the toy regex index (token_mask)", "notebooks/15_structured_outputs.ipynb",
             ("tests/test_grading_ch15_regions.py",)),
    Exercise("ch15_ex3", 5, "extend", "fast-forward tokens: forced tokens appended without sampling "
             "(FastForwardScheduler)", "exercises/ch15_structured_outputs.py", ("tests/test_grading_ch15.py",)),
]}

EDITION_FILE = "EDITION.json"  # written by scripts/release.py at a student edition's root
RESULTS_ENV = "MINIVLLM_GRADE_RESULTS"  # where the pytest plugin below writes each test's outcome
SPEED_RATIO = "speed_ratio"  # the user property a speed grader records: the student's time / the reference's
REGION_MARKER = re.compile(r"^(?P<indent>\s*)# EXERCISE (?P<id>ch\d\d_ex\d+) \((?P<points>\d+) points?\): (?P<task>.+)$")
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
GRADE_TIMEOUT_S = 1800  # one grading run's limit, seconds
MESSAGE_CHARS = 4000  # the tail of a failure report kept in the JSON (hypothesis' smallest example is there)
SUMMARY_CHARS = 240  # the most characters of a failure's message on one line of the score table


# --- exercise ids ------------------------------------------------------------------------------
def resolve(ids: list[str] | None) -> list[str]:
    """Expand chapter ids (`ch05`) into their exercises; None or [] means all.

    Raises:
        ValueError: an id that names no exercise and no chapter with exercises.
    """
    if not ids:
        return list(EXERCISES)
    out: list[str] = []
    for name in ids:
        if name in EXERCISES:
            found = [name]
        elif re.fullmatch(r"ch\d\d", name):
            found = [e for e in EXERCISES if e.startswith(name + "_")]
        else:
            found = []
        if not found:
            chapters = sorted({e[:4] for e in EXERCISES})
            raise ValueError(f"unknown exercise or chapter {name!r}: known chapters {', '.join(chapters)}; "
                             f"exercises {', '.join(EXERCISES)}")
        out += [e for e in found if e not in out]
    return out


@dataclass
class Region:
    """A graded region in a text: the marker line, the BEGIN and END lines (0-based line numbers)."""

    id: str
    points: int
    task: str
    indent: str
    marker: int
    begin: int
    end: int


def find_regions(text: str, where: str = "<text>") -> list[Region]:
    """The graded regions of `text` (a notebook cell's or a module's source), in order.

    Raises:
        ValueError: nested or unclosed regions, a region without a marker line, an id not in
            `EXERCISES`, or points that differ from `EXERCISES`' (the table is the one place for
            points). A marker line not followed by `### BEGIN SOLUTION` at its indentation is a
            stubbed region (a student edition's) and is skipped.
    """
    lines, regions, i = text.split("\n"), [], 0
    while i < len(lines):
        m = REGION_MARKER.match(lines[i])
        if m is None:
            if lines[i].strip() == BEGIN:
                raise ValueError(f"{where}:{i + 1}: {BEGIN} without an `# EXERCISE chNN_exK (N points): task` line above")
            i += 1
            continue
        ex, points = m["id"], int(m["points"])
        if ex not in EXERCISES:
            raise ValueError(f"{where}:{i + 1}: exercise {ex} is not in minivllm.course.grade.EXERCISES")
        if points != EXERCISES[ex].points:
            raise ValueError(f"{where}:{i + 1}: {ex} says {points} points, EXERCISES says {EXERCISES[ex].points}")
        if i + 1 >= len(lines) or lines[i + 1] != m["indent"] + BEGIN:  # a stub in a student edition
            i += 1
            continue
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() in (BEGIN, END)), None)
        if end is None or lines[end].strip() != END:
            raise ValueError(f"{where}:{i + 2}: region of {ex} nested or never closed")
        regions.append(Region(ex, points, m["task"].strip(), m["indent"], i, i + 1, end))
        i = end + 1
    return regions


KERNEL_DECORATOR = re.compile(r"^\s*@(?:triton\.)?jit\b")  # a Triton kernel's (`@triton.jit`, `@triton.jit(...)`)
# a stub as the release writes it (either kind); groups "text": "chNN_exK: task", "id": chNN_exK
STUB = re.compile(r"(?:raise NotImplementedError|tl\.static_assert)\((?:False, )?(?P<q>[\"'])"
                  r"(?P<text>(?P<id>ch\d\d_ex\d+): .*?)(?P=q)\)")


def in_triton_kernel(lines: list[str], i: int) -> bool:
    """Whether line `i` of `lines` (a cell's or a module's source) is in the body of a function
    decorated `@triton.jit`: the nearest `def` above it at a smaller indentation, and its decorators."""
    indent = len(lines[i]) - len(lines[i].lstrip())
    for j in range(i - 1, -1, -1):
        line = lines[j]
        if line.strip() and len(line) - len(line.lstrip()) < indent and line.lstrip().startswith(("def ", "async def ")):
            k = j - 1
            while k >= 0 and lines[k].lstrip().startswith("@"):
                if KERNEL_DECORATOR.match(lines[k]):
                    return True
                k -= 1
            return False
    return False


def stub_line(region: Region, kernel: bool = False) -> str:
    """What a region becomes in a student edition: one `raise` naming the exercise and its task; in a
    Triton kernel (`kernel`), whose compiler refuses `raise` ("unsupported AST node type: Raise"), a
    `tl.static_assert(False, ...)` that stops the compilation (and the interpreter) with the same words."""
    task = f"{region.id}: {region.task}"
    return f"{region.indent}{kernel_stub(task) if kernel else f'raise NotImplementedError({task!r})'}"


KERNEL_STUB_NOTE = "  # not implemented: a kernel cannot `raise`"
KERNEL_STUB = re.compile(r"tl\.static_assert\(False, (?P<q>[\"'])(?P<text>.*?)(?P=q)\)" + re.escape(KERNEL_STUB_NOTE))


def kernel_stub(text: str) -> str:
    """A stub's statement in a Triton kernel (`scripts/release.py`, `scripts/make_exercises.py`):
    compiling the kernel stops at it with `text` (a `CompileTimeAssertionFailure`), and so does Triton's
    interpreter (an `AssertionError`); a grading run reports either as `NotImplementedError: text`."""
    return f"tl.static_assert(False, {text!r}){KERNEL_STUB_NOTE}"


# --- the pytest plugin (loaded in the grading run with `-p minivllm.course.grade`) ----------------------
_outcomes: dict[str, dict] = {}
TEST_TIMEOUT_S = int(os.environ.get("MINIVLLM_GRADE_TEST_TIMEOUT_S", "600"))  # one test's limit in a grading
# run, seconds: an endless loop fails its own test, not the whole run


def _save_outcomes() -> None:
    path = os.environ.get(RESULTS_ENV)
    if path:
        Path(path).write_text(json.dumps(_outcomes, indent=1))


NOT_RUN = ("did not run: the grading run stopped before this test finished (the process crashed or exited, "
           "or the run's time limit passed; an endless loop or a memory blow-up in the code under grading?)")


# what a grading process killed by a signal most likely met (the pytest subprocess' exit status is -signal);
# short, so that the score table's line (150 characters) keeps the hint
CRASH_HINTS = {
    "SIGSEGV": "a segmentation fault (memory out of bounds: in a Triton kernel, check the masks of its loads and stores)",
    "SIGBUS": "a bus error (memory out of bounds: in a Triton kernel, check the masks of its loads and stores)",
    "SIGABRT": "aborted, often on a heap corrupted by a write out of bounds (a Triton kernel: check its stores' masks)",
    "SIGKILL": "killed, most often for running out of memory (a memory blow-up?)",
    "SIGFPE": "an arithmetic fault in native code (an integer division by zero?)",
}


def crash_message(returncode: int) -> str | None:
    """What a grading process' exit status says when a signal ended it (`returncode` < 0), as
    `"SIGSEGV (signal 11), a segmentation fault (…check the masks…)"`; None for an ordinary exit."""
    if returncode >= 0:
        return None
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "a signal"
    return f"{name} (signal {-returncode}), {CRASH_HINTS.get(name, 'a crash in native code')}"


def _crashed(outcomes: dict[str, dict], crash: str) -> None:
    """Rewrite the "did not run" messages of a run that `crash` ended: the test that was running when the
    process died (`started`) says it crashed there, the ones after it that they never ran because of it."""
    notrun = [n for n, o in outcomes.items() if _not_run(o)]
    running = next((n for n in notrun if outcomes[n].get("started")), None)
    for n in notrun:
        if n == running:
            outcomes[n]["message"] = f"crashed in this test: {crash}"
        else:
            where = f", in {running.split('::')[-1]}" if running else ""
            outcomes[n]["message"] = f"did not run: the process crashed earlier{where}: {crash}"


def pytest_deselected(items):
    """Tests that `-m` left out of the run are not in it: without this their records would stay "not
    run", and a run that passed every selected test would read as one that stopped early."""
    for item in items:
        _outcomes.pop(item.nodeid, None)


def pytest_collection_modifyitems(session, config, items):
    """Every collected test starts as not run (it scores nothing unless its report says it passed); a
    test marked with a part its exercise does not have fails at once, naming the parts there are."""
    for item in items:
        marks = sorted({m.name for m in item.iter_markers() if m.name in EXERCISES})
        group = item.get_closest_marker("group")
        rec = {"exercises": marks, "group": group.args[0] if group else None, "outcome": "notrun",
               "message": NOT_RUN, "details": ""}
        if item.get_closest_marker("gpu") is not None and not _has_cuda():
            rec["gpu_absent"] = True  # it would skip: should the run stop before it, it leaves the maximum
        unknown = [e for e in marks if rec["group"] is not None and rec["group"] not in dict(EXERCISES[e].groups)]
        if unknown:
            parts = "; ".join(f"{e}: {', '.join(repr(g) for g, _ in EXERCISES[e].groups) or 'none'}" for e in unknown)
            rec.update(outcome="failed", message=f"this test is marked with part {rec['group']!r}, which "
                       f"{', '.join(unknown)} does not have (its parts: {parts})")
        _outcomes[item.nodeid] = rec


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - the graders need torch
        return False
    return torch.cuda.is_available()


def pytest_runtest_logstart(nodeid, location):
    """Mark the test as started (saved at once): if the process dies in it, the report can name it."""
    rec = _outcomes.get(nodeid)
    if rec is not None and rec["outcome"] == "notrun":
        rec["started"] = True
        _save_outcomes()


class GradeTimeout(BaseException):
    """A test of a grading run ran past `TEST_TIMEOUT_S` (a BaseException: hypothesis does not retry
    it as a failing example, and an answer's `except Exception` does not swallow it)."""


def _alarm(signum, frame):
    raise GradeTimeout(f"this test ran past {TEST_TIMEOUT_S} s and was stopped (an endless loop?)")


class StubReached(BaseException):
    """A stub's `NotImplementedError` inside a hypothesis test of a grading run, carried out of hypothesis (a
    BaseException: hypothesis neither shrinks nor retries it; every example would fail the same way, and
    shrinking took seconds per test), then raised again as it was (`pytest_runtest_call`)."""

    def __init__(self, error: NotImplementedError):
        super().__init__(str(error))
        self.error = error


def _stop_at_stubs(test):
    """`test` (a hypothesis test's inner function), raising `StubReached` for an untouched stub's error."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        try:
            return test(*args, **kwargs)
        except NotImplementedError as e:
            if _root and str(e) in _edition_stubs(_root[0])[0]:
                raise StubReached(e) from None
            raise
    return run


def pytest_runtest_call(item):
    """Each test of a grading run stops after `TEST_TIMEOUT_S` (SIGALRM, where the platform has it), and a
    hypothesis test stops at its first example that reaches an untouched stub (`StubReached`)."""
    grading = bool(os.environ.get(RESULTS_ENV))
    timed = grading and hasattr(signal, "SIGALRM")
    given = getattr(getattr(item, "obj", None), "hypothesis", None) if grading else None
    if given is not None:  # hypothesis lets a runner wrap the inner test (`.hypothesis.inner_test`)
        inner = given.inner_test
        given.inner_test = _stop_at_stubs(inner)
    if timed:
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, TEST_TIMEOUT_S, 5.0)  # then every 5 s, should the first be caught
    try:
        return (yield)
    except StubReached as e:
        raise e.error from None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        if given is not None:
            given.inner_test = inner


if _pytest is not None:  # a hook wrapper around each test's call (grading runs need pytest anyway)
    pytest_runtest_call = _pytest.hookimpl(wrapper=True)(pytest_runtest_call)


def _framework_dirs() -> tuple[str, ...]:
    """The folders of pytest's, pluggy's and hypothesis' own code (frames there only pass a skip on)."""
    import importlib.util

    dirs = []
    for name in ("_pytest", "pytest", "pluggy", "hypothesis"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            dirs.append(os.path.dirname(spec.origin) + os.sep)
    return tuple(dirs)


def _skip_by_code_under_grading(item, excinfo) -> str | None:
    """Where a test's skip or xfail came from, if not from a grader: the innermost frame of the
    exception's traceback outside pytest's, pluggy's and hypothesis' code (the code that called
    `pytest.skip` or `pytest.xfail`, or raised their exceptions itself, an `exec`'s `<string>` too),
    unless it lies in `tests/` or in the folder of the test's own file (a private grader's). None for
    any other outcome, and for a skip with no such frame (a `skipif` mark's)."""
    if excinfo is None or not excinfo.errisinstance((_pytest.skip.Exception, _pytest.xfail.Exception)):
        return None
    frames, tb = [], excinfo.tb
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    framework = _framework_dirs()
    where = next((f for f in reversed(frames) if not f.startswith(framework)), None)
    if where is None:
        return None
    graders = [Path(str(item.path)).resolve().parent, *([_root[0] / "tests"] if _root else [])]
    try:
        path = Path(where).resolve()
    except (OSError, ValueError):
        return where
    return None if any(path.is_relative_to(g) for g in graders) else where


def pytest_runtest_makereport(item, call):
    """A skip or an xfail that the code under grading asked for fails its test: only its graders may
    skip one (a missing GPU, say), and an answer that skipped the cases it gets wrong would otherwise
    keep the points of the tests it passes."""
    outcome = yield
    where = _skip_by_code_under_grading(item, call.excinfo)
    if where is not None:
        report = outcome.get_result()
        kind = "pytest.xfail" if call.excinfo.errisinstance(_pytest.xfail.Exception) else "pytest.skip"
        report.outcome = "failed"
        report.longrepr = (f"{kind} from the code under grading ({where}): {call.excinfo.value}; "
                           "only the graders may skip a test, and a skipped test scores nothing")
        if hasattr(report, "wasxfail"):
            del report.wasxfail


if _pytest is not None:  # the outermost wrapper: it sees the report after pytest's own xfail handling
    pytest_runtest_makereport = _pytest.hookimpl(hookwrapper=True, tryfirst=True)(pytest_runtest_makereport)


_root: list[Path] = []  # the grading run's root folder
RAISED_STUB = re.compile(r"raise NotImplementedError\((?P<text>(?P<q>[\"'])(?:\\.|(?!(?P=q)).)*(?P=q))\)")


@functools.cache
def _edition_stubs(root: Path) -> tuple[frozenset[str], tuple[str, ...]]:
    """The stubs in the code at `root` (its package and exercises/, read once): the messages of its
    `raise NotImplementedError("...")` lines (`stub_line`'s, and the exercises' TODOs), and the texts of
    its Triton kernels' stubs (`kernel_stub`)."""
    texts = [f.read_text(errors="replace") for f in [*(root / "minivllm").rglob("*.py"), *(root / "exercises").glob("*.py")]]
    raised = frozenset(ast.literal_eval(m["text"]) for t in texts for m in RAISED_STUB.finditer(t))
    return raised, tuple(m["text"] for t in texts for m in KERNEL_STUB.finditer(t))


def _as_kernel_stub(message: str) -> str:
    """A failure at a Triton kernel's stub (`kernel_stub`: the compiler's or the interpreter's
    error, which names the stub's text) reported as the `NotImplementedError` a stub means elsewhere."""
    if not _root or message.startswith("NotImplementedError"):
        return message
    text = next((t for t in _edition_stubs(_root[0])[1] if t in message), None)
    if text is None:
        return message
    return f"NotImplementedError: {text} (a Triton kernel's stub: {message.splitlines()[0][:100]})\n{message}"


def pytest_configure(config):
    _root[:] = [Path(str(config.rootpath)).resolve()]


def pytest_runtest_logreport(report):
    rec = _outcomes.get(report.nodeid)
    if rec is None or rec["outcome"] == "failed":
        return
    if report.passed and report.when == "call" and rec["outcome"] == "notrun":
        rec.update(outcome="passed", message="")
        ratio = dict(report.user_properties).get(SPEED_RATIO)
        if ratio is not None:
            rec["speed_ratio"] = float(ratio)
    elif report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = _as_kernel_stub(crash.message if crash else str(report.longrepr))
        rec.update(outcome="failed", message=message[:MESSAGE_CHARS], details=report.longreprtext[-MESSAGE_CHARS:])
    elif report.skipped and rec["outcome"] in ("passed", "notrun"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3 else ""
        rec.update(outcome="skipped", message="", skip_reason=str(reason).removeprefix("Skipped: ")[:200])
    _save_outcomes()  # after every test: a run stopped later keeps what it had


def pytest_sessionfinish(session, exitstatus):
    _save_outcomes()


# --- running the graders -----------------------------------------------------------------------
def _tree_hash(root: Path, folder: str, pattern: str) -> str:
    h = hashlib.sha256()
    for f in sorted((root / folder).rglob(pattern)):
        if "__pycache__" not in f.parts and ".ipynb_checkpoints" not in f.parts:
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def edition_hashes(root: Path) -> dict[str, str]:
    """Hashes of an edition's package and chapters (recorded at release, compared when grading)."""
    return {"package_sha256": _tree_hash(root, "minivllm", "*.py"),
            "notebooks_sha256": _tree_hash(root, "notebooks", "*.ipynb")}


def sync_package(root: Path) -> str:
    """In a student edition, re-export `minivllm/` from the chapters if they changed since the last export
    (the release's, or a later one); after an export the edition's record holds the new hashes (the next edit of a
    chapter is compared with them).

    Returns a line saying what was done.
    Raises:
        RuntimeError: both the chapters and the package were edited and they disagree (the package
            is generated from the chapters: work in the notebooks, or grade with `export=False`).
    """
    edition = json.loads((root / EDITION_FILE).read_text())
    now = edition_hashes(root)
    if now["notebooks_sha256"] == edition["notebooks_sha256"]:
        if now["package_sha256"] != edition["package_sha256"]:
            return ("chapters unchanged since the last export: grading minivllm/ as it is, with the edits made in it "
                    "directly (the notebooks are the source: once a chapter changes, minivllm/ must be what it "
                    "exports, so put your work in the notebook)")
        return "chapters unchanged since the last export: grading minivllm/ as it is"
    export = [sys.executable, str(root / "scripts" / "export.py")]
    if now["package_sha256"] != edition["package_sha256"]:
        if subprocess.run(export + ["--check"], cwd=root, capture_output=True).returncode == 0:
            _record_hashes(root, edition)
            return "minivllm/ is up to date with the chapters"
        raise RuntimeError("both notebooks/ and minivllm/ were edited since the last export, and minivllm/ is not what "
                           "the notebooks export. minivllm/ is generated from the chapters: put your work in the "
                           "notebook (then grade again), or grade minivllm/ as it is with --no-export (its files "
                           "are overwritten by the next export).")
    r = subprocess.run(export, cwd=root, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"exporting the chapters failed:\n{r.stdout}{r.stderr}")
    _record_hashes(root, edition)
    return ("re-exported minivllm/ from the chapters (the notebooks are the source; minivllm/ had no edits of "
            "its own since the last export, so none were replaced)")


def _record_hashes(root: Path, edition: dict) -> None:
    """The package now is what the chapters export: remember both, as the release did."""
    (root / EDITION_FILE).write_text(json.dumps({**edition, **edition_hashes(root)}, indent=1) + "\n")


def find_root(start: str | Path = ".") -> Path:
    """The edition holding `start`: the nearest folder, upwards, with `minivllm/` and `tests/` (a
    chapter runs in `notebooks/`, so its grader cells find the root above it)."""
    here = Path(start).resolve()
    for folder in (here, *here.parents):
        if (folder / "minivllm").is_dir() and (folder / "tests").is_dir():
            return folder
    raise ValueError(f"no minivllm edition (a folder with minivllm/ and tests/) at or above {here}")


def in_a_kernel() -> bool:
    """Whether this process is a Jupyter kernel running a chapter (an IPython shell with a kernel), not
    only one that imported ipykernel (jupyter_client does, to find the python3 kernel's spec)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


def grade(ids: list[str] | str | None = None, root: str | Path | None = None, *, json_path: str | Path | None = None,
          junit_path: str | Path | None = None, private_tests: str | Path | None = None,
          export: bool | None = None, verbose: bool = True, timeout_s: float = GRADE_TIMEOUT_S) -> dict:
    """Run the graders of `ids` (exercise or chapter ids; default: the edition's exercises, or all) in
    the edition at `root` (default: `find_root()`); return the report and write it as JSON and/or JUnit XML.

    Args:
        export: re-export the package from the chapters first (None: where `root` is a student
            edition and its chapters changed, see `sync_package`).
        private_tests: a folder of extra test files (marked with the exercises' markers) kept
            outside the release; they count towards the same exercises.
        verbose: print pytest's report of the failures and a score table.
        timeout_s: each run's limit (an endless loop scores nothing, with an error saying so).
    The graders run in one pytest subprocess per chapter and kind (rebuild, extend): in an edition,
    the released regions a run does not grade are then the graders' stand-ins (`tests/stand_ins.py`),
    so an exercise scores by its own code alone, whatever else the edition released.
    In the book (not an edition), a chapter executed by the test suite (nbmake) does not run the
    graders again: the suite runs them itself; the report then says `"skipped"`.
    Returns:
        `{"root", "exercises": {id: {"points", "max_points", "passed", "tests", "failed": [...]}},
        "total", "max_total"}`.
    Raises:
        ValueError: an unknown id, or a `root`/`private_tests` folder that does not exist.
    """
    root = find_root() if root is None else Path(root).resolve()
    if not (root / "minivllm").is_dir():
        raise ValueError(f"{root} is not a minivllm edition (no minivllm/ folder)")
    edition = json.loads((root / EDITION_FILE).read_text()) if (root / EDITION_FILE).exists() else None
    if isinstance(ids, str):
        ids = [ids]
    wanted = resolve(ids or (edition["exercises"] if edition else None))
    unassigned = [e for e in wanted if edition and e not in edition["exercises"]]
    if unassigned and verbose:  # e.g. a chapter's grader cell of an exercise this edition did not release
        print(f"{', '.join(unassigned)}: not in this edition's assignment ({EDITION_FILE} lists "
              f"{', '.join(edition['exercises'])}); graded anyway")
    if edition is None and in_a_kernel() and os.environ.get("PYTEST_CURRENT_TEST"):
        # a chapter of the book executed by the test suite (nbmake): the suite runs these graders itself
        if verbose:
            print(f"{', '.join(wanted)}: not run here (this chapter runs inside the test suite, which runs the "
                  "same graders in tests/); run the cell in Jupyter to grade")
        return {"root": str(root), "skipped": "inside the test suite", "exercises": {}, "total": 0,
                "max_total": sum(EXERCISES[e].points for e in wanted)}
    note = ""
    if edition and export is not False:
        note = sync_package(root)
    elif export:
        subprocess.run([sys.executable, str(root / "scripts" / "export.py")], cwd=root, check=True, capture_output=True)
    if private_tests is not None:
        private_tests = Path(private_tests).resolve()
        if not private_tests.is_dir():
            raise ValueError(f"private tests folder {private_tests} does not exist")
    # an edition grades the student's exercises/, whatever else its folder holds
    impl = "solutions" if edition is None and (root / "solutions").is_dir() else "exercises"
    outcomes, logs, stopped = {}, [], []
    for group in dict.fromkeys((e[:4], EXERCISES[e].kind) for e in wanted):  # see tests/stand_ins.py
        ids_here = [e for e in wanted if (e[:4], EXERCISES[e].kind) == group]
        files = sorted({t for e in ids_here for t in EXERCISES[e].tests if (root / t).exists()})
        r, found = _run_graders(root, ids_here, files + ([str(private_tests)] if private_tests else []), impl,
                                timeout_s)
        crash = crash_message(r.returncode)
        if crash:
            _crashed(found, crash)
        outcomes.update({n: o for n, o in found.items() if set(o["exercises"]) & set(ids_here)})
        if r.returncode or not found:
            logs.append(r)
        if r.returncode not in (0, 1, 5) or any(_not_run(o) for o in found.values()):
            stopped.append(f"the grading run of {', '.join(ids_here)} stopped before it finished (exit status "
                           f"{r.returncode}{': it crashed, ' + crash if crash else ''}): the tests it did not finish score nothing")
    report = {"root": str(root), "impl": impl, "exercises": {}, "total": 0, "max_total": 0}
    borrowed = graders_code_used(root) if edition else []  # in the book, tests/ may be imported at will
    if borrowed:
        report["graders_code_used"] = borrowed
    for ex in wanted:
        tests = {n: o for n, o in outcomes.items() if ex in o["exercises"]}
        failed = [{"test": n, "message": o["message"], "details": o["details"]}
                  for n, o in tests.items() if o["outcome"] == "failed" or _not_run(o)]
        if borrowed:
            failed.insert(0, {"test": "(the code under grading)", "details": "\n".join(borrowed),
                              "message": f"{ex}: not graded: the code uses the graders' own code from tests/ or "
                                         f"reads their running state (their stand-ins, frames and expected values "
                                         f"are not your answer): {borrowed[0]}"})
        passed = bool(tests) and not failed and any(o["outcome"] == "passed" for o in tests.values())
        pts = EXERCISES[ex].points
        entry = {"title": EXERCISES[ex].title, "points": pts if passed else 0, "max_points": pts,
                 "passed": passed, "tests": len(tests), "failed": failed}
        if EXERCISES[ex].groups:
            entry["groups"] = score_groups(EXERCISES[ex], tests, bool(borrowed))
            entry["points"] = sum(g["points"] for g in entry["groups"].values())
            entry["max_points"] = pts = sum(g["max_points"] for g in entry["groups"].values())
            entry["passed"] = entry["points"] == pts
        report["exercises"][ex] = entry
        report["total"] += entry["points"]
        report["max_total"] += pts
    if not outcomes:  # pytest could not collect or start: say why
        report["error"] = "".join(r.stdout + r.stderr for r in logs)[-MESSAGE_CHARS:]
    elif stopped:
        report["error"] = "; ".join(stopped)
    if verbose:
        if note:
            print(note)
        for r in logs:
            print(r.stdout[-20000:] + r.stderr[-4000:])
        print(format_report(report))
        stubs = [ex for ex, r in report["exercises"].items()
                 if any(f"NotImplementedError: {ex}: " in f["message"] for f in r["failed"])]
        if stubs and note.startswith("chapters unchanged"):
            print(f"{', '.join(stubs)}: still a stub, and no chapter changed since the last export: "
                  "if you filled it in, save the notebook (the grader reads the saved file) and grade again")
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    if junit_path:
        write_junit(report, junit_path)
    return report


def summarize(message: str, limit: int = SUMMARY_CHARS) -> str:
    """A failure's message on one line of the score table: its first line, whole if it has at most `limit`
    characters; else its start and its end, cut between words and joined by " ... " (a grader's message
    names the case first and ends with what was expected and what came, the part a student needs)."""
    line = message.splitlines()[0] if message else ""
    if len(line) <= limit:
        return line
    head, tail = line[:limit // 2], line[len(line) - (limit - limit // 2 - 5):]
    head = head[:head.rfind(" ")] if " " in head else head
    tail = tail[tail.find(" ") + 1:] if " " in tail else tail
    return f"{head} ... {tail}"


def speed_points(bands: tuple[tuple[float, int], ...], ratio: float) -> int:
    """The points of the first band `(max_ratio, points)` whose `max_ratio` is at least `ratio`
    (the student's time over the reference's), 0 past the last band."""
    return next((pts for max_ratio, pts in bands if ratio <= max_ratio), 0)


def _not_run(outcome: dict) -> bool:
    """A test the run did not finish, except one that needs a GPU where there is none (it would skip)."""
    return outcome["outcome"] == "notrun" and not outcome.get("gpu_absent")


def score_groups(ex: Exercise, tests: dict[str, dict], borrowed: bool) -> dict[str, dict]:
    """Partial credit: each of `ex.groups` scores its points when its tests (`tests`: outcomes by test
    id, each with its `group`) ran, at least one passed, and none failed, and no test of `ex` outside
    every group failed (nothing scores where the code uses the graders' own code: `borrowed`); a speed
    group (`ex.speed`) scores by the band of the worst ratio its tests recorded, and one whose tests
    all skipped is not graded (`max_points` 0, the skip's reason in `message`), as is one whose tests
    need a GPU where there is none and did not run because the run stopped first (`gpu_absent`).
    Returns `{name: {"points", "max_points", "passed", "tests", "message"}}` (`message`: the first
    failure's, or the speed measured), with `"speed_ratio"` for a graded speed group."""
    names, bands = {g for g, _ in ex.groups}, dict(ex.speed)
    gate = [o for o in tests.values() if o.get("group") not in names and (o["outcome"] == "failed" or _not_run(o))]
    out = {}
    for name, pts in ex.groups:
        mine = [o for o in tests.values() if o.get("group") == name]
        bad = [o for o in mine if o["outcome"] == "failed" or _not_run(o)] + gate
        ok = not borrowed and bool(mine) and not bad and any(o["outcome"] == "passed" for o in mine)
        message = summarize(bad[0]["message"]) if bad and bad[0]["message"] else \
            ("" if mine else "no test of this group ran")
        entry = out[name] = {"points": pts if ok else 0, "max_points": pts, "passed": ok, "tests": len(mine),
                             "message": message}
        if name not in bands:
            continue
        if mine and not bad and all(o["outcome"] == "skipped" or o.get("gpu_absent") for o in mine):
            why = next((o.get("skip_reason") for o in mine if o.get("skip_reason")),
                       "needs a CUDA GPU" if any(o.get("gpu_absent") for o in mine) else "its tests skipped")
            entry.update(max_points=0, passed=True, message=f"not graded here ({why}): {pts} points where it can run")
        elif ok:
            ratios = [o["speed_ratio"] for o in mine if o.get("speed_ratio") is not None]
            if not ratios:
                entry.update(points=0, passed=False, message="no speed was recorded (a grader without record_property?)")
                continue
            ratio = max(ratios)
            got = speed_points(bands[name], ratio)
            entry.update(points=got, passed=got == pts, speed_ratio=round(ratio, 3), message=(
                f"{ratio:.2f}x the reference's time; bands: "
                + ", ".join(f"<= {r:g}x {p}" for r, p in bands[name]) + ", slower 0"))
    return out


GRADER_NAMES = re.compile(r"\b(_grader\w*|_Grader\w*|_Scaffold|STAND_INS)\b")


def graders_code_used(root: Path) -> list[str]:
    """Places where the code under grading (the package but this module, and `exercises/`) imports a
    module of `tests/`, names a grader module or reaches into `sys.modules` (where a grader module is
    found at run time), uses a grader's stand-in by name, or reads the running code's frames, closures
    or objects (`sys._getframe`, `f_locals`, `tb_frame`, `__closure__`, `gc.get_objects`, ...: where a
    grader's expected value, its reference or a stand-in held by a tripwire would be found): the graders'
    code is working answers written for the graders, not answers of the student's. Returns
    `path:line: text` for each."""
    modules = "|".join(sorted(re.escape(p.stem) for p in (root / "tests").glob("*.py")))
    importing = re.compile(rf"\b({modules})\b") if modules else None
    reaching = re.compile(r"\bsys\.modules\b|\btest_grading\w*"  # a grader module found at run time
                          r"|\b_getframe\b|\bf_(locals|globals|back)\b|\b(tb|gi|cr|ag)_frame\b|\b__closure__\b"
                          r"|\bcell_contents\b|\bget_(objects|referrers|referents)\b|\bcurrentframe\b"
                          r"|\binspect\.(stack|trace|getouterframes|getinnerframes|getclosurevars)\b")  # a grader's state
    found = []
    files = [*(root / "minivllm").rglob("*.py"), *(root / "exercises").glob("*.py")]
    for f in sorted(files):
        if f == root / "minivllm" / "course" / "grade.py":  # this module names them to find them
            continue
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if GRADER_NAMES.search(line) or reaching.search(line) or ("import" in line and importing and importing.search(line)):
                found.append(f"{f.relative_to(root)}:{i}: {line.strip()[:120]}")
    return found


def _run_graders(root: Path, ids: list[str], files: list[str], impl: str, timeout_s: float):
    """One pytest run of the graders of `ids` in `files`; returns (the finished process, outcomes by test)."""
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.json"
        env = {**os.environ, RESULTS_ENV: str(results), "PYTHONPATH": os.pathsep.join(
            [str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")])}
        # nbmake: not needed to run test files, and its import took a second and a half of each run's start
        cmd = [sys.executable, "-m", "pytest", "-p", "minivllm.course.grade", "-p", "no:cacheprovider", "-p", "no:nbmake", "-q",
               "--tb=short", "-m", " or ".join(ids), f"--impl={impl}", "--rootdir", str(root), *files]
        try:
            r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            out = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
            r = subprocess.CompletedProcess(cmd, 1, out(e.stdout), out(e.stderr) + f"\ngrading stopped after "
                                            f"{timeout_s:.0f} s (an endless loop?)")
        return r, (json.loads(results.read_text()) if results.exists() else {})


def format_report(report: dict) -> str:
    """The score table, one line per exercise."""
    lines = []
    for ex, r in report["exercises"].items():
        status = "PASS" if r["passed"] else ("PART" if r["points"] else "FAIL") if r["tests"] else "NO TESTS RAN"
        why = f" — {summarize(r['failed'][0]['message'])}" if r["failed"] and r["failed"][0]["message"] else ""
        lines.append(f"{ex} {status:>4} {r['points']:>2}/{r['max_points']:<2} {r['title']}"
                     + ("" if r.get("groups") else why))
        for name, g in r.get("groups", {}).items():
            lines.append(f"    {'ok' if g['passed'] else '--'} {g['points']:>2}/{g['max_points']:<2} {name}"
                         + (f" — {g['message']}" if g["message"] else ""))
    lines.append(f"total: {report['total']}/{report['max_total']} points")
    return "\n".join(lines)


def write_junit(report: dict, path: str | Path) -> None:
    """JUnit XML: one testcase per exercise (its points as properties), failures with their messages."""
    failures = sum(not r["passed"] for r in report["exercises"].values())
    suite = ET.Element("testsuite", name="minivllm grade", tests=str(len(report["exercises"])), failures=str(failures))
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="total", value=str(report["total"]))
    ET.SubElement(props, "property", name="max_total", value=str(report["max_total"]))
    for ex, r in report["exercises"].items():
        case = ET.SubElement(suite, "testcase", classname="minivllm.course.grade", name=ex)
        cprops = ET.SubElement(case, "properties")
        ET.SubElement(cprops, "property", name="points", value=str(r["points"]))
        ET.SubElement(cprops, "property", name="max_points", value=str(r["max_points"]))
        for name, g in r.get("groups", {}).items():
            ET.SubElement(cprops, "property", name=f"group: {name}", value=f"{g['points']}/{g['max_points']}")
        if not r["passed"]:
            first = r["failed"][0] if r["failed"] else {"message": "no test ran", "details": ""}
            fail = ET.SubElement(case, "failure", message=first["message"][:500])
            fail.text = "\n\n".join(f"{f['test']}\n{f['details']}" for f in r["failed"]) or first["message"]
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


CLEAN_COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", ".ipynb_checkpoints",
                                           "solutions", "*.egg-info", ".hypothesis")


def student_files(ids: list[str]) -> list[str]:
    """The files a student's work lives in for `ids`: the chapters holding their graded regions and
    the `exercises/` files of the extend ones (paths relative to an edition's root)."""
    return sorted({EXERCISES[e].where for e in ids})


def clean_base(base: Path, ids: list[str], out: Path) -> Path:
    """The copy of `base` that class grading copies each submission into, at `out`: of an edition, the
    edition (its tracked tools, no `.git`, `.venv` or `solutions/`); of the book, a release of `ids`
    (`scripts/release.py`), so that the copy a submission is graded beside holds stubs where the
    answers it is graded on would be. Returns `out`.
    Raises:
        RuntimeError: the release failed (its output in the message)."""
    if (base / EDITION_FILE).exists():
        shutil.copytree(base, out, ignore=CLEAN_COPY_IGNORE, symlinks=True)
        return out
    r = subprocess.run([sys.executable, str(base / "scripts" / "release.py"), *ids, "--out", str(out)], cwd=base,
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"releasing {', '.join(ids)} from the book for grading failed:\n{(r.stdout + r.stderr)[-2000:]}")
    return out


def grade_class(submissions: str | Path, csv_path: str | Path, ids: list[str] | None = None,
                private_tests: str | Path | None = None, tests_from: str | Path | None = None,
                reports: str | Path | None = None, verbose: bool = True) -> list[dict]:
    """Grade every subfolder of `submissions` (one student edition each) into one CSV: a row per
    subfolder with its points per exercise (and per part, `chNN_exK: part`, for an exercise graded in
    parts) and the total (a folder that cannot be graded gets an `error` column).

    Each submission is graded in a fresh copy of the instructor's edition (`tests_from`: the edition,
    or the book, the command runs from; of the book, a release of `ids`: `clean_base`), into which only
    the student's work is copied: the chapters
    holding the graded regions of `ids` and the `exercises/` files of its extend exercises
    (`student_files`). The package is exported from those chapters. Nothing else a submission holds
    counts: not its `tests/`, conftest or pytest files, `scripts/`, `EDITION.json`, nor a
    hand-edited `minivllm/`; the submission's folder is not changed.

    Args:
        ids: the exercises (default: those of `tests_from`'s `EDITION.json`, or all).
        reports: a folder for each submission's report (`NAME.json`, `NAME.xml`), with the failures.
    Raises:
        ValueError: `submissions` or `tests_from` is not a folder, or `submissions` has no subfolder.
        RuntimeError: `tests_from` is the book and releasing `ids` from it failed.
    The student's code still runs in the grading process and can tamper with it: grade a class in a
    sandbox or container, and read the code of a surprising score.
    """
    submissions, base = Path(submissions), find_root() if tests_from is None else Path(tests_from).resolve()
    if not submissions.is_dir():
        raise ValueError(f"submissions folder {submissions} does not exist")
    if not (base / "minivllm").is_dir() or not (base / "tests").is_dir() or not (base / "notebooks").is_dir():
        raise ValueError(f"{base} is not a minivllm edition (it needs minivllm/, notebooks/ and tests/)")
    folders = sorted(p for p in submissions.iterdir() if p.is_dir())
    if not folders:
        raise ValueError(f"{submissions} has no submission folder (one edition per subfolder)")
    edition = json.loads((base / EDITION_FILE).read_text()) if (base / EDITION_FILE).exists() else None
    wanted = resolve(ids or (edition["exercises"] if edition else None))
    if reports is not None:
        Path(reports).mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        clean = clean_base(base, wanted, Path(tmp) / "base")
        edition = json.loads((clean / EDITION_FILE).read_text())
        for folder in folders:
            row: dict = {"submission": folder.name}
            work = Path(tmp) / "work"
            try:
                shutil.rmtree(work, ignore_errors=True)
                shutil.copytree(clean, work, symlinks=True)
                missing = [f for f in student_files(wanted) if not (folder / f).is_file()]
                if missing:
                    raise ValueError(f"missing {', '.join(missing)}")
                for f in student_files(wanted):
                    shutil.copyfile(folder / f, work / f)
                r = subprocess.run([sys.executable, str(work / "scripts" / "export.py")], cwd=work,
                                   capture_output=True, text=True)
                if r.returncode:
                    raise RuntimeError(f"exporting the chapters failed: {(r.stdout + r.stderr)[-300:]}")
                released = [*dict.fromkeys([*(edition["exercises"] if edition else []), *wanted])]
                (work / EDITION_FILE).write_text(json.dumps({"exercises": released, **edition_hashes(work)}) + "\n")
                out = {} if reports is None else dict(json_path=Path(reports) / f"{folder.name}.json",
                                                      junit_path=Path(reports) / f"{folder.name}.xml")
                rep = grade(wanted, work, private_tests=private_tests, export=False, verbose=False, **out)
                row.update({ex: r["points"] for ex, r in rep["exercises"].items()})
                row.update({f"{ex}: {name}": g["points"] for ex, r in rep["exercises"].items()
                            for name, g in r.get("groups", {}).items()})
                row.update(total=rep["total"], max_total=rep["max_total"], error=rep.get("error", "")[:200])
                if rep.get("graders_code_used"):
                    row["error"] = f"uses the graders' code: {rep['graders_code_used'][0]}"[:300]
            except (ValueError, RuntimeError, OSError, json.JSONDecodeError) as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            if verbose:
                print(f"{folder.name}: {row.get('total', '-')}/{row.get('max_total', '-')} {row.get('error', '')}".rstrip())
    columns = ["submission", *[c for ex in wanted for c in [ex, *(f"{ex}: {g}" for g, _ in EXERCISES[ex].groups)]],
               "total", "max_total", "error"]
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minivllm.course.grade", description=__doc__.split("\n\n")[0])
    ap.add_argument("ids", nargs="*", help="exercise ids (ch05_ex1) or chapters (ch05); default: the edition's")
    ap.add_argument("--root", help="the edition to grade (default: the one holding the current folder)")
    ap.add_argument("--json", help="write the report as JSON here")
    ap.add_argument("--junit", help="write the report as JUnit XML here")
    ap.add_argument("--private-tests", help="a folder of extra tests, kept outside the release")
    ap.add_argument("--no-export", action="store_true", help="grade minivllm/ as it is (no export from the chapters)")
    ap.add_argument("--class", dest="submissions", help="grade each subfolder of this folder (one edition each)")
    ap.add_argument("--csv", help="with --class: the scores' CSV (default: scores.csv)")
    ap.add_argument("--tests-from", help="with --class: the instructor's edition (or the book) each submission is "
                                         "graded in (default: the one holding the current folder)")
    ap.add_argument("--reports", help="with --class: a folder for each submission's JSON and JUnit report")
    ap.add_argument("--list", action="store_true", help="list the exercises and their points")
    args = ap.parse_args(argv)
    try:
        if args.list:
            for e in EXERCISES.values():
                print(f"{e.id} {e.points:>2} points  {e.kind:<7} {e.title}  ({e.where})")
            return 0
        if not args.submissions and (args.csv or args.tests_from or args.reports):
            raise ValueError("--csv, --tests-from and --reports go with --class SUBMISSIONS")
        if args.submissions:
            rows = grade_class(args.submissions, args.csv or "scores.csv", args.ids, args.private_tests,
                               args.tests_from, args.reports)
            errors = sum(bool(r.get("error")) for r in rows)
            print(f"{len(rows)} submissions graded into {args.csv or 'scores.csv'}"
                  + (f"; {errors} with an error (see its row)" if errors else ""))
            return 0
        rep = grade(args.ids, args.root, json_path=args.json, junit_path=args.junit,
                    private_tests=args.private_tests, export=False if args.no_export else None)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if rep["total"] == rep["max_total"] else 1


if __name__ == "__main__":
    sys.exit(main())
