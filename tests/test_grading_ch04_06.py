"""Grading tests for chapters 04-06 (`pytest -m ch05_ex1 --impl=exercises`, ...); see test_grading.py.

Each answer is graded by its contract, not by comparison with minivllm's own classes: invariants
and the exercise's rule under random operation sequences (hypothesis), then plugged into the engine,
whose greedy outputs must equal transformers'.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import load
from engine_helpers import check_invariants, hf_greedy, make_model, one_thread, random_prompts, run_engine
from minivllm.block_manager import BlockManager
from minivllm.engine import LLMEngine
from minivllm.paged_attention import PagedAttention
from minivllm.models.llama import attention_reference
from minivllm.prefix_caching import PrefixCachingBlockManager
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler import Scheduler
from minivllm.sequence import Sequence
from test_prefix_caching import check_cache  # the prefix cache's invariants

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


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
                  kv_manager=BlockManager, attention_backend=PagedAttention)
    ref = [o.outputs[0].token_ids for o in run_engine(LLMEngine(**kwargs), prompts, params)]
    return kwargs, prompts, params, ref


def _engine_unchanged(engine_case, **plug):
    kwargs, prompts, params, ref = engine_case
    engine = LLMEngine(**{**kwargs, **plug})
    assert [o.outputs[0].token_ids for o in run_engine(engine, prompts, params)] == ref
    assert engine.scheduler.num_preemptions > 0
    check_invariants(engine)


def _random_ops(rng, n=40) -> list[tuple]:
    """A random workload: adds of short prompts over a 3-token vocabulary, many steps, a few aborts."""
    ops = []
    for _ in range(n):
        r = rng.random()
        if r < 0.4:
            ops.append(("add", [rng.randint(1, 3) for _ in range(rng.randint(1, 10))], rng.randint(1, 10)))
        elif r < 0.92:
            ops.append(("step", [rng.randint(1, 3) for _ in range(6)]))
        else:
            ops.append(("abort", rng.randint(0, 30)))
    return ops


OPS = st.randoms(use_true_random=False).map(_random_ops)


def _trace(scheduler_cls, manager_cls, ops, block_size, num_blocks, max_num_seqs):
    """Drive a scheduler through `ops`; return what it did at each step."""
    sched = scheduler_cls(manager_cls(num_blocks, block_size), max_num_seqs, 24, 24, {0})
    seqs, trace = [], []
    for op in ops:
        if op[0] == "add":
            seq = Sequence(op[1], SamplingParams(max_tokens=op[2]), block_size=block_size, seq_id=len(seqs))
            seqs.append(seq)
            if seq.num_blocks <= num_blocks:
                sched.add(seq)
        elif op[0] == "step":
            batch, is_prefill = sched.schedule()
            sched.postprocess(batch, (op[1] * 10)[:len(batch)])
            trace.append((is_prefill, [s.seq_id for s in batch]))
        elif seqs:
            sched.abort(seqs[op[1] % len(seqs)])
        check_invariants(sched)
        trace.append([(s.seq_id, list(s.block_table), s.num_cached_tokens) for s in seqs])
    return trace


def _ch04_drive(scheduler_cls, manager, ops, max_num_seqs, budget=24, max_model_len=24):
    """Drive a scheduler through `ops`, checking the shortest-prompt-first contract at every step."""
    sched = scheduler_cls(manager, max_num_seqs, budget, max_model_len, {0})
    bm, seqs = sched.block_manager, []
    for op in ops:
        if op[0] == "add":
            seq = Sequence(op[1], SamplingParams(max_tokens=op[2]), block_size=bm.block_size, seq_id=len(seqs))
            seqs.append(seq)
            if seq.num_blocks <= bm.num_blocks and seq.num_tokens < max_model_len:
                sched.add(seq)
        elif op[0] == "step":
            waiting, running = list(sched.waiting), list(sched.running)
            shortest = min(waiting, key=lambda s: s.num_tokens) if waiting else None  # the first of the shortest
            fits = (shortest is not None and len(running) < max_num_seqs and shortest.num_tokens <= budget
                    and bm.can_allocate(shortest))
            batch, is_prefill = sched.schedule()
            assert batch or sched.is_finished(), "nothing scheduled although sequences wait or run"
            if fits:
                assert is_prefill, "the shortest waiting sequence fits, so this must be a prefill step"
            if is_prefill:
                assert batch and all(s in waiting for s in batch) and len(set(map(id, batch))) == len(batch)
                left = [s for s in waiting if s not in batch]
                assert not left or max(s.num_tokens for s in batch) <= min(s.num_tokens for s in left), \
                    "a longer prompt was admitted while a shorter one waits"
                assert sum(s.num_tokens - s.num_cached_tokens for s in batch) <= budget
                assert list(sched.waiting) == left and list(sched.running)[:len(running)] == running
            else:
                assert all(s in running for s in batch) and set(map(id, sched.running)) == set(map(id, batch))
                assert list(sched.waiting)[len(sched.waiting) - len(waiting):] == waiting
            assert len(sched.running) <= max_num_seqs
            sched.postprocess(batch, (op[1] * 10)[:len(batch)])
        elif seqs:
            sched.abort(seqs[op[1] % len(seqs)])
        check_invariants(sched)
    for _ in range(2000):  # drain: nothing hangs
        if sched.is_finished():
            break
        batch, _ = sched.schedule()
        assert batch
        sched.postprocess(batch, [1] * len(batch))
        check_invariants(sched)
    assert sched.is_finished() and bm.num_free_blocks == bm.num_blocks


@pytest.mark.ch04
@pytest.mark.ch04_ex1
@settings(max_examples=150, deadline=None)
@given(ops=OPS, block_size=st.integers(1, 4), num_blocks=st.integers(3, 10), max_num_seqs=st.integers(1, 4),
       manager=st.sampled_from(["paged", "prefix", "contiguous"]))
def test_ch04_ex1_shortest_first_contract(ch04, ops, block_size, num_blocks, max_num_seqs, manager):
    """Random adds, steps and aborts: shortest prompts admitted first, limits and invariants kept."""
    from minivllm.kv_cache_manager import ContiguousKVManager

    bm = {"paged": lambda: BlockManager(num_blocks, block_size),
          "prefix": lambda: PrefixCachingBlockManager(num_blocks, block_size),
          "contiguous": lambda: ContiguousKVManager(num_blocks, 24)}[manager]()
    _ch04_drive(ch04.MyScheduler, bm, ops, max_num_seqs)


@pytest.mark.ch04
@pytest.mark.ch04_ex1
def test_ch04_ex1_admits_the_short_ones_first(ch04):
    """Prompts of 9, 2, 5 and 3 tokens, a budget of 10 tokens: 2, 3 and 5 go first, then 9."""
    sched = ch04.MyScheduler(BlockManager(64, 4), 8, 10, 64, {0})
    seqs = [Sequence(list(range(1, n + 1)), SamplingParams(max_tokens=1), block_size=4) for n in (9, 2, 5, 3)]
    for s in seqs:
        sched.add(s)
    batch, is_prefill = sched.schedule()
    assert is_prefill and sorted(s.num_tokens for s in batch) == [2, 3, 5]
    sched.postprocess(batch, [1] * 3)  # max_tokens=1: all three finish
    batch, is_prefill = sched.schedule()
    assert is_prefill and batch == [seqs[0]]


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
    from minivllm.attention import ContiguousAttention
    from minivllm.kv_cache_manager import ContiguousKVManager

    kwargs, prompts, params, _ = engine_case
    if manager == "contiguous":  # 3 regions of 128 tokens: short prompts overtake long ones
        kwargs = {**kwargs, "kv_manager": ContiguousKVManager, "attention_backend": ContiguousAttention,
                  "num_kvcache_blocks": 3 * 128 // kwargs["block_size"]}
    engine = LLMEngine(**kwargs, scheduler_cls=ch04.MyScheduler)
    assert [o.outputs[0].token_ids for o in run_engine(engine, prompts, params)] == ch04_oracle
    if manager == "paged":
        assert engine.scheduler.num_preemptions > 0
    check_invariants(engine)


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


@pytest.mark.ch05
@pytest.mark.ch05_ex1
@settings(max_examples=150, deadline=None)
@given(ops=st.randoms(use_true_random=False).map(_ch05_manager_ops), block_size=st.integers(1, 4),
       num_blocks=st.integers(1, 12), watermark=st.integers(0, 3))
def test_ch05_ex1_invariants_and_watermark(ch05, ops, block_size, num_blocks, watermark):
    """Contract only: any free order passes. Admission keeps `watermark_blocks` free; decode may use them."""
    bm = ch05.MyBlockManager(num_blocks, block_size, watermark_blocks=watermark)
    assert bm.num_free_blocks == num_blocks
    live: list[Sequence] = []
    for op in ops:
        if op[0] == "add":
            seq = Sequence([7] * op[1], block_size=block_size)
            ok = bm.num_free_blocks - seq.num_blocks >= watermark
            assert bm.can_allocate(seq) == ok, (bm.num_free_blocks, seq.num_blocks, watermark)
            if ok:
                seq.num_cached_tokens = 3  # allocate must reset it
                bm.allocate(seq)
                assert seq.num_cached_tokens == 0
                live.append(seq)
        elif live:
            seq = live[op[1] % len(live)]
            if op[0] == "grow":
                seq.append_token(7)
                needs = len(seq.block_table) < seq.num_blocks
                assert bm.can_append(seq) == (bm.num_free_blocks >= needs)
                if bm.can_append(seq):
                    bm.may_append(seq)
                else:  # preempted, as the scheduler would
                    bm.deallocate(seq)
                    assert seq.block_table == []
                    live.remove(seq)
            else:
                bm.deallocate(seq)
                assert seq.block_table == [] and seq.num_cached_tokens == 0
                live.remove(seq)
        _ch05_check_tables(bm, live, num_blocks)
    for seq in live:
        bm.deallocate(seq)
    assert bm.num_free_blocks == num_blocks


@pytest.fixture(scope="module")
def ch05_engine_case(tmp_path_factory):
    """A tiny model, 12 prompts on a cache small enough to preempt, and transformers' greedy outputs."""
    folder = tmp_path_factory.mktemp("grading-ch05")
    model = make_model(folder, "llama")
    prompts = random_prompts(12, 1, 60, seed=5)
    ref = [hf_greedy(model, p, 10) for p in prompts]
    return folder, prompts, ref


