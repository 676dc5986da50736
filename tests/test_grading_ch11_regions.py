"""Grading tests for chapter 11's rebuild exercises (`python -m minivllm.course.grade ch11_ex1`, or `pytest -m ch11_ex1`).

ch11_ex1 (`ChunkedPrefillScheduler.schedule`, written whole) and ch11_ex2 (`prepare_mixed_batch`) are
graded in the package itself: in a student edition they are the student's code, exported from the
chapter (stubs until filled), and there is no reference to compare with. Each is graded alone: the
grader's own stand-in for the other (`_GraderChunkedScheduler.schedule`, `_grader_prepare_mixed_batch`,
written here, differently from the chapter) takes its place, so a filled region passes whatever
state the other is in (`graded`; `STAND_INS` serves `tests/stand_ins.py` for editions of several chapters).

What is checked is the contract, never this chapter's code. ch11_ex1, in named groups so that a
student sees which part works:
* never over budget: no step holds more than `max_num_batched_tokens` tokens, no sequence computes
  past its `num_tokens` or (chunking on) more than `long_prefill_token_threshold`, without chunking
  only whole prompts; `is_prefill` as defined (hypothesis: random arrivals, steps and aborts, a fake
  model runner);
* running before waiting: running sequences first, in admission order, none skipped while budget is
  left; newcomers from the head of `waiting`, none after a preemption, and admission stops only when
  the budget, the seats or the blocks ran out; a running sequence waits a bounded number of steps;
* starts at the prefix-cache hit: a newcomer's `num_computed_tokens` is its block-aligned
  `num_cached_tokens`, the hit costs no budget, and a block is shared from the step that fills it;
* survives preemption: tiny KV caches, every request finishes, the KV-cache invariants after every
  step, and the engine's greedy tokens with forced preemptions equal transformers';
* equals transformers: the engine's greedy tokens (tiny float64 model) for several budgets and thresholds.
ch11_ex2: every field of the layout against its definition on random steps (one-query rows first,
token ids, positions, slots by the slot formula, padded block tables, the sampled rows: those that
hold a sequence's last token), and the engine's greedy tokens equal transformers'.
"""
from __future__ import annotations

import random
from contextlib import ExitStack, contextmanager

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minivllm.worker.mixed_batch as mixed_batch
from engine_helpers import check_invariants, hf_greedy, make_model, one_thread, random_prompts, run_engine
from minivllm.attention.backend import AttentionMetadata
from minivllm.core.block_manager import BlockManager
from minivllm.core.chunked_prefix_caching import ChunkedPrefixCachingBlockManager
from minivllm.core.sched.chunked_prefill import ChunkedPrefillScheduler
from minivllm.course.grade import EXERCISES as GRADED
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceStatus
from minivllm.worker.mixed_batch import MixedBatchMetadata

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)
MAX_MODEL_LEN = 128  # the engine tests'
SIM_MAX_MODEL_LEN = 30  # the scheduler-only simulations'
BUDGET, ORDER, PREEMPTION, PREFIX_HIT, EQUALS = (name for name, _ in GRADED["ch11_ex1"].groups)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


@contextmanager
def your_code(ex: str, what: str):
    """An error of the code under grading (not a stub's NotImplementedError, not a check's
    AssertionError) re-raised as an AssertionError naming `ex` and what was running."""
    try:
        yield
    except (NotImplementedError, AssertionError):
        raise
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{ex}: {what} raised {type(e).__name__}: {e} (the traceback shows where)") from e


# --- the grader's stand-ins ----------------------------------------------------------------------
class _GraderChunkedScheduler(ChunkedPrefillScheduler):
    """The grader's token-budget step: an index walk over `running`, then the head of `waiting`."""

    def schedule(self):
        left, out, preempted = self.max_num_batched_tokens, [], self.num_preemptions
        i = 0
        while i < len(self.running) and left > 0:
            seq = self.running[i]
            if not self.room_for(seq):  # it was preempted itself (and every sequence after it)
                break
            # each share from num_new_tokens: a later chapter's subclass (speculative decoding's drafts) decides it
            self.schedule_tokens(seq, self.num_new_tokens(seq, left))
            left -= seq.num_scheduled_tokens
            out.append(seq)
            i += 1
        while self.waiting and left > 0 and len(self.running) < self.max_num_seqs and self.num_preemptions == preempted:
            head = self.waiting[0]
            if not self.block_manager.can_allocate(head):
                break
            self.block_manager.allocate(head)
            head.num_computed_tokens = head.num_cached_tokens
            todo = head.num_tokens - head.num_computed_tokens
            take = self.num_new_tokens(head, left)
            if take < todo and not self.enable_chunked_prefill:
                self.block_manager.deallocate(head)
                head.num_computed_tokens = 0
                break
            if take < todo:
                self.block_manager.discard_unwritten([head])
            self.schedule_tokens(head, take)
            left -= take
            head.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            out.append(head)
        decodes = sum(s.num_scheduled_tokens == 1 and s.num_computed_tokens == s.num_tokens - 1 >= s.num_prompt_tokens
                      for s in out)
        return out, decodes < len(out)


