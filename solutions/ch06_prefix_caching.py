"""Chapter 06 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 1 (ch06_ex1) — rebuild `PrefixCachingBlockManager.allocate`: walk the prompt's blocks,
reuse cached full blocks while the chained hash (and the tokens) match, never for the block holding
the last token, and allocate fresh blocks after the first miss (registering the full ones). Graded by
a property-based differential test against minivllm's manager (same block tables, same
`num_cached_tokens`) and by running the engine with your class:
`pytest -m ch06_ex1 --impl=exercises`.
"""
from minivllm.prefix_caching import NO_HASH, PrefixCachingBlockManager, compute_hash
from minivllm.sequence import Sequence


class MyPrefixCachingBlockManager(PrefixCachingBlockManager):
    """Helpers you may use: `compute_hash(token_ids, parent_hash)`, `self.hash_to_block_id`,
    `self._take_cached_block(block_id)` (adds a reference, leaves the free queue if needed),
    `self._allocate_block()` and `self._register(block, hash, token_ids)`."""

    def allocate(self, seq: Sequence) -> None:
        """Fill `seq.block_table` (empty on entry) and set `seq.num_cached_tokens`."""
        # TODO: chain hashes over full blocks; hit while hash and tokens match and the block is not the last
        ### BEGIN SOLUTION
        assert not seq.block_table
        seq.num_cached_tokens = 0
        h, hit = NO_HASH, True
        for i in range(seq.num_blocks):
            tokens = seq.block(i)
            full = len(tokens) == self.block_size
            h = compute_hash(tokens, h) if full else NO_HASH
            block_id = self.hash_to_block_id.get(h, -1)
            hit = (hit and full and block_id != -1 and self.blocks[block_id].token_ids == tokens
                   and (i + 1) * self.block_size < seq.num_tokens)
            if hit:
                block = self._take_cached_block(block_id)
                seq.num_cached_tokens += self.block_size
            else:
                block = self._allocate_block()
                if full:
                    self._register(block, h, tokens)
            seq.block_table.append(block.block_id)
        ### END SOLUTION
