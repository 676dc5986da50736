"""Chapter 09 (CPU part): the seeded workload, the transformers baseline, `python -m minivllm bench`,
the warm-up before the clock, the CPU in the record, and scripts/profile_engine.py.

Tests check correctness and the report's fields only; throughput numbers are measured, never asserted.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from minivllm import bench
from minivllm.__main__ import main
from minivllm.bench import make_workload, run_hf
from minivllm.models.llama import load_model
from minivllm.naive import naive_generate
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
    from minivllm.models.llama import LlamaForCausalLM

    folder, _ = tiny_llama
    events: list[str] = []

    def spy(cls, name, event):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            events.append(event(self) if callable(event) else event)
            return original(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, wrapper)

    backend = defaults.attention_backend_for(torch.device("cpu"), torch.float32)  # what LLM() picks here
    spy(backend, "__call__", lambda attn: "prefill attention" if attn.metadata.is_prefill else "decode attention")
    spy(LlamaForCausalLM, "forward", "engine forward")
    spy(transformers.LlamaForCausalLM, "forward", "hf forward")
    timed = bench.timed

    def clocked(fn, *args, **kwargs):
        events.append("clock start")
        try:
            return timed(fn, *args, **kwargs)
        finally:
            events.append("clock stop")
    monkeypatch.setattr(bench, "timed", clocked)

    r = bench.benchmark(str(folder), num_requests=3, input_len=(4, 20), output_len=(2, 6), dtype="float32",
                        compare_hf=True, hf_batch_size=2)
    assert events.count("clock start") == 2  # the engine's clock, then transformers'
    engine_start = events.index("clock start")
    hf_start = events.index("clock start", engine_start + 1)
    before_engine = events[:engine_start]
    assert {"engine forward", "prefill attention", "decode attention"} <= set(before_engine), before_engine
    assert "hf forward" in events[events.index("clock stop"):hf_start]  # transformers' own warm-up
    assert r["engine_warmup_s"] > 0 and r["hf_warmup_s"] > 0


def test_cpu_model_names_the_cpu(monkeypatch):
    monkeypatch.setattr(bench, "_cpuinfo", lambda: {"model name": "AMD EPYC 7763 64-Core Processor",
                                                    "cpu family": "25", "model": "1", "stepping": "1",
                                                    "flags": "fpu avx2 fma avx512f"})
    assert bench.cpu_model() == "AMD EPYC 7763 64-Core Processor (cpu family 25, model 1, stepping 1)"
    env = bench.environment()
    assert env["hardware"]["cpu"] == bench.cpu_model()
    assert env["hardware"]["cpu_isa"] == ["avx2", "fma", "avx512f"]
    monkeypatch.setattr(bench, "_cpuinfo", lambda: {"CPU implementer": "0x41", "CPU part": "0xd0c"})
    assert "0xd0c" in bench.cpu_model()


def test_bench_prints_the_cpu_it_ran_on(tiny_llama, capsys):
    folder, _ = tiny_llama
    assert main(["bench", "--model", str(folder), "--dtype", "float64", "--num-requests", "2", "--input-len", "2",
                 "4", "--output-len", "1", "3", "--json"]) == 0
    captured = capsys.readouterr()
    cpu = bench.cpu_model()
    assert cpu and cpu in captured.err
    assert json.loads(captured.out)["hardware"]["cpu"] == cpu


def _profile_script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "profile_engine.py"
    spec = importlib.util.spec_from_file_location("profile_engine", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_script_accounts_for_every_step(tiny_llama, tmp_path, capsys):
    folder, _ = tiny_llama
    out = tmp_path / "profile.json"
    args = ["--model", str(folder), "--num-requests", "4", "--input-len", "4", "24", "--output-len", "2", "6",
            "--threads", "1", "--out", str(out)]
    assert _profile_script().main(args) == 0
    captured = capsys.readouterr()
    assert bench.cpu_model() in captured.err and "decode" in captured.out
    r = json.loads(out.read_text())
    w = make_workload(4, (4, 24), (2, 6), vocab_size=128, seed=0)
    assert r["command"] == "python scripts/profile_engine.py " + " ".join(args)
    assert r["workload"] == w.spec and r["output_tokens"] == w.num_output_tokens
    assert r["hardware"]["cpu"] == bench.cpu_model() and r["threads"] == 1 and "torch" in r["versions"]
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