@pytest.mark.ch05
@pytest.mark.ch05_ex1
def test_ch05_ex1_engine_equals_transformers(ch05, ch05_engine_case):
    folder, prompts, ref = ch05_engine_case
    engine = LLMEngine(model=folder, dtype="float64", max_model_len=128, block_size=4, num_kvcache_blocks=30,
                       kv_manager=ch05.MyBlockManager, attention_backend=PagedAttention)
    ids = [engine.add_request(None, p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
           for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [done[i].outputs[0].token_ids for i in ids] == ref
    assert engine.scheduler.num_preemptions > 0, "the cache should have been tight enough to preempt"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.ch05
@pytest.mark.ch05_ex2
@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 20), min_size=1, max_size=5), block_size=st.integers(1, 6),
       groups=st.sampled_from([1, 2, 3]), window=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_ch05_ex2_window_decode_matches_reference(ch05, lens, block_size, groups, window, seed):
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
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g, dtype=torch.float64)
    q = torch.randn(len(lens), kvh * groups, d, generator=g, dtype=torch.float64)
    got = ch05.paged_decode_attention_window(q, k_cache, v_cache, bt, torch.tensor(lens), 0.35, window)
    assert got.shape == q.shape and got.dtype == q.dtype
    for i, n in enumerate(lens):
        first = max(0, n - window)
        k = k_cache[tables[i]].flatten(0, 1)[first:n]
        v = v_cache[tables[i]].flatten(0, 1)[first:n]
        torch.testing.assert_close(got[i], attention_reference(q[i:i + 1], k, v, 0.35)[0], atol=1e-12, rtol=0)


