"""Chapter 11's part of `python -m minivllm bench`: the prefill-first engine against the token budget.

    python -m minivllm bench --workload mixed [--mixed-budget 512]   # streams decoding while long prompts arrive
    python -m minivllm bench --compare ch09                           # the plain workload, default engine vs ch09's

`--workload mixed` runs one `MixedWorkload` (chapter 11) through chapter 04's prefill-first `Scheduler`
(chapter 09's engine) and through the default engine with `max_num_batched_tokens` = the budget, one
after the other in one process, each warmed up first, and reports each one's p99 and median
inter-token latency (ITL) of the decoding streams, the long prompts' mean time to first token (TTFT),
output tokens per second, and the ratios chunked / prefill-first. `--compare ch09` runs chapter 09's
plain benchmark (`benchmark`) with the default engine, then the same workload through chapter 09's
engine (`scheduler_cls=Scheduler`), and reports the ratio of their output throughputs.

Written by hand, like `minivllm/defaults.py` and `minivllm/__main__.py`: the bench command's assembly
for chapter 11, built only from exported pieces (chapter 09's `benchmark`, `run_engine`, flags and
records; chapter 11's `MixedWorkload` and `run_mixed`), so that chapter 09 knows nothing of chapter 11.
`minivllm/__main__.py` passes `COMPARE` to chapter 09's `add_cli` and then calls `add_bench_flags` on
the parser it returns.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, fields

import torch

from . import cli as bench_cli
from .chunked_prefill import MixedResult, MixedWorkload, run_mixed
from .dummy import dummy_model
from .env import cpu_bf16_note, cpu_model, environment, write_json
from .runners import release_memory, run_engine
from .throughput import benchmark
from .workload import DEFAULT_INPUT_LEN, DEFAULT_NUM_REQUESTS, DEFAULT_OUTPUT_LEN, make_workload
from ..config import EngineArgs, resolve_device
from ..core.sched.scheduler import Scheduler
from ..llm import LLM
from ..model_executor.model_loader import load_config
from ..transformers_utils.model_files import resolve_model

COMPARE = {"ch09": "chapter 09's engine (chapter 04's prefill-first Scheduler) on the same workload"}
WORKLOADS = ("plain", "mixed")
DEFAULT_MIXED_BUDGET = 512  # tokens per step: issue 22's comparison point on a CPU
# issue 22's targets: chunked / prefill-first p99 ITL at most 0.5x, output throughput at least 0.95x;
# the plain workload through the default engine at least 0.97x chapter 09's engine
TARGETS = dict(p99_itl_ratio_max=0.5, output_tok_s_ratio_min=0.95, ch09_ratio_min=0.97)
MIXED_FIELDS = tuple(f.name for f in fields(MixedWorkload) if f.name != "seed")  # the seed is --seed
PREFILL_FIRST, CHUNKED = "prefill_first", "chunked"


def _flag(name: str) -> str:
    return "--mixed-" + name.replace("_", "-")


def add_bench_flags(bench: argparse.ArgumentParser) -> None:
    """Add `--workload`, `--mixed-budget` and one `--mixed-<field>` per `MixedWorkload` field to chapter
    09's `bench` parser, and make `run` (below) its `func`."""
    g = bench.add_argument_group("chapter 11: the mixed workload (--workload mixed)")
    g.add_argument("--workload", choices=WORKLOADS, default="plain",
                   help="plain: chapter 09's seeded workload; mixed: streams decoding while long prompts arrive, "
                        "prefill-first against a token budget")
    g.add_argument("--mixed-budget", type=int, default=DEFAULT_MIXED_BUDGET, metavar="TOKENS",
                   help="the chunked engine's max_num_batched_tokens")
    default = MixedWorkload()
    for name in MIXED_FIELDS:
        g.add_argument(_flag(name), type=int, default=getattr(default, name), dest=f"mixed_{name}",
                       help=f"MixedWorkload.{name}")
    bench.set_defaults(func=run)


