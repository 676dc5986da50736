# GENERATED from solutions/ch08_cuda_graphs.py by scripts/make_exercises.py: your work goes here.
"""Chapter 08's extend exercises. Your answers go between the TODO lines; see the chapter notebook
(the rebuild exercise ch08_ex1, the build, is in the chapter's export cells).

Exercise 2 (ch08_ex2) — capture sizes chosen from the workload instead of by a fixed rule. Given how
often each decode batch size occurred in a recorded run, choose at most `max_sizes` sizes to capture,
the largest always `max_num_seqs` (so that every batch has a graph), that minimise the padded rows:
the sum over the recorded steps of `padded size - batch size`, where a batch runs the graph of the
smallest captured size that holds it (`padded_batch_size`). Write `choose_capture_sizes`. Graded
against the optimum found by trying every choice on small histograms (hypothesis), on a histogram of
256 sizes that trying every choice could not finish in time, and by the ValueError each invalid
input must raise: `python -m minivllm.course.grade ch08_ex2`.

Exercise 3 (ch08_ex3) — what the graphs' static tensors cost in memory. Besides the graph pool (the
activations of the largest captured step), `CUDAGraphModelRunner` keeps static tensors for every batch it
may replay: the inputs and attention metadata, the logits, pinned host copies of the inputs, and one more
KV-cache block, the dummy block padded rows write into. Write `cudagraph_static_bytes`, their bytes for a
model config, and `largest_capture_size_within`, the most rows a device budget affords. Graded against the
bytes of the tensors the runner itself allocates (tiny models, several dtypes, block sizes and lengths,
`max_num_seqs` past `MAX_CAPTURE_SIZE`), against `DecodeBuffers` built for random configs (hypothesis),
by the budget's edge (the answer fits, one row more does not), and by the ValueError of each invalid
input: `python -m minivllm.course.grade ch08_ex3`.
"""
from __future__ import annotations

import bisect

import torch

from minivllm.worker.cuda_graph import DECODE_INPUTS, MAX_CAPTURE_SIZE


def padded_rows(batch_size_counts: dict[int, int], capture_sizes: list[int]) -> int:
    """The rows computed for nothing: `sum(count * (padded - n))` over the recorded batch sizes `n`,
    where `padded` is the smallest size of `capture_sizes` (ascending) >= n. Every `n` must fit."""
    total = 0
    for n, count in batch_size_counts.items():
        total += count * (capture_sizes[bisect.bisect_left(capture_sizes, n)] - n)
    return total


def choose_capture_sizes(batch_size_counts: dict[int, int], max_num_seqs: int, max_sizes: int) -> list[int]:
    """At most `max_sizes` decode batch sizes to capture, ascending, the last `max_num_seqs`, that
    minimise `padded_rows(batch_size_counts, sizes)` (any of the best choices, if several tie).

    Args:
        batch_size_counts: decode steps observed per batch size, `{batch size: steps}`; sizes are ints
            in `[1, max_num_seqs]`, steps ints >= 0 (a size missing from the dict was never seen).
        max_num_seqs: the largest batch the scheduler forms, an int >= 1; always captured.
        max_sizes: the most sizes to capture (graphs cost start-up time and memory), an int >= 1.
    Returns:
        the sizes, a list of distinct ints, ascending, `len <= max_sizes`, ending in `max_num_seqs`.
    Raises:
        ValueError: naming the argument, for a value that is not an int (bools are not ints) or out of
            its range, or a batch size or step count in `batch_size_counts` that is not.
    Hint: a best choice only ever captures sizes that were observed (besides `max_num_seqs`): a
    captured size with no observed batch at it can be lowered to the largest observed size below it
    without padding any more rows. Then dynamic programming over the observed sizes, ascending:
    the cheapest way to serve every size up to the j-th with t captured sizes, the j-th among them.
    It must handle 256 observed sizes and `max_sizes=8` in well under a second.
    """
    # TODO: check the arguments (ValueError), then choose the sizes
    raise NotImplementedError('ch08_cuda_graphs.choose_capture_sizes: check the arguments (ValueError), then choose the sizes')


def cudagraph_static_bytes(config, dtype: torch.dtype, block_size: int, max_num_seqs: int,
                           max_model_len: int | None = None) -> dict[str, int]:
    """The bytes of the static tensors `CUDAGraphModelRunner(model, block_manager, max_num_seqs=...,
    max_model_len=...)` sets aside for its graphs (the graph pool, the captured steps' activations, left out).

    The runner captures batch sizes up to `rows = min(max_num_seqs, MAX_CAPTURE_SIZE)` and sizes its
    `DecodeBuffers` for `rows`: on the device, an int64 vector `[rows]` per name in `DECODE_INPUTS`, the
    int64 block tables `[rows, ceil(max_model_len / block_size)]` and the logits `[rows, vocab_size]` in
    `dtype`; on the host, int64 copies of the inputs and the block tables (pinned on CUDA). The KV cache
    holds one block more than the block manager's, the dummy block: `[2, num_layers, 1, block_size,
    num_kv_heads, head_dim]` in `dtype` (`head_dim`: `config.head_dim` where it is set, else
    `hidden_size // num_attention_heads`, as the model's attention takes it).

    Args:
        config: the model's config (transformers'): `vocab_size`, `num_hidden_layers`, `num_key_value_heads`,
            `num_attention_heads`, `hidden_size`, `max_position_embeddings`, maybe `head_dim`.
        dtype: the model's dtype (logits and KV cache). block_size: tokens per KV-cache block, an int >= 1.
        max_num_seqs: the scheduler's largest batch, an int >= 1.
        max_model_len: tokens per sequence at most, an int >= 1; None: `config.max_position_embeddings`.
    Returns:
        `{"device": bytes on the model's device (buffers and the dummy block), "host": bytes of the host copies}`.
    Raises:
        ValueError: naming the argument, for `block_size`, `max_num_seqs` or `max_model_len` not an int (bools
            are not ints) >= 1 (`max_model_len` may be None).
    Source: the runner's constructor and `DecodeBuffers` (chapter 08); nano-vllm's and vLLM's static
    graph buffers.
    """
    # TODO: check the arguments (ValueError), then count the rows, the table width, each tensor's bytes
    raise NotImplementedError("ch08_cuda_graphs.cudagraph_static_bytes: check the arguments (ValueError), then count the rows, the table width, each tensor's bytes")


def largest_capture_size_within(config, dtype: torch.dtype, block_size: int, max_model_len: int,
                                device_budget_bytes: int) -> int:
    """The largest `max_num_seqs` in `[1, MAX_CAPTURE_SIZE]` whose static tensors on the device
    (`cudagraph_static_bytes(...)["device"]`) take at most `device_budget_bytes`; 0 when not even one row fits.

    Args: as `cudagraph_static_bytes` (`max_model_len` an int >= 1); device_budget_bytes, an int >= 0.
    Returns: an int in `[0, MAX_CAPTURE_SIZE]`.
    Raises: ValueError, naming the argument, for an argument not an int (bools are not ints) in its range.
    """
    # TODO: check the budget (ValueError); the bytes grow with the rows: find the last row count that fits
    raise NotImplementedError('ch08_cuda_graphs.largest_capture_size_within: check the budget (ValueError); the bytes grow with the rows: find the last row count that fits')


def _require(name: str, value, minimum: int = 1) -> None:
    """Given: a ValueError naming `name` unless `value` is an int (not a bool) >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
