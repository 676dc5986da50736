"""Where the engine's time goes: per step kind (prefill, decode), per part of a step.

    python scripts/profile_engine.py --out results/cpu_profile_headline.json

runs chapter 09's headline workload (`python -m minivllm bench` defaults: 64 requests, prompts
16-512 tokens, outputs 16-256 tokens, seed 0, float32, the default model) through `minivllm.llm.LLM`
once, after the same warm-up as the benchmark (the C++ kernel loaded, a first forward pass), with
wall-clock timers around the parts of a step:

    scheduler      Scheduler.schedule + Scheduler.postprocess (Python bookkeeping)
    prepare        input preparation: a forward pass's time outside the model and the LM head (the flat
                   token list, positions, slot mapping, block tables, the attention metadata)
    linear         every linear layer of the decoder layers (q/k/v, o, gate/up, down projections)
    attention      the attention backend's call (K/V store included), all layers; its K/V store is
                   also timed on its own (`kv_store_s` in each kind's `attention_bound`)
    other ops      the rest of the model's forward pass: embedding, RMSNorm, RoPE, SiLU, residual adds
    lm head        the LM head (hidden state -> logits)
    sampling       ModelRunner.sample
    engine rest    the rest of LLMEngine.step (outputs, statistics) and of LLM.generate's loop

It prints a table and the CPU model, and with `--out` writes one JSON record: the table, the
linear layers' FLOP rate, attention against its bound per step kind, the exact command, versions,
threads, hardware and the date. Attention's bound (chapter 09's roofline terms, `model_cost`, rates from
`measure_peaks` in the run's dtype, measured before the timed run): prefill, its causal (query, key)
pairs' FLOPs at the matmul rate; decode, the K/V bytes it reads at the copy rate. The timers
cost a few microseconds per call (a step takes tens of milliseconds), so the total is within a few
percent of the untimed run. Takes about as long as the engine half of the benchmark (about a minute
on 2 cores for the headline workload). `--num-requests 4 --input-len 4 32 --output-len 2 8 --model
FOLDER` runs a tiny version.
"""
from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
import time
from collections import defaultdict

import torch

from minivllm.benchmarks.env import cpu_model, environment
from minivllm.benchmarks.roofline import measure_peaks, model_cost
from minivllm.benchmarks.runners import warm_up_engine
from minivllm.benchmarks.workload import DEFAULT_INPUT_LEN, DEFAULT_NUM_REQUESTS, DEFAULT_OUTPUT_LEN, make_workload
from minivllm.llm import LLM
from minivllm.transformers_utils.model_files import resolve_model
from minivllm.sampling_params import SamplingParams

PARTS = ("scheduler", "prepare", "linear", "attention", "other ops", "lm head", "sampling", "engine rest")
KINDS = ("prefill", "decode")


class StepTimer:
    """Wall-clock totals per (step kind, part), filled by wrappers around the engine's parts."""

    def __init__(self, sync):
        self.sync = sync  # waits for the device, so that a part's time is its own (CUDA is asynchronous)
        self.kind = "prefill"
        self.seconds = {k: defaultdict(float) for k in KINDS}
        self.steps = {k: 0 for k in KINDS}
        self.tokens = {k: 0 for k in KINDS}
        self.linear_flop = {k: 0 for k in KINDS}
        self.forward_passes = {k: 0 for k in KINDS}
        self.attention_pairs = {k: 0 for k in KINDS}  # causal (query, key) pairs, all sequences of a kind
        self.context_tokens = {k: 0 for k in KINDS}   # tokens attended over (cached and new), summed
        self.running: set[str] = set()  # the parts being timed now (`wrap`)

    def add(self, part: str, seconds: float) -> None:
        self.seconds[self.kind][part] += seconds

    def wrap(self, fn, part: str):
        """`fn` timed as `part`; a call inside another call timed as the same part (chapter 11's mixed-step
        attention calls the backend it wraps) counts once, in the outer call."""
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if part in self.running:
                return fn(*args, **kwargs)
            self.sync()
            self.running.add(part)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                try:
                    self.sync()
                    self.add(part, time.perf_counter() - t0)
                finally:  # a failed sync must not leave the part marked as running (later calls untimed)
                    self.running.discard(part)
        return timed


