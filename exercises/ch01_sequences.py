# GENERATED from solutions/ch01_sequences.py by scripts/make_exercises.py: your work goes here.
"""Chapter 01 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 1 (ch01_ex1) — rebuild the block helpers of `Sequence`:
`num_blocks`, `last_block_num_tokens` and `block(i)`. Chapter 05's block manager relies on them.
Graded against minivllm's own `Sequence`: `pytest -m ch01_ex1 --impl=exercises`.
"""
from minivllm.sequence import Sequence


class BlockSequence(Sequence):
    """A `Sequence` whose block helpers you write yourself."""

    @property
    def num_blocks(self) -> int:
        """Blocks needed to hold all `num_tokens` tokens (the last block may be partial)."""
        # TODO: ceil(num_tokens / block_size), with integer arithmetic only
        raise NotImplementedError()

    @property
    def last_block_num_tokens(self) -> int:
        """Tokens in the last block: between 1 and block_size."""
        # TODO: use num_tokens, num_blocks and block_size
        raise NotImplementedError()

    def block(self, i: int) -> list[int]:
        """Token ids of logical block i. Raises IndexError when i is not in range(num_blocks)."""
        # TODO: slice token_ids; raise IndexError for a bad i (negative too)
        raise NotImplementedError()
