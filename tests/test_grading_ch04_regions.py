"""Grading tests for chapter 04's rebuild exercises (`python -m minivllm.course.grade ch04_ex3`, or `pytest -m ch04_ex3`).

ch04_ex2 (`slot_mapping`), ch04_ex3 (the build: `Scheduler` whole, `schedule`, `schedule_prefill`
and `schedule_decode`) and ch04_ex4 (`prepare_batch`'s flat layout) are graded in the package itself:
in a student edition they are the student's code, exported from the chapter (stubs until filled),
and there is no reference to compare with. Each is graded alone: the grader's own stand-ins
(`_GraderScheduler`, `_grader_prepare_batch`, `_grader_slots`) take the place of the regions the
exercise is not about, so a filled region passes whatever state the others are in (`stand_ins`, also
usable by other graders). ch04_ex3's random workloads are derandomized (the same answer always
scores the same points). ch04_ex3 scores by parts (`@pytest.mark.group`, the groups of
`EXERCISES["ch04_ex3"]`): the student's admission with the grader's decode, the student's decode
with the grader's admission, the student's whole scheduler, and the engine on it. The tests at the
end check that plausible wrong answers lose the right part's points.

What is checked is the contract, never this chapter's code:
* the slot formula on random block tables: each slot lies in the block the table names for its
  position, at the position's offset (an off-by-one is named);
* the scheduler under random adds, steps and aborts on a paged cache small enough to preempt
  (hypothesis): a prefill batch is the head of `waiting` in order and the next head did not fit; a
  step whose head fits is a prefill; a decode batch is the oldest running sequences, exactly the
  newest are preempted and only as many as needed, back at the front of `waiting` in admission order;
  never more than `max_num_seqs` running or `max_num_batched_tokens` in a prefill; the KV-cache
  invariants after every operation; every request finishes;
* the flat batch on random sequences: every field against its definition;
* the engine with the exercise's code in place, on a cache that forces preemptions: greedy tokens
  equal transformers' (tiny float64 model), every block free at the end.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import minivllm.core.kv_cache_manager as kvm
import minivllm.worker.model_runner as mr
from engine_helpers import check_invariants, hf_greedy, make_model, one_thread, random_prompts, run_engine
from adapters import failed_checks
from minivllm.attention.backend import AttentionMetadata
from minivllm.core.block_manager import BlockManager
from minivllm.engine.llm_engine import LLMEngine
from minivllm.attention.paged_attention import PagedAttention
from minivllm.sampling_params import SamplingParams
from minivllm.core.sched.scheduler import Scheduler
from minivllm.course.grade import EXERCISES as GRADED
from minivllm.sequence import Sequence, SequenceStatus

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


@contextmanager
def your_code(ex: str, what: str):
    """Within: an error raised by the code under grading, other than a stub's NotImplementedError (its
    message names the exercise and the task) or a check's AssertionError, is re-raised as an
    AssertionError naming `ex`, `what` was running and the error (the traceback still shows where)."""
    try:
        yield
    except (NotImplementedError, AssertionError):
        raise
    except Exception as e:  # noqa: BLE001  (an error in the student's code: say whose and where)
        raise AssertionError(f"{ex}: {what} raised {type(e).__name__}: {e} (the traceback shows where)") from e


def run_graded(ex: str, engine, prompts, params):
    """`run_engine` (which checks the engine's invariants after every step) with the failures named:
    a broken invariant or an error in the code under grading becomes an AssertionError naming `ex`; a
    stub's NotImplementedError stays as it is."""
    try:
        return run_engine(engine, prompts, params)
    except NotImplementedError:
        raise
    except AssertionError as e:
        raise AssertionError(f"{ex}: with your code the engine broke an invariant of its KV cache (reference "
                             f"counts, free and used blocks; the traceback shows which): {e}") from e
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{ex}: the engine with your code raised {type(e).__name__}: {e} (the traceback "
                             "shows where)") from e


# --- the grader's stand-ins ----------------------------------------------------------------------
def _grader_slots(block_table, block_size, start, end):
    """Token t lives at offset t % block_size of block block_table[t // block_size]."""
    out = []
    for t in range(start, end):
        block, offset = divmod(t, block_size)
        out.append(block_table[block] * block_size + offset)
    return out


def _grader_prepare_batch(seqs, is_prefill, block_size, device, slots_fn=None):
    """The flat batch, built sequence by sequence as tensors; slots from `slots_fn` (default the grader's)."""
    slots_fn = slots_fn or _grader_slots
    starts = [s.num_cached_tokens if is_prefill else s.num_tokens - 1 for s in seqs]
    ids = [torch.tensor(s.token_ids[a:], dtype=torch.int64) for s, a in zip(seqs, starts)]
    n_new = torch.tensor([len(x) for x in ids], dtype=torch.int64)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), n_new.cumsum(0)])
    width = max(len(s.block_table) for s in seqs)
    tables = torch.tensor([s.block_table + [-1] * (width - len(s.block_table)) for s in seqs], dtype=torch.int64)
    md = AttentionMetadata(is_prefill, cu, torch.tensor([s.num_tokens for s in seqs], device=device),
                           torch.tensor(sum((slots_fn(s.block_table, block_size, a, s.num_tokens)
                                             for s, a in zip(seqs, starts)), []), dtype=torch.int64, device=device),
                           tables.to(device))
    positions = torch.cat([torch.arange(a, s.num_tokens) for s, a in zip(seqs, starts)])
    return torch.cat(ids).to(device), positions.to(device), md, (cu[1:] - 1).to(device)


