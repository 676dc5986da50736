"""Chapter 12's asynchronous engine: AsyncLLM over the in-process and the multiprocess engine-core client.

The oracle is chapter 04's offline `LLM.generate` on the same tiny float64 model (itself checked against
transformers in test_engine_oracle.py): greedy texts and tokens, seeded samples, stop strings, stop tokens
and log-probabilities must come out the same whether the engine core runs in this process or in its own.
Every abort path must leave the engine idle with its blocks free, and a killed engine core must fail the
requests in flight rather than hang them.
"""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from engine_helpers import check_invariants
from serving_helpers import make_tiny_chat_model

from minivllm import defaults
from minivllm.config import EngineArgs
from minivllm.engine.async_llm import AsyncLLM, RequestOutputCollector, merge_delta
from minivllm.engine.core_client import EngineDeadError
from minivllm.llm import LLM
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

DELTA, FINAL = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3,", "Once upon a time", "def main():",
           "The best way to learn is"]
ENGINE = dict(dtype="float64", num_kvcache_blocks=96, block_size=4, max_num_seqs=8, max_model_len=256,
              max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), **ENGINE)


@pytest.fixture(scope="module", params=["inproc", "mp"])
def engine(request, model_dir):
    if request.param == "mp":
        pytest.importorskip("zmq", reason="the engine core in its own process talks over ZMQ (pyzmq)")
    llm = AsyncLLM(defaults.complete_engine_args(EngineArgs(model=str(model_dir), **ENGINE)),
                   multiprocess=request.param == "mp")
    yield llm
    llm.shutdown()


def offline_outputs(offline, prompts, params):
    return offline.generate(prompts, params, use_tqdm=False)


async def collect(engine, prompt, params, request_id):
    """All of one request's outputs, and its completions' texts and tokens joined from them."""
    outs = [out async for out in engine.generate(prompt, params, request_id)]
    texts, tokens = {}, {}
    for out in outs:
        for c in out.outputs:
            joined = params.output_kind is DELTA
            texts[c.index] = texts.get(c.index, "") + c.text if joined else c.text
            tokens[c.index] = tokens.get(c.index, []) + c.token_ids if joined else c.token_ids
    return outs, texts, tokens


