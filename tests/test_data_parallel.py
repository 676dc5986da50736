"""Chapter 13, data parallelism: `data_parallel_size` engine cores behind one `DPClient`.

The oracle is the single engine: greedy tokens (and seeded samples, n > 1 included) of `LLM(...,
data_parallel_size=2)` equal `LLM(...)`'s on a tiny float64 model. The load balancer's decisions are
recorded and checked (least loaded first, never a core idle while another has requests waiting); each
core runs on its share of the CPU threads (asked inside the core's process); a core killed with SIGKILL
fails only its own requests (sync `LLM.generate` and `AsyncLLM`), and the other core goes on serving; a
core that fails to start stops the others at once. No process is left behind by any test.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import asdict
from pathlib import Path

import psutil
import pytest
import torch

from minivllm import defaults
from minivllm.config import EngineArgs
from minivllm.course.testing import random_prompts
from minivllm.distributed.data_parallel import DataParallelLLMEngine, DPClient
from minivllm.distributed.executor import ParallelLLMEngine
from minivllm.distributed.parallel_state import ParallelEngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.engine.core_client import EngineDeadError
from minivllm.llm import LLM, run_to_completion, validate_and_add_requests
from minivllm.sampling_params import RequestOutputKind, SamplingParams

ENGINE = dict(dtype="float64", num_kvcache_blocks=256, block_size=4, max_model_len=256, max_num_seqs=8)
PROMPTS = random_prompts(8, 2, 40, seed=13)  # token ids: the tiny model has no tokenizer
THREADS_DIR_ENV = "MINIVLLM_TEST_THREADS_DIR"


@pytest.fixture(autouse=True)
def no_process_left():
    """Every test ends with no child process of this pytest process left (engine cores, their ranks)."""
    before = set(psutil.Process().children(recursive=True))
    yield
    deadline = time.monotonic() + 10
    while (left := set(psutil.Process().children(recursive=True)) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind: {[p.cmdline()[:4] for p in left]}"


@pytest.fixture
def child_imports_this_module(monkeypatch):
    """Engine cores are fresh interpreters: let them import this file's engine classes by name."""
    tests = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p))


def dp_args(folder, **kwargs) -> ParallelEngineArgs:
    return defaults.complete_engine_args(ParallelEngineArgs(model=str(folder), **{**ENGINE, **kwargs}))


def greedy(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True)


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


