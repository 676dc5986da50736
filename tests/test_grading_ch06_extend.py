"""Grading tests for chapter 06's cache-salt exercise (`python -m minivllm.course.grade ch06_ex3`, or
`pytest -m ch06_ex3 --impl=exercises`); ch06_ex2 is graded in test_grading_ch04_06.py.

ch06_ex3, `SaltedPrefixCachingBlockManager` (vLLM's `cache_salt`), is graded by its contract, written here:
* fixed requests one after another, all kept running: a request shares blocks (the same block ids) exactly
  with earlier requests of the same salt, as many whole blocks as the chapter's rule allows; unsalted
  blocks carry the chapter's names (`compute_hash` chained from `NO_HASH`), salted ones
  `compute_hash(tokens, salted_parent_hash(salt))` and the chain after it;
* blocks filled by decode steps (`may_append`): a first block filled so is found by its own salt only;
* a hash collision between two salts' first blocks, made by hand (one salt's block entered under the
  other salt's name): the request must miss, never share the other salt's block;
* random prompts and salts (hypothesis), each sent twice on a cache that evicts nothing: `num_cached_tokens`
  is the rule's for the requests of the same salt only, every shared block was written by that salt, and
  the cache's invariants hold (`check_cache`).
The tests at the end show that plausible wrong answers fail, and the grader's own answer passes.
"""
from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters import failed_checks, load
from minivllm.core.block_manager import BlockManager
from minivllm.core.prefix_caching import NO_HASH, NO_PARENT, PrefixCachingBlockManager, compute_hash
from minivllm.sequence import Sequence
from test_grading_ch04_regions import your_code
from test_prefix_caching import check_cache  # the prefix cache's invariants

HYPOTHESIS = dict(deadline=None, derandomize=True, database=None, report_multiple_bugs=False,
                  suppress_health_check=[HealthCheck.too_slow])
EX = "ch06_ex3"


@pytest.fixture(scope="module")
def ch06(impl_name):
    return load("ch06_prefix_caching", impl_name)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _seq(tokens, salt, block_size: int) -> Sequence:
    seq = Sequence(list(tokens), block_size=block_size)
    if salt is not None:
        seq.cache_salt = salt
    return seq


def _allocate(bm, seq: Sequence, what: str) -> None:
    with your_code(EX, f"allocate of {what}"):
        bm.allocate(seq)


def _append(bm, seq: Sequence, token: int, what: str) -> None:
    seq.append_token(token)
    with your_code(EX, f"may_append after token {token} of {what}"):
        bm.may_append(seq)


def _cache_ok(bm, live, after: str) -> None:
    try:
        check_cache(bm, live)
    except AssertionError as e:
        raise AssertionError(f"{EX}: after {after}: the cache's invariants (hash table, parents, tokens) broke: "
                             f"{e!r}") from e


# --- fixed requests: hits within a salt, misses across salts, the names --------------------------------
P = list(range(1, 11))  # 10 tokens: two full blocks of 4 and two tokens
KNOWN = [  # (name, tokens, salt, the cached tokens, the earlier request whose first blocks it shares)
    ("alice 1", P, "alice", 0, None),
    ("alice 2", P, "alice", 8, "alice 1"),  # the same salt: both full blocks
    ("bob 1", P, "bob", 0, None),  # another salt: nothing, although alice's blocks are cached
    ("plain 1", P, None, 0, None),  # no salt: nothing of the salted requests
    ("plain 2", P, None, 8, "plain 1"),  # unsalted requests share as in the chapter
    ("bob 2", P, "bob", 8, "bob 1"),
    ("alice 3", P[:8] + [50, 51], "alice", 8, "alice 1"),
    ("alice 4", P[:4] + [60, 61, 62, 63, 64], "alice", 4, "alice 1"),
    ("alice! 1", P, "alice!", 0, None),  # a salt that only looks alike is another salt
    ("plain 3", P[:8], None, 4, "plain 1"),  # whole blocks: the last token's block is computed
]


