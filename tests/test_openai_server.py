"""Chapter 12's OpenAI-compatible server, tested as its users meet it: `python -m minivllm serve` started as
a process on a free port, and OpenAI's own client (sync and async) talking to it. The tiny float64 Llama
with SmolLM2's tokenizer and chat template keeps each step at milliseconds on a CPU."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from serving_helpers import (ABORT_TIMEOUT_S, MAX_MODEL_LEN, MODEL_NAME, Server, make_tiny_chat_model,  # noqa: E402
                             metrics, wait_idle)

PROMPTS = ["Hello there, my name is", "The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
LONG = 400  # tokens: long enough that a request is still running when the client goes


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    s = Server(tiny_model, tmp_path_factory.mktemp("server") / "server.log")
    yield s
    assert s.stop() == 0, Path(s.log.name).read_text()[-3000:]
    assert not s.orphans(), "an engine-core process outlived the server"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_model):
    from minivllm.llm import LLM

    return LLM(str(tiny_model), dtype="float64", device="cpu", max_model_len=MAX_MODEL_LEN,
               kv_cache_memory_bytes=16 << 20)


def wait_aborted(server, before: dict[str, float], count: int = 1) -> dict[str, float]:
    """Wait until `count` more requests have finished as aborted and nothing runs or waits; returns the
    metrics then, or fails after `ABORT_TIMEOUT_S`. Nothing else is sent meanwhile: after an abort the engine
    core reports its scheduler's state even though no step runs."""
    key = "vllm:request_success_total{finished_reason=abort}"
    deadline = time.monotonic() + ABORT_TIMEOUT_S
    while time.monotonic() < deadline:
        m = metrics(server)
        if m[key] == before[key] + count and m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == 0:
            return m
        time.sleep(0.2)
    pytest.fail(f"the request was not aborted {ABORT_TIMEOUT_S} s after its client left: {metrics(server)}")


def ok(client) -> int:
    """A request that must succeed (the server keeps serving after bad input); returns its tokens."""
    r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
    return 2


# ------------------------------------------------------------------------- without a model: the pieces
class StubTokenizer:
    """Words as tokens, and a chat template that joins the messages: enough for the server's prompts."""

    chat_template = "messages joined with spaces"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(range(len(text.split())))

    def apply_chat_template(self, conversation, add_generation_prompt: bool, tokenize: bool) -> str:
        return " ".join(m["content"] for m in conversation)


class StubEngine:
    """`AsyncLLM`'s interface, generating the words of `WORDS` (and dying after `die_after` outputs)."""

    WORDS = ["Hel", "lo", " wor", "ld"]

    def __init__(self, die_after: int | None = None):
        from types import SimpleNamespace

        self.tokenizer, self.max_model_len, self.errored = StubTokenizer(), 64, False
        self.processor, self.die_after = SimpleNamespace(process=lambda prompt, params: None), die_after

    async def check_health(self) -> None:
        pass

    async def generate(self, prompt, params, request_id):
        from minivllm.engine.core_client import EngineDeadError
        from minivllm.outputs import CompletionOutput, RequestOutput
        from minivllm.sampling_params import RequestOutputKind

        ids, words = prompt["prompt_token_ids"], self.WORDS[:params.max_tokens]
        steps = [(w, [i], i == len(words) - 1) for i, w in enumerate(words)]
        if params.output_kind is RequestOutputKind.FINAL_ONLY:
            steps = [("".join(words), list(range(len(words))), True)]
        for k, (text, tokens, last) in enumerate(steps):
            if k == self.die_after:
                raise EngineDeadError("the engine core died")
            await asyncio.sleep(0)
            outputs = [CompletionOutput(i, text, tokens, finish_reason="length" if last else None)
                       for i in range(params.n)]
            yield RequestOutput(request_id, None, ids, None, outputs, last)


def stub_client(engine) -> "openai.AsyncOpenAI":
    """OpenAI's async client talking to `build_app(engine)` in this process (no socket)."""
    from prometheus_client import CollectorRegistry

    from minivllm.entrypoints.openai.api_server import build_app

    app = build_app(engine, "stub", CollectorRegistry())
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://stub")
    return openai.AsyncOpenAI(base_url="http://stub/v1", api_key="x", http_client=http, max_retries=0)


def test_sse_stream_parsed_by_openai_client():
    async def main():
        client = stub_client(StubEngine())
        full = await client.completions.create(model="stub", prompt="a b c", max_tokens=4)
        stream = await client.completions.create(model="stub", prompt="a b c", max_tokens=4, n=2, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        chat = await client.chat.completions.create(model="stub", messages=CHAT, max_tokens=3, stream=True)
        return full, chunks, [c async for c in chat]

    full, chunks, chat = asyncio.run(main())
    assert full.choices[0].text == "Hello world" and full.usage.completion_tokens == 4
    for i in range(2):
        assert "".join(c.choices[0].text for c in chunks[:-1] if c.choices[0].index == i) == "Hello world"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == 3 and all(c.usage is None for c in chunks[:-1])
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in chat) == "Hello wor"
    assert chat[-1].choices[0].finish_reason == "length"


def test_vllm_sampling_extras_reach_the_engine():
    """vLLM's sampling extras the engine implements are passed on, not dropped (the stub records them)."""
    engine, seen = StubEngine(), []
    generate = engine.generate
    engine.generate = lambda prompt, params, request_id: (seen.append(params), generate(prompt, params, request_id))[1]

    async def main():
        await stub_client(engine).completions.create(model="stub", prompt="a", max_tokens=2, extra_body={
            "spaces_between_special_tokens": False, "skip_special_tokens": False, "min_tokens": 1})

    asyncio.run(main())
    assert (seen[0].spaces_between_special_tokens, seen[0].skip_special_tokens, seen[0].min_tokens) == (False, False, 1)


