"""Chapter 05: the BlockManager (plain Python, a lazy block pool), paged attention in plain torch and
the decode planner. (Prefix caching, chapter 06's subclass, is tested with chapter 06.)"""
from __future__ import annotations

import random
import subprocess
import sys
import time
import tracemalloc
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.attention.backend import AttentionMetadata
from minivllm.core.block_manager import Block, BlockList, BlockManager, FreeBlockQueue
from minivllm.attention.decode_planner import paged_decode_attention_planned, plan_decode
from minivllm.core.kv_cache_manager import slot_mapping
from minivllm.model_executor.models.llama import attention_reference
from minivllm.attention.paged_attention import PagedAttention, gather_kv, paged_decode_attention, prefill_attention
from minivllm.sequence import Sequence


def seq(tokens, block_size):
    return Sequence(list(tokens), block_size=block_size)


def test_allocate_append_deallocate():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq(range(1, 7), 4)  # 6 tokens: 2 blocks
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert a.block_table == [0, 1] and bm.num_free_blocks == 4
    assert slot_mapping(a.block_table, 4, 0, a.num_tokens) == [0, 1, 2, 3, 4, 5]
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


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "16", None])
def test_bad_sizes_are_refused_once_at_the_boundary(bad):
    """The user's sizes are checked by `EngineArgs` (a ValueError naming them); the pool, built from
    checked settings, asserts its invariant instead of validating again."""
    from minivllm.config import EngineArgs

    with pytest.raises(ValueError, match="block_size"):
        EngineArgs(block_size=bad).check()
    if bad is not None:  # None: no block count given (the byte budget sizes the cache)
        with pytest.raises(ValueError, match="num_kvcache_blocks"):
            EngineArgs(num_kvcache_blocks=bad).check()
    if isinstance(bad, int) and bad < 1:
        with pytest.raises(AssertionError):
            BlockManager(bad, 16)
        with pytest.raises(AssertionError):
            BlockManager(4, bad)


def test_block_manager_interface():
    """`from_cache_size` (the engine's constructor) and `discard_unwritten` (nothing to undo)."""
    bm = BlockManager.from_cache_size(1000, 16, max_model_len=4096)
    assert (bm.num_blocks, bm.block_size, bm.num_free_blocks) == (62, 16, 62)
    a = seq(range(20), 16)
    bm.allocate(a)
    bm.discard_unwritten([a])
    assert a.block_table == [0, 1] and bm.num_free_blocks == 60
    with pytest.raises(AssertionError):
        BlockManager.from_cache_size(15, 16, 4096)  # not one block (the engine refuses it first: kv_cache_num_tokens)


def test_block_manager_imports_no_engine_attention_or_torch():
    code = ("import sys, minivllm.core.block_manager; "
            "print(sorted(m for m in sys.modules if m.startswith(('minivllm.', 'torch'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for forbidden in ("minivllm.engine.llm_engine", "minivllm.attention.backend", "minivllm.attention.paged_attention", "minivllm.llm",
                      "minivllm.core.sched.scheduler", "minivllm.worker.model_runner", "minivllm.attention.ops"):
        assert f"'{forbidden}'" not in loaded, loaded


def test_a_billion_blocks_cost_nothing():
    """`BlockManager(10**9, 16)` is built at once, in little memory, and works like any other."""
    tracemalloc.start()
    t0 = time.perf_counter()
    bm = BlockManager(10**9, 16)
    seconds = time.perf_counter() - t0
    a = seq(range(100), 16)
    bm.allocate(a)
    nbytes = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < 0.5 and nbytes < 1_000_000, (seconds, nbytes)
    assert len(bm.blocks) == 10**9 and bm.num_free_blocks == 10**9 - 7
    assert a.block_table == list(range(7)) and bm.blocks[10**9 - 1].ref_count == 0
    bm.deallocate(a)
    assert bm.num_free_blocks == 10**9
    with pytest.raises(IndexError):
        bm.blocks[10**9]


