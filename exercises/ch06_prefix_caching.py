# GENERATED from solutions/ch06_prefix_caching.py by scripts/make_exercises.py: your work goes here.
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
        raise NotImplementedError()
