"""Grading tests for chapters 04-06 (`python -m minivllm.course.grade ch05_ex1`, or `pytest -m ch05_ex1`); see test_grading.py.

Each answer is graded by its contract, not by comparison with minivllm's own classes: invariants
and the exercise's rule under random operation sequences (hypothesis), then plugged into the engine,
whose greedy outputs must equal transformers'.
"""
from __future__ import annotations

import inspect
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from adapters import failed_checks, load
from engine_helpers import check_invariants, hf_greedy, make_model, one_thread, random_prompts, run_engine, speed_ratio
from minivllm.core.block_manager import BlockManager
from minivllm.engine.llm_engine import LLMEngine
from minivllm.attention.paged_attention import PagedAttention, paged_decode_attention
from minivllm.model_executor.models.llama import attention_reference
from minivllm.core.prefix_caching import PrefixCachingBlockManager
from minivllm.sampling_params import SamplingParams
from minivllm.core.sched.scheduler import Scheduler
from minivllm.course import grade as grading
from minivllm.course.grade import EXERCISES as GRADED, SPEED_RATIO
from minivllm.sequence import Sequence
from test_grading_ch04_regions import _GraderScheduler, run_graded, stand_ins, your_code
from test_grading_ch04_regions import _named_invariants as _invariants
from stand_ins import _paged_decode_stand_in
from test_prefix_caching import check_cache  # the prefix cache's invariants


def _with_grader_decode(cls):
    """`cls` with the grader's `schedule` and `schedule_decode`: in a chapter 04 edition the chapter's are
    stubs (ch04_ex3)."""
    return type(cls.__name__, (cls,), {"schedule": _GraderScheduler.schedule,
                                       "schedule_decode": _GraderScheduler.schedule_decode})

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _written_here(ex: str, module, cls: type, methods: list[str]) -> None:
    """Each of `methods` of `cls` is a function written in the exercise's file `module.__file__`.

    An inherited method would be the package's: in an edition graded with several regions released
    its stub is replaced by the grader's stand-in for the whole run (tests/stand_ins.py), so it would
    work while grading and raise NotImplementedError anywhere else."""
    where = Path(module.__file__).resolve()
    for name in methods:
        fn = inspect.getattr_static(cls, name, None)
        fn = getattr(fn, "__func__", fn)  # a staticmethod's or classmethod's function
        code = getattr(fn, "__code__", None)
        _expect(code is not None and Path(code.co_filename).resolve() == where,
                f"{ex}: {cls.__name__}.{name} is not written in {where.parent.name}/{where.name} (it is "
                f"{'missing' if fn is None else getattr(fn, '__qualname__', type(fn).__name__)}"
                f"{' from ' + code.co_filename if code is not None else ''}): the exercise asks you to write it there")


@pytest.fixture(scope="module")
def ch04(impl_name):
    return load("ch04_scheduler", impl_name)


@pytest.fixture(scope="module")
def ch05(impl_name):
    return load("ch05_paged_attention", impl_name)


@pytest.fixture(scope="module")
def ch06(impl_name):
    return load("ch06_prefix_caching", impl_name)


@pytest.fixture(scope="module")
def engine_case(tmp_path_factory):
    """A tiny model, 12 prompts, and minivllm's own greedy outputs on a cache small enough to preempt."""
    folder = tmp_path_factory.mktemp("grading-engine")
    make_model(folder, "llama")
    prompts = random_prompts(12, 1, 80, seed=3, vocab=8)  # a small vocabulary: shared prefixes happen
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kwargs = dict(model=folder, dtype="float64", max_model_len=128, block_size=4, num_kvcache_blocks=40,
                  block_manager_cls=BlockManager, attention_backend=PagedAttention)
    with stand_ins():  # the grader's scheduler and batch layout (chapter 04's are stubs in its edition)
        ref = [o.outputs[0].token_ids for o in run_engine(LLMEngine(**kwargs, scheduler_cls=_GraderScheduler), prompts,
                                                          params)]
    return kwargs, prompts, params, ref


def _engine_unchanged(engine_case, **plug):
    kwargs, prompts, params, ref = engine_case
    engine = LLMEngine(**{**kwargs, **plug})
    assert [o.outputs[0].token_ids for o in run_engine(engine, prompts, params)] == ref
    assert engine.scheduler.num_preemptions > 0
    check_invariants(engine)


def _op(kind: str, tokens: list[int], n: int, k: int) -> tuple:
    """("add", prompt, max_tokens), ("step", the tokens sampled) or ("abort", which sequence)."""
    return {"add": ("add", tokens, n), "step": ("step", tokens), "abort": ("abort", k)}[kind]


# A random workload: adds of short prompts over a 3-token vocabulary, more steps, a few aborts. Built
# from lists and integers, so that hypothesis shrinks a failing workload to its few needed operations.
OPS = st.lists(st.builds(_op, st.sampled_from(["add"] * 5 + ["step"] * 7 + ["abort"]),
                         st.lists(st.integers(1, 3), min_size=1, max_size=10), st.integers(1, 10),
                         st.integers(0, 30)), max_size=40)


def _seqs(seqs) -> str:
    return "[" + ", ".join(f"{s.seq_id} ({s.num_tokens} token{'s' * (s.num_tokens != 1)})" for s in seqs) + "]"


def _ch04_step(sched, step: int, sampled: list[int]) -> None:
    """One `schedule()` checked against the shortest-prompt-first contract, then `postprocess`."""
    bm, max_num_seqs, budget = sched.block_manager, sched.max_num_seqs, sched.max_num_batched_tokens
    at = f"ch04_ex1: step {step} ({type(bm).__name__} of {bm.num_blocks} blocks of {bm.block_size}, " \
         f"max_num_seqs={max_num_seqs}, max_num_batched_tokens={budget}): "
    waiting, running = list(sched.waiting), list(sched.running)
    shortest = min(waiting, key=lambda s: s.num_tokens) if waiting else None  # the first of the shortest
    fits = (shortest is not None and len(running) < max_num_seqs and shortest.num_tokens <= budget
            and bm.can_allocate(shortest))
    with your_code("ch04_ex1", f"step {step}: schedule() with waiting {_seqs(waiting)}"):
        batch, is_prefill = sched.schedule()
    _expect(bool(batch) or sched.is_finished(), f"{at}nothing scheduled although sequences "
            f"{_seqs(sched.waiting)} wait and {_seqs(sched.running)} run")
    if fits:
        _expect(is_prefill, f"{at}the shortest waiting sequence, {_seqs([shortest])}, fits ({len(running)} "
                f"running, {bm.num_free_blocks} free blocks), so this must be a prefill step; got a decode of "
                f"{_seqs(batch)}")
    if is_prefill:
        _expect(bool(batch) and all(s in waiting for s in batch) and len(set(map(id, batch))) == len(batch),
                f"{at}a prefill admits waiting sequences, each once: waiting was {_seqs(waiting)}, got {_seqs(batch)}")
        left = [s for s in waiting if s not in batch]
        _expect(not left or max(s.num_tokens for s in batch) <= min(s.num_tokens for s in left),
                f"{at}admitted {_seqs(batch)} while {_seqs(left)} wait: a longer prompt was admitted while a "
                f"shorter one waits (waiting was {_seqs(waiting)})")
        used = sum(s.num_tokens - s.num_cached_tokens for s in batch)
        _expect(used <= budget, f"{at}the prefill of {_seqs(batch)} computes {used} tokens (their tokens minus "
                f"their num_cached_tokens), over max_num_batched_tokens={budget}")
        _expect(list(sched.waiting) == left, f"{at}after admitting {_seqs(batch)}, waiting should be "
                f"{_seqs(left)} (the others, in their order), got {_seqs(sched.waiting)}")
        _expect(list(sched.running)[:len(running)] == running, f"{at}after admitting {_seqs(batch)}, "
                f"running should start with those already running, {_seqs(running)}; got {_seqs(sched.running)}")
    else:
        _expect(all(s in running for s in batch) and set(map(id, sched.running)) == set(map(id, batch)),
                f"{at}a decode step runs the running sequences {_seqs(running)}; got {_seqs(batch)}, running "
                f"after it {_seqs(sched.running)}")
        _expect(list(sched.waiting)[len(sched.waiting) - len(waiting):] == waiting, f"{at}after a decode, "
                f"waiting should end with {_seqs(waiting)}, got {_seqs(sched.waiting)}")
    _expect(len(sched.running) <= max_num_seqs, f"{at}{len(sched.running)} running, more than "
            f"max_num_seqs={max_num_seqs}")
    sched.postprocess(batch, (sampled * 10)[:len(batch)])


