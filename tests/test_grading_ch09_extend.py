"""Grading tests for chapter 09's extend exercises (`python -m minivllm.course.grade ch09_ex2`, `... ch09_ex3`,
or `pytest -m ch09_ex2 --impl=exercises`).

Both are graded by their contracts, written here, never by the book's code; the exercises take a `ModelCost`
and a `DevicePeaks` as given, so their grading needs neither the student's ch09_ex1 nor the package's roofline.
Every comparison of two times is exact (`fractions.Fraction` of the float rates, integer counts), as the
contracts say, so an answer cannot be right or wrong by a rounding.

ch09_ex2, `sequences_that_fit` and `compute_bound_batch`:
* the blocks the engine itself allocates (`LLM` on tiny models, float32 and bfloat16, for a KV budget in bytes):
  with memory = the bytes of the engine's own parameters + that budget, the sequences that fit are its blocks
  divided by the blocks one sequence holds, counted by the grader's `Sequence`;
* random costs, budgets, block sizes and lengths (hypothesis) against sequences added one at a time, block by
  block, while the memory lasts;
* random costs, contexts and rates (hypothesis): the step of the returned batch is compute-bound and the step of
  one sequence fewer is not (the steps are counted here, one term per sequence); None only when even 10**30
  sequences leave the step memory-bound; a step that ties exactly is memory-bound (`roofline` counts it so);
* the ValueError of each invalid input.
ch09_ex3, `free_prefill_chunk`: on small random cases (hypothesis), every chunk length tried one by one, the
(query, key) pairs counted over the causal mask; on a case whose answer is about 1.4 * 10**9, within
`LARGE_LIMIT_S` (trying lengths one by one cannot finish), the answer's step memory-bound and the next
length's compute-bound; the ValueError of each invalid input.
The tests at the end show that plausible wrong answers fail.
"""
from __future__ import annotations

import signal
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from adapters import failed_checks, load, raises_value_error
from minivllm.benchmarks.roofline import DevicePeaks, ModelCost
from minivllm.course.testing import make_tiny_model

HYPOTHESIS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
LARGE_LIMIT_S = 20  # generous on a loaded machine: a bisection answers in milliseconds


@pytest.fixture(scope="module")
def ch09(impl_name):
    return load("ch09_benchmark", impl_name)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


COSTS = st.builds(ModelCost, num_params=st.integers(0, 10**5), weight_bytes=st.integers(0, 10**6),
                  matmul_params=st.integers(0, 1000), lm_head_params=st.integers(0, 1000),
                  attention_flops_per_pair=st.integers(0, 100), kv_bytes_per_token=st.integers(1, 1000))
RATES = st.integers(1, 10**6).map(float)  # whole numbers: exact ties are common, and must count as memory-bound


def _peaks(matmul: float, copy: float) -> DevicePeaks:
    return DevicePeaks(matmul_flops_per_s=matmul, copy_bytes_per_s=copy)


def _step(cost: ModelCost, query_lens, context_lens) -> tuple[int, int]:
    """(FLOPs, bytes) of a step, term by term per sequence: new token i of a sequence of `q` new tokens among
    `c` sees c - q + i + 1 keys (summed in closed form: the arithmetic series)."""
    flops, num_bytes = 0, cost.weight_bytes
    for q, c in zip(query_lens, context_lens):
        pairs = q * (c - q) + q * (q + 1) // 2  # sum over i < q of (c - q + i + 1)
        flops += 2 * cost.matmul_params * q + 2 * cost.lm_head_params + cost.attention_flops_per_pair * pairs
        num_bytes += cost.kv_bytes_per_token * (c + q)
    return flops, num_bytes


def _memory_bound(cost, query_lens, context_lens, peaks) -> bool:
    """bytes / copy rate >= FLOPs / matmul rate, exactly (roofline's side of a tie)."""
    flops, num_bytes = _step(cost, query_lens, context_lens)
    return num_bytes * Fraction(peaks.matmul_flops_per_s) >= flops * Fraction(peaks.copy_bytes_per_s)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# --- ch09_ex2: how many sequences fit ----------------------------------------------------------------
