"""Chapter 02 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 1 (ch02_ex1) — rebuild RMSNorm and RoPE as functions:
graded against minivllm's `RMSNorm` / `RotaryEmbedding` and by plugging them into the decoder,
whose logits must equal transformers': `pytest -m ch02_ex1 --impl=exercises`.

Exercise 2 (ch02_ex2) — rebuild attention for one sequence (grouped-query heads, causal rule
"the Tq queries are the last Tq of the Tk keys"): graded against `attention_reference` and by greedy
generation through a KV cache: `pytest -m ch02_ex2 --impl=exercises`.
"""
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x**2, last dim) + eps)`.

    Shapes: x `[..., hidden]`, weight `[hidden]`; returns x's shape and dtype. Like transformers,
    compute the statistics in float32 and cast back to x's dtype before multiplying by weight.
    """
    # TODO: three lines: upcast, normalise, cast back and scale
    ### BEGIN SOLUTION
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
    ### END SOLUTION


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x by RoPE, Llama's "rotate half" form.

    Shapes: x `[num_tokens, num_heads, head_dim]`; cos, sin `[num_tokens, head_dim]` (already gathered
    for each token's position, in x's dtype). Dimension i is paired with i + head_dim/2:
    `x * cos + rotate_half(x) * sin` where rotate_half([a, b]) = [-b, a].
    """
    # TODO: split the last dim in two halves, build rotate_half, combine with cos and sin
    ### BEGIN SOLUTION
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
    ### END SOLUTION


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              causal: bool = True) -> torch.Tensor:
    """Softmax attention for one sequence with grouped-query K/V.

    Shapes: q `[Tq, num_heads, head_dim]`; k, v `[Tk, num_kv_heads, head_dim]` with Tk >= Tq and
    num_heads a multiple of num_kv_heads. With `causal`, query i sees keys 0 .. i + Tk - Tq.
    Returns `[Tq, num_heads, head_dim]`. Run the softmax in at least float32.
    """
    # TODO: repeat K/V heads, scores = q.k * scale, mask, softmax, weighted sum of v
    ### BEGIN SOLUTION
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        tq, tk = q.shape[0], k.shape[0]
        keep = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(v.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)
    ### END SOLUTION
