"""Grading tests for chapter 12's extend exercise (`pytest -m ch12_ex3 --impl=exercises`); see test_grading.py.

`slo_attainment` and `max_goodput_rate` (goodput as DistServe measures it) are graded on synthetic traces
whose answers are worked out by hand, never by comparison with minivllm's code: which requests meet which
bounds (TTFT, TPOT per request, E2EL; bounds inclusive; one-token requests and failed ones), the errors
for bad arguments, and the highest rate of a sweep that keeps the attainment goal (a pass above a miss
does not count; None when the lowest rate misses).
"""
from __future__ import annotations

import pytest

from adapters import load
from minivllm.benchmarks.serve import RequestFuncOutput


@pytest.fixture(scope="module")
def ch12(impl_name):
    return load("ch12_serving", impl_name)


def req(ttft_ms: float, latency_ms: float, tokens: int, success: bool = True) -> RequestFuncOutput:
    return RequestFuncOutput(success=success, output_tokens=tokens, ttft=ttft_ms / 1000, latency=latency_ms / 1000)


# TTFT 100 ms, TPOT (900 - 100) / 9 = 88.9 ms, E2EL 900 ms
A = req(100, 900, 10)
# TTFT 300 ms, TPOT (500 - 300) / 4 = 50 ms, E2EL 500 ms
B = req(300, 500, 5)
# one token: no TPOT; TTFT = E2EL = 50 ms
C = req(50, 50, 1)
FAILED = req(10, 20, 3, success=False)


@pytest.mark.ch12
@pytest.mark.ch12_ex3
@pytest.mark.parametrize("slos, want", [
    ({}, 3 / 4),                                   # no bound: every request that succeeded
    ({"ttft": 100}, 2 / 4),                        # A (100 <= 100: inclusive) and C
    ({"ttft": 99.9}, 1 / 4),                       # C only
    ({"tpot": 50}, 2 / 4),                         # B (exactly 50) and C (one token: no TPOT)
    ({"tpot": 89}, 3 / 4),
    ({"e2el": 500, "ttft": 299}, 1 / 4),           # B misses TTFT, A misses E2EL: C
    ({"ttft": 1000, "tpot": 1000, "e2el": 1000}, 3 / 4),
])
def test_ex3_slo_attainment(ch12, slos, want):
    got = ch12.slo_attainment([A, B, C, FAILED], slos)
    assert got == pytest.approx(want), f"ch12_ex3: attainment {got} for SLOs {slos}, want {want}"


@pytest.mark.ch12
@pytest.mark.ch12_ex3
@pytest.mark.parametrize("args, what", [(([], {"ttft": 1}), "empty"), (([A], {"ttft": -1}), "ttft"),
                                        (([A], {"itl": 10}), "itl")])
def test_ex3_slo_attainment_refuses_bad_arguments(ch12, args, what):
    with pytest.raises(ValueError, match=what if what != "empty" else None):
        ch12.slo_attainment(*args)


@pytest.mark.ch12
@pytest.mark.ch12_ex3
def test_ex3_max_goodput_rate(ch12):
    slo = {"ttft": 200, "tpot": 60}
    good, bad = req(100, 300, 5), req(400, 900, 5)  # TPOT 50 ms; TTFT 400 ms misses
    runs = {1.0: [good] * 10, 2.0: [good] * 9 + [bad], 4.0: [good] * 8 + [bad] * 2, 8.0: [good] * 10}
    assert ch12.max_goodput_rate(runs, slo) == 2.0, "ch12_ex3: 90 % holds at 1 and 2 req/s; 4 req/s misses it " \
        "(80 %), so the pass at 8 req/s does not count"
    assert ch12.max_goodput_rate(runs, slo, attainment=0.8) == 8.0
    assert ch12.max_goodput_rate(runs, slo, attainment=1.0) == 1.0
    assert ch12.max_goodput_rate({0.5: [bad, good], 1.0: [good]}, slo) is None, \
        "ch12_ex3: None when the lowest rate misses the goal"
    assert ch12.max_goodput_rate({3.0: [good], 1.5: [good], 6.0: [bad]}, slo) == 3.0, "ch12_ex3: rates in any order"
    with pytest.raises(ValueError):
        ch12.max_goodput_rate({}, slo)
    with pytest.raises(ValueError):
        ch12.max_goodput_rate(runs, slo, attainment=0.0)
    with pytest.raises(ValueError):
        ch12.max_goodput_rate(runs, slo, attainment=1.5)
