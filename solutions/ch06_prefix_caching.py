"""Chapter 06 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 2 (ch06_ex2) — token-granular prefix caching: write `MyPrefixCachingBlockManager.cached_prefix`,
the lookup behind the chapter's third rule for the last token, and `allocate`, which shares what it
finds. Every full block of the prompt may be found in the cache (keep the check of tokens *and*
parent), and a prompt that is entirely cached recomputes only its last token: `num_cached_tokens =
num_tokens - 1` (vLLM does this when a whole prompt's K/V came from a remote connector). Graded by
its contract, not by the chapter's code: the cache invariants under random operation sequences,
`num_cached_tokens` exactly as large as the rule allows for requests that follow each other on a
cache that keeps everything, and the engine's greedy outputs against transformers on prompts sent
more than once: `pytest -m ch06_ex2 --impl=exercises`.

Exercise 3 (ch06_ex3) — cache isolation with a salt (vLLM's `cache_salt`). A shared prefix cache leaks:
a request that hits runs measurably faster, so one tenant can test whether another sent a given prompt
(a timing side channel). vLLM lets a request carry a `cache_salt`, mixed into the name of its first
block and, through the chain, of every block after it: requests share cached blocks only when their
salts are equal. Write `SaltedPrefixCachingBlockManager`'s `salted_parent_hash`, `allocate` and
`may_append`. Graded by its contract, not by the chapter's code: hits and misses on fixed sequences of salted and unsalted requests
(prompts and blocks filled in decode steps), the names of unsalted blocks equal to the chapter's, a
hash collision between salts forced by hand (it must cost a miss), and `num_cached_tokens` under
random requests and salts (hypothesis): `python -m minivllm.course.grade ch06_ex3`.
"""
import xxhash

from minivllm.core.block_manager import BlockManager
from minivllm.core.prefix_caching import NO_HASH, NO_PARENT, PrefixCachingBlockManager, compute_hash
from minivllm.sequence import Sequence