def _ch04_drive(scheduler_cls, manager, ops, max_num_seqs, budget=24, max_model_len=24):
    """Drive a scheduler through `ops`, checking the shortest-prompt-first contract at every step."""
    sched = scheduler_cls(manager, max_num_seqs, budget, max_model_len, {0})
    bm, seqs, step = sched.block_manager, [], 0
    for op in ops:
        if op[0] == "add":
            seq = Sequence(op[1], SamplingParams(max_tokens=op[2]), block_size=bm.block_size, seq_id=len(seqs))
            seqs.append(seq)
            if seq.num_blocks <= bm.num_blocks and seq.num_tokens < max_model_len:
                sched.add(seq)
        elif op[0] == "step":
            step += 1
            _ch04_step(sched, step, op[1])
        elif seqs:
            sched.abort(seqs[op[1] % len(seqs)])
        _invariants("ch04_ex1", sched, f"{op[0]} (step {step})")
    for _ in range(2000):  # drain, each step checked as above: nothing hangs
        if sched.is_finished():
            break
        step += 1
        _ch04_step(sched, step, [1])
        _invariants("ch04_ex1", sched, f"step {step}")
    _expect(sched.is_finished(), f"ch04_ex1: sequences {_seqs([*sched.waiting, *sched.running])} never finished")
    _expect(bm.num_free_blocks == bm.num_blocks, f"ch04_ex1: {bm.num_blocks - bm.num_free_blocks} blocks still held "
            "after every request finished")


@pytest.mark.ch04
@pytest.mark.ch04_ex1
@settings(max_examples=300, deadline=None, report_multiple_bugs=False)  # short workloads: many of them
@given(ops=OPS, block_size=st.integers(1, 4), num_blocks=st.integers(3, 10), max_num_seqs=st.integers(1, 4),
       manager=st.sampled_from(["paged", "prefix", "contiguous"]), budget=st.integers(8, 24))
def test_ch04_ex1_shortest_first_contract(ch04, ops, block_size, num_blocks, max_num_seqs, manager, budget):
    """Random adds, steps and aborts: shortest prompts admitted first, limits and invariants kept."""
    from minivllm.core.kv_cache_manager import ContiguousBlockManager

    bm = {"paged": lambda: BlockManager(num_blocks, block_size),
          "prefix": lambda: PrefixCachingBlockManager(num_blocks, block_size),
          "contiguous": lambda: ContiguousBlockManager(num_blocks, 24)}[manager]()
    # max_model_len = the budget, as the engine ensures: a preempted sequence always fits a prefill again
    _ch04_drive(_with_grader_decode(ch04.MyScheduler), bm, ops, max_num_seqs, budget, budget)


@pytest.mark.ch04
@pytest.mark.ch04_ex1
def test_ch04_ex1_written_in_the_exercise_file(ch04):
    """The admission policy is the student's own `schedule_prefill`, not the inherited one (`_written_here`)."""
    _written_here("ch04_ex1", ch04, ch04.MyScheduler, ["schedule_prefill"])


@pytest.mark.ch04
@pytest.mark.ch04_ex1
def test_ch04_ex1_admits_the_short_ones_first(ch04):
    """Prompts of 9, 2, 5 and 3 tokens, a budget of 10 tokens: 2, 3 and 5 go first, then 9."""
    sched = _with_grader_decode(ch04.MyScheduler)(BlockManager(64, 4), 8, 10, 64, {0})
    seqs = [Sequence(list(range(1, n + 1)), SamplingParams(max_tokens=1), block_size=4, seq_id=i)
            for i, n in enumerate((9, 2, 5, 3))]
    for s in seqs:
        sched.add(s)
    at = "ch04_ex1: prompts of 9, 2, 5 and 3 tokens wait, max_num_batched_tokens=10:"
    with your_code("ch04_ex1", "the first schedule()"):
        batch, is_prefill = sched.schedule()
    got = sorted(s.num_tokens for s in batch)
    _expect(is_prefill and got == [2, 3, 5], f"{at} the first step should be a prefill of the prompts of 2, 3 and "
            f"5 tokens (shortest first, 10 tokens in all), got a {'prefill' if is_prefill else 'decode'} of "
            f"prompts of {got} tokens")
    sched.postprocess(batch, [1] * 3)  # max_tokens=1: all three finish
    with your_code("ch04_ex1", "the second schedule()"):
        batch, is_prefill = sched.schedule()
    _expect(is_prefill and batch == [seqs[0]], f"{at} once those three finished, the second step should be a "
            f"prefill of the 9-token prompt, got a {'prefill' if is_prefill else 'decode'} of {_seqs(batch)}")


@pytest.fixture(scope="module")
def ch04_oracle(engine_case):
    """transformers' greedy tokens for `engine_case`'s prompts (not minivllm's)."""
    from transformers import AutoModelForCausalLM

    kwargs, prompts, params, _ = engine_case
    hf = AutoModelForCausalLM.from_pretrained(kwargs["model"], dtype=torch.float64).eval()
    return [hf_greedy(hf, p, params.max_tokens) for p in prompts]


