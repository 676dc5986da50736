# GENERATED from solutions/ch02_model.py by scripts/make_exercises.py: your work goes here.
"""Chapter 02 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 1 (ch02_ex1) — two variants of the chapter's building blocks, as other checkpoints use them:
(a) Gemma's RMSNorm, (b) RoPE over adjacent pairs (RoFormer, GPT-J, Meta's original Llama). Graded
against transformers' `GemmaRMSNorm` (float64 and bfloat16, bit for bit) and GPT-J's rotary code, and
by running our decoder on a tiny Llama with its q/k projections permuted to the interleaved layout:
`pytest -m ch02_ex1 --impl=exercises`.

Exercise 2 (ch02_ex2) — attention for one sequence with grouped-query heads, the causal rule "the Tq
queries are the last Tq of the Tk keys", and a sliding window. Graded against torch's attention and
inside a tiny Qwen2 whose second layer slides (logits and greedy tokens through a KV cache against
transformers): `pytest -m ch02_ex2 --impl=exercises`.
"""
import torch


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: `x / sqrt(mean(x**2, last dim) + eps) * (1 + weight)`.

    Shapes: x `[..., hidden]`, weight `[hidden]` (an offset from 1, in any float dtype); returns x's
    shape and dtype. Work in float32 throughout — statistics *and* the multiplication by
    `1 + weight` — and cast back to x's dtype only at the very end (the opposite order from Llama).
    """
    # TODO: upcast x and weight to float32, normalise, scale by (1 + weight), cast back
    raise NotImplementedError('ch02_model.gemma_rms_norm: upcast x and weight to float32, normalise, scale by (1 + weight), cast back')


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x by RoPE over adjacent pairs: dimensions (2i, 2i+1) are rotated by angle i.

    Shapes: x `[num_tokens, num_heads, head_dim]`; cos, sin `[num_tokens, head_dim // 2]` (one angle
    per pair, already gathered for each token's position, in x's dtype). For each pair (a, b):
    `(a * cos - b * sin, a * sin + b * cos)`, written back to dimensions 2i and 2i+1.
    """
    # TODO: take even and odd dimensions, rotate each pair, interleave the results again
    raise NotImplementedError('ch02_model.apply_rope_interleaved: take even and odd dimensions, rotate each pair, interleave the results again')


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True,
              sliding_window: int | None = None) -> torch.Tensor:
    """Softmax attention for one sequence with grouped-query K/V and an optional sliding window.

    Shapes: q `[Tq, num_heads, head_dim]`; k, v `[Tk, num_kv_heads, head_dim]` with Tk >= Tq and
    num_heads a multiple of num_kv_heads. The queries are the last Tq of Tk positions: query i is at
    position p = i + Tk - Tq. With `causal`, it sees keys at positions <= p; with `sliding_window`
    w as well (used with causal=True), only keys at positions > p - w, i.e. the last w positions.
    Returns `[Tq, num_heads, head_dim]`. Run the softmax in at least float32.
    """
    # TODO: repeat K/V heads, scores = q.k * scale, mask (causal, window), softmax, weighted sum of v
    raise NotImplementedError('ch02_model.attention: repeat K/V heads, scores = q.k * scale, mask (causal, window), softmax, weighted sum of v')