def mixed_workload(args: argparse.Namespace) -> MixedWorkload:
    """The `MixedWorkload` the flags ask for (seeded with `--seed`)."""
    return MixedWorkload(**{name: getattr(args, f"mixed_{name}") for name in MIXED_FIELDS}, seed=args.seed)


def longest_request(w: MixedWorkload) -> int:
    """The tokens of the workload's longest request, prompt and output: the `max_model_len` it needs."""
    return max(w.long_input_len + w.long_output_len, w.decode_input_len + w.decode_output_len)


def check_args(args: argparse.Namespace) -> None:
    """Refuse flags that do not fit `--workload` or `--compare ch09`, before any work. Raises ValueError."""
    mixed_given = [_flag(n) for n in MIXED_FIELDS if getattr(args, f"mixed_{n}") != getattr(MixedWorkload(), n)]
    if args.mixed_budget != DEFAULT_MIXED_BUDGET:
        mixed_given.append("--mixed-budget")
    if args.workload != "mixed":
        if mixed_given:
            raise ValueError(f"{', '.join(mixed_given)} need{'s' if len(mixed_given) == 1 else ''} --workload mixed")
        if args.compare == "ch09" and args.ladder:
            raise ValueError("--compare ch09 runs the plain benchmark, not --ladder (its rungs name their engines)")
        return
    plain = dict(ladder=args.ladder, compare=args.compare is not None, rungs=args.rungs is not None,
                 rung_requests=args.rung_requests is not None, time_limit=args.time_limit is not None,
                 shared_prefix=args.shared_prefix != 0, num_requests=args.num_requests != DEFAULT_NUM_REQUESTS,
                 input_len=tuple(args.input_len) != DEFAULT_INPUT_LEN,
                 output_len=tuple(args.output_len) != DEFAULT_OUTPUT_LEN,
                 max_num_batched_tokens=args.max_num_batched_tokens is not None,
                 sampling=bench_cli.sampling_fields(args) is not None)
    wrong = [f"--{k.replace('_', '-')}" for k, given in plain.items() if given]
    if wrong:
        raise ValueError(f"--workload mixed does not take {', '.join(wrong)} (its lengths are the --mixed-* flags, "
                         "its token budget --mixed-budget, its sampling greedy)")
    w = mixed_workload(args)
    lowest = dict(num_decoding=1, decode_input_len=1, decode_output_len=2,  # two tokens: one gap between them
                  long_input_len=1, long_output_len=1, arrival_every=1)
    for name in MIXED_FIELDS:
        low = lowest.get(name, 0)
        if getattr(w, name) < low:
            raise ValueError(f"{_flag(name)} must be >= {low}, got {getattr(w, name)}")
    if args.mixed_budget < 1:
        raise ValueError(f"--mixed-budget must be >= 1 token, got {args.mixed_budget}")
    if args.max_model_len is not None and args.max_model_len < longest_request(w):
        raise ValueError(f"--max-model-len {args.max_model_len} cannot hold the mixed workload's longest request "
                         f"({longest_request(w)} tokens, prompt and output): give at least that, or leave it out")
    if args.max_num_seqs is not None and args.max_num_seqs > args.mixed_budget:
        raise ValueError(f"--max-num-seqs {args.max_num_seqs} is more than --mixed-budget {args.mixed_budget}: a step "
                         "could not give every running sequence a token")


def mixed_summary(r: MixedResult) -> dict:
    """One contender's figures: ITL (seconds between two tokens of a decoding stream: p99, median, max),
    TTFT (seconds from a long prompt's arrival to its first token: mean), output tokens per second of
    the whole run, and its steps (how many computed prompt tokens, the most tokens in one)."""
    return dict(p99_itl_s=r.p99_itl, median_itl_s=r.median_itl, max_itl_s=max(r.itl), num_itl=len(r.itl),
                mean_ttft_s=r.mean_ttft if r.ttft else None, ttft_s=r.ttft, output_tokens=r.output_tokens,
                seconds=r.seconds, output_tok_s=r.output_tokens / r.seconds, steps=len(r.steps),
                prefill_steps=sum(s.is_prefill for s in r.steps), max_step_tokens=max(s.num_tokens for s in r.steps))


