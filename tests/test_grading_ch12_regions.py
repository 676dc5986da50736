"""Grading tests for chapter 12's rebuild exercises (`python -m minivllm.course.grade ch12_ex1`, or `pytest -m ch12_ex1`).

ch12_ex1 (`merge_delta`, `RequestOutputCollector` and `AsyncLLM.generate`: a request's path through the
asynchronous engine, written whole) and ch12_ex2 (the SSE chunk writer: `sse_event`, `sse_stream`,
`completion_chunks`) are graded in the package itself: in a student edition they are the student's code, exported
from the chapter (stubs until filled), and there is no reference to compare with. Each is graded alone: the
grader's own stand-in for the other takes its place (`graded`; `STAND_INS` serves `tests/stand_ins.py`).

What is checked is the contract, never this chapter's code. ch12_ex1, in named groups:
* replaces final and cumulative outputs: a consumer that falls behind gets the newest output only;
* merges deltas without loss (hypothesis: random puts of DELTA outputs for several completions,
  interleaved with `get_nowait`): every completion's text, tokens and log-probabilities arrive once, in
  order, with the newest finish reason; a completion that appears first in a later output keeps its place;
* raises errors: an exception put in is raised by the next `get`/`get_nowait`, and outputs put after it
  do not hide it;
* wakes a waiting consumer: `get` waits (without spinning) until another task puts an output;
* streams through AsyncLLM: an in-process `AsyncLLM` whose consumers are slower than the engine gives the
  texts of offline `LLM.generate` (tiny float64 model with the default model's tokenizer);
* aborts leave the engine idle: cancelling the consuming task, closing the generator early, bad input and
  an id in use leave no collector, no followed request and no sequence in the engine core.
ch12_ex2, by the real `openai` client and raw HTTP against a stub server (`build_app` over a scripted
engine, uvicorn on 127.0.0.1): one `data:` event per chunk and `data: [DONE]` last; streamed texts, finish
reasons and `n` choices as scripted; `usage` null on every chunk but a last one with no choices, only with
`include_usage`; an engine that dies mid-stream ends the stream with an error the client raises.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import socket
import threading
import time
from contextlib import ExitStack, contextmanager

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minivllm.engine.async_llm as async_llm
from minivllm.course.grade import EXERCISES as GRADED
from minivllm.engine.core_client import EngineDeadError
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams
REPLACES, MERGES, RAISES, WAKES, STREAMS, ABORTS = (name for name, _ in GRADED["ch12_ex1"].groups)

DELTA, CUMULATIVE, FINAL = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


@contextmanager
def your_code(ex: str, what: str):
    """An error of the code under grading (not a stub's NotImplementedError, not a check's AssertionError)
    re-raised as an AssertionError naming `ex` and what was running."""
    try:
        yield
    except (NotImplementedError, AssertionError):
        raise
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{ex}: {what} raised {type(e).__name__}: {e} (the traceback shows where)") from e


# --- the grader's stand-ins ----------------------------------------------------------------------
def _grader_merge_delta(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Appends per completion index, walking `new` after `old`; newest request-level fields."""
    merged = {c.index: CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                                        None if c.logprobs is None else list(c.logprobs), c.finish_reason,
                                        c.stop_reason) for c in old.outputs}
    for c in new.outputs:
        m = merged.setdefault(c.index, CompletionOutput(c.index, "", [], None, None))
        m.text, m.token_ids = m.text + c.text, m.token_ids + list(c.token_ids)
        m.logprobs = c.logprobs if m.logprobs is None or c.logprobs is None else m.logprobs + c.logprobs
        m.cumulative_logprob, m.finish_reason, m.stop_reason = c.cumulative_logprob, c.finish_reason, c.stop_reason
    return RequestOutput(new.request_id, new.prompt, new.prompt_token_ids, new.prompt_logprobs,
                         [merged[i] for i in sorted(merged)], new.finished, new.num_cached_tokens)


