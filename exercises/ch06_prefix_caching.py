# GENERATED from solutions/ch06_prefix_caching.py by scripts/make_exercises.py: your work goes here.
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
"""
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
        raise NotImplementedError('ch06_prefix_caching.cached_prefix: walk the full blocks, chaining hashes and parents, until the first miss')

    def allocate(self, seq: Sequence) -> None:
        """Share the blocks `cached_prefix` finds (`self.touch` adds a reference to a cached block),
        take fresh blocks for the rest (`self._allocate_block()`), make the fresh full ones findable
        (`self._cache(block_id, hash, token_ids, parent)`), and set `seq.num_cached_tokens`: a fully
        cached prompt still computes its last token (its logits choose the next token), so at most
        `num_tokens - 1`."""
        assert not seq.block_table, "allocate() on a sequence that already holds blocks"
        # TODO: share the hits, take and cache fresh blocks for the rest, count the cached tokens
        raise NotImplementedError('ch06_prefix_caching.allocate: share the hits, take and cache fresh blocks for the rest, count the cached tokens')
