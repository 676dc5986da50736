"""Chapter 06: hash prefix caching (`PrefixCachingBlockManager`).

Unit tests of sharing, the LRU free queue, the last-token rule and decode-time caching; the cache's
invariants (hash table, the forest of parents, the free-queue order) under random operation
sequences, also with a weak hash that collides often; and an injected collision in the parent chain,
which must cost a cache hit and never change an output (the engine against transformers).
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minivllm.core.prefix_caching as pc
from engine_helpers import check_invariants, hf_greedy, make_model, one_thread, run_engine
from minivllm.engine.llm_engine import LLMEngine
from minivllm.llm import LLM
from minivllm.attention.paged_attention import PagedAttention
from minivllm.core.prefix_caching import NO_HASH, NO_PARENT, PrefixCachingBlockManager, compute_hash
from minivllm.sampling_params import SamplingParams
from minivllm.core.sched.scheduler import Scheduler
from minivllm.sequence import Sequence

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


def seq(tokens, block_size: int) -> Sequence:
    return Sequence(list(tokens), block_size=block_size)


def check_cache(bm: PrefixCachingBlockManager, running=()) -> None:
    """The prefix cache's invariants.

    * `hash_to_block_id` and the blocks' `hash` fields agree; a cached block holds `block_size` tokens;
    * the cache is a forest: a cached block's parent is cached and lists it as a child, and back;
    * a cached block in a running sequence's table holds that sequence's tokens for its position,
      right after the sequence's previous block; following parents from it spells the sequence's
      prefix (the property that makes a hit correct, whatever the hash);
    * in the free queue every free cached block comes before its free cached parent (eviction takes leaves).
    """
    cached = {b.block_id: b for b in bm.blocks if b.hash != NO_HASH}
    assert bm.hash_to_block_id == {b.hash: i for i, b in cached.items()}
    for i, b in cached.items():
        assert len(b.token_ids) == bm.block_size, b
        if b.parent != NO_PARENT:
            assert b.parent in cached and i in cached[b.parent].children, b
        assert all(c in cached and cached[c].parent == i for c in b.children), b
    for s in running:
        for i, block_id in enumerate(s.block_table):
            b = bm.blocks[block_id]
            if b.hash == NO_HASH:
                continue
            assert b.token_ids == s.block(i), (s, i, b)
            assert b.parent == (s.block_table[i - 1] if i else NO_PARENT), (s, i, b)
            prefix, walk = [], b
            while True:
                prefix[:0] = walk.token_ids
                if walk.parent == NO_PARENT:
                    break
                walk = bm.blocks[walk.parent]
            assert prefix == s.token_ids[:(i + 1) * bm.block_size], (s, i)
    position = {block_id: k for k, block_id in enumerate(bm.free_block_ids)}
    for i, b in cached.items():
        if i in position and b.parent in position:
            assert position[i] < position[b.parent], f"cached block {i} is behind its parent in the free queue"


# --- the manager alone -------------------------------------------------------------------------------
def test_hash_is_chained():
    h1 = compute_hash([1, 2, 3])
    assert h1 == compute_hash([1, 2, 3]) and 0 <= h1 < 2**64
    assert compute_hash([4, 5], h1) != compute_hash([4, 5]) != compute_hash([4, 6], h1)


def test_shares_full_blocks_and_counts_cached_tokens():
    bm = PrefixCachingBlockManager(num_blocks=10, block_size=4)
    a, b, c = seq(range(10), 4), seq(list(range(8)) + [50, 51], 4), seq(list(range(4)) + [60] * 4, 4)
    for x in (a, b, c):
        bm.allocate(x)
        check_cache(bm, [a, b, c][:[a, b, c].index(x) + 1])
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert c.block_table[0] == a.block_table[0] and c.block_table[1] != a.block_table[1]
    assert c.num_cached_tokens == 4
    assert bm.blocks[a.block_table[0]].ref_count == 3 and bm.blocks[a.block_table[2]].hash == NO_HASH
    for x in (a, b, c):
        bm.deallocate(x)
    assert bm.num_free_blocks == 10
    check_cache(bm)


def test_freed_blocks_stay_cached_until_taken_least_recently_freed_first():
    bm = PrefixCachingBlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5], 2)  # blocks 0, 1 full and cached; block 2 partial; block 3 never used
    bm.allocate(a)
    bm.deallocate(a)  # tail first: the queue is [3 (never used), 2, 1, 0]
    assert list(bm.free_block_ids) == [3, 2, 1, 0]
    b = seq([1, 2, 3, 4, 9], 2)
    bm.allocate(b)
    assert b.block_table[:2] == [0, 1] and b.num_cached_tokens == 4
    bm.deallocate(b)
    check_cache(bm)
    c = seq([7] * 7, 2)  # needs all 4 blocks: the cached ones are overwritten last, leaves first
    bm.allocate(c)
    assert c.num_cached_tokens == 0 and c.block_table[-2:] == [1, 0]
    assert sorted(bm.hash_to_block_id.values()) == sorted(c.block_table[:3])  # only c's full blocks
    check_cache(bm, [c])


def test_fully_cached_prompt_recomputes_its_last_block():
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=4)
    a, b = seq(range(8), 4), seq(range(8), 4)
    bm.allocate(a)
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]
    assert bm.blocks[b.block_table[1]].hash == NO_HASH  # the same content is cached already: first kept
    check_cache(bm, [a, b])


def test_decode_fills_and_caches_blocks_for_the_next_turn():
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3], 2)
    bm.allocate(a)
    a.append_token(4)  # the step that writes token 4 fills block 1
    bm.may_append(a)
    assert bm.blocks[a.block_table[1]].hash == compute_hash([3, 4], compute_hash([1, 2]))
    assert bm.blocks[a.block_table[1]].parent == a.block_table[0]
    b = seq([1, 2, 3, 4, 5], 2)  # the next turn: prompt + completion + more
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[:2] == a.block_table
    check_cache(bm, [a, b])


def test_evicting_a_block_uncaches_the_blocks_below_it():
    bm = PrefixCachingBlockManager(num_blocks=6, block_size=2)
    a, b = seq([1, 2, 3, 4, 5, 6, 7], 2), seq([1, 2, 3, 4, 8, 9, 7], 2)
    bm.allocate(a)
    bm.allocate(b)  # shares blocks 0, 1; block 2 is a second child of block 1
    assert bm.blocks[a.block_table[1]].children == {a.block_table[2], b.block_table[2]}
    bm._uncache(a.block_table[1])
    assert list(bm.hash_to_block_id.values()) == [a.block_table[0]]
    assert bm.blocks[a.block_table[0]].children == set()


def test_discard_unwritten_uncaches_what_a_failed_step_was_to_write():
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3, 4, 5], 2)
    bm.allocate(a)
    b = seq([1, 2, 3, 4, 6, 7, 8], 2)
    bm.allocate(b)  # finds a's two full blocks; caches its own third block
    bm.discard_unwritten([b])  # b's step failed: its third block was never written
    assert set(bm.hash_to_block_id.values()) == set(a.block_table[:2])
    bm.discard_unwritten([a])
    assert bm.hash_to_block_id == {}
    check_cache(bm, [a, b])


def test_collision_in_the_parent_chain_is_a_miss(monkeypatch):
    """Blocks A, B, T of 4 tokens; T's hash ignores its parent, so T-after-A collides with T-after-B."""
    A, B, T = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    real = pc.compute_hash
    monkeypatch.setattr(pc, "compute_hash", lambda t, p=NO_HASH: 777 if list(t) == T else real(t, p))
    bm = PrefixCachingBlockManager(num_blocks=12, block_size=4)
    first, second, third = seq(B + T + [0], 4), seq(A + [0], 4), seq(A + T + [0], 4)
    for x in (first, second, third):
        bm.allocate(x)
    assert third.block_table[0] == second.block_table[0]  # A: a true hit
    assert third.block_table[1] != first.block_table[1]  # T after B is not served for T after A
    assert third.num_cached_tokens == 4
    check_cache(bm, [first, second, third])


