"""Chapter 05 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 1 (ch05_ex1) — rebuild the paged `BlockManager`'s `allocate`, `deallocate`, `can_append`
and `may_append`. Graded by a property-based differential test against minivllm's `BlockManager` and
by running the engine with your class (`LLM(..., kv_manager=MyBlockManager)`):
`pytest -m ch05_ex1 --impl=exercises`.

Exercise 2 (ch05_ex2) — rebuild `paged_decode_attention`: one query per sequence over its K/V, read
through its block table. Graded against `attention_reference` on random block tables:
`pytest -m ch05_ex2 --impl=exercises`.
"""
import torch

from minivllm.block_manager import BlockManager
from minivllm.sequence import Sequence


class MyBlockManager(BlockManager):
    """A `BlockManager` whose block-table methods you write yourself. Use `self._allocate_block()`
    (takes the least recently freed block, ref_count 1) and `self._free_block` (for a block at ref_count 0)."""

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` (no blocks yet) one block per `block_size` tokens; set `num_cached_tokens = 0`."""
        # TODO: append seq.num_blocks freshly allocated block ids to seq.block_table
        ### BEGIN SOLUTION
        assert not seq.block_table
        seq.num_cached_tokens = 0
        for _ in range(seq.num_blocks):
            seq.block_table.append(self._allocate_block().block_id)
        ### END SOLUTION

    def deallocate(self, seq: Sequence) -> None:
        """Drop one reference to each block of `seq` (last block first); free blocks nobody holds."""
        # TODO: decrement ref counts in reverse order, free at zero, empty the table, reset num_cached_tokens
        ### BEGIN SOLUTION
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_block(block)
        seq.block_table = []
        seq.num_cached_tokens = 0
        ### END SOLUTION

    def can_append(self, seq: Sequence) -> bool:
        """True if `seq` can take a decode step: a free block when its newest token starts a block."""
        # TODO: the newest token needs a new block when the table is shorter than seq.num_blocks
        ### BEGIN SOLUTION
        return self.num_free_blocks >= int(len(seq.block_table) < seq.num_blocks)
        ### END SOLUTION

    def may_append(self, seq: Sequence) -> None:
        """Before a decode step: append a new block if the newest token starts one."""
        # TODO: allocate and append one block when needed
        ### BEGIN SOLUTION
        if len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._allocate_block().block_id)
        ### END SOLUTION


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[num_seqs, num_heads, head_dim]`; caches `[num_blocks, block_size, num_kv_heads, head_dim]`;
    block_tables `[num_seqs, max_blocks]` padded with -1; context_lens `[num_seqs]`.
    Returns `[num_seqs, num_heads, head_dim]` (softmax in at least float32)."""
    # TODO: gather each sequence's blocks, mask slots past its context_len, softmax, weight V (GQA!)
    ### BEGIN SOLUTION
    out = []
    for i in range(q.shape[0]):
        n = int(context_lens[i])
        blocks = block_tables[i][: -(-n // k_cache.shape[1])]
        k = k_cache[blocks].flatten(0, 1)[:n]
        v = v_cache[blocks].flatten(0, 1)[:n]
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i], k) * scale
        probs = scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(v.dtype)
        out.append(torch.einsum("ht,thd->hd", probs, v))
    return torch.stack(out)
    ### END SOLUTION