def warmup_workload(w: MixedWorkload, budget: int) -> MixedWorkload:
    """A short mixed run for the warm-up: two streams and one prompt of up to two budgets, so that both
    engines run prefills, decodes (and, chunked, a chunk beside decodes) before the clock starts."""
    return MixedWorkload(num_decoding=2, decode_input_len=w.decode_input_len, decode_output_len=8, num_long=1,
                         long_input_len=min(w.long_input_len, 2 * budget), long_output_len=2, first_arrival_step=1,
                         arrival_every=1, seed=w.seed + 1)


def run_mixed_engine(model: str, workload: MixedWorkload, warmup: MixedWorkload, dtype: str,
                     **engine_args) -> tuple[MixedResult, float]:
    """Build an engine (`LLM(model, dtype=dtype, **engine_args)`), run `warmup`, then time `workload`;
    returns the `MixedResult` and the warm-up's seconds."""
    llm = LLM(model, dtype=dtype, **engine_args)
    t0 = time.perf_counter()
    run_mixed(llm.llm_engine, warmup)
    warmup_s = time.perf_counter() - t0
    result = run_mixed(llm.llm_engine, workload)
    del llm
    release_memory()
    return result, warmup_s


def mixed_benchmark(model: str | None, workload: MixedWorkload, budget: int = DEFAULT_MIXED_BUDGET,
                    dtype: str = "float32", threads: int | None = None, **engine_args) -> dict:
    """Run `workload` through chapter 04's prefill-first engine, then through the default engine with
    `max_num_batched_tokens=budget` (same process, model, dtype, threads); return the record.

    Args:
        model: a local model folder (None: the default model).
        workload: the `MixedWorkload` (lengths in tokens, arrivals in engine steps).
        budget: the chunked engine's token budget per step (tokens).
        dtype: the model's dtype name. threads: torch threads (None: as is).
        **engine_args: passed to both `LLM`s (`max_model_len` None: the workload's longest request;
            `max_num_seqs` None: the engine's default, at most `budget`, which must give each a token).
    Returns:
        A dict: `kind` "mixed", the workload, `budget`, per contender (`contenders`: `prefill_first`,
        `chunked`) `p99_itl_s`, `median_itl_s`, `max_itl_s`, `mean_ttft_s`, `output_tok_s` and more
        (`mixed_summary`), `ratios` (chunked / prefill-first of those four), `targets` and
        `meets_targets` (issue 22's), and `environment()`.
    Raises:
        ValueError: a bad engine argument or a workload the engine cannot hold.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    path = str(resolve_model(model))
    engine_args = dict(engine_args, max_model_len=engine_args.get("max_model_len") or longest_request(workload),
                       max_num_seqs=engine_args.get("max_num_seqs") or min(EngineArgs.max_num_seqs, budget))
    warmup = warmup_workload(workload, budget)
    contenders = {PREFILL_FIRST: ("chapter 04's prefill-first Scheduler (chapter 09's engine)",
                                  dict(engine_args, scheduler_cls=Scheduler)),
                  CHUNKED: (f"the default engine: chapter 11's token budget of {budget} tokens per step",
                            dict(engine_args, max_num_batched_tokens=budget))}
    runs = {}
    for name, (label, args) in contenders.items():
        print(f"minivllm bench --workload mixed: {label}", file=sys.stderr)
        result, warmup_s = run_mixed_engine(path, workload, warmup, dtype, **args)
        runs[name] = dict(label=label, warmup_s=warmup_s, **mixed_summary(result))
    a, b = runs[PREFILL_FIRST], runs[CHUNKED]
    ratios = {k: (b[f"{k}_s"] / a[f"{k}_s"] if a[f"{k}_s"] and b[f"{k}_s"] is not None else None)
              for k in ("p99_itl", "median_itl", "mean_ttft")}
    ratios["output_tok_s"] = b["output_tok_s"] / a["output_tok_s"]
    meets = dict(p99_itl=ratios["p99_itl"] <= TARGETS["p99_itl_ratio_max"],
                 output_tok_s=ratios["output_tok_s"] >= TARGETS["output_tok_s_ratio_min"])
    device = resolve_device(engine_args.get("device"))
    record = dict(kind="mixed", model=str(model or "default"), dtype=dtype, workload=asdict(workload), budget=budget,
                  engine_args=engine_args, warmup_workload=asdict(warmup), order=list(runs), contenders=runs,
                  ratios=ratios, targets={k: v for k, v in TARGETS.items() if not k.startswith("ch09")},
                  meets_targets=meets)
    record.update(environment())
    return record | dict(note=cpu_bf16_note(dtype, device, record["hardware"]))


def format_mixed_report(r: dict) -> str:
    """The summary `python -m minivllm bench --workload mixed` prints (without `--json`)."""
    w, ratios = r["workload"], r["ratios"]
    lines = [f"CPU: {r['hardware']['cpu']}" + (f"; GPU: {r['hardware']['gpu']}" if r["hardware"].get("gpu") else "")
             + f"; torch threads: {r['threads']}; model {r['model']} ({r['dtype']})",
             f"workload: {w['num_decoding']} streams ({w['decode_input_len']}-token prompts, {w['decode_output_len']} "
             f"tokens each) while {w['num_long']} prompts of {w['long_input_len']} tokens ({w['long_output_len']} "
             f"output tokens each) arrive from step {w['first_arrival_step']}, every {w['arrival_every']} steps; "
             f"seed {w['seed']}"]
    if r.get("note"):
        lines.append(r["note"])
    lines.append(f"{'':15s} {'p99 ITL':>9s} {'median ITL':>11s} {'mean TTFT':>10s} {'output tok/s':>13s}")
    fmt = lambda x, unit="s": "–" if x is None else f"{x:.3f} {unit}"  # noqa: E731
    for name, label in ((PREFILL_FIRST, "prefill-first"), (CHUNKED, f"budget {r['budget']}")):
        c = r["contenders"][name]
        lines.append(f"{label:15s} {fmt(c['p99_itl_s']):>9s} {fmt(c['median_itl_s']):>11s} "
                     f"{fmt(c['mean_ttft_s']):>10s} {c['output_tok_s']:13.1f}")
    ratio = lambda x: "–" if x is None else f"{x:.2f}x"  # noqa: E731
    lines.append(f"{'ratio':15s} {ratio(ratios['p99_itl']):>9s} {ratio(ratios['median_itl']):>11s} "
                 f"{ratio(ratios['mean_ttft']):>10s} {ratio(ratios['output_tok_s']):>13s}   (budget / prefill-first)")
    t, m = r["targets"], r["meets_targets"]
    lines.append(f"targets: p99 ITL <= {t['p99_itl_ratio_max']}x: {'met' if m['p99_itl'] else 'NOT met'}; "
                 f"output tok/s >= {t['output_tok_s_ratio_min']}x: {'met' if m['output_tok_s'] else 'NOT met'}")
    return "\n".join(lines)


def compare_ch09(model: str | None, args: argparse.Namespace, engine_args: dict) -> dict:
    """Chapter 09's `benchmark` with the default engine, then the same workload through chapter 09's
    engine (`scheduler_cls=Scheduler`), in one process; the record gains `ch09_s`, `ch09_tok_s`,
    `ch09_warmup_s`, `ch09_ratio` (default / chapter 09's output tok/s) and `ch09_target_min`."""
    record = benchmark(model, args.num_requests, tuple(args.input_len), tuple(args.output_len), args.shared_prefix,
                       args.seed, args.dtype, args.threads, False, args.hf_batch_size, args.progress, args.roofline,
                       bench_cli.sampling_fields(args), **engine_args)
    path = str(resolve_model(model))
    workload = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len),
                             load_config(path).vocab_size, args.shared_prefix, args.seed)
    print("minivllm bench --compare ch09: chapter 09's engine (chapter 04's prefill-first Scheduler)", file=sys.stderr)
    ch09 = run_engine(path, workload, args.dtype, use_tqdm=args.progress, sampling=bench_cli.sampling_fields(args),
                      scheduler_cls=Scheduler, **engine_args)
    return record | dict(compare="ch09", ch09_s=ch09.seconds, ch09_tok_s=ch09.tok_s,
                         ch09_warmup_s=ch09.extra["warmup_s"], ch09_steps=len(ch09.steps),
                         ch09_ratio=record["engine_tok_s"] / ch09.tok_s, ch09_target_min=TARGETS["ch09_ratio_min"])


