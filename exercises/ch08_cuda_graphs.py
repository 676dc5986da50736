# GENERATED from solutions/ch08_cuda_graphs.py by scripts/make_exercises.py: your work goes here.
"""Chapter 08's extend exercise. Your answer goes between the TODO lines; see the chapter notebook
(the rebuild exercise ch08_ex1, the build, is in the chapter's export cells).

Exercise 2 (ch08_ex2) — capture sizes chosen from the workload instead of by a fixed rule. Given how
often each decode batch size occurred in a recorded run, choose at most `max_sizes` sizes to capture,
the largest always `max_num_seqs` (so that every batch has a graph), that minimise the padded rows:
the sum over the recorded steps of `padded size - batch size`, where a batch runs the graph of the
smallest captured size that holds it (`padded_batch_size`). Write `choose_capture_sizes`. Graded
against the optimum found by trying every choice on small histograms (hypothesis), on a histogram of
256 sizes that trying every choice could not finish in time, and by the ValueError each invalid
input must raise: `python -m minivllm.course.grade ch08_ex2`.
"""
from __future__ import annotations

import bisect


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