def instrument(llm: LLM, timer: StepTimer) -> int:
    """Put timers around the engine's parts (instance attributes shadow the methods; hooks on modules).
    Returns the bytes of the timed linear layers' weights (what one forward pass reads)."""
    engine = llm.llm_engine
    runner, scheduler = engine.model_runner, engine.scheduler
    model = runner.model

    schedule = scheduler.schedule

    def schedule_and_note_kind(*args, **kwargs):
        t0 = time.perf_counter()
        seqs, is_prefill = schedule(*args, **kwargs)
        timer.kind = "prefill" if is_prefill else "decode"
        timer.add("scheduler", time.perf_counter() - t0)
        if seqs:
            timer.steps[timer.kind] += 1
            for start, end in (scheduler.scheduled_span(s, is_prefill) for s in seqs):
                q = end - start
                timer.tokens[timer.kind] += q
                timer.attention_pairs[timer.kind] += q * end - q * (q - 1) // 2
                timer.context_tokens[timer.kind] += end
        return seqs, is_prefill

    scheduler.schedule = schedule_and_note_kind
    scheduler.postprocess = timer.wrap(scheduler.postprocess, "scheduler")
    runner.forward_logits = timer.wrap(runner.forward_logits, "pass")  # prepare + model + LM head
    if hasattr(runner, "forward_mixed"):  # chapter 11's mixed steps (prefill chunks beside decodes)
        runner.forward_mixed = timer.wrap(runner.forward_mixed, "pass")
    runner.sample = timer.wrap(runner.sample, "sampling")
    model.compute_logits = timer.wrap(model.compute_logits, "lm head")
    engine.step = timer.wrap(engine.step, "step")  # the whole step; "engine rest" is what the parts leave

    for attn in (runner.attn, getattr(runner, "mixed_attn", None)):  # chapter 11: mixed steps' attention
        if attn is not None:  # a timed subclass: Python looks __call__ up on the class
            methods = {"__call__": timer.wrap(type(attn).__call__, "attention")}
            if hasattr(attn, "store_kvcache"):  # a backend; chapter 11's mixed-step wrapper stores through one
                methods["store_kvcache"] = timer.wrap(type(attn).store_kvcache, "kv store")
            attn.__class__ = type(f"Timed{type(attn).__name__}", (type(attn),), methods)

    def start(module, args):
        timer.sync()
        module._t0 = time.perf_counter()

    def stop(part):
        def hook(module, args, output):
            timer.sync()
            timer.add(part, time.perf_counter() - module._t0)
            if part == "linear":
                rows = args[0].numel() // module.in_features
                timer.linear_flop[timer.kind] += 2 * rows * module.in_features * module.out_features
            elif part == "forward":
                timer.forward_passes[timer.kind] += 1
        return hook

    model.register_forward_pre_hook(start)
    model.register_forward_hook(stop("forward"))
    lm_head = getattr(model, "lm_head", None)
    itemsize = torch.empty((), dtype=runner.dtype).element_size()
    weight_bytes = 0
    timed: list[str] = []  # a linear layer inside a timed one (AMXLinear's oneDNN layer for many rows) is not timed again
    for name, module in model.named_modules():
        if any(name.startswith(t + ".") for t in timed):
            continue
        if module is lm_head:  # timed as "lm head", with what is inside it
            timed.append(name)
        elif hasattr(module, "in_features") and hasattr(module, "out_features"):
            timed.append(name)
            module.register_forward_pre_hook(start)
            module.register_forward_hook(stop("linear"))
            weight_bytes += module.in_features * module.out_features * itemsize
    return weight_bytes


def attention_bound(timer: StepTimer, kind: str, cost, peaks) -> dict:
    """A kind's attention against its bound: prefill FLOPs at the matmul rate, decode K/V bytes read
    at the copy rate (chapter 09's `step_cost` terms, attention only). `ratio` holds the backend's whole
    call against the bound, `without_store_ratio` the call less its K/V store (`kv_store_s`), which the
    bound does not count: what the attention computation itself took."""
    flop = cost.attention_flops_per_pair * timer.attention_pairs[kind]
    kv_bytes = cost.kv_bytes_per_token * timer.context_tokens[kind]
    bound = flop / peaks.matmul_flops_per_s if kind == "prefill" else kv_bytes / peaks.copy_bytes_per_s
    seconds, store = timer.seconds[kind]["attention"], timer.seconds[kind]["kv store"]
    return dict(gflop=flop / 1e9, kv_gbytes=kv_bytes / 1e9, bound_by="matmul rate" if kind == "prefill" else "copy rate",
                bound_s=bound, seconds=seconds, ratio=seconds / bound if bound else None, kv_store_s=store,
                without_store_ratio=(seconds - store) / bound if bound else None)