class _GraderCollector:
    """A slot kept as a list of pending items, folded when taken."""

    def __init__(self, output_kind):
        self.kind, self.items, self.event = output_kind, [], asyncio.Event()

    def put(self, output) -> None:
        if self.items and isinstance(self.items[0], Exception):
            return
        self.items = [output] if isinstance(output, Exception) or self.kind is not DELTA else self.items + [output]
        self.event.set()

    async def get(self):
        while not self.items:
            self.event.clear()
            await self.event.wait()
        return self.get_nowait()

    def get_nowait(self):
        if not self.items:
            return None
        items, self.items = self.items, []
        if isinstance(items[0], Exception):
            raise items[0]
        out = items[0]
        for nxt in items[1:]:
            out = _grader_merge_delta(out, nxt)
        return out


async def _grader_generate(self, prompt, sampling_params=None, request_id=None):
    """The request's path: checked, followed, sent; outputs until one is finished; aborted otherwise."""
    if self.errored:
        raise self.dead_error or EngineDeadError("the engine core is not running")
    seq = self.processor.process(prompt, sampling_params)
    rid = str(request_id) if request_id is not None else f"g{id(seq)}"
    if rid in self.collectors:
        raise ValueError(f"request id {rid!r} is already in use")
    to_send = self.output_processor.add_request(rid, seq, time.monotonic())
    self.collectors[rid] = slot = async_llm.RequestOutputCollector(seq.sampling_params.output_kind)
    self._start_output_handler()
    done = False
    try:
        for r in to_send:
            self.engine_core.add_request(r)
        while not done:
            out = await slot.get()
            done = out.finished
            yield out
    finally:
        del self.collectors[rid]
        if not done:
            self._abort(rid)


def _grader_sse_event(data) -> str:
    return "data: " + (data if isinstance(data, str) else json.dumps(data)) + "\n\n"


async def _grader_sse_stream(chunks):
    from minivllm.entrypoints.openai import api_server

    try:
        async for chunk in chunks:
            yield _grader_sse_event(chunk)
    except Exception as e:  # noqa: BLE001
        yield _grader_sse_event(api_server.error_body(api_server.status_of(e), str(e) or type(e).__name__))
    yield _grader_sse_event("[DONE]")


async def _grader_completion_chunks(state, prompt, params, request_id, include_usage):
    from minivllm.entrypoints.openai import api_server

    created, offsets, tokens, prompt_len = int(time.time()), {}, 0, 0
    gen = state.engine.generate(prompt, params, request_id)
    try:
        async for out in gen:
            prompt_len = len(out.prompt_token_ids)
            for c in out.outputs:
                if c.text or c.token_ids or c.finish_reason is not None:
                    choice = api_server.completion_choice(state, c, params, offsets.get(c.index, 0))
                    offsets[c.index], tokens = offsets.get(c.index, 0) + len(c.text), tokens + len(c.token_ids)
                    yield api_server.stream_chunk(request_id, "text_completion", created, state.served_model_name, [choice])
    finally:
        await gen.aclose()
    if include_usage:
        yield api_server.stream_chunk(request_id, "text_completion", created, state.served_model_name, [],
                                      api_server.usage_info(prompt_len, tokens))


def _server_stand_ins():
    from minivllm.entrypoints.openai import api_server

    return [(api_server, "sse_event", _grader_sse_event), (api_server, "sse_stream", _grader_sse_stream),
            (api_server, "completion_chunks", _grader_completion_chunks)]


# exercise -> [(owner, attribute, stand-in)] (the format tests/stand_ins.py reads for editions of several chapters)
STAND_INS = {"ch12_ex1": [(async_llm, "merge_delta", _grader_merge_delta),
                          (async_llm, "RequestOutputCollector", _GraderCollector),
                          (async_llm.AsyncLLM, "generate", _grader_generate)]}
try:  # the server's packages (the `serve` extra) may be missing: then ch12_ex2 is skipped, and has no stand-ins
    STAND_INS["ch12_ex2"] = _server_stand_ins()
except ImportError:
    pass


@contextmanager
def graded(ex: str | None):
    """The package's (the student's) piece for `ex`, the grader's stand-ins for chapter 12's others."""
    with ExitStack() as stack:
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        for other, patches in STAND_INS.items():
            for owner, name, fn in patches if other != ex else ():
                mp.setattr(owner, name, fn)
        yield