# --- random operation sequences ----------------------------------------------------------------------
op = st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(1, 3), min_size=1, max_size=12), st.integers(1, 10)),
    st.tuples(st.just("step"), st.lists(st.integers(1, 3), min_size=8, max_size=8)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


def _drive(ops, block_size, num_blocks, max_num_seqs):
    s = Scheduler(PrefixCachingBlockManager(num_blocks, block_size), max_num_seqs, 24, 24, {0})
    live: list[Sequence] = []
    for o in ops:
        if o[0] == "add":
            x = Sequence(o[1], SamplingParams(max_tokens=o[2], ignore_eos=True), block_size=block_size)
            if x.num_blocks <= num_blocks:
                s.add(x)
                live.append(x)
        elif o[0] == "step":
            batch, _ = s.schedule()
            s.postprocess(batch, (o[1] * 4)[:len(batch)])
        elif live:
            s.abort(live[o[1] % len(live)])
        live = [x for x in live if not x.is_finished]
        check_invariants(s)
        check_cache(s.block_manager, s.running)
    return s


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=10, max_size=60), block_size=st.integers(1, 4), num_blocks=st.integers(3, 12),
       max_num_seqs=st.integers(1, 5))
def test_random_operations_keep_the_cache_invariants(ops, block_size, num_blocks, max_num_seqs):
    _drive(ops, block_size, num_blocks, max_num_seqs)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=10, max_size=60), block_size=st.integers(1, 4), num_blocks=st.integers(3, 12),
       max_num_seqs=st.integers(1, 5), buckets=st.integers(1, 8))