def _grader_metadata(rows, is_prefill: bool, block_size: int, device) -> AttentionMetadata:
    """`rows`: (seq, start, end); slots by token t -> block_table[t // block_size] * block_size + t % block_size."""
    width = max(len(s.block_table) for s, _, _ in rows)
    q_lens = torch.tensor([b - a for _, a, b in rows], dtype=torch.int64)
    slots = [s.block_table[t // block_size] * block_size + t % block_size for s, a, b in rows for t in range(a, b)]
    tables = [s.block_table + [-1] * (width - len(s.block_table)) for s, _, _ in rows]
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int64).to(device)  # noqa: E731
    return AttentionMetadata(is_prefill, torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]),
                             as_tensor([b for _, _, b in rows]), as_tensor(slots), as_tensor(tables))


def _grader_prepare_mixed_batch(seqs, block_size, device):
    """The grader's layout: a stable sort puts one-query rows first."""
    spans = sorted(((s, s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens) for s in seqs),
                   key=lambda r: r[2] - r[1] > 1)
    num_decodes = sum(b - a == 1 for _, a, b in spans)
    ids = [t for s, a, b in spans for t in s.token_ids[a:b]]
    pos = [p for _, a, b in spans for p in range(a, b)]
    rows, sampled, end = [], [], 0
    for s, a, b in spans:
        end += b - a
        if b == s.num_tokens:
            rows.append(end - 1)
            sampled.append(s)
    md = MixedBatchMetadata(num_decodes,
                            _grader_metadata(spans[:num_decodes], False, block_size, device) if num_decodes else None,
                            _grader_metadata(spans[num_decodes:], True, block_size, device)
                            if num_decodes < len(spans) else None)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int64).to(device)  # noqa: E731
    return as_tensor(ids), as_tensor(pos), md, as_tensor(rows), sampled


# exercise -> [(owner, attribute, stand-in)] (the format tests/stand_ins.py reads for editions of several chapters)
STAND_INS = {"ch11_ex1": [(ChunkedPrefillScheduler, "schedule", _GraderChunkedScheduler.schedule)],
             "ch11_ex2": [(mixed_batch, "prepare_mixed_batch", _grader_prepare_mixed_batch)]}


@contextmanager
def graded(ex: str | None):
    """The package's (the student's) piece for `ex`, the grader's stand-in for chapter 11's other (None: both)."""
    with ExitStack() as stack:
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        for other, patches in STAND_INS.items():
            for owner, name, fn in patches if other != ex else ():
                mp.setattr(owner, name, fn)
        yield


# --- ch11_ex1: the scheduler alone, with a fake model runner ------------------------------------------
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(1, 3), min_size=1, max_size=25), st.integers(1, 6)),
    st.tuples(st.just("step"), st.integers(0, 3)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
), min_size=5, max_size=50)


