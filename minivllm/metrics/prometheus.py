"""The server's `/metrics`: a stat logger that keeps vLLM's Prometheus metrics in one registry (after vLLM
V1's `PrometheusStatLogger` in `vllm/v1/metrics/loggers.py`). Same names, same `model_name` label, same
histogram bucket edges, so vLLM's dashboards and `bench serve` read minivllm's server as they read vLLM's."""
from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .stats import IterationStats, SchedulerStats, StatLoggerBase

# vLLM's bucket edges, seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values, each a labelled series from 0


def make_metrics(registry: CollectorRegistry) -> SimpleNamespace:
    """vLLM's metric objects, each with the label `model_name` (`request_success` also `finished_reason`),
    registered in `registry`: gauges, counters (exposed as `<name>_total`) and histograms (seconds)."""
    labels = dict(labelnames=["model_name"], registry=registry)
    return SimpleNamespace(
        running=Gauge("vllm:num_requests_running", "Requests in the running queue.", **labels),
        waiting=Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", **labels),
        kv_usage=Gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 means 100 percent).", **labels),
        prompt=Counter("vllm:prompt_tokens", "Prefill tokens processed.", **labels),
        generation=Counter("vllm:generation_tokens", "Generation tokens processed.", **labels),
        preemptions=Counter("vllm:num_preemptions", "Cumulative preemptions.", **labels),
        queries=Counter("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.", **labels),
        hits=Counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.", **labels),
        ttft=Histogram("vllm:time_to_first_token_seconds", "Time to first token (s).", buckets=TTFT_BUCKETS,
                       **labels),
        itl=Histogram("vllm:inter_token_latency_seconds", "Inter-token latency (s).", buckets=ITL_BUCKETS,
                      **labels),
        e2e=Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency (s).",
                      buckets=REQUEST_LATENCY_BUCKETS, **labels),
        success=Counter("vllm:request_success", "Finished requests.", labelnames=["model_name", "finished_reason"],
                        registry=registry))


class PrometheusStatLogger(StatLoggerBase):
    """vLLM's metrics for one served model, kept in `registry` (give each app its own registry: two apps in
    one process would otherwise clash on the metric names).

    Gauges: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (a
    fraction in [0, 1], as vLLM). Counters (exposed with a `_total` suffix): `vllm:prompt_tokens`,
    `vllm:generation_tokens`, `vllm:request_success` (label `finished_reason`: stop, length, abort),
    `vllm:num_preemptions`, `vllm:prefix_cache_queries`, `vllm:prefix_cache_hits` (tokens). Histograms
    (seconds): `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
    `vllm:e2e_request_latency_seconds`. Every series has the label `model_name`, and exists (at 0) from
    the start. Source: vLLM V1's `PrometheusStatLogger` (vllm/v1/metrics/loggers.py).
    """

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.registry, self.model_name, self.metrics = registry, model_name, make_metrics(registry)
        self.num_preemptions_seen = 0  # SchedulerStats.num_preemptions is the engine core's running total
        for name, metric in vars(self.metrics).items():
            if name != "success":
                metric.labels(model_name)
        for reason in FINISHED_REASONS:
            self.metrics.success.labels(model_name, reason)

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        """Set the gauges from `scheduler_stats` and add `iteration_stats` to the counters and histograms
        (either may be None: nothing of it is recorded)."""
        if scheduler_stats is not None:
            self.record_scheduler(scheduler_stats)
        if iteration_stats is not None:
            self.record_iteration(iteration_stats)

    def record_scheduler(self, s: SchedulerStats) -> None:
        """Gauges are set; the preemption counter grows by what the engine core's total grew since last time."""
        name, m = self.model_name, self.metrics
        m.running.labels(name).set(s.num_running)
        m.waiting.labels(name).set(s.num_waiting)
        m.kv_usage.labels(name).set(s.kv_cache_usage)
        if s.num_preemptions > self.num_preemptions_seen:
            m.preemptions.labels(name).inc(s.num_preemptions - self.num_preemptions_seen)
        self.num_preemptions_seen = max(self.num_preemptions_seen, s.num_preemptions)
        m.queries.labels(name).inc(s.prefix_cache_queries)
        m.hits.labels(name).inc(s.prefix_cache_hits)

    def record_iteration(self, it: IterationStats) -> None:
        """Token counters, one TTFT / ITL observation per value, and each finished request's reason and
        end-to-end latency."""
        name, m = self.model_name, self.metrics
        m.prompt.labels(name).inc(it.num_prompt_tokens)
        m.generation.labels(name).inc(it.num_generation_tokens)
        for ttft in it.time_to_first_token:
            m.ttft.labels(name).observe(ttft)
        for itl in it.inter_token_latency:
            m.itl.labels(name).observe(itl)
        for finished in it.finished_requests:
            m.success.labels(name, finished.finish_reason).inc()
            m.e2e.labels(name).observe(finished.e2e_latency)