# --- ch12_ex1: the collector ---------------------------------------------------------------------
def _out(pieces: list[tuple[int, str, str | None]], finished: bool = False, rid: str = "r") -> RequestOutput:
    """A DELTA output: per completion (index, text, finish reason); one token per character, logprobs
    one dict per token."""
    comps = [CompletionOutput(i, text, [ord(ch) for ch in text], -float(len(text)), [{ord(ch): None} for ch in text],
                              reason, None) for i, text, reason in sorted(pieces)]
    return RequestOutput(rid, "p", [1, 2], None, comps, finished)


def _collector(kind):
    with your_code("ch12_ex1", "RequestOutputCollector(output_kind)"):
        return async_llm.RequestOutputCollector(kind)


def _take(c):
    with your_code("ch12_ex1", "get_nowait()"):
        return c.get_nowait()


@pytest.mark.ch12
@pytest.mark.ch12_ex1
@pytest.mark.group(REPLACES)
@pytest.mark.parametrize("kind", [CUMULATIVE, FINAL])
def test_ex1_replaces_final_and_cumulative_outputs(kind):
    with graded("ch12_ex1"):
        c = _collector(kind)
        _expect(_take(c) is None, "ch12_ex1: get_nowait() on an empty collector must return None")
        outs = [_out([(0, "ab" * (k + 1), None)]) for k in range(3)]
        for o in outs:
            with your_code("ch12_ex1", "put()"):
                c.put(o)
        got = _take(c)
        _expect(got is outs[-1] or got == outs[-1], f"ch12_ex1: with {kind.name} outputs a consumer that fell behind "
                f"gets the newest output; got {got!r}")
        _expect(_take(c) is None, "ch12_ex1: an output is delivered once (the slot is empty after a get)")


PUTS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.lists(st.tuples(st.integers(0, 3), st.text("abcxyz", max_size=3)), min_size=1,
                                       max_size=4, unique_by=lambda t: t[0])),
    st.tuples(st.just("get"), st.none())), min_size=1, max_size=30)


