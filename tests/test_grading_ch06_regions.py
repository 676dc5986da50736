"""Grading tests for chapter 06's rebuild exercises (`python -m minivllm.course.grade ch06_ex3`, or `pytest -m ch06_ex3`).

ch06_ex2 (`compute_hash`), ch06_ex3 (`PrefixCachingBlockManager.allocate`) and ch06_ex4
(`BlockCache._uncache`) are graded in the package itself: in a student edition they are the
student's code, exported from the chapter (stubs until filled), and there is no reference to compare
with. Each is graded alone: `_Scaffold` holds the grader's own stand-ins for the other two, written on
the cache's given primitives (`_allocate_block`, `touch`, `_cache`), and `_hashing` swaps in the
grader's hash, so a filled region passes whatever state the others are in.

What is checked is the contract, never this chapter's code:
* the pool: each block's `ref_count` equals the tables holding it; free and used blocks add up to all;
* the cache: `hash_to_block_id` and the blocks agree, and the cached blocks form a forest;
* the content: the grader records which tokens' K/V each block holds (written at prefill and at each
  decode step). A block handed out as cached must hold exactly the sequence's prefix up to that
  block's end, and a cached block's chain of parents must spell what it holds, whatever the hash:
  a hit only when tokens *and* parent match;
* the hits: `num_cached_tokens` counts the longest run of leading full blocks whose prefix is in the
  cache when `allocate` is called, never the block holding the last token;
* the engine with the exercise's code in place: greedy tokens equal transformers' (tiny float64
  model, shared-prefix prompts, a cache small enough to evict).
Any eviction or free order passes: the graders never ask which block is taken.
"""
from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from contextlib import contextmanager
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minivllm.core.prefix_caching as pc
from engine_helpers import hf_greedy, make_model, one_thread, run_engine
from minivllm.core.block_manager import BlockPool
from minivllm.engine.llm_engine import LLMEngine
from minivllm.attention.paged_attention import PagedAttention
from minivllm.core.prefix_caching import NO_HASH, NO_PARENT, BlockCache, PrefixCachingBlockManager
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


# --- the grader's hashes and stand-ins -----------------------------------------------------------
def _grader_hash(token_ids, parent_hash: int = NO_HASH) -> int:
    """A chained 64-bit name (blake2b), standing in for `compute_hash` when another piece is graded."""
    data = repr((parent_hash, [int(t) for t in token_ids])).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _weak_hash(token_ids, parent_hash: int = NO_HASH) -> int:
    """A name from the block's own tokens only, in 16 values: the same block after two different
    prefixes always collides (and some different blocks too). Collisions must cost hits, never outputs."""
    return sum(t * 7**i for i, t in enumerate(token_ids)) % 16


HASHES = {"exact": _grader_hash, "weak": _weak_hash}


@contextmanager
def _hashing(kind: str):
    """Run with the package's `compute_hash` ("student") or the grader's ("exact", "weak") in its place."""
    if kind == "student":
        yield
        return
    with mock.patch.object(pc, "compute_hash", HASHES[kind]):
        yield