# ----------------------------------------------------------------------------------- engines run in the cores
class ThreadCountingEngine(ParallelLLMEngine):
    """Writes the torch threads the engine core runs with into `$MINIVLLM_TEST_THREADS_DIR/<pid>`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        Path(os.environ[THREADS_DIR_ENV], str(os.getpid())).write_text(str(torch.get_num_threads()))


class OddPortFailsEngine(ParallelLLMEngine):
    """Core 1 (its `master_port` is `master_port + 1`, odd here) fails at once; core 0 loads for 120 s."""

    def __init__(self, **kwargs):
        if kwargs["master_port"] % 2:
            raise RuntimeError("this core cannot start")
        time.sleep(120)
        super().__init__(**kwargs)


class RecordingDPClient(DPClient):
    """A `DPClient` that records each routing decision (every core's load then, the core chosen) and each
    core's reports `(core, waiting, running)`."""

    def __init__(self, args, **kwargs):
        super().__init__(args, engine_cls=ThreadCountingEngine)
        self.decisions, self.reports = [], []

    def add_request(self, request):
        loads = self.loads()
        super().add_request(request)
        self.decisions.append((loads, self.owner[request.request_id]))

    def _received(self, i, outputs):
        if (s := outputs.scheduler_stats) is not None:
            self.reports.append((i, s.num_waiting, s.num_running))
        return super()._received(i, outputs)


class RecordingEngine(DataParallelLLMEngine):
    client_cls = RecordingDPClient


def logprobs_close(a: list | None, b: list | None) -> bool:
    """Per position, the same tokens, ranks and decoded text, log-probabilities within 1e-12 (a core runs on
    half the threads, so float64 sums may differ in the last bit); None where the other has None."""
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        x is y if x is None or y is None else x.keys() == y.keys() and all(
            x[t].rank == y[t].rank and x[t].decoded_token == y[t].decoded_token
            and abs(x[t].logprob - y[t].logprob) <= 1e-12 for t in x) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------------- tests
def test_greedy_and_seeded_outputs_equal_one_engine_and_a_dead_core_fails_only_its_requests(tiny_llama):
    folder, _ = tiny_llama
    params = [greedy(i) for i in range(len(PROMPTS))]
    seeded = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=8)  # its completions go to both cores
    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, logprobs=2)  # each core scores its prompts
    one = LLM(str(folder), **ENGINE)
    expected, expected_n = one.generate(PROMPTS, params, use_tqdm=False), one.generate(PROMPTS[0], seeded, use_tqdm=False)
    expected_scored = one.generate(PROMPTS, scored, use_tqdm=False)
    llm = LLM(str(folder), data_parallel_size=2, **ENGINE)
    engine = llm.llm_engine
    try:
        assert isinstance(engine, DataParallelLLMEngine)
        assert token_ids(llm.generate(PROMPTS, params, use_tqdm=False)) == token_ids(expected)
        assert token_ids(llm.generate(PROMPTS[0], seeded, use_tqdm=False)) == token_ids(expected_n)
        got_scored = llm.generate(PROMPTS, scored, use_tqdm=False)
        assert token_ids(got_scored) == token_ids(expected_scored)
        for a, b in zip(got_scored, expected_scored, strict=True):
            assert logprobs_close(a.prompt_logprobs, b.prompt_logprobs)
            assert logprobs_close(a.outputs[0].logprobs, b.outputs[0].logprobs)
        assert all(n > 0 for n in engine.client.num_routed)
        assert {s.engine_index for s in engine.stats} == {0, 1}
        assert any(s.is_prefill for s in engine.stats) and all(s.seconds >= 0 for s in engine.stats)

        ids = validate_and_add_requests(engine, PROMPTS[:4], [greedy(20)] * 4)  # routed 0, 1, 0, 1
        assert sorted(engine.client.owner[i] for i in ids) == [0, 0, 1, 1]
        os.kill(engine.client.cores[1].process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="engine core 1"):
            run_to_completion(engine, ids, use_tqdm=False)
        assert not engine.has_unfinished_requests() and not engine.client.owner
        assert token_ids(llm.generate(PROMPTS, params, use_tqdm=False)) == token_ids(expected)  # on core 0
        assert engine.client.dead.keys() == {1} and engine.client.is_alive()
    finally:
        engine.shutdown()
        engine.shutdown()  # idempotent


def test_tensor_parallel_inside_data_parallel_equals_one_engine(tiny_llama):
    folder, _ = tiny_llama
    params = [greedy(i) for i in range(len(PROMPTS))]
    expected = LLM(str(folder), **ENGINE).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(str(folder), tensor_parallel_size=2, data_parallel_size=2, **ENGINE)
    try:
        cores = [psutil.Process(c.process.pid) for c in llm.llm_engine.client.cores]
        assert [len(c.children()) for c in cores] == [1, 1]  # each core runs rank 0 and starts rank 1
        assert token_ids(llm.generate(PROMPTS, params, use_tqdm=False)) == token_ids(expected)
    finally:
        llm.llm_engine.shutdown()


