"""How near the CPU prefill attention kernels come to their FLOP bound, by sequence length (chapter 09).

    python scripts/prefill_attention_lengths.py [--dtype float32 bfloat16] [--lengths 32 64 ... 2048]
                                                [--tokens 2048] [--threads N] [--out results/NAME.json]

The profile (`scripts/profile_engine.py`) holds a prefill's attention against its FLOPs at the matmul
rate. This script asks what that ratio depends on. For each dtype whose C++ prefill kernel runs here
(chapter 05's `cpu_prefill_varlen_kernel`: float32 where the CPU has AVX-512 or AVX2, bfloat16 where it has AMX)
and each length L of `--lengths`, it times one call of the kernel's batch form on `--tokens // L`
sequences of L new tokens each (at least one sequence, so a row holds `--tokens` tokens only where L
divides it), with the default model's heads (read from its config), random inputs, after one untimed
call: the best and the median of `--repeats` calls. The bound is the causal pairs' FLOPs
(`ModelCost.attention_flops_per_pair` for one layer: 4 x query heads x head_dim per pair, each sequence
L (L + 1) / 2 pairs) at the dtype's matmul rate, timed beside the row: `measure_peaks` finds the fastest
matmul path and size for the dtype once, then such a matmul is timed just before and just after each
row's calls, and the row's rate is the best of those (on a CPU shared with other programs the rate moves
from minute to minute). The ratio is the best time over the bound (1 at the bound). The times depend a
little on the data: the bfloat16 kernel rescales a row's sums only where a score rises well above the
row's running maximum, which random scores seldom do. Beside each call, alternating with it, the same
inputs go through torch's own fused causal attention, `F.scaled_dot_product_attention` (SDPA; the
sequences as a batch, `is_causal`, `enable_gqa`), against the same bound: a row also holds its best
time, ratio and largest difference from the kernel's output. A dtype whose kernel does not run here is
recorded as such, with no rows. Writes a record with the CPU named where `--out` is given.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys

import torch
import torch.nn.functional as F

from minivllm.attention.backends.cpu_attn import cpu_prefill_varlen_kernel
from minivllm.benchmarks.env import environment, write_json
from minivllm.benchmarks.roofline import DevicePeaks, matmul_paths, measure_peaks
from minivllm.benchmarks.runners import timed
from minivllm.transformers_utils.model_files import resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_heads() -> dict:
    """The default model's attention shape: `num_heads`, `num_kv_heads`, `head_dim` (from its config)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model(None))
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return dict(num_heads=num_heads, num_kv_heads=config.num_key_value_heads, head_dim=head_dim)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, scale: float) -> torch.Tensor:
    """torch's fused causal attention on `q [n, num_heads, D]`, `k`, `v [n, num_kv_heads, D]` laid out as
    `n // length` sequences of `length` tokens (a batch of views, no copy): the kernel's contract for
    sequences of one length, its output `[n, num_heads, D]`."""
    def batch(t):
        return t.view(-1, length, t.shape[1], t.shape[2]).transpose(1, 2)
    out = F.scaled_dot_product_attention(batch(q), batch(k), batch(v), is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(q.shape)


def reference_matmul(dtype: torch.dtype, peaks: DevicePeaks):
    """`(fn, flops)`: one call of the matmul that `measure_peaks` found fastest for `dtype` (its path and size
    from `peaks.detail`; `torch.mm` at n = 2048 where the detail does not say), from chapter 09's
    `matmul_paths`, and its FLOPs (2 n^3). Raises ValueError for a path `matmul_paths` does not have here."""
    n, op = peaks.detail.get("matmul_n", 2048), peaks.detail.get("matmul_op", "torch.mm")
    paths = matmul_paths(n, "cpu", dtype)
    if op not in paths:
        raise ValueError(f"reference_matmul: no matmul path named {op!r} (here: {', '.join(paths)})")
    return paths[op], 2 * n ** 3


def time_reference(reference, repeats: int) -> list[float]:
    """The wall times of `(repeats + 1) // 2` calls of `reference`'s function after an untimed one (none
    without a reference)."""
    if reference is None:
        return []
    reference[0]()
    return [timed(reference[0])[1] for _ in range((repeats + 1) // 2)]


def time_length(kernel, dtype: torch.dtype, heads: dict, length: int, tokens: int, repeats: int,
                reference=None) -> dict:
    """One row: `max(1, tokens // length)` sequences of `length` tokens through `kernel`, and through `sdpa`
    alternating with it; the kernel's best and median times, SDPA's best time and its largest difference from
    the kernel's output, the causal pairs and FLOPs of the call (one layer). With `reference`, `(fn, flops)`
    from `reference_matmul`, `fn()` is also timed just before and just after the row's calls
    (`time_reference`), and the row holds the best rate of those (`matmul_flops_per_s`)."""
    num_seqs = max(1, tokens // length)
    g = torch.Generator().manual_seed(length)
    n, head_dim = num_seqs * length, heads["head_dim"]
    q = torch.randn(n, heads["num_heads"], head_dim, generator=g).to(dtype)
    k, v = (torch.randn(n, heads["num_kv_heads"], head_dim, generator=g).to(dtype) for _ in range(2))
    cu = torch.arange(0, n + 1, length, dtype=torch.int64)
    scale = head_dim ** -0.5
    # the reference matmul just before and just after the row's calls (not between them: its operands would
    # push the row's inputs out of the caches, which the engine's attention finds warm from the projection)
    reference_times = time_reference(reference, repeats)
    # untimed: first-touch of the outputs, caches
    diff = (kernel(q, k, v, cu, cu, scale).float() - sdpa(q, k, v, length, scale).float()).abs().max().item()
    times, sdpa_times = [], []
    for _ in range(repeats):
        times.append(timed(kernel, q, k, v, cu, cu, scale)[1])
        sdpa_times.append(timed(sdpa, q, k, v, length, scale)[1])
    reference_times += time_reference(reference, repeats)
    pairs = num_seqs * length * (length + 1) // 2
    row = dict(length=length, num_seqs=num_seqs, pairs=pairs, flops=4 * heads["num_heads"] * head_dim * pairs,
               seconds=min(times), median_seconds=statistics.median(times), sdpa_seconds=min(sdpa_times),
               sdpa_max_diff=diff)
    if reference is not None:
        row["matmul_flops_per_s"] = reference[1] / min(reference_times)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["float32", "bfloat16"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024, 2048],
                    help="tokens per sequence")
    ap.add_argument("--tokens", type=int, default=2048, help="new tokens per call (sequences: tokens // length)")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per row")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    ap.add_argument("--out", default=None, help="write a JSON record here")
    args = ap.parse_args(argv)
    if min(args.lengths) < 1 or args.tokens < 1 or args.repeats < 1 or (args.threads is not None and args.threads < 1):
        ap.error("--lengths, --tokens, --repeats and --threads must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    env, heads = environment(), default_heads()
    print(f"{env['hardware']['cpu']}, {torch.get_num_threads()} threads; heads {heads}")
    results = {}
    for name in args.dtype:
        dtype = DTYPES[name]
        kernel = cpu_prefill_varlen_kernel(dtype)
        if kernel is None:
            print(f"{name}: the C++ prefill kernel does not run here (neither AVX-512 nor AVX2 for float32, no AMX for bfloat16)")
            results[name] = dict(kernel=False, rows=[])
            continue
        peaks = measure_peaks("cpu", dtype)
        reference = reference_matmul(dtype, peaks)
        rows = [time_length(kernel, dtype, heads, length, args.tokens, args.repeats, reference)
                for length in args.lengths]
        print(f"{name}: matmul rate {peaks.matmul_flops_per_s / 1e9:.0f} GFLOP/s before the rows "
              f"({peaks.detail.get('matmul_op', 'torch.mm')}, n = {peaks.detail.get('matmul_n', 2048)}), then timed "
              "beside each row")
        print(f"{'length':>8} {'seqs':>5} {'best ms':>8} {'median ms':>9} {'GFLOP/s':>8} {'matmul':>7} {'x bound':>8} "
              f"{'SDPA ms':>8} {'SDPA x bound':>12} {'max diff':>9}")
        for row in rows:
            rate = row["matmul_flops_per_s"]
            row["gflop_per_s"] = row["flops"] / row["seconds"] / 1e9
            row["ratio"] = row["seconds"] * rate / row["flops"]
            row["sdpa_ratio"] = row["sdpa_seconds"] * rate / row["flops"]
            print(f"{row['length']:8d} {row['num_seqs']:5d} {1e3 * row['seconds']:8.2f} "
                  f"{1e3 * row['median_seconds']:9.2f} {row['gflop_per_s']:8.0f} {rate / 1e9:7.0f} {row['ratio']:8.2f} "
                  f"{1e3 * row['sdpa_seconds']:8.2f} {row['sdpa_ratio']:12.2f} {row['sdpa_max_diff']:9.2g}")
        results[name] = dict(kernel=True, matmul_flops_per_s=peaks.matmul_flops_per_s, rows=rows)
    if args.out:
        command = "python scripts/prefill_attention_lengths.py " + shlex.join(sys.argv[1:] if argv is None else argv)
        write_json(dict(script="scripts/prefill_attention_lengths.py", command=command, tokens=args.tokens,
                        heads=heads, dtypes=results, **env), args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