def test_stream_ends_with_an_error_when_the_engine_dies():
    async def main():
        stream = await stub_client(StubEngine(die_after=2)).completions.create(model="stub", prompt="a", stream=True)
        return [c.choices[0].text async for c in stream]

    with pytest.raises(openai.APIError, match="engine core died"):
        asyncio.run(main())


def test_prometheus_stat_logger():
    from prometheus_client import CollectorRegistry, generate_latest

    from minivllm.metrics.prometheus import PrometheusStatLogger
    from minivllm.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

    registry = CollectorRegistry()
    logger = PrometheusStatLogger(registry, "m")
    for preemptions in (2, 2, 5):  # the engine core's running total
        logger.record(SchedulerStats(num_running=3, num_waiting=1, kv_cache_usage=0.25, num_preemptions=preemptions,
                                     prefix_cache_queries=10, prefix_cache_hits=4), None)
    logger.record(None, IterationStats(num_prompt_tokens=7, num_generation_tokens=3, time_to_first_token=[0.1],
                                       inter_token_latency=[0.02, 0.03],
                                       finished_requests=[FinishedRequestStats("stop", 0.5, 7, 3, 0.1)]))
    samples = {(s.name, s.labels.get("finished_reason")): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples
               if s.labels.get("model_name") == "m"}
    assert samples[("vllm:num_preemptions_total", None)] == 5
    assert samples[("vllm:prefix_cache_queries_total", None)] == 30 and samples[("vllm:prefix_cache_hits_total", None)] == 12
    assert samples[("vllm:num_requests_running", None)] == 3 and samples[("vllm:kv_cache_usage_perc", None)] == 0.25
    assert samples[("vllm:prompt_tokens_total", None)] == 7 and samples[("vllm:generation_tokens_total", None)] == 3
    assert samples[("vllm:request_success_total", "stop")] == 1 and samples[("vllm:request_success_total", "abort")] == 0
    assert samples[("vllm:inter_token_latency_seconds_count", None)] == 2
    assert samples[("vllm:e2e_request_latency_seconds_count", None)] == 1


# ----------------------------------------------------------------------------------------------- basics
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_greedy_completions_match_offline(client, offline):
    from minivllm.sampling_params import SamplingParams

    expected = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for prompt, want in zip(PROMPTS, expected):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == want.outputs[0].text
        assert r.choices[0].finish_reason == want.outputs[0].finish_reason
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_token_id_prompt(client, offline):
    ids = offline.get_tokenizer().encode(PROMPTS[0])
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_chat_matches_offline(client, offline):
    from minivllm.sampling_params import SamplingParams

    want = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)


# -------------------------------------------------------------------------------------------- streaming
def test_completion_stream_concatenates_to_text(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == full.choices[0].finish_reason
    plain = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                           stream=True))
    assert all(c.usage is None and len(c.choices) == 1 for c in plain)  # no usage chunk unless asked for


def test_chat_stream(client):
    full = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == full.choices[0].message.content
    assert body[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_n_and_seed(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=3, seed=1234)
    a, b = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # a seed makes sampling repeat
    assert a.usage.completion_tokens == 3 * 8
    texts = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == [c.text for c in sorted(a.choices, key=lambda c: c.index)]


def test_async_clients_concurrently(server, client):
    want = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=10, temperature=0)

    async def one(aclient, stream: bool) -> str:
        if not stream:
            r = await aclient.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=10, temperature=0)
            return r.choices[0].text
        s = await aclient.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=10, temperature=0,
                                             stream=True)
        return "".join([c.choices[0].text async for c in s])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i % 2 == 0) for i in range(8)))

    assert asyncio.run(main()) == [want.choices[0].text] * 8


def test_the_apps_tokenizer_thread_stops_with_the_app():
    """The app's lifespan shuts its tokenizer thread down when the app stops (uvicorn runs the lifespan, and
    so does Starlette's TestClient), not only `serve_http`: an app a test builds leaves no thread behind."""
    from prometheus_client import CollectorRegistry
    from starlette.testclient import TestClient

    from minivllm.entrypoints.openai.api_server import build_app

    app = build_app(StubEngine(), "stub", CollectorRegistry())
    thread = app.state.serving.tokenizer_thread
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        assert thread.submit(lambda: 7).result() == 7  # serving: the thread takes work
    with pytest.raises(RuntimeError, match="after shutdown"):
        thread.submit(lambda: 7)


def test_the_server_answers_while_a_long_prompt_is_tokenized(server):
    """Tokenizing two megabytes of text takes a second or more; meanwhile the server must go on answering.
    `/health` is asked again and again while the long request runs: a server that tokenizes on its event
    loop answers none of them until that request is done (it then fails: the prompt is longer than the
    context), one that tokenizes on another thread answers them all. The count, not a time, is asserted;
    the pause lets the long request reach the server first."""
    text = "hello world, the quick brown fox. " * 60_000  # 2 MB, about 480,000 tokens
    result: list[httpx.Response] = []

    def send_long():
        result.append(httpx.post(f"{server.url}/v1/completions", timeout=300,
                                 json={"model": MODEL_NAME, "prompt": text, "max_tokens": 1}))

    long_request = threading.Thread(target=send_long)
    long_request.start()
    time.sleep(0.3)
    answered_meanwhile = 0
    while long_request.is_alive():
        assert httpx.get(f"{server.url}/health", timeout=300).status_code == 200
        answered_meanwhile += long_request.is_alive()
    long_request.join()
    assert result[0].status_code == 400 and "maximum context length" in result[0].text, result[0].text
    assert answered_meanwhile >= 5, f"/health was answered {answered_meanwhile} times while the long prompt was tokenized"


