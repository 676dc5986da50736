# GENERATED from solutions/ch05_paged_attention.py by scripts/make_exercises.py: your work goes here.
"""Chapter 05's extend exercises. Your answers go between the TODO lines; see the chapter notebook
(the rebuild exercise ch05_ex1, the build of the paged KV cache, is in the chapter's export cells).

Exercise 2 (ch05_ex2) — a block manager of your own, with vLLM's admission watermark: the block-manager
interface (`can_allocate`, `allocate`, `deallocate`, `can_append`, `may_append`) written from scratch
in this file (an inherited method, the package's `BlockManager`'s say, does not count: the grader
checks where each is written), in any free order you like. Graded by its contract: invariants under random operation sequences
(hypothesis), the watermark rule, and the engine's outputs with your class equal to transformers':
`python -m minivllm.course.grade ch05_ex2`.

Exercise 3 (ch05_ex3) — sliding-window decode attention over the paged cache: each sequence's query
sees only its last `window` tokens. Graded against `attention_reference` on random block tables:
`python -m minivllm.course.grade ch05_ex3`.
"""
from __future__ import annotations

import torch

from minivllm.sequence import Sequence


class MyBlockManager:
    """A paged KV-cache manager with an admission watermark (vLLM V0's `watermark`).

    Args:
        num_blocks: blocks in the cache (>= 1). block_size: token slots per block (>= 1).
        watermark_blocks: free blocks a new prefill must leave (>= 0); decode steps may use them.
    You own the bookkeeping: `self.free_ids` (free block ids, any order you keep) and
    `self.ref_counts[block_id]` (how many block tables hold the block). A sequence's block table is
    `seq.block_table`; it needs `seq.num_blocks` blocks to hold its `seq.num_tokens` tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int = 1):
        if num_blocks < 1 or block_size < 1 or watermark_blocks < 0:
            raise ValueError(f"need num_blocks >= 1, block_size >= 1, watermark_blocks >= 0; got "
                             f"{num_blocks}, {block_size}, {watermark_blocks}")
        self.num_blocks, self.block_size, self.watermark_blocks = num_blocks, block_size, watermark_blocks
        self.free_ids: list[int] = list(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @classmethod
    def from_cache_size(cls, num_tokens: int, block_size: int, max_model_len: int) -> MyBlockManager:
        return cls(num_tokens // block_size, block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def discard_unwritten(self, seqs: list[Sequence]) -> None:
        """Nothing to undo: no block's content is recorded."""

    def can_allocate(self, seq: Sequence) -> bool:
        """True if `seq`'s blocks are free and at least `watermark_blocks` stay free afterwards."""
        # TODO: compare the free blocks left after allocating seq.num_blocks with the watermark
        raise NotImplementedError('ch05_paged_attention.can_allocate: compare the free blocks left after allocating seq.num_blocks with the watermark')

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` (no blocks yet) `seq.num_blocks` free blocks; its `num_cached_tokens` becomes 0."""
        # TODO: take free ids, set their ref counts to 1, append them to seq.block_table
        raise NotImplementedError('ch05_paged_attention.allocate: take free ids, set their ref counts to 1, append them to seq.block_table')

    def deallocate(self, seq: Sequence) -> None:
        """Drop `seq`'s reference to each of its blocks (free those nobody holds); empty its table."""
        # TODO: decrement ref counts, free ids at zero, empty the table, reset num_cached_tokens
        raise NotImplementedError('ch05_paged_attention.deallocate: decrement ref counts, free ids at zero, empty the table, reset num_cached_tokens')

    def can_append(self, seq: Sequence) -> bool:
        """True if `seq` can take a decode step: a free block when its newest token starts a block."""
        # TODO: the newest token needs a block when the table is shorter than seq.num_blocks (no watermark)
        raise NotImplementedError('ch05_paged_attention.can_append: the newest token needs a block when the table is shorter than seq.num_blocks (no watermark)')

    def may_append(self, seq: Sequence) -> None:
        """Before a decode step: give `seq` one more block if its newest token starts one."""
        # TODO: allocate and append one block when needed
        raise NotImplementedError('ch05_paged_attention.may_append: allocate and append one block when needed')


def paged_decode_attention_window(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                  window: int) -> torch.Tensor:
    """Decode attention where sequence `i`'s query sees only its last `min(window, context_lens[i])` tokens.

    q `[num_seqs, num_heads, head_dim]`; caches `[num_blocks, block_size, num_kv_heads, head_dim]`;
    block_tables `[num_seqs, max_blocks]` int64 padded with -1; context_lens `[num_seqs]` int64 >= 1;
    window >= 1. Returns `[num_seqs, num_heads, head_dim]`, dtype of q. Read only the blocks the
    window touches.
    """
    # TODO: for each sequence, find the window's first token and block, gather those blocks, attend (GQA!)
    raise NotImplementedError("ch05_paged_attention.paged_decode_attention_window: for each sequence, find the window's first token and block, gather those blocks, attend (GQA!)")