class _Sim:
    """A `ChunkedPrefillScheduler` (the student's `schedule`) driven step by step with a fake model runner;
    each step's state before `schedule` is passed to `check(sim, before, batch, is_prefill)`."""

    def __init__(self, manager, num_blocks, block_size, max_num_seqs, budget, threshold, chunking, check):
        self.s = ChunkedPrefillScheduler(manager(num_blocks, block_size), max_num_seqs, budget, SIM_MAX_MODEL_LEN, {0},
                                         enable_chunked_prefill=chunking, long_prefill_token_threshold=threshold)
        self.num_blocks, self.block_size, self.budget, self.threshold, self.chunking = \
            num_blocks, block_size, budget, threshold, chunking
        self.check, self.steps, self.live = check, 0, []

    def add(self, prompt, max_tokens) -> None:
        seq = Sequence(prompt, SamplingParams(max_tokens=max_tokens), block_size=self.block_size)
        if seq.num_blocks <= self.num_blocks and seq.num_tokens < SIM_MAX_MODEL_LEN:  # what the engine accepts
            self.s.add(seq)
            self.live.append(seq)

    def step(self, token: int = 1) -> None:
        s, self.steps = self.s, self.steps + 1
        before = dict(running=list(s.running), waiting=list(s.waiting), preemptions=s.num_preemptions,
                      computed={id(x): getattr(x, "num_computed_tokens", 0) for x in [*s.running, *s.waiting]})
        with your_code("ch11_ex1", f"schedule() at step {self.steps}"):
            batch, is_prefill = s.schedule()
        _expect(isinstance(batch, list) and isinstance(is_prefill, bool),
                f"ch11_ex1: schedule() must return (a list of sequences, a bool), got ({type(batch).__name__}, "
                f"{type(is_prefill).__name__})")
        _expect(bool(batch) or s.is_finished(), f"ch11_ex1: step {self.steps}: nothing scheduled although "
                f"{len(s.waiting)} sequences wait and {len(s.running)} run")
        _expect(len({id(x) for x in batch}) == len(batch), f"ch11_ex1: step {self.steps}: a sequence scheduled twice")
        self.check(self, before, batch, is_prefill)
        tokens = [token if x.num_computed_tokens + x.num_scheduled_tokens == x.num_tokens else None for x in batch]
        s.postprocess(batch, tokens)
        self.invariants(f"after step {self.steps}")

    def invariants(self, when: str) -> None:
        try:
            check_invariants(self.s)
        except AssertionError as e:
            raise AssertionError(f"ch11_ex1: {when}: a KV-cache invariant broke (reference counts, block tables, "
                                 f"free and used blocks, cached hashes): {e}") from e

    def run(self, ops) -> None:
        for o in ops:
            if o[0] == "add":
                self.add(o[1], o[2])
            elif o[0] == "step":
                self.step(o[1])
            elif self.live:
                with your_code("ch11_ex1", "abort"):
                    self.s.abort(self.live[o[1] % len(self.live)])
            self.live = [x for x in self.live if not x.is_finished]
            self.invariants(f"after {o[0]}")
        for _ in range(3000):  # drain: everything finishes, nothing hangs
            if self.s.is_finished():
                break
            self.step()
        left = [x.seq_id for x in [*self.s.waiting, *self.s.running]]
        _expect(self.s.is_finished(), f"ch11_ex1: sequences {left} never finished")
        _expect(self.s.block_manager.num_free_blocks == self.num_blocks,
                "ch11_ex1: blocks still held after every request finished")


def _sim_args(draw_manager=st.sampled_from([BlockManager, ChunkedPrefixCachingBlockManager])):
    return dict(manager=draw_manager, block_size=st.integers(1, 4), num_blocks=st.integers(8, 24),
                max_num_seqs=st.integers(1, 4), extra_budget=st.integers(0, 12), threshold=st.integers(0, 6),
                chunking=st.booleans())


def _simulate(ops, manager, block_size, num_blocks, max_num_seqs, extra_budget, threshold, chunking, check):
    # without chunking the engine requires max_num_batched_tokens >= max_model_len
    budget = max_num_seqs + extra_budget if chunking else SIM_MAX_MODEL_LEN + extra_budget
    _Sim(manager, num_blocks, block_size, max_num_seqs, budget, threshold, chunking, check).run(ops)


def _check_budget(sim, before, batch, is_prefill):
    at = f"ch11_ex1: step {sim.steps}"
    total = sum(x.num_scheduled_tokens for x in batch)
    _expect(total <= sim.budget, f"{at}: {total} tokens scheduled, max_num_batched_tokens={sim.budget}")
    for x in batch:
        start, n = x.num_computed_tokens, x.num_scheduled_tokens
        _expect(x.status == SequenceStatus.RUNNING and any(x is r for r in sim.s.running),
                f"{at}: scheduled sequence {x.seq_id} must be RUNNING and in `running`")
        _expect(n >= 1, f"{at}: sequence {x.seq_id} scheduled with num_scheduled_tokens={n} (at least 1)")
        _expect(start + n <= x.num_tokens, f"{at}: sequence {x.seq_id} computes tokens [{start}, {start + n}) "
                f"past its num_tokens={x.num_tokens}")
        if sim.chunking and sim.threshold:
            _expect(n <= sim.threshold, f"{at}: sequence {x.seq_id} computes {n} tokens, "
                    f"long_prefill_token_threshold={sim.threshold}")
        if not sim.chunking:
            _expect(start + n == x.num_tokens, f"{at}: chunking is off, but sequence {x.seq_id} computes "
                    f"[{start}, {start + n}) of its {x.num_tokens} tokens (whole prompts only)")
    decode = all(x.num_scheduled_tokens == 1 and x.num_prompt_tokens <= x.num_computed_tokens == x.num_tokens - 1
                 for x in batch)
    _expect(is_prefill == (not decode), f"{at}: is_prefill={is_prefill}, but "
            + ("every sequence computes just its newest generated token" if decode else "some sequence computes more "
               "than its newest generated token"))


