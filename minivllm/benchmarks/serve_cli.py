"""`python -m minivllm bench serve`: benchmark a running OpenAI-compatible server (chapter 12), with vLLM's
`vllm bench serve` flags. `add_cli(subparsers)` adds the `serve` parser; `minivllm/__main__.py` sends
`python -m minivllm bench serve ...` to it (and every other `bench ...` to chapter 09's `bench`).

    python -m minivllm serve --port 8000 &
    python -m minivllm bench serve --port 8000 --num-prompts 32 --random-input-len 160 \\
        --random-range-ratio 0.5 --random-output-len 48 --ignore-eos --save-result
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shlex
import sys
from pathlib import Path

from .env import environment
from .serve import METRICS, benchmark, format_result, parse_goodput, sample_random_requests
from ..transformers_utils.model_files import resolve_model

BACKEND = "openai"  # vLLM's name for the /v1/completions client
DEFAULT_NUM_PROMPTS = 100  # vLLM: 1000; a laptop's CPU serves 100 in minutes
DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN = 256, 64  # tokens (vLLM: 1024, 128)


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad flag values before the tokenizer is loaded or a request is sent. Raises ValueError."""
    for name in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if not args.request_rate > 0 or not args.burstiness > 0:
        raise ValueError(f"--request-rate and --burstiness must be > 0, got {args.request_rate}, {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.endpoint.endswith("/completions") or args.endpoint.endswith("chat/completions"):
        raise ValueError(f"--endpoint {args.endpoint}: bench serve streams /v1/completions only")
    unknown = [m for m in percentile_metrics(args) if m not in METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; choose from {', '.join(METRICS)}")
    metric_percentiles(args)
    parse_goodput(args.goodput or [])
    metadata(args)


def percentile_metrics(args: argparse.Namespace) -> list[str]:
    """`--percentile-metrics "ttft,tpot"` -> ["ttft", "tpot"]."""
    return [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]


def metric_percentiles(args: argparse.Namespace) -> list[float]:
    """`--metric-percentiles "50,99"` -> [50.0, 99.0]. Raises ValueError for a value outside [0, 100]."""
    try:
        values = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        values = [-1.0]
    if not values or not all(0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles {args.metric_percentiles!r}: give numbers in [0, 100], comma-separated")
    return values


def metadata(args: argparse.Namespace) -> dict[str, str]:
    """`--metadata server=... note=...` -> a dict (vLLM's). Raises ValueError for an item without `=`."""
    bad = [kv for kv in args.metadata or [] if "=" not in kv]
    if bad:
        raise ValueError(f"--metadata: {bad} are not KEY=VALUE")
    return dict(kv.split("=", 1) for kv in args.metadata or [])


def base_url(args: argparse.Namespace) -> str:
    """The server's root URL: `--base-url`, else `http://HOST:PORT`."""
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def served_model_name(args: argparse.Namespace, url: str, model_path: str) -> str:
    """The `model` field of each request: `--served-model-name`, else the server's only model (GET
    /v1/models), else `--model` (as vLLM), else the tokenizer's folder."""
    if args.served_model_name:
        return args.served_model_name
    import httpx  # the serve extra

    try:
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        if len(models) == 1:
            return models[0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        pass  # a server without /v1/models: fall back to the model's name
    return args.model or model_path


def result_record(args: argparse.Namespace, result: dict, model_id: str, model_path: str) -> dict:
    """The saved record: vLLM's fields (backend, model_id, tokenizer_id, num_prompts, request_rate, burstiness,
    max_concurrency), the workload's flags, the command line, `--metadata`, the date, machine (CPU model and
    cores) and versions (`environment()`), and every metric and per-request list of `result`."""
    env = environment()
    env.pop("threads")  # the client's torch threads say nothing about the server
    record = dict(backend=BACKEND, model_id=model_id,
                  tokenizer_id=model_path, endpoint=args.endpoint, num_prompts=args.num_prompts,
                  request_rate=args.request_rate if args.request_rate != float("inf") else "inf",
                  burstiness=args.burstiness, max_concurrency=args.max_concurrency, dataset_name=args.dataset_name,
                  random_input_len=args.random_input_len, random_output_len=args.random_output_len,
                  random_range_ratio=args.random_range_ratio, seed=args.seed, ignore_eos=args.ignore_eos,
                  goodput=parse_goodput(args.goodput or []) or None)
    if sys.argv[1:3] == ["bench", "serve"]:  # run from the shell, not from a test or a notebook
        record["command"] = "python -m minivllm " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    return record | metadata(args) | env | result


def result_path(args: argparse.Namespace, model_id: str) -> Path:
    """`--result-dir`/`--result-filename`, else vLLM's name: `openai-<rate>qps[-concurrency<N>]-<model>-<date>.json`."""
    if args.result_filename:
        name = args.result_filename
    else:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"{BACKEND}-{args.request_rate}qps{concurrency}-{Path(model_id).name}-{date}.json"
    return Path(args.result_dir or "results") / name


def run(args: argparse.Namespace) -> int:
    """`python -m minivllm bench serve`: check the flags, draw the workload, benchmark, print (and save)."""
    check_args(args)
    from transformers import AutoTokenizer

    model_path = str(resolve_model(args.tokenizer or args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    requests = sample_random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                      args.random_range_ratio, args.seed)
    url = base_url(args)
    model_id = served_model_name(args, url, model_path)
    print(f"minivllm bench serve: {args.num_prompts} prompts to {url}{args.endpoint} (model {model_id!r}), "
          f"request rate {args.request_rate}, burstiness {args.burstiness}, "
          f"max concurrency {args.max_concurrency}", file=sys.stderr)
    result = asyncio.run(benchmark(url + args.endpoint, model_id, requests, args.request_rate, args.burstiness,
                                   args.max_concurrency, metric_percentiles(args), parse_goodput(args.goodput or []),
                                   args.ignore_eos, tokenizer, args.seed, args.disable_tqdm))
    print(format_result(result, percentile_metrics(args), metric_percentiles(args), args.request_rate,
                        args.max_concurrency))
    if args.save_result or args.result_filename:
        path = result_path(args, model_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result_record(args, result, model_id, model_path)) + "\n")
        print(f"minivllm bench serve: wrote {path}", file=sys.stderr)
    return 0


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Add the `serve` subcommand (its `func` is `run`) to `subparsers` (`python -m minivllm bench`'s) with
    vLLM's `vllm bench serve` flags; return its parser."""
    s = subparsers.add_parser("serve", help="benchmark a running OpenAI-compatible server (vllm bench serve)",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--base-url", default=None, help="the server's root URL (None: http://HOST:PORT)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--endpoint", default="/v1/completions")
    s.add_argument("--model", default=None, help="local Hugging Face folder (None: the embedded SmolLM2-135M-Instruct)")
    s.add_argument("--tokenizer", default=None, help="tokenizer folder (None: --model's)")
    s.add_argument("--served-model-name", default=None,
                   help="the requests' model name (None: the server's only model in /v1/models, else --model)")
    s.add_argument("--dataset-name", choices=["random"], default="random")
    s.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS)
    s.add_argument("--random-input-len", type=int, default=DEFAULT_INPUT_LEN, help="prompt tokens")
    s.add_argument("--random-output-len", type=int, default=DEFAULT_OUTPUT_LEN, help="output tokens (max_tokens)")
    s.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    s.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (inf: all at once)")
    s.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps between requests (1: Poisson; < 1 burstier, > 1 more regular)")
    s.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (None: no limit)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--ignore-eos", action="store_true", help="generate all max_tokens tokens, past the end-of-sequence")
    s.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="service-level objectives for goodput, in ms: ttft:500 tpot:50 e2el:10000")
    s.add_argument("--percentile-metrics", default="ttft,tpot,itl", help=f"metrics in the table: {','.join(METRICS)}")
    s.add_argument("--metric-percentiles", default="99", help="percentiles in the table, e.g. 25,50,99")
    s.add_argument("--disable-tqdm", action="store_true")
    s.add_argument("--save-result", action="store_true", help="write the JSON record")
    s.add_argument("--result-dir", default=None, help="the record's folder (None: results/)")
    s.add_argument("--result-filename", default=None, help="the record's file name (implies --save-result)")
    s.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE",
                   help="more fields for the record, e.g. server_command='python -m minivllm serve ...'")
    s.set_defaults(func=run)
    return s