# ------------------------------------------------------------------------------------ stop and logprobs
def test_stop_string(client):
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(base[i:i + 3] for i in range(2, len(base) - 3) if base[i:i + 3].strip())
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == base[:base.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                         stop=stop, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_completion_logprobs(client, offline):
    from minivllm.sampling_params import SamplingParams

    want = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, logprobs=2),
                            use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    for got, step, token in zip(lp.token_logprobs, want.logprobs, want.token_ids):
        assert got == pytest.approx(step[token].logprob, abs=1e-9)
    assert all(2 <= len(top) <= 3 and max(top.values()) >= chosen for top, chosen in zip(lp.top_logprobs,
                                                                                         lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the likeliest
        assert bytes(entry.bytes).decode(errors="replace") == entry.token


# ---------------------------------------------------------------------- echo and prompt log-probabilities
@pytest.fixture(scope="module")
def hf_prompt_logprobs(tiny_model, offline):
    """prompt -> (its token ids, per token after the first its log-probability under transformers' float64
    model: log_softmax of the logits at the position before it), the oracle for echo and prompt_logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64).eval()
    tokenizer = offline.llm_engine.tokenizer

    def oracle(prompt: str) -> tuple[list[int], list[float], torch.Tensor]:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        return ids, [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))], logprobs

    return oracle


def check_offsets(lp, start: int = 0) -> None:
    """Each token's text_offset is where its text starts: `start` plus the lengths of the tokens before it."""
    want = [start + sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    assert lp.text_offset == want, (lp.text_offset, want)


def test_echo_with_max_tokens_0_gives_the_prompts_logprobs_as_transformers(client, hf_prompt_logprobs):
    """lm-eval-harness's loglikelihood request (echo, max_tokens 0, logprobs 1, temperature 0): the text is
    the prompt, and per prompt token its log-probability under transformers' model to 1e-9, the first
    null (top_logprobs too); the prompt given as token ids gives the same numbers and its decoded text."""
    prompt = PROMPTS[1]
    ids, want, logprobs = hf_prompt_logprobs(prompt)
    for sent in (prompt, ids):
        r = client.completions.create(model=MODEL_NAME, prompt=sent, echo=True, max_tokens=0, logprobs=1,
                                      temperature=0)
        c = r.choices[0]
        assert c.text == prompt and c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(ids)
        assert c.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-9)
        assert "".join(c.logprobs.tokens) == prompt
        check_offsets(c.logprobs)
        for k, top in enumerate(c.logprobs.top_logprobs[1:], start=1):  # the chosen token and the likeliest
            assert 1 <= len(top) <= 2 and c.logprobs.tokens[k] in top
            assert max(top.values()) == pytest.approx(logprobs[k - 1].max().item(), abs=1e-9)


def test_echo_puts_the_prompt_before_the_completion(client, hf_prompt_logprobs):
    """echo with max_tokens > 0: text = prompt + completion, the logprobs cover the prompt's tokens then the
    generated ones (as the same request without echo gives them), one sequence of text offsets; without
    logprobs, the text alone. The usage counts the generated tokens only."""
    prompt, kw = PROMPTS[0], dict(model=MODEL_NAME, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    ids, want, _ = hf_prompt_logprobs(prompt)
    plain = client.completions.create(prompt=prompt, logprobs=1, **kw)
    r = client.completions.create(prompt=prompt, echo=True, logprobs=1, **kw)
    c, p = r.choices[0], plain.choices[0]
    assert c.text == prompt + p.text and c.finish_reason == p.finish_reason == "length"
    assert c.logprobs.tokens == [*c.logprobs.tokens[:len(ids)], *p.logprobs.tokens]
    assert c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:] == pytest.approx([*want, *p.logprobs.token_logprobs], abs=1e-9)
    assert "".join(c.logprobs.tokens) == c.text
    check_offsets(c.logprobs)
    assert r.usage.model_dump() == plain.usage.model_dump()
    bare = client.completions.create(prompt=prompt, echo=True, **kw).choices[0]
    assert bare.text == c.text and bare.logprobs is None


def test_echo_of_a_list_of_prompts(client, hf_prompt_logprobs):
    """A list of prompts (texts, or token-id lists, as lm-eval-harness batches them) with echo: each choice is
    its prompt, with that prompt's log-probabilities."""
    oracles = [hf_prompt_logprobs(p) for p in PROMPTS]
    for sent in (PROMPTS, [ids for ids, _, _ in oracles]):
        r = client.completions.create(model=MODEL_NAME, prompt=sent, echo=True, max_tokens=0, logprobs=1,
                                      temperature=0)
        assert [c.index for c in r.choices] == [0, 1, 2] and [c.text for c in r.choices] == PROMPTS
        for c, (ids, want, _) in zip(r.choices, oracles):
            assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == len(ids)
            assert c.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-9)


def test_streamed_echo_starts_each_choice_with_its_prompt(client):
    """A stream with echo: each choice's first chunk starts with the prompt (and its logprobs), the chunks of
    a choice join into the non-streamed text and logprobs, and the offsets go on across chunks; with
    max_tokens 0, one chunk per choice: the prompt."""
    prompt, kw = PROMPTS[2], dict(model=MODEL_NAME, echo=True, logprobs=1, temperature=0, n=2)
    for max_tokens in (0, 5):
        whole = client.completions.create(prompt=prompt, max_tokens=max_tokens, **kw)
        chunks = list(client.completions.create(prompt=prompt, max_tokens=max_tokens, stream=True, **kw))
        for i in range(2):
            mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
            assert mine[0].text.startswith(prompt) and mine[-1].finish_reason == whole.choices[i].finish_reason
            assert max_tokens > 0 or len(mine) == 1
            assert "".join(m.text for m in mine) == whole.choices[i].text
            assert [t for m in mine for t in m.logprobs.tokens] == whole.choices[i].logprobs.tokens
            assert [x for m in mine for x in m.logprobs.token_logprobs] == whole.choices[i].logprobs.token_logprobs
            assert [x for m in mine for x in m.logprobs.text_offset] == whole.choices[i].logprobs.text_offset


@pytest.mark.parametrize("kwargs", [dict(prompt=PROMPTS[0], stop=[" zq never"]), dict(prompt="Hi 😀 there", echo=True),
                                    dict(prompt=PROMPTS[1], echo=True, extra_body={"return_tokens_as_token_ids": True})],
                         ids=["text-held-back-for-a-stop-string", "a-character-split-over-tokens", "token-ids-as-names"])
def test_streamed_text_offsets_go_on_as_the_whole_completions_do(client, kwargs):
    """A stream's text offsets run on across its chunks as the non-streamed completion's do (each token's offset:
    the lengths of the tokens before it), also where the text sent so far is not the tokens' texts joined:
    text held back while it may start a stop string, a character split over tokens (each shown as U+FFFD), tokens
    named "token_id:{id}". Counting the text sent instead, the offsets went back, or stayed at 0."""
    kw = dict(model=MODEL_NAME, max_tokens=8, temperature=0, logprobs=1, **kwargs)
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = [ch.choices[0] for ch in client.completions.create(stream=True, **kw) if ch.choices]
    assert [t for c in chunks for t in c.logprobs.tokens] == whole.tokens
    check_offsets(whole)
    assert [x for c in chunks for x in c.logprobs.text_offset] == whole.text_offset


def test_prompt_logprobs_as_vllm_returns_them(client, hf_prompt_logprobs):
    """vLLM's `prompt_logprobs` (k): per choice (chat: per response) a list with null first, then per prompt
    token {token id: {logprob, rank, decoded_token}} holding that token and the k likeliest, the logprobs
    transformers' to 1e-9. More than 20, and any in a stream, are a 400 naming the field, as is
    max_tokens 0 without echo."""
    prompt = PROMPTS[1]
    ids, want, logprobs = hf_prompt_logprobs(prompt)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0, n=2,
                                  extra_body={"prompt_logprobs": 2})
    for c in r.choices:
        got = c.model_extra["prompt_logprobs"]
        assert len(got) == len(ids) and got[0] is None and c.logprobs is None
        for k, (token, entry) in enumerate(zip(ids[1:], got[1:]), start=1):
            assert str(token) in entry and 2 <= len(entry) <= 3
            assert entry[str(token)]["logprob"] == pytest.approx(want[k - 1], abs=1e-9)
            assert {1, 2} <= {e["rank"] for e in entry.values()}
            best = min(entry.values(), key=lambda e: e["rank"])
            assert best["logprob"] == pytest.approx(logprobs[k - 1].max().item(), abs=1e-9)
            assert isinstance(entry[str(token)]["decoded_token"], str)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 1})
    got = chat.model_extra["prompt_logprobs"]
    assert len(got) == chat.usage.prompt_tokens and got[0] is None and all(len(e) <= 2 for e in got[1:])
    for kwargs, match in [(dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs must be in"),
                          (dict(extra_body={"prompt_logprobs": 1}, stream=True), "prompt_logprobs are not available"),
                          (dict(max_tokens=0), "max_tokens")]:
        with pytest.raises(openai.BadRequestError, match=match):
            client.completions.create(model=MODEL_NAME, prompt=prompt, **{"max_tokens": 2, **kwargs})
    ok(client)


# --------------------------------------------------------------------------------- several prompts at once
def test_a_list_of_prompts_gets_n_choices_each(client, offline):
    """OpenAI's list forms of `prompt` (texts, token-id lists; lm-eval-harness sends them): prompt i's n
    choices are i*n .. i*n+n-1 (vLLM's and OpenAI's numbering), each as offline `LLM.generate` samples it
    with the same seed; the usage sums over the prompts; a stream carries the same indices and usage."""
    from minivllm.sampling_params import SamplingParams

    kw = dict(n=2, temperature=0.8, seed=7, max_tokens=6)
    want = offline.generate(PROMPTS, SamplingParams(**kw), use_tqdm=False)
    texts = [c.text for w in want for c in w.outputs]
    usage = (sum(len(w.prompt_token_ids) for w in want), sum(len(c.token_ids) for w in want for c in w.outputs))
    for prompt in (PROMPTS, [w.prompt_token_ids for w in want]):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, **kw)
        assert [c.index for c in r.choices] == list(range(6))
        assert [c.text for c in r.choices] == texts
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == usage
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, stream=True,
                                                stream_options={"include_usage": True}, **kw))
        streamed = {}
        for chunk in chunks[:-1]:
            for c in chunk.choices:
                streamed[c.index] = streamed.get(c.index, "") + c.text
        assert [streamed[i] for i in range(6)] == texts
        assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == r.usage.model_dump()
        assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1
    one = client.completions.create(model=MODEL_NAME, prompt=[PROMPTS[2]], **kw)  # a list of one is one prompt
    assert [c.text for c in one.choices] == texts[4:]


