"""Chapter 12's load test, through the real server and the real `openai` client: 64 concurrent streaming
clients (`AsyncOpenAI`), a seeded quarter of them leaving after a random number of chunks. Every stream
that stays ends with its finish reason and `data: [DONE]`, its text equals offline `LLM.generate`'s, the
whole run is bounded in time, and afterwards the engine is idle (nothing running or waiting, every KV block
free or free-but-cached) and, once the server stops, no engine-core process is left. With the engine core
in its own process (the default) and in the server's process (`--in-process`)."""
from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("psutil")

from serving_helpers import MAX_MODEL_LEN, MODEL_NAME, Server, make_tiny_chat_model, wait_idle  # noqa: E402

NUM_CLIENTS, NUM_LEAVING = 64, 16
PROMPTS = ["Hello there, my name is", "The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


async def stream(client, prompt: str, max_tokens: int, leave_after: int | None):
    """One streaming completion read as raw SSE lines through the openai client; returns (text, finish
    reason, saw [DONE]), or None when the client left after `leave_after` events."""
    text, reason, done, events = "", None, False, 0
    async with client.completions.with_streaming_response.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) as response:
        async for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            events += 1
            if leave_after is not None and events >= leave_after:
                return None  # leaving the block closes the connection
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
    return text, reason, done


@pytest.mark.parametrize("mode", ["mp", "in-process"])
def test_64_streams_with_random_leavers(tiny_model, tmp_path, mode):
    from minivllm.llm import LLM

    rng = random.Random(2024)
    prompts = [f"{rng.choice(PROMPTS)} {i}" for i in range(NUM_CLIENTS)]
    lengths = [rng.randint(4, 24) for _ in prompts]
    leaving = dict.fromkeys(rng.sample(range(NUM_CLIENTS), NUM_LEAVING))
    leaving = {i: rng.randint(1, 4) for i in leaving}
    offline = LLM(str(tiny_model), dtype="float64", device="cpu", max_model_len=MAX_MODEL_LEN,
                  kv_cache_memory_bytes=16 << 20)
    from minivllm.sampling_params import SamplingParams
    want = [o.outputs[0].text for o in offline.generate(
        prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths], use_tqdm=False)]
    server = Server(tiny_model, tmp_path / "server.log", ["--in-process"] if mode == "in-process" else [])
    try:
        async def main():
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
            tasks = [stream(client, p, n, leaving.get(i)) for i, (p, n) in enumerate(zip(prompts, lengths))]
            return await asyncio.wait_for(asyncio.gather(*tasks), 240)
        results = asyncio.run(main())
        for i, result in enumerate(results):
            if i in leaving:
                assert result is None or result[2], i  # a short request may end before its client leaves
                continue
            text, reason, done = result
            assert done and reason == "length", (i, result)
            assert text == want[i], i
        m = wait_idle(server)
        assert m["vllm:kv_cache_usage_perc"] == 0.0
        assert m["vllm:request_success_total{finished_reason=length}"] >= NUM_CLIENTS - NUM_LEAVING
    finally:
        code = server.stop()
    assert code == 0
    assert not server.orphans(), "an engine-core process outlived the server"


def test_killing_the_server_kills_its_engine_core(tiny_model, tmp_path):
    """kill -9 of the server (no chance to clean up): its engine-core process dies with it (Linux's
    parent-death signal, and the core's own check of its parent), so nothing is left running."""
    import signal
    import tempfile
    import time

    # the killed server cannot remove its socket folder (MPClient's minivllm-zmq-*): it goes in a folder of
    # the test's, removed at the end (a short path: a Unix socket's path is at most 107 bytes)
    sockets = tempfile.TemporaryDirectory(prefix="k9-")
    server = Server(tiny_model, tmp_path / "server.log", env={"TMPDIR": sockets.name})
    core = server.engine_core()
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(10)
    deadline = time.monotonic() + 10
    while core.is_running() and core.status() != "zombie" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not core.is_running() or core.status() == "zombie", "the engine core outlived its killed server"
    server.log.close()
    assert [p.name[:13] for p in Path(sockets.name).iterdir()] == ["minivllm-zmq-"]  # what kill -9 leaves
    sockets.cleanup()