def test_a_hash_that_collides_often_never_serves_a_wrong_prefix(ops, block_size, num_blocks, max_num_seqs,
                                                                buckets):
    """With only `buckets` distinct hash values, collisions are everywhere; `check_cache` still finds
    every shared block's parent chain spelling the sequence's own prefix."""
    real = pc.compute_hash
    with pytest.MonkeyPatch.context() as m:
        m.setattr(pc, "compute_hash", lambda t, p=NO_HASH: real(t, p) % buckets)
        _drive(ops, block_size, num_blocks, max_num_seqs)


# --- the engine ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prefix-caching")
    return folder, make_model(folder, "llama")


class TokensOnlyBlockManager(PrefixCachingBlockManager):
    """The check of a block's own tokens only (no parent): what the parent check guards against."""

    def _is_hit(self, block_id, token_ids, parent):
        return block_id != -1 and self.blocks[block_id].token_ids == token_ids


def test_injected_collision_keeps_outputs_equal_to_transformers(tiny, monkeypatch):
    folder, model = tiny
    rng = random.Random(5)
    A, B, T = ([rng.randrange(128) for _ in range(8)] for _ in range(3))
    real = pc.compute_hash
    monkeypatch.setattr(pc, "compute_hash", lambda t, p=NO_HASH: 12345 if list(t) == T else real(t, p))
    prompts = [B + T + [5], A + [7, 8], A + T + [9]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = hf_greedy(model, prompts[2], 16)
    got = {}
    for cls in (PrefixCachingBlockManager, TokensOnlyBlockManager):
        engine = LLMEngine(model=folder, dtype="float64", block_size=8, max_model_len=128, num_kvcache_blocks=32,
                           block_manager_cls=cls, attention_backend=PagedAttention)
        if cls is PrefixCachingBlockManager:  # every step checked (invariants include the parent chains)
            got[cls] = [run_engine(engine, [p], params)[0] for p in prompts][2]
        else:  # the faulty manager breaks the invariants: run it unchecked
            got[cls] = [_run_unchecked(engine, p, params) for p in prompts][2]
    assert got[PrefixCachingBlockManager].num_cached_tokens == 8  # block A only
    assert got[PrefixCachingBlockManager].outputs[0].token_ids == ref
    # the test can see the fault it guards against: checking tokens alone serves T-after-B
    assert got[TokensOnlyBlockManager].num_cached_tokens == 16
    assert got[TokensOnlyBlockManager].outputs[0].token_ids != ref


def _run_unchecked(engine, prompt, params):
    """Run one request to the end without the invariant checks (the faulty manager breaks them)."""
    request_id = engine.add_request(None, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                result = out
    return result


def test_multi_turn_reuses_the_completion_and_equals_transformers(tiny):
    folder, model = tiny
    llm = LLM(folder, dtype="float64", block_size=4, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    first = list(range(1, 31))
    out1 = llm.generate([first], params, use_tqdm=False)[0]
    second = first + out1.outputs[0].token_ids + [5, 6, 7]  # 42 tokens: blocks of prompt + completion
    out2 = llm.generate([second], params, use_tqdm=False)[0]
    assert out1.outputs[0].token_ids == hf_greedy(model, first, 9)
    assert out2.outputs[0].token_ids == hf_greedy(model, second, 9)
    # 30 + 9 tokens were computed; the K/V of the first 38 are stored (the 9th output token's is not)
    assert out2.num_cached_tokens == 36
    check_invariants(llm.llm_engine)


def test_a_failed_step_leaves_nothing_cached_that_was_not_written(tiny, monkeypatch):
    """The model fails in the middle of a prefill: the blocks that step was to write leave the cache
    (`discard_unwritten`), so the same prompt afterwards is computed again, and equals transformers."""
    folder, model = tiny
    engine = LLMEngine(model=folder, dtype="float64", block_size=4, max_model_len=128, num_kvcache_blocks=32,
                       block_manager_cls=PrefixCachingBlockManager, attention_backend=PagedAttention)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompt = list(range(3, 30))
    run_engine(engine, [prompt[:9]], params)  # caches two prompt blocks and one completion block
    bm = engine.block_manager
    written = dict(bm.hash_to_block_id)
    real_run = engine.model_runner.run

    def failing_run(seqs, is_prefill):
        raise RuntimeError("the device failed in the middle of the step")

    monkeypatch.setattr(engine.model_runner, "run", failing_run)
    request_id = engine.add_request(None, prompt, params)
    with pytest.raises(RuntimeError, match="device failed"):
        engine.step()
    assert bm.hash_to_block_id == written  # the failed step's own blocks are not findable
    engine.abort_request(request_id)
    check_invariants(engine)
    monkeypatch.setattr(engine.model_runner, "run", real_run)
    out = run_engine(engine, [prompt], params)[0]
    assert out.num_cached_tokens == 8 and out.outputs[0].token_ids == hf_greedy(model, prompt, 5)
    check_cache(bm)


@pytest.mark.parametrize("manager", ["prefix caching", "contiguous"])
def test_stepping_on_after_a_failed_prefill_prefills_again(tiny, monkeypatch, manager):
    """The model fails in a prefill step and the caller steps on without aborting: the step's
    sequences were sent back to `waiting`, so they are prefilled again (not decoded over K/V that was
    never written) and equal transformers; with the same prompt twice, the second one found no block
    the failed step was to write."""
    folder, model = tiny
    kwargs = dict(block_manager_cls=PrefixCachingBlockManager, attention_backend=PagedAttention) if manager == "prefix caching" else {}
    engine = LLMEngine(model=folder, dtype="float64", block_size=4, max_model_len=128, num_kvcache_blocks=32, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompt = list(range(3, 30))
    real_run = engine.model_runner.run
    monkeypatch.setattr(engine.model_runner, "run", lambda seqs, is_prefill: 1 / 0)
    ids = [engine.add_request(None, prompt, params), engine.add_request(None, prompt, params)]
    with pytest.raises(ZeroDivisionError):
        engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ids and not engine.scheduler.running
    check_invariants(engine)
    monkeypatch.setattr(engine.model_runner, "run", real_run)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        check_invariants(engine)
    want = hf_greedy(model, prompt, 5)
    assert [done[i].outputs[0].token_ids for i in ids] == [want, want]
    if manager == "prefix caching":
        assert [done[i].num_cached_tokens for i in ids] == [0, 24]