def test_bad_prompt_lists_are_refused_naming_the_prompt(server, client):
    """An empty list is a 400 (no prompt); a bad prompt in a list is a 400 naming it, and nothing of the
    request is left queued."""
    before = wait_idle(server)
    for prompt, match in [([], "prompt is an empty list"), ([[1, 2], []], "empty"),
                          ([PROMPTS[0], "word " * MAX_MODEL_LEN], "maximum context length")]:
        with pytest.raises(openai.BadRequestError, match=match):
            client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": ["Hi", [1, 2]], "max_tokens": 2})
    assert r.status_code == 400, r.text  # texts and token ids are not mixed, as in vLLM
    assert r.json()["error"]["message"].endswith("; got a list holding lists and texts"), r.text  # in one sentence
    after = wait_idle(server)
    assert after["vllm:request_success_total{finished_reason=length}"] == \
        before["vllm:request_success_total{finished_reason=length}"]
    ok(client)


@pytest.mark.parametrize("prompt, says", [
    (["Hi", [1, 2]], "got a list holding lists and texts"), (["Hi", 1], "got a list holding texts and token ids"),
    ([True, False], "got a list holding booleans"), ([1.0, 2.0], "got a list holding numbers"),
    ([[1, 2], [3, None]], r"^prompt\[1\] must be a list of token ids \(integers\); it holds nulls$"),
    (5, "got a JSON number"), ({"text": "Hi"}, "got a JSON object"),
])
def test_a_prompt_in_none_of_openais_forms_is_one_error_saying_so(prompt, says):
    """A prompt that is not a text, a list of texts, a list of token ids or a list of token-id lists is one
    validation error, of `prompt`, that names what came instead (pydantic alone gives one error per form
    it tried, five or six of them); the four forms themselves are taken."""
    from pydantic import ValidationError

    from minivllm.entrypoints.openai.protocol import PROMPT_FORMS, CompletionRequest
    with pytest.raises(ValidationError) as e:
        CompletionRequest(model=MODEL_NAME, prompt=prompt)
    (error,) = e.value.errors()
    message = error["msg"].removeprefix("Value error, ")
    assert error["loc"] == ("prompt",) and re.search(says, message), error
    assert message.startswith(f"prompt must be {PROMPT_FORMS}; ") or message.startswith("prompt[1]"), message
    for good in ["Hi", ["Hi", "there"], [1, 2], [[1], [2, 3]]]:
        assert CompletionRequest(model=MODEL_NAME, prompt=good).prompt == good


