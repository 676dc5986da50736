"""Chapter 13, tensor parallelism: each parallel layer against its whole counterpart, shards' logits
against the single process (float64), greedy tokens against the single process and transformers with
preemption, prefix caching and chunked prefill, bad settings refused before any process starts, a dead
rank that makes the call raise, two "machines" on 127.0.0.1, and no process left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from minivllm.distributed import rank_checks
from engine_helpers import hf_greedy
from minivllm import LLM, SamplingParams
from minivllm.course import testing
from minivllm.distributed.parallel_state import free_port, run_on_ranks
from minivllm.model_executor.model_loader import load_model
from minivllm.model_executor.models.llama import attention_reference


@pytest.fixture(autouse=True)
def no_process_left():
    """No process that the test started outlives it (processes already there, such as Inductor's compile
    workers from an earlier test's torch.compile, are not the test's)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    deadline = time.monotonic() + 10
    while (children := [p for p in psutil.Process().children(recursive=True) if p.pid not in before]) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not children, f"processes left behind: {[c.cmdline()[:3] for c in children]}"


def single_process_logits(folder, ids):
    model = load_model(folder, torch.float64)
    scale = model.model.layers[0].self_attn.scale
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)),
                                          lambda i, q, k, v: attention_reference(q, k, v, scale)))


