"""Chapter 12: `python -m minivllm bench serve`, the client-side serving benchmark (after vLLM's
`vllm/benchmarks/serve.py`): the metrics on scripted traces with hand-computed numbers, the arrival
process's statistics (a fake clock: no wall time), the SSE timing against a stub server that streams
scripted chunks with known delays, and the command's wiring.

Tests check correctness only; no benchmark figure is asserted.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

pytest.importorskip("httpx", reason="bench serve talks HTTP with httpx (the `serve` extra, installed with openai)")

from minivllm.__main__ import build_parser, main  # noqa: E402
from minivllm.benchmarks.serve import (  # noqa: E402
    RequestFuncOutput, SampleRequest, async_request_openai_completions, benchmark, calculate_metrics,
    format_result, get_request, parse_goodput, parse_sse_line, record_chunk, request_intervals,
    sample_random_requests)


# ---------------------------------------------------------------- metrics on scripted traces

def traced_output(prompt_len: int, chunks: list[tuple[float, str, int]], output_tokens: int) -> RequestFuncOutput:
    """A successful output timed by `record_chunk` from (seconds after the start, text, tokens) chunks."""
    out = RequestFuncOutput(prompt_len=prompt_len, start_time=100.0, success=True, output_tokens=output_tokens)
    for t, text, n in chunks:
        record_chunk(out, 100.0 + t, text, n)
    return out


def scripted_trace() -> tuple[list[SampleRequest], list[RequestFuncOutput]]:
    """Four requests: A (a role chunk, then 1, 1 and 3 tokens, then an empty closing chunk), B (2 tokens),
    C (1 token), D (failed)."""
    a = traced_output(10, [(0.0, "", 0), (0.2, "Hello", 1), (0.3, " world", 1), (0.6, " a b c", 3), (0.7, "", 0)], 5)
    b = traced_output(20, [(0.4, "x", 1), (0.6, " y", 1)], 2)
    c = traced_output(5, [(0.3, "z", 1)], 1)
    d = RequestFuncOutput(prompt_len=100, success=False, error="HTTP 500: boom")
    requests = [SampleRequest("p", n, 8) for n in (10, 20, 5, 100)]
    return requests, [a, b, c, d]


def test_record_chunk_times_text_per_token():
    _, (a, b, c, _) = scripted_trace()
    assert a.ttft == pytest.approx(0.2)  # the role chunk at 0.0 carries no text: not the first token
    assert a.itl == pytest.approx([0.1, 0.1, 0.1, 0.1])  # 0.1 s to " world", then 0.3 s split over 3 tokens
    assert a.latency == pytest.approx(0.6) and a.generated_text == "Hello world a b c"  # not 0.7
    assert b.ttft == pytest.approx(0.4) and b.itl == pytest.approx([0.2]) and b.latency == pytest.approx(0.6)
    assert c.itl == [] and c.ttft == pytest.approx(0.3) == c.latency


def test_calculate_metrics_by_hand():
    requests, outputs = scripted_trace()
    m, output_lens = calculate_metrics(requests, outputs, dur_s=2.0, selected_percentiles=[50, 99])
    assert output_lens == [5, 2, 1, 0]  # the failed request generated nothing
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 35, 8)  # D's 100 tokens excluded
    assert m.request_throughput == pytest.approx(1.5) and m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(43 / 2)
    # TTFT: 200, 400, 300 ms
    assert (m.mean_ttft_ms, m.median_ttft_ms) == pytest.approx((300, 300))
    assert m.std_ttft_ms == pytest.approx(np.sqrt(20000 / 3))
    assert dict(m.percentiles_ttft_ms) == pytest.approx({50: 300, 99: 398})  # 300 + 0.98 * (400 - 300)
    # TPOT: A (600 - 200) / 4 = 100 ms, B (600 - 400) / 1 = 200 ms; C has one token: excluded
    assert (m.mean_tpot_ms, m.median_tpot_ms) == pytest.approx((150, 150))
    assert dict(m.percentiles_tpot_ms) == pytest.approx({50: 150, 99: 199})
    # ITL pooled per token: A's 100, 100, 100, 100 and B's 200 ms (a per-chunk count would give 100, 300, 200)
    assert (m.mean_itl_ms, m.median_itl_ms) == pytest.approx((120, 100))
    assert dict(m.percentiles_itl_ms) == pytest.approx({50: 100, 99: 196})  # 100 + 0.96 * (200 - 100)
    # E2EL: 600, 600, 300 ms
    assert (m.mean_e2el_ms, m.median_e2el_ms) == pytest.approx((500, 600))
    assert m.request_goodput == 0.0  # no SLOs given


@pytest.mark.parametrize("slos, good", [
    ({"ttft": 350, "tpot": 150}, 2),  # A (200 ms, 100 ms) and C (300 ms, no TPOT); B's TTFT 400 misses
    ({"ttft": 350, "tpot": 150, "e2el": 500}, 1),  # A's 600 ms end to end misses: only C
    ({"tpot": 99}, 1),  # TPOT per request: A's 100 and B's 200 miss, C (0) meets it
    ({"ttft": 1000, "tpot": 200, "e2el": 600}, 3),  # bounds are inclusive; D (failed) never counts
])
def test_goodput_counts_requests_meeting_every_slo(slos, good):
    requests, outputs = scripted_trace()
    m, _ = calculate_metrics(requests, outputs, 2.0, [99], slos)
    assert m.request_goodput == pytest.approx(good / 2.0)


def test_calculate_metrics_refuses_mismatched_lists():
    requests, outputs = scripted_trace()
    with pytest.raises(ValueError, match="one output per request"):
        calculate_metrics(requests[:2], outputs, 2.0, [99])
    with pytest.raises(ValueError, match="dur_s"):
        calculate_metrics(requests, outputs, 0.0, [99])


def test_parse_goodput_as_vllm():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:1e4"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 10000.0}
    for bad in ("itl:5", "ttft", "ttft:-1", "ttft:fast", "ttft:nan"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput([bad])


def test_parse_sse_line():
    assert parse_sse_line('data: {"a": 1}\n') == {"a": 1}
    assert parse_sse_line("data:[DONE]") is None
    assert parse_sse_line("") is None and parse_sse_line(": keep-alive") is None and parse_sse_line("event: x") is None
    with pytest.raises(ValueError):
        parse_sse_line("data: {not json")


def test_format_result_has_vllms_rows():
    requests, outputs = scripted_trace()
    from minivllm.benchmarks.serve import benchmark_result

    result = benchmark_result(requests, outputs, 2.0, [50, 99.9], {"ttft": 350})
    assert result["p99.9_itl_ms"] > result["p50_itl_ms"] == pytest.approx(100)
    table = format_result(result, ["ttft", "itl"], [50, 99.9], request_rate=4.0, max_concurrency=2)
    for row in ("Serving Benchmark Result", "Successful requests:", "Failed requests:", "Request goodput (req/s):",
                "Mean TTFT (ms):", "P99.9 ITL (ms):", "Median ITL (ms):", "Maximum request concurrency:",
                "Request rate configured (RPS):"):
        assert row in table
    assert "TPOT" not in table  # not selected
    assert json.dumps(result)  # the record is JSON as it is


# ---------------------------------------------------------------- the arrival process (a fake clock)

def arrival_gaps(n: int, rate: float, burstiness: float, seed: int = 0) -> tuple[list[SampleRequest], list[float]]:
    """Run `get_request` with a sleep that only records: the requests yielded and the gaps asked for."""
    requests = [SampleRequest(str(i), 1, 1) for i in range(n)]
    gaps: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        gaps.append(seconds)

    async def collect() -> list[SampleRequest]:
        return [r async for r in get_request(requests, rate, burstiness, seed, sleep=fake_sleep)]

    return asyncio.run(collect()), gaps


def test_infinite_rate_sends_everything_at_once():
    got, gaps = arrival_gaps(50, float("inf"), 1.0)
    assert [r.prompt for r in got] == [str(i) for i in range(50)] and gaps == []


# Tolerances: 20,000 seeded gaps; the sample mean's relative standard error is CV / sqrt(n) (0.7% for CV 1),
# the sample CV's about sqrt((kurtosis - 1) / 4n) (1.0% for exponential gaps, 0.7% for gamma shape 4):
# each tolerance is about 3-4 standard errors, and burstiness 1 vs 4 differ by 50 of them.
@pytest.mark.parametrize("burstiness, cv", [(1.0, 1.0), (4.0, 0.5), (0.25, 2.0)])
def test_gamma_arrivals_have_mean_one_over_rate_and_cv_one_over_sqrt_burstiness(burstiness, cv):
    rate, n = 4.0, 20_001
    got, gaps = arrival_gaps(n, rate, burstiness, seed=1)
    assert len(got) == n and len(gaps) == n - 1
    gaps = np.asarray(gaps)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03 * max(1.0, cv))
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.04 * max(1.0, cv))


def test_arrivals_are_seeded_and_checked():
    assert request_intervals(100, 2.0, 1.0, seed=3) == request_intervals(100, 2.0, 1.0, seed=3)
    assert request_intervals(100, 2.0, 1.0, seed=3) != request_intervals(100, 2.0, 1.0, seed=4)
    for rate, burstiness in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError, match="must be > 0"):
            request_intervals(10, rate, burstiness)


# ---------------------------------------------------------------- the random dataset

class WordTokenizer:
    """A stand-in tokenizer: token i is the word `w<i>`, any other word is token 2; ids 0 and 1 are special."""

    vocab_size, all_special_ids = 100, [0, 1]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(w[1:]) if w[:1] == "w" and w[1:].isdigit() else 2 for w in text.split()]


def test_random_dataset_is_seeded_in_range_and_without_special_tokens():
    tok = WordTokenizer()
    a = sample_random_requests(tok, 200, input_len=20, output_len=10, range_ratio=0.5, seed=7)
    assert a == sample_random_requests(tok, 200, 20, 10, 0.5, seed=7)
    assert a != sample_random_requests(tok, 200, 20, 10, 0.5, seed=8)
    assert all(10 <= r.prompt_len <= 30 and 5 <= r.expected_output_len <= 15 for r in a)
    assert all(r.prompt_len == len(tok.encode(r.prompt)) for r in a)
    assert {min(r.prompt_len for r in a), max(r.prompt_len for r in a)} == {10, 30}  # both ends drawn
    assert not {0, 1} & {t for r in a for t in tok.encode(r.prompt)}
    fixed = sample_random_requests(tok, 5, 16, 4, 0.0)
    assert {(r.prompt_len, r.expected_output_len) for r in fixed} == {(16, 4)}
    for bad in (dict(num_requests=0), dict(input_len=0), dict(range_ratio=1.0), dict(range_ratio=-0.1)):
        with pytest.raises(ValueError):
            sample_random_requests(tok, **{**dict(num_requests=1, input_len=4, output_len=4), **bad})


@pytest.mark.slow
def test_random_dataset_with_the_default_models_tokenizer():
    from transformers import AutoTokenizer

    from minivllm.transformers_utils.model_files import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    requests = sample_random_requests(tok, 8, input_len=64, output_len=8, range_ratio=0.25, seed=0)
    for r in requests:  # decoding then re-encoding may merge a few tokens; the record keeps the true length
        assert r.prompt_len == len(tok.encode(r.prompt, add_special_tokens=False))
        assert 48 - 4 <= r.prompt_len <= 80


# ---------------------------------------------------------------- SSE timing against a stub server

STEP_S = 0.2  # the stub's sleep between chunks
# Timing tolerance: time.sleep never returns early, but a chunk may reach the client late by thread
# scheduling, loopback and the event loop on a busy 2-core machine (tens of ms); 80 ms still tells
# apart what is checked: TTFT 0.2 s from the role chunk's 0 s, and a 3-token chunk's 0.1 s per token
# from its 0.3 s per chunk.
TOL_S = 0.08


def choice_chunk(text: str, usage_tokens: int | None = None) -> dict:
    chunk = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text}]}
    if usage_tokens is not None:
        chunk["usage"] = {"prompt_tokens": 3, "completion_tokens": usage_tokens}
    return chunk


def stub_script(continuous_usage: bool) -> list[tuple[float, dict]]:
    """(sleep seconds before, chunk): a role chunk, "Hello", " world", one chunk of 3 tokens, an empty chunk
    with the finish reason, the usage."""
    u = (lambda n: n) if continuous_usage else (lambda n: None)
    return [(0.0, choice_chunk("", u(0))), (STEP_S, choice_chunk("Hello", u(1))),
            (STEP_S, choice_chunk(" world", u(2))), (1.5 * STEP_S, choice_chunk(" a b c", u(5))),
            (STEP_S, choice_chunk("", u(5)) | {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}),
            (0.0, {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}})]


class StubHandler(BaseHTTPRequestHandler):
    """POST /v1/completions streams `server.script`; /fail answers 500; GET /v1/models names one model."""

    def log_message(self, *args) -> None:  # keep the test output quiet
        pass

    def do_GET(self) -> None:
        self._send(200, "application/json", json.dumps({"object": "list", "data": [{"id": "stub-model"}]}))

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.payloads.append(body)
        if self.path != "/v1/completions":
            return self._send(500, "application/json", '{"error": "boom"}')
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes
        try:
            for delay, chunk in self.server.script:
                time.sleep(delay)
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):  # the client gave up: a test that failed already
            pass

    def _send(self, status: int, content_type: str, body: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())


@pytest.fixture
def stub_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubHandler)
    server.daemon_threads = True
    server.payloads, server.script = [], stub_script(continuous_usage=False)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def stream_one(url: str, tokenizer=None, path: str = "/v1/completions") -> RequestFuncOutput:
    import httpx

    async def go() -> RequestFuncOutput:
        async with httpx.AsyncClient(timeout=10) as client:
            return await async_request_openai_completions(client, url + path, "stub-model",
                                                          SampleRequest("hi there", 2, 5), True, tokenizer)
    return asyncio.run(go())


def check_stub_timing(out: RequestFuncOutput) -> None:
    assert out.success and out.error == "" and out.generated_text == "Hello world a b c"
    assert out.output_tokens == 5 and out.prompt_len == 2
    assert out.ttft == pytest.approx(STEP_S, abs=TOL_S)  # not ~0: the role chunk carries no text
    assert out.itl == pytest.approx([STEP_S] + [STEP_S / 2] * 3, abs=TOL_S)  # 0.3 s over 3 tokens: 0.1 each
    assert len(out.itl) == 4 and sum(out.itl) + out.ttft == pytest.approx(out.latency)
    assert out.latency == pytest.approx(3.5 * STEP_S, abs=TOL_S)  # the last text, not the empty chunk at 4.5


def test_stream_timing_counts_tokens_by_tokenizing_chunks(stub_server):
    server, url = stub_server
    check_stub_timing(stream_one(url, tokenizer=WordTokenizer()))  # " a b c" -> 3 words
    payload = server.payloads[0]
    assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}
    assert (payload["model"], payload["prompt"], payload["max_tokens"], payload["ignore_eos"]) == \
        ("stub-model", "hi there", 5, True)


def test_stream_timing_counts_tokens_from_usage_per_chunk(stub_server):
    server, url = stub_server
    server.script = stub_script(continuous_usage=True)
    check_stub_timing(stream_one(url))  # no tokenizer: the usage count's growth says 3


def test_stream_without_token_counts_times_per_chunk(stub_server):
    out = stream_one(stub_server[1])  # neither a tokenizer nor usage per chunk: one token per chunk
    assert out.output_tokens == 5  # the usage chunk's count still
    assert out.itl == pytest.approx([STEP_S, 1.5 * STEP_S], abs=TOL_S)


def test_failed_request_is_recorded_not_raised(stub_server):
    out = stream_one(stub_server[1], path="/fail")
    assert not out.success and out.error.startswith("HTTP 500") and "boom" in out.error
    out = stream_one("http://127.0.0.1:9")  # nothing listens on the discard port
    assert not out.success and "ConnectError" in out.error


def test_benchmark_against_the_stub(stub_server):
    server, url = stub_server
    requests = [SampleRequest(f"p{i}", 2, 5) for i in range(4)]
    result = asyncio.run(benchmark(url + "/v1/completions", "stub-model", requests, max_concurrency=2,
                                   selected_percentiles=[50], goodput_config_dict={"ttft": 10_000},
                                   tokenizer=WordTokenizer(), disable_tqdm=True))
    assert len(server.payloads) == 5  # the initial test request, then the 4
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (4, 0, 20)
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["median_itl_ms"] == pytest.approx(STEP_S / 2 * 1000, abs=TOL_S * 1000)
    assert result["duration"] >= 2 * 3.5 * STEP_S  # two waves of two: the semaphore held the others back
    with pytest.raises(ValueError, match="initial test request"):
        asyncio.run(benchmark(url + "/fail", "stub-model", requests, disable_tqdm=True))


# ---------------------------------------------------------------- the command

def test_bench_serve_is_dispatched_and_bench_is_unchanged(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--help"])
    assert e.value.code == 0 and "--request-rate" in capsys.readouterr().out
    args = build_parser().parse_args(["bench", "--num-requests", "2", "--workload", "mixed"])
    assert (args.command, args.num_requests, args.workload) == ("bench", 2, "mixed")
    assert main(["bench", "serve", "--num-prompts", "0"]) == 2  # refused before any tokenizer or request
    assert "--num-prompts must be >= 1" in capsys.readouterr().err
    assert main(["bench", "serve", "--goodput", "itl:5"]) == 2
    assert main(["bench", "serve", "--endpoint", "/v1/chat/completions"]) == 2


@pytest.mark.slow
def test_bench_serve_command_writes_its_record(stub_server, tmp_path, capsys):
    server, url = stub_server
    status = main(["bench", "serve", "--base-url", url, "--num-prompts", "3", "--random-input-len", "8",
                   "--random-output-len", "5", "--ignore-eos", "--disable-tqdm", "--goodput", "ttft:5000",
                   "--metric-percentiles", "50,99", "--result-dir", str(tmp_path), "--result-filename", "r.json"])
    assert status == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P99 TPOT (ms):" in out and "Mean ITL (ms):" in out
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["model_id"] == "stub-model" == server.payloads[-1]["model"]  # from GET /v1/models
    assert record["completed"] == 3 and record["request_rate"] == "inf" and record["goodput"] == {"ttft": 5000.0}
    assert record["hardware"]["cpu"] and record["hardware"]["cpu_count"] >= 1 and record["date"]
    assert {"mean_ttft_ms", "p99_tpot_ms", "p50_itl_ms", "median_e2el_ms", "std_itl_ms"} <= set(record)