def _fit_by_counting(cost: ModelCost, dtype, memory_bytes: int, block_size: int, context_len: int) -> int:
    """Sequences added one at a time, each taking its blocks one by one, while the memory lasts."""
    left = memory_bytes - cost.num_params * torch.empty((), dtype=dtype).element_size()
    block = block_size * cost.kv_bytes_per_token
    if left < 0:
        return 0
    seqs = 0
    while True:
        need, tokens = 0, 0
        while tokens < context_len:  # the next sequence's blocks
            need, tokens = need + block, tokens + block_size
        if need > left:
            return seqs
        left, seqs = left - need, seqs + 1


# Fixed cases where whole blocks and tokens differ (a sequence's last block partly filled), with room for
# several sequences: random draws rarely leave room for one (the K/V of a long context outweighs the budget).
FIT_CASES = [  # (num_params, kv_bytes_per_token, dtype, memory_bytes, block_size, context_len)
    (10, 2, torch.float32, 140, 4, 5), (100, 3, torch.bfloat16, 1000, 16, 17), (7, 1, torch.float64, 500, 8, 1),
    (0, 5, torch.float32, 999, 3, 10)]


def _check_fit_random(mod) -> None:
    for num_params, kv, dtype, memory, block_size, context_len in FIT_CASES:
        cost = ModelCost(num_params=num_params, weight_bytes=num_params * dtype.itemsize, matmul_params=num_params,
                         lm_head_params=0, attention_flops_per_pair=4, kv_bytes_per_token=kv)
        want = _fit_by_counting(cost, dtype, memory, block_size, context_len)
        got = mod.sequences_that_fit(cost, dtype, memory, block_size, context_len)
        _expect(_is_int(got) and got == want,
                f"ch09_ex2: sequences_that_fit({cost}, {dtype}, memory_bytes={memory}, block_size={block_size}, "
                f"context_len={context_len}): expected {want} (weights first, then whole blocks), got {got!r}")

    @settings(max_examples=150, **HYPOTHESIS)
    @given(cost=COSTS, dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
           memory=st.integers(0, 2 * 10**6), block_size=st.integers(1, 40), context_len=st.integers(1, 300))
    def run(cost, dtype, memory, block_size, context_len):
        cost = ModelCost(**{**cost.__dict__, "kv_bytes_per_token": cost.kv_bytes_per_token * 50})  # fewer loops
        want = _fit_by_counting(cost, dtype, memory, block_size, context_len)
        got = mod.sequences_that_fit(cost, dtype, memory, block_size, context_len)
        _expect(_is_int(got) and got == want,
                f"ch09_ex2: sequences_that_fit({cost}, {dtype}, memory_bytes={memory}, block_size={block_size}, "
                f"context_len={context_len}): expected {want} (weights first, then whole blocks), got {got!r}")
    run()


@pytest.mark.ch09
@pytest.mark.ch09_ex2
def test_ch09_ex2_sequences_that_fit_by_counting(ch09):
    _check_fit_random(ch09)


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    folders = {}
    for kind, tie in [("llama", False), ("qwen3", True)]:
        folders[kind] = tmp_path_factory.mktemp(f"ch09x-{kind}")
        make_tiny_model(folders[kind], kind, tie=tie)
    return folders


@pytest.mark.ch09
@pytest.mark.ch09_ex2
@pytest.mark.parametrize("kind,dtype,block_size,kv_budget,context_len", [
    ("llama", "float32", 4, 100_000, 10), ("llama", "bfloat16", 16, 300_000, 33),
    ("qwen3", "float32", 8, 250_000, 8), ("qwen3", "bfloat16", 1, 60_000, 5)])
