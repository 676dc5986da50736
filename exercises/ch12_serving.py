# GENERATED from solutions/ch12_serving.py by scripts/make_exercises.py: your work goes here.
"""Chapter 12 exercises. Your answers go between the TODO lines; see the chapter notebook.

Exercise 3 (ch12_ex3) — goodput as DistServe measures it. `bench serve --goodput` counts the requests per
second that met every SLO (vLLM's `request_goodput`). DistServe (Zhong et al., OSDI 2024) asks a question
an operator cares about more: what is the highest request rate this server sustains while at least 90 %
of the requests meet their SLOs? Write `slo_attainment` (the fraction of a run's requests that meet every
SLO) and `max_goodput_rate` (the highest request rate of a sweep that keeps the attainment goal, as in
DistServe's figures); both contracts are in the docstrings. Graded on synthetic traces whose answers are
worked out by hand: `pytest -m ch12_ex3 --impl=exercises`.
"""
from minivllm.benchmarks.serve import RequestFuncOutput

SLO_METRICS = ("ttft", "tpot", "e2el")


def slo_attainment(outputs: list[RequestFuncOutput], slos_ms: dict[str, float]) -> float:
    """The fraction of `outputs` (all requests of one run, failed ones included) that meet every SLO.

    Args:
        outputs: one `RequestFuncOutput` per request sent (times in seconds).
        slos_ms: bounds in milliseconds for any of "ttft" (time to first token), "tpot" (time per output
            token after the first: `(latency - ttft) / (output_tokens - 1)`) and "e2el" (`latency`); a
            request meets a bound when its value is at most the bound. A request with one output token
            has no TPOT and meets any TPOT bound. A failed request (`success` False) meets none.
    Returns: a float in [0, 1]; 1.0 for an empty SLO dict when every request succeeded.
    Raises:
        ValueError: `outputs` is empty, or `slos_ms` names another metric or holds a negative bound.
    """
    # TODO: check the arguments; count the requests that succeeded and meet every bound
    raise NotImplementedError('ch12_serving.slo_attainment: check the arguments; count the requests that succeeded and meet every bound')


def max_goodput_rate(runs: dict[float, list[RequestFuncOutput]], slos_ms: dict[str, float],
                     attainment: float = 0.9) -> float | None:
    """DistServe's goodput: the highest request rate of a sweep at which the SLO attainment goal holds.

    Args:
        runs: request rate (requests per second) -> the outputs of the run at that rate.
        slos_ms: the SLOs, as `slo_attainment` reads them. attainment: the goal, in (0, 1].
    Returns: the highest rate whose run, and the run of every lower rate, meet the goal
        (`slo_attainment >= attainment`): a rate above one that misses it does not count, since latency
        only grows with load and a pass there is noise. None when the lowest rate misses it already.
    Raises:
        ValueError: `runs` is empty, `attainment` is outside (0, 1], or as `slo_attainment`.
    """
    # TODO: walk the rates upwards; stop at the first that misses the goal
    raise NotImplementedError('ch12_serving.max_goodput_rate: walk the rates upwards; stop at the first that misses the goal')
