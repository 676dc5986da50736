"""Grading tests for chapter 06's build (`python -m minivllm.course.grade ch06_ex1`, or `pytest -m ch06_ex1`).

ch06_ex1 is the prefix cache written whole: `compute_hash`; the cache's forest (`_cache`, `_uncache`);
the pool with a cache (`BlockCache._free_block`, `_allocate_block`, `discard_unwritten`); the lookup
(`PrefixCachingBlockManager._is_hit`, `allocate`, `may_append`). It is graded in the package itself:
in a student edition these are the student's code, exported from the chapter (stubs until filled),
and there is no reference to compare with. It scores by parts (`@pytest.mark.group`, the groups of
`EXERCISES["ch06_ex1"]`), each on its own: `STAND_INS` holds the grader's own version of every method
of the build (written on the pool's given primitives: `BlockPool._allocate_block`, `_free_block`,
`touch`), `_graded(part)` puts them in place of the methods a part is not about, and `_hashing`
swaps the grader's hash in for `compute_hash` where the hash is not what is graded. Random workloads
are derandomized (the same answer always scores the same points). The tests at the end check that
plausible wrong answers lose their part's points.

What is checked is the contract, never this chapter's code:
* the pool: each block's `ref_count` equals the tables holding it; free and used blocks add up to all;
* the cache: `hash_to_block_id` and the blocks agree, and the cached blocks form a forest;
* the content: the grader records which tokens' K/V each block holds (written at prefill and at each
  decode step). A block handed out as cached must hold exactly the sequence's prefix up to that
  block's end, and a cached block's chain of parents must spell what it holds, whatever the hash:
  a hit only when tokens *and* parent match;
* the hits: `num_cached_tokens` counts the longest run of leading full blocks whose prefix is in the
  cache when `allocate` is called, never the block holding the last token;
* freeing and eviction: a free leaves the cache as it was; the blocks taken for new content are the
  least recently freed (the pool's free queue, front first), and what they cached leaves the cache;
* the engine on the whole build: greedy tokens equal transformers' (tiny float64 model, shared-prefix
  prompts, a cache small enough to evict).
"""
from __future__ import annotations

import hashlib
import inspect
import itertools
from collections import Counter
from contextlib import contextmanager
from unittest import mock

import pytest
import xxhash
from hypothesis import example, given, settings
from hypothesis import strategies as st

import minivllm.core.prefix_caching as pc
from engine_helpers import hf_greedy, make_model, one_thread, run_engine
from minivllm.attention.paged_attention import PagedAttention
from minivllm.core.block_manager import BlockManager, BlockPool
from minivllm.core.prefix_caching import NO_HASH, NO_PARENT, PrefixCachingBlockManager
from minivllm.course.grade import EXERCISES as GRADED
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence
from test_grading_ch04_regions import your_code

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)

EX = "ch06_ex1"
HASHES, ALLOCS, KEEPS, ENGINE = (name for name, _ in GRADED[EX].groups)
PARTS = {"hash": (), "alloc": ("_is_hit", "allocate", "may_append"),
         "keeps": ("_cache", "_uncache", "_free_block", "_allocate_block", "discard_unwritten")}
PART_GROUP = {"hash": HASHES, "alloc": ALLOCS, "keeps": KEEPS}


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _derandomized(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    report_multiple_bugs=False)


# --- the grader's stand-ins: every method of the build, written differently from the book's ------
def _grader_hash(token_ids, parent_hash: int = NO_HASH) -> int:
    """A chained 64-bit name (blake2b), standing in for `compute_hash` when another part is graded."""
    data = repr((parent_hash, [int(t) for t in token_ids])).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _lookup(bm, token_ids: list[int]) -> list[int]:
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


def _grader_cache(self, block_id, h, token_ids, parent) -> None:
    if h in self.hash_to_block_id:
        return  # first come, first kept
    if parent != NO_PARENT and self.blocks[parent].hash == NO_HASH:
        return  # an orphan could never be reached
    block = self.blocks[block_id]
    block.hash, block.token_ids, block.parent = h, [int(t) for t in token_ids], parent
    self.hash_to_block_id[h] = block_id
    if parent != NO_PARENT:
        self.blocks[parent].children.add(block_id)


def _grader_uncache(self, block_id) -> None:
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


def _grader_free_block(self, block) -> None:
    BlockPool._free_block(self, block)


def _grader_allocate_block(self):
    block = BlockPool._allocate_block(self)
    self._uncache(block.block_id)
    return block