def test_ch09_ex2_sequences_that_fit_the_engines_cache(ch09, tiny_folders, kind, dtype, block_size, kv_budget,
                                                       context_len):
    """The engine given a KV budget in bytes allocates whole blocks; weights + budget hold its blocks'
    sequences. The grader's `ModelCost` carries the engine's own parameter count and K/V bytes per token."""
    from minivllm.llm import LLM
    from minivllm.sequence import Sequence

    torch_dtype = getattr(torch, dtype)
    llm = LLM(str(tiny_folders[kind]), dtype=dtype, device="cpu", kv_cache_memory_bytes=kv_budget,
              block_size=block_size, max_model_len=context_len)
    engine = llm.llm_engine
    params = list(engine.model.parameters())  # a tied matrix once
    cache = engine.model_runner.kv_cache  # [2, layers, blocks, block_size, kv_heads, head_dim]
    per_token = cache[:, :, 0, 0].numel() * cache.element_size()
    cost = ModelCost(num_params=sum(p.numel() for p in params), weight_bytes=0, matmul_params=0, lm_head_params=0,
                     attention_flops_per_pair=0, kv_bytes_per_token=per_token)
    weights = sum(p.numel() * p.element_size() for p in params)
    assert weights == cost.num_params * torch_dtype.itemsize, "grader: the engine's weights are not all in the dtype"
    blocks = engine.block_manager.num_blocks
    assert blocks == cache.shape[2] and cache.shape[3] == block_size, "grader: an unexpected cache layout"
    per_seq = Sequence(list(range(context_len)), block_size=block_size).num_blocks
    want = blocks // per_seq
    # the leftover bytes of the budget (less than a block) and a few more than the weights add no sequence
    for memory in (weights + kv_budget, weights + blocks * block_size * per_token + 7):
        got = ch09.sequences_that_fit(cost, torch_dtype, memory, block_size, context_len)
        _expect(got == want, f"ch09_ex2: sequences_that_fit with the {kind} model's {weights} bytes of {dtype} weights "
                             f"and {memory - weights} bytes for the cache: the engine allocates {blocks} blocks of "
                             f"{block_size} tokens for them, {per_seq} per sequence of {context_len} tokens, so "
                             f"{want} sequences; got {got!r}")
    _expect(ch09.sequences_that_fit(cost, torch_dtype, weights - 1, block_size, context_len) == 0,
            f"ch09_ex2: sequences_that_fit: one byte short of the {kind} model's weights, no sequence fits")


# --- ch09_ex2: the batch from which decode is compute-bound --------------------------------------
def _check_batch(mod, cost, context_len, peaks) -> None:
    got = mod.compute_bound_batch(cost, context_len, peaks)
    what = (f"compute_bound_batch({cost}, {context_len}, matmul {peaks.matmul_flops_per_s}, "
            f"copy {peaks.copy_bytes_per_s})")

    def decode(b):  # b identical sequences: b times one sequence's terms, the weights once
        flops, num_bytes = _step(cost, [1], [context_len])
        flops, num_bytes = b * flops, cost.weight_bytes + b * (num_bytes - cost.weight_bytes)
        return num_bytes * Fraction(peaks.matmul_flops_per_s) >= flops * Fraction(peaks.copy_bytes_per_s)

    if got is None:
        _expect(decode(10**30), f"ch09_ex2: {what} returned None, but a decode step of 10**30 sequences is "
                                "compute-bound already")
        return
    _expect(_is_int(got) and got >= 1, f"ch09_ex2: {what}: expected an int >= 1 or None, got {got!r}")
    _expect(not decode(got), f"ch09_ex2: {what} = {got}, but a decode step of {got} sequences is memory-bound "
                             "(bytes / copy rate >= FLOPs / matmul rate, exactly)")
    _expect(got == 1 or decode(got - 1), f"ch09_ex2: {what} = {got}, but {got - 1} sequences already make the "
                                         "step compute-bound")


def _check_batch_random(mod) -> None:
    @settings(max_examples=200, **HYPOTHESIS)
    @given(cost=COSTS, context_len=st.integers(1, 5000), matmul=RATES, copy=RATES)
    def run(cost, context_len, matmul, copy):
        _check_batch(mod, cost, context_len, _peaks(matmul, copy))
    run()