# --- ch06_ex1: token-granular prefix caching, graded by its contract --------------------------------
def _ch06_expected(prompt: list[int], written: set[tuple[int, ...]], block_size: int) -> int:
    """The rule: every full block whose whole prefix was written before is found; a prompt found
    entirely recomputes only its last token."""
    m = 0
    while (m + 1) * block_size <= len(prompt) and tuple(prompt[:(m + 1) * block_size]) in written:
        m += 1
    return min(m * block_size, len(prompt) - 1)


@pytest.mark.ch06
@pytest.mark.ch06_ex1
@settings(max_examples=200, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(1, 2), min_size=1, max_size=12), min_size=1, max_size=12),
       block_size=st.integers(1, 4))
def test_ch06_ex1_cached_tokens_as_the_rule_says(ch06, prompts, block_size):
    """Requests one after another on a cache that keeps everything: `num_cached_tokens` is exactly
    what the rule allows, the shared blocks are the earlier requests' blocks, and all is freed after."""
    bm = ch06.MyPrefixCachingBlockManager(num_blocks=len(prompts) * 12 + 1, block_size=block_size)
    written: set[tuple[int, ...]] = set()
    for tokens in prompts + prompts:  # every prompt twice: whole prompts come back
        seq = Sequence(tokens, block_size=block_size)
        bm.allocate(seq)
        assert seq.num_cached_tokens == _ch06_expected(tokens, written, block_size), (tokens, sorted(written))
        assert len(seq.block_table) == seq.num_blocks and len(set(seq.block_table)) == seq.num_blocks
        check_cache(bm, [seq])
        written.update(tuple(tokens[:k]) for k in range(block_size, len(tokens) + 1, block_size))
        bm.deallocate(seq)
        assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.ch06