def _check_order(sim, before, batch, is_prefill):
    s, at = sim.s, f"ch11_ex1: step {sim.steps}"
    was_running = [x for x in before["running"]]
    admitted = [x for x in batch if any(x is w for w in before["waiting"])]
    served = [x for x in batch if not any(x is w for w in before["waiting"])]
    _expect(batch[:len(served)] == served, f"{at}: newcomers {[x.seq_id for x in admitted]} scheduled before "
            "running sequences: running sequences come first")
    order = [x.seq_id for x in was_running]
    _expect([x.seq_id for x in served] == [i for i in order if i in {x.seq_id for x in served}],
            f"{at}: running sequences served in order {[x.seq_id for x in served]}, admission order is {order}")
    _expect([x.seq_id for x in admitted] == [x.seq_id for x in before["waiting"][:len(admitted)]],
            f"{at}: admitted {[x.seq_id for x in admitted]}, the head of waiting was "
            f"{[x.seq_id for x in before['waiting'][:max(1, len(admitted))]]} (first come, first served)")
    left = sim.budget - sum(x.num_scheduled_tokens for x in batch)
    preempted = s.num_preemptions > before["preemptions"]
    _expect(not (admitted and preempted), f"{at}: sequences were preempted in this step, yet "
            f"{[x.seq_id for x in admitted]} were admitted (a preemption ends admission)")
    for x in was_running:
        if x.status == SequenceStatus.RUNNING and not any(x is b for b in batch):
            _expect(left == 0, f"{at}: running sequence {x.seq_id} was skipped with {left} tokens of budget left")
            _expect(not admitted, f"{at}: running sequence {x.seq_id} was skipped, yet waiting ones were admitted")
            sim.waited = getattr(sim, "waited", {})
            sim.waited[x.seq_id] = sim.waited.get(x.seq_id, 0) + 1
            bound = -(-s.max_num_seqs * SIM_MAX_MODEL_LEN // sim.budget) + 1
            _expect(sim.waited[x.seq_id] <= bound, f"{at}: running sequence {x.seq_id} waited "
                    f"{sim.waited[x.seq_id]} steps in a row (budget {sim.budget}, at most {bound})")
        else:
            getattr(sim, "waited", {}).pop(x.seq_id, None)
    if s.waiting and left > 0 and len(s.running) < s.max_num_seqs and not preempted and sim.chunking:
        head = s.waiting[0]
        _expect(not s.block_manager.can_allocate(head), f"{at}: sequence {head.seq_id} left waiting with "
                f"{left} tokens of budget, a free seat and its blocks free")


def _check_prefix_hit(sim, before, batch, is_prefill):
    at, bs = f"ch11_ex1: step {sim.steps}", sim.block_size
    for x in batch:
        if any(x is w for w in before["waiting"]):
            _expect(x.num_computed_tokens == x.num_cached_tokens, f"{at}: newcomer {x.seq_id} starts at "
                    f"num_computed_tokens={x.num_computed_tokens}, its prefix-cache hit is "
                    f"num_cached_tokens={x.num_cached_tokens}")
            _expect(x.num_cached_tokens % bs == 0 and x.num_cached_tokens <= x.num_tokens - 1,
                    f"{at}: newcomer {x.seq_id} has num_cached_tokens={x.num_cached_tokens} (block size {bs}, "
                    f"{x.num_tokens} tokens): a whole number of blocks, never its last token")
        else:
            _expect(x.num_computed_tokens == before["computed"].get(id(x), x.num_computed_tokens),
                    f"{at}: running sequence {x.seq_id}'s num_computed_tokens changed in schedule()")


def _check_blocks_for_the_step(sim, before, batch, is_prefill):
    at, bs = f"ch11_ex1: step {sim.steps}", sim.block_size
    for x in batch:
        end = x.num_computed_tokens + x.num_scheduled_tokens
        _expect(len(x.block_table) * bs >= end, f"{at}: sequence {x.seq_id} computes up to token {end} but its "
                f"block table {x.block_table} holds {len(x.block_table) * bs} slots (room_for makes room)")


_settings = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                     report_multiple_bugs=False)