def _student_slots_prepare_batch(seqs, is_prefill, block_size, device):
    return _grader_prepare_batch(seqs, is_prefill, block_size, device, slots_fn=kvm.slot_mapping)


class _GraderScheduler(Scheduler):
    """The grader's step, admission and decode (first come, first served; preempt the newest)."""

    def schedule(self):
        batch = self.schedule_prefill()
        return (batch, True) if batch else (self.schedule_decode(), False)

    def schedule_prefill(self):
        batch, used = [], 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            if used + head.num_tokens > self.max_num_batched_tokens or not self.block_manager.can_allocate(head):
                break
            self.block_manager.allocate(head)
            used += head.num_tokens - head.num_cached_tokens
            head.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            batch.append(head)
        return batch

    def schedule_decode(self):
        out, i = [], 0
        while i < len(self.running):
            seq = self.running[i]
            if self.block_manager.can_append(seq):
                self.block_manager.may_append(seq)
                out.append(seq)
                i += 1
            else:
                self.preempt(self.running.pop())  # the newest, possibly `seq` itself
        return out


SCHEDULER_METHODS = {"prefill": "schedule_prefill", "decode": "schedule_decode"}  # ch04_ex3's parts
EXERCISES = ("ch04_ex2", "ch04_ex3", "ch04_ex4")
ADMITS, DECODES, SURVIVES, EQUALS = (name for name, _ in GRADED["ch04_ex3"].groups)
PART_GROUP = {"prefill": ADMITS, "decode": DECODES, "whole": SURVIVES}


def graded_scheduler(ex: str | None) -> type[Scheduler]:
    """The scheduler to grade `ex` with: ch04_ex3 (or "whole") the package's (the student's) `Scheduler`;
    "prefill" or "decode" the package's method of that part and the grader's others; anything else
    (None, another exercise) all the grader's."""
    if ex in ("ch04_ex3", "whole"):
        return Scheduler
    if ex not in SCHEDULER_METHODS:
        return _GraderScheduler
    method = SCHEDULER_METHODS[ex]
    return type(f"Graded_{method}", (_GraderScheduler,), {method: Scheduler.__dict__[method]})


@contextmanager
def stand_ins(ex: str | None = None):
    """Within: the model runner lays batches out with the grader's code, except the piece `ex` grades
    (ch04_ex2: the student's `slot_mapping` inside the grader's layout; ch04_ex4: the student's
    `prepare_batch` with the grader's slots). Use `graded_scheduler(ex)` as the engine's scheduler."""
    with ExitStack() as stack:
        if ex == "ch04_ex4":
            stack.enter_context(mock.patch.object(mr, "slot_mapping", _grader_slots))
        else:
            fn = _student_slots_prepare_batch if ex == "ch04_ex2" else _grader_prepare_batch
            stack.enter_context(mock.patch.object(mr, "prepare_batch", fn))
        yield


# --- ch04_ex2: slot_mapping ----------------------------------------------------------------------
@st.composite
def _tables(draw):
    block_size = draw(st.integers(1, 8))
    table = draw(st.lists(st.integers(0, 63), min_size=1, max_size=6, unique=True))
    end = draw(st.integers(0, len(table) * block_size))
    start = draw(st.integers(0, end))
    return table, block_size, start, end