def test_requests_go_to_the_least_loaded_core_on_its_share_of_threads(tiny_llama, child_imports_this_module,
                                                                       tmp_path, monkeypatch):
    folder, _ = tiny_llama
    monkeypatch.setenv(THREADS_DIR_ENV, str(tmp_path))
    args = dp_args(folder, data_parallel_size=2, max_num_seqs=2)  # 3 requests per core: one waits
    engine = RecordingEngine(**asdict(args))
    client = engine.client
    try:
        ids = validate_and_add_requests(engine, PROMPTS[:6], [greedy(9)] * 6)
        run_to_completion(engine, ids, use_tqdm=False)
        decisions, reports, loads_after = list(client.decisions), list(client.reports), client.loads()
        threads = {int(p.name): int(p.read_text()) for p in tmp_path.iterdir()}
        assert threads == {c.process.pid: max(1, torch.get_num_threads() // 2) for c in client.cores}

        # the cores' reports, not only what was sent to them, decide: 3 running requests sent 0, 1, 0 ...
        delta = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        ids = [engine.add_request(None, PROMPTS[k], delta) for k in range(3)]
        deadline = time.monotonic() + 60
        while [(s.num_waiting, s.num_running) for s in client.latest] != [(0, 2), (0, 1)] or any(client.sent_since_report):
            assert time.monotonic() < deadline, client.latest
            engine.step()
        ids.append(engine.add_request(None, PROMPTS[3], delta))  # ... then core 1 (2 running on core 0, 1 on core 1)
        assert [client.owner[i] for i in ids] == [0, 1, 0, 1]
        engine.abort_request(ids)
        assert not engine.has_unfinished_requests() and not client.owner
    finally:
        engine.shutdown()
    assert [core for _, core in decisions] == [0, 1, 0, 1, 0, 1]
    for loads, core in decisions:
        scores = [4 * w + r for w, r in loads]
        assert scores[core] == min(scores)  # the least loaded (waiting * 4 + running), ties to the lowest index
        assert loads[core] == (0, 0) or (0, 0) not in loads  # never queued behind work while a core was idle
    assert {core for core, _, _ in reports} == {0, 1}
    assert all(waiting + running <= 3 and running <= 2 for _, waiting, running in reports)
    assert any(waiting > 0 for _, waiting, _ in reports)  # max_num_seqs=2: each core's third request waited
    assert loads_after == [(0, 0), (0, 0)]  # everything finished: the last reports say so


def test_a_killed_core_fails_only_its_requests_in_async_llm(tiny_llama):
    folder, _ = tiny_llama
    args = dp_args(folder, data_parallel_size=2)
    client = DPClient(args)
    llm = AsyncLLM(args, engine_core=client)
    long = SamplingParams(max_tokens=150, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def drain(gen) -> int:
        return sum([len(out.outputs[0].token_ids) async for out in gen])

    async def main():
        gens = {f"r{k}": llm.generate(PROMPTS[k], long, f"r{k}") for k in range(4)}
        gens["n2"] = llm.generate(PROMPTS[4], SamplingParams(n=2, max_tokens=150, ignore_eos=True, seed=1,
                                                             output_kind=RequestOutputKind.DELTA), "n2")
        # every request is sent before the output handler reads anything: routed 0, 1, 0, 1, 0, 1
        firsts = dict(zip(gens, [len(out.outputs[0].token_ids) for out in
                                 await asyncio.gather(*(anext(gen) for gen in gens.values()))]))
        owners = dict(client.owner)
        assert owners == {"r0": 0, "r1": 1, "r2": 0, "r3": 1, "n2": 0, "1_n2": 1}
        os.kill(client.cores[1].process.pid, signal.SIGKILL)
        results = await asyncio.gather(*(drain(g) for g in gens.values()), return_exceptions=True)
        for rid, result in zip(gens, results):
            if owners[rid] == 1 or rid == "n2":  # n2 lost one of its completions: the whole request fails
                assert isinstance(result, EngineDeadError) and "engine core 1" in str(result), (rid, result)
            else:
                assert not isinstance(result, BaseException) and result + firsts[rid] == 150, (rid, repr(result))
        assert not llm.errored and not client.owner  # n2's completion on core 0 was aborted
        final = [out async for out in llm.generate(PROMPTS[5], SamplingParams(max_tokens=5), "after")][-1]
        assert final.finished and len(final.outputs[0].token_ids) == 5
        assert client.num_routed == [4, 3]  # core 0: r0, r2 and one of n2's; then "after"
        stats = llm.scheduler_stats
        assert stats.num_running + stats.num_waiting == 0 and stats.kv_cache_usage == 0.0

    async def in_a_new_event_loop():  # as a notebook's second asyncio.run: the client follows the new loop
        outs = [out async for out in llm.generate(PROMPTS[6], SamplingParams(max_tokens=3), "again")]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    try:
        asyncio.run(main())
        asyncio.run(in_a_new_event_loop())
    finally:
        llm.shutdown()


def test_a_core_that_fails_to_start_stops_the_others_at_once(tiny_llama, child_imports_this_module):
    folder, _ = tiny_llama
    args = dp_args(folder, data_parallel_size=2, master_port=28000)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="(?s)engine core 1 failed to start.*this core cannot start"):
        DPClient(args, engine_cls=OddPortFailsEngine)
    assert time.monotonic() - start < 60  # core 0 was killed while it still "loaded"


def test_bad_settings_are_refused_before_any_process_starts(tiny_llama):
    folder, _ = tiny_llama
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1, got 0"):
        LLM(str(folder), data_parallel_size=0, **ENGINE)
    with pytest.raises(ValueError, match="data_parallel_size must be an int"):
        LLM(str(folder), data_parallel_size=1.5, **ENGINE)
    with pytest.raises(ValueError, match="needs a ParallelEngineArgs"):
        DPClient(defaults.complete_engine_args(EngineArgs(model=str(folder), **ENGINE)))


def test_serve_with_two_engine_cores(tmp_path):
    """`python -m minivllm serve --data-parallel-size 2`: two engine-core processes, requests sent at once
    all answered, `/metrics` counting them over both cores; `--in-process` with it is refused."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from serving_helpers import MODEL_NAME, Server, make_tiny_chat_model, wait_idle

    model = make_tiny_chat_model(tmp_path / "model")
    server = Server(model, tmp_path / "server.log", ["--data-parallel-size", "2"])
    try:
        cores = [p for p in server.children if "run_engine_core" in " ".join(p.cmdline())]
        assert len(cores) == 2
        body = dict(model=MODEL_NAME, prompt="Hello, my name is", max_tokens=7, temperature=0)
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: httpx.post(f"{server.url}/v1/completions", json=body, timeout=60),
                                    range(6)))
        assert [a.status_code for a in answers] == [200] * 6
        assert len({a.json()["choices"][0]["text"] for a in answers}) == 1  # greedy: the same on both cores
        m = wait_idle(server)
        assert m["vllm:request_success_total{finished_reason=length}"] == 6
        assert m["vllm:generation_tokens_total"] == 6 * 7
        assert 0 <= m["vllm:kv_cache_usage_perc"] <= 1
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        assert server.stop() == 0, Path(server.log.name).read_text()[-3000:]
    assert not server.orphans()
    refused = subprocess.run([sys.executable, "-m", "minivllm", "serve", "--model", str(model), "--device", "cpu",
                              "--in-process", "--data-parallel-size", "2"], capture_output=True, text=True,
                             timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert refused.returncode == 2 and "--in-process" in refused.stderr, refused.stderr[-2000:]


def test_unseeded_samples_differ_across_cores(tiny_llama):
    """Each core seeds its unseeded requests' generator differently (seed + core index): n unseeded
    samples split over two cores are not copies of each other."""
    folder, _ = tiny_llama
    llm = LLM(folder, data_parallel_size=2, **ENGINE)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(n=4, temperature=1.0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0]
        samples = [tuple(c.token_ids) for c in out.outputs]
        assert len(set(samples)) == 4, samples
    finally:
        llm.llm_engine.shutdown()