def test_a_subclass_chooses_its_block_class_and_hooks_allocation():
    """Chapter 06's extension points: `block_cls`, `_allocate_block`, `_free_block`, `free_block_ids.remove`."""

    class TaggedBlock(Block):
        def __init__(self, block_id):
            super().__init__(block_id)
            self.tag = None

    class Tagging(BlockManager):
        block_cls = TaggedBlock
        events: list

        def _allocate_block(self):
            block = super()._allocate_block()
            self.events.append(("take", block.block_id))
            return block

        def _free_block(self, block):
            super()._free_block(block)
            self.events.append(("give", block.block_id))

    bm = Tagging(4, 2)
    bm.events = []
    a = seq([1, 2, 3], 2)
    bm.allocate(a)
    assert all(isinstance(bm.blocks[i], TaggedBlock) for i in a.block_table)
    bm.deallocate(a)
    assert bm.events == [("take", 0), ("take", 1), ("give", 1), ("give", 0)]
    assert list(bm.free_block_ids) == [2, 3, 1, 0]
    bm.free_block_ids.remove(1)  # taken out of the middle (a cached block found again)
    del bm.free_block_ids[0]
    assert list(bm.free_block_ids) == [2, 3] and 1 not in bm.free_block_ids and 3 in bm.free_block_ids
    with pytest.raises(KeyError):
        bm.free_block_ids.remove(3)  # never used: not removable


class EagerBlockManager:
    """The eager pool this chapter replaced (a `Block` per id and an `OrderedDict` of all free ids up
    front): the reference the lazy pool must match, id for id."""

    def __init__(self, num_blocks, block_size):
        self.block_size, self.ref = block_size, [0] * num_blocks
        self.free = OrderedDict.fromkeys(range(num_blocks))

    def allocate(self, s):
        for _ in range(s.num_blocks):
            s.block_table.append(self._take())

    def _take(self):
        block_id, _ = self.free.popitem(last=False)
        self.ref[block_id] = 1
        return block_id

    def may_append(self, s):
        if len(s.block_table) < s.num_blocks:
            s.block_table.append(self._take())

    def deallocate(self, s):
        for block_id in reversed(s.block_table):
            self.ref[block_id] -= 1
            if self.ref[block_id] == 0:
                self.free[block_id] = None
        s.block_table = []


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(1, 30), block_size=st.integers(1, 5))
def test_lazy_pool_equals_the_eager_pool(seed, num_blocks, block_size):
    """Random allocate / grow / free sequences: same block tables, same free queue, same counts."""
    rng = random.Random(seed)
    lazy, eager = BlockManager(num_blocks, block_size), EagerBlockManager(num_blocks, block_size)
    live = []  # (lazy's sequence, eager's sequence)
    for _ in range(60):
        r = rng.random()
        if r < 0.35:
            tokens = [1] * rng.randint(1, 3 * block_size)
            pair = seq(tokens, block_size), seq(tokens, block_size)
            if lazy.can_allocate(pair[0]):
                assert len(eager.free) >= pair[1].num_blocks
                lazy.allocate(pair[0])
                eager.allocate(pair[1])
                live.append(pair)
        elif r < 0.75 and live:
            a, b = live[rng.randrange(len(live))]
            a.append_token(2)
            b.append_token(2)
            if lazy.can_append(a):
                lazy.may_append(a)
                eager.may_append(b)
            else:
                live.remove((a, b))
                lazy.deallocate(a)
                eager.deallocate(b)
        elif live:
            a, b = live.pop(rng.randrange(len(live)))
            lazy.deallocate(a)
            eager.deallocate(b)
        assert all(a.block_table == b.block_table for a, b in live)
        assert list(lazy.free_block_ids) == list(eager.free) and lazy.num_free_blocks == len(eager.free)
        assert lazy.used_block_ids == {i for a, _ in live for i in a.block_table}
        assert all(lazy.blocks[i].ref_count == eager.ref[i] for i in range(num_blocks))