def test_a_list_of_prompts_is_aborted_when_its_client_goes(server, client):
    """Every prompt's request stops when the client goes, streamed or not."""
    body = {"model": MODEL_NAME, "prompt": PROMPTS[:2], "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    before = wait_idle(server)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=dict(body, stream=True), timeout=60) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leaving the block closes the connection
    after = wait_aborted(server, before, count=2)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 2 * LONG
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    final = wait_aborted(server, after, count=2)
    assert final["vllm:generation_tokens_total"] - after["vllm:generation_tokens_total"] < 2 * LONG


# ------------------------------------------------------------------------------------- vLLM's extra fields
def test_return_tokens_as_token_ids(client, offline):
    """vLLM's `return_tokens_as_token_ids`: each logprobs token (chosen and top) reads "token_id:{id}", in
    completions (streamed too) and chat; false or absent keeps the text."""
    from minivllm.sampling_params import SamplingParams

    want = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=5, logprobs=2), use_tqdm=False)[0]
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=5, temperature=0, logprobs=2)
    r = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in want.outputs[0].token_ids]
    for top, step in zip(lp.top_logprobs, want.outputs[0].logprobs):
        assert set(top) == {f"token_id:{t}" for t in step}
    streamed = [t for c in client.completions.create(**kw, stream=True, extra_body={"return_tokens_as_token_ids": True})
                for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    plain = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": False}).choices[0].logprobs
    assert "".join(plain.tokens) == r.choices[0].text and not plain.tokens[0].startswith("token_id:")
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    for entry in chat.choices[0].logprobs.content:
        assert entry.token.startswith("token_id:") and bytes(entry.bytes).decode() == entry.token
        assert all(t.token.startswith("token_id:") for t in entry.top_logprobs)


def test_vllm_fields_minivllm_does_not_serve_are_refused_or_ignored_as_vllm_does(client):
    """vLLM's `logits_processors` (refused unless empty: minivllm loads no code named by a request),
    `priority` (nonzero needs priority scheduling: vLLM's FCFS policy refuses it too) and `length_penalty`
    (beam search's alone: ignored otherwise, as vLLM ignores it; a value that is not a number is a 400)."""
    for endpoint in ("completions", "chat"):
        def create(**extra):
            if endpoint == "completions":
                return client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4, temperature=0,
                                                 extra_body=extra).choices[0].text
            return client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0,
                                                  extra_body=extra).choices[0].message.content

        with pytest.raises(openai.BadRequestError, match=r"minivllm does not implement logits_processors=\['my\.Proc'\]"):
            create(logits_processors=["my.Proc"])
        with pytest.raises(openai.BadRequestError, match=r"priority=3 needs priority scheduling.*first come, first served"):
            create(priority=3)
        with pytest.raises(openai.BadRequestError, match="length_penalty"):
            create(length_penalty="long")
        assert create(logits_processors=[], priority=0, length_penalty=0.5) == create()
    ok(client)