KNOWN_BATCHES = [  # (cost, context_len, peaks, the batch): decode steps counted by hand
    # per sequence 6 FLOPs and 2 bytes; 8 bytes of weights: B = 2 ties (12 FLOPs, 12 bytes), so B = 3
    (ModelCost(0, 8, 3, 0, 0, 1), 1, _peaks(1.0, 1.0), 3),
    # per sequence 2 * (100 + 50) + 4 * 10 = 340 FLOPs, 2 * 11 = 22 bytes; rates 10 and 1: 34 > 22 from the
    # first; 1000 bytes of weights: B * (34 - 22) > 1000 from B = 84
    (ModelCost(0, 1000, 100, 50, 4, 2), 10, _peaks(10.0, 1.0), 84),
    # per sequence 340 FLOPs at rate 20 is 17 against 22 bytes: never compute-bound
    (ModelCost(0, 1000, 100, 50, 4, 2), 10, _peaks(20.0, 1.0), None),
]


def _check_batch_known(mod) -> None:
    for cost, context_len, peaks, want in KNOWN_BATCHES:
        got = mod.compute_bound_batch(cost, context_len, peaks)
        _expect(got == want, f"ch09_ex2: compute_bound_batch({cost}, {context_len}, {peaks}): expected {want}, "
                             f"got {got!r}")


@pytest.mark.ch09
@pytest.mark.ch09_ex2
def test_ch09_ex2_compute_bound_batch_on_random_steps(ch09):
    _check_batch_random(ch09)


@pytest.mark.ch09
@pytest.mark.ch09_ex2
def test_ch09_ex2_compute_bound_batch_known_cases(ch09):
    _check_batch_known(ch09)



_COST = ModelCost(10, 40, 5, 3, 2, 4)
_FIT_INVALID = [(-1, 4, 8, "memory_bytes < 0"), (100, 0, 8, "block_size = 0"), (100, 4, 0, "context_len = 0"),
                (100, True, 8, "block_size a bool"), (100.0, 4, 8, "memory_bytes a float"), (100, 4, "8", "a str")]


@pytest.mark.ch09
@pytest.mark.ch09_ex2
@pytest.mark.parametrize("memory,block_size,context_len,what", _FIT_INVALID, ids=[c[-1] for c in _FIT_INVALID])
def test_ch09_ex2_sequences_that_fit_invalid_input(ch09, memory, block_size, context_len, what):
    raises_value_error(lambda: ch09.sequences_that_fit(_COST, torch.float32, memory, block_size, context_len),
                        f"ch09_ex2: sequences_that_fit(memory_bytes={memory!r}, block_size={block_size!r}, "
                        f"context_len={context_len!r}) ({what})")


@pytest.mark.ch09
@pytest.mark.ch09_ex2
@pytest.mark.parametrize("context_len", [0, -3, 2.5, True, "7"])
def test_ch09_ex2_compute_bound_batch_invalid_input(ch09, context_len):
    raises_value_error(lambda: ch09.compute_bound_batch(_COST, context_len, _peaks(1.0, 1.0)),
                        f"ch09_ex2: compute_bound_batch(context_len={context_len!r})")


# --- ch09_ex3: the free prefill chunk -------------------------------------------------------------
def _check_chunk(mod, cost, decodes, prefix_len, peaks, max_chunk, want=None) -> None:
    what = (f"free_prefill_chunk({cost}, {decodes}, prefix_len={prefix_len}, matmul {peaks.matmul_flops_per_s}, "
            f"copy {peaks.copy_bytes_per_s}, max_chunk={max_chunk})")
    got = mod.free_prefill_chunk(cost, list(decodes), prefix_len, peaks, max_chunk)
    if want is None:  # every length, one by one, the pairs counted over the causal mask
        want = 0
        for k in range(1, max_chunk + 1):
            pairs = int(torch.ones(k, prefix_len + k, dtype=torch.bool).tril(diagonal=prefix_len).sum())
            assert pairs == k * prefix_len + k * (k + 1) // 2  # the grader's own closed form agrees
            if not _memory_bound(cost, [1] * len(decodes) + [k], list(decodes) + [prefix_len + k], peaks):
                break
            want = k
    _expect(_is_int(got) and got == want, f"ch09_ex3: {what}: expected {want}, got {got!r}")