@pytest.mark.ch04
@pytest.mark.ch04_ex2
@settings(max_examples=200, deadline=None, report_multiple_bugs=False)
@given(case=_tables())
def test_ch04_ex2_slot_mapping_by_its_definition(case):
    """Random block tables (shuffled, unique ids), block sizes and ranges: slot of position t ==
    block_table[t // block_size] * block_size + t % block_size, as a list of end - start ints."""
    table, bs, start, end = case
    call = f"ch04_ex2: slot_mapping(block_table={table}, block_size={bs}, start={start}, end={end})"
    with your_code("ch04_ex2", call[10:]):
        got = kvm.slot_mapping(list(table), bs, start, end)
    _expect(isinstance(got, list) and all(isinstance(x, int) for x in got),
            f"{call} should return a list of ints, got {type(got).__name__} {got!r}"[:400])
    _expect(len(got) == end - start, f"{call} should give {end - start} slots (one per position in "
            f"[{start}, {end})), got {len(got)}: {got}")
    want = [table[t // bs] * bs + t % bs for t in range(start, end)]
    for i, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        t = start + i
        hint = ""
        if len({a - b for a, b in zip(got, want)}) == 1:
            hint = f" — every slot is off by {g - w:+d}"
        if got == [table[u // bs] * bs + u % bs for u in range(end - start)]:
            hint = " — positions counted from 0 instead of from start"
        elif got == [table[0] * bs + u for u in range(start, end)]:
            hint = (f" — the block table is ignored: slots counted on from block {table[0]} as if the blocks "
                    "were contiguous (each position must look up its own block)")
        elif got == list(range(start, end)):
            hint = " — the block table is ignored: the slot equals the position"
        _expect(False, f"{call}: position {t} lies in block_table[{t} // {bs}] = block {table[t // bs]} at offset "
                f"{t} % {bs} = {t % bs}, so in slot {table[t // bs]} * {bs} + {t % bs} = {w}; got {g}{hint}")


# --- ch04_ex3: the scheduler, built whole ----------------------------------------------------------
# (kind, a, b): add a prompt of 1 + a % 6 tokens with max_tokens b; step, sampling EOS (3) when a == 0;
# abort sequence a. Adds and steps outnumber aborts, so that several sequences run and get preempted.
OPS = st.lists(st.tuples(st.sampled_from(["add"] * 3 + ["step"] * 4 + ["abort"]), st.integers(0, 30),
                         st.integers(1, 8)), max_size=40)


def _fits(sched, seq) -> bool:
    return len(sched.running) < sched.max_num_seqs and seq.num_tokens <= sched.max_num_batched_tokens \
        and sched.block_manager.can_allocate(seq)


def _ch04_step(ex: str, sched, step: int) -> list[Sequence]:
    """One `schedule()` checked against the admission and decode contracts; returns the batch."""
    bm, at = sched.block_manager, f"{ex}: step {step}: "
    waiting, running = list(sched.waiting), list(sched.running)
    head_fits = bool(waiting) and _fits(sched, waiting[0])
    free = bm.num_free_blocks
    needs = [int(len(s.block_table) < s.num_blocks) for s in running]  # blocks each running one needs
    held = [len(s.block_table) for s in running]  # what preempting each would free (no block is shared here)
    preempts_before = sched.num_preemptions
    with your_code(ex, f"step {step}: schedule() with waiting {[s.seq_id for s in waiting]} and running "
                   f"{[s.seq_id for s in running]}"):
        batch, is_prefill = sched.schedule()
    names = lambda seqs: [s.seq_id for s in seqs]  # noqa: E731
    _expect(isinstance(batch, list) and (bool(batch) or (not waiting and not running)),
            f"{at}nothing scheduled although sequences {names(waiting)} wait and {names(running)} run")
    if head_fits:
        _expect(is_prefill and batch and batch[0] is waiting[0], f"{at}sequence {waiting[0].seq_id} "
                f"({waiting[0].num_tokens} tokens) at the head of waiting fits (running {len(running)} of "
                f"{sched.max_num_seqs}, budget {sched.max_num_batched_tokens} tokens, {free} free blocks), so "
                f"it must be admitted in a prefill step; got {'prefill' if is_prefill else 'decode'} {names(batch)}")
    if is_prefill:
        k = len(batch)
        _expect(names(batch) == names(waiting[:k]), f"{at}a prefill batch must be the head of waiting in order "
                f"(first come, first served): waiting was {names(waiting)}, admitted {names(batch)}")
        _expect(names(sched.waiting) == names(waiting[k:]) and names(sched.running) == names(running + batch),
                f"{at}after admitting {names(batch)}: waiting should be {names(waiting[k:])} and running "
                f"{names(running + batch)} (admitted ones at the back), got {names(sched.waiting)} and "
                f"{names(sched.running)}")
        used = sum(s.num_tokens - s.num_cached_tokens for s in batch)
        _expect(used <= sched.max_num_batched_tokens, f"{at}the prefill computes {used} tokens, over "
                f"max_num_batched_tokens={sched.max_num_batched_tokens}")
        for s in batch:
            _expect(s.status == SequenceStatus.RUNNING and len(s.block_table) == s.num_blocks,
                    f"{at}admitted sequence {s.seq_id} must be RUNNING with its {s.num_blocks} blocks allocated, "
                    f"is {s.status.name} with block_table {s.block_table}")
        if k < len(waiting):
            nxt = waiting[k]
            still = (len(sched.running) < sched.max_num_seqs and used + nxt.num_tokens <= sched.max_num_batched_tokens
                     and bm.can_allocate(nxt))
            _expect(not still, f"{at}sequence {nxt.seq_id} ({nxt.num_tokens} tokens), next at the head of waiting, "
                    f"still fits ({len(sched.running)} running of {sched.max_num_seqs}, {used} of "
                    f"{sched.max_num_batched_tokens} tokens used, {bm.num_free_blocks} free blocks) but was not admitted")
    elif running:
        k = len(batch)
        # most sequences the oldest ones can be, preempting the newest: blocks freed by those preempted
        best = max(j for j in range(len(running) + 1)
                   if sum(needs[:j]) <= free + sum(held[j:]))
        _expect(names(batch) == names(running[:k]), f"{at}a decode batch must be the oldest running sequences in "
                f"admission order, {names(running)}; got {names(batch)}")
        for s in batch:
            _expect(len(s.block_table) == s.num_blocks, f"{at}sequence {s.seq_id} ({s.num_tokens} tokens) decodes "
                    f"with block_table {s.block_table}: it needs {s.num_blocks} blocks for its new token's K/V")
        _expect(k == best, f"{at}running {names(running)} need {needs} new block(s) with {free} free: preempting "
                f"the newest until the rest fit leaves {names(running[:best])} to decode; got {names(batch)}")
        gone = running[k:]
        _expect(names(sched.running) == names(batch), f"{at}after the decode, running should be {names(batch)} "
                f"(admission order), got {names(sched.running)}")
        _expect(names(sched.waiting) == names(gone + waiting), f"{at}preempted {names(gone)} go back to the "
                f"front of waiting in admission order: waiting should be {names(gone + waiting)}, got "
                f"{names(sched.waiting)}")
        _expect(sched.num_preemptions - preempts_before == len(gone),
                f"{at}{len(gone)} preempted, num_preemptions grew by {sched.num_preemptions - preempts_before}")
        for s in gone:
            _expect(s.status == SequenceStatus.WAITING and not s.block_table, f"{at}preempted sequence {s.seq_id} "
                    f"must be WAITING and hold no blocks (recompute preemption), is {s.status.name} with {s.block_table}")
    _expect(len(sched.running) <= sched.max_num_seqs and len(batch) <= sched.max_num_seqs,
            f"{at}{len(sched.running)} running, more than max_num_seqs={sched.max_num_seqs}")
    return batch


def _named_invariants(ex: str, sched, after: str) -> None:
    """The KV-cache invariants (`check_invariants`), a failure naming `ex` and the operation before."""
    try:
        check_invariants(sched)
    except AssertionError as e:
        raise AssertionError(f"{ex}: after {after}: a KV-cache invariant broke: {e or 'the traceback shows which'}") \
            from e


def _ch04_drive(ex: str, cls: type[Scheduler], ops, block_size: int, num_blocks: int, max_num_seqs: int,
                budget: int) -> None:
    # max_model_len = the budget, as the engine ensures (max_num_batched_tokens >= max_model_len): a
    # preempted sequence always fits a prefill again
    sched = cls(BlockManager(num_blocks, block_size), max_num_seqs, budget, budget, {3})
    seqs, step = [], 0
    for op, a, b in ops:
        if op == "add":
            seq = Sequence([1 + i % 2 for i in range(1 + a % 6)], SamplingParams(max_tokens=b), block_size=block_size,
                           seq_id=len(seqs))
            seqs.append(seq)
            if seq.num_blocks <= num_blocks and seq.num_tokens < budget:
                sched.add(seq)
        elif op == "step":
            step += 1
            batch = _ch04_step(ex, sched, step)
            sched.postprocess(batch, [3 if a == 0 else 1] * len(batch))
        elif seqs:
            with your_code(ex, f"abort of sequence {seqs[a % len(seqs)].seq_id} (step {step})"):
                sched.abort(seqs[a % len(seqs)])
        _named_invariants(ex, sched, f"{op} (step {step})")
    for _ in range(500):  # drain: every request finishes
        if sched.is_finished():
            break
        step += 1
        batch = _ch04_step(ex, sched, step)
        sched.postprocess(batch, [1] * len(batch))
        _named_invariants(ex, sched, f"step {step}")
    left = [s.seq_id for s in [*sched.waiting, *sched.running]]
    _expect(sched.is_finished(), f"{ex}: sequences {left} never finished")
    _expect(sched.block_manager.num_free_blocks == num_blocks, f"{ex}: blocks still held after every request finished")


def check_contract(cls: type[Scheduler], ex: str = "ch04_ex3", max_examples: int = 120) -> None:
    """Random adds, steps (with preemption) and aborts on `cls`: first come first served, the limits,
    recompute preemption of the newest, the KV-cache invariants, and every request finishes."""
    @settings(max_examples=max_examples, deadline=None, report_multiple_bugs=False, database=None,
              derandomize=True)
    # a fixed case first (the draws depend on where the check is called from): a head over the budget with
    # a shorter request behind it; a request arriving while another runs
    @example(ops=[("add", 3, 8), ("add", 3, 8), ("add", 0, 8), ("step", 1, 1), ("add", 0, 8), ("step", 1, 1)],
             block_size=4, num_blocks=10, max_num_seqs=4, budget=5)
    @given(ops=OPS, block_size=st.integers(1, 4), num_blocks=st.integers(3, 10), max_num_seqs=st.integers(1, 4),
           budget=st.integers(5, 24))
    def run(ops, block_size, num_blocks, max_num_seqs, budget):
        _ch04_drive(ex, cls, ops, block_size, num_blocks, max_num_seqs, budget)
    run()


def check_memory_pressure(cls: type[Scheduler], ex: str = "ch04_ex3", max_examples: int = 60) -> None:
    """Every prompt admitted at once into a cache with `spare` blocks beyond their prompts, then
    decoded to the end: preemption after preemption, each step checked as in `check_contract`."""
    @settings(max_examples=max_examples, deadline=None, report_multiple_bugs=False, database=None,
              derandomize=True)
    @given(lens=st.lists(st.integers(1, 6), min_size=2, max_size=5), block_size=st.integers(1, 3),
           spare=st.integers(0, 2), max_tokens=st.integers(2, 8))
    def run(lens, block_size, spare, max_tokens):
        need = sum(-(-n // block_size) for n in lens)
        budget = max(24, sum(lens))
        sched = cls(BlockManager(need + spare, block_size), len(lens), budget, budget, set())
        for i, n in enumerate(lens):
            sched.add(Sequence([1] * n, SamplingParams(max_tokens=max_tokens), block_size=block_size, seq_id=i))
        for step in range(1, 500):
            if sched.is_finished():
                break
            batch = _ch04_step(ex, sched, step)
            sched.postprocess(batch, [1] * len(batch))
            _named_invariants(ex, sched, f"step {step}")
        _expect(sched.is_finished(), f"{ex}: sequences {[s.seq_id for s in [*sched.waiting, *sched.running]]} "
                "never finished")
    run()


def check_preempts_the_newest(cls: type[Scheduler], ex: str = "ch04_ex3") -> None:
    """Three sequences of 4 tokens in 3 blocks of 4: the first decode needs a block for each; the
    oldest keeps running, the newest two are preempted and wait at the front in admission order."""
    sched = cls(BlockManager(3, 4), 8, 64, 64, set())
    seqs = [Sequence([1, 2, 3, 4], SamplingParams(max_tokens=4), block_size=4, seq_id=i) for i in range(3)]
    late = Sequence([5], SamplingParams(max_tokens=1), block_size=4, seq_id=3)
    for s in seqs:
        sched.add(s)
    batch, _ = _GraderScheduler.schedule(sched)
    sched.postprocess(batch, [9, 9, 9])
    sched.add(late)  # waits behind the preempted ones
    with your_code(ex, "schedule_decode() of three running sequences that each need a new block, none free"):
        batch = sched.schedule_decode()
    for s in batch:
        _expect(len(s.block_table) == s.num_blocks, f"{ex}: sequence {s.seq_id} ({s.num_tokens} tokens) decodes "
                f"with block_table {s.block_table}: it needs {s.num_blocks} blocks for its new token's K/V")
    _expect([s.seq_id for s in batch] == [0], f"{ex}: three running sequences each need a new block and none is "
            f"free: preempting the newest (2, then 1) leaves a decode of sequence 0 alone; expected [0], got "
            f"{[s.seq_id for s in batch]}")
    _expect([s.seq_id for s in sched.waiting] == [1, 2, 3], f"{ex}: waiting should be [1, 2, 3] (the preempted "
            f"ones first, in admission order), got {[s.seq_id for s in sched.waiting]}")


def check_token_budget(cls: type[Scheduler], ex: str = "ch04_ex3") -> None:
    """Seats and blocks for all, the budget deciding: prompts of 4 tokens under budgets of 10 to 13 admit
    two (the third would pass the budget), then the third; under a budget of 12 all three (an exact fit);
    and a preempted sequence that grew to 9 tokens is re-admitted only when its 9 fit what is left."""
    for budget in (10, 11, 12, 13):
        sched = cls(BlockManager(16, 4), 8, budget, budget, set())
        for i in range(3):
            sched.add(Sequence([1, 2, 3, 4], SamplingParams(max_tokens=4), block_size=4, seq_id=i))
        plan = [(1, [0, 1, 2])] if budget >= 12 else [(1, [0, 1]), (2, [2])]
        for step, want in plan:
            batch = _ch04_step(ex, sched, step)
            _expect([s.seq_id for s in batch] == want, f"{ex}: step {step}: with max_num_batched_tokens={budget} "
                    f"and prompts of 4 tokens, the prefill should admit {want}, got {[s.seq_id for s in batch]}")
            sched.postprocess(batch, [1] * len(batch))
    # behind a prompt of 4, a sequence that grew from 4 to 9 tokens before it was preempted: budget 12
    sched = cls(BlockManager(16, 4), 8, 12, 12, set())
    grown = Sequence([1, 2, 3, 4], SamplingParams(max_tokens=9), block_size=4, seq_id=1)
    for _ in range(5):
        grown.append_token(1)
    sched.add(Sequence([1, 2, 3, 4], SamplingParams(max_tokens=4), block_size=4, seq_id=0))
    sched.add(grown)
    batch = _ch04_step(ex, sched, 1)
    _expect([s.seq_id for s in batch] == [0], f"{ex}: a prompt of 4 tokens at the head and behind it a sequence of "
            f"9 tokens (4 prompt + 5 generated, preempted, to be recomputed whole), budget 12: 4 + 9 = 13 tokens do not "
            f"fit, so only the first is admitted; got {[s.seq_id for s in batch]}")


PARTS = [pytest.param(part, marks=pytest.mark.group(group), id=part) for part, group in PART_GROUP.items()]


@pytest.mark.ch04
@pytest.mark.ch04_ex3
@pytest.mark.parametrize("part", PARTS)
def test_ch04_ex3_scheduler_contract(part):
    """One part of the scheduler (admission, decode) with the grader's others, or the whole: random
    adds, steps and aborts (see `check_contract`)."""
    check_contract(graded_scheduler(part))


@pytest.mark.ch04
@pytest.mark.ch04_ex3
@pytest.mark.parametrize("part", PARTS)
def test_ch04_ex3_scheduler_under_memory_pressure(part):
    check_memory_pressure(graded_scheduler(part))


@pytest.mark.ch04
@pytest.mark.ch04_ex3
@pytest.mark.group(ADMITS)
def test_ch04_ex3_admission_keeps_to_the_token_budget():
    check_token_budget(graded_scheduler("prefill"))


@pytest.mark.ch04
@pytest.mark.ch04_ex3
@pytest.mark.group(DECODES)
def test_ch04_ex3_preempts_the_newest_back_to_the_front():
    check_preempts_the_newest(graded_scheduler("decode"))


# --- plausible wrong answers lose the right part's points (not graded: they check the graders) -------
class _Overtakes(_GraderScheduler):
    """Admission that skips a head that does not fit and admits later ones (not first come, first served)."""

    def schedule_prefill(self):
        batch, used = [], 0
        for seq in list(self.waiting):
            if len(self.running) >= self.max_num_seqs:
                break
            if used + seq.num_tokens <= self.max_num_batched_tokens and self.block_manager.can_allocate(seq):
                self.block_manager.allocate(seq)
                used += seq.num_tokens - seq.num_cached_tokens
                seq.status = SequenceStatus.RUNNING
                self.waiting.remove(seq)
                self.running.append(seq)
                batch.append(seq)
        return batch


class _IgnoresTheBudget(_GraderScheduler):
    """Admission that checks seats and blocks but not `max_num_batched_tokens`."""

    def schedule_prefill(self):
        batch = []
        while self.waiting and len(self.running) < self.max_num_seqs and self.block_manager.can_allocate(self.waiting[0]):
            seq = self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(seq)
        return batch


def _admission_by(fits):
    """An admission in order that admits the head while `fits(scheduler, head, tokens used so far)`."""
    def schedule_prefill(self):
        batch, used = [], 0
        while self.waiting and len(self.running) < self.max_num_seqs and fits(self, self.waiting[0], used):
            seq = self.waiting.popleft()
            self.block_manager.allocate(seq)
            used += seq.num_tokens - seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(seq)
        return batch
    return schedule_prefill


class _BudgetOnPromptTokens(_GraderScheduler):
    """The budget checked with the head's prompt only (a recomputed sequence brings its generated tokens too)."""

    schedule_prefill = _admission_by(lambda s, head, used: used + head.num_prompt_tokens <= s.max_num_batched_tokens
                                     and s.block_manager.can_allocate(head))


class _BudgetOffByOne(_GraderScheduler):
    """The budget compared with `<` (an exact fit refused)."""

    schedule_prefill = _admission_by(lambda s, head, used: used + head.num_tokens < s.max_num_batched_tokens
                                     and s.block_manager.can_allocate(head))


class _PreemptsTheOldest(_GraderScheduler):
    """Decode that frees room by preempting the oldest running sequence instead of the newest."""

    def schedule_decode(self):
        out = []
        for seq in list(self.running):
            if seq not in self.running:
                continue
            while not self.block_manager.can_append(seq) and self.running[0] is not seq:
                self.preempt(self.running.popleft())
            if self.block_manager.can_append(seq):
                self.block_manager.may_append(seq)
                out.append(seq)
            else:
                self.running.remove(seq)
                self.preempt(seq)
        return out


class _NeverClaims(_GraderScheduler):
    """Decode that checks for room but never claims it (`may_append` forgotten)."""

    def schedule_decode(self):
        out = []
        while self.running and len(out) < len(self.running):
            seq = self.running[len(out)]
            if self.block_manager.can_append(seq):
                out.append(seq)
            else:
                self.preempt(self.running.pop())
        return out


class _DecodeFirst(_GraderScheduler):
    """A step that decodes whenever something runs and admits only when nothing does."""

    def schedule(self):
        if self.running:
            return self.schedule_decode(), False
        return self.schedule_prefill(), True


@pytest.mark.parametrize("wrong, fails", [
    (_Overtakes, "admission"), (_IgnoresTheBudget, "admission"), (_BudgetOnPromptTokens, "admission"),
    (_BudgetOffByOne, "admission"), (_PreemptsTheOldest, "decode"),
    (_NeverClaims, "decode"), (_DecodeFirst, "whole")])
def test_ch04_ex3_wrong_answers_lose_their_part(wrong, fails):
    """Each wrong answer fails the checks of the part it gets wrong, so it loses that part's points (the
    other parts run the grader's code in place of the wrong method, or, for the whole, all of it)."""
    checks = [check_contract, check_memory_pressure] + {"admission": [check_token_budget],
                                                        "decode": [check_preempts_the_newest]}.get(fails, [])
    failures = failed_checks(checks, wrong)
    assert failures, f"{wrong.__name__}: a wrong {fails} passed every check of its part"


# --- ch04_ex4: prepare_batch ---------------------------------------------------------------------
@st.composite
def _batches(draw):
    block_size = draw(st.integers(1, 4))
    is_prefill = draw(st.booleans())
    pool = list(range(64))
    draw(st.randoms(use_true_random=False)).shuffle(pool)
    seqs = []
    for i in range(draw(st.integers(1, 4))):
        seq = Sequence(draw(st.lists(st.integers(1, 99), min_size=1, max_size=10)), block_size=block_size, seq_id=i)
        seq.block_table, pool = pool[:seq.num_blocks], pool[seq.num_blocks:]
        if is_prefill:
            seq.num_cached_tokens = draw(st.integers(0, seq.num_tokens - 1))
        seqs.append(seq)
    return seqs, is_prefill, block_size


@pytest.mark.ch04
@pytest.mark.ch04_ex4
@settings(max_examples=120, deadline=None, report_multiple_bugs=False)
@given(case=_batches())
def test_ch04_ex4_flat_batch_by_its_definition(case):
    """Random sequences (shuffled block tables, cached prefixes at a prefill): each field equals its
    definition, written here from the sequences alone."""
    seqs, is_prefill, bs = case
    with stand_ins("ch04_ex4"), your_code("ch04_ex4", "prepare_batch"):
        ids, pos, md, last = mr.prepare_batch(seqs, is_prefill, bs, torch.device("cpu"))
    starts = [s.num_cached_tokens if is_prefill else s.num_tokens - 1 for s in seqs]
    lens = [s.num_tokens - a for s, a in zip(seqs, starts)]
    cu = [sum(lens[:i]) for i in range(len(seqs) + 1)]
    want = {
        "input_ids": sum((s.token_ids[a:] for s, a in zip(seqs, starts)), []),
        "positions": sum((list(range(a, s.num_tokens)) for s, a in zip(seqs, starts)), []),
        "cu_seqlens_q": cu,
        "context_lens": [s.num_tokens for s in seqs],
        "slot_mapping": sum((_grader_slots(s.block_table, bs, a, s.num_tokens) for s, a in zip(seqs, starts)), []),
        "block_tables": [s.block_table + [-1] * (max(len(t.block_table) for t in seqs) - len(s.block_table))
                         for s in seqs],
        "last_token_rows": [c - 1 for c in cu[1:]],
    }
    got = {"input_ids": ids, "positions": pos, "cu_seqlens_q": md.cu_seqlens_q, "context_lens": md.context_lens,
           "slot_mapping": md.slot_mapping, "block_tables": md.block_tables, "last_token_rows": last}
    desc = "; ".join(f"seq {s.seq_id}: {s.num_tokens} tokens, {s.num_cached_tokens} cached, block_table {s.block_table}"
                     for s in seqs)
    at = f"ch04_ex4: prepare_batch({'prefill' if is_prefill else 'decode'}, block_size={bs}) of [{desc}]"
    _expect(md.is_prefill == is_prefill, f"{at}: metadata.is_prefill should be {is_prefill}")
    for name, w in want.items():
        t = got[name]
        _expect(isinstance(t, torch.Tensor) and t.dtype == torch.int64, f"{at}: {name} should be an int64 tensor, "
                f"got {t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        _expect(t.tolist() == w, f"{at}: {name} should be {w}, got {t.tolist()}")
    _expect(md.cu_seqlens_q.device.type == "cpu", f"{at}: cu_seqlens_q stays on the CPU")


# --- every exercise in the engine, against transformers ------------------------------------------
@pytest.fixture(scope="module")
def engine_case(tmp_path_factory):
    """A tiny model, 10 prompts on a cache small enough to preempt, and transformers' greedy outputs."""
    folder = tmp_path_factory.mktemp("grading-ch04")
    model = make_model(folder, "llama")
    prompts = random_prompts(10, 1, 40, seed=4)
    return folder, prompts, [hf_greedy(model, p, 8) for p in prompts]


@pytest.mark.ch04
@pytest.mark.parametrize("ex", [pytest.param(ex, marks=[getattr(pytest.mark, ex)] + (
    [pytest.mark.group(EQUALS)] if ex == "ch04_ex3" else []), id=ex) for ex in EXERCISES])
def test_ch04_engine_equals_transformers(ex, engine_case):
    """The engine with the exercise's code in place (the grader's for the other regions), paged blocks
    of 4 on a cache that forces preemptions, at most 4 sequences and 64 prefill tokens a step:
    greedy tokens equal transformers', every block free at the end."""
    folder, prompts, ref = engine_case
    with stand_ins(ex):
        with your_code(ex, "building the engine"):
            engine = LLMEngine(model=folder, dtype="float64", max_model_len=64, block_size=4, num_kvcache_blocks=24,
                               max_num_seqs=4, max_num_batched_tokens=64, block_manager_cls=BlockManager,
                               attention_backend=PagedAttention, scheduler_cls=graded_scheduler(ex))
        outs = run_graded(ex, engine, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for i, (o, r) in enumerate(zip(outs, ref)):
        g = o.outputs[0].token_ids
        j = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
        _expect(g == r, f"{ex}: prompt {i} ({len(prompts[i])} tokens): the engine generated {g}, transformers {r} "
                f"(first difference at completion token {j})")
    assert engine.scheduler.num_preemptions > 0, "grader setup: the cache should have been tight enough to preempt"
    _expect(engine.block_manager.num_free_blocks == engine.block_manager.num_blocks,
            f"{ex}: blocks still held after every request finished")
