"""How much chapter 10's sampler adds to a decode step: greedy against `temperature=0.8, top_p=0.95`.

    python scripts/sampler_overhead.py                       # 32 requests, the default model, CPU
    python scripts/sampler_overhead.py --num-requests 256 --input-len 100 1024 --output-len 32 32 --device cuda

The workload is chapter 09's (`minivllm.benchmarks.workload.make_workload`: random token ids, lengths
uniform in the ranges, seeded). Each run generates it once greedily and once with `temperature=0.8, top_p=0.95` (each
request seeded), alternating, `--repeats` times. From the decode steps that run the whole batch it
reports the mean step time and the mean time of the sampler's call inside those steps (timed around
`model_runner.sampler`), and the sampler's extra time as a share of a greedy decode step. It prints
the CPU model and thread count: on a machine shared with other jobs the figures are noisy, and the
record says so.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minivllm.benchmarks.workload import make_workload  # noqa: E402
from minivllm.llm import LLM  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402


TEXT = ("The lighthouse keeper climbed the stairs every evening, counting the steps as his father had done. "
        "Below him the sea rolled against the rocks, and the gulls settled on the rail to watch the light turn. ")


class TimedSampler:
    """Calls the engine's sampler and records each call's seconds (CUDA synchronized)."""

    def __init__(self, sampler, device: torch.device):
        self.sampler, self.device, self.seconds = sampler, device, []

    def __getattr__(self, name):
        return getattr(self.sampler, name)

    def __call__(self, logits, seqs, generators, default_generator):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        tokens = self.sampler(logits, seqs, generators, default_generator)
        self.seconds.append(time.perf_counter() - start)  # `tokens` is a list: the device work is done
        return tokens


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def measure(llm: LLM, prompts, params, timed: TimedSampler, batch: int) -> tuple[list[float], list[float]]:
    """(decode step seconds, sampler seconds) of the steps that decode the whole batch."""
    engine = llm.llm_engine
    first_step, first_call = len(engine.stats), len(timed.seconds)
    llm.generate(prompts, params, use_tqdm=False)
    steps = engine.stats[first_step:]
    calls = timed.seconds[first_call:]
    assert len(steps) == len(calls), "one sampler call per step"
    full = [(s.seconds, c) for s, c in zip(steps, calls) if not s.is_prefill and s.num_seqs == batch]
    return [s for s, _ in full], [c for _, c in full]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default=None)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=[128, 256])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 32])
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", choices=["random", "text"], default="random",
                    help="random token ids (chapter 09's workload) or English text cut to the same lengths")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.num_requests,
              max_model_len=args.input_len[1] + args.output_len[1] + 8)
    engine = llm.llm_engine
    timed = TimedSampler(engine.model_runner.sampler, engine.model_runner.device)
    engine.model_runner.sampler = timed
    workload = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len),
                             engine.model.config.vocab_size, seed=0)
    prompts = [{"prompt_token_ids": list(p)} for p in workload.prompts]
    if args.prompts == "text":  # natural text gives the peaked distributions of real use
        text = engine.get_tokenizer().encode(" ".join(TEXT for _ in range(40)))
        prompts = [{"prompt_token_ids": text[i:i + len(p)]} for i, p in enumerate(workload.prompts)]
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    sampled = [SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=i, max_tokens=n, ignore_eos=True)
               for i, n in enumerate(workload.output_lens)]
    measure(llm, prompts[:2], greedy[:2], timed, 2)  # warm-up
    runs = {"greedy": ([], []), "sampled": ([], [])}
    for _ in range(args.repeats):
        for name, params in (("greedy", greedy), ("sampled", sampled)):
            steps, calls = measure(llm, prompts, params, timed, args.num_requests)
            runs[name][0].extend(steps)
            runs[name][1].extend(calls)
    med = {name: (statistics.median(s), statistics.median(c)) for name, (s, c) in runs.items()}
    record = dict(
        what="chapter 10 sampler overhead on a decode step", command="python scripts/sampler_overhead.py "
        + " ".join(sys.argv[1:] if argv is None else argv), cpu=cpu_model(), device=str(engine.model_runner.device),
        threads=torch.get_num_threads(), torch=torch.__version__, model=str(engine.args.model or "default (SmolLM2-135M)"),
        dtype=args.dtype, batch=args.num_requests, prompts=args.prompts, input_len=args.input_len, output_len=args.output_len,
        temperature=args.temperature, top_p=args.top_p, decode_steps_measured={k: len(v[0]) for k, v in runs.items()},
        greedy_step_ms=1e3 * med["greedy"][0], sampled_step_ms=1e3 * med["sampled"][0],
        greedy_sampler_ms=1e3 * med["greedy"][1], sampled_sampler_ms=1e3 * med["sampled"][1],
        sampler_extra_share=(med["sampled"][1] - med["greedy"][1]) / med["greedy"][0],
        step_extra_share=(med["sampled"][0] - med["greedy"][0]) / med["greedy"][0],
        note="medians over the decode steps that run the whole batch; the machine may be shared with other jobs")
    if args.json:
        print(json.dumps(record))
    else:
        print(f"{record['cpu']}, {record['threads']} threads, {record['device']}, batch {args.num_requests} "
              f"(machine possibly shared: noisy)")
        print(f"decode step: greedy {record['greedy_step_ms']:.1f} ms, sampled {record['sampled_step_ms']:.1f} ms")
        print(f"sampler call: greedy {record['greedy_sampler_ms']:.2f} ms, sampled {record['sampled_sampler_ms']:.2f} ms")
        print(f"sampler's extra time: {100 * record['sampler_extra_share']:.1f}% of a greedy decode step "
              f"(whole step: {100 * record['step_extra_share']:+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