def _check_chunk_random(mod) -> None:
    @settings(max_examples=150, **HYPOTHESIS)
    # a fixed case first (the draws depend on where the check is called from): free up to 12 tokens, the lm
    # head's FLOPs and the prefix's pairs both counted
    @example(cost=ModelCost(0, 1000, 10, 100, 1, 1), decodes=[8, 3], prefix_len=4, matmul=1.0, copy=1.0, max_chunk=40)
    @given(cost=COSTS, decodes=st.lists(st.integers(1, 200), max_size=6), prefix_len=st.integers(0, 100),
           matmul=RATES, copy=RATES, max_chunk=st.integers(0, 40))
    def run(cost, decodes, prefix_len, matmul, copy, max_chunk):
        _check_chunk(mod, cost, decodes, prefix_len, _peaks(matmul, copy), max_chunk)
    run()


@pytest.mark.ch09
@pytest.mark.ch09_ex3
def test_ch09_ex3_free_chunk_against_every_length(ch09):
    _check_chunk_random(ch09)


class _TooSlow(Exception):
    pass


def _check_chunk_large(mod) -> None:
    """Per chunk token 2 + k FLOPs against 2 bytes at equal rates, 10**18 bytes of weights: free up to about
    sqrt(2 * 10**18), 1.4 * 10**9 tokens; checked at the answer and one past it."""
    cost, peaks, max_chunk = ModelCost(0, 10**18, 1, 1, 1, 1), _peaks(1.0, 1.0), 10**12

    def alarm(*_):
        raise _TooSlow

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(LARGE_LIMIT_S)
    try:
        got = mod.free_prefill_chunk(cost, [5, 9], 3, peaks, max_chunk)
    except _TooSlow:
        raise AssertionError(f"ch09_ex3: free_prefill_chunk took more than {LARGE_LIMIT_S} s on a case whose answer "
                             "is about 1.4 * 10**9 (trying lengths one by one cannot finish: see the hint)") from None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)

    def free(k):
        return _memory_bound(cost, [1, 1, k], [5, 9, 3 + k], peaks)

    _expect(_is_int(got) and 10**9 < got < max_chunk and free(got) and not free(got + 1),
            f"ch09_ex3: free_prefill_chunk on 10**18 bytes of weights returned {got!r}: the step of that chunk must "
            "be memory-bound and that of one more token compute-bound")


@pytest.mark.ch09
@pytest.mark.ch09_ex3
def test_ch09_ex3_free_chunk_large_in_time(ch09):
    _check_chunk_large(ch09)


_CHUNK_INVALID = [([3], -1, 4, "prefix_len < 0"), ([3], 0, -1, "max_chunk < 0"), ([0], 0, 4, "a context 0"),
                  ([2.0], 0, 4, "a float context"), ([3], 0, True, "max_chunk a bool"), (3, 0, 4, "an int, not a list")]


@pytest.mark.ch09
@pytest.mark.ch09_ex3
@pytest.mark.parametrize("decodes,prefix_len,max_chunk,what", _CHUNK_INVALID, ids=[c[-1] for c in _CHUNK_INVALID])
def test_ch09_ex3_free_chunk_invalid_input(ch09, decodes, prefix_len, max_chunk, what):
    raises_value_error(lambda: ch09.free_prefill_chunk(_COST, decodes, prefix_len, _peaks(1.0, 1.0), max_chunk),
                        f"ch09_ex3: free_prefill_chunk({decodes!r}, prefix_len={prefix_len!r}, "
                        f"max_chunk={max_chunk!r}) ({what})")


# --- plausible wrong answers fail (not graded: they check the graders) -----------------------------
def _wrong_fit_ignores_weights(cost, dtype, memory_bytes, block_size, context_len):
    """All the memory for the cache, as if the weights lived elsewhere."""
    return memory_bytes // (block_size * cost.kv_bytes_per_token) // -(-context_len // block_size)


