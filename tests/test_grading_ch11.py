"""Grading tests for chapter 11's extend exercise (`pytest -m ch11_ex3 --impl=exercises`); see test_grading.py.

`MyScheduler` (vLLM V0's `max_num_partial_prefills` and `max_long_partial_prefills` on chapter 11's
token-budget scheduler) is graded by its contract, never by comparison with minivllm's code: in a
scheduler-only simulation with a fake model runner (a short prompt that arrives while long prompts are
being prefilled gets its first token before they do; under random arrivals, aborts and tiny KV caches
the limits, the budget and the KV-cache invariants hold every step and everything finishes), and
plugged into the engine, whose greedy tokens must equal transformers' (tiny float64 model).
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters import load
from engine_helpers import check_invariants, hf_greedy, make_model, one_thread, random_prompts, run_engine
from minivllm.core.block_manager import BlockManager
from minivllm.core.chunked_prefix_caching import ChunkedPrefixCachingBlockManager
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceStatus

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)
SIM_MAX_MODEL_LEN = 200


@pytest.fixture(scope="module")
def ch11(impl_name):
    return load("ch11_chunked_prefill", impl_name)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _decoding(x: Sequence) -> bool:
    """Computes just its newest generated token (the definition in `MyScheduler`'s docstring)."""
    return x.num_prompt_tokens <= x.num_computed_tokens == x.num_tokens - 1


def _step(s, budget: int, threshold: int, limits: tuple[int, int], at: str, token: int = 1) -> list[Sequence]:
    """One step of `s` with a fake model runner, checking the contract; returns the sequences that got a token."""
    before = list(s.running)
    batch, is_prefill = s.schedule()
    _expect(isinstance(batch, list) and isinstance(is_prefill, bool), f"{at}: schedule() must return (list, bool)")
    _expect(bool(batch) or s.is_finished(), f"{at}: nothing scheduled although sequences wait or run")
    _expect(len({id(x) for x in batch}) == len(batch), f"{at}: a sequence scheduled twice")
    total = sum(x.num_scheduled_tokens for x in batch)
    _expect(total <= budget, f"{at}: {total} tokens scheduled, max_num_batched_tokens={budget}")
    prefills = [x for x in batch if not _decoding(x)]
    long = [x for x in prefills if 0 < threshold < x.num_prompt_tokens]
    _expect(len(prefills) <= limits[0], f"{at}: {len(prefills)} prefills in one step (sequences "
            f"{[x.seq_id for x in prefills]}), max_num_partial_prefills={limits[0]}")
    _expect(len(long) <= limits[1], f"{at}: {len(long)} long prefills in one step (sequences "
            f"{[x.seq_id for x in long]}), max_long_partial_prefills={limits[1]}")
    for x in batch:
        n, start = x.num_scheduled_tokens, x.num_computed_tokens
        _expect(x.status == SequenceStatus.RUNNING and any(x is r for r in s.running),
                f"{at}: scheduled sequence {x.seq_id} must be RUNNING and in `running`")
        _expect(1 <= n and start + n <= x.num_tokens, f"{at}: sequence {x.seq_id} computes [{start}, {start + n}) "
                f"of its {x.num_tokens} tokens")
        _expect(not threshold or n <= threshold, f"{at}: sequence {x.seq_id} computes {n} tokens, "
                f"long_prefill_token_threshold={threshold}")
        _expect(len(x.block_table) * s.block_manager.block_size >= start + n,
                f"{at}: sequence {x.seq_id} computes up to token {start + n} without blocks for it")
    _expect(is_prefill == bool(prefills), f"{at}: is_prefill={is_prefill} with prefills {[x.seq_id for x in prefills]}")
    for x in before:  # decodes are never held back while budget is left
        if x.status == SequenceStatus.RUNNING and _decoding(x) and not any(x is b for b in batch):
            _expect(total == budget, f"{at}: running sequence {x.seq_id} only decodes, yet was skipped with "
                    f"{budget - total} tokens of budget left")
    tokens = [token if x.num_computed_tokens + x.num_scheduled_tokens == x.num_tokens else None for x in batch]
    advanced = s.postprocess(batch, tokens)
    try:
        check_invariants(s)
    except AssertionError as e:
        raise AssertionError(f"{at}: a KV-cache invariant broke: {e}") from e
    return advanced


def _first_token_steps(ch11, limits, threshold=8, budget=16, long_len=100, num_long=2, short_at=2):
    """`num_long` prompts of `long_len` tokens, then (after `short_at` steps) a 4-token one; the step at which
    each got its first token."""
    s = ch11.MyScheduler(BlockManager(200, 4), 8, budget, SIM_MAX_MODEL_LEN, {0},
                         long_prefill_token_threshold=threshold, max_num_partial_prefills=limits[0],
                         max_long_partial_prefills=limits[1])
    longs = [Sequence([1 + (i + k) % 7 for i in range(long_len)], SamplingParams(max_tokens=3), block_size=4)
             for k in range(num_long)]
    short = Sequence([3, 1, 4, 1], SamplingParams(max_tokens=3), block_size=4)
    for x in longs:
        s.add(x)
    first: dict[int, int] = {}
    for step in range(1, 200):
        if step == short_at + 1:
            s.add(short)
        for x in _step(s, budget, threshold, limits, f"ch11_ex3: step {step}"):
            first.setdefault(x.seq_id, step)
        if s.is_finished():
            break
    _expect(s.is_finished(), "ch11_ex3: the prompts never finished")
    return {"short": first[short.seq_id], **{f"long {i}": first[x.seq_id] for i, x in enumerate(longs)}}, short_at + 1


@pytest.mark.ch11
@pytest.mark.ch11_ex3
@pytest.mark.parametrize("limits, num_long", [((2, 1), 2), ((3, 1), 3), ((3, 2), 3)])
def test_ch11_ex3_a_short_prompt_overtakes_long_ones(ch11, limits, num_long):
    """Long prompts (100 tokens, threshold 8, a budget of 8 tokens more than `max_long_partial_prefills`
    long chunks take) are being prefilled when a 4-token prompt arrives: with the limits it starts at once
    and gets its first token before any long one does. Without them the long prompts take the whole budget."""
    first, arrival = _first_token_steps(ch11, limits, budget=8 * (limits[1] + 1), num_long=num_long)
    longs = {k: v for k, v in first.items() if k != "short"}
    _expect(first["short"] == arrival, f"ch11_ex3: limits {limits}: the short prompt arrived at step {arrival} and "
            f"got its first token at step {first['short']}, expected at once (first tokens: {first})")
    _expect(first["short"] < min(longs.values()), f"ch11_ex3: limits {limits}: first tokens at steps {first}: the "
            "short prompt should come first")
    s = ch11.MyScheduler(BlockManager(8, 4), 4, 16, 32, set(), long_prefill_token_threshold=4,
                         max_num_partial_prefills=3, max_long_partial_prefills=2)
    _expect((s.max_num_partial_prefills, s.max_long_partial_prefills) == (3, 2), "ch11_ex3: the limits given are kept")
    for bad, name in ((dict(max_num_partial_prefills=0), "max_num_partial_prefills"),
                      (dict(max_num_partial_prefills=2, max_long_partial_prefills=3), "max_long_partial_prefills")):
        with pytest.raises(ValueError, match=name):
            ch11.MyScheduler(BlockManager(8, 4), 4, 16, 32, set(), **bad)


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 5)),
    st.tuples(st.just("step"), st.integers(0, 3)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
), min_size=5, max_size=40)