def test_a_lone_surrogate_is_refused_as_not_utf8_naming_the_field(server, client):
    """JSON may carry a lone UTF-16 surrogate ("\\ud800"), which no tokenizer takes: the 400 says which field
    is not valid UTF-8 text, in its own words (not the tokenizer's)."""
    for path, body, field in [("completions", rb'{"prompt": "hi \ud800", "max_tokens": 2}', "prompt"),
                              ("completions", rb'{"prompt": ["hi", "a \udfff b"], "max_tokens": 2}', r"prompt\[1\]"),
                              ("chat/completions", rb'{"messages": [{"role": "user", "content": "x"}, '
                                                   rb'{"role": "user", "content": "\ud800"}], "max_tokens": 2}',
                               r"messages\[1\]\.content")]:
        r = httpx.post(f"{server.url}/v1/{path}", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert re.fullmatch(field + r" is not valid UTF-8 text: it holds a lone surrogate \('\\ud[89a-f][0-9a-f]{2}' at "
                            r"character \d+\)", message), message
    ok(client)


# ----------------------------------------------------------------------------------------------- metrics
def test_metrics_count_what_was_sent(server, client):
    before = wait_idle(server)
    results = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=7, temperature=0) for p in PROMPTS]
    results += [client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0, n=2)]
    after = wait_idle(server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["vllm:generation_tokens_total"] == sum(r.usage.completion_tokens for r in results)
    assert delta["vllm:prompt_tokens_total"] == sum(r.usage.prompt_tokens for r in results[:3]) + 2 * \
        results[3].usage.prompt_tokens  # each of the n completions counts its prompt, as in vLLM
    assert delta["vllm:request_success_total{finished_reason=length}"] == 3 + 2
    assert delta["vllm:e2e_request_latency_seconds_count"] == 5
    assert delta["vllm:time_to_first_token_seconds_count"] == 5
    assert 0 <= after["vllm:kv_cache_usage_perc"] <= 1


# ------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("body, status", [
    ({"prompt": "Hi", "temperature": -1}, 400),
    ({"prompt": "Hi", "temperature": "hot"}, 400),
    ({"prompt": "Hi", "max_tokens": "many"}, 400),
    ({"prompt": "Hi", "stop": 5}, 400),
    ({"prompt": "Hi", "n": 0}, 400),
    ({"prompt": "Hi", "logprobs": 1000}, 400),
    ({"prompt": ""}, 400),
    ({"prompt": [10**9]}, 400),
    ({"prompt": [True, False]}, 400),  # not token ids, as the offline API says too
    ({"prompt": [1.0, 2.0]}, 400),
    ({"temperature": 0}, 400),
    ({"prompt": "Hi", "model": "gpt-4"}, 404),
    ({"prompt": "Hi", "max_tokens": 2, "stream_options": {"include_usage": True}}, 400),  # without stream (vLLM)
])
def test_bad_completion_requests(server, client, body, status):
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    ok(client)


def test_bad_requests_through_the_client(server, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="word " * MAX_MODEL_LEN, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                       temperature=3.5, top_p=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.BadRequestError):  # the stream is refused before it starts
        client.completions.create(model=MODEL_NAME, prompt="Hi", temperature=-2, stream=True)
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"messages": [', headers={
        "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    for method, path, content, status in [("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400),  # not UTF-8
                                          ("POST", "/v1/completions", rb'{"prompt": "hi \ud800", "max_tokens": 2}', 400),
                                          ("POST", "/v1/nowhere", b"{}", 404), ("GET", "/v1/completions", None, 405)]:
        r = httpx.request(method, f"{server.url}{path}", content=content, headers={"content-type": "application/json"})
        assert r.status_code == status and r.json()["error"]["code"] == status, (path, r.text)
    ok(client)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
NOT_IMPLEMENTED = [  # (endpoint, field, the client's arguments): each would change the answer
    ("completions", "logit_bias", dict(logit_bias={"7042": -100})),
    ("completions", "allowed_token_ids", dict(extra_body={"allowed_token_ids": [30]})),
    ("completions", "bad_words", dict(extra_body={"bad_words": [" Paris"]})),
    ("completions", "truncate_prompt_tokens", dict(extra_body={"truncate_prompt_tokens": 2})),
    ("completions", "use_beam_search", dict(extra_body={"use_beam_search": True})),
    ("completions", "suffix", dict(suffix="!")),
    ("completions", "best_of", dict(best_of=2)),
    ("completions", "add_special_tokens", dict(extra_body={"add_special_tokens": False})),
    ("chat", "tools", dict(tools=[TOOL])),
    ("chat", "tool_choice", dict(tool_choice="required")),
    ("chat", "tool_choice", dict(tool_choice={"type": "function", "function": {"name": "f"}})),
    ("chat", "chat_template", dict(extra_body={"chat_template": "{{ messages[0]['content'] }}"})),
    ("chat", "continue_final_message", dict(extra_body={"continue_final_message": True})),
    ("chat", "logit_bias", dict(logit_bias={"7042": 5})),
    ("chat", "echo", dict(extra_body={"echo": True})),  # vLLM's chat echo repeats the last message: not served
]


@pytest.mark.parametrize("endpoint, field, kwargs", NOT_IMPLEMENTED, ids=[f"{e}-{f}" for e, f, _ in NOT_IMPLEMENTED])
def test_fields_minivllm_does_not_implement_are_refused(client, endpoint, field, kwargs):
    """A field that would change the answer is refused (400 naming it), not quietly served without it."""
    with pytest.raises(openai.BadRequestError, match=f"minivllm does not implement {field}=") as e:
        if endpoint == "completions":
            client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, **kwargs)
        else:
            client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, **kwargs)
    assert e.value.status_code == 400 and e.value.body["code"] == 400
    ok(client)


