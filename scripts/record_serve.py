"""Record chapter 12's serving measurements into results/ (one JSON per part), each comparison side by side
in one run on the default model (SmolLM2-135M-Instruct, float32, this machine's CPU):

    python scripts/record_serve.py                 # all three parts
    python scripts/record_serve.py --part split    # one part: served | split | itl

* served: output throughput of `python -m minivllm serve` (engine core in its own process) measured by
  `bench serve` at rate inf, against offline `LLM.generate` on the same requests (same prompts, same
  output lengths, ignore_eos) -> results/cpu_serve_vs_offline.json;
* split: 64 streaming requests through `AsyncLLM` with the engine core in this process (stepped by a
  thread) and in its own process: the event loop's lag (a 5 ms heartbeat) and the ITL
  -> results/cpu_serve_split.json;
* itl: requests of mixed lengths arriving at a fixed rate (Poisson), chapter 11's token budget
  (the default assembly) against chapter 04's prefill-first scheduler: TTFT and ITL percentiles
  -> results/cpu_serve_itl_chunked_vs_prefill_first.json.
Each record holds the machine (CPU model, cores, load average before and after), versions, the command
and the workload.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minivllm import defaults  # noqa: E402
from minivllm.benchmarks.env import environment  # noqa: E402
from minivllm.benchmarks.serve import benchmark, sample_random_requests  # noqa: E402
from minivllm.benchmarks.serve_engine import benchmark_engine  # noqa: E402
from minivllm.config import EngineArgs  # noqa: E402
from minivllm.engine.async_llm import AsyncLLM  # noqa: E402
from minivllm.transformers_utils.model_files import load_tokenizer, resolve_model  # noqa: E402

SUMMARY = ("duration", "completed", "failed", "total_output_tokens", "output_throughput", "mean_ttft_ms",
           "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_tpot_ms",
           "p50_event_loop_lag_ms", "p99_event_loop_lag_ms")


def summary(result: dict) -> dict:
    return {k: result[k] for k in SUMMARY if k in result}


def write(name: str, record: dict) -> None:
    path = ROOT / "results" / name
    record = {"command": "python " + " ".join(sys.argv), **environment(), "load_average_after": os.getloadavg()} | record
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


def engine_args(**kw) -> EngineArgs:
    return defaults.complete_engine_args(EngineArgs(dtype="float32", **kw))


def part_served(tokenizer, n: int) -> None:
    """The server against offline `LLM.generate` on the same requests."""
    from minivllm.llm import LLM
    from minivllm.sampling_params import SamplingParams

    requests = sample_random_requests(tokenizer, n, input_len=128, output_len=48, range_ratio=0.5, seed=0)
    load_before = os.getloadavg()
    server = subprocess.Popen([sys.executable, "-m", "minivllm", "serve", "--port", "0", "--dtype", "float32",
                               "--served-model-name", "smollm2", "--uvicorn-log-level", "warning"],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        url = next(line.split()[-1] for line in server.stdout if line.startswith("minivllm serve: listening on "))
        served = asyncio.run(benchmark(f"{url}/v1/completions", "smollm2", requests, tokenizer=tokenizer,
                                       selected_percentiles=[50, 99]))
    finally:
        server.terminate()
        server.wait(60)
    llm = LLM(dtype="float32")
    llm.generate(requests[0].prompt, SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up, as bench serve's test request
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in requests], [SamplingParams(temperature=0.0, max_tokens=r.expected_output_len,
                                                                      ignore_eos=True) for r in requests])
    offline_s = time.perf_counter() - start
    offline_tps = sum(len(o.outputs[0].token_ids) for o in outs) / offline_s
    write("cpu_serve_vs_offline.json", {
        "workload": {"num_prompts": n, "random_input_len": 128, "random_output_len": 48, "random_range_ratio": 0.5,
                     "request_rate": "inf", "ignore_eos": True, "seed": 0},
        "load_average_before": load_before, "served": summary(served),
        "engine_core_reserved_cores": int(os.environ.get("MINIVLLM_CPU_RESERVED_CORES", "0")),
        "offline": {"duration": offline_s, "output_throughput": offline_tps},
        "served_over_offline_output_throughput": served["output_throughput"] / offline_tps})


def part_split(tokenizer, n: int) -> None:
    """The engine core stepped by a thread of this process against the engine core in its own process."""
    requests = sample_random_requests(tokenizer, n, input_len=32, output_len=24, range_ratio=0.5, seed=1)
    load_before, results = os.getloadavg(), {}
    for name, multiprocess in (("in_process", False), ("multiprocess", True)):
        engine = AsyncLLM(engine_args(), multiprocess=multiprocess)
        try:
            asyncio.run(benchmark_engine(engine, requests[:2]))  # warm-up
            results[name] = asyncio.run(benchmark_engine(engine, requests))
        finally:
            engine.shutdown()
    lag = {k: v["p99_event_loop_lag_ms"] for k, v in results.items()}
    write("cpu_serve_split.json", {
        "workload": {"num_prompts": n, "random_input_len": 32, "random_output_len": 24, "random_range_ratio": 0.5,
                     "request_rate": "inf", "heartbeat_s": 0.005},
        "load_average_before": load_before, **{k: summary(v) for k, v in results.items()},
        "p99_event_loop_lag_multiprocess_over_in_process": lag["multiprocess"] / lag["in_process"]})


def part_itl(tokenizer, n: int, rate: float) -> None:
    """Chapter 11's token budget against chapter 04's prefill-first scheduler, at a fixed request rate."""
    from minivllm.core.sched.scheduler import Scheduler

    requests = sample_random_requests(tokenizer, n, input_len=384, output_len=32, range_ratio=0.9, seed=2)
    load_before, results = os.getloadavg(), {}
    for name, kw in (("chunked_prefill", {}), ("prefill_first", {"scheduler_cls": Scheduler})):
        engine = AsyncLLM(engine_args(**kw))
        try:
            asyncio.run(benchmark_engine(engine, requests[:2]))  # warm-up
            results[name] = asyncio.run(benchmark_engine(engine, requests, request_rate=rate, seed=2))
        finally:
            engine.shutdown()
    write("cpu_serve_itl_chunked_vs_prefill_first.json", {
        "workload": {"num_prompts": n, "random_input_len": 384, "random_output_len": 32, "random_range_ratio": 0.9,
                     "request_rate": rate, "burstiness": 1.0, "seed": 2},
        "load_average_before": load_before, **{k: summary(v) for k, v in results.items()},
        "p99_itl_chunked_over_prefill_first": results["chunked_prefill"]["p99_itl_ms"] / results["prefill_first"]["p99_itl_ms"]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("served", "split", "itl"), action="append")
    parser.add_argument("--num-prompts", type=int, default=None, help="default: served 32, split 64, itl 24")
    parser.add_argument("--request-rate", type=float, default=1.0, help="the itl part's requests per second")
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model(None))
    for part in args.part or ("served", "split", "itl"):
        n = args.num_prompts or {"served": 32, "split": 64, "itl": 24}[part]
        print(f"--- {part}: {n} requests", flush=True)
        if part == "itl":
            part_itl(tokenizer, n, args.request_rate)
        else:
            {"served": part_served, "split": part_split}[part](tokenizer, n)


if __name__ == "__main__":
    main()