async def wait_idle(engine, timeout: float = 10.0):
    """Wait until the engine has no request left (in-process: its scheduler and tables; both: the front end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        core = getattr(engine.engine_core, "proc", None)
        front_idle = not engine.collectors and not engine.output_processor.requests and not engine.output_processor.states
        if front_idle and (core is None or (not core.has_work() and not core.core.requests)):
            if core is not None:
                check_invariants(core.engine)
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the engine did not become idle")


@pytest.mark.parametrize("kind", [DELTA, FINAL])
def test_greedy_equals_offline(engine, offline, kind):
    params = SamplingParams(temperature=0.0, max_tokens=10, output_kind=kind)
    want = offline_outputs(offline, PROMPTS, SamplingParams(temperature=0.0, max_tokens=10))

    async def main():
        results = await asyncio.gather(*[collect(engine, p, params, f"g{kind.name}{i}") for i, p in enumerate(PROMPTS)])
        await wait_idle(engine)
        return results

    for (outs, texts, tokens), ref in zip(asyncio.run(main()), want):
        assert texts[0] == ref.outputs[0].text and tokens[0] == ref.outputs[0].token_ids
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert all(not o.finished for o in outs[:-1])
        assert len(outs) == (len(tokens[0]) if kind is DELTA else 1)


def test_seeded_n_stop_and_logprobs_equal_offline(engine, offline):
    """n > 1 with seeds, stop strings, stop token ids, log-probabilities and the prompt's (computed in the
    engine core, decoded in the front end, in every output of the request): the front end's work."""
    greedy = offline_outputs(offline, PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=12))
    text, ids = greedy[0].outputs[0].text, greedy[1].outputs[0].token_ids
    cases = [(PROMPTS[2], dict(n=3, temperature=1.0, seed=7, max_tokens=8)),
             (PROMPTS[0], dict(temperature=0.0, max_tokens=12, stop=[text[8:12]])),
             (PROMPTS[0], dict(temperature=0.0, max_tokens=12, stop=[text[8:12]], include_stop_str_in_output=True)),
             (PROMPTS[1], dict(temperature=0.0, max_tokens=12, stop_token_ids=[ids[5]])),
             (PROMPTS[3], dict(temperature=0.8, seed=3, max_tokens=6, logprobs=2)),
             (PROMPTS[2], dict(n=2, temperature=0.0, max_tokens=4, prompt_logprobs=3))]
    for j, (prompt, kw) in enumerate(cases):
        ref = offline_outputs(offline, [prompt], SamplingParams(**kw))[0]
        for kind in (DELTA, FINAL):
            outs, texts, tokens = asyncio.run(collect(engine, prompt, SamplingParams(**kw, output_kind=kind), f"s{j}{kind.name}"))
            last = {c.index: c for o in outs for c in o.outputs}
            for c in ref.outputs:
                assert (texts[c.index], tokens[c.index]) == (c.text, c.token_ids), (kw, kind)
                assert (last[c.index].finish_reason, last[c.index].stop_reason) == (c.finish_reason, c.stop_reason)
            if kw.get("logprobs") and kind is FINAL:
                got = last[0].logprobs
                assert [list(d) for d in got] == [list(d) for d in ref.outputs[0].logprobs]
                assert all(abs(a.logprob - b.logprob) < 1e-9 for d, e in zip(got, ref.outputs[0].logprobs)
                           for a, b in zip(d.values(), e.values()))
            for o in outs if kw.get("prompt_logprobs") else ():
                assert len(o.prompt_logprobs) == len(ref.prompt_logprobs) and o.prompt_logprobs[0] is None
                for d, e in zip(o.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
                    assert [(t, lp.rank, lp.decoded_token) for t, lp in d.items()] == [
                        (t, lp.rank, lp.decoded_token) for t, lp in e.items()]
                    assert all(abs(d[t].logprob - e[t].logprob) < 1e-9 for t in d)
    asyncio.run(wait_idle(engine))


def test_abort_paths_leave_the_engine_idle(engine):
    """Cancel the consuming task, close the generator early, and `abort()` from elsewhere."""
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=DELTA)

    async def main():
        seen = asyncio.Event()

        async def consume(request_id):
            async for out in engine.generate(PROMPTS[0], params, request_id):
                if len(out.outputs[0].token_ids) and out.outputs[0].finish_reason is None:
                    seen.set()
        task = asyncio.create_task(consume("cancelled"))
        await asyncio.wait_for(seen.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gen = engine.generate(PROMPTS[1], params, "closed")
        await gen.__anext__()
        await gen.aclose()
        outs = []

        async def aborted():
            async for out in engine.generate(PROMPTS[2], params, "aborted"):
                outs.append(out)
        task = asyncio.create_task(aborted())
        while not outs:
            await asyncio.sleep(0.01)
        await engine.abort("aborted")
        await asyncio.wait_for(task, 10)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        await wait_idle(engine)
        # and the engine keeps serving
        _, texts, _ = await collect(engine, PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=3), "after")
        assert texts[0]
    asyncio.run(main())


def test_bad_input_is_refused_and_the_engine_keeps_serving(engine):
    async def main():
        for prompt, params, what in [("x " * 300, SamplingParams(), "max_model_len"),
                                     ([10**9], SamplingParams(), "token ids"),
                                     (PROMPTS[0], SamplingParams(prompt_logprobs=21), "prompt_logprobs")]:
            with pytest.raises(ValueError, match=what):
                await anext(engine.generate(prompt, params, "bad"))
        slow = engine.generate(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True), "dup")
        await slow.__anext__()
        with pytest.raises(ValueError, match="in use"):
            await anext(engine.generate(PROMPTS[1], SamplingParams(), "dup"))
        await slow.aclose()
        _, texts, _ = await collect(engine, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=4), "ok")
        assert texts[0]
        await wait_idle(engine)
    asyncio.run(main())