@pytest.mark.ch06_ex1
@settings(max_examples=150, deadline=None)
@given(ops=OPS, block_size=st.integers(1, 4), num_blocks=st.integers(3, 10), max_num_seqs=st.integers(1, 4))
def test_ch06_ex1_invariants_under_random_operations(ch06, ops, block_size, num_blocks, max_num_seqs):
    """Adds, steps (with preemption) and aborts: reference counts, the hash table and the parent
    chains stay consistent (`check_invariants`, `check_cache`), whatever the block tables are."""
    sched = Scheduler(ch06.MyPrefixCachingBlockManager(num_blocks, block_size), max_num_seqs, 24, 24, {0})
    seqs = []
    for op in ops:
        if op[0] == "add":
            seq = Sequence(op[1], SamplingParams(max_tokens=op[2]), block_size=block_size, seq_id=len(seqs))
            seqs.append(seq)
            if seq.num_blocks <= num_blocks:
                sched.add(seq)
        elif op[0] == "step":
            batch, _ = sched.schedule()
            sched.postprocess(batch, (op[1] * 10)[:len(batch)])
        elif seqs:
            sched.abort(seqs[op[1] % len(seqs)])
        check_invariants(sched)
        check_cache(sched.block_manager, sched.running)
        for seq in sched.running:
            assert seq.num_cached_tokens < seq.num_tokens


@pytest.mark.ch06
@pytest.mark.ch06_ex1
def test_ch06_ex1_engine_equals_transformers(ch06, tmp_path):
    """Prompts of whole blocks sent again (alone and together) and prompts sharing prefixes, on a
    cache small enough to preempt: greedy tokens equal transformers'; repeats recompute one token."""
    model = make_model(tmp_path, "llama")
    prompts = random_prompts(6, 1, 40, seed=7, vocab=4) + [list(range(1, 17)), list(range(1, 33))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    refs = {tuple(p): hf_greedy(model, p, 6) for p in prompts}
    engine = LLMEngine(model=tmp_path, dtype="float64", max_model_len=64, block_size=4, num_kvcache_blocks=24,
                       kv_manager=ch06.MyPrefixCachingBlockManager, attention_backend=PagedAttention)
    first = run_engine(engine, prompts[-2:], params)
    again = run_engine(engine, prompts[-2:], params)  # whole blocks, found entirely
    both = run_engine(engine, prompts + prompts[-2:], params)  # repeats in one step; preemption
    for p, out in zip(prompts[-2:] * 2 + prompts + prompts[-2:], first + again + both):
        assert out.outputs[0].token_ids == refs[tuple(p)], p
    assert [o.num_cached_tokens for o in again] == [15, 31]
    assert engine.scheduler.num_preemptions > 0
    check_invariants(engine)
