# GENERATED from solutions/ch03_batching.py by scripts/make_exercises.py: your work goes here.
"""Chapter 03 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 1 (ch03_ex1) — batch without padding: attention over prompts laid end to end in one flat
token list (FlashAttention's varlen layout). Graded by its contract: equal to torch's
`scaled_dot_product_attention` on each sequence alone, and, plugged into the tiny model's prefill,
equal to transformers' logits for each prompt: `pytest -m ch03_ex1 --impl=exercises`.
"""
import torch


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal attention over several sequences packed into one flat token list, without padding.

    Shapes: q `[N, num_heads, head_dim]`; k, v `[N, num_kv_heads, head_dim]`; num_heads is a multiple
    of num_kv_heads (query head h uses K/V head `h // (num_heads // num_kv_heads)`). `cu_seqlens` is
    `[num_seqs + 1]` int64, `0 = cu_seqlens[0] < cu_seqlens[1] < ... < cu_seqlens[-1] = N`: sequence s
    holds tokens `cu_seqlens[s] .. cu_seqlens[s + 1] - 1`. Token i of a sequence attends to tokens
    j <= i of the *same* sequence, with weights softmax(scale * q·k). Returns `[N, num_heads, head_dim]`
    in q's dtype; run the softmax in at least float32.
    """
    # TODO: find each token's sequence, build the [N, N] mask (same sequence and not in the future), attend
    raise NotImplementedError("ch03_batching.varlen_attention: find each token's sequence, build the [N, N] mask (same sequence and not in the future), attend")