def test_continuous_usage_stats_is_refused(client):
    """vLLM's `stream_options.continuous_usage_stats` puts the usage in every chunk; minivllm sends it once, at the
    end (`include_usage`), so the field is refused (400 naming it) instead of quietly leaving every chunk's usage
    null; false asks for nothing and is served."""
    for create, kw in ((client.completions.create, dict(prompt="Hi")), (client.chat.completions.create, dict(messages=CHAT))):
        with pytest.raises(openai.BadRequestError, match="continuous_usage_stats"):
            create(model=MODEL_NAME, max_tokens=2, stream=True,
                   stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw)
        chunks = list(create(model=MODEL_NAME, max_tokens=2, stream=True,
                             stream_options={"include_usage": True, "continuous_usage_stats": False}, **kw))
        assert chunks[-1].usage.completion_tokens == 2 and all(c.usage is None for c in chunks[:-1])
    ok(client)

def test_fields_that_ask_for_nothing_are_served(client):
    """The same fields at values that ask for nothing (their defaults, empty, tool_choice none or auto
    without tools) give the answer the request gives without them."""
    plain = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4, temperature=0).choices[0].text
    same = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4, temperature=0, logit_bias={},
                                     echo=False, best_of=1, user="u", extra_body={
                                         "bad_words": [], "use_beam_search": False, "prompt_logprobs": None})
    assert same.choices[0].text == plain
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0)
    for tool_choice in ("none", "auto"):
        again = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0,
                                               tools=[], tool_choice=tool_choice,
                                               extra_body={"chat_template_kwargs": {}})
        assert again.choices[0].message.content == chat.choices[0].message.content


def test_chat_template_kwargs_reach_the_template(default_model_dir):
    """vLLM's `chat_template_kwargs` are variables the chat template sees (the stub engine records the
    prompt the template made); apply_chat_template's own arguments, or a value that is not an object,
    are a 400 naming the field."""
    from transformers import AutoTokenizer

    engine, seen = StubEngine(), []
    engine.tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    engine.tokenizer.chat_template = "{% if shout %}LOUD {% endif %}{{ messages[0]['content'] }}"
    generate = engine.generate
    engine.generate = lambda prompt, params, request_id: (seen.append(prompt["prompt"]), generate(prompt, params, request_id))[1]

    async def main():
        client = stub_client(engine)
        for kwargs in ({"shout": True}, None):
            await client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                                 extra_body={"chat_template_kwargs": kwargs})
        for bad, match in [({"chat_template": "{{ 1 }}"}, "chat_template"), ("loud", "chat_template_kwargs")]:
            with pytest.raises(openai.BadRequestError, match=match):
                await client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=2, extra_body={"chat_template_kwargs": bad})

    asyncio.run(main())
    assert seen == ["LOUD hi", "hi"], seen


def test_stop_token_ids_outside_the_vocabulary(client):
    """The engine's Processor refuses them (offline too): 400 naming the field, and the server goes on."""
    with pytest.raises(openai.BadRequestError, match=r"stop_token_ids must be integers in \[0, 49152\); got \[1000000\]"):
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, extra_body={"stop_token_ids": [10**6]})
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, extra_body={"stop_token_ids": [-1]})
    ok(client)


def test_max_tokens_larger_than_the_context_leaves_is_refused(client, offline):
    """vLLM's server answers 400 when prompt tokens + max_tokens exceed max_model_len (completions' default
    of 16 included); the offline LLM caps such a request at the end of the context instead, as vLLM's does."""
    from minivllm.sampling_params import SamplingParams

    prompt = [1] * (MAX_MODEL_LEN - 4)
    too_large = (rf"'max_tokens' or 'max_completion_tokens' is too large: {{}}\. This model's maximum context length "
                 rf"is {MAX_MODEL_LEN} tokens and your request has {MAX_MODEL_LEN - 4} input tokens")
    with pytest.raises(openai.BadRequestError, match=too_large.format(5) + rf" \(5 > {MAX_MODEL_LEN} - 1020\)"):
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5)
    with pytest.raises(openai.BadRequestError, match=too_large.format(16)):  # the default
        client.completions.create(model=MODEL_NAME, prompt=prompt)
    with pytest.raises(openai.BadRequestError, match=r"is too large: 5"):
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, stream=True)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    for kwargs in (dict(max_completion_tokens=MAX_MODEL_LEN), dict(max_tokens=MAX_MODEL_LEN),
                   dict(max_tokens=2, max_completion_tokens=MAX_MODEL_LEN)):  # max_completion_tokens wins
        with pytest.raises(openai.BadRequestError, match=rf"is too large: {MAX_MODEL_LEN}\. "):
            client.chat.completions.create(model=MODEL_NAME, messages=CHAT, **kwargs)
    capped = offline.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(capped.token_ids) == 4 and capped.finish_reason == "length"
    ok(client)


def test_chat_errors_name_the_field(client):
    """top_logprobs out of range names top_logprobs (the request's field, not the engine's logprobs); an
    unknown role names the roles there are."""
    for top in (-1, 21):
        with pytest.raises(openai.BadRequestError, match=rf"top_logprobs must be in \[0, 20\], got {top}"):
            client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, logprobs=True, top_logprobs=top)
    roles = r"messages\.1\.role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'"
    with pytest.raises(openai.BadRequestError, match=roles):
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT + [{"role": "wizard", "content": "Abracadabra"}],
                                       max_tokens=2)
    r = client.chat.completions.create(model=MODEL_NAME, max_tokens=2, messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert r.choices[0].finish_reason == "length"
    ok(client)


def test_n_with_stop_strings(server, client, offline):
    """Each of n completions stops at its own stop string in the front end while its siblings run on: the
    engine core may send one more token of a stopped completion before the abort reaches it."""
    from minivllm.sampling_params import SamplingParams

    kw = dict(n=3, temperature=0.8, seed=7, max_tokens=40, stop=["e"])
    for stream in (False, True):
        r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], stream=stream, **kw)
        texts = {}
        for chunk in (r if stream else [r]):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
        want = offline.generate([PROMPTS[0]], SamplingParams(**kw), use_tqdm=False)[0].outputs
        assert [texts[i] for i in range(3)] == [c.text for c in want]
    assert httpx.get(f"{server.url}/health").status_code == 200
    wait_idle(server)
    ok(client)


