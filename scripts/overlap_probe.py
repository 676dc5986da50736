"""Does this CPU hide memory reads under arithmetic? A probe for reading the roofline (chapter 09).

    python scripts/overlap_probe.py [--mib 1024] [--work 16 32 64 128 256] [--ahead 0 8] [--threads N]
                                    [--out results/cpu_overlap_probe.json]

The roofline gives each step the longer of its compute time and its memory time, as if a core could
stream memory and compute at full speed at once. This probe measures how far that holds here. A C++
loop (`scripts/overlap_probe.cpp`, built like the engine's kernels) reads a buffer of `--mib` MiB chunk by
chunk (4 KiB, 64 cache lines) and, after each chunk, runs `work` rounds of multiply-adds on registers. It
is timed three ways, in turn, each the best of `--repeats` rounds:

    memory    the big buffer, no arithmetic
    compute   the arithmetic alone, over a 512 KiB buffer read again and again (it stays in the caches),
              as many chunks as the big buffer has
    both      the big buffer with the arithmetic

and reports `hidden = (memory + compute - both) / min(memory, compute)`: 1 where the shorter part is
hidden entirely (both = the longer of the two, the roofline's assumption), 0 where the two add up.
`--ahead N` also prefetches the chunk N chunks further on into L2, spread over the arithmetic (0: only
the hardware's prefetchers). Writes a record with the CPU named where `--out` is given.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from minivllm.benchmarks.env import environment, write_json
from minivllm.model_executor.cpp_extension import CppExtension, load_extension

PROBE = CppExtension("minivllm_overlap_probe", Path(__file__).with_name("overlap_probe.cpp"),
                     "the overlap probe's kernel", "the probe cannot run")
SMALL_MIB = 0.5  # the compute part's buffer: cached, so that its reads cost next to nothing


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def probe(module, mib: int, works: list[int], aheads: list[int], repeats: int) -> list[dict]:
    """For each prefetch distance and amount of work, the best of `repeats` rounds of the three timings
    taken in turn (a machine that drifts slows all three alike); one row each."""
    big = torch.ones(mib * 2**20 // 4)
    small = torch.ones(int(SMALL_MIB * 2**20) // 4)
    reps = round(mib / SMALL_MIB)  # the same number of chunks as the big buffer
    module.stream(big, 0, 0, 1)  # first touch
    rows = []
    for ahead in aheads:
        for work in works:
            runs = dict(memory=lambda: module.stream(big, 0, ahead, 1),
                        compute=lambda: module.stream(small, work, 0, reps),
                        both=lambda: module.stream(big, work, ahead, 1))
            best = {name: min(seconds(fn) for _ in range(1)) for name, fn in runs.items()}  # warm
            for _ in range(repeats):
                for name, fn in runs.items():
                    best[name] = min(best[name], seconds(fn))
            memory, compute, both = best["memory"], best["compute"], best["both"]
            hidden = (memory + compute - both) / min(memory, compute)
            rows.append(dict(ahead=ahead, work=work, memory_s=memory, compute_s=compute, both_s=both,
                             hidden=hidden, both_over_longer=both / max(memory, compute),
                             both_over_sum=both / (memory + compute)))
            print(f"ahead {ahead:2d}  work {work:4d}: memory {memory * 1e3:7.1f} ms  compute {compute * 1e3:7.1f} ms  "
                  f"both {both * 1e3:7.1f} ms  -> both / longer {both / max(memory, compute):.2f}, "
                  f"hidden {hidden:.2f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="the streamed buffer's size (MiB)")
    ap.add_argument("--work", type=int, nargs="+", default=[16, 32, 64, 128, 256],
                    help="rounds of 8 register multiply-adds per 4 KiB chunk")
    ap.add_argument("--ahead", type=int, nargs="+", default=[0, 8], help="software prefetch distance in chunks (0: none)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="write a JSON record here")
    args = ap.parse_args(argv)
    if args.mib < 1 or min(args.work) < 0 or min(args.ahead) < 0 or args.repeats < 1:
        ap.error("--mib and --repeats must be at least 1, --work and --ahead at least 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    module = load_extension(PROBE)
    if module is None:
        raise SystemExit("overlap_probe: the C++ probe could not be built (see the warning above)")
    env = environment()
    print(f"{env['hardware']['cpu']}, {torch.get_num_threads()} threads, {args.mib} MiB streamed")
    rows = probe(module, args.mib, args.work, args.ahead, args.repeats)
    if args.out:
        command = "python scripts/overlap_probe.py " + " ".join(sys.argv[1:] if argv is None else argv)
        write_json(dict(script="scripts/overlap_probe.py", command=command, mib=args.mib, small_mib=SMALL_MIB,
                        rows=rows, **env), args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