def _grader_discard_unwritten(self, seqs) -> None:
    for seq in seqs:
        for block_id in reversed(seq.block_table[seq.num_cached_tokens // self.block_size:]):
            self._uncache(block_id)


def _grader_is_hit(self, block_id, token_ids, parent) -> bool:
    return 0 <= block_id < self.num_blocks and self.blocks[block_id].parent == parent \
        and list(self.blocks[block_id].token_ids) == list(token_ids)


def _grader_allocate(self, seq) -> None:
    assert not seq.block_table
    found = _lookup(self, seq.token_ids)[:(seq.num_tokens - 1) // self.block_size]
    self.touch(found)
    seq.block_table, seq.num_cached_tokens = list(found), len(found) * self.block_size
    h = self.blocks[found[-1]].hash if found else NO_HASH
    for i in range(len(found), seq.num_blocks):
        block_id, tokens = self._allocate_block().block_id, seq.block(i)
        if len(tokens) == self.block_size:
            h = pc.compute_hash(tokens, h)
            self._cache(block_id, h, tokens, seq.block_table[-1] if i else NO_PARENT)
        seq.block_table.append(block_id)


def _grader_may_append(self, seq) -> None:
    BlockManager.may_append(self, seq)
    if seq.num_tokens % self.block_size:
        return
    i = seq.num_tokens // self.block_size - 1
    parent = seq.block_table[i - 1] if i else NO_PARENT
    parent_hash = self.blocks[parent].hash if i else NO_HASH
    if not i or parent_hash != NO_HASH:
        self._cache(seq.block_table[i], pc.compute_hash(seq.block(i), parent_hash), seq.block(i), parent)


_GRADER_METHODS = {"_cache": _grader_cache, "_uncache": _grader_uncache, "_free_block": _grader_free_block,
                   "_allocate_block": _grader_allocate_block, "discard_unwritten": _grader_discard_unwritten, "_is_hit": _grader_is_hit,
                   "allocate": _grader_allocate, "may_append": _grader_may_append}


def _owner(name: str) -> type:
    """The class of the chapter that defines method `name` (where a stand-in goes)."""
    return next(c for c in PrefixCachingBlockManager.__mro__ if name in vars(c))


BUILD_METHODS = [m for part in ("alloc", "keeps") for m in PARTS[part]]
STAND_INS = {EX: [(pc, "compute_hash", _grader_hash)]
             + [(_owner(m), m, _GRADER_METHODS[m]) for m in BUILD_METHODS]}


def _through_the_grader(fn):
    """`fn` as a method: while the build is graded the stand-ins are tripwires for the code under
    grading, and this wrapper (the graders' own code) is how the graders call them."""
    def method(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    return method


def _graded(part: str) -> type[PrefixCachingBlockManager]:
    """The manager that grades `part`: the package's (the student's) methods of that part, the
    grader's for the others ("hash": the grader's methods all, with the package's `compute_hash`
    under `_hashing("student")`); "whole": the package's `PrefixCachingBlockManager` as it is."""
    if part == "whole":
        return PrefixCachingBlockManager
    body = {name: _through_the_grader(fn) for _, name, fn in STAND_INS[EX][1:] if name not in PARTS[part]}
    return type(f"Graded_{part}", (PrefixCachingBlockManager,), body)


def _exact_hash(token_ids, parent_hash: int = NO_HASH) -> int:
    return _grader_hash(token_ids, parent_hash)


def _weak_hash(token_ids, parent_hash: int = NO_HASH) -> int:
    """A name from the block's own tokens only, in 16 values: the same block after two different
    prefixes always collides (and some different blocks too). Collisions must cost hits, never outputs."""
    return sum(t * 7**i for i, t in enumerate(token_ids)) % 16


@contextmanager
def _hashing(kind: str):
    """Run with the package's `compute_hash` ("student") or the grader's ("exact", "weak") in its place."""
    if kind == "student":
        yield
        return
    with mock.patch.object(pc, "compute_hash", {"exact": _exact_hash, "weak": _weak_hash}[kind]):
        yield


FINDABLE = {  # why a full block just computed may not be found again, by part
    "hash": "compute_hash must give the same prefix the same name every time and different prefixes different "
            "names (chain the parent's hash)",
    "alloc": "each new full block must be cached (self._cache with its chained hash and its parent) unless "
             "its name is already taken",
    "keeps": "_cache must enter the block (hash, tokens, parent, the parent's children, hash_to_block_id) unless "
             "its name is taken or its parent caches nothing, and _allocate_block/_uncache must remove no more "
             "than the block taken and those below it",
    "whole": "each new full block must be cached",
}


# --- the manager under random operations, with the grader's record of each block's content ------
class _Drive:
    """Admit, re-admit, grow (preempting when no block is free), fork, fail and free sequences on a
    graded manager; check the pool, the cache and every block's content after each operation."""

    def __init__(self, cls: type, part: str, kind: str, num_blocks: int, block_size: int):
        self.part, self.kind, self.bs = part, kind, block_size
        self.bm = cls(num_blocks, block_size)
        self.live: list[Sequence] = []
        self.gone: list[list[int]] = []  # token ids of finished and preempted sequences (to re-admit)
        self.content: dict[int, tuple | None] = {}  # block id -> the tokens whose K/V it holds (None: garbage)

    def admit(self, tokens: list[int], fail: bool = False) -> None:
        bm, bs = self.bm, self.bs
        seq = Sequence(list(tokens), block_size=bs)
        if bm.num_free_blocks < seq.num_blocks:
            return
        found, queue = _lookup(bm, tokens), list(bm.free_block_ids)
        want = min(len(found), (len(tokens) - 1) // bs)
        seq.num_cached_tokens = 3  # allocate sets it
        at = f"{EX}: allocate of prompt {tokens} (block_size {bs})"
        with your_code(EX, at[len(EX) + 2:]):
            bm.allocate(seq)
        table, n = list(seq.block_table), len(tokens)
        k, rest = divmod(seq.num_cached_tokens, bs)
        _expect(rest == 0 and 0 <= seq.num_cached_tokens < n, f"{at}: num_cached_tokens is {seq.num_cached_tokens} "
                f"after allocate (it was 3 before the call: allocate sets it, from 0); it counts whole blocks of {bs} "
                f"and never the block holding the last token (at most {n - 1})")
        for i in range(min(k, len(table))):
            holds = self.content.get(table[i])
            _expect(holds == tuple(tokens[:(i + 1) * bs]), f"{at}: block {table[i]} was handed out as cached for "
                    f"block {i}, prefix {tokens[:(i + 1) * bs]}, but holds the K/V of {holds and list(holds)}. "
                    "A hit needs the block's tokens to match AND its parent to be the block just matched "
                    "(a hash only finds candidates; names can collide)")
        _expect(len(table) == seq.num_blocks and len(set(table)) == len(table) and
                all(isinstance(b, int) and 0 <= b < bm.num_blocks for b in table),
                f"{at}: block_table {table} should hold {seq.num_blocks} distinct block ids in [0, {bm.num_blocks})")
        _expect(k == want, f"{at}: num_cached_tokens should be {want * bs}: when allocate was called the cache "
                f"held the prompt's first {len(found)} full block(s) (blocks {found}, tokens and parents matching), "
                f"of which {want} may be shared (never the block holding the last token); got "
                f"{seq.num_cached_tokens}")
        _expect(table[:k] == found[:k], f"{at}: its cached blocks are {found[:k]}, the table starts {table[:k]}")
        for i in range(k, len(table)):
            b = table[i]
            _expect(b in queue and bm.blocks[b].ref_count == 1, f"{at}: block {i} of the table is past the "
                    f"cached prefix, so the prefill writes it: it must be a fresh block from the free queue, held "
                    f"only by this sequence, but block {b} was {'free' if b in queue else 'held'} before and "
                    f"has ref_count {bm.blocks[b].ref_count}")
            self.content[b] = None if fail else tuple(tokens[:min((i + 1) * bs, n)])
        if self.part != "alloc":  # the order of taking is allocate's; graded where allocate is the grader's
            lru = [b for b in queue if b not in table[:k]][:len(table) - k]
            _expect(sorted(table[k:]) == sorted(lru), f"{at}: the free queue was {queue} (least recently freed "
                    f"first); the {len(table) - k} block(s) taken for new content should be its first ones, {lru} "
                    f"(besides the cached blocks found, {table[:k]}), but they are {table[k:]}: _allocate_block "
                    "takes the least recently freed block")
        if self.kind != "weak" and not fail:  # with a hash that does not collide, every full block is findable now
            _expect(len(_lookup(bm, tokens)) == n // bs, f"{at}: after allocate only the first "
                    f"{len(_lookup(bm, tokens))} of the prompt's {n // bs} full blocks can be found in the cache: "
                    f"{FINDABLE[self.part]}")
        self.live.append(seq)
        if fail:  # the step failed before writing its K/V, as the engine reports it
            with your_code(EX, f"discard_unwritten of prompt {tokens} (block_size {bs})"):
                bm.discard_unwritten([seq])
            still = [b for b in table[k:] if bm.blocks[b].hash != NO_HASH]
            _expect(not still, f"{at}: the step failed before writing the K/V of blocks {table[k:]} "
                    f"(discard_unwritten), but blocks {still} are still cached")
            self.free(len(self.live) - 1, keep=False)

    def grow(self, i: int, token: int) -> None:
        bm, seq, bs = self.bm, self.live[i % len(self.live)], self.bs
        seq.append_token(token)
        if len(seq.block_table) < seq.num_blocks and bm.num_free_blocks == 0:
            self.free(self.live.index(seq))  # preempted, as the scheduler would
            return
        n, full = seq.num_tokens, seq.num_tokens // bs
        own = full and all(bm.blocks[b].hash != NO_HASH for b in seq.block_table[:full - 1]) and \
            _lookup(bm, seq.token_ids[:(full - 1) * bs]) == seq.block_table[:full - 1]
        with your_code(EX, f"may_append of a sequence of {n} tokens (block_size {bs})"):
            bm.may_append(seq)
        b = seq.block_table[(n - 1) // bs]
        _expect(bm.blocks[b].ref_count == 1, f"{EX}: a decode step of a sequence writes into block {b}, which "
                f"{bm.blocks[b].ref_count} tables hold: a shared block must never be written")
        self.content[b] = tuple(seq.token_ids)
        if n % bs == 0 and own and self.kind != "weak":
            _expect(len(_lookup(bm, seq.token_ids)) == full, f"{EX}: a decode step's token fills block {full - 1} "
                    f"of a sequence of {n} tokens (block_size {bs}, block_table {seq.block_table}) whose earlier "
                    f"blocks are all cached, but after may_append its prefix {seq.token_ids} cannot be found: "
                    + ("may_append caches the block it fills (chained to its parent's hash, with its parent)"
                       if self.part != "hash" else "the block's name was already taken by another prefix: "
                       + FINDABLE["hash"]))

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
        bm, seq = self.bm, self.live.pop(i % len(self.live))
        tokens, table = list(seq.token_ids), list(seq.block_table)
        before = {b: (blk.hash, list(blk.token_ids), blk.parent) for b in range(bm.num_blocks)
                  if (blk := bm.blocks[b]).hash != NO_HASH}
        with your_code(EX, f"deallocate of block_table {table}"):
            bm.deallocate(seq)
        after = {b: (blk.hash, list(blk.token_ids), blk.parent) for b in range(bm.num_blocks)
                 if (blk := bm.blocks[b]).hash != NO_HASH}
        _expect(after == before, f"{EX}: deallocate of a sequence with block_table {table} (tokens {tokens}) changed "
                f"the cache: cached blocks (hash, tokens, parent) were {before}, are {after}. A freed block goes to "
                "the back of the free queue still cached, findable until it is taken for new content")
        if keep:
            self.gone.append(tokens)

    def check(self, after: str) -> None:
        bm, at = self.bm, f"{EX}: after {after}: "
        held = Counter(b for s in self.live for b in s.block_table)
        for s in self.live:
            _expect(len(s.block_table) == s.num_blocks, f"{at}a sequence of {s.num_tokens} tokens holds "
                    f"{len(s.block_table)} blocks of {self.bs}, needs {s.num_blocks}")
        for b in range(bm.num_blocks):
            _expect(bm.blocks[b].ref_count == held[b], f"{at}block {b} is in {held[b]} block table(s) but its "
                    f"ref_count is {bm.blocks[b].ref_count} (a block found in the cache is shared with "
                    "self.touch([block_id]): one more reference)")
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
                    f"chain of parents) but holds those of {holds and list(holds)}: a later hit would be wrong "
                    "(a block taken for new content must leave the cache with everything below it)")


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(1, 2), min_size=1, max_size=10)),
    st.tuples(st.just("grow"), st.integers(0, 9), st.integers(1, 2)),
    st.tuples(st.just("fork"), st.integers(0, 9)),
    st.tuples(st.just("free"), st.integers(0, 9)),
    st.tuples(st.just("readmit"), st.integers(0, 9)),
    st.tuples(st.just("fail"), st.lists(st.integers(1, 2), min_size=1, max_size=10))), min_size=4, max_size=30)


def check_random_operations(cls: type, part: str, kind: str, max_examples: int = 60) -> None:
    """Random admissions (prompts over two tokens: prefixes repeat), re-admissions, decode steps,
    forks, failed steps and frees on a small cache (blocks are evicted): the pool, the cache and every
    block's content stay consistent; each allocate shares exactly the cached prefix (`kind`: the
    grader's hash, a weak one that collides everywhere, or the package's)."""
    @_derandomized(max_examples)
    # a fixed case first (the draws depend on where the check is called from): a prompt admitted twice
    @example(ops=[("add", [1, 2, 1]), ("add", [1, 2, 1]), ("free", 0), ("free", 0)], block_size=1, num_blocks=8)
    @given(ops=OPS, block_size=st.integers(1, 4), num_blocks=st.integers(2, 12))
    def run(ops, block_size, num_blocks):
        d = _Drive(cls, part, kind, num_blocks, block_size)
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
            d.check(f"operation {j} of {ops} ({num_blocks} blocks of {block_size})")
        while d.live:
            d.free(0)
        d.check("freeing every sequence")
    with _hashing(kind):
        run()


def _rule(tokens: list[int], written: set[tuple[int, ...]], bs: int) -> int:
    """Cached tokens by the chapter's rule: the leading full blocks whose whole prefix was computed
    before, never the block holding the last token."""
    m = 0
    while (m + 1) * bs <= len(tokens) - 1 and tuple(tokens[:(m + 1) * bs]) in written:
        m += 1
    return m * bs


def check_hits_follow_the_rule(cls: type, kind: str, max_examples: int = 80) -> None:
    """Requests one after another, every prompt twice, on a cache large enough to evict nothing:
    `num_cached_tokens` is exactly what the rule allows, given what earlier requests computed."""
    @_derandomized(max_examples)
    @example(prompts=[[1, 2]], block_size=1)  # a fixed case first: the block holding the last token
    @given(prompts=st.lists(st.lists(st.integers(1, 2), min_size=1, max_size=12), min_size=1, max_size=8),
           block_size=st.integers(1, 4))
    def run(prompts, block_size):
        requests = prompts + prompts
        bm = cls(sum(-(-len(p) // block_size) for p in requests), block_size)
        written: set[tuple[int, ...]] = set()
        for k, tokens in enumerate(requests):
            seq = Sequence(tokens, block_size=block_size)
            with your_code(EX, f"allocate of request {k} of {requests} (block_size {block_size})"):
                bm.allocate(seq)
            want = _rule(tokens, written, block_size)
            _expect(seq.num_cached_tokens == want, f"{EX}: request {k} of {requests} (block_size {block_size}): "
                    f"num_cached_tokens should be {want} (the leading full blocks an earlier request computed, "
                    f"never the block holding the last token), got {seq.num_cached_tokens}")
            written.update(tuple(tokens[:j]) for j in range(block_size, len(tokens) + 1, block_size))
            bm.deallocate(seq)
    with _hashing(kind):
        run()


# --- the name of a block -------------------------------------------------------------------------
TOKEN = st.one_of(st.integers(0, 300), st.integers(0, 2**32 - 1))


def check_hash_range() -> None:
    """Any full block (token ids up to 2**32 - 1) after any parent hash: an int in [0, 2**64), the
    same for the same input (also given a copy of the list)."""
    @_derandomized(200)
    @example(tokens=[1], parent=NO_HASH)  # a fixed case first: Python's hash((-1, (1,))) is negative
    @given(tokens=st.lists(TOKEN, min_size=1, max_size=16), parent=st.one_of(st.just(NO_HASH), st.integers(0, 2**64 - 1)))
    def run(tokens, parent):
        with your_code(EX, f"compute_hash({tokens}, {parent})"):
            h = pc.compute_hash(tokens, parent)
            again = pc.compute_hash(list(tokens), parent)
        _expect(type(h) is int and 0 <= h < 2**64, f"{EX}: compute_hash({tokens}, {parent}) returned {h!r}; "
                "expected an int in [0, 2**64)")
        _expect(again == h, f"{EX}: compute_hash({tokens}, {parent}) gives another value the second time: equal "
                "prefixes must get equal names")
    run()


def check_distinct_prefixes() -> None:
    """Every prefix of up to `depth` full blocks over the tokens 0, 1, 3, 12, 23, 256, 2**32 - 1, each
    named by chaining: no two different prefixes share a name (digits written one after another, for
    one, would give [1, 23] and [12, 3] the same name; a hash that ignores the parent gives the same
    block after different prefixes the same name)."""
    alphabet = [0, 1, 3, 12, 23, 256, 2**32 - 1]
    for block_size, depth in [(1, 4), (2, 2), (3, 1)]:
        blocks = [list(b) for b in itertools.product(alphabet, repeat=block_size)]
        names: dict[int, list[int]] = {}
        level = [([], NO_HASH)]
        for _ in range(depth):
            nxt = []
            for prefix, parent in level:
                for block in blocks:
                    with your_code(EX, f"compute_hash({block}, {parent})"):
                        h = pc.compute_hash(block, parent)
                    _expect(h not in names, f"{EX}: prefixes {names.get(h)} and {prefix + block} (block_size "
                            f"{block_size}) both get the name {h}: the name must stand for the whole prefix "
                            "(chain the parent's hash; fixed-width bytes per token)")
                    names[h] = prefix + block
                    nxt.append((prefix + block, h))
            level = nxt


# --- the lookup ----------------------------------------------------------------------------------
def check_collision(cls: type) -> None:
    """The chapter's injected collision: block T gets one name whatever its parent. After B+T and A,
    the prompt A+T+[9] finds A; the block named like T holds B+T, so it must not be shared."""
    A, B, T = [1, 2], [3, 4], [5, 6]

    def colliding(token_ids, parent_hash=NO_HASH):
        return 12345 if list(token_ids) == T else _grader_hash(token_ids, parent_hash)

    with mock.patch.object(pc, "compute_hash", colliding):
        bm = cls(16, 2)
        first, second, third = (Sequence(p, block_size=2) for p in (B + T + [7], A + [8], A + T + [9]))
        for s in (first, second, third):
            with your_code(EX, f"allocate of {s.token_ids} (blocks of 2)"):
                bm.allocate(s)
    _expect(third.block_table[0] == second.block_table[0], f"{EX}: prompt A+T+[9] should share the block of "
            f"A (block {second.block_table[0]}), its table is {third.block_table}")
    _expect(third.block_table[1] != first.block_table[1], f"{EX}: prompt A+T+[9] was given block "
            f"{first.block_table[1]}, which holds B+T: its name and tokens match, but its parent is B's block, "
            "not A's. A hit needs the parent to be the block just matched (_is_hit)")
    _expect(third.num_cached_tokens == 2, f"{EX}: prompt A+T+[9] should have 2 cached tokens (block A), "
            f"got {third.num_cached_tokens}")


def check_decode_fills_are_cached(cls: type) -> None:
    """A prompt of 3 tokens (blocks of 2) grows by decode steps to 6 tokens and finishes; a prompt with
    its first 5 tokens finds the two blocks the decode steps filled."""
    with _hashing("exact"):
        bm = cls(8, 2)
        a = Sequence([1, 2, 3], block_size=2)
        bm.allocate(a)
        for t in (4, 5, 6):
            a.append_token(t)
            with your_code(EX, f"may_append of a sequence of {a.num_tokens} tokens (blocks of 2)"):
                bm.may_append(a)
        table = list(a.block_table)
        bm.deallocate(a)
        b = Sequence([1, 2, 3, 4, 5, 6, 7], block_size=2)
        bm.allocate(b)
    _expect(b.num_cached_tokens == 6 and b.block_table[:3] == table[:3], f"{EX}: a sequence [1, 2, 3] grew by "
            f"decode steps to [1, 2, 3, 4, 5, 6] (blocks of 2, block_table {table}) and finished; the prompt "
            f"[1, 2, 3, 4, 5, 6, 7] should find its 3 blocks (6 cached tokens), got num_cached_tokens "
            f"{b.num_cached_tokens} and block_table {b.block_table}: may_append caches the block a decode step fills")


# --- the forest, freeing and eviction ------------------------------------------------------------
def _forest(bm, prompts: list[list[int]]) -> None:
    """Cache every full block of `prompts` in `bm`, sharing equal prefixes (blocks taken from the pool
    and entered with the grader's code, so that no graded code runs while the forest is built)."""
    bs, block_of = bm.block_size, {}
    for tokens in prompts:
        h, parent = NO_HASH, NO_PARENT
        for i in range(len(tokens) // bs):
            prefix, block = tuple(tokens[:(i + 1) * bs]), tokens[i * bs:(i + 1) * bs]
            h = _grader_hash(block, h)
            if prefix not in block_of:
                block_of[prefix] = BlockPool._allocate_block(bm).block_id
                _grader_cache(bm, block_of[prefix], h, block, parent)
            parent = block_of[prefix]


def check_uncache_forest(cls: type) -> None:
    """A forest of cached blocks; `_uncache(b)` for a few blocks, cached or not: `b` and every cached
    block below it leave the cache (out of `hash_to_block_id`, forgotten, unlinked from their parents),
    every other cached block stays as it was."""
    @_derandomized(120)
    @given(prompts=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=10), min_size=1, max_size=6),
           block_size=st.integers(1, 3), targets=st.lists(st.integers(0, 60), min_size=1, max_size=4))
    def run(prompts, block_size, targets):
        bm = cls(61, block_size)
        _forest(bm, prompts)
        for t in targets:
            before = {b: (blk.hash, list(blk.token_ids), blk.parent, set(blk.children))
                      for b in range(bm.num_blocks) if (blk := bm.blocks[b]).hash != NO_HASH}
            gone, todo = set(), [t] if t in before else []
            while todo:
                b = todo.pop()
                gone.add(b)
                todo += before[b][3]
            at = f"{EX}: _uncache({t}) on the forest of {prompts} (block_size {block_size}; cached block: " \
                 f"(hash, tokens, parent, children) {before})"
            with your_code(EX, at[len(EX) + 2:]):
                bm._uncache(t)
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
    run()


def check_deep_chain(cls: type) -> None:
    """A 3,000-token prompt in blocks of one token: uncaching its second block uncaches 2,999 blocks
    (Python's recursion limit is about 1,000: the walk must be a loop)."""
    n = 3000
    bm = cls(n, 1)
    _forest(bm, [[7] * n])
    try:
        with your_code(EX, "_uncache(1) on a chain of 3,000 cached blocks"):
            bm._uncache(1)
    except RecursionError as e:
        raise AssertionError(f"{EX}: _uncache on a chain of 3,000 cached blocks hit Python's recursion limit: "
                             "walk the blocks below with a loop (a list as a stack), not with recursion") from e
    _expect(list(bm.hash_to_block_id.values()) == [0] and bm.blocks[0].children == set(),
            f"{EX}: after uncaching block 1 of a 3,000-block chain only block 0 should stay cached, with no "
            f"children; cached: {len(bm.hash_to_block_id)} blocks, block 0's children {bm.blocks[0].children}")


def check_freed_blocks_found_again(cls: type) -> None:
    """A prompt of 5 tokens (blocks of 2) finishes; a prompt with the same first 4 tokens finds its two
    full blocks in the cache, although they were free."""
    with _hashing("exact"):
        bm = cls(4, 2)
        a, b = Sequence([1, 2, 3, 4, 5], block_size=2), Sequence([1, 2, 3, 4, 6], block_size=2)
        bm.allocate(a)
        table = list(a.block_table)
        with your_code(EX, f"deallocate of block_table {table}"):
            bm.deallocate(a)
        bm.allocate(b)
    _expect(b.num_cached_tokens == 4 and b.block_table[:2] == table[:2], f"{EX}: the prompt [1, 2, 3, 4, 5] (blocks "
            f"of 2, block_table {table}) finished; then [1, 2, 3, 4, 6] should find its first two blocks, free but "
            f"still cached (4 cached tokens, table starting {table[:2]}); got {b.num_cached_tokens} cached tokens "
            f"and block_table {b.block_table}. A freed block keeps its content and name until it is taken again")


def check_discard_keeps_the_cached_prefix(cls: type) -> None:
    """Blocks of 2: [1, 2, 3, 4, 5] runs and finishes (its two full blocks stay cached); [1, 2, 3, 4, 6, 7, 8]
    finds them, gets one more full block and a partial one, then its step fails before writing:
    discard_unwritten uncaches the new full block, and the two found blocks, written earlier, stay cached."""
    with _hashing("exact"):
        bm = cls(8, 2)
        a, b = Sequence([1, 2, 3, 4, 5], block_size=2), Sequence([1, 2, 3, 4, 6, 7, 8], block_size=2)
        bm.allocate(a)
        bm.deallocate(a)
        bm.allocate(b)
        table = list(b.block_table)
        _expect(b.num_cached_tokens == 4, f"{EX}: [1, 2, 3, 4, 6, 7, 8] should find the two cached blocks of "
                f"[1, 2, 3, 4, 5] (4 cached tokens), got {b.num_cached_tokens}")
        with your_code(EX, f"discard_unwritten of block_table {table} with 4 cached tokens (blocks of 2)"):
            bm.discard_unwritten([b])
    lost = [x for x in table[:2] if bm.blocks[x].hash == NO_HASH]
    kept = [x for x in table[2:] if bm.blocks[x].hash != NO_HASH]
    _expect(not lost and not kept, f"{EX}: after a failed step, discard_unwritten uncaches the blocks past the "
            f"cached prefix ({table[2:]}, from num_cached_tokens // block_size = 2 on) and keeps the prefix's "
            f"blocks {table[:2]}, whose K/V was written earlier; still cached past the prefix: {kept}, "
            f"uncached in the prefix: {lost}")


def check_least_recently_freed_goes_first(cls: type) -> None:
    """Six blocks of 2; the prompts A, B, C (one full block and one token each) run and finish in that
    order; then D, then E (two new full blocks each, nothing cached): D's blocks come from A (freed
    longest ago), so A's block leaves the cache and B's and C's stay; E's come from B."""
    prompts = {"A": [1, 2, 9], "B": [3, 4, 9], "C": [5, 6, 9], "D": [7, 8, 7, 8], "E": [11, 12, 11, 12]}
    with _hashing("exact"):
        bm = cls(6, 2)
        for name in "ABC":
            seq = Sequence(prompts[name], block_size=2)
            bm.allocate(seq)
            bm.deallocate(seq)
        found = {}
        for name in "DE":
            seq = Sequence(prompts[name], block_size=2)
            with your_code(EX, f"allocate of {prompts[name]} after A, B, C finished"):
                bm.allocate(seq)
            found[name] = {k: bool(_lookup(bm, prompts[k])) for k in "ABC"}
    want = {"D": {"A": False, "B": True, "C": True}, "E": {"A": False, "B": False, "C": True}}
    _expect(found == want, f"{EX}: 6 blocks of 2; the prompts A {prompts['A']}, B {prompts['B']}, C {prompts['C']} "
            f"ran and finished in that order, then D {prompts['D']} and E {prompts['E']} took two blocks each. Which of "
            f"A, B, C could still be found after D, after E: expected {want}, got {found}. Blocks are taken for new "
            "content least recently freed first: A's block goes first, then B's")


# --- the parts ------------------------------------------------------------------------------------
def _part(part: str):
    return pytest.mark.group(PART_GROUP[part])


@pytest.mark.ch06
@pytest.mark.ch06_ex1
@pytest.mark.parametrize("part, kind", [
    pytest.param("hash", "student", marks=_part("hash"), id="hash"),
    pytest.param("alloc", "exact", marks=_part("alloc"), id="alloc"),
    pytest.param("alloc", "weak", marks=_part("alloc"), id="alloc-weak-hash"),
    pytest.param("keeps", "exact", marks=_part("keeps"), id="keeps"),
    pytest.param("keeps", "weak", marks=_part("keeps"), id="keeps-weak-hash")])
def test_ch06_ex1_cache_contract_under_random_operations(part, kind):
    check_random_operations(_graded(part), part, kind)


@pytest.mark.ch06
@pytest.mark.ch06_ex1
@pytest.mark.parametrize("part, kind", [pytest.param("hash", "student", marks=_part("hash"), id="hash"),
                                        pytest.param("alloc", "exact", marks=_part("alloc"), id="alloc")])
def test_ch06_ex1_hits_follow_the_rule(part, kind):
    check_hits_follow_the_rule(_graded(part), kind)


@pytest.mark.ch06
@pytest.mark.ch06_ex1
@pytest.mark.group(HASHES)
def test_ch06_ex1_hash_is_a_stable_64_bit_name():
    check_hash_range()


@pytest.mark.ch06
@pytest.mark.ch06_ex1
@pytest.mark.group(HASHES)
def test_ch06_ex1_different_prefixes_get_different_names():
    check_distinct_prefixes()


@pytest.mark.ch06
@pytest.mark.ch06_ex1
@pytest.mark.group(ALLOCS)
def test_ch06_ex1_a_collision_costs_a_hit_not_an_output():
    check_collision(_graded("alloc"))


@pytest.mark.ch06
@pytest.mark.ch06_ex1
@pytest.mark.group(ALLOCS)
def test_ch06_ex1_decode_steps_cache_the_blocks_they_fill():
    check_decode_fills_are_cached(_graded("alloc"))


@pytest.mark.ch06
@pytest.mark.ch06_ex1
@pytest.mark.group(KEEPS)
def test_ch06_ex1_uncache_removes_exactly_the_block_and_those_below():
    check_uncache_forest(_graded("keeps"))


@pytest.mark.ch06
@pytest.mark.ch06_ex1
@pytest.mark.group(KEEPS)
def test_ch06_ex1_a_chain_thousands_of_blocks_deep():
    check_deep_chain(_graded("keeps"))


@pytest.mark.ch06
@pytest.mark.ch06_ex1
@pytest.mark.group(KEEPS)
def test_ch06_ex1_freed_blocks_are_found_again():
    check_freed_blocks_found_again(_graded("keeps"))


@pytest.mark.ch06
@pytest.mark.ch06_ex1
@pytest.mark.group(KEEPS)
def test_ch06_ex1_the_least_recently_freed_goes_first():
    check_least_recently_freed_goes_first(_graded("keeps"))


@pytest.mark.ch06
@pytest.mark.ch06_ex1
@pytest.mark.group(KEEPS)
def test_ch06_ex1_a_failed_step_keeps_the_cached_prefix():
    check_discard_keeps_the_cached_prefix(_graded("keeps"))


# --- the engine on the whole build, against transformers -------------------------------------------
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


def check_engine(cls: type, case) -> None:
    """Three rounds of the prompts on a cache of 24 blocks of 4 (cached blocks are evicted and
    sequences preempted): greedy tokens equal transformers', later rounds find cached blocks, every
    block is free at the end."""
    folder, prompts, ref = case
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with your_code(EX, "building the engine"):
        engine = LLMEngine(model=folder, dtype="float64", max_model_len=64, block_size=4, num_kvcache_blocks=24,
                           block_manager_cls=cls, attention_backend=PagedAttention)
    rounds = [prompts[:3], prompts, prompts[::-1]]
    try:  # run_engine checks the engine's invariants after every step
        outs = [run_engine(engine, batch, params) for batch in rounds]
    except NotImplementedError:
        raise
    except AssertionError as e:
        raise AssertionError(f"{EX}: with your code the engine broke an invariant of its KV cache (reference "
                             f"counts, free and used blocks, the hash table; the traceback shows which): {e}") from e
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{EX}: the engine with your code raised {type(e).__name__}: {e} (the traceback "
                             "shows where)") from e
    for batch, batch_outs in zip(rounds, outs):
        for p, o in zip(batch, batch_outs):
            got, want = o.outputs[0].token_ids, ref[tuple(p)]
            _expect(got == want, f"{EX}: prompt {p} ({len(p)} tokens, {o.num_cached_tokens} from the cache): the "
                    f"engine generated {got}, transformers {want}")
    _expect(sum(o.num_cached_tokens for o in outs[1]) > 0, f"{EX}: the second round found nothing in the cache "
            f"(num_cached_tokens {[o.num_cached_tokens for o in outs[1]]}), though its prompts share a preamble")
    bm = engine.block_manager
    _expect(bm.num_free_blocks == bm.num_blocks, f"{EX}: {bm.num_blocks - bm.num_free_blocks} blocks still held "
            "after every request finished")


@pytest.mark.ch06
@pytest.mark.ch06_ex1
@pytest.mark.group(ENGINE)
def test_ch06_ex1_engine_equals_transformers(ch06_engine_case):
    """The engine on the package's (the student's) whole build, its own hash included."""
    check_engine(_graded("whole"), ch06_engine_case)


# --- plausible wrong answers lose their part's points (not graded: they check the graders) ---------
def _unchained_hash(token_ids, parent_hash: int = NO_HASH) -> int:
    """xxHash64 of the block's own tokens: the parent's hash forgotten."""
    return xxhash.xxh64(b"".join(int(t).to_bytes(4, "little") for t in token_ids)).intdigest()


def _builtin_hash(token_ids, parent_hash: int = NO_HASH) -> int:
    """Python's `hash` of the parent's hash and the tokens: chained, but negative half the time."""
    return hash((parent_hash, tuple(token_ids)))


def _allocate_without_touch(self, seq) -> None:
    """The book's walk, but a hit only goes into the table: no reference taken, left in the free queue."""
    seq.num_cached_tokens = 0
    h, parent, hit = NO_HASH, NO_PARENT, True
    for i in range(seq.num_blocks):
        tokens = seq.block(i)
        full = len(tokens) == self.block_size
        h = pc.compute_hash(tokens, h) if full else NO_HASH
        block_id = self.hash_to_block_id.get(h, -1)
        hit = hit and i < (seq.num_tokens - 1) // self.block_size and self._is_hit(block_id, tokens, parent)
        if hit:
            seq.num_cached_tokens += self.block_size
        else:
            block_id = self._allocate_block().block_id
            if full:
                self._cache(block_id, h, tokens, parent)
        seq.block_table.append(block_id)
        parent = block_id


def _allocate_last_block_hits(self, seq) -> None:
    """The book's walk, but every full block may hit, the one holding the last token included."""
    seq.num_cached_tokens = 0
    h, parent, hit = NO_HASH, NO_PARENT, True
    for i in range(seq.num_blocks):
        tokens = seq.block(i)
        full = len(tokens) == self.block_size
        h = pc.compute_hash(tokens, h) if full else NO_HASH
        block_id = self.hash_to_block_id.get(h, -1)
        hit = hit and full and self._is_hit(block_id, tokens, parent)
        if hit:
            self.touch([block_id])
            seq.num_cached_tokens += self.block_size
        else:
            block_id = self._allocate_block().block_id
            if full:
                self._cache(block_id, h, tokens, parent)
        seq.block_table.append(block_id)
        parent = block_id
    seq.num_cached_tokens = min(seq.num_cached_tokens, seq.num_tokens - 1)


def _hit_on_tokens_only(self, block_id, token_ids, parent) -> bool:
    """nano-vllm's check: the block's own tokens, not its parent."""
    return block_id != -1 and self.blocks[block_id].token_ids == list(token_ids)


def _free_forgets(self, block) -> None:
    """A free that drops the block from the cache (sharing only between running sequences)."""
    BlockPool._free_block(self, block)
    self._uncache(block.block_id)


def _evicts_the_newest(self):
    """Takes the most recently freed block (the back of the queue) for new content."""
    queue = self.free_block_ids
    freed = list(queue.freed)
    if freed:
        queue.remove(freed[-1])
        block = self.blocks[freed[-1]]
    else:
        block = self.blocks[queue.popleft()]
    block.reset()
    self.used_block_ids.add(block.block_id)
    self._uncache(block.block_id)
    return block


def _discards_the_whole_table(self, seqs) -> None:
    """Uncaches every block of a failed step's sequences, the cached prefix's too (only hits are lost)."""
    for seq in seqs:
        for block_id in seq.block_table:
            self._uncache(block_id)


def _uncaches_only_itself(self, block_id) -> None:
    """Removes the block from the cache but leaves the blocks below it cached (orphans)."""
    block = self.blocks[block_id]
    if block.hash == NO_HASH:
        return
    del self.hash_to_block_id[block.hash]
    if block.parent != NO_PARENT:
        self.blocks[block.parent].children.discard(block_id)
    block.forget()


CHECKS = {  # part -> its checks, each on (graded class); a hash part checks the hash in `pc.compute_hash`
    "hash": [lambda cls: check_random_operations(cls, "hash", "student"),
             lambda cls: check_hits_follow_the_rule(cls, "student"),
             lambda cls: check_hash_range(), lambda cls: check_distinct_prefixes()],
    "alloc": [lambda cls: check_random_operations(cls, "alloc", "exact"),
              lambda cls: check_random_operations(cls, "alloc", "weak"),
              lambda cls: check_hits_follow_the_rule(cls, "exact"), check_collision, check_decode_fills_are_cached],
    "keeps": [lambda cls: check_random_operations(cls, "keeps", "exact"),
              lambda cls: check_random_operations(cls, "keeps", "weak"), check_uncache_forest, check_deep_chain,
              check_freed_blocks_found_again, check_least_recently_freed_goes_first, check_discard_keeps_the_cached_prefix],
}
WRONG = {  # name -> (part, the wrong piece: a hash function, or (method name, function))
    "unchained hash": ("hash", _unchained_hash),
    "built-in hash": ("hash", _builtin_hash),
    "no reference on a hit": ("alloc", ("allocate", _allocate_without_touch)),
    "the last token's block hits": ("alloc", ("allocate", _allocate_last_block_hits)),
    "hit on tokens only": ("alloc", ("_is_hit", _hit_on_tokens_only)),
    "free forgets the block": ("keeps", ("_free_block", _free_forgets)),
    "evicts the most recently freed": ("keeps", ("_allocate_block", _evicts_the_newest)),
    "uncaches only the block itself": ("keeps", ("_uncache", _uncaches_only_itself)),
    "discard uncaches the cached prefix": ("keeps", ("discard_unwritten", _discards_the_whole_table)),
}


def _failures(checks, cls, first_only: bool = False) -> list[str]:
    failed = []
    for check in checks:
        try:
            check(cls)
        except AssertionError as e:
            failed.append(str(e))
            if first_only:
                break
    return failed


SILENT = {"unchained hash", "built-in hash", "free forgets the block", "evicts the most recently freed",
          "discard uncaches the cached prefix"}


@pytest.mark.parametrize("wrong", list(WRONG))
def test_ch06_ex1_wrong_answers_lose_their_part(wrong, ch06_engine_case):
    """Each wrong answer fails the checks of the part it gets wrong, so it loses that part's points
    (the other parts run the grader's code in place of the wrong piece). Those that change no output
    (`SILENT`: a weaker hash, a free that forgets, eviction of the newest) also pass the engine's part
    on the whole build: they lose exactly their part."""
    part, piece = WRONG[wrong]
    engine = [lambda cls: check_engine(cls, ch06_engine_case)] if wrong in SILENT else []
    if callable(piece):  # the hash: the grader's methods with the wrong hash; the whole build with it
        with mock.patch.object(pc, "compute_hash", piece):
            failed = _failures(CHECKS[part], _graded("hash"), first_only=True)
            engine_failed = _failures(engine, PrefixCachingBlockManager)
    else:
        name, fn = piece
        failed = _failures(CHECKS[part], type(f"Wrong_{name}", (_graded(part),), {name: fn}), first_only=True)
        engine_failed = _failures(engine, type(f"WrongWhole_{name}", (PrefixCachingBlockManager,), {name: fn}))
    assert failed, f"{wrong}: a wrong answer passed every check of its part ({PART_GROUP[part]})"
    assert all(EX in f for f in failed), failed
    assert not engine_failed, f"{wrong}: changes no output, yet failed the engine's part: {engine_failed}"


@pytest.mark.parametrize("part", list(CHECKS))
def test_ch06_ex1_graders_pass_the_graders_own_pieces(part):
    """The checks of each part pass with the grader's stand-ins in place (and the grader's hash)."""
    cls = type(f"Grader_{part}", (PrefixCachingBlockManager,), {n: fn for _, n, fn in STAND_INS[EX][1:]})
    with mock.patch.object(pc, "compute_hash", _grader_hash):
        assert not _failures(CHECKS[part], cls)


def test_ch06_ex1_stand_ins_cover_every_region():
    """Every method of the build has a stand-in, on the class that defines it, and each stand-in is a
    plain function (no zero-argument `super()`: it is set on the chapter's classes by tests/stand_ins.py)."""
    for owner, name, fn in STAND_INS[EX][1:]:
        assert name in vars(owner), (owner, name)
        assert "super()" not in inspect.getsource(fn), name
