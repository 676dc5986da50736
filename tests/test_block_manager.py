"""BlockManager (chapter 05), paged attention (chapter 05) and prefix caching (chapter 06)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.block_manager import BlockManager
from minivllm.model_runner import AttentionMetadata
from minivllm.models.llama import attention_reference
from minivllm.paged_attention import (PagedAttention, gather_kv, paged_decode_attention,
                                      paged_decode_attention_planned, plan_decode, prefill_attention)
from minivllm.prefix_caching import NO_HASH, PrefixCachingBlockManager, compute_hash
from minivllm.sequence import Sequence


def seq(tokens, block_size):
    return Sequence(list(tokens), block_size=block_size)


def test_allocate_append_deallocate():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq(range(1, 7), 4)  # 6 tokens: 2 blocks
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert a.block_table == [0, 1] and bm.num_free_blocks == 4
    assert bm.slot_mapping(a) == [0, 1, 2, 3, 4, 5]
    a.append_token(9)  # token 7 goes into block 1: no new block
    assert not bm.needs_new_block(a) and bm.can_append(a)
    bm.may_append(a)
    for t in (9, 9):
        a.append_token(t)
        bm.may_append(a)
    assert a.block_table == [0, 1, 2]  # token 9 started a third block
    bm.deallocate(a)
    assert a.block_table == [] and bm.num_free_blocks == 6
    assert list(bm.free_block_ids) == [3, 4, 5, 2, 1, 0]  # freed blocks go to the back, tail first


def test_cannot_allocate_or_append_without_free_blocks():
    bm = BlockManager(num_blocks=2, block_size=2)
    a, b = seq([1, 2, 3], 2), seq([1, 2, 3, 4, 5], 2)
    assert not bm.can_allocate(b)
    bm.allocate(a)
    a.append_token(4)
    assert bm.can_append(a)  # token 4 fits in block 1
    bm.may_append(a)
    a.append_token(5)
    assert not bm.can_append(a)
    with pytest.raises(ValueError):
        BlockManager(0, 16)


def test_hash_is_chained():
    h1 = compute_hash([1, 2, 3])
    assert h1 == compute_hash([1, 2, 3]) and h1 >= 0
    assert compute_hash([4, 5], h1) != compute_hash([4, 5]) != compute_hash([4, 6], h1)


def test_prefix_caching_shares_full_blocks_and_counts_cached_tokens():
    bm = PrefixCachingBlockManager(num_blocks=10, block_size=4)
    a = seq(range(10), 4)
    b = seq(list(range(8)) + [50, 51], 4)
    c = seq(list(range(4)) + [60] * 4, 4)
    for x in (a, b, c):
        bm.allocate(x)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert c.block_table[0] == a.block_table[0] and c.block_table[1] != a.block_table[1]
    assert c.num_cached_tokens == 4
    assert bm.blocks[a.block_table[0]].ref_count == 3 and bm.blocks[a.block_table[2]].hash == NO_HASH
    for x in (a, b, c):
        bm.deallocate(x)
    assert bm.num_free_blocks == 10


def test_freed_blocks_stay_cached_until_reused_least_recently_freed_first():
    bm = PrefixCachingBlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5], 2)  # blocks 0, 1 full and hashed; block 2 partial
    bm.allocate(a)
    bm.deallocate(a)  # freed tail first: queue is [3, 2, 1, 0]
    assert list(bm.free_block_ids) == [3, 2, 1, 0]
    b = seq([1, 2, 3, 4, 9], 2)
    bm.allocate(b)
    assert b.block_table[:2] == [0, 1] and b.num_cached_tokens == 4
    bm.deallocate(b)
    c = seq([7, 7, 7, 7, 7, 7, 7], 2)  # needs all 4 blocks: the cached ones are overwritten last
    bm.allocate(c)
    assert c.block_table == [2, 3, 1, 0] and c.num_cached_tokens == 0  # b freed [3, 1, 0] after 2
    assert all(bm.blocks[i].hash == NO_HASH or bm.blocks[i].token_ids == [7, 7] for i in range(4))
    assert set(bm.hash_to_block_id.values()) <= {2, 3, 1}


def test_fully_cached_prompt_recomputes_its_last_block():
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=4)
    a = seq(range(8), 4)
    bm.allocate(a)
    b = seq(range(8), 4)
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]
    assert bm.hash_to_block_id[bm.blocks[b.block_table[1]].hash] == b.block_table[1]


def test_decode_fills_and_hashes_blocks():
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3], 2)
    bm.allocate(a)
    a.append_token(4)  # the step that writes token 4 fills block 1
    bm.may_append(a)
    h0 = compute_hash([1, 2])
    assert bm.blocks[a.block_table[1]].hash == compute_hash([3, 4], h0)
    b = seq([1, 2, 3, 4, 5], 2)  # a follow-up turn finds both blocks
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[:2] == a.block_table


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 20), min_size=1, max_size=5), block_size=st.integers(1, 6),
       seed=st.integers(0, 10_000), num_cached=st.integers(0, 3))
def test_paged_attention_matches_reference(lens, block_size, seed, num_cached):
    """Random block tables over a shuffled cache: prefill (with a cached prefix) and decode equal
    `attention_reference` on contiguous K/V."""
    g = torch.Generator().manual_seed(seed)
    H, KVH, D = 4, 2, 8
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, start = [], 0
    for k in need:
        tables.append(perm[start:start + k])
        start += k
    width = max(need)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables])
    cache = torch.zeros(2, 1, num_blocks, block_size, KVH, D, dtype=torch.float64)
    ks = [torch.randn(n, KVH, D, generator=g, dtype=torch.float64) for n in lens]
    vs = [torch.randn(n, KVH, D, generator=g, dtype=torch.float64) for n in lens]
    qs = [torch.randn(n, H, D, generator=g, dtype=torch.float64) for n in lens]
    cached = [min(num_cached, n - 1) for n in lens]  # tokens already in the cache before the prefill
    for i, n in enumerate(lens):
        for t in range(cached[i]):
            b, o = tables[i][t // block_size], t % block_size
            cache[0, 0, b, o], cache[1, 0, b, o] = ks[i][t], vs[i][t]
    slots = [tables[i][t // block_size] * block_size + t % block_size
             for i, n in enumerate(lens) for t in range(cached[i], n)]
    cu = [0]
    for i, n in enumerate(lens):
        cu.append(cu[-1] + n - cached[i])
    backend = PagedAttention(cache, D ** -0.5)
    backend.metadata = AttentionMetadata(True, torch.tensor(cu), torch.tensor(lens), torch.tensor(slots), bt)
    out = backend(0, torch.cat([q[c:] for q, c in zip(qs, cached)]), torch.cat([k[c:] for k, c in zip(ks, cached)]),
                  torch.cat([v[c:] for v, c in zip(vs, cached)]))
    for i in range(len(lens)):
        ref = attention_reference(qs[i][cached[i]:], ks[i], vs[i], D ** -0.5)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], ref, atol=1e-12, rtol=0)
        torch.testing.assert_close(gather_kv(cache[0, 0], bt[i], lens[i]), ks[i], atol=0, rtol=0)
    dec = paged_decode_attention(torch.stack([q[-1] for q in qs]), cache[0, 0], cache[1, 0], bt,
                                 torch.tensor(lens), D ** -0.5)
    for i in range(len(lens)):
        ref = attention_reference(qs[i][-1:], ks[i], vs[i], D ** -0.5)[0]
        torch.testing.assert_close(dec[i], ref, atol=1e-12, rtol=0)
    # the bucketed decode, with one bucket per length, the default cost, and one bucket for all
    q_last = torch.stack([q[-1] for q in qs])
    for overhead in (0, 512, 10 ** 9):
        plan = plan_decode(bt, torch.tensor(lens), block_size, torch.float64, overhead)
        got = paged_decode_attention_planned(q_last, cache[0, 0], cache[1, 0], plan, D ** -0.5)
        torch.testing.assert_close(got, dec, atol=1e-12, rtol=0)
    # and the backend's decode path (a decode step writes each sequence's last K/V first)
    backend.metadata = AttentionMetadata(False, torch.arange(len(lens) + 1), torch.tensor(lens),
                                         torch.tensor([tables[i][(n - 1) // block_size] * block_size + (n - 1) % block_size
                                                       for i, n in enumerate(lens)]), bt)
    got = backend(0, q_last, torch.stack([k[-1] for k in ks]), torch.stack([v[-1] for v in vs]))
    torch.testing.assert_close(got, dec, atol=1e-12, rtol=0)


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=7), block_size=st.sampled_from([1, 4, 16]),
       overhead=st.sampled_from([0, 3, 20, 100]))
def test_plan_decode_is_the_cheapest_cut(lens, block_size, overhead):
    """The DP's buckets partition the length-sorted batch, cover each sequence's blocks, and cost no
    more than any other way of cutting the sorted batch into runs (brute force over all 2^(n-1) cuts)."""
    import itertools

    n = len(lens)
    width = max(-(-L // block_size) for L in lens)
    bt = torch.arange(n * width).view(n, width)  # any distinct ids
    plan = plan_decode(bt, torch.tensor(lens), block_size, torch.float32, overhead)
    srt = sorted(lens)
    assert [lens[i] for i in plan.order.tolist()] == srt
    assert plan.order[plan.inverse].tolist() == list(range(n))
    assert plan.buckets[0].start == 0 and plan.buckets[-1].end == n
    assert all(a.end == b.start for a, b in zip(plan.buckets, plan.buckets[1:]))
    blocks = lambda L: -(-L // block_size)  # noqa: E731
    for b in plan.buckets:
        assert b.num_slots == blocks(srt[b.end - 1]) * block_size
        rows = plan.order[b.start:b.end]
        assert torch.equal(b.block_ids, bt[rows, :blocks(srt[b.end - 1])].flatten())
        real = torch.arange(b.num_slots)[None, :] < torch.tensor(srt[b.start:b.end])[:, None]
        assert torch.equal(b.mask[:, 0, 0] == 0, real) and torch.isinf(b.mask[:, 0, 0][~real]).all()

    def cost(bounds):
        return sum(overhead + (e - s) * blocks(srt[e - 1]) * block_size for s, e in bounds)

    got = cost([(b.start, b.end) for b in plan.buckets])
    for cuts in itertools.product([False, True], repeat=n - 1):
        points = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        assert got <= cost(list(zip(points, points[1:])))


@settings(max_examples=40, deadline=None)
@given(tq=st.integers(1, 40), cached=st.integers(0, 30), chunk=st.integers(1, 16), seed=st.integers(0, 1000))
def test_prefill_attention_in_chunks_equals_reference(tq, cached, chunk, seed):
    """Query chunks that skip the masked keys give `attention_reference`'s result (float64 rounding)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, 4, 8, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, cached + tq, 2, 8, generator=g, dtype=torch.float64).unbind(0)
    torch.testing.assert_close(prefill_attention(q, k, v, 0.3, chunk), attention_reference(q, k, v, 0.3),
                               atol=1e-12, rtol=0)
