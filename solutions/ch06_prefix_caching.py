"""Chapter 06 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 1 (ch06_ex1) — token-granular prefix caching: write `MyPrefixCachingBlockManager.allocate`
with the chapter's third rule for the last token. Every full block of the prompt may be found in the
cache (keep the check of tokens *and* parent), and a prompt that is entirely cached recomputes only
its last token: `num_cached_tokens = num_tokens - 1` (vLLM does this when a whole prompt's K/V came
from a remote connector). Graded by its contract, not by the chapter's code: the cache invariants
under random operation sequences, `num_cached_tokens` exactly as large as the rule allows for
requests that follow each other on a cache that keeps everything, and the engine's greedy outputs
against transformers on prompts sent more than once: `pytest -m ch06_ex1 --impl=exercises`.
"""
from minivllm.prefix_caching import NO_HASH, NO_PARENT, PrefixCachingBlockManager, compute_hash
from minivllm.sequence import Sequence


class MyPrefixCachingBlockManager(PrefixCachingBlockManager):
    """Helpers you may use: `compute_hash(token_ids, parent_hash)`, `self.hash_to_block_id`,
    `self._is_hit(block_id, token_ids, parent)` (tokens and parent match), `self._revive`
    (one more reference to the cached block of an id), `self._allocate_block()` (a fresh block) and
    `self._cache(block_id, hash, token_ids, parent)` (make a full block findable)."""

    def allocate(self, seq: Sequence) -> None:
        """Fill `seq.block_table` (empty on entry) and set `seq.num_cached_tokens`."""
        # TODO: share every cached full block of the prompt; a fully cached prompt counts num_tokens - 1
        ### BEGIN SOLUTION
        assert not seq.block_table
        seq.num_cached_tokens = 0
        h, parent, hit = NO_HASH, NO_PARENT, True
        for i in range(seq.num_blocks):
            tokens = seq.block(i)
            full = len(tokens) == self.block_size
            h = compute_hash(tokens, h) if full else NO_HASH
            block_id = self.hash_to_block_id.get(h, -1)
            hit = hit and full and self._is_hit(block_id, tokens, parent)
            if hit:
                self._revive(block_id)
                seq.num_cached_tokens += self.block_size
            else:
                block_id = self._allocate_block().block_id
                if full:
                    self._cache(block_id, h, tokens, parent)
            seq.block_table.append(block_id)
            parent = block_id
        # all of the prompt found: its last token is computed again (into the shared last block)
        seq.num_cached_tokens = min(seq.num_cached_tokens, seq.num_tokens - 1)
        ### END SOLUTION