@pytest.mark.ch04
@pytest.mark.ch04_ex1
@pytest.mark.parametrize("manager", ["paged", "contiguous"])
def test_ch04_ex1_engine_equals_transformers(ch04, engine_case, ch04_oracle, manager):
    from minivllm.attention.backend import ContiguousAttention
    from minivllm.core.kv_cache_manager import ContiguousBlockManager

    kwargs, prompts, params, _ = engine_case
    if manager == "contiguous":  # 3 regions of 128 tokens: short prompts overtake long ones
        kwargs = {**kwargs, "block_manager_cls": ContiguousBlockManager, "attention_backend": ContiguousAttention,
                  "num_kvcache_blocks": 3 * 128 // kwargs["block_size"]}
    with stand_ins():  # the grader's batch layout: in a chapter 04 edition the chapter's is a stub
        engine = LLMEngine(**kwargs, scheduler_cls=_with_grader_decode(ch04.MyScheduler))
        outs = run_graded("ch04_ex1", engine, prompts, params)
    _same_tokens("ch04_ex1", f"the engine with MyScheduler ({manager} KV cache)", prompts, outs, ch04_oracle)
    if manager == "paged":
        assert engine.scheduler.num_preemptions > 0, "grader setup: the cache should have been tight enough to preempt"
    _invariants("ch04_ex1", engine, "every request finished")


def _same_tokens(ex: str, who: str, prompts, outs, refs) -> None:
    """Each output's greedy tokens equal transformers'; a failure names `ex`, the prompt and the first difference."""
    for i, (o, r) in enumerate(zip(outs, refs)):
        g = o.outputs[0].token_ids
        j = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
        _expect(g == r, f"{ex}: prompt {i} ({len(prompts[i])} tokens): {who} generated {g}, transformers {r} (first "
                f"difference at completion token {j})")


# --- chapter 05 ----------------------------------------------------------------------------------
# ch05_ex1 (rebuild: the build of the paged KV cache) grades the package's own `BlockManager` methods
# (can_allocate, allocate, deallocate, needs_new_block, can_append, may_append) and
# `paged_decode_attention`: in a student edition these are the student's code, exported from the
# chapter (stubs until filled), and there is no reference to compare with. It scores by parts
# (`@pytest.mark.group`, the groups of `EXERCISES["ch05_ex1"]`), each on its own: `_Scaffold` is the
# grader's own block manager, every method of the build written on the pool's primitives, and stands
# in for the methods a part is not about (`_graded`); the engine's decode goes through the package's
# `paged_decode_attention` (`_ReferenceDecode`). Random workloads are derandomized (the same answer
# always scores the same points). The tests after the parts check that plausible wrong answers lose
# their part's points.
ALLOCS, APPENDS, PREEMPTS, DECODES, ENGINE, SPEED = (name for name, _ in GRADED["ch05_ex1"].groups)
CH05_PARTS = {"alloc": ("can_allocate", "allocate", "deallocate"),
              "append": ("needs_new_block", "can_append", "may_append")}
CH05_BUILD_METHODS = [m for methods in CH05_PARTS.values() for m in methods]


class _Scaffold(BlockManager):
    """The grader's block manager: every method of ch05_ex1. It frees the tail first, as the book does: in an
    edition it stands in for ch05_ex1 wherever another exercise is graded, and chapter 06's prefix cache keeps
    a freed block's content and evicts leaves before their parents, an order its graders check."""

    def can_allocate(self, seq: Sequence) -> bool:
        return seq.num_blocks <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        seq.num_cached_tokens = 0
        seq.block_table = [self._allocate_block().block_id for _ in range(seq.num_blocks)]

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_block(block)
        seq.block_table, seq.num_cached_tokens = [], 0

    def needs_new_block(self, seq: Sequence) -> bool:
        return (seq.num_tokens - 1) // self.block_size >= len(seq.block_table)

    def can_append(self, seq: Sequence) -> bool:
        return self.num_free_blocks > 0 or len(seq.block_table) * self.block_size >= seq.num_tokens

    def may_append(self, seq: Sequence) -> None:
        while len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._allocate_block().block_id)


def _graded(part: str) -> type[BlockManager]:
    """The block manager that grades `part`: "alloc" or "append" the package's (the student's) methods
    of that part and the grader's others; "whole" the package's `BlockManager` as it is."""
    if part == "whole":
        return BlockManager
    return type(f"Graded_{part}", (_Scaffold,), {m: inspect.getattr_static(BlockManager, m) for m in CH05_PARTS[part]})


def _ch05_check(ex: str, bm: BlockManager, live: list[Sequence], after: str, covering=None) -> None:
    """The pool's state against the live block tables, each of `covering` (default: all live) covering
    its sequence; a failure names `ex` and what was expected."""
    at = f"{ex}: after {after}: "
    held = Counter(b for s in live for b in s.block_table)
    for s in live if covering is None else covering:
        _expect(len(s.block_table) == s.num_blocks, f"{at}a sequence of {s.num_tokens} tokens needs {s.num_blocks} "
                f"blocks of {bm.block_size} slots, its block_table is {s.block_table}")
        _expect(len(set(s.block_table)) == len(s.block_table), f"{at}block_table {s.block_table} holds a block twice")
    bad = sorted(b for b in held if not (isinstance(b, int) and 0 <= b < bm.num_blocks))
    _expect(not bad, f"{at}block ids {bad} are not ints in [0, {bm.num_blocks})")
    for b, n in held.items():
        _expect(bm.blocks[b].ref_count == n, f"{at}block {b} is in {n} block table(s) but its ref_count is "
                f"{bm.blocks[b].ref_count}")
    free = list(bm.free_block_ids)
    _expect(len(set(free)) == len(free), f"{at}a block is in the free queue twice: {free}")
    both = sorted(set(held) & set(free))
    _expect(not both, f"{at}blocks {both} are in a block table and also free")
    lost = sorted(set(range(bm.num_blocks)) - set(held) - set(free))
    _expect(not lost, f"{at}blocks {lost} are in no block table and not free: a block never freed (leaked)")
    _expect(bm.used_block_ids == set(held), f"{at}used_block_ids {sorted(bm.used_block_ids)} should be the blocks "
            f"the tables hold, {sorted(held)}")
    _expect(bm.num_free_blocks == bm.num_blocks - len(held), f"{at}num_free_blocks is {bm.num_free_blocks}, "
            f"expected {bm.num_blocks} - {len(held)} held")


CH05_OPS = st.lists(st.one_of(st.tuples(st.just("add"), st.integers(1, 12)), st.tuples(st.just("grow"), st.integers(0, 9)),
                              st.tuples(st.just("fork"), st.integers(0, 9)), st.tuples(st.just("free"), st.integers(0, 9))),
                    max_size=40)


def _ch05_add(ex: str, bm: BlockManager, live: list[Sequence], n: int) -> None:
    """Admit a sequence of `n` tokens if `can_allocate` says it fits (checked against the free count)."""
    seq, bs = Sequence([7] * n, block_size=bm.block_size), bm.block_size
    fits, before = bm.num_free_blocks >= seq.num_blocks, bm.num_free_blocks
    with your_code(ex, f"can_allocate of a {n}-token sequence"):
        said = bm.can_allocate(seq)
    _expect(said == fits, f"{ex}: can_allocate of a {n}-token sequence (it needs {seq.num_blocks} blocks of {bs} "
            f"slots) with {before} free blocks should be {fits}, got {said!r}")
    if not fits:
        return
    seq.num_cached_tokens, first = 3, list(bm.free_block_ids)[:seq.num_blocks]
    with your_code(ex, f"allocate of a {n}-token sequence"):
        bm.allocate(seq)
    _expect(seq.num_cached_tokens == 0, f"{ex}: allocate must set num_cached_tokens to 0 (nothing is cached)")
    _expect(bm.num_free_blocks == before - seq.num_blocks, f"{ex}: allocate of a {n}-token sequence should take "
            f"{seq.num_blocks} blocks of {bs} slots, took {before - bm.num_free_blocks}")
    _expect(seq.block_table == first, f"{ex}: allocate of a {n}-token sequence should take the free queue's first "
            f"{seq.num_blocks} blocks in order (self._allocate_block() each), {first}; its block_table is {seq.block_table}")
    live.append(seq)


