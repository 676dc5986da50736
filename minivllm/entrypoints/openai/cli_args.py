"""`python -m minivllm serve`'s flags (vLLM's names), kept apart from the server so that the command line
loads without FastAPI, uvicorn or prometheus-client (the `serve` extra): they are imported when `serve`
runs. After vLLM's `vllm/entrypoints/openai/cli_args.py`."""
from __future__ import annotations

import argparse

from minivllm.config import DTYPES


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Add `serve` (vLLM's flag names); its `func` is `run_server`. Returns the parser."""
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", default=None, help="local Hugging Face folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed)")
    p.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    p.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)], help="parameter dtype")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--max-model-len", type=int, default=None, help="most tokens per sequence")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="most tokens in one step")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV-cache size in bytes")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    p.add_argument("--seed", type=int, default=0, help="seeds requests without a seed of their own")
    p.add_argument("--no-multiprocess", "--in-process", dest="multiprocess", action="store_false",
                   help="run the engine core in the server's process (default: a process of its own)")
    p.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_server)
    return p


def run_server(args: argparse.Namespace) -> int:
    """Run `api_server.run_server` (imported only now: it needs the `serve` extra)."""
    from .api_server import run_server as serve

    return serve(args)
