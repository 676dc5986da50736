"""Where the engine's time goes on chapter 09's GPU workload, and how fast the decode kernel reads.

    python scripts/gpu_profile.py --out results/gpu_profile.json     # on a CUDA machine (about 2 minutes)
    python scripts/gpu_profile.py --dry-run --out /tmp/p.json         # the same stages on a CPU, tiny model

Three measurements, each in this one process:

1. **Step parts.** The default assembly (`LLM` on CUDA: Triton kernels, CUDA graphs) runs the ladder's
   workload (Qwen3-0.6B's config with dummy bfloat16 weights, 256 requests, prompts and outputs
   100-1024 tokens) with wall-clock timers around the parts of each step, the device synchronised at
   each timer: the scheduler (`schedule` + `postprocess`), the forward pass (for decode split into the
   static buffers' filling, `prepare_decode_inputs`, and the graph's replay), sampling, and the rest of
   `LLMEngine.step`. Per step kind (prefill, decode): steps, sequences, seconds per part.
2. **Decode kernel bandwidth.** `paged_decode_attention_triton` alone on a random paged cache of the
   model's shape (16 query heads, 8 KV heads, head size 128, the engine's block size), for decode
   batches and context lengths like the workload's: milliseconds per call (CUDA events, median of
   20) and the K/V bytes read per second, next to a plain copy's rate measured here.
3. **Compiled small ops, end to end.** The same workload with `CompiledOpsGraphRunner` (chapter 08's
   graphs with `torch.compile` on the RMSNorms and rotary embedding) against the default runner:
   output tokens per second of each, measured one after the other.

The timers of part 1 synchronise the device, so its total is a little above an untimed run's; parts
2 and 3 are untimed by anything else. Writes one JSON record (`--out`) with the exact command,
rewritten after each stage.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minivllm.benchmarks import decode_step  # noqa: E402
from minivllm.worker import cuda_graph  # noqa: E402
from minivllm.benchmarks.dummy import dummy_model  # noqa: E402
from minivllm.benchmarks.env import environment, write_json  # noqa: E402
from minivllm.benchmarks.runners import bench_params, generate_until, release_memory, warm_up_engine  # noqa: E402
from minivllm.benchmarks.workload import make_workload  # noqa: E402
from minivllm.llm import LLM  # noqa: E402


def timed_parts(llm: LLM, sync) -> tuple[dict, dict]:
    """Wrap the engine's parts with synchronised timers; returns (seconds per kind and part, counts per kind)."""
    engine = llm.llm_engine
    runner, scheduler = engine.model_runner, engine.scheduler
    seconds = {"prefill": defaultdict(float), "decode": defaultdict(float)}
    counts = {"prefill": defaultdict(int), "decode": defaultdict(int)}
    state = {"kind": "prefill"}

    def wrap(fn, part):
        def timed(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                seconds[state["kind"]][part] += time.perf_counter() - t0
        return timed

    schedule = scheduler.schedule

    def schedule_and_note(*args, **kwargs):
        t0 = time.perf_counter()
        seqs, is_prefill = schedule(*args, **kwargs)
        state["kind"] = "prefill" if is_prefill else "decode"
        seconds[state["kind"]]["scheduler"] += time.perf_counter() - t0
        if seqs:
            counts[state["kind"]]["steps"] += 1
            counts[state["kind"]]["seqs"] += len(seqs)
        return seqs, is_prefill

    scheduler.schedule = schedule_and_note
    scheduler.postprocess = wrap(scheduler.postprocess, "scheduler")
    runner.forward_logits = wrap(runner.forward_logits, "forward")
    runner.sample = wrap(runner.sample, "sampling")
    engine.step = wrap(engine.step, "step")
    cuda_graph.prepare_decode_inputs = wrap(cuda_graph.prepare_decode_inputs, "graph inputs")
    graphs = getattr(runner, "decode_graphs", None)
    for graph in (graphs.graphs.values() if graphs else ()):
        graph.replay = wrap(graph.replay, "graph replay")
    return seconds, counts


def step_parts(folder: str, workload, dtype: str, time_limit: float, sync, **engine_args) -> dict:
    llm = LLM(folder, dtype=dtype, **engine_args)
    warm_up_engine(llm)
    seconds, counts = timed_parts(llm, sync)
    prompts = [{"prompt_token_ids": list(p)} for p in workload.prompts]
    t0 = time.perf_counter()
    tokens, _ = generate_until(llm.llm_engine, prompts, bench_params(workload), time_limit)
    total = time.perf_counter() - t0
    out = {"seconds": total, "output_tokens": sum(map(len, tokens)),
           "runner": type(llm.llm_engine.model_runner).__name__,
           "attention_backend": type(llm.llm_engine.model_runner.attn).__name__,
           "block_size": llm.llm_engine.block_manager.block_size}
    for kind in ("prefill", "decode"):
        s = dict(seconds[kind])
        s["engine rest"] = s.get("step", 0.0) - sum(v for k, v in s.items()
                                                    if k in ("scheduler", "forward", "sampling"))
        out[kind] = {"steps": counts[kind]["steps"], "seqs": counts[kind]["seqs"],
                     "seconds": {k: round(v, 4) for k, v in s.items()}}
    del llm, seconds, counts
    release_memory()  # the timers' closures hold the engine in reference cycles
    return out


def kernel_bandwidth(device: torch.device, dtype: torch.dtype, block_size: int, batches, contexts) -> list[dict]:
    from minivllm.attention.ops.triton_attention import choose_num_splits, num_sms, paged_decode_attention_triton

    heads, kv_heads, head_dim = 16, 8, 128
    rows = []
    for b in batches:
        for ctx in contexts:
            blocks_per_seq = -(-ctx // block_size)
            num_blocks = b * blocks_per_seq
            k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            tables = torch.randperm(num_blocks, device=device).view(b, blocks_per_seq)
            lens = torch.full((b,), ctx, device=device, dtype=torch.int64)
            q = torch.randn(b, heads, head_dim, device=device, dtype=dtype)
            call = lambda: paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)  # noqa: E731
            ms = time_ms(call, device)
            kv_bytes = 2 * b * ctx * kv_heads * head_dim * k_cache.element_size()
            rows.append({"batch": b, "context": ctx, "block_size": block_size, "ms": ms,
                         "num_splits": choose_num_splits(b, kv_heads, ctx, num_sms(device)),
                         "kv_gb_per_s": kv_bytes / ms / 1e6})
            del k_cache, v_cache
    return rows


def time_ms(fn, device: torch.device, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    if device.type != "cuda":
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            t.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(t)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_gb_per_s(device: torch.device) -> float:
    x = torch.empty(256 * 2 ** 20, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), device)
    return 2 * x.numel() * 4 / ms / 1e6  # read + written


def vocab_size(folder: Path) -> int:
    return json.loads((Path(folder) / "config.json").read_text())["vocab_size"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU (checks the script)")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per engine run")
    p.add_argument("--stages", default="parts,kernel,compiled")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    stages = set(args.stages.split(","))
    if args.dry_run:
        import tempfile

        from minivllm.course.testing import tiny_config
        config = Path(tempfile.mkdtemp()) / "tiny_qwen3.json"
        tiny_config("qwen3", tie_word_embeddings=True).to_json_file(config, use_diff=False)
        folder, dtype, device = dummy_model(config, "float32"), "float32", torch.device("cpu")
        workload = make_workload(6, (4, 24), (2, 8), vocab_size(folder), seed=0)
        engine_args = {"device": "cpu", "max_model_len": 64}
        batches, contexts, block_size = (2,), (16,), 16
    else:
        folder, dtype, device = dummy_model("qwen3-0.6b", "bfloat16"), "bfloat16", torch.device("cuda")
        workload = make_workload(256, (100, 1024), (100, 1024), vocab_size(folder), seed=0)
        engine_args = {"max_model_len": 2048}  # as the ladder's
        batches, contexts, block_size = (64, 256), (256, 1024), None
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    record = {**environment(), "kind": "gpu_profile", "dry_run": args.dry_run, "workload": workload.spec,
              "command": " ".join(["python scripts/gpu_profile.py", *map(shlex.quote, sys.argv[1:] if argv is None
                                                                          else argv)])}
    if "parts" in stages:
        record["parts"] = step_parts(str(folder), workload, dtype, args.time_limit, sync, **engine_args)
        print(json.dumps(record["parts"], indent=1), flush=True)
        save(record, args.out)
        block_size = block_size or record["parts"]["block_size"]
    if "kernel" in stages and (device.type == "cuda" or args.dry_run):
        if device.type == "cpu":
            import os
            os.environ.setdefault("TRITON_INTERPRET", "1")
        record["copy_gb_per_s"] = copy_gb_per_s(device)
        record["decode_kernel"] = kernel_bandwidth(device, getattr(torch, dtype), block_size or 16, batches, contexts)
        print(json.dumps({"copy_gb_per_s": record["copy_gb_per_s"], "decode_kernel": record["decode_kernel"]},
                         indent=1), flush=True)
        save(record, args.out)
    if "compiled" in stages:
        runs = {}
        for name, cls in (("default runner", None), ("compiled small ops", decode_step.CompiledOpsGraphRunner)):
            llm = LLM(str(folder), dtype=dtype, **engine_args, **({"model_runner_cls": cls} if cls else {}))
            warm_up_engine(llm)
            prompts = [{"prompt_token_ids": list(p)} for p in workload.prompts]
            t0 = time.perf_counter()
            tokens, _ = generate_until(llm.llm_engine, prompts, bench_params(workload), args.time_limit)
            seconds = time.perf_counter() - t0
            n = sum(map(len, tokens))
            runs[name] = {"runner": type(llm.llm_engine.model_runner).__name__, "seconds": seconds,
                          "output_tokens": n, "tok_s": n / seconds, "tokens": tokens}
            print(name, runs[name]["runner"], f"{n / seconds:.1f} tok/s", flush=True)
            del llm
            release_memory()
        a, b = runs["default runner"].pop("tokens"), runs["compiled small ops"].pop("tokens")
        runs["requests_with_equal_tokens"] = sum(x == y for x, y in zip(a, b))
        record["compiled"] = runs
        print(json.dumps(runs, indent=1), flush=True)
        save(record, args.out)
    return 0


def save(record: dict, out: str | None) -> None:
    """Write the record so far: a run stopped by a time limit keeps the stages it finished."""
    if out:
        write_json(record, out)


if __name__ == "__main__":
    sys.exit(main())
