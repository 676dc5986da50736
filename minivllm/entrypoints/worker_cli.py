"""`python -m minivllm worker`: the ranks of a tensor-parallel engine on another machine (exported from
notebooks/13_scaling_out.ipynb). After vLLM's `--headless` nodes and torchrun's flags."""
from __future__ import annotations

import argparse
import os

from ..distributed.executor import run_node
from ..distributed.parallel_state import local_ranks


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Add `worker`: torchrun's rendezvous flags (default: the `MASTER_ADDR`, `MASTER_PORT` variables)."""
    p = subparsers.add_parser("worker", help="run this machine's ranks of a tensor-parallel engine on another node")
    p.add_argument("--tensor-parallel-size", type=int, required=True)
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--node-rank", type=int, required=True, help="this machine's index, 1 .. nnodes - 1")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"), help="node 0's address")
    p.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT", 0)) or None)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--distributed-timeout-seconds", type=float, default=300.0)
    p.set_defaults(func=worker)
    return p


def worker(args: argparse.Namespace) -> int:
    """Check the flags (ValueError names the bad one), then run this node's ranks until the engine stops."""
    if args.master_addr is None or args.master_port is None:
        raise ValueError("give --master-addr and --master-port (or MASTER_ADDR and MASTER_PORT): node 0's address")
    if args.nnodes < 2 or not 0 < args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} must be in [1, {args.nnodes - 1}]: node 0 runs the engine")
    if args.tensor_parallel_size % args.nnodes:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size} does not split evenly over "
                         f"--nnodes {args.nnodes}")
    local_ranks(args.tensor_parallel_size, args.nnodes, args.node_rank)
    return run_node(args.tensor_parallel_size, args.nnodes, args.node_rank, args.master_addr, args.master_port,
                    args.device, args.distributed_timeout_seconds)
