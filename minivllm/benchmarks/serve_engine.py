"""Benchmark an `AsyncLLM` inside this process, without HTTP: what the serving layer's own choices cost
(chapter 12). The same workload and metrics as `bench serve` (`benchmarks.serve`), plus the event loop's
lag: how late a heartbeat task wakes while the engine works. With the engine core stepped by a thread of
this process (`multiprocess=False`) every step holds the GIL for a while and the loop waits; with the
engine core in its own process the loop only moves outputs. After vLLM's `vllm/benchmarks/serve.py`."""
from __future__ import annotations

import asyncio
import time

import numpy as np

from .serve import RequestFuncOutput, SampleRequest, benchmark_result, get_request, record_chunk
from ..engine.async_llm import AsyncLLM
from ..sampling_params import RequestOutputKind, SamplingParams


async def heartbeat(interval: float, lags: list[float], stop: asyncio.Event) -> None:
    """Sleep `interval` seconds again and again until `stop` is set; append how late each wake-up was
    (seconds) to `lags`: the event loop's lag, the time a ready callback waited for the loop."""
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(interval)
        lags.append(max(0.0, time.perf_counter() - start - interval))


async def engine_request(engine: AsyncLLM, request: SampleRequest, request_id: str,
                         ignore_eos: bool = True) -> RequestFuncOutput:
    """Stream one request through `engine.generate` (greedy, `expected_output_len` tokens) and time its
    tokens as `bench serve` times a server's chunks (`record_chunk`: TTFT, ITL per token, latency)."""
    params = SamplingParams(temperature=0.0, max_tokens=request.expected_output_len, ignore_eos=ignore_eos,
                            output_kind=RequestOutputKind.DELTA)
    out = RequestFuncOutput(prompt_len=request.prompt_len, start_time=time.perf_counter())
    try:
        async for delta in engine.generate(request.prompt, params, request_id):
            c = delta.outputs[0]
            record_chunk(out, time.perf_counter(), c.text or " " * bool(c.token_ids), len(c.token_ids))
            out.output_tokens += len(c.token_ids)
        out.success = True
    except Exception as e:  # noqa: BLE001 -- recorded, as bench serve records a failed request
        out.error = f"{type(e).__name__}: {e}"
    return out


async def benchmark_engine(engine: AsyncLLM, requests: list[SampleRequest], request_rate: float = float("inf"),
                           burstiness: float = 1.0, seed: int = 0, heartbeat_s: float = 0.005,
                           selected_percentiles: list[float] = (50, 99)) -> dict:
    """Send `requests` to `engine` paced by `get_request`, each streamed on its own task, while a heartbeat
    measures the event loop's lag. Returns `benchmark_result`'s record plus `event_loop_lags` (seconds) and
    `p50_event_loop_lag_ms`, `p99_event_loop_lag_ms`."""
    lags, stop = [], asyncio.Event()
    beat = asyncio.create_task(heartbeat(heartbeat_s, lags, stop))
    start = time.perf_counter()
    tasks = [asyncio.create_task(engine_request(engine, r, f"bench-{i}"))
             async for i, r in _numbered(get_request(requests, request_rate, burstiness, seed))]
    outputs = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    stop.set()
    await beat
    result = benchmark_result(requests, list(outputs), duration, list(selected_percentiles), None)
    return result | {"event_loop_lags": lags, "p50_event_loop_lag_ms": 1000 * float(np.percentile(lags, 50)),
                     "p99_event_loop_lag_ms": 1000 * float(np.percentile(lags, 99))}


async def _numbered(requests):
    i = 0
    async for r in requests:
        yield i, r
        i += 1
