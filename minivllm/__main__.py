"""`python -m minivllm ...` (and the `minivllm` command): the command line, assembled from the chapters.

Written by hand, like `__init__.py` and `defaults.py`: each chapter that adds a command adds its
`add_cli(subparsers)` line here, and a chapter that extends a command adds its flags to the parser that
`add_cli` returns. A subcommand's parser sets `func(args) -> exit status`.

`python -m minivllm bench serve ...` (chapter 12, vLLM's `vllm bench serve`) has a parser of its own
(`build_bench_parser`): `main` sends argv that starts with `bench serve` there, and everything else to
`build_parser`, so that every `python -m minivllm bench --...` of chapters 09 and 11 parses as before.
"""
from __future__ import annotations

import argparse
import sys

from minivllm.benchmarks import chunked_prefill_cli
from minivllm.benchmarks import cli as bench_cli
from minivllm.benchmarks import serve_cli as bench_serve_cli
from minivllm.entrypoints import cli
from minivllm.entrypoints.openai import cli_args as serve_cli
from minivllm.entrypoints import worker_cli


def build_parser() -> argparse.ArgumentParser:
    """The `python -m minivllm` parser: `generate` and `convert` (chapter 04), `bench` (chapter 09; chapter 11
    adds `--workload mixed` and `--compare ch09`)."""
    parser = argparse.ArgumentParser(prog="python -m minivllm", description="minivllm: a small vLLM-style engine")
    subparsers = parser.add_subparsers(dest="command", required=True)
    cli.add_cli(subparsers)
    serve_cli.add_cli(subparsers)  # chapter 12: `serve`, the OpenAI-compatible server
    worker_cli.add_cli(subparsers)  # chapter 13: `worker`, another machine's tensor-parallel ranks
    bench = bench_cli.add_cli(subparsers, compare=chunked_prefill_cli.COMPARE)
    chunked_prefill_cli.add_bench_flags(bench)
    return parser


def build_bench_parser() -> argparse.ArgumentParser:
    """The `python -m minivllm bench` parser of the benchmarks with a sub-subcommand: `serve` (chapter 12)."""
    parser = argparse.ArgumentParser(prog="python -m minivllm bench", description="benchmark a running server")
    bench_serve_cli.add_cli(parser.add_subparsers(dest="bench_command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Returns the exit status: 2 for bad input, with one `error: ...` line on stderr."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["bench", "serve"]:
        args = build_bench_parser().parse_args(argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
