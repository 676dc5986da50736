"""Grading tests for chapter 08's extend exercises (`python -m minivllm.course.grade ch08_ex2`, `... ch08_ex3`, or
`pytest -m ch08_ex2 --impl=exercises`).

ch08_ex2, `choose_capture_sizes`, is graded by its contract, written here: the answer is a valid
choice (distinct ints, ascending, at most `max_sizes`, the last `max_num_seqs`) whose padded rows equal
the optimum found by trying every choice, on small random histograms (hypothesis shrinks a failure to
the smallest one); on 256 observed sizes, where trying every choice would take years, it must finish
within `LARGE_LIMIT_S` and match the optimum of a dynamic program written here (checked against the
exhaustive search first); and each invalid input raises ValueError.

ch08_ex3, `cudagraph_static_bytes` and `largest_capture_size_within`: the bytes of the tensors the runner
itself allocates (`CUDAGraphModelRunner` on tiny models: its buffers, and its KV cache beyond an eager runner's),
of `DecodeBuffers` built on the meta device for random configs (hypothesis), the budget's answer at its edge
(it fits, one row more does not, `MAX_CAPTURE_SIZE` at most), and the ValueError of each invalid input. The
tests at the end show that plausible wrong answers fail.
"""
from __future__ import annotations

import bisect
import itertools
import random
import signal
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import failed_checks, load, raises_value_error

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