def _check_known(mod) -> None:
    bm = mod.SaltedPrefixCachingBlockManager(num_blocks=64, block_size=4)
    live, sent = {}, []
    for name, tokens, salt, want, shares in KNOWN:
        seq = _seq(tokens, salt, 4)
        what = f"the request {name!r} (tokens {tokens}, cache_salt {salt!r}, blocks of 4) after {sent}"
        _allocate(bm, seq, what)
        _expect(seq.num_cached_tokens == want, f"{EX}: {what}: num_cached_tokens should be {want} (requests share "
                f"whole blocks only with earlier requests of the same salt), got {seq.num_cached_tokens}")
        k = want // 4
        if shares is not None:
            _expect(seq.block_table[:k] == live[shares].block_table[:k], f"{EX}: {what}: its first {k} blocks should "
                    f"be those of {shares!r}, {live[shares].block_table[:k]}; got {seq.block_table[:k]}")
        others = {b: n for n, s in live.items() for b in s.block_table}
        stolen = {b: others[b] for b in seq.block_table if b in others and getattr(live[others[b]], "cache_salt",
                                                                                     None) != salt}
        _expect(not stolen, f"{EX}: {what}: it shares blocks {stolen} with requests of another salt")
        live[name] = seq
        sent.append(name)
        _cache_ok(bm, list(live.values()), what)
    for salt in (None, "alice", "bob"):
        first = bm.salted_parent_hash(salt)
        _expect(first == mod.SaltedPrefixCachingBlockManager(num_blocks=1, block_size=4).salted_parent_hash(salt),
                f"{EX}: salted_parent_hash({salt!r}) differs between two managers: it must depend on the salt only")
    _expect(bm.salted_parent_hash(None) == NO_HASH, f"{EX}: salted_parent_hash(None) should be NO_HASH (an unsalted "
            f"request keeps the chapter's names), got {bm.salted_parent_hash(None)!r}")
    for salt in ("alice", "bob"):
        start = bm.salted_parent_hash(salt)
        _expect(isinstance(start, int) and 0 <= start < 2**64 and start != NO_HASH,
                f"{EX}: salted_parent_hash({salt!r}) should be an int in [0, 2**64), got {start!r}")
    _expect(bm.salted_parent_hash("alice") != bm.salted_parent_hash("bob"),
            f"{EX}: salted_parent_hash gives 'alice' and 'bob' the same hash")
    for name, salt in (("plain 1", None), ("alice 1", "alice"), ("bob 1", "bob")):
        h0 = compute_hash(P[:4], bm.salted_parent_hash(salt))
        want = [h0, compute_hash(P[4:8], h0)]
        got = [bm.blocks[b].hash for b in live[name].block_table[:2]]
        _expect(got == want, f"{EX}: the full blocks of {name!r} (cache_salt {salt!r}) should be cached under "
                f"compute_hash(tokens, salted_parent_hash(salt)) and the chain after it, {want}; they are under {got}")


@pytest.mark.ch06
@pytest.mark.ch06_ex3
def test_ch06_ex3_written_in_the_exercise_file(ch06):
    """The three methods are the student's own, written in the exercise's file (an inherited `allocate` is the
    chapter's, which knows no salt)."""
    where = Path(ch06.__file__).resolve()
    for name in ("salted_parent_hash", "allocate", "may_append"):
        fn = inspect.getattr_static(ch06.SaltedPrefixCachingBlockManager, name, None)
        code = getattr(fn, "__code__", None)
        _expect(code is not None and Path(code.co_filename).resolve() == where,
                f"{EX}: SaltedPrefixCachingBlockManager.{name} is not written in {where.parent.name}/{where.name}")


@pytest.mark.ch06
@pytest.mark.ch06_ex3
def test_ch06_ex3_salts_share_only_within_a_salt(ch06):
    _check_known(ch06)


# --- blocks filled by decode steps -------------------------------------------------------------------
def _check_decode(mod) -> None:
    bm = mod.SaltedPrefixCachingBlockManager(num_blocks=64, block_size=4)
    live = []

    def request(tokens, salt, want, shares=None, name=""):
        seq = _seq(tokens, salt, 4)
        what = f"the request {name or tokens} (tokens {tokens}, cache_salt {salt!r}, blocks of 4)"
        _allocate(bm, seq, what)
        _expect(seq.num_cached_tokens == want, f"{EX}: {what}, after blocks filled by decode steps: num_cached_tokens "
                f"should be {want}, got {seq.num_cached_tokens}")
        k = want // 4
        if shares is not None:
            _expect(seq.block_table[:k] == shares.block_table[:k], f"{EX}: {what}: its first {k} blocks should be "
                    f"{shares.block_table[:k]}, got {seq.block_table[:k]}")
        live.append(seq)
        _cache_ok(bm, live, what)
        return seq

    a = request([1, 2, 3], "alice", 0, name="a")
    _append(bm, a, 4, "a (alice), whose first block it fills")
    _cache_ok(bm, live, "a's first block filled")
    request([1, 2, 3, 4, 5], "alice", 4, a, "alice after a's decode")
    bob = request([1, 2, 3, 4, 5], "bob", 0, name="bob")
    request([1, 2, 3, 4, 5], None, 0, name="an unsalted request after a's decode")
    for t in (5, 6, 7, 8):
        _append(bm, a, t, "a (alice)")
    request(list(range(1, 10)), "alice", 8, a, "alice after a's second block filled")
    request(list(range(1, 10)), "bob", 4, bob, "bob again")
    e = request([7, 8, 9], None, 0, name="e (unsalted)")
    _append(bm, e, 10, "e (unsalted), whose first block it fills")
    request([7, 8, 9, 10, 11], None, 4, e, "unsalted after e's decode")
    request([7, 8, 9, 10, 11], "alice", 0, name="alice after e's decode")


