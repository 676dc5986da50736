# GENERATED from solutions/ch03_batching.py by scripts/make_exercises.py: your work goes here.
"""Chapter 03 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 1 (ch03_ex1) — batch without padding: attention over prompts laid end to end in one flat
token list (FlashAttention's varlen layout). Graded by its contract: equal to torch's
`scaled_dot_product_attention` on each sequence alone, and, plugged into the tiny model's prefill,
equal to transformers' logits for each prompt: `pytest -m ch03_ex1 --impl=exercises`.

Exercise 3 (ch03_ex3) — sort before batching. A static batch pads every prompt to its longest, so a
batch that mixes long and short prompts pays for the longest in every row. An offline job that has
all its requests up front can group prompts of similar lengths: `length_sorted_batches` orders the
requests longest prompt first and cuts them into batches of `batch_size`, with the batch of the rest
(when `batch_size` does not divide their number) placed where it pads least; `sorted_static_generate`
runs each batch through chapter 03's `static_generate` and gives the outputs back in the order the
requests came. Graded on fixed cases, on random lengths (hypothesis) against the order the contract
gives and against every split of a few requests into batches of the same sizes (none pads less), and
on the tiny model: transformers' greedy tokens and the seeded draws of each request alone, in arrival
order, with each request's padding within its own batch: `python -m minivllm.course.grade ch03_ex3`.
"""
from dataclasses import dataclass

import torch

from minivllm.baselines import static_batching
from minivllm.sampling_params import SamplingParams


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


@dataclass
class SortedBatchesResult:
    """What `sorted_static_generate` returns (given).

    Attributes:
        outputs: per request, in arrival order (the order of `prompts`), its generated token ids.
        pad_lens: per request, in arrival order, the padding slots of its row: the longest prompt of
            its own batch minus its prompt's length.
        batches: the request indices (into `prompts`) of each static batch, in the order they ran.
        num_steps: forward passes over all the batches (each batch's prefill and decode steps).
    """

    outputs: list[list[int]]
    pad_lens: list[int]
    batches: list[list[int]]
    num_steps: int


def length_sorted_batches(prompt_lens: list[int], batch_size: int) -> list[list[int]]:
    """Split requests into static batches of `batch_size` (and one of the rest) that pad the fewest slots.

    The request indices are ordered longest prompt first (equal lengths in arrival order: the lower
    index first) and that order is cut into consecutive batches: all of `batch_size` requests, except,
    when `batch_size` does not divide their number `n`, one batch of the rest (`n % batch_size`
    requests), which may sit at any place in the order. It goes where the padding is least (of equal
    paddings, at the latest place). A batch pads each prompt to its longest. No other split into batches
    of these sizes pads fewer slots.

    Args:
        prompt_lens: each request's prompt length in tokens, ints >= 1, in arrival order; at least one.
        batch_size: requests per batch, an int >= 1.
    Returns:
        the batches, each a list of request indices (into `prompt_lens`), in that order.
    Raises:
        ValueError: naming the argument, for no requests, a length or `batch_size` not an int (bools are
            not ints) or below 1.
    """
    # TODO: check the arguments (ValueError), order the indices longest prompt first, then try each place of the batch of the rest
    raise NotImplementedError('ch03_batching.length_sorted_batches: check the arguments (ValueError), order the indices longest prompt first, then try each place of the batch of the rest')


def sorted_static_generate(model, prompts: list[list[int]], sampling_params: SamplingParams | list[SamplingParams],
                           batch_size: int, eos_token_id: int | None = None,
                           pad_token_id: int = 0) -> SortedBatchesResult:
    """Static batching after sorting: the requests split by `length_sorted_batches`, each batch run by
    chapter 03's `static_generate` (`minivllm.baselines.static_batching`), one batch after the other,
    and each request's outputs given back in arrival order.

    Each request generates what it would generate alone: greedy tokens are the model's, a seeded request
    draws with its own generator; the batches change only the padding and the steps.

    Args:
        model: our decoder. prompts: token-id lists, each non-empty, in arrival order.
        sampling_params: one for all requests, or one per request (in arrival order).
        batch_size: requests per batch, an int >= 1. eos_token_id, pad_token_id: as `static_generate`'s.
    Returns:
        A `SortedBatchesResult`: outputs and pad_lens in arrival order, the batches, the forward passes.
    Raises:
        ValueError: as `length_sorted_batches` (an empty prompt is a length below 1), a list of sampling
            params of another length than `prompts`, and as `static_generate`.
    """
    # TODO: split the requests into batches, run static_generate on each, put outputs and padding back in arrival order
    raise NotImplementedError('ch03_batching.sorted_static_generate: split the requests into batches, run static_generate on each, put outputs and padding back in arrival order')