@pytest.mark.ch11
@pytest.mark.ch11_ex1
@pytest.mark.group(BUDGET)
@_settings
@given(ops=OPS, **_sim_args())
def test_ch11_ex1_never_over_budget_no_chunk_past_num_tokens_or_the_threshold(ops, manager, block_size, num_blocks,
                                                                             max_num_seqs, extra_budget, threshold,
                                                                             chunking):
    with graded("ch11_ex1"):
        _simulate(ops, manager, block_size, num_blocks, max_num_seqs, extra_budget, threshold, chunking, _check_budget)


@pytest.mark.ch11
@pytest.mark.ch11_ex1
@pytest.mark.group(BUDGET)
def test_ch11_ex1_each_share_comes_from_num_new_tokens():
    """A subclass that overrides `num_new_tokens` (chapter 14's speculative decoding does, to schedule a
    sequence's drafts) decides every share: here at most 3 tokens a sequence, for a budget of 8."""

    class AtMostThree(ChunkedPrefillScheduler):
        def num_new_tokens(self, seq, budget):
            return min(3, super().num_new_tokens(seq, budget))

    s = AtMostThree(BlockManager(32, 4), 4, 8, 64, set())
    a, b = (Sequence(list(range(1, 21)), SamplingParams(max_tokens=3), block_size=4),
            Sequence([5] * 12, SamplingParams(max_tokens=3), block_size=4))
    s.add(a)
    s.add(b)
    with graded("ch11_ex1"), your_code("ch11_ex1", "schedule()"):
        steps = []
        for _ in range(2):
            batch, _ = s.schedule()
            steps.append([(x.seq_id, x.num_computed_tokens, x.num_scheduled_tokens) for x in batch])
            s.postprocess(batch, [1 if x.num_computed_tokens + x.num_scheduled_tokens == x.num_tokens else None
                                  for x in batch])
    want = [[(a.seq_id, 0, 3), (b.seq_id, 0, 3)], [(a.seq_id, 3, 3), (b.seq_id, 3, 3)]]
    _expect(steps == want, f"ch11_ex1: with a num_new_tokens that gives at most 3 tokens, (seq_id, "
            f"num_computed_tokens, num_scheduled_tokens) per step: got {steps}, expected {want} (each sequence's "
            "share must come from self.num_new_tokens, which a subclass may override)")


@pytest.mark.ch11
@pytest.mark.ch11_ex1
@pytest.mark.group(ORDER)
@_settings
@given(ops=OPS, **_sim_args())
def test_ch11_ex1_running_before_waiting_unless_the_budget_ran_out(ops, manager, block_size, num_blocks, max_num_seqs,
                                                                  extra_budget, threshold, chunking):
    with graded("ch11_ex1"):
        _simulate(ops, manager, block_size, num_blocks, max_num_seqs, extra_budget, threshold, chunking, _check_order)


@pytest.mark.ch11
@pytest.mark.ch11_ex1
@pytest.mark.group(ORDER)
def test_ch11_ex1_running_before_waiting_by_example():
    """Budget 8, threshold 0: a running 20-token prompt takes the whole budget (no newcomer), then its
    last 4 tokens beside the newcomer's first 4."""
    s = ChunkedPrefillScheduler(BlockManager(32, 4), 4, 8, 64, set())
    a, b = Sequence(list(range(1, 21)), SamplingParams(max_tokens=3), block_size=4), \
        Sequence([5] * 12, SamplingParams(max_tokens=3), block_size=4)
    s.add(a)
    with graded("ch11_ex1"), your_code("ch11_ex1", "schedule()"):
        steps = []
        for i in range(3):
            if i == 1:
                s.add(b)
            batch, _ = s.schedule()
            steps.append([(x.seq_id, x.num_computed_tokens, x.num_scheduled_tokens) for x in batch])
            s.postprocess(batch, [1 if x.num_computed_tokens + x.num_scheduled_tokens == x.num_tokens else None
                                  for x in batch])
    want = [[(a.seq_id, 0, 8)], [(a.seq_id, 8, 8)], [(a.seq_id, 16, 4), (b.seq_id, 0, 4)]]
    _expect(steps == want, f"ch11_ex1: (seq_id, num_computed_tokens, num_scheduled_tokens) per step: got {steps}, "
            f"expected {want}")