@pytest.mark.ch12
@pytest.mark.ch12_ex1
@pytest.mark.group(MERGES)
@given(ops=PUTS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_ex1_merges_deltas_without_loss(ops):
    with graded("ch12_ex1"):
        c, sent, got, order = _collector(DELTA), {}, {}, {}
        reasons, last_reason = {}, {}
        for k, (op, pieces) in enumerate(ops):
            if op == "put":
                out = _out([(i, t, "length" if k % 5 == 4 else None) for i, t in pieces])
                for i, t in pieces:
                    sent[i] = sent.get(i, "") + t
                    last_reason[i] = "length" if k % 5 == 4 else None
                with your_code("ch12_ex1", "put()"):
                    c.put(out)
            ops_left = op == "get" or k == len(ops) - 1
            if ops_left and (out := _take(c)) is not None:
                indices = [x.index for x in out.outputs]
                _expect(indices == sorted(set(indices)), f"ch12_ex1: completions of a merged output must be in index "
                        f"order, each once; got indices {indices}")
                for comp in out.outputs:
                    got[comp.index] = got.get(comp.index, "") + comp.text
                    _expect(comp.token_ids == [ord(ch) for ch in comp.text] and len(comp.logprobs) == len(comp.text),
                            f"ch12_ex1: completion {comp.index}: text, token_ids and logprobs must be merged alike")
                    reasons[comp.index] = comp.finish_reason
        _expect(got == sent, f"ch12_ex1: DELTA outputs merged while the consumer was behind lost or repeated text: "
                f"sent {sent}, received {got}")
        _expect(reasons == {i: last_reason[i] for i in reasons},
                f"ch12_ex1: a merged completion must carry the newest finish reason: {reasons} vs {last_reason}")


@pytest.mark.ch12
@pytest.mark.ch12_ex1
@pytest.mark.group(RAISES)
@pytest.mark.parametrize("kind", [DELTA, FINAL])
def test_ex1_raises_errors(kind):
    with graded("ch12_ex1"):
        c = _collector(kind)
        with your_code("ch12_ex1", "put()"):
            c.put(_out([(0, "a", None)]))
            c.put(RuntimeError("the engine core died"))
            c.put(_out([(0, "b", None)]))
        with pytest.raises(RuntimeError, match="died"):
            c.get_nowait()

        async def waiting():
            c2 = _collector(kind)
            task = asyncio.create_task(c2.get())
            await asyncio.sleep(0.01)
            c2.put(ValueError("boom"))
            await asyncio.wait_for(task, 2)
        with pytest.raises(ValueError, match="boom"):
            asyncio.run(waiting())


@pytest.mark.ch12
@pytest.mark.ch12_ex1
@pytest.mark.group(WAKES)
def test_ex1_wakes_a_waiting_consumer():
    with graded("ch12_ex1"):
        async def main():
            c, loops = _collector(DELTA), 0

            async def ticker():  # a consumer that spins would starve this task
                nonlocal loops
                while True:
                    loops += 1
                    await asyncio.sleep(0.005)
            tick = asyncio.create_task(ticker())
            task = asyncio.create_task(c.get())
            cpu = time.process_time()
            await asyncio.sleep(0.2)
            cpu = time.process_time() - cpu
            _expect(not task.done(), "ch12_ex1: get() on an empty collector must wait for a put")
            _expect(cpu < 0.1, f"ch12_ex1: get() kept the CPU busy while it waited ({cpu:.2f} s of CPU in 0.2 s): "
                    "await an asyncio.Event instead of polling")
            c.put(_out([(0, "x", None)]))
            with your_code("ch12_ex1", "get()"):
                out = await asyncio.wait_for(task, 2)
            tick.cancel()
            _expect(out.outputs[0].text == "x", f"ch12_ex1: get() returned {out!r}")
            _expect(loops >= 5, "ch12_ex1: while get() waits, other tasks must run (await an asyncio.Event, do not spin)")
            c.put(_out([(0, "y", None)]))
            _expect((await asyncio.wait_for(c.get(), 2)).outputs[0].text == "y", "ch12_ex1: a second get() after a put")
        asyncio.run(main())


ENGINE_ARGS = dict(dtype="float64", num_kvcache_blocks=64, block_size=4, max_model_len=128)
PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3,"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny float64 model with the default tokenizer, and offline `LLM.generate`'s greedy texts."""
    from serving_helpers import make_tiny_chat_model

    from minivllm.llm import LLM

    folder = make_tiny_chat_model(tmp_path_factory.mktemp("tiny"))
    want = [o.outputs[0].text for o in LLM(str(folder), **ENGINE_ARGS).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)]
    return folder, want


@contextmanager
def _async_llm(folder):
    from minivllm import defaults
    from minivllm.config import EngineArgs

    llm = async_llm.AsyncLLM(defaults.complete_engine_args(EngineArgs(model=str(folder), **ENGINE_ARGS)),
                             multiprocess=False)
    try:
        yield llm
    finally:
        llm.shutdown()


def _generate(llm, prompt, params, request_id):
    """`llm.generate(...)`, which must be an async generator (a stub's body has no `yield`)."""
    gen = llm.generate(prompt, params, request_id)
    if not inspect.isasyncgen(gen):
        if inspect.iscoroutine(gen):
            gen.close()
        raise NotImplementedError("ch12_ex1: AsyncLLM.generate must be an async generator (it yields outputs)")
    return gen


async def _idle(llm, what: str, timeout: float = 10.0):
    proc = llm.engine_core.proc
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not (llm.collectors or llm.output_processor.requests or proc.core.requests or proc.has_work()):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"ch12_ex1: after {what} the engine is not idle: collectors {list(llm.collectors)}, "
                         f"followed requests {list(llm.output_processor.requests)}, engine core {list(proc.core.requests)}")


@pytest.mark.ch12
@pytest.mark.ch12_ex1
@pytest.mark.group(STREAMS)
def test_ex1_streams_through_async_llm(tiny):
    folder, want = tiny
    with graded("ch12_ex1"), _async_llm(folder) as llm:
        async def slow_consumer(i):
            text = ""
            async for out in _generate(llm, PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=12,
                                                                      output_kind=DELTA), str(i)):
                text += out.outputs[0].text
                await asyncio.sleep(0.03)  # the engine gets ahead: outputs pile up in the collector
            return text

        async def main():
            got = await asyncio.wait_for(asyncio.gather(*[slow_consumer(i) for i in range(3)]), 60)
            await _idle(llm, "three requests finished")
            return got
        with your_code("ch12_ex1", "AsyncLLM.generate"):
            got = asyncio.run(main())
    _expect(got == want, f"ch12_ex1: streamed texts {got} differ from offline LLM.generate's {want}")