def format_ch09_report(r: dict) -> str:
    """Chapter 09's summary and a line for chapter 09's engine and the ratio."""
    return (bench_cli.format_report(r) + f"\nch09  : {r['ch09_tok_s']:8.1f} output tok/s ({r['ch09_s']:.1f} s; "
            f"chapter 04's prefill-first Scheduler)\nratio : {r['ch09_ratio']:.2f}x (default engine / chapter 09's "
            f"engine output tok/s; target >= {r['ch09_target_min']}x)")


def _load_average() -> list[float] | None:
    """The system's 1, 5 and 15-minute load averages (runnable processes; None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def run(args: argparse.Namespace) -> int:
    """`python -m minivllm bench`: `--workload mixed` and `--compare ch09` here, anything else chapter 09's `run`."""
    check_args(args)
    if args.workload != "mixed" and args.compare != "ch09":
        return bench_cli.run(args)
    if args.workload == "mixed":  # chapter 09's checks, on the mixed workload's shortest and longest requests
        w = mixed_workload(args)
        lengths = sorted((w.decode_input_len, w.long_input_len)), sorted((w.decode_output_len, w.long_output_len))
        bench_cli.check_args(argparse.Namespace(**{**vars(args), "input_len": lengths[0], "output_len": lengths[1]}))
    else:
        bench_cli.check_args(args)
    load_start = _load_average()
    threads = args.threads or torch.get_num_threads()
    print(f"minivllm bench on {cpu_model()} with {threads} torch threads", file=sys.stderr)
    engine_args = {k: getattr(args, k) for k in bench_cli.ENGINE_FLAGS if getattr(args, k) is not None}
    if args.no_prefix_caching:
        engine_args["enable_prefix_caching"] = False
    model = args.model
    if args.model_config is not None:
        print(f"minivllm bench: {args.model_config} with dummy weights ({args.dtype})", file=sys.stderr)
        model = str(dummy_model(args.model_config, args.dtype))
    if args.workload == "mixed":
        record = mixed_benchmark(model, mixed_workload(args), args.mixed_budget, args.dtype, args.threads,
                                 **engine_args)
        report = format_mixed_report
    else:
        record, report = compare_ch09(model, args, engine_args), format_ch09_report
    if args.model_config is not None:
        record["model"] = f"{args.model_config} (dummy weights)"
    # what else kept the machine busy: on a shared CPU the contenders' ratio is the figure to trust
    record["load_average"] = dict(start=load_start, end=_load_average())
    if sys.argv[1:2] == ["bench"]:  # run from the shell, not from a test or a notebook
        record["command"] = "python -m minivllm " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.output_json:
        write_json(record, args.output_json)
    print(json.dumps(record) if args.json else report(record))
    return 0