@pytest.mark.ch11
@pytest.mark.ch11_ex1
@pytest.mark.group(PREFIX_HIT)
@_settings
@given(ops=OPS, **_sim_args(st.just(ChunkedPrefixCachingBlockManager)))
def test_ch11_ex1_starts_at_the_prefix_cache_hit(ops, manager, block_size, num_blocks, max_num_seqs, extra_budget,
                                                 threshold, chunking):
    with graded("ch11_ex1"):
        _simulate(ops, manager, block_size, num_blocks, max_num_seqs, extra_budget, threshold, chunking,
                  _check_prefix_hit)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """(model folder, prompts of 1-90 tokens sharing prefixes, max_tokens, transformers' greedy completions)."""
    folder = tmp_path_factory.mktemp("ch11-grading-llama")
    model = make_model(folder, "llama", seed=1)
    base = random_prompts(5, 1, 60, seed=23)
    shared = list(range(7, 44))  # 37 tokens: two full blocks of 16 and a partial one
    prompts = base + [shared + p[:15] for p in base[:2]] + [shared, shared + [9] * 53]
    rng = random.Random(5)
    max_tokens = [rng.randint(1, 7) for _ in prompts]
    return folder, prompts, max_tokens, [hf_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]


def _engine(ex: str, folder, budget, **kwargs):
    """`LLM`'s default assembly (chapter 11's scheduler and mixed batches), float64, budget `budget` (None: 8192)."""
    seqs = {} if budget is None else dict(max_num_batched_tokens=budget, max_num_seqs=min(8, budget))
    kwargs.setdefault("num_kvcache_blocks", 8 * MAX_MODEL_LEN // kwargs.get("block_size", 16))
    with your_code(ex, "building the engine"):
        engine = LLM(folder, dtype="float64", max_model_len=MAX_MODEL_LEN, **seqs, **kwargs).llm_engine
    _expect(isinstance(engine.scheduler, ChunkedPrefillScheduler), f"{ex}: the engine's scheduler is "
            f"{type(engine.scheduler).__name__}, expected chapter 11's ChunkedPrefillScheduler or a subclass")
    return engine


def run_graded(ex: str, engine, prompts, params):
    """`run_engine` (the KV-cache invariants after every step) with the failures named."""
    try:
        return run_engine(engine, prompts, params)
    except NotImplementedError:
        raise
    except AssertionError as e:
        raise AssertionError(f"{ex}: with your code the engine broke an invariant of its KV cache: {e}") from e
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{ex}: the engine with your code raised {type(e).__name__}: {e}") from e


def _greedy(max_tokens):
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]


def _expect_refs(ex: str, outs, prompts, refs, what: str) -> None:
    """Each output's first tokens (as many as transformers' reference has) equal the reference."""
    for i, (out, ref) in enumerate(zip(outs, refs)):
        got = out.outputs[0].token_ids[:len(ref)]
        _expect(got == ref, f"{ex}: {what}: prompt {i} ({len(prompts[i])} tokens): greedy tokens {got}, "
                f"transformers' {ref}")