def _wrong_fit_counts_tokens(cost, dtype, memory_bytes, block_size, context_len):
    """Tokens, not whole blocks: a sequence's last, partly filled block is not paid for."""
    free = memory_bytes - cost.num_params * dtype.itemsize
    return max(0, free // (context_len * cost.kv_bytes_per_token))


def _wrong_batch_tie_is_compute_bound(cost, context_len, peaks):
    """>= instead of >: a step that ties counted compute-bound."""
    p, b = Fraction(peaks.matmul_flops_per_s), Fraction(peaks.copy_bytes_per_s)
    flops = 2 * cost.matmul_params + 2 * cost.lm_head_params + cost.attention_flops_per_pair * context_len
    gain = flops * b - cost.kv_bytes_per_token * (context_len + 1) * p
    return None if gain <= 0 else max(1, -(-cost.weight_bytes * p // gain))


def _wrong_batch_ignores_kv(cost, context_len, peaks):
    """Only the weights amortised: the K/V each sequence reads left out."""
    p, b = Fraction(peaks.matmul_flops_per_s), Fraction(peaks.copy_bytes_per_s)
    flops = 2 * cost.matmul_params + 2 * cost.lm_head_params + cost.attention_flops_per_pair * context_len
    return None if flops == 0 else int(cost.weight_bytes * p // (flops * b)) + 1


def _chunk_search(memory_bound, max_chunk, first_compute_bound=False):
    if max_chunk == 0 or not memory_bound(1):
        return 0
    lo, hi = 1, max_chunk
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if memory_bound(mid) else (lo, mid - 1)
    return min(lo + 1, max_chunk) if first_compute_bound else lo


def _wrong_chunk(no_lm_head=False, off_by_one=False, no_prefix=False):
    def free_prefill_chunk(cost, decodes, prefix_len, peaks, max_chunk):
        prefix = 0 if no_prefix else prefix_len
        head = replace_cost(cost, lm_head_params=0) if no_lm_head else cost

        def memory_bound(k):
            flops, num_bytes = _step(cost, [1] * len(decodes), list(decodes))
            chunk_flops, chunk_bytes = _step(replace_cost(head, weight_bytes=0), [k], [prefix + k])
            return ((num_bytes + chunk_bytes) * Fraction(peaks.matmul_flops_per_s)
                    >= (flops + chunk_flops) * Fraction(peaks.copy_bytes_per_s))
        return _chunk_search(memory_bound, max_chunk, off_by_one)
    return free_prefill_chunk


def replace_cost(cost, **changes):
    return ModelCost(**{**cost.__dict__, **changes})


_RIGHT_CHUNK = _wrong_chunk()  # the grader's own answer, to show the checks pass it

CH09_EX2_CHECKS = [_check_fit_random, _check_batch_random, _check_batch_known]
CH09_EX3_CHECKS = [_check_chunk_random, _check_chunk_large]
WRONG = [
    (SimpleNamespace(sequences_that_fit=_wrong_fit_ignores_weights), CH09_EX2_CHECKS[:1]),
    (SimpleNamespace(sequences_that_fit=_wrong_fit_counts_tokens), CH09_EX2_CHECKS[:1]),
    (SimpleNamespace(compute_bound_batch=_wrong_batch_tie_is_compute_bound), CH09_EX2_CHECKS[1:]),
    (SimpleNamespace(compute_bound_batch=_wrong_batch_ignores_kv), CH09_EX2_CHECKS[1:]),
    (SimpleNamespace(free_prefill_chunk=_wrong_chunk(no_lm_head=True)), CH09_EX3_CHECKS),
    (SimpleNamespace(free_prefill_chunk=_wrong_chunk(off_by_one=True)), CH09_EX3_CHECKS),
    (SimpleNamespace(free_prefill_chunk=_wrong_chunk(no_prefix=True)), CH09_EX3_CHECKS),
]
WRONG_IDS = ["fit-ignores-weights", "fit-counts-tokens", "batch-tie-compute-bound", "batch-ignores-kv",
             "chunk-no-lm-head", "chunk-first-compute-bound", "chunk-ignores-prefix"]


@pytest.mark.parametrize("wrong,checks", WRONG, ids=WRONG_IDS)
def test_ch09_ex2_ex3_wrong_answers_fail(wrong, checks):
    failures = failed_checks(checks, wrong)
    assert failures, f"a wrong answer passed every check of its exercise: {wrong}"


def test_ch09_ex3_graders_own_answer_passes():
    for check in CH09_EX3_CHECKS:
        check(SimpleNamespace(free_prefill_chunk=_RIGHT_CHUNK))
