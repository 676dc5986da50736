"""The embedding and the LM head split by vocabulary rows over the tensor-parallel ranks (exported from
notebooks/13_scaling_out.ipynb). After vLLM's `model_executor/layers/vocab_parallel_embedding.py`."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .parallel_linear import TPGroup, shard_range

VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of 64 rows before splitting it


def padded_vocab_size(vocab_size: int, tp_size: int, pad_to: int = VOCAB_PADDING) -> int:
    """The vocabulary rounded up to a multiple of both `pad_to` and `tp_size`, so every rank holds
    the same number of rows (the last rows are padding: zeros, never looked up, their logits cut)."""
    multiple = pad_to * tp_size // math.gcd(pad_to, tp_size)
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows are split over the ranks: each rank looks up the ids in its range,
    writes zeros for the others, and one all-reduce adds the ranks' rows (exactly one is non-zero).

    Args: vocab_size, hidden_size, tp (`TPGroup`).
    Attributes: weight `[padded_vocab_size / tp.size, hidden_size]`; start, end (this rank's id range).
    Shapes: `forward(ids [N] int64)` -> `[N, hidden_size]` on every rank.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.padded_vocab_size = padded_vocab_size(vocab_size, tp.size)
        self.start, self.end = shard_range(self.padded_vocab_size, tp.size, tp.rank)
        self.weight = nn.Parameter(torch.zeros(self.end - self.start, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # EXERCISE ch13_ex2 (5 points): look up the ids in this rank's range, zeros for the others, sum over ranks
        ### BEGIN SOLUTION
        inside = (ids >= self.start) & (ids < self.end)
        rows = F.embedding((ids - self.start) * inside, self.weight)  # out-of-range ids read row 0 ...
        rows = rows * inside.unsqueeze(-1).to(rows.dtype)  # ... and are zeroed
        return self.tp.all_reduce(rows)
        ### END SOLUTION

    shard_names = ("weight",)

    def load_shard(self, name: str, loaded) -> list[nn.Parameter]:
        """Copy this rank's rows of the whole `[vocab_size, hidden_size]` matrix (zeros past the vocabulary)."""
        # EXERCISE ch13_ex2 (5 points): this rank's rows of the checkpoint's matrix; padding rows stay zero
        ### BEGIN SOLUTION
        end = min(self.end, self.vocab_size)
        with torch.no_grad():
            self.weight.zero_()
            if end > self.start:
                self.weight[:end - self.start].copy_(loaded[self.start:end])
        ### END SOLUTION
        return [self.weight]


class ParallelLMHead(nn.Module):
    """The LM head over the same vocabulary split: each rank computes the logits of its rows, and the
    slices are gathered on rank 0, which alone samples (so the ranks cannot draw different tokens).

    Args: vocab_size, hidden_size, tp; embedding: a `VocabParallelEmbedding` whose shard to share
        (tied word embeddings, as SmolLM2's), or None for a weight of its own.
    Shapes: `forward(hidden [N, hidden_size])` -> rank 0: `[N, vocab_size]`; other ranks: `[N, 0]`.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, embedding: VocabParallelEmbedding | None = None):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.padded_vocab_size = padded_vocab_size(vocab_size, tp.size)
        self.start, self.end = shard_range(self.padded_vocab_size, tp.size, tp.rank)
        self.tied = embedding is not None
        self.weight = embedding.weight if self.tied else nn.Parameter(torch.zeros(self.end - self.start, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # EXERCISE ch13_ex2 (5 points): this rank's logits, gathered on rank 0, padding cut
        ### BEGIN SOLUTION
        logits = self.tp.gather(F.linear(hidden, self.weight))
        return logits[..., :self.vocab_size] if self.tp.rank == 0 else logits
        ### END SOLUTION

    shard_names, load_shard = VocabParallelEmbedding.shard_names, VocabParallelEmbedding.load_shard