@pytest.mark.ch11
@pytest.mark.ch11_ex1
@pytest.mark.group(PREFIX_HIT)
def test_ch11_ex1_starts_at_the_prefix_cache_hit_in_the_engine(oracle):
    """Two 48-token prompts, blocks of 16, budget 48, threshold 16: b arrives beside a's second chunk and
    shares a's blocks 0 and 1 (block 1 is written in that very step): it computes only its last block."""
    with graded("ch11_ex1"):
        e = _engine("ch11_ex1", oracle[0], 48, block_size=16, long_prefill_token_threshold=16,
                    enable_prefix_caching=True)
        prompt, params = list(range(48)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        done = {}
        with your_code("ch11_ex1", "the engine's steps"):
            e.add_request("a", prompt, params)
            e.step()
            e.add_request("b", prompt, params)
            while e.has_unfinished_requests():
                done.update((o.request_id, o) for o in e.step() if o.finished)
                check_invariants(e)
    _expect(done["b"].num_cached_tokens == 32, f"ch11_ex1: b's num_cached_tokens is {done['b'].num_cached_tokens}, "
            "expected 32 (a's blocks 0 and 1, cached by the steps that fill them)")
    got = [st.num_tokens for st in e.stats[:3]]
    _expect(got == [16, 32, 17], f"ch11_ex1: tokens per step {got}, expected [16, 32, 17] (a: 16 a step; b: only "
            "its last block, the hit costs no budget; then a's last 16 beside b's first decode)")
    _expect(done["a"].outputs[0].token_ids == done["b"].outputs[0].token_ids, "ch11_ex1: a and b differ")


@pytest.mark.ch11
@pytest.mark.ch11_ex1
@_settings
@given(lens=st.lists(st.integers(1, 20), min_size=2, max_size=6), block_size=st.integers(1, 4),
       spare=st.integers(0, 3), max_tokens=st.integers(2, 9), budget=st.integers(4, 40),
       threshold=st.integers(0, 6), caching=st.booleans())
@pytest.mark.group(PREEMPTION)
def test_ch11_ex1_survives_preemption(lens, block_size, spare, max_tokens, budget, threshold, caching):
    """A KV cache that holds the prompts and `spare` blocks more: decodes run out of blocks and the newest
    running sequences are preempted; every request finishes, the invariants hold after every step."""
    need = sum(-(-n // block_size) for n in lens)
    longest = max(-(-(n + max_tokens) // block_size) for n in lens)
    manager = ChunkedPrefixCachingBlockManager if caching else BlockManager
    sim = _Sim(manager, max(need, longest) + spare, block_size, len(lens), budget, threshold, True,
               _check_blocks_for_the_step)
    with graded("ch11_ex1"):
        for n in lens:
            sim.add([1 + i % 3 for i in range(n)], max_tokens)
        sim.run([])


@pytest.mark.ch11
@pytest.mark.ch11_ex1
@pytest.mark.group(PREEMPTION)
@pytest.mark.parametrize("budget, caching", [(7, True), (16, False)])
def test_ch11_ex1_survives_preemption_in_the_engine(oracle, budget, caching):
    folder, prompts, max_tokens, refs = oracle
    with graded("ch11_ex1"):
        e = _engine("ch11_ex1", folder, budget, block_size=4, num_kvcache_blocks=32, enable_prefix_caching=caching)
        outs = run_graded("ch11_ex1", e, prompts, _greedy([m + 24 for m in max_tokens]))
    _expect(e.scheduler.num_preemptions >= 2, f"ch11_ex1: {e.scheduler.num_preemptions} preemptions in a cache too "
            "small for the batch (expected several)")
    _expect_refs("ch11_ex1", outs, prompts, refs, f"budget {budget}, 32 blocks of 4")


@pytest.mark.ch11
@pytest.mark.ch11_ex1
@pytest.mark.parametrize("budget, threshold, chunking", [(1, 0, True), (7, 0, True), (16, 5, True), (64, 5, True),
                                                         (None, 0, True), (MAX_MODEL_LEN, 0, False)])
@pytest.mark.group(EQUALS)
def test_ch11_ex1_equals_transformers(oracle, budget, threshold, chunking):
    folder, prompts, max_tokens, refs = oracle
    with graded("ch11_ex1"):
        e = _engine("ch11_ex1", folder, budget, long_prefill_token_threshold=threshold, block_size=16,
                    enable_prefix_caching=True, enable_chunked_prefill=chunking)
        outs = run_graded("ch11_ex1", e, prompts, _greedy(max_tokens))
    _expect_refs("ch11_ex1", outs, prompts, refs, f"budget {budget}, threshold {threshold}, chunking {chunking}")
    _expect(all(st.num_tokens <= (budget or 8192) for st in e.stats), f"ch11_ex1: a step over budget {budget}")


# --- ch11_ex2: the mixed batch ------------------------------------------------------------------
@st.composite
def _steps(draw):
    """(seqs, block_size): random sequences with block tables, each with a span to compute this step."""
    block_size = draw(st.integers(1, 5))
    ids = iter(draw(st.permutations(range(200))))
    seqs = []
    for _ in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(st.integers(0, 99), min_size=1, max_size=20))
        seq = Sequence(prompt, SamplingParams(max_tokens=50), block_size=block_size)
        for t in draw(st.lists(st.integers(0, 99), max_size=4)):
            seq.append_token(t)
        kind = draw(st.sampled_from(["decode", "chunk", "rest", "one"]))
        if kind == "decode":  # its newest token only
            start = seq.num_tokens - 1
        else:
            start = draw(st.integers(0, seq.num_tokens - 1))
        if kind == "decode" or kind == "one":
            n = 1
        elif kind == "rest":
            n = seq.num_tokens - start
        else:
            n = draw(st.integers(1, seq.num_tokens - start))
        seq.num_computed_tokens, seq.num_scheduled_tokens = start, n
        seq.block_table = [next(ids) for _ in range(-(-seq.num_tokens // block_size))]
        seqs.append(seq)
    return seqs, block_size


def _check_metadata(md, rows, is_prefill: bool, block_size: int, what: str) -> None:
    at = f"ch11_ex2: {what}"
    if not rows:
        _expect(md is None, f"{at} must be None: no such rows in this step")
        return
    _expect(isinstance(md, AttentionMetadata), f"{at}: expected an AttentionMetadata, got {type(md).__name__}")
    _expect(md.is_prefill is is_prefill, f"{at}.is_prefill is {md.is_prefill}, expected {is_prefill}")
    cu = [0]
    for _, a, b in rows:
        cu.append(cu[-1] + b - a)
    slots = [s.block_table[t // block_size] * block_size + t % block_size for s, a, b in rows for t in range(a, b)]
    for name, want in (("cu_seqlens_q", cu), ("context_lens", [b for _, _, b in rows]), ("slot_mapping", slots)):
        got = getattr(md, name)
        _expect(isinstance(got, torch.Tensor) and got.dtype == torch.int64, f"{at}.{name}: an int64 tensor")
        _expect(got.tolist() == want, f"{at}.{name} is {got.tolist()}, expected {want}")
    tables = md.block_tables
    _expect(isinstance(tables, torch.Tensor) and tables.dtype == torch.int64 and tables.dim() == 2
            and tables.shape[0] == len(rows), f"{at}.block_tables: an int64 tensor [{len(rows)}, max blocks]")
    for i, (s, _, _) in enumerate(rows):
        row = tables[i].tolist()
        _expect(row[:len(s.block_table)] == s.block_table and all(x == -1 for x in row[len(s.block_table):]),
                f"{at}.block_tables row {i} is {row}, expected {s.block_table} padded with -1")


@pytest.mark.ch11
@pytest.mark.ch11_ex2
@settings(max_examples=200, deadline=None, report_multiple_bugs=False)
@given(case=_steps())
def test_ch11_ex2_layout_by_its_definition(case):
    seqs, block_size = case
    with graded("ch11_ex2"), your_code("ch11_ex2", "prepare_mixed_batch"):
        out = mixed_batch.prepare_mixed_batch(seqs, block_size, torch.device("cpu"))
    _expect(isinstance(out, tuple) and len(out) == 5, "ch11_ex2: return (input_ids, positions, metadata, "
            "sample_rows, sampled)")
    input_ids, positions, md, sample_rows, sampled = out
    rows = [(s, s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens) for s in seqs]
    ordered = [r for r in rows if r[2] - r[1] == 1] + [r for r in rows if r[2] - r[1] > 1]
    want_ids = [t for s, a, b in ordered for t in s.token_ids[a:b]]
    want_pos = [p for _, a, b in ordered for p in range(a, b)]
    for name, got, want in (("input_ids", input_ids, want_ids), ("positions", positions, want_pos)):
        _expect(isinstance(got, torch.Tensor) and got.dtype == torch.int64, f"ch11_ex2: {name}: an int64 tensor")
        _expect(got.tolist() == want, f"ch11_ex2: {name} is {got.tolist()}, expected {want} (one-query rows first, "
                "then the chunks, each in the step's order)")
    num_decodes = sum(b - a == 1 for _, a, b in rows)
    _expect(isinstance(md, MixedBatchMetadata) and md.num_decode_tokens == num_decodes,
            f"ch11_ex2: the metadata must be a MixedBatchMetadata with num_decode_tokens={num_decodes}")
    _check_metadata(md.decode, ordered[:num_decodes], False, block_size, "metadata.decode")
    _check_metadata(md.prefill, ordered[num_decodes:], True, block_size, "metadata.prefill")
    want_rows, want_sampled, end = [], [], 0
    for s, a, b in ordered:
        end += b - a
        if b == s.num_tokens:
            want_rows.append(end - 1)
            want_sampled.append(s)
    _expect(isinstance(sample_rows, torch.Tensor) and sample_rows.dtype == torch.int64
            and sample_rows.tolist() == want_rows, f"ch11_ex2: sample_rows is {sample_rows.tolist()}, expected "
            f"{want_rows} (the row of each sequence's last token, when this step reaches it)")
    _expect(len(sampled) == len(want_sampled) and all(x is y for x, y in zip(sampled, want_sampled)),
            f"ch11_ex2: sampled holds sequences {[x.seq_id for x in sampled]}, expected "
            f"{[x.seq_id for x in want_sampled]} (those whose step reaches their last token, in row order)")


@pytest.mark.ch11
@pytest.mark.ch11_ex2
@pytest.mark.parametrize("budget, threshold, block_size", [(1, 0, 16), (7, 0, 4), (16, 5, 16), (None, 0, 16)])
def test_ch11_ex2_engine_greedy_equals_transformers(oracle, budget, threshold, block_size):
    folder, prompts, max_tokens, refs = oracle
    with graded("ch11_ex2"):
        e = _engine("ch11_ex2", folder, budget, long_prefill_token_threshold=threshold, block_size=block_size,
                    enable_prefix_caching=True)
        outs = run_graded("ch11_ex2", e, prompts, _greedy(max_tokens))
    _expect_refs("ch11_ex2", outs, prompts, refs, f"budget {budget}, threshold {threshold}, block size {block_size}")
