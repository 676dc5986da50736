"""Where the engine's time goes on chapter 09's GPU workload, and how fast the decode kernel reads.

    python scripts/gpu_profile.py --out results/gpu_profile.json     # on a CUDA machine (about 2 minutes)
    python scripts/gpu_profile.py --dry-run --out /tmp/p.json         # the same stages on a CPU, tiny model

Four measurements (`--stages`, default all), each in this one process:

1. **Step parts** (`parts`). The default assembly (`LLM` on CUDA: Triton kernels, CUDA graphs) runs the
   ladder's workload (Qwen3-0.6B's config with dummy weights, bfloat16 unless `--dtype`, 256 requests
   unless `--num-requests`, prompts and outputs 100-1024 tokens) with wall-clock timers around the parts of
   each step, the device synchronised at each timer: the scheduler (`schedule` + `postprocess`), the
   forward pass (for decode split into the static buffers' filling, `prepare_decode_inputs`, and the
   graph's replay), sampling, and the rest of `LLMEngine.step`. Per step kind (prefill, decode): steps,
   sequences, seconds per part. `--parts-runner graphs` runs it with chapter 08's `CUDAGraphModelRunner`
   instead of the default runner (chapter 11's, whose steps with prompt chunks are one mixed pass each).
2. **Decode kernel bandwidth** (`kernel`). `paged_decode_attention_triton` alone on a random paged cache
   of the model's shape (16 query heads, 8 KV heads, head size 128, the engine's block size), for decode
   batches and context lengths like the workload's: milliseconds per call (CUDA events, median of
   20) and the K/V bytes read per second, next to a plain copy's rate measured here.
3. **Compiled modules** (`modules`). Each module `compile_small_ops` compiles (the layers' RMSNorm,
   Qwen3's per-head q norm on a view of one q/k/v projection, the rotary embedding) at the model's
   shapes for 1 to 1,000 tokens, random inputs: how many outputs differ from eager's.
4. **Compiled small ops, end to end** (`compiled`). The same workload through four engines one after
   the other: the default runner, `CUDAGraphModelRunner`, `CompiledOpsGraphRunner` (chapter 08's graphs
   with `torch.compile` on the RMSNorms and rotary embedding), and `CUDAGraphModelRunner` again as the
   control: output tokens per second of each, and the requests whose greedy tokens the compiled runner
   (and the repeat, and the default runner) share with the first `CUDAGraphModelRunner`. Compare the
   counts only for runs the time limit did not cut (equal output token counts).

The timers of part 1 synchronise the device, so its total is a little above an untimed run's; parts
2 to 4 are untimed by anything else. Writes one JSON record (`--out`) with the exact command,
rewritten after each stage.
"""
from __future__ import annotations

import argparse
import copy
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
    if hasattr(runner, "forward_mixed"):  # chapter 11's runner: a step with prompt chunks is one mixed pass
        runner.forward_mixed = wrap(runner.forward_mixed, "forward")
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
    p.add_argument("--stages", default="parts,kernel,modules,compiled")
    p.add_argument("--dtype", default="bfloat16", help="of the dummy model on CUDA (the ladder's: bfloat16)")
    p.add_argument("--num-requests", type=int, default=256, help="of the ladder's workload, on CUDA")
    p.add_argument("--parts-runner", choices=("default", "graphs"), default="default",
                   help="the parts stage's model runner: the default assembly's, or chapter 08's CUDAGraphModelRunner")
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
        folder, dtype, device = dummy_model("qwen3-0.6b", args.dtype), args.dtype, torch.device("cuda")
        workload = make_workload(args.num_requests, (100, 1024), (100, 1024), vocab_size(folder), seed=0)
        engine_args = {"max_model_len": 2048}  # as the ladder's
        batches, contexts, block_size = (64, 256), (256, 1024), None
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    record = {**environment(), "kind": "gpu_profile", "dry_run": args.dry_run, "workload": workload.spec,
              "command": " ".join(["python scripts/gpu_profile.py", *map(shlex.quote, sys.argv[1:] if argv is None
                                                                          else argv)])}
    if "parts" in stages:
        runner_args = {"model_runner_cls": cuda_graph.CUDAGraphModelRunner} if args.parts_runner == "graphs" else {}
        record["parts"] = step_parts(str(folder), workload, dtype, args.time_limit, sync, **engine_args, **runner_args)
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
    if "modules" in stages:
        record["compiled_modules"] = compiled_modules(Path(folder), device, dtype)
        print(json.dumps(record["compiled_modules"], indent=1), flush=True)
        save(record, args.out)
    if "compiled" in stages:
        runs = {}
        # the compiled runner subclasses CUDAGraphModelRunner: that class, uncompiled, is its like-for-like
        # baseline (the default runner adds mixed prefill/decode steps, which run other kernels); the
        # uncompiled runner a second time is the control: how many requests two identical runs agree on
        for name, cls in (("default runner", None), ("graphs, uncompiled", cuda_graph.CUDAGraphModelRunner),
                          ("compiled small ops", decode_step.CompiledOpsGraphRunner),
                          ("graphs, uncompiled, again", cuda_graph.CUDAGraphModelRunner)):
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
        a, base, b, again = (runs[k].pop("tokens") for k in ("default runner", "graphs, uncompiled",
                                                              "compiled small ops", "graphs, uncompiled, again"))
        runs["requests_with_equal_tokens"] = sum(x == y for x, y in zip(base, b))  # compiled vs its own base
        runs["uncompiled_repeat_equal_tokens"] = sum(x == y for x, y in zip(base, again))  # the control
        runs["default_vs_uncompiled_equal_tokens"] = sum(x == y for x, y in zip(a, base))
        record["compiled"] = runs
        print(json.dumps(runs, indent=1), flush=True)
        save(record, args.out)
    return 0