@pytest.mark.parametrize("in_features,out_features", [(8, 12), (6, 4)])
def test_column_then_row_parallel_equal_nn_linear(in_features, out_features):
    for rank, result in enumerate(run_on_ranks(rank_checks.parallel_linear_errors, 2, 0, in_features, out_features)):
        assert result["column_shape"] == (5, out_features // 2)
        assert result["column"] < 1e-12 and result["row"] < 1e-12, (rank, result)  # the row bias counted once


@pytest.mark.parametrize("vocab_size,tied", [(100, True), (77, False)])
def test_vocab_parallel_embedding_and_head(vocab_size, tied):
    results = run_on_ranks(rank_checks.vocab_parallel_errors, 2, 1, vocab_size, 8, tied)
    for result in results:
        assert result["embedding"] < 1e-12 and result["shares"] == tied
        assert result["shard_rows"] == 64  # padded to 128 rows, split in two
    assert results[0]["logits"] < 1e-12 and results[0]["logits_shape"] == (vocab_size, vocab_size)
    assert results[1]["logits_shape"] == (vocab_size, 0)  # only rank 0 holds logits


def test_shards_logits_equal_single_process(tiny_model):
    folder, _ = tiny_model
    ids = [1, 5, 9, 33, 7, 100, 2]
    logits = run_on_ranks(rank_checks.shard_logits, 2, folder, ids)[0]
    assert (logits - single_process_logits(folder, ids)).abs().max().item() <= 1e-12


def test_four_ranks_two_kv_heads_replicated(tiny_llama):
    folder, _ = tiny_llama  # 4 heads, 2 KV heads: at tp 4 each KV head lives on two ranks
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    logits = run_on_ranks(rank_checks.shard_logits, 4, folder, ids)[0]
    assert (logits - single_process_logits(folder, ids)).abs().max().item() <= 1e-12


def test_one_kv_head_at_two_ranks(tmp_path):
    testing.make_tiny_model(tmp_path, "qwen2", num_key_value_heads=1)
    ids = [7, 7, 8, 1]
    logits = run_on_ranks(rank_checks.shard_logits, 2, tmp_path, ids)[0]
    assert (logits - single_process_logits(tmp_path, ids)).abs().max().item() <= 1e-12


def shared_prefix_prompts():
    prefix = list(range(3, 40))  # shared: the prefix cache serves the later prompts
    return [prefix + [50 + i] * (i + 1) for i in range(5)] + [[9, 8, 7], list(range(60, 110))]


@pytest.mark.parametrize("tp_size,chunked", [(2, True), (4, False)])
def test_engine_greedy_equals_single_process_and_transformers(tiny_llama, tp_size, chunked):
    """Preemption (a small cache), prefix caching and chunked prefill (a small token budget) at tp 2;
    chapter 04's prefill-first scheduler at tp 4 (KV heads replicated)."""
    from minivllm.core.sched.scheduler import Scheduler
    from engine_helpers import run_engine

    folder, hf_model = tiny_llama
    prompts, sp = shared_prefix_prompts(), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    settings = dict(dtype="float64", block_size=4, num_kvcache_blocks=40, max_model_len=80,
                    max_num_batched_tokens=32 if chunked else 80, max_num_seqs=8)
    if not chunked:
        settings["scheduler_cls"] = Scheduler
    single = [o.outputs[0].token_ids for o in LLM(folder, **settings).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(folder, tensor_parallel_size=tp_size, **settings)
    try:
        engine = llm.llm_engine
        assert type(engine.model_runner).__name__ == ("TensorParallelMixedBatchModelRunner" if chunked
                                                     else "TensorParallelModelRunner")
        outs = [o.outputs[0].token_ids for o in run_engine(engine, prompts, sp)]
        assert engine.scheduler.num_preemptions > 0
        assert outs == single
        assert outs == [hf_greedy(hf_model, p, 12) for p in prompts]
        assert sum(o.num_cached_tokens or 0 for o in llm.generate(prompts[:2], sp, use_tqdm=False)) > 0
    finally:
        llm.llm_engine.shutdown()


def test_sampling_n_and_prompt_logprobs_equal_single_process(tiny_llama):
    """Rank 0 samples from the gathered logits with the same generators: seeded draws, `n` completions
    sharing the prompt's blocks (the ranks copy blocks together) and prompt logprobs equal one process's,
    also when rank 0 takes them 8 rows at a time (3 chunks of the 21-token prompt, each gathered from
    every rank: a rank that ran other chunks would leave the gathers waiting)."""
    folder, _ = tiny_llama
    sp = [SamplingParams(max_tokens=8, temperature=0.9, seed=7, n=3, prompt_logprobs=2, logprobs=1),
          SamplingParams(max_tokens=8, temperature=1.0, top_k=20, seed=3)]
    prompts = [list(range(10, 31)), [4, 4, 4]]

    def run(prompt_chunk_tokens=None, **kw):
        llm = LLM(folder, dtype="float64", block_size=4, **kw)
        try:
            if prompt_chunk_tokens is not None:
                llm.llm_engine.model_runner.prompt_chunk_tokens = prompt_chunk_tokens
            return [([c.token_ids for c in o.outputs], o.prompt_logprobs, [c.logprobs for c in o.outputs])
                    for o in llm.generate(prompts, sp, use_tqdm=False)]
        finally:
            getattr(llm.llm_engine, "shutdown", lambda: None)()

    def close(a, b):
        """Logprob dicts equal in keys and ranks, values within 1e-12: the ranks' partial sums are added in a
        different order than one process's matmul, so float64 may differ in the last bit (as the logits
        tests above allow)."""
        if a is None or b is None:
            return a is b
        return all(x is y if x is None or y is None else
                   x.keys() == y.keys() and all(x[t].rank == y[t].rank and abs(x[t].logprob - y[t].logprob) <= 1e-12
                                                for t in x) for x, y in zip(a, b, strict=True))

    tp, single = run(8, tensor_parallel_size=2), run()
    for (tp_tokens, tp_prompt, tp_samples), (tokens, prompt, samples) in zip(tp, single, strict=True):
        assert tp_tokens == tokens  # the seeded draws are the same tokens
        assert close(tp_prompt, prompt)
        assert all(close(x, y) for x, y in zip(tp_samples, samples, strict=True))


def test_bad_sizes_refused_before_any_process_starts(tmp_path, default_model_dir):
    with pytest.raises(ValueError, match=r"num_attention_heads=9 is not divisible by tensor_parallel_size=2"):
        LLM(default_model_dir, tensor_parallel_size=2)  # SmolLM2: 9 heads, 3 KV heads
    testing.make_tiny_model(tmp_path / "kv", "llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    with pytest.raises(ValueError, match=r"num_key_value_heads=3 neither is divisible by nor divides tensor_parallel_size=2"):
        LLM(tmp_path / "kv", tensor_parallel_size=2)
    testing.make_tiny_model(tmp_path / "mlp", "llama", intermediate_size=130)
    with pytest.raises(ValueError, match=r"intermediate_size=130 is not divisible by tensor_parallel_size=4"):
        LLM(tmp_path / "mlp", tensor_parallel_size=4)
    for bad, message in (({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
                         ({"tensor_parallel_size": 3, "nnodes": 2}, "does not split evenly over nnodes=2"),
                         ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2}, r"node_rank must be in \[0, 1\]"),
                         ({"tensor_parallel_size": 2, "nnodes": 2}, "give master_port")):
        with pytest.raises(ValueError, match=message):
            LLM(tmp_path / "mlp", **bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            LLM(tmp_path / "mlp", tensor_parallel_size=2, device="cuda")
    assert not psutil.Process().children(recursive=True)  # refused before any process started


def test_dead_rank_makes_the_call_raise(tiny_llama):
    folder, _ = tiny_llama
    llm = LLM(folder, dtype="float64", tensor_parallel_size=2, distributed_timeout_seconds=20)
    try:
        sp = SamplingParams(max_tokens=4, temperature=0)
        llm.generate([[1, 2, 3]], sp, use_tqdm=False)
        worker = llm.llm_engine.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            llm.generate([[1, 2, 3]], sp, use_tqdm=False)
        assert time.monotonic() - start < 20
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("flags, message", [
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1, got 0"),
    (["--tensor-parallel-size", "-2"], "--tensor-parallel-size must be >= 1, got -2"),
    (["--nnodes", "1", "--node-rank", "0"], "--nnodes must be >= 2"),
    (["--nnodes", "0"], "--nnodes must be >= 2"),
    (["--distributed-timeout-seconds", "-1"], "--distributed-timeout-seconds must be > 0"),
    (["--distributed-timeout-seconds", "nan"], "--distributed-timeout-seconds must be > 0"),
])
def test_worker_refuses_bad_flags_before_starting_a_rank(flags, message, monkeypatch, capsys):
    """`python -m minivllm worker` names a bad flag in one line (exit 2) before any rank process starts."""
    from minivllm import __main__
    from minivllm.entrypoints import worker_cli

    monkeypatch.setattr(worker_cli, "run_node", lambda *a: pytest.fail("a rank was started"))
    argv = ["worker", "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr",
            "127.0.0.1", "--master-port", "29500", *flags]
    assert __main__.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("port", ["0", "70000", "-1", "abc"])
def test_worker_refuses_a_port_out_of_range_from_the_flag_or_master_port(port, monkeypatch, capsys):
    """A port outside 1 .. 65535 is refused by the parser, whether from `--master-port` or MASTER_PORT; a
    malformed MASTER_PORT does not break the other subcommands (it was read when the parser was built)."""
    from minivllm import __main__
    from minivllm.entrypoints import worker_cli

    monkeypatch.setattr(worker_cli, "run_node", lambda *a: pytest.fail("a rank was started"))
    argv = ["worker", "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1"]
    for env, extra in ((None, ["--master-port", port]), (port, [])):
        if env is None:
            monkeypatch.delenv("MASTER_PORT", raising=False)
        else:
            monkeypatch.setenv("MASTER_PORT", env)
        with pytest.raises(SystemExit) as e:
            __main__.main([*argv, *extra])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--master-port" in err and "1 .. 65535" in err and "Traceback" not in err, err
    monkeypatch.setenv("MASTER_PORT", port)
    with pytest.raises(SystemExit) as e:
        __main__.main(["generate", "--help"])
    assert e.value.code == 0


def test_two_nodes_on_one_machine(tiny_llama):
    """Node 1's ranks start with `python -m minivllm worker` (torchrun's flags) and join node 0's engine."""
    folder, _ = tiny_llama
    port = free_port()
    node1 = subprocess.Popen([sys.executable, "-m", "minivllm", "worker", "--tensor-parallel-size", "4", "--nnodes",
                              "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)])
    prompts, sp = [[1, 5, 9, 33, 7], [100, 2]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    try:
        single = [o.outputs[0].token_ids for o in LLM(folder, dtype="float64").generate(prompts, sp, use_tqdm=False)]
        llm = LLM(folder, dtype="float64", tensor_parallel_size=4, nnodes=2, node_rank=0, master_addr="127.0.0.1",
                  master_port=port)
        try:
            assert len(llm.llm_engine.workers) == 1  # ranks 0 and 1 here, 2 and 3 on "node 1"
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == single
        finally:
            llm.llm_engine.shutdown()
        assert node1.wait(30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


@pytest.mark.slow
def test_default_model_at_three_ranks_equals_one(default_model_dir):
    """SmolLM2-135M: 9 heads, 3 KV heads, 576, 1536 and 49152 all divisible by 3 (float32)."""
    chats = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Name three colors.",
                                                      "Write a haiku about the sea.")]
    sp = SamplingParams(max_tokens=24, temperature=0)
    one = [o.outputs[0].text for o in LLM(default_model_dir).chat(chats, sp, use_tqdm=False)]
    llm = LLM(default_model_dir, tensor_parallel_size=3)
    try:
        assert [o.outputs[0].text for o in llm.chat(chats, sp, use_tqdm=False)] == one
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
def test_default_model_parameters_per_rank(default_model_dir):
    """At tp 3 each rank holds about a third of the weights (norms are whole on every rank)."""
    one = run_on_ranks(rank_checks.parameter_bytes, 1, default_model_dir)[0]
    per_rank = run_on_ranks(rank_checks.parameter_bytes, 3, default_model_dir)
    assert max(per_rank) <= 0.35 * one, (per_rank, one)


@pytest.mark.gpu
def test_nccl_at_world_size_one():
    """The one lent GPU: NCCL joins a group of one, an all-reduce of a CUDA tensor runs, the group is left."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from minivllm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    tp = init_tensor_parallel(0, 1, "127.0.0.1", free_port(), torch.device("cuda"), 60.0)
    try:
        x = torch.arange(4.0, device="cuda")
        torch.distributed.all_reduce(x, group=tp.group)
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        destroy_tensor_parallel()


def test_refusals_after_the_ranks_start_leave_nothing_behind(tiny_llama):
    """A runner that cannot drive the ranks is refused before any starts; a setting refused after they
    started (max_model_len above the model's limit) stops them at once, so a retry works."""
    from minivllm.worker.model_runner import ModelRunner

    folder, _ = tiny_llama
    with pytest.raises(ValueError, match="needs a model runner that drives the other ranks"):
        LLM(folder, dtype="float64", tensor_parallel_size=2, model_runner_cls=ModelRunner)
    assert not psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match="max_model_len=4096"):
        LLM(folder, dtype="float64", tensor_parallel_size=2, max_model_len=4096)
    assert not torch.distributed.is_initialized()
    llm = LLM(folder, dtype="float64", tensor_parallel_size=2)  # the retry
    llm.llm_engine.shutdown()
