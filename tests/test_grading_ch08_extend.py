"""Grading tests for chapter 08's extend exercise (`python -m minivllm.course.grade ch08_ex2`, or
`pytest -m ch08_ex2 --impl=exercises`).

ch08_ex2, `choose_capture_sizes`, is graded by its contract, written here: the answer is a valid
choice (distinct ints, ascending, at most `max_sizes`, the last `max_num_seqs`) whose padded rows equal
the optimum found by trying every choice, on small random histograms (hypothesis shrinks a failure to
the smallest one); on 256 observed sizes, where trying every choice would take years, it must finish
within `LARGE_LIMIT_S` and match the optimum of a dynamic program written here (checked against the
exhaustive search first); and each invalid input raises ValueError.
"""
from __future__ import annotations

import bisect
import itertools
import random
import signal
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import load

LARGE_LIMIT_S = 20  # generous on a loaded 2-core machine: an O(max_sizes * sizes**2) answer takes about a second


@pytest.fixture(scope="module")
def ch08(impl_name):
    return load("ch08_cuda_graphs", impl_name)


def _padded(counts: dict[int, int], sizes: list[int]) -> int:
    return sum(c * (sizes[bisect.bisect_left(sizes, n)] - n) for n, c in counts.items())


def _exhaustive(counts: dict[int, int], max_num_seqs: int, max_sizes: int) -> tuple[int, list[int]]:
    """The fewest padded rows over every choice of at most `max_sizes` sizes ending in `max_num_seqs`."""
    best = None
    for r in range(max_sizes):
        for below in itertools.combinations(range(1, max_num_seqs), r):
            sizes = [*below, max_num_seqs]
            rows = _padded(counts, sizes)
            if best is None or rows < best[0]:
                best = (rows, sizes)
    return best


def _optimum(counts: dict[int, int], max_num_seqs: int, max_sizes: int) -> int:
    """The same optimum by dynamic programming over every size 1..max_num_seqs: `f[j]`, the fewest rows
    padding every batch of size <= j with j captured and at most t sizes."""
    n_at = [counts.get(n, 0) for n in range(max_num_seqs + 1)]
    cum_c, cum_s = list(itertools.accumulate(n_at)), list(itertools.accumulate(n * c for n, c in enumerate(n_at)))

    def cost(i, j):  # batches of sizes i+1..j run the graph of j
        return j * (cum_c[j] - cum_c[i]) - (cum_s[j] - cum_s[i])

    f = [cost(0, j) for j in range(max_num_seqs + 1)]
    for _ in range(max_sizes - 1):
        f = [min([f[j]] + [f[i] + cost(i, j) for i in range(1, j)]) for j in range(max_num_seqs + 1)]
    return f[max_num_seqs]


def _check_choice(sizes, counts, max_num_seqs, max_sizes, want_rows, want_sizes=None):
    what = f"batch_size_counts={counts}, max_num_seqs={max_num_seqs}, max_sizes={max_sizes}"
    if not (isinstance(sizes, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in sizes)):
        raise AssertionError(f"ch08_ex2 ({what}): expected a list of ints, got {sizes!r}")
    problems = [p for ok, p in [
        (len(sizes) >= 1, "no sizes"), (len(sizes) <= max_sizes, f"{len(sizes)} sizes, more than max_sizes"),
        (sizes == sorted(set(sizes)), "not distinct and ascending"),
        (bool(sizes) and sizes[-1] == max_num_seqs, "the last size is not max_num_seqs"),
        (all(1 <= s <= max_num_seqs for s in sizes), "a size outside [1, max_num_seqs]")] if not ok]
    if problems:
        raise AssertionError(f"ch08_ex2 ({what}): your sizes {sizes} are not a valid choice: {'; '.join(problems)}")
    rows = _padded(counts, sizes)
    if rows != want_rows:
        best = f" (for example {want_sizes})" if want_sizes else ""
        raise AssertionError(f"ch08_ex2 ({what}): your sizes {sizes} pad {rows} rows; the best choice{best} pads "
                             f"{want_rows}, {rows - want_rows} fewer")