@pytest.mark.ch06
@pytest.mark.ch06_ex3
def test_ch06_ex3_blocks_filled_by_decode_keep_their_salt(ch06):
    _check_decode(ch06)


# --- a collision between salts ----------------------------------------------------------------------
COLLISIONS = [("alice", "bob"), ("alice", None), (None, "alice")]


def _check_collision(mod) -> None:
    for own, other in COLLISIONS:
        what = (f"a hash collision (a first block of cache_salt {own!r} entered under the name the same tokens get "
                f"with cache_salt {other!r})")
        m1 = mod.SaltedPrefixCachingBlockManager(num_blocks=16, block_size=4)
        x = _seq(P, other, 4)
        _allocate(m1, x, f"{P} with cache_salt {other!r}")
        name_other = m1.blocks[x.block_table[0]].hash
        m2 = mod.SaltedPrefixCachingBlockManager(num_blocks=16, block_size=4)
        y = _seq(P, own, 4)
        _allocate(m2, y, f"{P} with cache_salt {own!r}")
        block = y.block_table[0]
        name_own = m2.blocks[block].hash
        _expect(name_own != name_other and name_own in m2.hash_to_block_id,
                f"{EX}: the first block of {P} is cached under {name_own} with cache_salt {own!r} and under "
                f"{name_other} with {other!r}: the names should differ, and the block be in hash_to_block_id")
        m2.deallocate(y)  # free, still cached
        del m2.hash_to_block_id[name_own]  # the collision: the other salt's name finds this block
        m2.hash_to_block_id[name_other], m2.blocks[block].hash = block, name_other
        z = _seq(P, other, 4)
        _allocate(m2, z, f"{P} with cache_salt {other!r} after {what}")
        _expect(z.num_cached_tokens == 0 and block not in z.block_table,
                f"{EX}: after {what}, a request of cache_salt {other!r} found that block (num_cached_tokens "
                f"{z.num_cached_tokens}, blocks {z.block_table}, the collided block {block}): a hit must check the "
                "first block's salt, as it checks tokens and parent, so that a collision costs a miss")
        _cache_ok(m2, [z], what)


@pytest.mark.ch06
@pytest.mark.ch06_ex3
def test_ch06_ex3_a_collision_between_salts_costs_a_miss(ch06):
    _check_collision(ch06)