def _lookup(bm: BlockCache, token_ids: list[int]) -> list[int]:
    """The blocks that hold `token_ids`' leading full blocks in `bm`'s cache now (hash found in the
    table, the block's tokens and parent equal), in order, up to the first one missing."""
    bs, found, h, parent = bm.block_size, [], NO_HASH, NO_PARENT
    for i in range(len(token_ids) // bs):
        tokens = list(token_ids[i * bs:(i + 1) * bs])
        h = pc.compute_hash(tokens, h)
        block_id = bm.hash_to_block_id.get(h, -1)
        if block_id == -1 or bm.blocks[block_id].token_ids != tokens or bm.blocks[block_id].parent != parent:
            break
        found.append(block_id)
        parent = block_id
    return found


class _Scaffold(PrefixCachingBlockManager):
    """The grader's stand-ins for `allocate` and `_uncache` (written differently from the book's)."""

    def allocate(self, seq: Sequence) -> None:
        assert not seq.block_table
        found = _lookup(self, seq.token_ids)[:(seq.num_tokens - 1) // self.block_size]
        for block_id in found:
            self.touch([block_id])
        seq.block_table, seq.num_cached_tokens = list(found), len(found) * self.block_size
        h = self.blocks[found[-1]].hash if found else NO_HASH
        for i in range(len(found), seq.num_blocks):
            block_id, tokens = self._allocate_block().block_id, seq.block(i)
            if len(tokens) == self.block_size:
                h = pc.compute_hash(tokens, h)
                self._cache(block_id, h, tokens, seq.block_table[-1] if i else NO_PARENT)
            seq.block_table.append(block_id)

    def _uncache(self, block_id: int) -> None:
        if self.blocks[block_id].hash == NO_HASH:
            return
        gone, grew = {block_id}, True
        while grew:  # every cached block whose parent is gone goes too
            below = {b for b in self.hash_to_block_id.values() if b not in gone and self.blocks[b].parent in gone}
            grew, gone = bool(below), gone | below
        for b in gone:
            block = self.blocks[b]
            del self.hash_to_block_id[block.hash]
            if block.parent != NO_PARENT:
                self.blocks[block.parent].children.discard(b)
            block.forget()


FINDABLE = {  # why a full block just computed may not be found again, by exercise
    "ch06_ex2": "compute_hash must give the same prefix the same name every time",
    "ch06_ex3": "each new full block must be cached (self._cache with its chained hash and its parent) unless "
                "its name is already taken",
    "ch06_ex4": "_uncache removed cached blocks it was not asked to remove (only the block and those below it go)",
}
PIECES = {"ch06_ex3": ("allocate", PrefixCachingBlockManager), "ch06_ex4": ("_uncache", BlockCache)}


def _graded(ex: str) -> type[PrefixCachingBlockManager]:
    """A manager with the package's (the student's) piece for `ex` and the grader's others. For
    ch06_ex2 the piece is `compute_hash`, used with the grader's methods (`_hashing("student")`)."""
    if ex == "ch06_ex2":
        return _Scaffold
    name, owner = PIECES[ex]
    return type(f"Graded_{name.strip('_')}", (_Scaffold,), {name: owner.__dict__[name]})


def _params(pairs):
    return [pytest.param(ex, kind, marks=getattr(pytest.mark, ex), id=f"{ex}-{kind}") for ex, kind in pairs]


# --- the manager under random operations, with the grader's record of each block's content ------
class _Drive:
    """Admit, re-admit, grow (preempting when no block is free), fork, fail and free sequences on a
    graded manager; check the pool, the cache and every block's content after each operation."""

    def __init__(self, ex: str, kind: str, num_blocks: int, block_size: int):
        self.ex, self.kind, self.bs = ex, kind, block_size
        self.bm = _graded(ex)(num_blocks, block_size)
        self.live: list[Sequence] = []
        self.gone: list[list[int]] = []  # token ids of finished and preempted sequences (to re-admit)
        self.content: dict[int, tuple | None] = {}  # block id -> the tokens whose K/V it holds (None: garbage)

    def admit(self, tokens: list[int], fail: bool = False) -> None:
        bm, bs, ex = self.bm, self.bs, self.ex
        seq = Sequence(list(tokens), block_size=bs)
        if bm.num_free_blocks < seq.num_blocks:
            return
        found, free_before = _lookup(bm, tokens), set(bm.free_block_ids)
        want = min(len(found), (len(tokens) - 1) // bs)
        seq.num_cached_tokens = 3  # allocate sets it
        bm.allocate(seq)
        table, n = list(seq.block_table), len(tokens)
        at = f"{ex}: allocate of prompt {tokens} (block_size {bs})"
        _expect(len(table) == seq.num_blocks and len(set(table)) == len(table) and
                all(isinstance(b, int) and 0 <= b < bm.num_blocks for b in table),
                f"{at}: block_table {table} should hold {seq.num_blocks} distinct block ids in [0, {bm.num_blocks})")
        k, rest = divmod(seq.num_cached_tokens, bs)
        _expect(rest == 0 and 0 <= seq.num_cached_tokens < n, f"{at}: num_cached_tokens is {seq.num_cached_tokens}; "
                f"it counts whole blocks of {bs} and never the block holding the last token (at most {n - 1})")
        for i in range(k):
            holds = self.content.get(table[i])
            _expect(holds == tuple(tokens[:(i + 1) * bs]), f"{at}: block {table[i]} was handed out as cached for "
                    f"block {i}, prefix {tokens[:(i + 1) * bs]}, but holds the K/V of {holds and list(holds)}. "
                    "A hit needs the block's tokens to match AND its parent to be the block just matched "
                    "(a hash only finds candidates; names can collide)")
        _expect(k == want, f"{at}: num_cached_tokens should be {want * bs}: when allocate was called the cache "
                f"held the prompt's first {len(found)} full block(s) (blocks {found}, tokens and parents matching), "
                f"of which {want} may be shared (never the block holding the last token); got "
                f"{seq.num_cached_tokens}")
        _expect(table[:k] == found[:k], f"{at}: its cached blocks are {found[:k]}, the table starts {table[:k]}")
        for i in range(k, len(table)):
            b = table[i]
            _expect(b in free_before and bm.blocks[b].ref_count == 1, f"{at}: block {i} of the table is past the "
                    f"cached prefix, so the prefill writes it: it must be a fresh block from the free queue, held "
                    f"only by this sequence, but block {b} was {'free' if b in free_before else 'held'} before and "
                    f"has ref_count {bm.blocks[b].ref_count}")
            self.content[b] = None if fail else tuple(tokens[:min((i + 1) * bs, n)])
        if self.kind != "weak" and not fail:  # with a hash that does not collide, every full block is findable now
            _expect(len(_lookup(bm, tokens)) == n // bs, f"{at}: after allocate only the first "
                    f"{len(_lookup(bm, tokens))} of the prompt's {n // bs} full blocks can be found in the cache: "
                    f"{FINDABLE[ex]}")
        self.live.append(seq)
        if fail:  # the step failed before writing its K/V, as the engine reports it
            bm.discard_unwritten([seq])
            self.free(len(self.live) - 1, keep=False)

    def grow(self, i: int, token: int) -> None:
        bm, seq = self.bm, self.live[i % len(self.live)]
        seq.append_token(token)
        if len(seq.block_table) < seq.num_blocks and bm.num_free_blocks == 0:
            self.free(self.live.index(seq))  # preempted, as the scheduler would
            return
        bm.may_append(seq)
        b = seq.block_table[(seq.num_tokens - 1) // self.bs]
        _expect(bm.blocks[b].ref_count == 1, f"{self.ex}: a decode step of a sequence writes into block {b}, which "
                f"{bm.blocks[b].ref_count} tables hold: a shared block must never be written")
        self.content[b] = tuple(seq.token_ids)

    def fork(self, i: int) -> None:
        seq = self.live[i % len(self.live)]
        if seq.num_tokens % self.bs:  # only whole blocks are shared: the next token starts a block of its own
            return
        child = Sequence(list(seq.token_ids), block_size=self.bs)
        child.block_table = list(seq.block_table)
        for b in child.block_table:
            self.bm.blocks[b].ref_count += 1
        self.live.append(child)

    def free(self, i: int, keep: bool = True) -> None:
        seq = self.live.pop(i % len(self.live))
        tokens = list(seq.token_ids)
        self.bm.deallocate(seq)
        if keep:
            self.gone.append(tokens)

    def check(self, after: str) -> None:
        bm, at = self.bm, f"{self.ex}: after {after}: "
        held = Counter(b for s in self.live for b in s.block_table)
        for s in self.live:
            _expect(len(s.block_table) == s.num_blocks, f"{at}a sequence of {s.num_tokens} tokens holds "
                    f"{len(s.block_table)} blocks of {self.bs}, needs {s.num_blocks}")
        for b in range(bm.num_blocks):
            _expect(bm.blocks[b].ref_count == held[b], f"{at}block {b} is in {held[b]} block table(s) but its "
                    f"ref_count is {bm.blocks[b].ref_count}")
        free = list(bm.free_block_ids)
        _expect(len(free) == len(set(free)) == bm.num_free_blocks, f"{at}the free queue {free} holds a block twice")
        _expect(not set(free) & set(held), f"{at}blocks {sorted(set(free) & set(held))} are free and also held "
                "(a cached block found for a sequence is taken with self.touch, which takes it out of the free "
                "queue if nobody held it)")
        _expect(set(free) | set(held) == set(range(bm.num_blocks)) and bm.used_block_ids == set(held),
                f"{at}free {sorted(free)} and used {sorted(bm.used_block_ids)} should split the {bm.num_blocks} "
                f"blocks, used = held by a table {sorted(held)}")
        cached = {b: bm.blocks[b] for b in range(bm.num_blocks) if bm.blocks[b].hash != NO_HASH}
        _expect(bm.hash_to_block_id == {blk.hash: b for b, blk in cached.items()}, f"{at}hash_to_block_id is "
                f"{bm.hash_to_block_id}; it should map exactly the cached blocks' hashes to them, "
                f"{ {blk.hash: b for b, blk in cached.items()} } (a block that leaves the cache leaves the table)")
        for b, blk in cached.items():
            _expect(len(blk.token_ids) == self.bs, f"{at}cached block {b} holds {blk.token_ids}, not {self.bs} tokens")
            _expect(blk.parent == NO_PARENT or (blk.parent in cached and b in cached[blk.parent].children),
                    f"{at}cached block {b}'s parent {blk.parent} is not cached or does not list it as a child: a "
                    "block leaves the cache with every cached block below it")
            _expect(all(c in cached and cached[c].parent == b for c in blk.children), f"{at}cached block {b} lists "
                    f"children {sorted(blk.children)}, not all cached with {b} as their parent")
            chain, walk = [], blk
            for _ in range(bm.num_blocks):
                chain[:0] = walk.token_ids
                if walk.parent == NO_PARENT:
                    break
                walk = cached[walk.parent]
            holds = self.content.get(b)
            _expect(holds == tuple(chain), f"{at}cached block {b} claims the K/V of {chain} (its tokens after its "
                    f"chain of parents) but holds those of {holds and list(holds)}: a later hit would be wrong")


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(1, 2), min_size=1, max_size=10)),
    st.tuples(st.just("grow"), st.integers(0, 9), st.integers(1, 2)),
    st.tuples(st.just("fork"), st.integers(0, 9)),
    st.tuples(st.just("free"), st.integers(0, 9)),
    st.tuples(st.just("readmit"), st.integers(0, 9)),
    st.tuples(st.just("fail"), st.lists(st.integers(1, 2), min_size=1, max_size=10))), min_size=4, max_size=30)