def _ch05_grow(ex: str, bm: BlockManager, live: list[Sequence], seq: Sequence) -> None:
    """Append a token to `seq`, then room for it: exactly one block at a block boundary, none otherwise;
    without room (`can_append` false) the sequence is preempted, as the scheduler would."""
    old, n_table, bs = list(seq.block_table), len(seq.block_table), bm.block_size
    seq.append_token(7)
    need, before = (seq.num_tokens - 1) % bs == 0, bm.num_free_blocks
    at = (f"{ex}: a sequence of {seq.num_tokens} tokens (its newest at position {seq.num_tokens - 1}) holding "
          f"{n_table} block(s) of {bs}, {before} free")
    with your_code(ex, f"needs_new_block and can_append of a sequence of {seq.num_tokens} tokens"):
        needs, room = bm.needs_new_block(seq), bm.can_append(seq)
    _expect(needs == need, f"{at}: needs_new_block should be {need} (the newest token "
            f"{'starts block ' + str(n_table) if need else 'fits block ' + str(n_table - 1)}), got {needs!r}")
    _expect(room == (before >= need), f"{at}: can_append should be {before >= need} (it needs {int(need)} block), "
            f"got {room!r}")
    if not room:
        bm.deallocate(seq)
        live.remove(seq)
        return
    front = next(iter(bm.free_block_ids), None)
    with your_code(ex, f"may_append of a sequence of {seq.num_tokens} tokens"):
        bm.may_append(seq)
    _expect(bm.num_free_blocks == before - need, f"{at}: may_append should take {int(need)} block(s), took "
            f"{before - bm.num_free_blocks}")
    _expect(seq.block_table[:n_table] == old and len(seq.block_table) == n_table + need, f"{at}: after may_append "
            f"its block_table should be {old} with {int(need)} block(s) appended, it is {seq.block_table}")
    if need:
        _expect(seq.block_table[-1] == front, f"{at}: may_append should append the free queue's first block, {front} "
                f"(self._allocate_block()), got block_table {seq.block_table}")


def _ch05_free(ex: str, bm: BlockManager, live: list[Sequence], seq: Sequence) -> None:
    """Deallocate `seq` (no longer in `live`): its blocks nobody else holds must be free, the others not."""
    table = list(seq.block_table)
    seq.num_cached_tokens = min(seq.num_tokens - 1, bm.block_size)  # as chapter 06's prefix caching may leave it
    with your_code(ex, f"deallocate of block_table {table}"):
        bm.deallocate(seq)
    _expect(seq.block_table == [] and seq.num_cached_tokens == 0, f"{ex}: after deallocate the block_table must "
            f"be [] and num_cached_tokens 0, got {seq.block_table} and {seq.num_cached_tokens}")
    others, free = {b for s in live for b in s.block_table}, set(bm.free_block_ids)
    for b in table:
        _expect(b in others or b in free, f"{ex}: block {b} of the deallocated block_table {table} is held by no "
                f"other sequence but was never freed (ref_count {bm.blocks[b].ref_count}, not in free_block_ids)")
        _expect(b not in others or b not in free, f"{ex}: block {b} of the deallocated block_table {table} was "
                "freed although another sequence still holds it")


def _ch05_drive(ex: str, cls: type[BlockManager], ops: list[tuple], block_size: int, num_blocks: int) -> None:
    """Admit, grow (preempting when no block is free), fork (share every block, as chapter 06 and
    parallel sampling do) and free sequences; check the pool after every operation."""
    bm = cls(num_blocks, block_size)
    live: list[Sequence] = []
    for op, arg in ops:
        if op == "add":
            _ch05_add(ex, bm, live, arg)
        elif not live:
            continue
        elif op == "grow":
            _ch05_grow(ex, bm, live, live[arg % len(live)])
        elif op == "fork":
            seq = live[arg % len(live)]
            child = Sequence(list(seq.token_ids), block_size=block_size)
            child.block_table = list(seq.block_table)
            for b in child.block_table:
                bm.blocks[b].ref_count += 1
            live.append(child)
        else:
            _ch05_free(ex, bm, live, live.pop(arg % len(live)))
        _ch05_check(ex, bm, live, f"{op} {arg}")
    while live:
        _ch05_free(ex, bm, live, live.pop())
    _ch05_check(ex, bm, [], "freeing every sequence")


def check_manager_contract(cls: type[BlockManager], ex: str = "ch05_ex1", max_examples: int = 150) -> None:
    """Random admissions, growth, forks and frees on `cls`: `can_allocate` and `can_append` say exactly
    when there is room; tables cover their sequences with the free queue's first blocks, one more
    exactly at each block boundary; reference counts equal the tables holding each block, every other
    block is free. Any order of freeing passes."""
    @settings(max_examples=max_examples, deadline=None, report_multiple_bugs=False, database=None,
              derandomize=True)
    # a fixed case first (the draws depend on where the check is called from): an exact fit, a shared block freed
    @example(ops=[("add", 4), ("fork", 0), ("free", 0)], block_size=2, num_blocks=2)
    @given(ops=CH05_OPS, block_size=st.integers(1, 4), num_blocks=st.integers(1, 12))
    def run(ops, block_size, num_blocks):
        _ch05_drive(ex, cls, ops, block_size, num_blocks)
    run()


def check_block_boundaries(cls: type[BlockManager], ex: str = "ch05_ex1") -> None:
    """Two sequences of 4 tokens in 3 blocks of 4, the first grown to 9 tokens: its 5th token takes the
    last free block; its 6th to 8th fit that block (room even with none free); its 9th has no room.
    Then blocks of 1: every token takes a block."""
    bm, got = cls(3, 4), []
    a, b = (Sequence([1, 2, 3, 4], block_size=4) for _ in range(2))
    for seq in (a, b):
        bm.allocate(seq)
    for _ in range(5):
        a.append_token(5)
        with your_code(ex, f"needs_new_block and can_append of a sequence of {a.num_tokens} tokens (blocks of 4)"):
            needs, room = bm.needs_new_block(a), bm.can_append(a)
            if room:
                bm.may_append(a)
        got.append((a.num_tokens, needs, room, len(a.block_table)))
    want = [(5, True, True, 2), (6, False, True, 2), (7, False, True, 2), (8, False, True, 2), (9, True, False, 2)]
    _expect(got == want, f"{ex}: blocks of 4, 3 blocks, two sequences of 4 tokens; the first grows a token at a time "
            f"(needs_new_block, can_append, then may_append when there is room): expected (tokens, needs_new_block, "
            f"can_append, blocks held) {want}, got {got}")
    bm, c = cls(4, 1), Sequence([1], block_size=1)
    bm.allocate(c)
    for n in range(2, 5):
        c.append_token(5)
        with your_code(ex, f"may_append of a sequence of {n} tokens (blocks of 1)"):
            bm.may_append(c)
        _expect(len(c.block_table) == n and bm.num_free_blocks == 4 - n, f"{ex}: blocks of 1 token: a sequence of {n} "
                f"tokens holds {n} blocks after may_append, got block_table {c.block_table}")