@pytest.mark.ch12
@pytest.mark.ch12_ex1
@pytest.mark.group(ABORTS)
def test_ex1_aborts_leave_the_engine_idle(tiny):
    folder, want = tiny
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, output_kind=DELTA)
    with graded("ch12_ex1"), _async_llm(folder) as llm:
        async def main():
            started = asyncio.Event()

            async def consume():
                async for _ in _generate(llm, PROMPTS[0], long, "cancelled"):
                    started.set()
            task = asyncio.create_task(consume())
            first = asyncio.create_task(started.wait())
            await asyncio.wait([task, first], timeout=20, return_when=asyncio.FIRST_COMPLETED)
            first.cancel()
            if task.done() and not started.is_set():
                task.result()  # the stream's own error (a stub's NotImplementedError) says what is wrong
            _expect(started.is_set(), "ch12_ex1: a streamed request gave no output within 20 s")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            _expect("cancelled" not in llm.output_processor.requests, "ch12_ex1: a cancelled request must be aborted "
                    "at once (`_abort`), not left to run to its end")
            await _idle(llm, "cancelling the consuming task")
            gen = _generate(llm, PROMPTS[1], long, "closed")
            await gen.__anext__()
            await gen.aclose()
            _expect("closed" not in llm.output_processor.requests, "ch12_ex1: a request whose generator was closed "
                    "early must be aborted at once (`_abort`)")
            await _idle(llm, "closing the generator after one output")
            for prompt, params, what in [("x " * 200, SamplingParams(), "max_model_len"), ([10**9], SamplingParams(), "token ids")]:
                with pytest.raises(ValueError, match=what):
                    await _generate(llm, prompt, params, "bad").__anext__()
            await _idle(llm, "a refused request")
            held = _generate(llm, PROMPTS[0], long, "dup")
            await held.__anext__()
            with pytest.raises(ValueError, match="in use"):
                await _generate(llm, PROMPTS[1], SamplingParams(), "dup").__anext__()
            await held.aclose()
            await _idle(llm, "a request refused for an id in use, and the first one closed")
            text = ""
            async for out in _generate(llm, PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=12, output_kind=DELTA), "after"):
                text += out.outputs[0].text
            return text
        with your_code("ch12_ex1", "AsyncLLM.generate"):
            text = asyncio.run(main())
    _expect(text == want[2], f"ch12_ex1: after the aborts the engine must still serve: got {text!r}, want {want[2]!r}")


# --- ch12_ex2: the SSE chunk writer, against a stub server ----------------------------------------
class _ScriptedEngine:
    """`AsyncLLM`'s interface for the server: each request streams the pieces of `SCRIPT` (one token per
    piece) for each of its `n` completions, and dies after `die_after` outputs when that is set."""

    SCRIPT = ["Str", "eam", "ing", " wor", "ks", "!"]

    def __init__(self, die_after=None):
        from types import SimpleNamespace

        self.tokenizer = SimpleNamespace(encode=lambda text, **kw: list(range(len(text.split()))),
                                         chat_template=None)
        self.max_model_len, self.errored, self.die_after = 64, False, die_after
        self.processor = SimpleNamespace(process=lambda prompt, params: None)

    async def check_health(self):
        pass

    async def generate(self, prompt, params, request_id):
        pieces = self.SCRIPT[:params.max_tokens]
        ids = prompt["prompt_token_ids"]
        for k, piece in enumerate(pieces):
            if k == self.die_after:
                raise EngineDeadError("the engine core died")
            await asyncio.sleep(0.001)
            last = k == len(pieces) - 1
            yield RequestOutput(request_id, None, ids, None, [
                CompletionOutput(i, piece, [k], finish_reason="length" if last else None) for i in range(params.n)], last)