class MyPrefixCachingBlockManager(PrefixCachingBlockManager):
    """Token-granular prefix caching. You write the lookup, `cached_prefix`, and `allocate`, which
    uses it. Helpers: `compute_hash(token_ids, parent_hash)`, `self.hash_to_block_id`, `seq.block(i)` and
    `self._is_hit(block_id, token_ids, parent)` (the cached block `block_id`, -1 for none, holds
    these tokens right after block `parent`)."""

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The block ids of the longest run of `seq`'s leading full blocks that the cache holds.

        Block `i` (a full block of `block_size` tokens) is found when `self.hash_to_block_id` maps its
        chained hash (block 0: `compute_hash(tokens)`; block i: `compute_hash(tokens, hash of block
        i - 1)`) to a block that `self._is_hit` accepts with `parent` = the block found for block
        `i - 1` (`NO_PARENT` for block 0). The run stops at the first block not found or not full.
        Every full block may be found, the one holding the prompt's last token included.
        """
        # TODO: walk the full blocks, chaining hashes and parents, until the first miss
        ### BEGIN SOLUTION
        found, chained, previous = [], NO_HASH, NO_PARENT
        for index in range(seq.num_blocks):
            block_tokens = seq.block(index)
            if len(block_tokens) < self.block_size:
                break
            chained = compute_hash(block_tokens, chained)
            candidate = self.hash_to_block_id.get(chained, -1)
            if not self._is_hit(candidate, block_tokens, previous):
                break
            found.append(candidate)
            previous = candidate
        return found
        ### END SOLUTION

    def allocate(self, seq: Sequence) -> None:
        """Share the blocks `cached_prefix` finds (`self.touch` adds a reference to a cached block),
        take fresh blocks for the rest (`self._allocate_block()`), make the fresh full ones findable
        (`self._cache(block_id, hash, token_ids, parent)`), and set `seq.num_cached_tokens`: a fully
        cached prompt still computes its last token (its logits choose the next token), so at most
        `num_tokens - 1`."""
        assert not seq.block_table, "allocate() on a sequence that already holds blocks"
        # TODO: share the hits, take and cache fresh blocks for the rest, count the cached tokens
        ### BEGIN SOLUTION
        hits = self.cached_prefix(seq)
        h, parent = NO_HASH, NO_PARENT
        for i in range(seq.num_blocks):
            tokens = seq.block(i)
            full = len(tokens) == self.block_size
            h = compute_hash(tokens, h) if full else NO_HASH
            if i < len(hits):
                block_id = hits[i]
                self.touch([block_id])
            else:
                block_id = self._allocate_block().block_id
                if full:
                    self._cache(block_id, h, tokens, parent)
            seq.block_table.append(block_id)
            parent = block_id
        seq.num_cached_tokens = min(len(hits) * self.block_size, seq.num_tokens - 1)
        ### END SOLUTION


def cache_salt_of(seq: Sequence) -> str | None:
    """The salt a sequence's request carries: its `cache_salt` attribute, None when it has none (the
    request is not salted). Given, not graded.

    Raises:
        ValueError: a salt that is neither None nor a non-empty str (vLLM's API refuses an empty salt).
    """
    salt = getattr(seq, "cache_salt", None)
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be None or a non-empty str, got {salt!r}")
    return salt


class SaltedPrefixCachingBlockManager(PrefixCachingBlockManager):
    """Prefix caching with cache isolation: a request's `cache_salt` (`cache_salt_of(seq)`) takes part in
    the name of its first block, hence (the names are chained) of every block after it, and a request
    finds only blocks cached under its own salt (vLLM's `cache_salt`: an extra key of the first block's hash
    only, `generate_block_hash_extra_keys` in `vllm/v1/core/kv_cache_utils.py`; its prefix-caching design
    notes: "to isolate caches in multi-tenant environments"). You write `salted_parent_hash`, `allocate`
    and `may_append`; keep the chapter's rules otherwise (whole blocks, never the block of the prompt's
    last token, first come first kept)."""

    def salted_parent_hash(self, cache_salt: str | None) -> int:
        """The hash a sequence's first block chains from, as if it were the hash of a block before it:
        `NO_HASH` without a salt (the chapter's names), else an int in `[0, 2**64)` that depends only on
        the salt (the same in every manager). Hint: `xxhash.xxh64(some_bytes).intdigest()`, on bytes that
        say what they are (e.g. a prefix such as `b"cache_salt:"` before the salt's UTF-8)."""
        # TODO: NO_HASH for None, else a 64-bit hash of the salt
        ### BEGIN SOLUTION
        if cache_salt is None:
            return NO_HASH
        return xxhash.xxh64(b"cache_salt:" + cache_salt.encode("utf-8")).intdigest()
        ### END SOLUTION

    def allocate(self, seq: Sequence) -> None:
        """As the chapter's `allocate`, with the salt.

        * A request without a salt is cached exactly as in the chapter: its blocks are named by
          `compute_hash` chained from `NO_HASH`, so unsalted requests share with one another as before.
        * A salted request's first block is named `compute_hash(tokens, self.salted_parent_hash(salt))`, and
          the blocks after it chain from it: no block of a salted request has the name of the same block
          unsalted or under another salt.
        * A hit needs the same salt, checked, not only a matching name: with a hash collision between
          two salts' first blocks, the name would point at the other tenant's block. Remember each cached
          first block's salt (e.g. an attribute of the block, set whenever you cache one) and compare it,
          as `_is_hit` compares tokens and parent.
        * `num_cached_tokens` as in the chapter: the shared whole blocks, never the block holding the
          prompt's last token. A fresh full block is entered with `self._cache` (its id, name, tokens, parent).
        Raises: ValueError for an invalid salt (`cache_salt_of`).
        """
        assert not seq.block_table, "allocate() on a sequence that already holds blocks"
        # TODO: the chapter's allocate, chained from a salted start, a hit also checking the first block's salt
        ### BEGIN SOLUTION
        salt = cache_salt_of(seq)
        seq.num_cached_tokens = 0
        hittable = (seq.num_tokens - 1) // self.block_size
        h, parent, hit = self.salted_parent_hash(salt), NO_PARENT, True
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            full = len(token_ids) == self.block_size
            h = compute_hash(token_ids, h) if full else NO_HASH
            block_id = self.hash_to_block_id.get(h, -1)
            hit = (hit and i < hittable and self._is_hit(block_id, token_ids, parent)
                   and (i > 0 or getattr(self.blocks[block_id], "cache_salt", None) == salt))
            if hit:
                self.touch([block_id])
                seq.num_cached_tokens += self.block_size
            else:
                block = self._allocate_block()
                block_id, block.cache_salt = block.block_id, salt
                if full:
                    self._cache(block_id, h, token_ids, parent)
            seq.block_table.append(block_id)
            parent = block_id
        ### END SOLUTION

    def may_append(self, seq: Sequence) -> None:
        """As the chapter's `may_append`, with the salt: when a decode step's token fills a salted
        request's first block (a prompt shorter than a block), that block is cached under its salted name
        and with its salt, never under the unsalted one."""
        # TODO: make room as chapter 05 does; cache a block the newest token fills, the first one under its salted name
        ### BEGIN SOLUTION
        salt = cache_salt_of(seq)
        if salt is None or seq.num_tokens != self.block_size:  # later blocks chain from a salted parent already
            super().may_append(seq)
            return
        BlockManager.may_append(self, seq)  # chapter 05's room for the token (the chapter's names block 0 unsalted)
        block_id = seq.block_table[0]
        self._cache(block_id, compute_hash(seq.block(0), self.salted_parent_hash(salt)), seq.block(0), NO_PARENT)
        self.blocks[block_id].cache_salt = salt
        ### END SOLUTION
