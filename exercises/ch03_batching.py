# GENERATED from solutions/ch03_batching.py by scripts/make_exercises.py: your work goes here.
"""Chapter 03 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 1 (ch03_ex1) — rebuild the attention of a left-padded batch: graded against minivllm's
`padded_attention` on random shapes and paddings, and by plugging it into `static_generate`, whose
greedy tokens must still equal one-at-a-time decoding: `pytest -m ch03_ex1 --impl=exercises`.
"""
import torch


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal attention over a left-padded batch.

    Shapes: q `[batch_size, Tq, num_heads, head_dim]` holds the last Tq columns of each row;
    k, v `[batch_size, Tk, num_kv_heads, head_dim]` hold columns 0 .. Tk-1 (Tk >= Tq); num_heads is a
    multiple of num_kv_heads. Columns `< pad_lens[b]` of row b are padding. A query at column c sees
    key column j if `j <= c` and j is not padding; a padding query (which would see nothing, and a
    softmax over nothing is NaN) sees only its own column. Returns `[batch_size, Tq, num_heads,
    head_dim]` in q's dtype; run the softmax in at least float32.
    """
    # TODO: repeat K/V heads, scores = q.k * scale per row, build the [batch, Tq, Tk] mask, softmax, sum of v
    raise NotImplementedError()
