"""Chapter 02's float32 GEMM (`PanelLinear`) against oneDNN's packed layers (`PackedLinear`), side by side
in one process: forward passes of the default model (fused q/k/v and small ops, as the engine runs it) over
1 to 256 tokens, with logits.

    python scripts/cpu_gemm_ab.py [--tokens 1 8 32 64 256] [--rounds 3] [--out results/cpu_gemm_ab.json]

The two models alternate round by round, so a noisy machine slows both alike; each time is the best of
`--rounds` rounds of 3 calls. Records the times, their ratios (oneDNN over ours: above 1, ours is faster),
the largest logit difference between the two, the micro-kernel the C++ GEMM was built with
(`kernel_isa`: "avx512" or "avx2") and the machine. Chapter 02's appendix C quotes the AVX2 record (its own
timings are the AVX-512 ones).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch

from minivllm.baselines.naive import CausalAttention
from minivllm.benchmarks.env import environment, write_json
from minivllm.model_executor.layers.cpu_gemm import cpu_gemm, use_panel_linear
from minivllm.model_executor.layers.linear import pack_linear_layers
from minivllm.model_executor.model_loader import load_model
from minivllm.model_executor.models.fused_layers import fuse_small_ops
from minivllm.model_executor.models.fused_qkv import fuse_qkv_projections


def forward_time(model, n: int, scale: float, calls: int = 3) -> float:
    """Seconds, best of `calls`, for one forward pass with logits over `n` tokens."""
    ids = torch.randint(100, 10000, (n,), generator=torch.Generator().manual_seed(n))
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        model.compute_logits(model(ids, torch.arange(n), CausalAttention(scale)))
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (None: torch's choice)")
    parser.add_argument("--out", default=None, help="write the JSON record to this file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_gemm() is None:
        parser.error("the C++ GEMM is not available here (no AVX-512 or AVX2 with FMA, or no compiler)")
    with torch.inference_mode():
        ours = load_model(None, dtype=torch.float32)
        fuse_qkv_projections(ours)
        onednn = copy.deepcopy(ours)  # before packing: a packed model cannot be copied
        replaced = use_panel_linear(ours), pack_linear_layers(onednn)
        fuse_small_ops(ours), fuse_small_ops(onednn)
        scale = ours.model.layers[0].self_attn.scale
        ids = torch.arange(100, 140)
        a, b = (m.compute_logits(m(ids, torch.arange(len(ids)), CausalAttention(scale))) for m in (onednn, ours))
        diff = (a - b).abs().max().item()
        t_ours, t_dnn = [float("inf")] * len(args.tokens), [float("inf")] * len(args.tokens)
        for _ in range(args.rounds):
            t_dnn = [min(t, forward_time(onednn, n, scale)) for t, n in zip(t_dnn, args.tokens)]
            t_ours = [min(t, forward_time(ours, n, scale)) for t, n in zip(t_ours, args.tokens)]
    for n, d, o in zip(args.tokens, t_dnn, t_ours):
        print(f"{n:5d} tokens: oneDNN {1e3 * d:7.1f} ms, ours {1e3 * o:7.1f} ms: {d / o:4.2f}x", file=sys.stderr)
    record = dict(script="scripts/cpu_gemm_ab.py", model="default", dtype="float32", kernel_isa=cpu_gemm().kernel_isa(),
                  layers_replaced=dict(ours=replaced[0], onednn=replaced[1]), tokens=args.tokens,
                  onednn_ms=[1e3 * t for t in t_dnn], ours_ms=[1e3 * t for t in t_ours],
                  ratio=[d / o for d, o in zip(t_dnn, t_ours)], max_logit_difference=diff, rounds=args.rounds,
                  **environment(), command="python " + " ".join(["scripts/cpu_gemm_ab.py", *(argv or sys.argv[1:])]))
    if args.out:
        write_json(record, args.out)
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