def table(timer: StepTimer, total: float, cost=None, peaks=None) -> dict:
    """Per kind: steps, tokens, seconds, and each part's seconds (the parts add up to the kind's time);
    with `cost` and `peaks`, attention against its bound (`attention_bound`)."""
    out = {}
    for kind in KINDS:
        s = timer.seconds[kind]
        parts = {"scheduler": s["scheduler"], "prepare": s["pass"] - s["forward"] - s["lm head"], "linear": s["linear"],
                 "attention": s["attention"], "other ops": s["forward"] - s["linear"] - s["attention"],
                 "lm head": s["lm head"], "sampling": s["sampling"]}
        parts["engine rest"] = s["step"] - sum(parts.values())
        out[kind] = dict(steps=timer.steps[kind], tokens=timer.tokens[kind], seconds=s["step"],
                         forward_passes=timer.forward_passes[kind], parts=parts,
                         linear_gflop=timer.linear_flop[kind] / 1e9,
                         linear_gflop_per_s=timer.linear_flop[kind] / 1e9 / s["linear"] if s["linear"] else None)
        if cost is not None and peaks is not None:
            out[kind]["attention_bound"] = attention_bound(timer, kind, cost, peaks)
    out["generate_s"] = total
    out["outside_steps_s"] = total - sum(out[k]["seconds"] for k in KINDS)
    return out


def format_table(t: dict) -> str:
    lines = [f"{'phase':8} {'part':12} {'seconds':>8} {'share':>6}"]
    for kind in KINDS:
        k = t[kind]
        lines.append(f"{kind:8} {'(all)':12} {k['seconds']:8.2f} {100 * k['seconds'] / t['generate_s']:5.1f}%"
                     f"   {k['steps']} steps, {k['tokens']} tokens, {k['forward_passes']} forward passes")
        for part, sec in k["parts"].items():
            lines.append(f"{'':8} {part:12} {sec:8.2f} {100 * sec / t['generate_s']:5.1f}%")
        if k["linear_gflop_per_s"]:
            lines.append(f"{'':8} linear layers: {k['linear_gflop']:.0f} GFLOP at {k['linear_gflop_per_s']:.0f} GFLOP/s")
        if (a := k.get("attention_bound")) and a["ratio"]:
            what = f"{a['gflop']:.0f} GFLOP" if kind == "prefill" else f"{a['kv_gbytes']:.1f} GB of K/V"
            lines.append(f"{'':8} attention: {a['seconds']:.2f} s against {a['bound_s']:.2f} s for {what} at the "
                         f"{a['bound_by']}: {a['ratio']:.2f}x its bound ({a['without_store_ratio']:.2f}x without "
                         f"its K/V store, {a['kv_store_s']:.2f} s)")
    lines.append(f"LLM.generate: {t['generate_s']:.2f} s ({t['outside_steps_s']:.2f} s outside the steps)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="local Hugging Face folder (None: the default model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS)
    p.add_argument("--input-len", type=int, nargs=2, default=list(DEFAULT_INPUT_LEN), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=list(DEFAULT_OUTPUT_LEN), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--threads", type=int, default=None, help="torch threads (None: torch's choice)")
    p.add_argument("--out", default=None, help="write the JSON record to this file")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}; torch threads: {torch.get_num_threads()}", file=sys.stderr)

    path = resolve_model(args.model)
    llm = LLM(str(path), dtype=args.dtype)
    engine = llm.llm_engine
    vocab_size = engine.model.config.vocab_size
    workload = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len), vocab_size,
                             seed=args.seed)
    warmup_s = warm_up_engine(llm)
    device = engine.model_runner.device
    cost = model_cost(engine.model.config, engine.model_runner.dtype)
    peaks = measure_peaks(device, engine.model_runner.dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    timer = StepTimer(sync)
    linear_weight_bytes = instrument(llm, timer)
    prompts = [{"prompt_token_ids": list(p)} for p in workload.prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - t0

    t = table(timer, total, cost, peaks)
    print(format_table(t))
    print(f"rates: matmul {peaks.matmul_flops_per_s / 1e9:.0f} GFLOP/s, copy {peaks.copy_bytes_per_s / 1e9:.1f} GB/s "
          "read + written")
    record = dict(script="scripts/profile_engine.py", model=str(args.model or "default"), dtype=args.dtype,
                  workload=workload.spec, prompt_tokens_total=workload.num_prompt_tokens,
                  output_tokens=workload.num_output_tokens,
                  attention_backend=type(engine.model_runner.attn).__mro__[1].__name__,
                  kv_manager=type(engine.block_manager).__name__, warmup_s=warmup_s,
                  linear_weight_bytes=linear_weight_bytes, profile=t,
                  peaks=dict(matmul_flops_per_s=peaks.matmul_flops_per_s, copy_bytes_per_s=peaks.copy_bytes_per_s,
                             **peaks.detail),
                  command=" ".join(["python scripts/profile_engine.py",
                                    *map(shlex.quote, sys.argv[1:] if argv is None else argv)]))
    record.update(environment())
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(record) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