@pytest.mark.ch11
@pytest.mark.ch11_ex3
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], report_multiple_bugs=False)
@given(ops=OPS, caching=st.booleans(), block_size=st.integers(1, 4), num_blocks=st.integers(12, 40),
       max_num_seqs=st.integers(1, 5), budget=st.integers(5, 24), threshold=st.integers(0, 8),
       partial=st.integers(1, 3), data=st.data())
def test_ch11_ex3_limits_budget_and_invariants_hold_every_step(ch11, ops, caching, block_size, num_blocks,
                                                               max_num_seqs, budget, threshold, partial, data):
    limits = (partial, data.draw(st.integers(1, partial)))
    manager = ChunkedPrefixCachingBlockManager if caching else BlockManager
    max_model_len = 48
    s = ch11.MyScheduler(manager(num_blocks, block_size), max_num_seqs, budget, max_model_len, {0},
                         long_prefill_token_threshold=threshold, max_num_partial_prefills=limits[0],
                         max_long_partial_prefills=limits[1])
    live, step = [], 0
    for o in ops:
        if o[0] == "add":
            x = Sequence([1 + i % 3 for i in range(o[1])], SamplingParams(max_tokens=o[2]), block_size=block_size)
            if x.num_blocks <= num_blocks and x.num_tokens < max_model_len:
                s.add(x)
                live.append(x)
        elif o[0] == "step":
            step += 1
            _step(s, budget, threshold, limits, f"ch11_ex3: step {step}", token=o[1])
        elif live:
            s.abort(live[o[1] % len(live)])
        live = [x for x in live if not x.is_finished]
    for _ in range(3000):
        if s.is_finished():
            break
        step += 1
        _step(s, budget, threshold, limits, f"ch11_ex3: step {step}")
    _expect(s.is_finished(), f"ch11_ex3: sequences {[x.seq_id for x in [*s.waiting, *s.running]]} never finished")
    _expect(s.block_manager.num_free_blocks == num_blocks, "ch11_ex3: blocks still held after every request finished")


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ch11-extend-llama")
    model = make_model(folder, "llama", seed=2)
    prompts = random_prompts(4, 30, 90, seed=31) + random_prompts(4, 1, 6, seed=32)  # long ones, then short ones
    rng = random.Random(7)
    max_tokens = [rng.randint(2, 8) for _ in prompts]
    return folder, prompts, max_tokens, [hf_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]


@pytest.mark.ch11
@pytest.mark.ch11_ex3
@pytest.mark.parametrize("limits, blocks", [((2, 1), 64), ((3, 1), 32), ((1, 1), 64)])
def test_ch11_ex3_engine_greedy_equals_transformers(ch11, oracle, limits, blocks):
    folder, prompts, max_tokens, refs = oracle
    scheduler = type("Limited", (ch11.MyScheduler,), {"max_num_partial_prefills": limits[0],
                                                      "max_long_partial_prefills": limits[1]})
    e = LLM(folder, dtype="float64", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=8, block_size=4,
            num_kvcache_blocks=blocks, long_prefill_token_threshold=8, scheduler_cls=scheduler).llm_engine
    _expect(isinstance(e.scheduler, ch11.MyScheduler), "ch11_ex3: the engine did not take MyScheduler")
    outs = run_engine(e, prompts, [SamplingParams(temperature=0, max_tokens=m + 10, ignore_eos=True)
                                   for m in max_tokens])
    for i, (out, ref) in enumerate(zip(outs, refs)):
        got = out.outputs[0].token_ids[:len(ref)]
        _expect(got == ref, f"ch11_ex3: limits {limits}, {blocks} blocks: prompt {i} ({len(prompts[i])} tokens): "
                f"greedy tokens {got}, transformers' {ref}")
