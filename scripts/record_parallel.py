"""Record chapter 13's CPU figures: tensor parallelism (tp 2, one thread per rank) and data parallelism
(dp 2, one thread per engine core) against one process with both threads, one seeded workload, one run.

    python scripts/record_parallel.py [--model qwen3-0.6b] [--out results/cpu_parallel.json]

The default model (SmolLM2-135M, 9 heads) cannot be split in two, so the run uses Qwen3-0.6B's
architecture with dummy weights (16 heads, 8 KV heads; speed does not depend on the weights' values).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from minivllm.benchmarks.dummy import dummy_model
from minivllm.benchmarks.env import environment, write_json
from minivllm.benchmarks.parallel import parallel_benchmark


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b", help="a shipped config name (dummy weights) or a model folder")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--out", default="results/cpu_parallel.json")
    args = p.parse_args()
    model = str(dummy_model(args.model, "float32")) if not os.path.isdir(args.model) else args.model
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    record = parallel_benchmark(model, num_requests=args.num_requests)
    record.update({"model": args.model, "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                   "environment": environment(), "load_average_before": load_before,
                   "load_average_after": os.getloadavg(), "wall_seconds": time.perf_counter() - t0})
    write_json(record, args.out)
    r = record["ratios"]
    print(f"tp 2 / tp 1 tokens/s: {r['tp2_tok_s_vs_tp1']:.2f}x (collectives {r['tp2_comm_share']:.0%} of the run; through gloo {r['tp2_gloo_tok_s_vs_tp1']:.2f}x); "
          f"dp 2 / tp 1: {r['dp2_tok_s_vs_tp1']:.2f}x; parameters per rank at tp 2: {r['tp2_parameter_bytes_vs_tp1']:.2f}x; "
          f"KV bytes per rank: {r['tp2_kv_bytes_vs_tp1']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
