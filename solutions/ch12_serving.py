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
    ### BEGIN SOLUTION
    if not outputs:
        raise ValueError("no requests: the attainment of an empty run is not defined")
    for name, bound in slos_ms.items():
        if name not in SLO_METRICS:
            raise ValueError(f"unknown SLO metric {name!r}; use {', '.join(SLO_METRICS)}")
        if not bound >= 0:
            raise ValueError(f"the {name} SLO must be >= 0 ms, got {bound}")

    def meets(o: RequestFuncOutput) -> bool:
        if not o.success:
            return False
        values = {"ttft": o.ttft, "e2el": o.latency,
                  "tpot": (o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0}
        return all(values[name] * 1000 <= bound for name, bound in slos_ms.items())

    return sum(map(meets, outputs)) / len(outputs)
    ### END SOLUTION


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
    ### BEGIN SOLUTION
    if not runs:
        raise ValueError("no runs: a sweep needs at least one request rate")
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment must be in (0, 1], got {attainment}")
    best = None
    for rate in sorted(runs):
        if slo_attainment(runs[rate], slos_ms) < attainment:
            break
        best = rate
    return best
    ### END SOLUTION
