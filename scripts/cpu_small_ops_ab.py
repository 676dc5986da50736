"""A/B timings of candidate CPU fusions against the engine's own ops, side by side in one process.

    python scripts/cpu_small_ops_ab.py [--rows 8 32 64 512 2048] [--dtype float32] [--threads N]

For each row count (tokens in a forward pass: a decode batch or a prefill chunk) and the default
model's shapes (hidden 576, 9 query heads and 3 K/V heads of 64, intermediate 1536), it times:

    qkv       q, k and v projections as three oneDNN-packed linears (chapter 02's `PackedLinear`)
              against one packed linear over the concatenated weights, split afterwards
    gate/up   the MLP's gate and up projections, two packed linears against one concatenated
    rotary    chapter 02's `RotaryEmbedding` (rotate-half by concatenation) against the same
              arithmetic written into each half of one output, without the concatenation
    rms_norm  chapter 02's `RMSNorm` (eight eager ops) against `torch.nn.functional.rms_norm` (which
              computes in the input's dtype: in float64 it differs from chapter 02's float32 statistics)

and checks that each candidate gives the same numbers: float64 within 1e-12, and whether float32 is
bit-identical. Each timing is the best of `--repeats` rounds of `--calls` calls; the two contenders
alternate round by round, so a noisy machine slows both alike. Prints one table; no record is written
(a probe for deciding what to build, not a benchmark of the engine).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.benchmarks.env import cpu_model
from minivllm.model_executor.layers.linear import PackedLinear
from minivllm.model_executor.models.llama import RMSNorm, RotaryEmbedding

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536


def rotary_without_cat(rot: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """`RotaryEmbedding.forward`'s arithmetic, each half written in place: `x1 cos - x2 sin`, `x2 cos + x1 sin`."""
    cos = rot.cos[positions].to(q.dtype)[:, None, :]
    sin = rot.sin[positions].to(q.dtype)[:, None, :]
    half = rot.head_dim // 2

    def rotate(x):
        out = x * cos
        out[..., :half] -= x[..., half:] * sin[..., :half]
        out[..., half:] += x[..., :half] * sin[..., half:]
        return out
    return rotate(q), rotate(k)


def best_pair(a, b, calls: int, repeats: int) -> tuple[float, float]:
    """Best seconds per call of `a()` and `b()`, alternating rounds."""
    a(), b()
    ta = tb = float("inf")
    for _ in range(repeats):
        for fn, slot in ((a, 0), (b, 1)):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            t = (time.perf_counter() - t0) / calls
            ta, tb = (min(ta, t), tb) if slot == 0 else (ta, min(tb, t))
    return ta, tb


def same(x, y, dtype) -> str:
    if dtype == torch.float64:
        return "yes (1e-12)" if all(torch.allclose(u, v, rtol=1e-12, atol=1e-12) for u, v in zip(x, y)) else "NO"
    return "bit-identical" if all(torch.equal(u, v) for u, v in zip(x, y)) else \
        f"max diff {max((u - v).abs().max().item() for u, v in zip(x, y)):.1e}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64, 512, 2048])
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"CPU: {cpu_model()}; torch threads: {torch.get_num_threads()}; {args.dtype}")
    g = torch.Generator().manual_seed(0)

    def linear(i, o):
        m = nn.Linear(i, o, bias=False)
        with torch.no_grad():
            m.weight.copy_(torch.randn(o, i, generator=g) / i ** 0.5)
        return m.to(dtype)
    q, k, v = linear(HIDDEN, HEADS * HEAD_DIM), linear(HIDDEN, KV_HEADS * HEAD_DIM), linear(HIDDEN, KV_HEADS * HEAD_DIM)
    gate, up = linear(HIDDEN, INTERMEDIATE), linear(HIDDEN, INTERMEDIATE)
    qkv, gate_up = nn.Linear(HIDDEN, 1, bias=False), nn.Linear(HIDDEN, 1, bias=False)
    qkv.weight, gate_up.weight = (nn.Parameter(torch.cat([m.weight for m in ms]).detach(), requires_grad=False)
                                  for ms in ((q, k, v), (gate, up)))
    qkv.out_features, gate_up.out_features = qkv.weight.shape[0], gate_up.weight.shape[0]
    pack = PackedLinear if PackedLinear.can_pack(q) else (lambda m: m)  # float64: oneDNN does not pack
    P = {name: pack(m) for name, m in dict(q=q, k=k, v=v, gate=gate, up=up, qkv=qkv, gate_up=gate_up).items()}
    split = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
    norm = RMSNorm(HIDDEN, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(HIDDEN, generator=g))
    rot = RotaryEmbedding(HEAD_DIM, 8192, 100000.0)

    print(f"{'rows':>5} {'op':9} {'engine us':>10} {'candidate us':>12} {'speedup':>8}  same numbers")
    with torch.inference_mode():
        for n in args.rows:
            x = torch.randn(n, HIDDEN, generator=g).to(dtype)
            pos = torch.randint(0, 4096, (n,), generator=g)
            qx = torch.randn(n, HEADS, HEAD_DIM, generator=g).to(dtype)
            kx = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
            cases = {
                "qkv": (lambda: (P["q"](x), P["k"](x), P["v"](x)), lambda: P["qkv"](x).split(split, -1)),
                "gate/up": (lambda: (P["gate"](x), P["up"](x)), lambda: P["gate_up"](x).chunk(2, -1)),
                "rotary": (lambda: rot(pos, qx, kx), lambda: rotary_without_cat(rot, pos, qx, kx)),
                "rms_norm": (lambda: (norm(x),), lambda: (F.rms_norm(x, (HIDDEN,), norm.weight, norm.eps),)),
            }
            for op, (a, b) in cases.items():
                ta, tb = best_pair(a, b, args.calls, args.repeats)
                print(f"{n:5d} {op:9} {1e6 * ta:10.0f} {1e6 * tb:12.0f} {ta / tb:7.2f}x  {same(a(), b(), dtype)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