def test_load_with_random_aborts(engine, offline):
    """64 concurrent streams, a seeded quarter of them aborted at random points: every other stream ends
    with its finish reason and the offline text, in bounded time, and the engine is left idle."""
    rng = random.Random(12)
    prompts = [f"{rng.choice(PROMPTS)} {i}" for i in range(64)]
    lengths = [rng.randint(4, 16) for _ in prompts]
    aborted = set(rng.sample(range(64), 16))
    want = offline_outputs(offline, prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in lengths])

    async def stream(i):
        await asyncio.sleep(rng.random() * 0.2)
        text, last = "", None
        async for out in engine.generate(prompts[i], SamplingParams(temperature=0.0, max_tokens=lengths[i],
                                                                     output_kind=DELTA), f"load{i}"):
            text, last = text + out.outputs[0].text, out
        return text, last

    async def main():
        tasks = [asyncio.create_task(stream(i)) for i in range(64)]
        for i in sorted(aborted):
            await asyncio.sleep(rng.random() * 0.05)
            tasks[i].cancel()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
        await wait_idle(engine)
        probe = [o async for o in engine.generate(PROMPTS[0], SamplingParams(max_tokens=3, output_kind=DELTA), "probe")]
        return results, probe

    results, probe = asyncio.run(main())
    for i, (result, ref) in enumerate(zip(results, want)):
        if isinstance(result, asyncio.CancelledError):
            assert i in aborted
            continue
        text, last = result
        assert last.finished and last.outputs[0].finish_reason == "length", i
        assert text == ref.outputs[0].text, i
    assert len(probe) == 3
    stats = engine.scheduler_stats  # after the probe's last step: nothing else runs or waits
    assert stats.num_running + stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0


def test_a_killed_engine_core_fails_requests_in_flight(model_dir):
    """kill -9 of the engine core's process: streams in flight end with EngineDeadError (no hang),
    new requests are refused, and no process is left behind."""
    psutil = pytest.importorskip("psutil")
    before = set(psutil.Process().children(recursive=True))
    llm = AsyncLLM(defaults.complete_engine_args(EngineArgs(model=str(model_dir), **ENGINE)))
    child = psutil.Process(llm.engine_core.process.pid)

    async def main():
        gen = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2000, ignore_eos=True, output_kind=DELTA), "x")
        await gen.__anext__()
        child.kill()
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        assert time.monotonic() - start < 10
        assert llm.errored
        with pytest.raises(EngineDeadError):
            await anext(llm.generate(PROMPTS[1], SamplingParams(), "y"))
    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert set(psutil.Process().children(recursive=True)) <= before


@pytest.mark.gpu
def test_inproc_async_llm_on_cuda_equals_offline(tmp_path):
    """On a GPU (the GPU image has no pyzmq: the engine core is stepped by a thread of this process; and no
    default model: a tiny model without a tokenizer, token-id prompts): greedy streams equal offline
    `LLM.generate` on the same device."""
    import torch

    from engine_helpers import make_model, random_prompts

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    make_model(tmp_path, "llama")
    engine_args = dict(ENGINE, device="cuda")
    prompts = random_prompts(6, 3, 20, seed=5)
    want = offline_outputs(LLM(str(tmp_path), **engine_args), prompts, SamplingParams(temperature=0.0, max_tokens=10))
    llm = AsyncLLM(defaults.complete_engine_args(EngineArgs(model=str(tmp_path), **engine_args)), multiprocess=False)
    params = SamplingParams(temperature=0.0, max_tokens=10, output_kind=DELTA)

    async def main():
        return await asyncio.gather(*[collect(llm, p, params, f"cuda{i}") for i, p in enumerate(prompts)])
    try:
        results = asyncio.run(main())
    finally:
        llm.shutdown()
    for (_, _, tokens), ref in zip(results, want):
        assert tokens[0] == ref.outputs[0].token_ids
