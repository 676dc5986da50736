"""Grading tests for chapter 12's rebuild exercises (`python -m minivllm.course.grade ch12_ex1`, or `pytest -m ch12_ex1`).

ch12_ex1 (`merge_delta` and `RequestOutputCollector`, written whole) and ch12_ex2 (`sse_event`, the SSE
chunk writer) are graded in the package itself: in a student edition they are the student's code, exported
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
  texts of offline `LLM.generate` (tiny float64 model with the default model's tokenizer).
"""
from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack, contextmanager

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minivllm.engine.async_llm as async_llm
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

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


# exercise -> [(owner, attribute, stand-in)] (the format tests/stand_ins.py reads for editions of several chapters)
STAND_INS = {"ch12_ex1": [(async_llm, "merge_delta", _grader_merge_delta),
                          (async_llm, "RequestOutputCollector", _GraderCollector)]}


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


@pytest.mark.ch12
@pytest.mark.ch12_ex1
def test_ex1_streams_through_async_llm(tmp_path):
    from serving_helpers import make_tiny_chat_model

    from minivllm import defaults
    from minivllm.config import EngineArgs
    from minivllm.llm import LLM

    folder = make_tiny_chat_model(tmp_path / "tiny")
    engine_args = dict(dtype="float64", num_kvcache_blocks=64, block_size=4, max_model_len=128)
    prompts = ["Hello, my name is", "The capital of France is", "1, 2, 3,"]
    want = [o.outputs[0].text for o in LLM(str(folder), **engine_args).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)]
    with graded("ch12_ex1"):
        llm = async_llm.AsyncLLM(defaults.complete_engine_args(EngineArgs(model=str(folder), **engine_args)),
                                 multiprocess=False)

        async def slow_consumer(i):
            text = ""
            async for out in llm.generate(prompts[i], SamplingParams(temperature=0.0, max_tokens=12,
                                                                     output_kind=DELTA), str(i)):
                text += out.outputs[0].text
                await asyncio.sleep(0.03)  # the engine gets ahead: outputs pile up in the collector
            return text

        async def main():
            return await asyncio.wait_for(asyncio.gather(*[slow_consumer(i) for i in range(3)]), 60)
        try:
            with your_code("ch12_ex1", "AsyncLLM.generate with your collector"):
                got = asyncio.run(main())
        finally:
            llm.shutdown()
    _expect(got == want, f"ch12_ex1: streamed texts {got} differ from offline LLM.generate's {want}")