def check_survives_preemption(cls: type[BlockManager], ex: str = "ch05_ex1", max_examples: int = 60) -> None:
    """The grader's scheduler on a `cls` cache with `spare` blocks beyond the prompts, every prompt
    admitted, then decoded to the end: preemption after preemption; after every `schedule()` each
    running sequence's table covers it, preempted ones hold nothing and the pool adds up; all free at
    the end."""
    def drive(lens, block_size, spare, max_tokens) -> int:
        need = sum(-(-n // block_size) for n in lens)
        budget = max(24, sum(lens))
        sched = _GraderScheduler(cls(need + spare, block_size), len(lens), budget, budget, set())
        bm = sched.block_manager
        for i, n in enumerate(lens):
            sched.add(Sequence([1] * n, SamplingParams(max_tokens=max_tokens), block_size=block_size, seq_id=i))
        where = f"{len(lens)} prompts of {lens} tokens, {need + spare} blocks of {block_size}, max_tokens={max_tokens}"
        for step in range(1, 500):
            if sched.is_finished():
                break
            with your_code(ex, f"step {step} of the grader's scheduler ({where})"):
                batch, _ = sched.schedule()
            # the step's batch has room for its tokens; a running sequence left out of a prefill step
            # waits with its newest token not yet given a slot
            _ch05_check(ex, bm, list(sched.running), f"scheduling step {step} ({where})", covering=batch)
            held = [s.seq_id for s in sched.waiting if s.block_table]
            _expect(not held, f"{ex}: after scheduling step {step} ({where}): waiting sequences {held} still hold "
                    "blocks (a preempted sequence gives all of them back: deallocate)")
            with your_code(ex, f"step {step}: the finished sequences' deallocate ({where})"):
                sched.postprocess(batch, [1] * len(batch))
        _expect(sched.is_finished(), f"{ex}: {where}: requests never finished")
        _expect(bm.num_free_blocks == bm.num_blocks, f"{ex}: {where}: {bm.num_blocks - bm.num_free_blocks} blocks "
                "still held after every request finished")
        return sched.num_preemptions

    assert drive([4, 4, 4], 2, 0, 6) > 0, "grader setup: the cache should have been tight enough to preempt"

    @settings(max_examples=max_examples, deadline=None, report_multiple_bugs=False, database=None,
              derandomize=True)
    @given(lens=st.lists(st.integers(1, 6), min_size=2, max_size=5), block_size=st.integers(1, 3),
           spare=st.integers(0, 2), max_tokens=st.integers(2, 8))
    def run(lens, block_size, spare, max_tokens):
        drive(lens, block_size, spare, max_tokens)
    run()


PARTS_CH05 = [pytest.param(part, marks=pytest.mark.group(group), id=part)
              for part, group in {"alloc": ALLOCS, "append": APPENDS}.items()]


@pytest.mark.ch05
@pytest.mark.ch05_ex1
@pytest.mark.parametrize("part", PARTS_CH05)
def test_ch05_ex1_block_manager_contract(part):
    """One part of the block manager (admission and release, or growth) with the grader's others:
    random admissions, growth, forks and frees (see `check_manager_contract`)."""
    check_manager_contract(_graded(part))


@pytest.mark.ch05
@pytest.mark.ch05_ex1
@pytest.mark.group(APPENDS)
def test_ch05_ex1_appends_at_each_block_boundary():
    check_block_boundaries(_graded("append"))


@pytest.mark.ch05
@pytest.mark.ch05_ex1
@pytest.mark.group(PREEMPTS)
def test_ch05_ex1_survives_preemption():
    check_survives_preemption(_graded("whole"))


def _paged_case(lens, block_size, groups, seed, dtype):
    """Random q and K/V stored under shuffled block tables: (q, k_cache, v_cache, block_tables, ks, vs)."""
    g = torch.Generator().manual_seed(seed)
    kvh, d = 2, 8
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 1
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, start = [], 0
    for k in need:
        tables.append(perm[start:start + k])
        start += k
    bt = torch.tensor([t + [-1] * (max(need) - len(t)) for t in tables])
    k_cache, v_cache = torch.randn(2, num_blocks, block_size, kvh, d, generator=g, dtype=torch.float64).to(dtype)
    q = torch.randn(len(lens), kvh * groups, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k_cache, v_cache, bt, tables


# float64: rounding only (1e-12). float32: about 1e-7 relative per operation over a few dozen keys.
# bfloat16 keeps 8 significant bits: scores of size ~3 carry errors ~1e-2, which the softmax turns into
# relative errors of that size in the weights, so 5e-2 absolute on outputs of size ~1.
CH05_TOL = {torch.float64: (1e-12, 0.0), torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-2, 2e-2)}


@pytest.mark.ch05
@pytest.mark.ch05_ex1
@pytest.mark.group(DECODES)
@pytest.mark.parametrize("dtype", list(CH05_TOL), ids=str)
@settings(max_examples=40, deadline=None, report_multiple_bugs=False, database=None, derandomize=True)
@given(lens=st.lists(st.integers(1, 20), min_size=1, max_size=5), block_size=st.integers(1, 6),
       groups=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_ch05_ex1_paged_decode_equals_attention(dtype, lens, block_size, groups, seed):
    """Each sequence's query over its keys read through a shuffled block table equals
    `attention_reference` on its contiguous K/V (computed in float64 from the same rounded inputs)."""
    _check_paged_decode(lens, block_size, groups, seed, dtype)


def _check_paged_decode(lens, block_size, groups, seed, dtype, what: str = "context_lens", decode=None) -> None:
    """`decode` (default: the package's, the student's) over `_paged_case(...)` against
    `attention_reference`, sequence by sequence."""
    q, k_cache, v_cache, bt, tables = _paged_case(lens, block_size, groups, seed, dtype)
    with your_code("ch05_ex1", f"paged_decode_attention ({dtype}, {what} {lens}, block_size {block_size})"):
        got = (decode or paged_decode_attention)(q, k_cache, v_cache, bt, torch.tensor(lens), 0.35)
    _expect(isinstance(got, torch.Tensor) and got.shape == q.shape and got.dtype == q.dtype,
            f"ch05_ex1: paged_decode_attention should return a tensor of shape {tuple(q.shape)} and dtype {q.dtype}, "
            f"got {got.shape if isinstance(got, torch.Tensor) else type(got).__name__}"
            f"{' ' + str(got.dtype) if isinstance(got, torch.Tensor) else ''}")
    atol, rtol = CH05_TOL[dtype]
    for i, n in enumerate(lens):
        k = k_cache[tables[i]].flatten(0, 1)[:n].double()
        v = v_cache[tables[i]].flatten(0, 1)[:n].double()
        want = attention_reference(q[i:i + 1].double(), k, v, 0.35)[0]
        torch.testing.assert_close(got[i].double(), want, atol=atol, rtol=rtol, msg=lambda m: (
            f"ch05_ex1 ({dtype}): paged decode of sequence {i} ({n} keys over {len(tables[i])} blocks) of {what} "
            f"{lens}, block_size {block_size}, block table {tables[i]}, {q.shape[1]} query heads over 2 K/V heads: {m}"))


# Long contexts (hundreds of keys, ragged, block tables shuffled over a large cache): an answer that
# reads a fixed number of keys, or a buffer sized for short prompts, fails here. Block sizes 16 and 7
# (a context rarely ends on a block's edge).
CH05_LONG = [([300, 517, 1, 129, 452], 16, 2, 11), ([640, 33, 401], 7, 3, 12), ([258, 259], 16, 1, 13)]


@pytest.mark.ch05
@pytest.mark.ch05_ex1
@pytest.mark.group(DECODES)
@pytest.mark.parametrize("dtype", list(CH05_TOL), ids=str)
@pytest.mark.parametrize("lens,block_size,groups,seed", CH05_LONG, ids=lambda p: None)
def test_ch05_ex1_long_contexts(dtype, lens, block_size, groups, seed):
    """Contexts of several hundred tokens, as above: each sequence equals `attention_reference` on its
    contiguous K/V (float64 from the same rounded inputs; the tolerances above: the softmax's sum over
    more keys adds rounding of the same relative size)."""
    _check_paged_decode(lens, block_size, groups, seed, dtype, what="long contexts")


def check_paged_decode(decode) -> None:
    """`decode` on a few fixed batches (float64): ragged lengths ending inside blocks, one to three query
    heads per K/V head, a long context."""
    for lens, block_size, groups, seed in [([5, 1, 13], 4, 1, 1), ([7, 3], 3, 2, 2), ([9, 16, 2], 4, 3, 3),
                                           CH05_LONG[1]]:
        _check_paged_decode(lens, block_size, groups, seed, torch.float64, decode=decode)


def _speed_case(seed: int = 5, num_seqs: int = 48, block_size: int = 16, kv_heads: int = 3, groups: int = 3,
                head_dim: int = 64):
    """A decode batch shaped like the default model's (9 query heads over 3 K/V heads of 64), float32:
    `num_seqs` contexts of 16-512 tokens in blocks shuffled over the cache."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(16, 513, (num_seqs,), generator=g)
    need = [-(-n // block_size) for n in lens.tolist()]
    num_blocks = sum(need) + 7
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(num_seqs)]
    bt = torch.tensor([t + [-1] * (max(need) - len(t)) for t in tables])
    k_cache, v_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    q = torch.randn(num_seqs, kv_heads * groups, head_dim, generator=g)
    return q, k_cache, v_cache, bt, lens, head_dim ** -0.5


@pytest.mark.ch05
@pytest.mark.ch05_ex1
@pytest.mark.group(SPEED)
def test_ch05_ex1_paged_decode_speed(record_property):
    """The speed part: the package's (the student's) `paged_decode_attention` on a decode batch of the
    default model's shape (48 sequences, 16-512 tokens, float32), first checked against the reference
    (float32 tolerance as above), then timed side by side with the grader's stand-in
    `_paged_decode_stand_in` (a batched gather and one attention call) on this machine's torch threads (`speed_ratio`: the median of 11 rounds' ratios). The ratio scores by
    `EXERCISES["ch05_ex1"].speed`'s bands; a shared machine slows both alike."""
    case = _speed_case()
    with your_code("ch05_ex1", "paged_decode_attention (the speed part's batch: 48 sequences, float32)"):
        got = paged_decode_attention(*case)
    torch.testing.assert_close(got, _paged_decode_stand_in(*case), atol=1e-5, rtol=1e-5, msg=lambda m: (
        f"ch05_ex1: paged decode of the speed part's batch differs from the reference (so it is not timed): {m}"))
    ratio = speed_ratio(lambda: paged_decode_attention(*case), lambda: _paged_decode_stand_in(*case), rounds=11)
    record_property(SPEED_RATIO, ratio)


class _ReferenceDecode(PagedAttention):
    """The backend with decode through `paged_decode_attention` (the package's, the student's)."""

    def decode(self, q, k_cache, v_cache, md):
        return paged_decode_attention(q, k_cache, v_cache, md.block_tables, md.context_lens, self.scale)


@pytest.mark.ch05
@pytest.mark.ch05_ex1
@pytest.mark.group(ENGINE)
def test_ch05_ex1_engine_equals_transformers(ch05_engine_case):
    """The engine on the package's (the student's) block manager, decoding through its
    `paged_decode_attention`, on a cache small enough to preempt: greedy tokens equal transformers',
    every block free at the end."""
    folder, prompts, ref = ch05_engine_case
    with your_code("ch05_ex1", "building the engine"):
        engine = LLMEngine(model=folder, dtype="float64", max_model_len=120, block_size=4, num_kvcache_blocks=30,
                           block_manager_cls=BlockManager, attention_backend=_ReferenceDecode)
    outs = run_graded("ch05_ex1", engine, prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    _same_tokens("ch05_ex1", "the engine on your block manager and paged decode", prompts, outs, ref)
    assert engine.scheduler.num_preemptions > 0, "grader setup: the cache should have been tight enough to preempt"
    _expect(engine.block_manager.num_free_blocks == engine.block_manager.num_blocks,
            f"ch05_ex1: {engine.block_manager.num_blocks - engine.block_manager.num_free_blocks} blocks still held "
            "after every request finished")


# --- plausible wrong answers lose their part's points (not graded: they check the graders) ---------
class _FreesShared(_Scaffold):
    """deallocate that frees every block of the table, shared ones too (reference counts ignored)."""

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count = 0
            self._free_block(block)
        seq.block_table, seq.num_cached_tokens = [], 0


class _KeepsCachedTokens(_Scaffold):
    """deallocate that empties the table but leaves `num_cached_tokens` as it was (harmless in chapter
    05, where `allocate` resets it; wrong from chapter 06 on, where a prefix hit sets it)."""

    def deallocate(self, seq: Sequence) -> None:
        cached = seq.num_cached_tokens
        _Scaffold.deallocate(self, seq)
        seq.num_cached_tokens = cached


class _RefusesAnExactFit(_Scaffold):
    """can_allocate that wants a block to spare (`>` for `>=`)."""

    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_free_blocks > seq.num_blocks


class _AppendsOneTooLate(_Scaffold):
    """Growth that takes the new block one token after the boundary (the newest token has no slot)."""

    def needs_new_block(self, seq: Sequence) -> bool:
        return len(seq.block_table) * self.block_size < seq.num_tokens - 1

    def can_append(self, seq: Sequence) -> bool:
        return self.num_free_blocks >= int(self.needs_new_block(seq))

    def may_append(self, seq: Sequence) -> None:
        if self.needs_new_block(seq):
            seq.block_table.append(self._allocate_block().block_id)


def _decode_without_the_mask(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Paged decode over every slot of the table's blocks: the context length mask forgotten."""
    k = k_cache[block_tables.clamp(min=0)].flatten(1, 2).transpose(1, 2)
    v = v_cache[block_tables.clamp(min=0)].flatten(1, 2).transpose(1, 2)
    return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)[:, :, 0]


def _decode_heads_interleaved(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Paged decode that gives query head h the K/V head h % num_kv_heads (`repeat`, not `repeat_interleave`)."""
    group = q.shape[1] // k_cache.shape[2]
    k = k_cache[block_tables.clamp(min=0)].flatten(1, 2).repeat(1, 1, group, 1).transpose(1, 2)
    v = v_cache[block_tables.clamp(min=0)].flatten(1, 2).repeat(1, 1, group, 1).transpose(1, 2)
    valid = torch.arange(k.shape[2])[None, :] < context_lens[:, None]
    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=valid[:, None, None], scale=scale)[:, :, 0]


def _decode_token_by_token(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Correct paged decode that gathers each sequence's keys one token at a time in Python."""
    out, block_size = torch.empty_like(q), k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    for i, n in enumerate(context_lens.tolist()):
        slots = [(int(block_tables[i, t // block_size]), t % block_size) for t in range(n)]
        k = torch.stack([k_cache[b, o] for b, o in slots]).repeat_interleave(group, 1)
        v = torch.stack([v_cache[b, o] for b, o in slots]).repeat_interleave(group, 1)
        out[i] = torch.einsum("ht,thd->hd", (torch.einsum("hd,thd->ht", q[i], k) * scale).softmax(-1), v)
    return out


def test_ch05_ex1_a_slow_answer_loses_the_speed_part():
    """A correct decode that gathers keys token by token passes the decode checks but loses the speed
    part: about 3-6 times the reference's time on the speed part's batch (measured on a 2-core AMD EPYC,
    one thread), twice the full-points band's limit or more."""
    check_paged_decode(_decode_token_by_token)
    case = _speed_case()
    ratio = speed_ratio(lambda: _decode_token_by_token(*case), lambda: _paged_decode_stand_in(*case),
                        rounds=3, calls=1, warmup=0)
    bands = dict(GRADED["ch05_ex1"].speed)[SPEED]
    assert grading.speed_points(bands, ratio) < dict(GRADED["ch05_ex1"].groups)[SPEED], (ratio, bands)


@pytest.mark.parametrize("wrong, fails", [
    (_FreesShared, ALLOCS), (_KeepsCachedTokens, ALLOCS), (_RefusesAnExactFit, ALLOCS), (_AppendsOneTooLate, APPENDS),
    (_decode_without_the_mask, DECODES), (_decode_heads_interleaved, DECODES)], ids=lambda p: getattr(p, "__name__", None))
def test_ch05_ex1_wrong_answers_lose_their_part(wrong, fails):
    """Each wrong answer fails the checks of the part it gets wrong, so it loses that part's points (the
    other parts run the grader's code in place of the wrong piece); the grader's own pieces pass them."""
    checks = {ALLOCS: [check_manager_contract], APPENDS: [check_manager_contract, check_block_boundaries],
              DECODES: [check_paged_decode]}[fails]
    for check in checks:  # the checks themselves pass on the grader's pieces
        check(_Scaffold if fails != DECODES else _paged_decode_stand_in)
    failures = failed_checks(checks, wrong)
    assert failures, f"{wrong.__name__}: a wrong answer passed every check of its part ({fails})"
    assert all("ch05_ex1" in f for f in failures), failures


def _ch05_manager_ops(rng, n=60) -> list[tuple]:
    """A random workload for a KV manager alone: admit prompts, grow sequences, finish them."""
    ops = []
    for _ in range(n):
        r = rng.random()
        ops.append(("add", rng.randint(1, 12)) if r < 0.35 else ("grow", rng.randrange(10**6)) if r < 0.85
                   else ("finish", rng.randrange(10**6)))
    return ops


def _ch05_check_tables(bm, live, num_blocks) -> None:
    """Every live table covers its sequence, holds valid ids, shares no block; the free count adds up."""
    held = [b for s in live for b in s.block_table]
    assert all(len(s.block_table) == s.num_blocks for s in live)
    assert all(0 <= b < num_blocks for b in held), held
    assert len(set(held)) == len(held), f"a block in two places: {[s.block_table for s in live]}"
    assert bm.num_free_blocks == num_blocks - len(held)


# "From scratch": the block-manager interface is written in the exercise's file, not inherited (`_written_here`).
CH05_EX2_METHODS = ["can_allocate", "allocate", "deallocate", "can_append", "may_append"]


@pytest.mark.ch05
@pytest.mark.ch05_ex2
@settings(max_examples=150, deadline=None)
@given(ops=st.randoms(use_true_random=False).map(_ch05_manager_ops), block_size=st.integers(1, 4),
       num_blocks=st.integers(1, 12), watermark=st.integers(0, 3))
def test_ch05_ex2_invariants_and_watermark(ch05, ops, block_size, num_blocks, watermark):
    """Contract only: any free order passes. Admission keeps `watermark_blocks` free; decode may use them."""
    _written_here("ch05_ex2", ch05, ch05.MyBlockManager, CH05_EX2_METHODS)
    bm = ch05.MyBlockManager(num_blocks, block_size, watermark_blocks=watermark)
    assert bm.num_free_blocks == num_blocks
    live: list[Sequence] = []
    for op in ops:
        if op[0] == "add":
            seq = Sequence([7] * op[1], block_size=block_size)
            ok = bm.num_free_blocks - seq.num_blocks >= watermark
            _expect(bm.can_allocate(seq) == ok, f"ch05_ex2: can_allocate with {bm.num_free_blocks} free blocks, a "
                    f"sequence needing {seq.num_blocks} and watermark_blocks={watermark} should be {ok}")
            if ok:
                seq.num_cached_tokens = 3  # allocate must reset it
                bm.allocate(seq)
                _expect(seq.num_cached_tokens == 0, "ch05_ex2: allocate must set num_cached_tokens to 0")
                live.append(seq)
        elif live:
            seq = live[op[1] % len(live)]
            if op[0] == "grow":
                seq.append_token(7)
                needs = len(seq.block_table) < seq.num_blocks
                _expect(bm.can_append(seq) == (bm.num_free_blocks >= needs), f"ch05_ex2: can_append with "
                        f"{bm.num_free_blocks} free blocks for a sequence that needs {int(needs)} more should be "
                        f"{bm.num_free_blocks >= needs} (the watermark does not apply to decode)")
                if bm.can_append(seq):
                    bm.may_append(seq)
                else:  # preempted, as the scheduler would
                    bm.deallocate(seq)
                    _expect(seq.block_table == [], "ch05_ex2: deallocate must empty the block_table")
                    live.remove(seq)
            else:
                bm.deallocate(seq)
                _expect(seq.block_table == [] and seq.num_cached_tokens == 0,
                        "ch05_ex2: deallocate must empty the block_table and set num_cached_tokens to 0")
                live.remove(seq)
        try:
            _ch05_check_tables(bm, live, num_blocks)
        except AssertionError as e:
            raise AssertionError(f"ch05_ex2: after {op[0]}: every table covers its sequence with valid ids, no "
                                 f"block is in two tables, the free count adds up: {e}") from e
    for seq in live:
        bm.deallocate(seq)
    _expect(bm.num_free_blocks == num_blocks, f"ch05_ex2: {num_blocks - bm.num_free_blocks} blocks still held after "
            "every sequence was deallocated")


@pytest.fixture(scope="module")
def ch05_engine_case(tmp_path_factory):
    """A tiny model, 12 prompts on a cache small enough to preempt, and transformers' greedy outputs."""
    folder = tmp_path_factory.mktemp("grading-ch05")
    model = make_model(folder, "llama")
    prompts = random_prompts(12, 1, 60, seed=5)
    ref = [hf_greedy(model, p, 10) for p in prompts]
    return folder, prompts, ref


@pytest.mark.ch05
@pytest.mark.ch05_ex2
def test_ch05_ex2_engine_equals_transformers(ch05, ch05_engine_case):
    _written_here("ch05_ex2", ch05, ch05.MyBlockManager, CH05_EX2_METHODS)
    folder, prompts, ref = ch05_engine_case
    engine = LLMEngine(model=folder, dtype="float64", max_model_len=120, block_size=4, num_kvcache_blocks=30,
                       block_manager_cls=ch05.MyBlockManager, attention_backend=PagedAttention)
    ids = [engine.add_request(None, p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
           for p in prompts]
    done = {}
    with your_code("ch05_ex2", "the engine with MyBlockManager"):
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    got = [done[i].outputs[0].token_ids for i in ids]
    for i, (g, r) in enumerate(zip(got, ref)):
        _expect(g == r, f"ch05_ex2: prompt {i} ({len(prompts[i])} tokens): the engine with MyBlockManager generated "
                f"{g}, transformers {r}")
    assert engine.scheduler.num_preemptions > 0, "the cache should have been tight enough to preempt"
    _expect(engine.block_manager.num_free_blocks == engine.block_manager.num_blocks,
            "ch05_ex2: blocks still held after every request finished")


@pytest.mark.ch05
@pytest.mark.ch05_ex3
@pytest.mark.parametrize("dtype", list(CH05_TOL), ids=str)
@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 20), min_size=1, max_size=5), block_size=st.integers(1, 6),
       groups=st.sampled_from([1, 2, 3]), window=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_ch05_ex3_window_decode_matches_reference(ch05, dtype, lens, block_size, groups, window, seed):
    q, k_cache, v_cache, bt, tables = _paged_case(lens, block_size, groups, seed, dtype)
    got = ch05.paged_decode_attention_window(q, k_cache, v_cache, bt, torch.tensor(lens), 0.35, window)
    _expect(isinstance(got, torch.Tensor) and got.shape == q.shape and got.dtype == q.dtype,
            f"ch05_ex3: expected a tensor of shape {tuple(q.shape)} and dtype {q.dtype}")
    atol, rtol = CH05_TOL[dtype]
    for i, n in enumerate(lens):
        first = max(0, n - window)
        k = k_cache[tables[i]].flatten(0, 1)[first:n].double()
        v = v_cache[tables[i]].flatten(0, 1)[first:n].double()
        want = attention_reference(q[i:i + 1].double(), k, v, 0.35)[0]
        torch.testing.assert_close(got[i].double(), want, atol=atol, rtol=rtol, msg=lambda m: (
            f"ch05_ex3 ({dtype}): sequence {i} of context_lens {lens}, window {window} (keys {first}..{n - 1}), "
            f"block_size {block_size}, block table {tables[i]}: {m}"))


# --- ch06_ex2: token-granular prefix caching, graded by its contract --------------------------------
def _ch06_expected(prompt: list[int], written: set[tuple[int, ...]], block_size: int) -> int:
    """The rule: every full block whose whole prefix was written before is found; a prompt found
    entirely recomputes only its last token."""
    m = 0
    while (m + 1) * block_size <= len(prompt) and tuple(prompt[:(m + 1) * block_size]) in written:
        m += 1
    return min(m * block_size, len(prompt) - 1)


@pytest.mark.ch06
@pytest.mark.ch06_ex2
def test_ch06_ex2_written_in_the_exercise_file(ch06):
    """The lookup is the student's own `cached_prefix`, written in the exercise's file (`_written_here`)."""
    _written_here("ch06_ex2", ch06, ch06.MyPrefixCachingBlockManager, ["cached_prefix"])


@pytest.mark.ch06
@pytest.mark.ch06_ex2
@settings(max_examples=200, deadline=None, report_multiple_bugs=False)
@given(prompts=st.lists(st.lists(st.integers(1, 2), min_size=1, max_size=12), min_size=1, max_size=12),
       block_size=st.integers(1, 4))
def test_ch06_ex2_cached_tokens_as_the_rule_says(ch06, prompts, block_size):
    """Requests one after another on a cache that keeps everything: `num_cached_tokens` is exactly
    what the rule allows, the shared blocks are the earlier requests' blocks, and all is freed after."""
    bm = ch06.MyPrefixCachingBlockManager(num_blocks=len(prompts) * 12 + 1, block_size=block_size)
    written: set[tuple[int, ...]] = set()
    sent = []
    for tokens in prompts + prompts:  # every prompt twice: whole prompts come back
        seq = Sequence(tokens, block_size=block_size)
        at = f"ch06_ex2: block_size {block_size}, prompt {tokens} after the prompts {sent}:"
        with your_code("ch06_ex2", f"allocate of the prompt {tokens} (block_size {block_size}) after {sent}"):
            bm.allocate(seq)
        want = _ch06_expected(tokens, written, block_size)
        _expect(seq.num_cached_tokens == want, f"{at} num_cached_tokens should be {want} ({want // block_size} full "
                f"blocks were written before with the same prefix; a prompt found entirely recomputes its last "
                f"token), got {seq.num_cached_tokens}")
        _expect(len(seq.block_table) == seq.num_blocks and len(set(seq.block_table)) == seq.num_blocks,
                f"{at} the block table should hold {seq.num_blocks} distinct blocks, got {seq.block_table}")
        try:
            check_cache(bm, [seq])
        except AssertionError as e:
            raise AssertionError(f"{at} the cache's invariants (reference counts, hash table, parents) broke: {e}") \
                from e
        written.update(tuple(tokens[:k]) for k in range(block_size, len(tokens) + 1, block_size))
        bm.deallocate(seq)
        sent.append(tokens)
        _expect(bm.num_free_blocks == bm.num_blocks, f"{at} {bm.num_blocks - bm.num_free_blocks} blocks still held "
                "after its deallocate")


@pytest.mark.ch06
@pytest.mark.ch06_ex2
@settings(max_examples=300, deadline=None, report_multiple_bugs=False)  # short workloads: many of them
@given(ops=OPS, block_size=st.integers(1, 4), num_blocks=st.integers(3, 10), max_num_seqs=st.integers(1, 4))
def test_ch06_ex2_invariants_under_random_operations(ch06, ops, block_size, num_blocks, max_num_seqs):
    """Adds, steps (with preemption) and aborts: reference counts, the hash table and the parent
    chains stay consistent (`check_invariants`, `check_cache`), whatever the block tables are."""
    sched = Scheduler(ch06.MyPrefixCachingBlockManager(num_blocks, block_size), max_num_seqs, 24, 24, {0})
    seqs, step = [], 0
    for op in ops:
        if op[0] == "add":
            seq = Sequence(op[1], SamplingParams(max_tokens=op[2]), block_size=block_size, seq_id=len(seqs))
            seqs.append(seq)
            if seq.num_blocks <= num_blocks:
                sched.add(seq)
        elif op[0] == "step":
            step += 1
            with your_code("ch06_ex2", f"step {step} (a prefill allocates with your cached_prefix)"):
                batch, _ = sched.schedule()
            sched.postprocess(batch, (op[1] * 10)[:len(batch)])
        elif seqs:
            sched.abort(seqs[op[1] % len(seqs)])
        after = f"{op[0]} (step {step}; {num_blocks} blocks of {block_size}, max_num_seqs={max_num_seqs})"
        _invariants("ch06_ex2", sched, after)
        try:
            check_cache(sched.block_manager, sched.running)
        except AssertionError as e:
            raise AssertionError(f"ch06_ex2: after {after}: the cache's invariants (reference counts, hash table, "
                                 f"parents) broke: {e}") from e
        for seq in sched.running:
            _expect(seq.num_cached_tokens < seq.num_tokens, f"ch06_ex2: after {after}: sequence {seq.seq_id} of "
                    f"{seq.num_tokens} tokens has num_cached_tokens {seq.num_cached_tokens}: at least its last token "
                    "must be computed")


@pytest.mark.ch06
@pytest.mark.ch06_ex2
def test_ch06_ex2_engine_equals_transformers(ch06, tmp_path):
    """Prompts of whole blocks sent again (alone and together) and prompts sharing prefixes, on a
    cache small enough to preempt: greedy tokens equal transformers'; repeats recompute one token."""
    model = make_model(tmp_path, "llama")
    prompts = random_prompts(6, 1, 40, seed=7, vocab=4) + [list(range(1, 17)), list(range(1, 33))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    refs = {tuple(p): hf_greedy(model, p, 6) for p in prompts}
    engine = LLMEngine(model=tmp_path, dtype="float64", max_model_len=64, block_size=4, num_kvcache_blocks=24,
                       block_manager_cls=ch06.MyPrefixCachingBlockManager, attention_backend=PagedAttention)
    first = run_graded("ch06_ex2", engine, prompts[-2:], params)
    again = run_graded("ch06_ex2", engine, prompts[-2:], params)  # whole blocks, found entirely
    both = run_graded("ch06_ex2", engine, prompts + prompts[-2:], params)  # repeats in one step; preemption
    sent = prompts[-2:] * 2 + prompts + prompts[-2:]
    _same_tokens("ch06_ex2", "the engine with MyPrefixCachingBlockManager", sent, first + again + both,
                 [refs[tuple(p)] for p in sent])
    got = [o.num_cached_tokens for o in again]
    _expect(got == [15, 31], f"ch06_ex2: prompts of 16 and 32 tokens (blocks of 4) sent again: found entirely, "
            f"they recompute only their last token, so num_cached_tokens should be [15, 31], got {got}")
    assert engine.scheduler.num_preemptions > 0, "grader setup: the cache should have been tight enough to preempt"
    _invariants("ch06_ex2", engine, "every request finished")