@contextmanager
def _stub_server(engine):
    """`build_app(engine)` served by uvicorn on 127.0.0.1 (a free port) in a thread; yields the base URL."""
    pytest.importorskip("fastapi")
    import uvicorn
    from prometheus_client import CollectorRegistry

    from minivllm.entrypoints.openai.api_server import build_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "stub", CollectorRegistry()), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _raw_events(url: str, body: dict) -> list[str]:
    import httpx

    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=20) as r:
        text = "".join(r.iter_text())
    _expect(text.endswith("\n\n"), f"ch12_ex2: the stream must end with a blank line after its last event: {text[-40:]!r}")
    events = text.split("\n\n")[:-1]
    for e in events:
        _expect(e.startswith("data: ") and "\n" not in e, f"ch12_ex2: every event is one `data: ...` line, got {e!r}")
    return [e[len("data: "):] for e in events]


@pytest.mark.ch12
@pytest.mark.ch12_ex2
def test_ex2_one_data_event_per_chunk_then_done():
    with graded("ch12_ex2"), _stub_server(_ScriptedEngine()) as url:
        with your_code("ch12_ex2", "the completions stream"):
            events = _raw_events(url, {"model": "stub", "prompt": "a b", "max_tokens": 4, "stream": True})
    _expect(events[-1] == "[DONE]", f"ch12_ex2: the last event must be `data: [DONE]`, got {events[-1:]}")
    chunks = [json.loads(e) for e in events[:-1]]
    _expect("".join(c["choices"][0]["text"] for c in chunks) == "".join(_ScriptedEngine.SCRIPT[:4]),
            f"ch12_ex2: the chunks' texts must join to the scripted text: {[c['choices'] for c in chunks]}")
    _expect(len(chunks) == 4, f"ch12_ex2: one chunk per output that advanced (4), got {len(chunks)}")


@pytest.mark.ch12
@pytest.mark.ch12_ex2
@pytest.mark.parametrize("include_usage", [False, True])
def test_ex2_openai_client_parses_the_stream(include_usage):
    openai = pytest.importorskip("openai")
    with graded("ch12_ex2"), _stub_server(_ScriptedEngine()) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=20)
        with your_code("ch12_ex2", "the completions stream"):
            chunks = list(client.completions.create(model="stub", prompt="a b c", max_tokens=5, n=2, stream=True,
                                                    stream_options={"include_usage": include_usage}))
    body = chunks[:-1] if include_usage else chunks
    for i in range(2):
        mine = [c.choices[0] for c in body if c.choices and c.choices[0].index == i]
        _expect("".join(ch.text for ch in mine) == "".join(_ScriptedEngine.SCRIPT[:5]),
                f"ch12_ex2: choice {i}'s texts must join to the scripted text")
        _expect(mine[-1].finish_reason == "length" and all(ch.finish_reason is None for ch in mine[:-1]),
                f"ch12_ex2: choice {i}: the finish reason comes on its last chunk only")
    _expect(all(c.usage is None for c in body), "ch12_ex2: usage must be null on every chunk but the usage chunk")
    if include_usage:
        last = chunks[-1]
        _expect(last.choices == [] and last.usage is not None, "ch12_ex2: with include_usage the last chunk has no "
                "choices and carries the usage")
        _expect((last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (3, 10, 13),
                f"ch12_ex2: usage must count the prompt's tokens and every choice's tokens: {last.usage}")


@pytest.mark.ch12
@pytest.mark.ch12_ex2
def test_ex2_an_engine_that_dies_ends_the_stream_with_an_error():
    openai = pytest.importorskip("openai")
    with graded("ch12_ex2"), _stub_server(_ScriptedEngine(die_after=2)) as url:
        with your_code("ch12_ex2", "the completions stream"):
            events = _raw_events(url, {"model": "stub", "prompt": "a", "max_tokens": 6, "stream": True})
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=20)
        with pytest.raises(openai.APIError, match="died"):
            for _ in client.completions.create(model="stub", prompt="a", max_tokens=6, stream=True):
                pass
    _expect(events[-1] == "[DONE]" and "error" in json.loads(events[-2]),
            f"ch12_ex2: a failure mid-stream sends an error event, then [DONE]: got {events[-2:]}")