def test_block_list_and_free_queue_on_their_own():
    made = []
    blocks = BlockList(5, lambda i: made.append(i) or Block(i))
    assert len(blocks) == 5 and made == []
    assert blocks[3] is blocks[3] and made == [3]
    assert [b.block_id for b in blocks] == [0, 1, 2, 3, 4]
    for bad in (-1, 5):
        with pytest.raises(IndexError):
            blocks[bad]
    queue = FreeBlockQueue(3)
    assert [queue.popleft() for _ in range(3)] == [0, 1, 2] and len(queue) == 0
    with pytest.raises(IndexError, match="no free block"):
        queue.popleft()
    queue.append(1)
    queue.append(0)
    assert list(queue) == [1, 0] and queue.popleft() == 1


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


@pytest.mark.parametrize("prompt_len, copied", [(6, True), (5, False), (4, True), (1, False)])
def test_fork_shares_the_full_blocks_and_names_the_partial_one_to_copy(prompt_len, copied):
    """`fork` (the block manager's, not the caller's, reference counts): the blocks wholly before the
    child's last token are shared, the one holding earlier tokens and the last is a fresh block whose
    K/V must be copied from the parent's, and the child computes only its last token."""
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = seq(range(1, prompt_len + 1), 4)
    bm.allocate(parent)
    parent.append_token(99)
    child = seq(range(1, prompt_len + 1), 4)
    assert bm.can_fork(child)
    copies = bm.fork(parent, child)
    shared = (prompt_len - 1) // 4
    assert child.block_table[:shared] == parent.block_table[:shared]
    assert all(bm.blocks[b].ref_count == 2 for b in parent.block_table[:shared])
    assert child.num_cached_tokens == prompt_len - 1
    if copied:
        assert copies == [(parent.block_table[shared], child.block_table[shared])]
        assert len(child.block_table) == shared + 1 and bm.blocks[child.block_table[-1]].ref_count == 1
    else:
        assert copies == [] and len(child.block_table) == shared
    bm.deallocate(parent)
    bm.deallocate(child)
    assert bm.num_free_blocks == 8 and not bm.used_block_ids


def test_can_fork_needs_a_free_block_only_for_a_partial_last_block():
    bm = BlockManager(num_blocks=2, block_size=4)
    parent = seq(range(6), 4)
    bm.allocate(parent)
    assert not bm.can_fork(seq(range(6), 4))  # its second block is partial: a copy needs a free block
    assert bm.can_fork(seq(range(5), 4))  # its last token starts a block: nothing to copy


def test_touch_takes_a_free_block_out_of_the_free_queue():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(range(8), 4)
    bm.allocate(a)
    bm.touch(a.block_table)  # one more table holds them
    assert [bm.blocks[b].ref_count for b in a.block_table] == [2, 2] and bm.num_free_blocks == 2
    b = seq(range(8), 4)
    bm.allocate(b)
    bm.deallocate(b)  # blocks 3, 2 freed, nobody holds them
    bm.touch([2])  # chapter 06 finds a freed block by its content and takes it back
    assert 2 not in bm.free_block_ids and 2 in bm.used_block_ids and bm.blocks[2].ref_count == 1
    assert list(bm.free_block_ids) == [3]


def test_only_the_block_manager_changes_reference_counts_or_takes_blocks():
    """Ownership: outside core/, no module of the package writes a `ref_count` or calls a block
    manager's private `_allocate_block`/`_free_block`; engine/ does not run the model itself."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parent.parent / "minivllm"
    offenders = []
    for path in root.rglob("*.py"):
        if path.relative_to(root).parts[0] == "core":
            continue
        text = path.read_text()
        if re.search(r"ref_count\s*[-+]?=|\._allocate_block\(|\._free_block\(|kv_cache\[[^\]]*\]\s*=", text):
            offenders.append(str(path.relative_to(root)))
    assert offenders == [] or offenders == ["worker/model_runner.py"], offenders