def compiled_modules(folder: Path, device: torch.device, dtype: str, token_counts=(1, 7, 64, 256, 1000)) -> dict:
    """Outputs of `compile_small_ops`' modules at the model's shapes that differ from eager: the
    layers' RMSNorm over `[T, hidden]`, Qwen3's per-head norm over the q heads' view `[T, H, D]` of one
    `[T, (H + 2 KV) * D]` projection (as `qkv` gives them; the k heads' norm has the same shape but
    for the head count, and is not measured), and the rotary embedding, for T tokens in a step (decode
    batches, prefill chunks); random inputs in `dtype`, one compile of each module on `device`.
    Returns `{module: {T: {"differ": outputs unlike eager's, "of": outputs, "largest": largest
    absolute difference}}}`."""
    from transformers import AutoConfig

    from minivllm.model_executor.models.llama import RMSNorm, RotaryEmbedding, rope_theta_of
    from minivllm.worker.cuda_graph import compile_small_ops

    c = AutoConfig.from_pretrained(folder)
    hidden, heads, kv, eps = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.rms_norm_eps
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    dt, g = getattr(torch, dtype), torch.Generator(device).manual_seed(0)
    with torch.device(device):
        eager = torch.nn.ModuleList([RMSNorm(hidden, eps), RMSNorm(head_dim, eps),
                                     RotaryEmbedding(head_dim, c.max_position_embeddings, rope_theta_of(c))])
    eager = eager.to(dt)
    with torch.no_grad():
        for norm in eager[:2]:
            norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=g, device=device))
    compiled = copy.deepcopy(eager)
    compile_small_ops(compiled)
    found = {}
    with torch.inference_mode():
        for t in token_counts:
            x = (3 * torch.randn(t, hidden, generator=g, device=device)).to(dt)
            qkv = torch.randn(t, (heads + 2 * kv) * head_dim, generator=g, device=device).to(dt)
            q, k = qkv[:, :heads * head_dim].view(t, heads, head_dim), qkv[:, heads * head_dim:(heads + kv) * head_dim]
            k = k.view(t, kv, head_dim)
            pos = torch.randint(0, min(2048, c.max_position_embeddings), (t,), generator=g, device=device)
            got, want = ((m[0](x), m[1](q), *m[2](pos, q, k)) for m in (compiled, eager))
            for name, a, b in zip(("RMSNorm (hidden)", "q_norm (head view)", "rotary q", "rotary k"), got, want):
                found.setdefault(name, {})[t] = {"differ": int((a != b).sum()), "of": a.numel(),
                                                 "largest": float((a.float() - b.float()).abs().max())}
    return found


def save(record: dict, out: str | None) -> None:
    """Write the record so far: a run stopped by a time limit keeps the stages it finished."""
    if out:
        write_json(record, out)


if __name__ == "__main__":
    sys.exit(main())