@pytest.mark.ch06
@pytest.mark.parametrize("ex, kind", _params([("ch06_ex2", "student"), ("ch06_ex3", "exact"), ("ch06_ex3", "weak"),
                                               ("ch06_ex4", "exact"), ("ch06_ex4", "weak")]))
@settings(max_examples=80, deadline=None)
@given(ops=OPS, block_size=st.integers(1, 4), num_blocks=st.integers(2, 12))
def test_ch06_cache_contract_under_random_operations(ex, kind, ops, block_size, num_blocks):
    """Random admissions (prompts over two tokens: prefixes repeat), re-admissions, decode steps,
    forks, failed steps and frees on a small cache (blocks are evicted): the pool, the cache and every
    block's content stay consistent; each allocate shares exactly the cached prefix (`kind`: the
    grader's hash, or a weak one that collides everywhere)."""
    with _hashing(kind):
        d = _Drive(ex, kind, num_blocks, block_size)
        for j, op in enumerate(ops):
            if op[0] == "add":
                d.admit(op[1])
            elif op[0] == "fail":
                d.admit(op[1], fail=True)
            elif op[0] == "readmit":
                if d.gone:
                    d.admit(d.gone[op[1] % len(d.gone)])
            elif d.live:
                getattr(d, op[0])(*op[1:])
            d.check(f"operation {j} of {ops}")
        while d.live:
            d.free(0)
        d.check("freeing every sequence")