@pytest.mark.ch08
@pytest.mark.ch08_ex2
@settings(max_examples=150, deadline=None)
@given(data=st.data(), max_num_seqs=st.integers(1, 9), max_sizes=st.integers(1, 4))
def test_ch08_ex2_choice_is_optimal_on_small_histograms(ch08, data, max_num_seqs, max_sizes):
    """Against every possible choice: the fewest padded rows, with a valid list of sizes."""
    counts = data.draw(st.dictionaries(st.integers(1, max_num_seqs), st.integers(0, 6), max_size=max_num_seqs),
                       label="batch_size_counts")
    want_rows, want_sizes = _exhaustive(counts, max_num_seqs, max_sizes)
    assert _optimum(counts, max_num_seqs, max_sizes) == want_rows  # the grader's own two agree
    sizes = ch08.choose_capture_sizes(dict(counts), max_num_seqs, max_sizes)
    _check_choice(sizes, counts, max_num_seqs, max_sizes, want_rows, want_sizes)


class _TooSlow(Exception):
    pass


@pytest.mark.ch08
@pytest.mark.ch08_ex2
@pytest.mark.parametrize("seed", [0, 1])
def test_ch08_ex2_many_observed_sizes_in_time(ch08, seed):
    """256 observed batch sizes (a recorded run with max_num_seqs=256), up to 8 graphs: optimal, in time."""
    rng = random.Random(seed)
    max_num_seqs, max_sizes = 256, 8
    counts = {n: rng.choice([0, rng.randint(1, 50), rng.randint(100, 1000)]) for n in range(1, max_num_seqs + 1)}

    def alarm(*_):
        raise _TooSlow

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(LARGE_LIMIT_S)
    start = time.perf_counter()
    try:
        sizes = ch08.choose_capture_sizes(dict(counts), max_num_seqs, max_sizes)
    except _TooSlow:
        raise AssertionError(f"ch08_ex2: choose_capture_sizes took more than {LARGE_LIMIT_S} s for 256 observed "
                             f"sizes and max_sizes=8 (trying every choice cannot finish: see the hint)") from None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    took = time.perf_counter() - start
    _check_choice(sizes, counts, max_num_seqs, max_sizes, _optimum(counts, max_num_seqs, max_sizes))
    assert took < LARGE_LIMIT_S


INVALID = [  # (counts, max_num_seqs, max_sizes, what is wrong)
    ({1: 3}, 4, 0, "max_sizes = 0"),
    ({1: 3}, 4, True, "max_sizes a bool"),
    ({1: 3}, 4, 2.0, "max_sizes a float"),
    ({1: 3}, 0, 2, "max_num_seqs = 0"),
    ({1: 3}, "4", 2, "max_num_seqs a str"),
    ({0: 3}, 4, 2, "batch size 0"),
    ({5: 3}, 4, 2, "batch size above max_num_seqs"),
    ({"2": 3}, 4, 2, "batch size a str"),
    ({2: -1}, 4, 2, "a negative step count"),
    ({2: 1.5}, 4, 2, "a float step count"),
    ([3, 1], 4, 2, "a list instead of a dict"),
]


@pytest.mark.ch08
@pytest.mark.ch08_ex2
@pytest.mark.parametrize("counts,max_num_seqs,max_sizes,what", INVALID, ids=[c[-1] for c in INVALID])
def test_ch08_ex2_invalid_input_raises_value_error(ch08, counts, max_num_seqs, max_sizes, what):
    try:
        got = ch08.choose_capture_sizes(counts, max_num_seqs, max_sizes)
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - the message names what was raised instead
        raise AssertionError(f"ch08_ex2: choose_capture_sizes({counts!r}, {max_num_seqs!r}, {max_sizes!r}) ({what}) "
                             f"must raise ValueError, raised {type(e).__name__}: {e}") from e
    raise AssertionError(f"ch08_ex2: choose_capture_sizes({counts!r}, {max_num_seqs!r}, {max_sizes!r}) ({what}) "
                         f"must raise ValueError, returned {got!r}")