# --- random prompts and salts --------------------------------------------------------------------------
def _expected(prompt: list[int], written: set[tuple[int, ...]], block_size: int) -> int:
    """The chapter's rule: whole blocks whose whole prefix was written before, never the last token's block."""
    m = 0
    while (m + 1) * block_size <= len(prompt) and tuple(prompt[:(m + 1) * block_size]) in written:
        m += 1
    return min(m, (len(prompt) - 1) // block_size) * block_size


def _check_random(mod, max_examples: int = 200) -> None:
    @settings(max_examples=max_examples, **HYPOTHESIS)
    @given(requests=st.lists(st.tuples(st.lists(st.integers(1, 2), min_size=1, max_size=12),
                                       st.sampled_from([None, "a", "b"])), min_size=1, max_size=10),
           block_size=st.integers(1, 4))
    def run(requests, block_size):
        bm = mod.SaltedPrefixCachingBlockManager(num_blocks=2 * len(requests) * 12 + 1, block_size=block_size)
        written: dict = {}
        writer: dict[int, str | None] = {}  # block id -> the salt of the request that wrote it
        sent = []
        for tokens, salt in requests + requests:  # each twice: whole prompts come back
            seq = _seq(tokens, salt, block_size)
            what = f"{tokens} with cache_salt {salt!r} (block_size {block_size}) after {sent}"
            _allocate(bm, seq, what)
            want = _expected(tokens, written.setdefault(salt, set()), block_size)
            _expect(seq.num_cached_tokens == want, f"{EX}: {what}: num_cached_tokens should be {want} (whole blocks "
                    f"written before by requests of the same salt), got {seq.num_cached_tokens}")
            _expect(len(set(seq.block_table)) == len(seq.block_table) == seq.num_blocks,
                    f"{EX}: {what}: the block table should hold {seq.num_blocks} distinct blocks, got "
                    f"{seq.block_table}")
            k = seq.num_cached_tokens // block_size
            foreign = [b for b in seq.block_table[:k] if writer.get(b, salt) != salt]
            _expect(not foreign, f"{EX}: {what}: it shares blocks {foreign}, written by requests of another salt")
            writer.update({b: salt for b in seq.block_table[k:]})
            _cache_ok(bm, [seq], what)
            written[salt].update(tuple(tokens[:j]) for j in range(block_size, len(tokens) + 1, block_size))
            bm.deallocate(seq)
            sent.append((tokens, salt))
    run()


@pytest.mark.ch06
@pytest.mark.ch06_ex3
def test_ch06_ex3_random_requests_and_salts(ch06):
    _check_random(ch06)


# --- plausible wrong answers fail (not graded: they check the graders) -----------------------------
class _GraderSalted(PrefixCachingBlockManager):
    """The grader's own answer: the salt of each block taken fresh kept in a dict, checked on a first
    block's hit; the lookup walks the chain first, then takes blocks."""

    salt_none_hash = NO_HASH  # what an unsalted request chains from
    check_salt = True
    salted_decode = True

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.salt_of: dict[int, str | None] = {}

    def salted_parent_hash(self, cache_salt):
        if cache_salt is None:
            return self.salt_none_hash
        return xxhash.xxh64(b"salt\x00" + cache_salt.encode()).intdigest()

    def allocate(self, seq):
        salt = getattr(seq, "cache_salt", None)
        names, h = [], self.salted_parent_hash(salt)
        for i in range(seq.num_blocks):
            full = len(seq.block(i)) == self.block_size
            h = compute_hash(seq.block(i), h) if full else NO_HASH
            names.append(h)
        hits, parent = [], NO_PARENT
        for i in range((seq.num_tokens - 1) // self.block_size):
            b = self.hash_to_block_id.get(names[i], -1)
            salt_differs = i == 0 and self.check_salt and self.salt_of.get(b) != salt
            if not self._is_hit(b, seq.block(i), parent) or salt_differs:
                break
            hits.append(b)
            parent = b
        self.touch(hits)
        seq.block_table[:], seq.num_cached_tokens = list(hits), len(hits) * self.block_size
        for i in range(len(hits), seq.num_blocks):
            b = self._allocate_block().block_id
            self.salt_of[b] = salt
            if names[i] != NO_HASH:
                self._cache(b, names[i], seq.block(i), seq.block_table[-1] if i else NO_PARENT)
            seq.block_table.append(b)

    def may_append(self, seq):
        salt = getattr(seq, "cache_salt", None)
        if not self.salted_decode or seq.num_tokens != self.block_size:
            return super().may_append(seq)
        BlockManager.may_append(self, seq)
        self._cache(seq.block_table[0], compute_hash(seq.block(0), self.salted_parent_hash(salt)), seq.block(0),
                    NO_PARENT)
        self.salt_of[seq.block_table[0]] = salt


class _IgnoresTheSalt(PrefixCachingBlockManager):
    """The chapter's cache with a salt function nobody uses: every salt shares."""

    def salted_parent_hash(self, cache_salt):
        return NO_HASH


class _DecodeUnsalted(_GraderSalted):
    """Salted in allocate, but a first block filled by a decode step is cached under its unsalted name."""

    salted_decode = False


class _NoSaltCheck(_GraderSalted):
    """Salted names, but a hit trusts the name: a collision shares another salt's block."""

    check_salt = False


class _SaltsEveryone(_GraderSalted):
    """No salt treated as the salt "": unsalted requests still share, under names the chapter does not use."""

    salt_none_hash = xxhash.xxh64(b"salt\x00").intdigest()


CH06_EX3_CHECKS = [_check_known, _check_decode, _check_collision, lambda mod: _check_random(mod, 60)]
WRONG = [_IgnoresTheSalt, _DecodeUnsalted, _NoSaltCheck, _SaltsEveryone]


@pytest.mark.parametrize("wrong", WRONG, ids=[w.__name__ for w in WRONG])
def test_ch06_ex3_wrong_answers_fail(wrong):
    mod = SimpleNamespace(SaltedPrefixCachingBlockManager=wrong)
    failures = failed_checks(CH06_EX3_CHECKS, mod)
    assert failures, f"a wrong answer passed every check of ch06_ex3: {wrong.__doc__}"


def test_ch06_ex3_graders_own_answer_passes():
    for check in CH06_EX3_CHECKS:
        check(SimpleNamespace(SaltedPrefixCachingBlockManager=_GraderSalted))
