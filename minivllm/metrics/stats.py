"""What the serving layer measures: the scheduler's state after a step, and what each batch of outputs
did to the requests (after vLLM V1's `vllm/v1/metrics/stats.py`). Times are seconds, taken in the front
end when outputs arrive (`time.monotonic()`), so they include the trip from the engine core."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    """The engine core's state after one step (sent with that step's outputs).

    Attributes:
        num_running: sequences in `running`. num_waiting: sequences in `waiting`.
        kv_cache_usage: fraction of the KV cache's blocks in use, in [0, 1].
        num_preemptions: preemptions over the engine core's life (a counter; the logger adds increments).
        prefix_cache_queries: prompt tokens looked up in the prefix cache by this step's first admissions.
        prefix_cache_hits: of those, tokens found cached.
        num_steps: steps the engine core has run (a counter).
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_steps: int = 0


@dataclass
class FinishedRequestStats:
    """One finished request (each of its `n` completions counts as one, as in vLLM).

    Attributes: finish_reason ("stop", "length", "abort"), e2e_latency (arrival to last output, s),
        num_prompt_tokens, num_generation_tokens, time_to_first_token (s, None if no token came).
    """

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    time_to_first_token: float | None = None


@dataclass
class IterationStats:
    """What one batch of engine-core outputs did (vLLM V1's `IterationStats`).

    Attributes:
        num_prompt_tokens: prompt tokens of requests that got their first token in this batch.
        num_generation_tokens: tokens generated in this batch.
        time_to_first_token: one TTFT (s) per request that got its first token.
        inter_token_latency: one ITL (s) per token after a request's first (a batch that brings k tokens of
            one request adds k values of (gap / k): vllm-project/vllm#27485).
        finished_requests: a `FinishedRequestStats` per request that finished.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


class StatLoggerBase:
    """Receives each batch's stats (vLLM V1's `StatLoggerBase`): subclasses override `record`."""

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        raise NotImplementedError
