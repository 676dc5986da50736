# GENERATED from solutions/ch09_benchmark.py by scripts/make_exercises.py: your work goes here.
"""Chapter 09's extend exercises. Your answers go between the TODO lines; see the chapter notebook
(the rebuild exercise ch09_ex1, the cost model and the roofline, is in the chapter's export cells).
Both exercises take a `ModelCost` (its six counts) and a `DevicePeaks` (its two rates) as given: they do
not call `model_cost`, `step_cost` or `roofline`, so they can be done before ch09_ex1 works.

Exercise 2 (ch09_ex2) — how many sequences fit, and from which batch a decode step is compute-bound.
`sequences_that_fit`: the most sequences of a given length a device's memory holds, the weights first,
then the KV cache in whole blocks. `compute_bound_batch`: the smallest decode batch whose step is
compute-bound on a device (the ridge point of the roofline, reached by batching), or None when no batch
is: batching amortises the weights, never the K/V. Graded against the blocks the engine itself allocates
for a memory budget, a count of sequences added one at a time (hypothesis), steps just below and at the
batch compared exactly, and the ValueError of each invalid input: `python -m minivllm.course.grade ch09_ex2`.

Exercise 3 (ch09_ex3) — the prefill tokens that ride along a decode step for free. While a step is
memory-bound the device waits for bytes, and arithmetic added to the step hides behind them: the idea
behind chunked prefill's mixed batches (Sarathi-Serve, Agrawal et al., OSDI 2024; chapter 11).
`free_prefill_chunk`: the longest chunk of a prompt that can join a decode step while the step stays
memory-bound. Graded against every chunk length tried one by one on small cases (hypothesis), a case
where trying them one by one cannot finish in time, and the ValueError of each invalid input:
`python -m minivllm.course.grade ch09_ex3`.
"""
from __future__ import annotations

from fractions import Fraction

import torch

from minivllm.benchmarks.roofline import DevicePeaks, ModelCost


def sequences_that_fit(cost: ModelCost, dtype: torch.dtype, memory_bytes: int, block_size: int,
                       context_len: int) -> int:
    """How many sequences of `context_len` tokens a device with `memory_bytes` of memory holds at once.

    The weights come first: every parameter (`cost.num_params`, an untied embedding included: it sits in
    memory even though a step gathers only a few rows of it) in `dtype`. The rest holds the KV cache in
    whole blocks of `block_size` tokens (`block_size * cost.kv_bytes_per_token` bytes each; what is left
    over is no block), and a sequence of `context_len` tokens holds `ceil(context_len / block_size)` of
    them (chapter 05's paged cache). Activations are left out (an upper bound, as the roofline is a
    lower one).

    Args:
        cost: from `model_cost` (its `kv_bytes_per_token` counted in the same `dtype`).
        dtype: the weights' dtype. memory_bytes: the device's memory for weights and cache, an int >= 0.
        block_size: tokens per block, an int >= 1. context_len: tokens per sequence, an int >= 1.
    Returns:
        the number of sequences, an int >= 0 (0 when the weights alone do not fit).
    Raises:
        ValueError: naming the argument, for `memory_bytes`, `block_size` or `context_len` not an int
            (bools are not ints) or out of its range.
    """
    # TODO: check the arguments (ValueError), then the weights, the blocks, the blocks per sequence
    raise NotImplementedError('ch09_benchmark.sequences_that_fit: check the arguments (ValueError), then the weights, the blocks, the blocks per sequence')


def compute_bound_batch(cost: ModelCost, context_len: int, peaks: DevicePeaks) -> int | None:
    """The smallest batch `B >= 1` such that a decode step of `B` sequences, each attending over
    `context_len` tokens (one new token each), is compute-bound on a device of rates `peaks`; None when
    no batch is.

    The step's FLOPs and bytes are `step_cost`'s (chapter 09): per sequence the linear maps and the LM head
    for one token and `context_len` (query, key) pairs; the weights read once for the whole step, and per
    sequence the K/V of `context_len` tokens read and of one token written. Compute-bound means
    `FLOPs / peaks.matmul_flops_per_s > bytes / peaks.copy_bytes_per_s`, strictly (`roofline` counts a
    tie as memory-bound), compared exactly: the counts are integers and a float rate is an exact binary
    fraction (`fractions.Fraction(rate)`), so compare `FLOPs * copy rate` with `bytes * matmul rate`
    without rounding. Hint: both sides grow linearly in `B`; the weights are paid once, each sequence
    adds its FLOPs to one side and its K/V bytes to the other.

    Args:
        cost: from `model_cost`. context_len: an int >= 1. peaks: the device's two rates (positive).
    Returns:
        the batch, an int >= 1, or None.
    Raises:
        ValueError: `context_len` not an int >= 1.
    """
    # TODO: check context_len (ValueError), then per-sequence arithmetic against per-sequence traffic
    raise NotImplementedError('ch09_benchmark.compute_bound_batch: check context_len (ValueError), then per-sequence arithmetic against per-sequence traffic')


def free_prefill_chunk(cost: ModelCost, decode_context_lens: list[int], prefix_len: int, peaks: DevicePeaks,
                       max_chunk: int) -> int:
    """The longest chunk of a prompt, at most `max_chunk` tokens, that can join a decode step while the
    step stays memory-bound: the largest `q` in `[0, max_chunk]` such that for every `k` in `1..q`, the
    step of the decodes (one new token each, attending over `decode_context_lens`) and the chunk (`k` new
    tokens after `prefix_len` cached ones: query `k`, context `prefix_len + k`) is memory-bound.

    FLOPs and bytes are `step_cost`'s (chapter 09), the chunk counted as one more sequence of the step (its
    LM head too). Memory-bound means `bytes / peaks.copy_bytes_per_s >= FLOPs / peaks.matmul_flops_per_s`
    (as `roofline` counts it), compared exactly (`fractions.Fraction` of the rates, integer counts).
    0 when a chunk of one token already makes the step compute-bound. It must answer in well under a
    second for `max_chunk` up to 10**12. Hint: the step's FLOPs grow with `k` as the chunk's causal pairs
    do (quadratically), its bytes linearly; what does that say about the chunk lengths that keep the step
    memory-bound, once a chunk of one token does?

    Args:
        cost: from `model_cost`. decode_context_lens: ints >= 1 (may be empty: the chunk alone).
        prefix_len: the prompt's tokens already cached, an int >= 0. peaks: the device's rates.
        max_chunk: an int >= 0.
    Returns:
        the chunk length, an int in `[0, max_chunk]`.
    Raises:
        ValueError: naming the argument, for a value not an int (bools are not ints) or out of its range.
    """
    # TODO: check the arguments (ValueError), then search the chunk lengths
    raise NotImplementedError('ch09_benchmark.free_prefill_chunk: check the arguments (ValueError), then search the chunk lengths')
