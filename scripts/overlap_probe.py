"""Does this CPU hide memory reads under arithmetic? A probe for reading the roofline (chapter 09).

    python scripts/overlap_probe.py [--mib 2048] [--work 32 64 128 256 512] [--ahead 0 2 8 32] [--threads N]
                                    [--out results/cpu_overlap_probe.json]
    python scripts/overlap_probe.py --tiles [--groups 200000] [--rounds 1 2 4 8 16] [--threads N]
                                    [--out results/cpu_amx_tile_overlap_probe.json]

The roofline gives each step the longer of its compute time and its memory time, as if a core could
stream memory and compute at full speed at once. This probe measures how far that holds for one simple
loop on this machine. A C++ loop (`scripts/overlap_probe.cpp`, built like the engine's kernels) reads a
buffer of `--mib` MiB chunk by chunk (4 KiB, 64 cache lines) and, after each chunk, runs `work` rounds
of 8 multiply-add chains on registers. It is timed three ways, in turn, each the best of `--repeats`
rounds (after one untimed round):

    memory    the reads alone (no rounds)
    compute   the rounds alone (no reads), as many chunks' worth, with their prefetch instructions
              aimed at a small buffer that stays in the caches (swept again and again: the last `ahead`
              chunks of each sweep ask for nothing, so with 2 threads 0.4 %, 1.6 % and 6 % fewer prefetches
              than `both` at 2, 8 and 32 chunks ahead)
    both      the reads and the rounds

and reports `both / longer` (1: the roofline's assumption, the shorter part hidden entirely), `both /
sum` (1: the two parts one after the other) and `hidden = (memory + compute - both) / min(memory,
compute)`, the share of the shorter part hidden (1 at the roofline, 0 for the sum, below 0 where the loop
takes longer than its parts apart). `--ahead N` also prefetches the chunk N chunks further on into L2,
spread over the rounds (0: only the hardware's prefetchers). The buffer should be several times the
last-level cache, or the reads come partly from it: the script warns where Linux reports an L3 more
than a quarter of `--mib`. Writes a record with the CPU named where `--out` is given.

`--tiles` asks the same question inside one core, on a CPU with AMX (chapter 09, "Inside one core"): does it
run AMX's tile products and AVX-512 arithmetic side by side? The C++ loop repeats `--groups` times four tile
products (bfloat16, each into its own float32 accumulator tile) followed by `rounds` rounds of 12 independent
16-lane multiply-add chains, and is timed three ways: the products alone (once, shared by the rows), the rounds
alone and both, for each of `--rounds`, all in turn. The rows report the same three ratios. Without AMX (or
without Linux's grant of its tile state) the script stops with a message.
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

from minivllm.benchmarks.env import environment, write_json
from minivllm.benchmarks.runners import timed
from minivllm.model_executor.cpp_extension import CppExtension, load_extension

PROBE = CppExtension("minivllm_overlap_probe", Path(__file__).with_name("overlap_probe.cpp"),
                     "the overlap probe's kernel", "the probe cannot run")
SMALL_MIB = 4  # the compute part's prefetch targets: cached, so that those prefetches cost only their instructions
L3_SIZE = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")  # Linux: e.g. "32768K"


def overlap(a: float, b: float, both: float) -> dict:
    """How far a loop doing two parts (`a` and `b` seconds alone) in `both` seconds overlapped them: `hidden`, the
    share of the shorter part hidden ((a + b - both) / min(a, b): 1 at the roofline, 0 one after the other, below 0
    slower than that), `both_over_longer` and `both_over_sum` (plain ratios). Raises ZeroDivisionError for a part
    of 0 s."""
    return dict(hidden=(a + b - both) / min(a, b), both_over_longer=both / max(a, b), both_over_sum=both / (a + b))


def summarize(ahead: int, work: int, memory: float, compute: float, both: float) -> dict:
    """One row of the record from the three best times (seconds)."""
    return dict(ahead=ahead, work=work, memory_s=memory, compute_s=compute, both_s=both,
                **overlap(memory, compute, both))


def best_times(runs: dict, repeats: int) -> dict:
    """The best time in seconds, per name, of `repeats` timed rounds of each of `runs` (name -> function of no
    arguments), taken in turn (a machine that drifts slows them alike), after one untimed round (first touch,
    caches)."""
    for fn in runs.values():
        fn()
    best = {name: timed(fn)[1] for name, fn in runs.items()}
    for _ in range(repeats - 1):
        for name, fn in runs.items():
            best[name] = min(best[name], timed(fn)[1])
    return best


def probe(module, mib: int, works: list[int], aheads: list[int], repeats: int) -> list[dict]:
    """For each prefetch distance and amount of work, the best of `repeats` rounds of the three timings
    taken in turn (a machine that drifts slows all three alike), after one untimed round; one row each."""
    big = torch.ones(mib * 2**20 // 4)
    small = torch.ones(SMALL_MIB * 2**20 // 4)
    reps = max(1, round(mib / SMALL_MIB))  # as many chunks' worth of rounds as the big buffer has chunks
    rows = []
    for ahead in aheads:
        for work in works:
            best = best_times(dict(memory=lambda: module.stream(big, 0, ahead, 1, True),
                                   compute=lambda: module.stream(small, work, ahead, reps, False),
                                   both=lambda: module.stream(big, work, ahead, 1, True)), repeats)
            row = summarize(ahead, work, best["memory"], best["compute"], best["both"])
            rows.append(row)
            print(f"ahead {ahead:2d}  work {work:4d}: memory {1e3 * row['memory_s']:7.1f} ms  compute "
                  f"{1e3 * row['compute_s']:7.1f} ms  both {1e3 * row['both_s']:7.1f} ms  -> both / longer "
                  f"{row['both_over_longer']:.2f}, both / sum {row['both_over_sum']:.2f}", flush=True)
    return rows


def tile_probe(module, groups: int, rounds: list[int], repeats: int) -> list[dict]:
    """`--tiles`: the best times of the tile products alone and, for each number of rounds of vector work per
    group of four products, of the rounds alone and of both in one loop, all taken in turn (`best_times`), so that
    a machine that drifts slows every row alike; one row each, all with the same products-alone time."""
    runs = {"tiles": functools.partial(module.tiles_and_vectors, groups, True, 0)}
    for r in rounds:
        runs["vectors", r] = functools.partial(module.tiles_and_vectors, groups, False, r)
        runs["both", r] = functools.partial(module.tiles_and_vectors, groups, True, r)
    best = best_times(runs, repeats)
    rows = []
    for r in rounds:
        row = dict(rounds=r, tiles_s=best["tiles"], vectors_s=best["vectors", r], both_s=best["both", r],
                   **overlap(best["tiles"], best["vectors", r], best["both", r]))
        rows.append(row)
        print(f"rounds {r:3d}: tiles {1e3 * row['tiles_s']:7.2f} ms  vectors {1e3 * row['vectors_s']:7.2f} ms  both "
              f"{1e3 * row['both_s']:7.2f} ms  -> both / longer {row['both_over_longer']:.2f}, both / sum "
              f"{row['both_over_sum']:.2f}", flush=True)
    return rows


def l3_bytes() -> int | None:
    """The last-level cache Linux reports for CPU 0, in bytes (None where it reports none)."""
    try:
        text = L3_SIZE.read_text().strip()
    except OSError:
        return None
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=2048, help="the streamed buffer's size (MiB)")
    ap.add_argument("--work", type=int, nargs="+", default=[32, 64, 128, 256, 512],
                    help="rounds of 8 register multiply-adds per 4 KiB chunk")
    ap.add_argument("--ahead", type=int, nargs="+", default=[0, 2, 8, 32],
                    help="software prefetch distance in chunks (0: none)")
    ap.add_argument("--tiles", action="store_true",
                    help="probe AMX's tile products against AVX-512 arithmetic instead of memory against arithmetic")
    ap.add_argument("--groups", type=int, default=200_000, help="--tiles: groups of four tile products per thread")
    ap.add_argument("--rounds", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                    help="--tiles: rounds of 12 vector multiply-adds per group")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="write a JSON record here")
    args = ap.parse_args(argv)
    threads_ok = args.threads is None or args.threads >= 1
    if args.mib < 1 or min(args.work) < 1 or min(args.ahead) < 0 or args.repeats < 1 or not threads_ok:
        ap.error("--mib, --work, --repeats and --threads must be at least 1, --ahead at least 0")
    if args.groups < 1 or min(args.rounds) < 1:
        ap.error("--groups and --rounds must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.tiles and (l3 := l3_bytes()) and 4 * l3 > args.mib * 2**20:
        print(f"warning: Linux reports an L3 cache of {l3 / 2**20:.0f} MiB; a buffer of {args.mib} MiB is less than "
              "four times that, so some reads may come from it", file=sys.stderr)
    module = load_extension(PROBE)
    if module is None:
        raise SystemExit("overlap_probe: the C++ probe could not be built (see the warning above)")
    if args.tiles and not module.tiles_available():
        raise SystemExit("overlap_probe --tiles: this build or CPU has no AMX (or Linux does not grant its tile state)")
    env = environment()
    if args.tiles:
        print(f"{env['hardware']['cpu']}, {torch.get_num_threads()} threads, {args.groups} groups of 4 tile products")
        record = dict(groups=args.groups, rows=tile_probe(module, args.groups, args.rounds, args.repeats))
    else:
        print(f"{env['hardware']['cpu']}, {torch.get_num_threads()} threads, {args.mib} MiB streamed")
        record = dict(mib=args.mib, small_mib=SMALL_MIB, rows=probe(module, args.mib, args.work, args.ahead,
                                                                    args.repeats))
    if args.out:
        command = "python scripts/overlap_probe.py " + " ".join(sys.argv[1:] if argv is None else argv)
        write_json(dict(script="scripts/overlap_probe.py", command=command, **record, **env), args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