# ------------------------------------------------------------------------------------------ disconnects
def test_stream_disconnect_aborts(server, client):
    before = wait_idle(server)
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leaving the block closes the connection
    after = wait_aborted(server, before)
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < LONG, "the request ran to its end after its client had gone"


def test_non_stream_disconnect_aborts(server, client):
    before = wait_idle(server)
    impatient = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=LONG, temperature=0,
                                     extra_body={"ignore_eos": True})
    after = wait_aborted(server, before)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < LONG


# ------------------------------------------------------------------------------------------ dead engine
def test_engine_core_killed(tiny_model, tmp_path):
    """kill -9 of the engine core: /health says 503, the open stream ends with an error, new requests get
    503, and the server still stops cleanly with no process left behind."""
    s = Server(tiny_model, tmp_path / "server.log")
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=30)
        ok(c)
        stream = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=LONG, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks), next(chunks)
        os.kill(s.engine_core().pid, signal.SIGKILL)
        with pytest.raises(openai.APIError):
            for _ in chunks:
                pass
        assert httpx.get(f"{s.url}/health").status_code == 503
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
        assert e.value.status_code == 503
    finally:
        code = s.stop()
    assert code == 0, (tmp_path / "server.log").read_text()[-3000:]
    assert not s.orphans()


# ------------------------------------------------------------------------------------------- bad start-up
def _serve_refused(*flags: str, tag: str = "") -> subprocess.CompletedProcess:
    """`python -m minivllm serve` with `flags`; `tag` goes into its environment (its engine cores inherit it)."""
    from serving_helpers import SERVER_FLAGS

    return subprocess.run([sys.executable, "-m", "minivllm", "serve", *SERVER_FLAGS, *flags], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
                          env={**os.environ, TAG_ENV: tag})


def _one_error_line(done: subprocess.CompletedProcess, expected: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], done.stderr[-3000:]


def test_serve_refuses_a_taken_port_before_it_loads_the_model(tiny_model):
    """A port another socket holds: exit status 2 and one `error:` line naming the address, and no engine
    core was started for it (the address is bound before the model loads)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _serve_refused("--model", str(tiny_model), "--port", str(port))
    _one_error_line(done, f"cannot listen on 127.0.0.1:{port}")
    assert "engine core" not in done.stderr.lower(), done.stderr[-3000:]


def test_a_bound_port_is_not_shared():
    """Two servers started at once on one port: the second's `bind_socket` fails at once. (With
    SO_REUSEADDR, Linux lets two sockets bind one port until one of them listens; a socket that only
    bound would let the second server load its model and fail later, in uvicorn.)"""
    from minivllm.entrypoints.openai.api_server import bind_socket

    with bind_socket("127.0.0.1", 0) as first:
        port = first.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind_socket("127.0.0.1", port).close()


def test_the_ready_line_is_a_url_for_an_ipv6_address_too(capsys):
    """`serve --host ::1` printed `http://::1:PORT`, which no client parses; an IPv6 address in a URL goes
    in brackets. A real uvicorn server on the IPv6 loopback (skipped where this machine has none)."""
    import uvicorn
    from fastapi import FastAPI

    from minivllm.entrypoints.openai.api_server import bind_socket, serve_until_stopped

    try:
        sock = bind_socket("::1", 0)
    except ValueError:
        pytest.skip("no IPv6 loopback on this machine")
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(FastAPI(), log_level="warning"))

    async def serve_then_stop():
        serving = asyncio.create_task(serve_until_stopped(server, sock))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        server.should_exit = True
        await serving

    with sock:
        asyncio.run(serve_then_stop())
    url = capsys.readouterr().out.strip().removeprefix("minivllm serve: listening on ")
    assert url == f"http://[::1]:{port}" and httpx.URL(url).port == port, url


@pytest.mark.parametrize("extra", [[], ["--in-process"], ["--data-parallel-size", "2"]],
                         ids=["engine core process", "in process", "two engine cores"])
def test_serve_refuses_a_missing_model_folder_in_one_line(tmp_path, extra):
    """A model folder that is not there: the engine core refuses it as it starts, and the server ends with
    the engine's own message, exit status 2, no traceback, and no engine-core process left behind."""
    tag = f"{os.getpid()}-{time.monotonic_ns()}"  # this server's engine cores only, not another test's
    done = _serve_refused("--model", str(tmp_path / "nowhere"), "--port", "0", *extra, tag=tag)
    _one_error_line(done, "nowhere")
    assert not _engine_cores(tag), "an engine-core process outlived the refused server"


TAG_ENV = "MINIVLLM_TEST_SERVER_TAG"


def _engine_cores(tag: str) -> list[int]:
    """The pids of the engine-core processes running now whose environment carries `tag`."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "run_engine_core" in " ".join(p.info["cmdline"] or []) and p.environ().get(TAG_ENV) == tag:
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


@pytest.mark.parametrize("flags, expected", [
    (["--port", "70000"], "cannot listen on 127.0.0.1:70000"),
    (["--port", "0", "--host", "999.1.1.1"], "cannot listen on 999.1.1.1:0"),
    (["--port", "0", "--kv-cache-memory-bytes", "10"], "kv_cache_memory_bytes"),
], ids=["port out of range", "no such address", "a KV cache too small"])
def test_serve_refuses_bad_flags_in_one_line(tiny_model, flags, expected):
    _one_error_line(_serve_refused("--model", str(tiny_model), *flags), expected)
