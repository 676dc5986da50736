"""`python -m minivllm bench serve`: measure a running OpenAI-compatible server from the outside, as a user
sees it (chapter 12; after vLLM's `vllm/benchmarks/serve.py`).

A seeded random workload (`sample_random_requests`) is sent to `/v1/completions` at a chosen request rate
(`get_request`: gamma-distributed gaps; burstiness 1 is a Poisson process), each request streamed
(`async_request_openai_completions` times every token as it arrives), and the timings are summed up
(`calculate_metrics`): time to first token (TTFT), time per output token (TPOT), inter-token latency
(ITL), end-to-end latency (E2EL), throughput and goodput. `benchmark` drives it all; `format_result`
prints vLLM's table.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # httpx comes with the `serve` extra (openai): imported where a request is sent
    import httpx

MILLISECONDS_TO_SECONDS_CONVERSION = 1000
METRICS = ("ttft", "tpot", "itl", "e2el")  # what --percentile-metrics may name
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # what --goodput may bound (milliseconds)
METRIC_HEADERS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                  "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
MAX_PROMPT_RETRIES = 10  # decode/re-encode rounds to hit a prompt's target length
REQUEST_TIMEOUT_S = 6 * 60 * 60  # vLLM's AIOHTTP_TIMEOUT: a request on a loaded server may wait long


@dataclass
class SampleRequest:
    """One benchmark request (vLLM's `SampleRequest`).

    Attributes:
        prompt: the prompt text (or token ids).
        prompt_len: its length in tokens (the model's tokenizer, no special tokens added).
        expected_output_len: tokens to generate (`max_tokens`).
    """

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


def _length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive `[length * (1 - ratio), length * (1 + ratio)]`, at least 1 (tokens)."""
    return max(1, math.floor(length * (1 - range_ratio))), max(1, math.ceil(length * (1 + range_ratio)))


def _prompt_of_length(tokenizer, token_ids: list[int], rng: np.random.Generator,
                      allowed: np.ndarray) -> tuple[str, int]:
    """Decode `token_ids` to text whose re-encoding has (close to) their length: decoding then encoding
    may merge or split tokens, so trim or top up and try again (vLLM's `gen_prompt_decode_to_target_len`).
    Returns (text, its length in tokens)."""
    target = len(token_ids)
    for _ in range(MAX_PROMPT_RETRIES):
        text = tokenizer.decode(token_ids)
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        if len(token_ids) == target:
            break
        token_ids = token_ids[:target] + rng.choice(allowed, max(0, target - len(token_ids))).tolist()
    text = tokenizer.decode(token_ids)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def sample_random_requests(tokenizer, num_requests: int, input_len: int, output_len: int,
                           range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """vLLM's `random` dataset: prompts of random token ids (no special tokens) decoded into text, lengths
    uniform in `[len * (1 - range_ratio), len * (1 + range_ratio)]`, seeded.

    Args:
        tokenizer: the model's tokenizer (`transformers.AutoTokenizer`): `decode`, `encode`, `vocab_size`.
        num_requests: >= 1. input_len, output_len: mean lengths (tokens), >= 1.
        range_ratio: in [0, 1). seed: the generator's seed.
    Raises:
        ValueError: a count, length or ratio out of range.
    """
    if num_requests < 1 or input_len < 1 or output_len < 1:
        raise ValueError(f"num_requests, input_len and output_len must be >= 1, got {num_requests}, "
                         f"{input_len}, {output_len}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(tokenizer.vocab_size), list(tokenizer.all_special_ids))
    in_lo, in_hi = _length_range(input_len, range_ratio)
    out_lo, out_hi = _length_range(output_len, range_ratio)
    requests = []
    for _ in range(num_requests):
        ids = rng.choice(allowed, int(rng.integers(in_lo, in_hi + 1))).tolist()
        prompt, prompt_len = _prompt_of_length(tokenizer, ids, rng, allowed)
        requests.append(SampleRequest(prompt, prompt_len, int(rng.integers(out_lo, out_hi + 1))))
    return requests


def request_intervals(num_requests: int, request_rate: float, burstiness: float = 1.0,
                      seed: int = 0) -> list[float]:
    """The `num_requests - 1` gaps (seconds) between arrivals: gamma-distributed with shape `burstiness`
    and mean `1 / request_rate`, so their coefficient of variation is `1 / sqrt(burstiness)`
    (burstiness 1: exponential gaps, a Poisson process; larger: more regular; smaller: burstier).
    `request_rate = inf`: all at once (zeros). From vLLM's `get_request`.

    Raises:
        ValueError: request_rate or burstiness not > 0.
    """
    if not request_rate > 0 or not burstiness > 0:
        raise ValueError(f"request_rate and burstiness must be > 0, got {request_rate} and {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * max(0, num_requests - 1)
    theta = 1.0 / (request_rate * burstiness)  # the gamma's scale: mean = shape * scale = 1 / rate
    return np.random.default_rng(seed).gamma(shape=burstiness, scale=theta, size=max(0, num_requests - 1)).tolist()


async def get_request(requests: list[SampleRequest], request_rate: float, burstiness: float = 1.0,
                      seed: int = 0,
                      sleep: Callable[[float], Awaitable] = asyncio.sleep) -> AsyncIterator[SampleRequest]:
    """Yield `requests` in order, the first at once, then each after its gap from `request_intervals`
    (seconds; `sleep` waits it out: a test passes a fake clock). Raises ValueError as `request_intervals`."""
    intervals = request_intervals(len(requests), request_rate, burstiness, seed)
    for i, request in enumerate(requests):
        yield request
        if i < len(intervals) and intervals[i] > 0:
            await sleep(intervals[i])


@dataclass
class RequestFuncOutput:
    """What one streamed request measured (vLLM's `RequestFuncOutput`); times in seconds.

    Attributes:
        success: the server streamed at least one token of text; error: why not (else "").
        generated_text: the text streamed. output_tokens: tokens generated (the server's usage count).
        prompt_len: the prompt's tokens. start_time: `time.perf_counter()` when the request was sent.
        ttft: time to the first chunk carrying text. latency: time to the last one.
        itl: the gaps between tokens after the first: a chunk carrying n tokens adds n gaps, each
            1/n of the time since the previous chunk.
    """

    success: bool = False
    error: str = ""
    generated_text: str = ""
    output_tokens: int = 0
    prompt_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0


def parse_sse_line(line: str) -> dict | None:
    """One line of a server-sent-events stream -> the JSON object of its `data:` field, or None for a blank
    line, a comment, another field or the closing `data: [DONE]`. Raises ValueError for bad JSON."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line.removeprefix("data:").strip()
    return None if data == "[DONE]" else json.loads(data)


def record_chunk(output: RequestFuncOutput, timestamp: float, text: str, num_tokens: int) -> None:
    """Time one streamed chunk carrying `text`, `num_tokens` >= 1 tokens, arriving at `timestamp`
    (`perf_counter` seconds). A chunk without text (the role chunk, an empty delta) times nothing: TTFT
    is the first *text* (vllm#3759). Later chunks add `num_tokens` equal gaps to ITL, so a chunk carrying
    several tokens counts per token, not per chunk (vllm#27485). `latency` tracks the last chunk."""
    if not text:
        return
    elapsed = timestamp - output.start_time
    if not output.generated_text:
        output.ttft = elapsed
    else:
        gap = elapsed - output.latency
        output.itl.extend([gap / num_tokens] * num_tokens)
    output.latency = elapsed
    output.generated_text += text


def completions_payload(model: str, request: SampleRequest, ignore_eos: bool) -> dict:
    """The body of a streamed `/v1/completions` request: usage in the last chunk, greedy, `max_tokens`."""
    return {"model": model, "prompt": request.prompt, "max_tokens": request.expected_output_len,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos}


def _chunk_tokens(data: dict, text: str, tokens_seen: int, tokenizer) -> int:
    """How many tokens a chunk carries: the growth of its usage count where the server sends one per chunk
    (vLLM's `continuous_usage_stats`), else the chunk's text re-tokenized, else 1 (at least 1)."""
    usage = data.get("usage") or {}
    if usage.get("completion_tokens") is not None:
        return max(1, usage["completion_tokens"] - tokens_seen)
    if tokenizer is not None and text:
        return max(1, len(tokenizer.encode(text, add_special_tokens=False)))
    return 1


async def _read_stream(response: httpx.Response, output: RequestFuncOutput, tokenizer) -> int | None:
    """Read a streamed completion into `output`; returns the usage chunk's completion_tokens (None: none came)."""
    tokens_seen, usage_tokens = 0, None
    async for line in response.aiter_lines():
        data = parse_sse_line(line)
        if data is None:
            continue
        if "error" in data:
            raise ValueError(f"the server streamed an error: {data['error']}")
        if choices := data.get("choices"):
            text = choices[0].get("text") or ""
            n = _chunk_tokens(data, text, tokens_seen, tokenizer) if text else 0
            record_chunk(output, time.perf_counter(), text, n)
            tokens_seen += n
        elif (data.get("usage") or {}).get("completion_tokens") is not None:
            usage_tokens = data["usage"]["completion_tokens"]
    return usage_tokens if usage_tokens is not None else tokens_seen


async def async_request_openai_completions(client: httpx.AsyncClient, api_url: str, model: str,
                                           request: SampleRequest, ignore_eos: bool = True,
                                           tokenizer=None) -> RequestFuncOutput:
    """Send one streamed `/v1/completions` request and time its tokens (vLLM's function of this name).

    Args:
        client: an `httpx.AsyncClient`. api_url: the endpoint's full URL. model: the served model name.
        request: the prompt and `max_tokens`. ignore_eos: generate all `max_tokens` tokens.
        tokenizer: counts a chunk's tokens when the server gives no count per chunk (None: 1 per chunk).
    Returns:
        A `RequestFuncOutput`; a failure (HTTP error, broken stream, no text) is recorded in `success`
        and `error`, never raised, so that one bad request does not end a benchmark (as vLLM).
    """
    import httpx

    output = RequestFuncOutput(prompt_len=request.prompt_len)
    output.start_time = time.perf_counter()
    try:
        async with client.stream("POST", api_url, json=completions_payload(model, request, ignore_eos)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                output.error = f"HTTP {response.status_code}: {body[:500]}"
                return output
            output.output_tokens = await _read_stream(response, output, tokenizer)
    except (httpx.HTTPError, ValueError) as e:  # ValueError: bad JSON or an error event
        output.error = f"{type(e).__name__}: {e}"
        return output
    output.success = bool(output.generated_text)
    if not output.success:
        output.error = "Never received a chunk with text to calculate TTFT."
    return output


@dataclass
class BenchmarkMetrics:
    """A benchmark's summary (vLLM's `BenchmarkMetrics`): counts of requests and tokens, rates per second,
    and for TTFT, TPOT, ITL and E2EL the mean, median, standard deviation and chosen percentiles in
    milliseconds (`percentiles_*_ms`: (percentile, value) pairs)."""

    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    percentiles_ttft_ms: list[tuple[float, float]]
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    percentiles_tpot_ms: list[tuple[float, float]]
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    percentiles_itl_ms: list[tuple[float, float]]
    mean_e2el_ms: float
    median_e2el_ms: float
    std_e2el_ms: float
    percentiles_e2el_ms: list[tuple[float, float]]


def _summary_ms(name: str, values_s: list[float], percentiles: list[float]) -> dict:
    """`mean_/median_/std_/percentiles_{name}_ms` of `values_s` (seconds) in milliseconds (0 when empty)."""
    ms = np.asarray(values_s or [0.0], dtype=float) * MILLISECONDS_TO_SECONDS_CONVERSION
    return {f"mean_{name}_ms": float(np.mean(ms)), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(np.std(ms)),
            f"percentiles_{name}_ms": [(p, float(np.percentile(ms, p))) for p in percentiles]}


def request_goodput(outputs: list[RequestFuncOutput], tpots: list[float], goodput_config_dict: dict[str, float],
                    dur_s: float) -> float:
    """Successful requests per second that met every service-level objective in `goodput_config_dict`
    (`ttft`, `tpot`, `e2el`, in milliseconds; TPOT per request; `tpots[i]` belongs to the i-th successful
    output) (vLLM's goodput, from DistServe: Zhong et al., OSDI 2024)."""
    ok = [o for o in outputs if o.success]
    measured = {"ttft": [o.ttft for o in ok], "tpot": tpots, "e2el": [o.latency for o in ok]}
    slos = {k: v / MILLISECONDS_TO_SECONDS_CONVERSION for k, v in goodput_config_dict.items()}
    good = sum(all(measured[k][i] <= slo for k, slo in slos.items()) for i in range(len(ok)))
    return good / dur_s


def calculate_metrics(input_requests: list[SampleRequest], outputs: list[RequestFuncOutput], dur_s: float,
                      selected_percentiles: list[float],
                      goodput_config_dict: dict[str, float] | None = None) -> tuple[BenchmarkMetrics, list[int]]:
    """Sum up a benchmark (vLLM's `calculate_metrics`). Failed requests count only in `failed`.

    TPOT = (latency - TTFT) / (output tokens - 1), for requests with more than one token (the others have
    no second token: 0 for goodput); ITL pools every request's per-token gaps; E2EL is the latency.

    Args:
        input_requests, outputs: the requests and their results, in the same order.
        dur_s: the benchmark's wall time (seconds). selected_percentiles: e.g. [50, 99].
        goodput_config_dict: SLOs in milliseconds (None or {}: goodput not measured, 0).
    Returns:
        (`BenchmarkMetrics`, output tokens per request: 0 for a failed one).
    Raises:
        ValueError: lists of different lengths or `dur_s` not > 0.
    """
    if len(input_requests) != len(outputs) or not dur_s > 0:
        raise ValueError(f"need one output per request ({len(input_requests)} vs {len(outputs)}) and dur_s > 0 "
                         f"(got {dur_s})")
    ok = [(r, o) for r, o in zip(input_requests, outputs) if o.success]
    output_lens = [o.output_tokens if o.success else 0 for o in outputs]
    all_tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0 for _, o in ok]
    total_input, total_output = sum(r.prompt_len for r, _ in ok), sum(output_lens)
    goodput = request_goodput(outputs, all_tpots, goodput_config_dict, dur_s) if goodput_config_dict else 0.0
    return BenchmarkMetrics(
        completed=len(ok), failed=len(outputs) - len(ok), total_input=total_input, total_output=total_output,
        request_throughput=len(ok) / dur_s, request_goodput=goodput, output_throughput=total_output / dur_s,
        total_token_throughput=(total_input + total_output) / dur_s,
        **_summary_ms("ttft", [o.ttft for _, o in ok], selected_percentiles),
        **_summary_ms("tpot", [t for t, (_, o) in zip(all_tpots, ok) if o.output_tokens > 1], selected_percentiles),
        **_summary_ms("itl", [g for _, o in ok for g in o.itl], selected_percentiles),
        **_summary_ms("e2el", [o.latency for _, o in ok], selected_percentiles)), output_lens


def parse_goodput(slo_pairs: Iterable[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> `{"ttft": 500.0, "tpot": 50.0}` (milliseconds; vLLM's `--goodput`).

    Raises:
        ValueError: not NAME:VALUE, a name other than ttft, tpot, e2el, or a negative value.
    """
    slos = {}
    for pair in slo_pairs:
        name, _, text = pair.partition(":")
        try:
            value = float(text)
        except ValueError:
            value = None
        if name not in GOODPUT_METRICS or value is None or not value >= 0:
            raise ValueError(f"--goodput: {pair!r} is not NAME:MILLISECONDS with NAME one of "
                             f"{', '.join(GOODPUT_METRICS)} and a value >= 0")
        slos[name] = value
    return slos


async def run_requests(client: httpx.AsyncClient, api_url: str, model: str, input_requests: list[SampleRequest],
                       request_rate: float, burstiness: float, max_concurrency: int | None, ignore_eos: bool,
                       tokenizer=None, seed: int = 0, pbar=None) -> list[RequestFuncOutput]:
    """Send `input_requests` as `get_request` paces them, at most `max_concurrency` in flight (a semaphore;
    None: no limit), each on its own task; returns their outputs in the requests' order."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(request: SampleRequest) -> RequestFuncOutput:
        async with semaphore or contextlib.nullcontext():
            out = await async_request_openai_completions(client, api_url, model, request, ignore_eos, tokenizer)
        if pbar is not None:
            pbar.update(1)
        return out

    tasks = [asyncio.create_task(one(r)) async for r in get_request(input_requests, request_rate, burstiness, seed)]
    return list(await asyncio.gather(*tasks))


def benchmark_result(input_requests: list[SampleRequest], outputs: list[RequestFuncOutput], dur_s: float,
                     selected_percentiles: list[float], goodput_config_dict: dict[str, float] | None) -> dict:
    """The result record (vLLM's keys): `duration` (seconds), counts, throughputs (per second), for each
    metric `mean_/median_/std_/p<percentile>_<metric>_ms`, and per request `input_lens`, `output_lens`,
    `ttfts`, `itls` (seconds), `generated_texts`, `errors`."""
    metrics, output_lens = calculate_metrics(input_requests, outputs, dur_s, selected_percentiles,
                                             goodput_config_dict)
    result = {"duration": dur_s, "completed": metrics.completed, "failed": metrics.failed,
              "total_input_tokens": metrics.total_input, "total_output_tokens": metrics.total_output,
              "request_throughput": metrics.request_throughput,
              "request_goodput": metrics.request_goodput if goodput_config_dict else None,
              "output_throughput": metrics.output_throughput,
              "total_token_throughput": metrics.total_token_throughput}
    for name in METRICS:
        for stat in ("mean", "median", "std"):
            result[f"{stat}_{name}_ms"] = getattr(metrics, f"{stat}_{name}_ms")
        for p, value in getattr(metrics, f"percentiles_{name}_ms"):
            result[f"p{int(p) if int(p) == p else p}_{name}_ms"] = value
    return result | {"input_lens": [o.prompt_len for o in outputs], "output_lens": output_lens,
                     "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
                     "generated_texts": [o.generated_text for o in outputs], "errors": [o.error for o in outputs]}


async def benchmark(api_url: str, model: str, input_requests: list[SampleRequest], request_rate: float = float("inf"),
                    burstiness: float = 1.0, max_concurrency: int | None = None,
                    selected_percentiles: list[float] = (99,), goodput_config_dict: dict[str, float] | None = None,
                    ignore_eos: bool = True, tokenizer=None, seed: int = 0, disable_tqdm: bool = False) -> dict:
    """Benchmark a server (vLLM's `benchmark`): one test request first (it must succeed: a wrong URL or
    model name fails fast, and the server warms up), then every request of `input_requests` paced by
    `get_request` (`request_rate` per second, inf: all at once; `burstiness`), at most `max_concurrency`
    at once, timed with a tqdm bar. Returns `benchmark_result`'s record.

    Raises:
        ValueError: the test request failed (with the server's error), or bad rate/burstiness/concurrency.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    request_intervals(1, request_rate, burstiness)  # checks them before any request is sent
    import httpx
    from tqdm.asyncio import tqdm

    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        test = await async_request_openai_completions(client, api_url, model, input_requests[0], ignore_eos)
        if not test.success:
            raise ValueError(f"the initial test request to {api_url} (model {model!r}) failed: {test.error}")
        pbar = None if disable_tqdm else tqdm(total=len(input_requests))
        start = time.perf_counter()
        outputs = await run_requests(client, api_url, model, input_requests, request_rate, burstiness,
                                     max_concurrency, ignore_eos, tokenizer, seed, pbar)
        dur_s = time.perf_counter() - start
        if pbar is not None:
            pbar.close()
    return benchmark_result(input_requests, outputs, dur_s, list(selected_percentiles), goodput_config_dict)


def format_result(result: dict, selected_percentile_metrics: list[str], selected_percentiles: list[float],
                  request_rate: float = float("inf"), max_concurrency: int | None = None) -> str:
    """vLLM's "Serving Benchmark Result" table of a `benchmark` record: counts, throughputs, and for each
    selected metric its mean, median and percentiles (milliseconds)."""
    row = lambda label, value, fmt="": f"{label:<40} {value:<10{fmt}}"  # noqa: E731
    lines = [f"{' Serving Benchmark Result ':=^50}", row("Successful requests:", result["completed"]),
             row("Failed requests:", result["failed"])]
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    if not math.isinf(request_rate):
        lines.append(row("Request rate configured (RPS):", request_rate, ".2f"))
    lines += [row("Benchmark duration (s):", result["duration"], ".2f"),
              row("Total input tokens:", result["total_input_tokens"]),
              row("Total generated tokens:", result["total_output_tokens"]),
              row("Request throughput (req/s):", result["request_throughput"], ".2f")]
    if result.get("request_goodput") is not None:
        lines.append(row("Request goodput (req/s):", result["request_goodput"], ".2f"))
    lines += [row("Output token throughput (tok/s):", result["output_throughput"], ".2f"),
              row("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f")]
    for name in (m for m in METRICS if m in selected_percentile_metrics):
        upper = name.upper()
        lines += [f"{METRIC_HEADERS[name]:-^50}", row(f"Mean {upper} (ms):", result[f"mean_{name}_ms"], ".2f"),
                  row(f"Median {upper} (ms):", result[f"median_{name}_ms"], ".2f")]
        for p in selected_percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            lines.append(row(f"P{word} {upper} (ms):", result[f"p{word}_{name}_ms"], ".2f"))
    return "\n".join([*lines, "=" * 50])