# --- ch08_ex3: the static tensors' bytes ---------------------------------------------------------------
# Graded by the tensors the runner itself allocates: `CUDAGraphModelRunner` on tiny models (the buffers of its
# `DecodeGraphs`, the KV cache's bytes beyond an eager runner's), then `DecodeBuffers` built for random configs
# on the meta device (hypothesis); the budget by its edge. The grader's closed form `_bytes` is checked against
# those measurements first.
EX3 = "ch08_ex3"
CAP = 512  # MAX_CAPTURE_SIZE, checked against the package below


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _bytes(config, dtype, block_size, max_num_seqs, max_model_len=None) -> dict[str, int]:
    """The grader's count: rows up to the cap, 8-byte ints, the logits and the dummy block in `dtype`."""
    rows, length = min(max_num_seqs, CAP), max_model_len or config.max_position_embeddings
    host = 8 * rows * (4 + -(-length // block_size))
    item = torch.empty((), dtype=dtype).element_size()
    dummy = 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * _head_dim(config) * item
    return {"device": host + rows * config.vocab_size * item + dummy, "host": host}


def _measured_buffers(config, dtype, block_size, max_num_seqs, max_model_len) -> dict[str, int]:
    """`DecodeBuffers` as the runner sizes them, on the meta device (no memory), and the dummy block's shape."""
    from minivllm.worker.cuda_graph import DECODE_INPUTS, DecodeBuffers

    rows, length = min(max_num_seqs, CAP), max_model_len or config.max_position_embeddings
    b = DecodeBuffers(rows, -(-length // block_size), block_size, 0, config.vocab_size, dtype, torch.device("meta"))
    dummy = torch.empty(2, config.num_hidden_layers, 1, block_size, config.num_key_value_heads, _head_dim(config),
                        dtype=dtype, device="meta")
    device = [getattr(b, n) for n in DECODE_INPUTS] + [b.block_tables, b.logits, dummy]
    return {"device": sum(t.nbytes for t in device), "host": sum(t.nbytes for t in b.host.values())}


class _NoCapture:
    """A graph that records nothing (the warm-up step still runs): the runner's tensors without the capture."""

    def capture(self, step, pool=None):
        pass

    def replay(self):
        raise AssertionError("grader: not replayed")


RUNNER_CASES = [  # (kind, dtype, block_size, max_num_seqs, max_model_len)
    ("llama", torch.float32, 4, 3, 30), ("llama", torch.bfloat16, 16, 20, None),
    ("qwen3", torch.float64, 8, 600, 100), ("qwen3", torch.bfloat16, 5, 9, 11)]


@pytest.fixture(scope="module")
def tiny_ch08x(tmp_path_factory):
    from minivllm.course.testing import make_tiny_model

    folders = {}
    for kind in ("llama", "qwen3"):
        folders[kind] = tmp_path_factory.mktemp(f"ch08x-{kind}")
        make_tiny_model(folders[kind], kind)
    return folders


def _runner_bytes(folder, dtype, block_size, max_num_seqs, max_model_len):
    """The runner's own tensors: its buffers' device and host tensors, and its KV cache beyond an eager one's."""
    from minivllm.attention.paged_attention import PagedAttention
    from minivllm.core.block_manager import BlockManager
    from minivllm.model_executor.model_loader import load_model
    from minivllm.worker.cuda_graph import DECODE_INPUTS, MAX_CAPTURE_SIZE, CapturablePagedAttention, \
        CUDAGraphModelRunner
    from minivllm.worker.model_runner import ModelRunner

    assert MAX_CAPTURE_SIZE == CAP, "grader: MAX_CAPTURE_SIZE changed"
    model = load_model(folder, dtype=dtype)
    runner_cls = type("Runner", (CUDAGraphModelRunner,), {"graph_cls": _NoCapture})
    with torch.inference_mode():
        runner = runner_cls(model, BlockManager(10, block_size), attention_backend=CapturablePagedAttention,
                            max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        eager = ModelRunner(model, BlockManager(10, block_size), attention_backend=PagedAttention)
    b = runner.decode_graphs.buffers
    device = [getattr(b, n) for n in DECODE_INPUTS] + [b.block_tables, b.logits]
    return model.config, {"device": sum(t.nbytes for t in device) + runner.kv_cache.nbytes - eager.kv_cache.nbytes,
                          "host": sum(t.nbytes for t in b.host.values())}


def _check_static(mod, config, dtype, block_size, max_num_seqs, max_model_len, want, where: str) -> None:
    got = mod.cudagraph_static_bytes(config, dtype, block_size, max_num_seqs, max_model_len)
    what = (f"cudagraph_static_bytes({where}, {dtype}, block_size={block_size}, max_num_seqs={max_num_seqs}, "
            f"max_model_len={max_model_len})")
    _expect3(isinstance(got, dict) and set(got) == {"device", "host"} and all(_is_int(v) for v in got.values()),
             f"{EX3}: {what} should return {{'device': int, 'host': int}}, got {got!r}")
    _expect3(got == want, f"{EX3}: {what}: the runner allocates {want}, you count {got}")


def _expect3(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


@pytest.mark.ch08
@pytest.mark.ch08_ex3
@pytest.mark.parametrize("kind,dtype,block_size,max_num_seqs,max_model_len", RUNNER_CASES,
                         ids=[f"{c[0]}-{str(c[1])[6:]}-bs{c[2]}-seqs{c[3]}-len{c[4]}" for c in RUNNER_CASES])
def test_ch08_ex3_bytes_of_the_runners_own_tensors(ch08, tiny_ch08x, kind, dtype, block_size, max_num_seqs,
                                                   max_model_len):
    config, want = _runner_bytes(tiny_ch08x[kind], dtype, block_size, max_num_seqs, max_model_len)
    assert want == _bytes(config, dtype, block_size, max_num_seqs, max_model_len), "grader: its count disagrees"
    _check_static(ch08, config, dtype, block_size, max_num_seqs, max_model_len, want, f"the tiny {kind}'s config")


CONFIGS = st.builds(
    lambda vocab, layers, kv, groups, hd, own_head_dim, positions: SimpleNamespace(
        vocab_size=vocab, num_hidden_layers=layers, num_key_value_heads=kv, num_attention_heads=kv * groups,
        hidden_size=kv * groups * hd, head_dim=own_head_dim, max_position_embeddings=positions),
    st.integers(1, 3000), st.integers(1, 6), st.integers(1, 4), st.integers(1, 4), st.integers(1, 32),
    st.one_of(st.none(), st.integers(1, 64)), st.integers(1, 4096))
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64])


def _check_static_random(mod, max_examples: int = 150) -> None:
    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None)
    @given(config=CONFIGS, dtype=DTYPES, block_size=st.integers(1, 64), max_num_seqs=st.integers(1, 700),
           max_model_len=st.one_of(st.none(), st.integers(1, 4096)))
    def run(config, dtype, block_size, max_num_seqs, max_model_len):
        want = _measured_buffers(config, dtype, block_size, max_num_seqs, max_model_len)
        assert want == _bytes(config, dtype, block_size, max_num_seqs, max_model_len), "grader: its count disagrees"
        _check_static(mod, config, dtype, block_size, max_num_seqs, max_model_len, want, str(config))
    run()


@pytest.mark.ch08
@pytest.mark.ch08_ex3
def test_ch08_ex3_bytes_of_decode_buffers_for_random_configs(ch08):
    _check_static_random(ch08)


SMALL = SimpleNamespace(vocab_size=10, num_hidden_layers=1, num_key_value_heads=1, num_attention_heads=1,
                        hidden_size=2, head_dim=None, max_position_embeddings=4)
# float32, blocks of 2, 4 tokens: per row 8 * (4 + 2) + 10 * 4 = 88 bytes, the dummy block 2 * 2 * 2 * 4 = 32
BUDGETS = [(31, 0), (119, 0), (120, 1), (295, 2), (296, 3), (297, 3), (32 + 88 * 512, 512), (10**15, 512)]


def _check_budget_known(mod) -> None:
    for budget, want in BUDGETS:
        got = mod.largest_capture_size_within(SMALL, torch.float32, 2, 4, budget)
        _expect3(_is_int(got) and got == want, f"{EX3}: largest_capture_size_within({SMALL}, float32, block_size=2, "
                 f"max_model_len=4, device_budget_bytes={budget}): the device bytes are 32 + 88 per row, so {want}; "
                 f"got {got!r}")


def _check_budget_random(mod, max_examples: int = 150) -> None:
    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None)
    @given(config=CONFIGS, dtype=DTYPES, block_size=st.integers(1, 64), max_model_len=st.integers(1, 4096),
           rows=st.integers(1, 600), delta=st.integers(-2, 2))
    def run(config, dtype, block_size, max_model_len, rows, delta):
        def device(r):
            return _bytes(config, dtype, block_size, r, max_model_len)["device"]

        budget = max(0, device(rows) + delta)  # at the edge of `rows` rows
        got = mod.largest_capture_size_within(config, dtype, block_size, max_model_len, budget)
        what = (f"largest_capture_size_within({config}, {dtype}, block_size={block_size}, max_model_len="
                f"{max_model_len}, device_budget_bytes={budget})")
        _expect3(_is_int(got) and 0 <= got <= CAP, f"{EX3}: {what}: expected an int in [0, {CAP}], got {got!r}")
        if got == 0:
            _expect3(device(1) > budget, f"{EX3}: {what} returned 0, but one row takes {device(1)} bytes")
            return
        _expect3(device(got) <= budget, f"{EX3}: {what} = {got}, but {got} rows take {device(got)} bytes")
        _expect3(got == CAP or device(got + 1) > budget, f"{EX3}: {what} = {got}, but {got + 1} rows fit "
                 f"({device(got + 1)} bytes)")
    run()


@pytest.mark.ch08
@pytest.mark.ch08_ex3
def test_ch08_ex3_largest_capture_size_within_known_budgets(ch08):
    _check_budget_known(ch08)


@pytest.mark.ch08
@pytest.mark.ch08_ex3
def test_ch08_ex3_largest_capture_size_within_at_the_edge(ch08):
    _check_budget_random(ch08)


def _raises_value_error(call, what: str) -> None:
    raises_value_error(call, f"{EX3}: {what}")


INVALID3 = [(0, 4, 8, "block_size = 0"), (4, 0, 8, "max_num_seqs = 0"), (4, 4, 0, "max_model_len = 0"),
            (True, 4, 8, "block_size a bool"), (4, 2.0, 8, "max_num_seqs a float"), (4, 4, "8", "max_model_len a str")]


@pytest.mark.ch08
@pytest.mark.ch08_ex3
@pytest.mark.parametrize("block_size,max_num_seqs,max_model_len,what", INVALID3, ids=[c[-1] for c in INVALID3])
def test_ch08_ex3_static_bytes_invalid_input(ch08, block_size, max_num_seqs, max_model_len, what):
    _raises_value_error(lambda: ch08.cudagraph_static_bytes(SMALL, torch.float32, block_size, max_num_seqs,
                                                            max_model_len),
                        f"cudagraph_static_bytes(block_size={block_size!r}, max_num_seqs={max_num_seqs!r}, "
                        f"max_model_len={max_model_len!r}) ({what})")


INVALID_BUDGET = [(2, 4, -1, "a negative budget"), (2, 4, 1.5, "a float budget"), (2, 4, True, "a bool budget"),
                  (0, 4, 100, "block_size = 0"), (2, None, 100, "max_model_len None"), (2, 0, 100, "max_model_len = 0")]


@pytest.mark.ch08
@pytest.mark.ch08_ex3
@pytest.mark.parametrize("block_size,max_model_len,budget,what", INVALID_BUDGET, ids=[c[-1] for c in INVALID_BUDGET])
def test_ch08_ex3_budget_invalid_input(ch08, block_size, max_model_len, budget, what):
    _raises_value_error(lambda: ch08.largest_capture_size_within(SMALL, torch.float32, block_size, max_model_len,
                                                                 budget),
                        f"largest_capture_size_within(block_size={block_size!r}, max_model_len={max_model_len!r}, "
                        f"device_budget_bytes={budget!r}) ({what})")


# --- plausible wrong answers fail (not graded: they check the graders) -----------------------------
def _wrong_static(no_cap=False, floor_width=False, no_dummy=False, heads_only=False, float32_logits=False):
    def cudagraph_static_bytes(config, dtype, block_size, max_num_seqs, max_model_len=None):
        rows = max_num_seqs if no_cap else min(max_num_seqs, CAP)
        length = max_model_len or config.max_position_embeddings
        width = length // block_size if floor_width else -(-length // block_size)
        item = torch.empty((), dtype=dtype).element_size()
        hd = config.hidden_size // config.num_attention_heads if heads_only else _head_dim(config)
        host = 8 * rows * (4 + width)
        dummy = 0 if no_dummy else 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * hd * item
        return {"device": host + rows * config.vocab_size * (4 if float32_logits else item) + dummy, "host": host}
    return cudagraph_static_bytes


def _wrong_budget(first_that_does_not_fit=False, no_cap=False):
    def largest_capture_size_within(config, dtype, block_size, max_model_len, device_budget_bytes):
        def fits(rows):
            return _bytes(config, dtype, block_size, rows, max_model_len)["device"] <= device_budget_bytes

        r = 0
        while (no_cap or r < CAP) and fits(r + 1):
            r += 1
            if no_cap and r > 4 * CAP:
                break
        return r + 1 if first_that_does_not_fit else r
    return largest_capture_size_within


def _check_static_known(mod) -> None:
    """The runner's cases, measured on the meta device (no model needed: the wrong answers' check)."""
    from minivllm.course.testing import tiny_config

    for kind, dtype, block_size, max_num_seqs, max_model_len in RUNNER_CASES:
        config = tiny_config(kind)
        want = _measured_buffers(config, dtype, block_size, max_num_seqs, max_model_len)
        _check_static(mod, config, dtype, block_size, max_num_seqs, max_model_len, want, f"the tiny {kind}'s config")


CH08_EX3_STATIC = [_check_static_known, lambda mod: _check_static_random(mod, 60)]
CH08_EX3_BUDGET = [_check_budget_known, lambda mod: _check_budget_random(mod, 60)]
WRONG3 = [
    (SimpleNamespace(cudagraph_static_bytes=_wrong_static(no_cap=True)), CH08_EX3_STATIC),
    (SimpleNamespace(cudagraph_static_bytes=_wrong_static(floor_width=True)), CH08_EX3_STATIC),
    (SimpleNamespace(cudagraph_static_bytes=_wrong_static(no_dummy=True)), CH08_EX3_STATIC),
    (SimpleNamespace(cudagraph_static_bytes=_wrong_static(heads_only=True)), CH08_EX3_STATIC),
    (SimpleNamespace(cudagraph_static_bytes=_wrong_static(float32_logits=True)), CH08_EX3_STATIC),
    (SimpleNamespace(largest_capture_size_within=_wrong_budget(first_that_does_not_fit=True)), CH08_EX3_BUDGET),
    (SimpleNamespace(largest_capture_size_within=_wrong_budget(no_cap=True)), CH08_EX3_BUDGET),
]
WRONG3_IDS = ["ignores-the-cap", "floors-the-table-width", "no-dummy-block", "head-dim-from-heads", "float32-logits",
              "budget-first-that-does-not-fit", "budget-ignores-the-cap"]


@pytest.mark.parametrize("wrong,checks", WRONG3, ids=WRONG3_IDS)
def test_ch08_ex3_wrong_answers_fail(wrong, checks):
    failures = failed_checks(checks, wrong)
    assert failures, f"a wrong answer passed every check of ch08_ex3: {wrong}"


def test_ch08_ex3_graders_own_answer_passes():
    right = SimpleNamespace(cudagraph_static_bytes=_wrong_static(), largest_capture_size_within=_wrong_budget())
    for check in CH08_EX3_STATIC + CH08_EX3_BUDGET:
        check(right)