# --- hits as the rule says, on a cache that keeps everything --------------------------------------
def _rule(tokens: list[int], written: set[tuple[int, ...]], bs: int) -> int:
    """Cached tokens by the chapter's rule: the leading full blocks whose whole prefix was computed
    before, never the block holding the last token."""
    m = 0
    while (m + 1) * bs <= len(tokens) - 1 and tuple(tokens[:(m + 1) * bs]) in written:
        m += 1
    return m * bs


@pytest.mark.ch06
@pytest.mark.parametrize("ex, kind", _params([("ch06_ex2", "student"), ("ch06_ex3", "exact")]))
@settings(max_examples=100, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(1, 2), min_size=1, max_size=12), min_size=1, max_size=8),
       block_size=st.integers(1, 4))
def test_ch06_hits_follow_the_rule(ex, kind, prompts, block_size):
    """Requests one after another, every prompt twice, on a cache large enough to evict nothing:
    `num_cached_tokens` is exactly what the rule allows, given what earlier requests computed."""
    requests = prompts + prompts
    with _hashing(kind):
        bm = _graded(ex)(sum(-(-len(p) // block_size) for p in requests), block_size)
        written: set[tuple[int, ...]] = set()
        for k, tokens in enumerate(requests):
            seq = Sequence(tokens, block_size=block_size)
            bm.allocate(seq)
            want = _rule(tokens, written, block_size)
            _expect(seq.num_cached_tokens == want, f"{ex}: request {k} of {requests} (block_size {block_size}): "
                    f"num_cached_tokens should be {want} (the leading full blocks an earlier request computed, "
                    f"never the block holding the last token), got {seq.num_cached_tokens}")
            written.update(tuple(tokens[:j]) for j in range(block_size, len(tokens) + 1, block_size))
            bm.deallocate(seq)


@pytest.mark.ch06
@pytest.mark.ch06_ex3
def test_ch06_ex3_a_collision_costs_a_hit_not_an_output():
    """The chapter's injected collision: block T gets one name whatever its parent. After B+T and A,
    the prompt A+T+[9] finds A; the block named like T holds B+T, so it must not be shared."""
    A, B, T = [1, 2], [3, 4], [5, 6]

    def colliding(token_ids, parent_hash=NO_HASH):
        return 12345 if list(token_ids) == T else _grader_hash(token_ids, parent_hash)

    with mock.patch.object(pc, "compute_hash", colliding):
        bm = _graded("ch06_ex3")(16, 2)
        first, second, third = (Sequence(p, block_size=2) for p in (B + T + [7], A + [8], A + T + [9]))
        for s in (first, second, third):
            bm.allocate(s)
    _expect(third.block_table[0] == second.block_table[0], "ch06_ex3: prompt A+T+[9] should share the block of "
            f"A (block {second.block_table[0]}), its table is {third.block_table}")
    _expect(third.block_table[1] != first.block_table[1], f"ch06_ex3: prompt A+T+[9] was given block "
            f"{first.block_table[1]}, which holds B+T: its name and tokens match, but its parent is B's block, "
            "not A's. A hit needs the parent to be the block just matched")
    _expect(third.num_cached_tokens == 2, f"ch06_ex3: prompt A+T+[9] should have 2 cached tokens (block A), "
            f"got {third.num_cached_tokens}")


# --- ch06_ex2: the name of a block ---------------------------------------------------------------
TOKEN = st.one_of(st.integers(0, 300), st.integers(0, 2**32 - 1))


@pytest.mark.ch06
@pytest.mark.ch06_ex2
@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(TOKEN, min_size=1, max_size=16), parent=st.one_of(st.just(NO_HASH), st.integers(0, 2**64 - 1)))
def test_ch06_ex2_hash_is_a_stable_64_bit_name(tokens, parent):
    """Any full block (token ids up to 2**32 - 1) after any parent hash: an int in [0, 2**64), the
    same for the same input (also given a copy of the list)."""
    h = pc.compute_hash(tokens, parent)
    _expect(type(h) is int and 0 <= h < 2**64, f"ch06_ex2: compute_hash({tokens}, {parent}) returned {h!r}; "
            "expected an int in [0, 2**64)")
    _expect(pc.compute_hash(list(tokens), parent) == h, f"ch06_ex2: compute_hash({tokens}, {parent}) gives "
            "another value the second time: equal prefixes must get equal names")


@pytest.mark.ch06
@pytest.mark.ch06_ex2
@pytest.mark.parametrize("block_size, depth", [(1, 4), (2, 2), (3, 1)])
def test_ch06_ex2_different_prefixes_get_different_names(block_size, depth):
    """Every prefix of up to `depth` full blocks over the tokens 0, 1, 3, 12, 23, 256, 2**32 - 1, each
    named by chaining: no two different prefixes share a name (digits written one after another, for
    one, would give [1, 23] and [12, 3] the same name; a hash that ignores the parent gives the same
    block after different prefixes the same name)."""
    alphabet = [0, 1, 3, 12, 23, 256, 2**32 - 1]
    blocks = [list(b) for b in itertools.product(alphabet, repeat=block_size)]
    names: dict[int, list[int]] = {}
    level = [([], NO_HASH)]
    for _ in range(depth):
        nxt = []
        for prefix, parent in level:
            for block in blocks:
                h = pc.compute_hash(block, parent)
                _expect(h not in names, f"ch06_ex2: prefixes {names.get(h)} and {prefix + block} (block_size "
                        f"{block_size}) both get the name {h}")
                names[h] = prefix + block
                nxt.append((prefix + block, h))
        level = nxt


# --- ch06_ex4: uncaching a block and everything below it -----------------------------------------
def _forest(bm: BlockCache, prompts: list[list[int]]) -> None:
    """Cache every full block of `prompts` in `bm`, sharing equal prefixes (blocks taken from the pool
    directly, so that no graded code runs while the forest is built)."""
    bs, block_of = bm.block_size, {}
    for tokens in prompts:
        h, parent = NO_HASH, NO_PARENT
        for i in range(len(tokens) // bs):
            prefix, block = tuple(tokens[:(i + 1) * bs]), tokens[i * bs:(i + 1) * bs]
            h = _grader_hash(block, h)
            if prefix not in block_of:
                block_of[prefix] = BlockPool._allocate_block(bm).block_id
                bm._cache(block_of[prefix], h, block, parent)
            parent = block_of[prefix]


@pytest.mark.ch06
@pytest.mark.ch06_ex4
@settings(max_examples=150, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=10), min_size=1, max_size=6),
       block_size=st.integers(1, 3), targets=st.lists(st.integers(0, 60), min_size=1, max_size=4))
def test_ch06_ex4_uncache_removes_exactly_the_block_and_those_below(prompts, block_size, targets):
    """A forest of cached blocks; `_uncache(b)` for a few blocks, cached or not: `b` and every cached
    block below it leave the cache (out of `hash_to_block_id`, forgotten, unlinked from their parents),
    every other cached block stays as it was."""
    bm = _graded("ch06_ex4")(61, block_size)
    _forest(bm, prompts)
    for t in targets:
        before = {b: (blk.hash, list(blk.token_ids), blk.parent, set(blk.children))
                  for b in range(bm.num_blocks) if (blk := bm.blocks[b]).hash != NO_HASH}
        gone, todo = set(), [t] if t in before else []
        while todo:
            b = todo.pop()
            gone.add(b)
            todo += before[b][3]
        bm._uncache(t)
        at = f"ch06_ex4: _uncache({t}) on the forest of {prompts} (block_size {block_size}; cached block: " \
             f"(hash, tokens, parent, children) {before})"
        for b in gone:
            blk = bm.blocks[b]
            _expect((blk.hash, blk.token_ids, blk.parent, blk.children) == (NO_HASH, [], NO_PARENT, set()),
                    f"{at}: block {b} is {'it' if b == t else 'below it'} and must be forgotten (block.forget()), "
                    f"it has hash {blk.hash}, tokens {blk.token_ids}, parent {blk.parent}, children {blk.children}")
        for b, (h, tokens, parent, children) in before.items():
            if b in gone:
                continue
            blk = bm.blocks[b]
            _expect((blk.hash, blk.token_ids, blk.parent, blk.children) == (h, tokens, parent, children - gone),
                    f"{at}: block {b} is not below {t} and must stay cached as it was (children minus those "
                    f"removed: {sorted(children - gone)}); it has hash {blk.hash}, tokens {blk.token_ids}, parent "
                    f"{blk.parent}, children {sorted(blk.children)}")
        want = {h: b for b, (h, *_rest) in before.items() if b not in gone}
        _expect(bm.hash_to_block_id == want, f"{at}: hash_to_block_id should be {want}, is {bm.hash_to_block_id}")


@pytest.mark.ch06
@pytest.mark.ch06_ex4
def test_ch06_ex4_a_chain_thousands_of_blocks_deep():
    """A 3,000-token prompt in blocks of one token: uncaching its second block uncaches 2,999 blocks
    (Python's recursion limit is about 1,000: the walk must be a loop)."""
    n = 3000
    bm = _graded("ch06_ex4")(n, 1)
    _forest(bm, [[7] * n])
    try:
        bm._uncache(1)
    except RecursionError as e:
        raise AssertionError("ch06_ex4: _uncache on a chain of 3,000 cached blocks hit Python's recursion limit: "
                             "walk the blocks below with a loop (a list as a stack), not with recursion") from e
    _expect(list(bm.hash_to_block_id.values()) == [0] and bm.blocks[0].children == set(),
            f"ch06_ex4: after uncaching block 1 of a 3,000-block chain only block 0 should stay cached, with no "
            f"children; cached: {len(bm.hash_to_block_id)} blocks, block 0's children {bm.blocks[0].children}")


# --- the engine with each piece in place, against transformers -----------------------------------
@pytest.fixture(scope="module")
def ch06_engine_case(tmp_path_factory):
    """A tiny float64 model; prompts that share a 13-token preamble (three blocks of 4 and one token),
    repeats, and transformers' greedy tokens for them."""
    import random

    folder = tmp_path_factory.mktemp("grading-ch06-regions")
    model = make_model(folder, "llama")
    rng = random.Random(6)
    preamble = [rng.randrange(128) for _ in range(13)]
    prompts = [preamble + [rng.randrange(128) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    prompts += [prompts[0], preamble[:8], prompts[2] + [5]]  # a repeat, a whole-block prompt, an extension
    ref = {tuple(p): hf_greedy(model, p, 6) for p in prompts}
    return folder, prompts, ref


@pytest.mark.ch06
@pytest.mark.parametrize("ex, kind", _params([("ch06_ex2", "student"), ("ch06_ex3", "exact"), ("ch06_ex4", "exact")]))
def test_ch06_engine_equals_transformers(ex, kind, ch06_engine_case):
    """Three rounds of the prompts on a cache of 24 blocks of 4 (cached blocks are evicted and
    sequences preempted): greedy tokens equal transformers', later rounds find cached blocks, every
    block is free at the end."""
    folder, prompts, ref = ch06_engine_case
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with _hashing(kind):
        engine = LLMEngine(model=folder, dtype="float64", max_model_len=64, block_size=4, num_kvcache_blocks=24,
                           block_manager_cls=_graded(ex), attention_backend=PagedAttention)
        rounds = [prompts[:3], prompts, prompts[::-1]]
        try:  # run_engine checks the engine's invariants after every step
            outs = [run_engine(engine, batch, params) for batch in rounds]
        except AssertionError as e:
            raise AssertionError(f"{ex}: with your code the engine broke an invariant of its KV cache (reference "
                                 f"counts, free and used blocks, the hash table; the traceback shows which): {e}") from e
    for batch, batch_outs in zip(rounds, outs):
        for p, o in zip(batch, batch_outs):
            got, want = o.outputs[0].token_ids, ref[tuple(p)]
            _expect(got == want, f"{ex}: prompt {p} ({len(p)} tokens, {o.num_cached_tokens} from the cache): the "
                    f"engine generated {got}, transformers {want}")
    _expect(sum(o.num_cached_tokens for o in outs[1]) > 0, f"{ex}: the second round found nothing in the cache "
            f"(num_cached_tokens {[o.num_cached_tokens for o in outs[1]]}), though its prompts share a preamble")
    bm = engine.block_manager
    _expect(bm.num_free_blocks == bm.num_blocks, f"{ex}: {bm.num_blocks - bm.num_free_blocks} blocks still held "
            "after every request finished")
