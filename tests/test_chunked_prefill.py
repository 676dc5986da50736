"""Chapter 11: the token-budget scheduler and mixed batches.

The engine's greedy tokens equal transformers' whatever the budget, threshold, block size, prefix
caching or preemption (float64 tiny models); seeded samples and prompt logprobs do not depend on
chunking; a partial prefill makes no output; hypothesis drives the scheduler alone with a fake runner
against its contract.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_helpers import check_invariants, hf_greedy, make_model, one_thread, random_prompts, run_engine
from minivllm.config import EngineArgs
from minivllm.core.block_manager import BlockManager
from minivllm.core.chunked_prefix_caching import ChunkedPrefixCachingBlockManager
from minivllm.core.prefix_caching import PrefixCachingBlockManager
from minivllm.core.sched.chunked_prefill import ChunkedPrefillScheduler
from minivllm.core.sched.scheduler import Scheduler
from minivllm.llm import LLM
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.sequence import Sequence, SequenceStatus
from minivllm.worker.mixed_batch import MixedBatchModelRunner

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """(model folder, prompts, max_tokens, transformers' greedy completions). The prompts share
    prefixes (so prefix-cache hits happen) and run from 1 to 90 tokens."""
    folder = tmp_path_factory.mktemp("chunked-llama")
    model = make_model(folder, "llama")
    base = random_prompts(6, 1, 60, seed=11)
    shared = list(range(3, 40))  # 37 tokens: two full blocks of 16 and a partial one
    prompts = base + [shared + p[:20] for p in base[:3]] + [shared, shared + [5] * 53]
    rng = random.Random(3)
    max_tokens = [rng.randint(1, 8) for _ in prompts]
    refs = [hf_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    return folder, prompts, max_tokens, refs


def greedy(max_tokens):
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]


def engine(folder, budget, **kwargs):
    """`LLM`'s default assembly (chapter 11's scheduler) with token budget `budget` (None: 8192)."""
    seqs = {} if budget is None else dict(max_num_batched_tokens=budget, max_num_seqs=min(8, budget))
    kwargs.setdefault("num_kvcache_blocks", 8 * MAX_MODEL_LEN // kwargs.get("block_size", 16))  # the invariant
    return LLM(folder, dtype="float64", max_model_len=MAX_MODEL_LEN, **seqs, **kwargs).llm_engine  # checks visit every block


@pytest.mark.parametrize("budget, threshold, block_size, caching",
                         list(itertools.product([1, 7, 16, 64, None], [0, 5], [1, 16], [True, False])))
def test_greedy_tokens_equal_transformers(oracle, budget, threshold, block_size, caching):
    folder, prompts, max_tokens, refs = oracle
    e = engine(folder, budget, long_prefill_token_threshold=threshold, block_size=block_size,
               enable_prefix_caching=caching)
    assert isinstance(e.scheduler, ChunkedPrefillScheduler) and isinstance(e.model_runner, MixedBatchModelRunner)
    assert isinstance(e.block_manager, ChunkedPrefixCachingBlockManager if caching else BlockManager)
    outs = run_engine(e, prompts, greedy(max_tokens))  # checks the block invariants after every step
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} ({len(prompts[i])} tokens)"
    budget = budget or 8192
    for st in e.stats:  # never over budget; with a threshold, mixed steps really happen
        assert st.num_tokens <= budget
    if budget == 64 and threshold == 5:
        assert any(st.is_prefill and st.num_tokens < st.num_seqs * 5 for st in e.stats)


@pytest.mark.parametrize("limit", [1, 20, None])
def test_mixed_steps_in_cpu_microbatches_keep_the_tokens(oracle, monkeypatch, limit):
    """A mixed step runs in forward passes of at most `limit` scheduled tokens (a longer row alone)."""
    import minivllm.worker.mixed_batch as mixed_batch

    folder, prompts, max_tokens, refs = oracle
    monkeypatch.setattr(MixedBatchModelRunner, "prefill_microbatch_tokens", limit)
    passes, real = [], mixed_batch.prepare_mixed_batch
    monkeypatch.setattr(mixed_batch, "prepare_mixed_batch",
                        lambda seqs, *a: passes.append([s.num_scheduled_tokens for s in seqs]) or real(seqs, *a))
    outs = run_engine(engine(folder, 64), prompts, greedy(max_tokens))
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert passes and all(len(p) == 1 or sum(p) <= (limit or 64) for p in passes)
    assert limit is None or any(len(p) > 1 for p in passes) or limit == 1


@pytest.mark.parametrize("budget", [7, 16])
@pytest.mark.parametrize("caching", [True, False])
def test_forced_preemption_keeps_the_greedy_tokens(oracle, budget, caching):
    folder, prompts, max_tokens, refs = oracle
    # 36 blocks of 4 = 144 tokens: the longest sequence fits alone, the batch does not
    e = engine(folder, budget, block_size=4, num_kvcache_blocks=36, enable_prefix_caching=caching)
    outs = run_engine(e, prompts, greedy([m + 12 for m in max_tokens]))
    assert e.scheduler.num_preemptions >= 2, e.scheduler.num_preemptions
    for out, ref, m in zip(outs, refs, max_tokens):
        assert out.outputs[0].token_ids[:m] == ref


def test_chunking_off_runs_whole_prompts_beside_decodes(oracle):
    folder, prompts, max_tokens, refs = oracle
    e = engine(folder, MAX_MODEL_LEN, enable_chunked_prefill=False)
    outs = run_engine(e, prompts, greedy(max_tokens))
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert all(st.num_tokens <= MAX_MODEL_LEN for st in e.stats)


def test_seeded_samples_do_not_depend_on_chunking(oracle):
    folder, prompts, _, _ = oracle
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=6, ignore_eos=True)
              for i in range(len(prompts))]
    runs = [[o.outputs[0].token_ids for o in run_engine(engine(folder, b), prompts, params)] for b in (1, 7, None)]
    assert runs[0] == runs[1] == runs[2]


def test_prompt_logprobs_do_not_depend_on_chunking(oracle):
    folder, prompts, _, _ = oracle
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, logprobs=2)
    chunked = run_engine(engine(folder, 7), prompts, params)
    whole = run_engine(LLM(folder, dtype="float64", max_model_len=MAX_MODEL_LEN, scheduler_cls=Scheduler).llm_engine,
                       prompts, params)
    for a, b in zip(chunked, whole):
        assert a.prompt_logprobs == b.prompt_logprobs  # one pass over the prompt alone: bit for bit
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):  # a step's rows: attention summed in
            assert {t: v.rank for t, v in x.items()} == {t: v.rank for t, v in y.items()}  # another order, so
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-12 for t in x)  # float64's last bits may differ


def test_a_partial_prefill_makes_no_output_and_decodes_go_on(oracle):
    folder = oracle[0]
    e = engine(folder, 16, block_size=16)
    stream = lambda n, **kw: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,  # noqa: E731
                                            output_kind=RequestOutputKind.DELTA, **kw)
    e.add_request("short", [1, 2, 3], stream(20))
    assert [o.request_id for o in e.step()] == ["short"]  # its prefill, sampled
    e.add_request("long", list(range(50)), stream(3, prompt_logprobs=1))  # 15 a step beside the decode, then 5
    outs = [e.step() for _ in range(4)]  # vllm#14239: prompt logprobs made an output for a partial prefill
    assert [[(o.request_id, len(o.outputs[0].token_ids)) for o in step] for step in outs] == \
        [[("short", 1)]] * 3 + [[("short", 1), ("long", 1)]]
    assert len(outs[3][1].prompt_logprobs) == 50  # all of them, once
    assert [st.num_tokens for st in e.stats[1:5]] == [16, 16, 16, 6]
    while e.has_unfinished_requests():
        e.step()
    check_invariants(e)


def test_a_block_is_shareable_from_the_step_that_fills_it_and_num_cached_tokens_counts_the_hit_once(oracle):
    folder = oracle[0]
    e = engine(folder, 48, block_size=16, long_prefill_token_threshold=16)
    prompt = list(range(48))  # three full blocks
    final = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    e.add_request("a", prompt, final)
    e.step()  # a's first chunk: block 0
    e.add_request("b", prompt, final)  # admitted beside a's second chunk: blocks 0 and 1 (written this step)
    done = {}
    while e.has_unfinished_requests():
        done.update((o.request_id, o) for o in e.step() if o.finished)
        check_invariants(e)
    assert done["a"].num_cached_tokens == 0 and done["b"].num_cached_tokens == 32
    assert done["a"].outputs[0].token_ids == done["b"].outputs[0].token_ids
    assert [st.num_tokens for st in e.stats[:3]] == [16, 32, 17]  # step 2: a's block 1 and b's block 2 only
    e.add_request("c", prompt, final)
    outs = [o for _ in range(3) for o in e.step() if o.finished]
    assert outs[0].num_cached_tokens == 32


def test_a_failed_step_caches_nothing_it_did_not_write(oracle):
    """The model raises in a step with a chunk and a newcomer sharing its block: nothing planned for
    that step stays cached, the prompts start again, and the outputs are transformers' all the same."""
    folder, prompts, max_tokens, refs = oracle
    e = engine(folder, 48, block_size=16, long_prefill_token_threshold=16)
    prompt = list(range(48))
    e.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    e.step()
    e.add_request("b", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    real = e.model_runner.run
    e.model_runner.run = lambda *a: (_ for _ in ()).throw(RuntimeError("the model failed"))
    with pytest.raises(RuntimeError):
        e.step()
    e.model_runner.run = real
    check_invariants(e)
    bm = e.block_manager
    assert len(bm.hash_to_block_id) == 1  # block 0, written in step 1; block 1 (planned) is forgotten
    done = {}
    while e.has_unfinished_requests():
        done.update((o.request_id, o) for o in e.step() if o.finished)
        check_invariants(e)
    assert done["a"].outputs[0].token_ids == done["b"].outputs[0].token_ids


@pytest.mark.parametrize("kwargs, names", [
    (dict(long_prefill_token_threshold=-1), ["long_prefill_token_threshold", "-1"]),
    (dict(max_num_batched_tokens=0), ["max_num_batched_tokens", "0"]),
    (dict(max_num_batched_tokens=4, max_num_seqs=8), ["max_num_batched_tokens=4", "max_num_seqs=8"]),
    (dict(max_num_batched_tokens=100, max_num_seqs=8, enable_chunked_prefill=False),
     ["max_num_batched_tokens=100", "max_model_len=128"]),
    (dict(enable_chunked_prefill="yes"), ["enable_chunked_prefill"]),
])
def test_bad_settings_raise_value_error_naming_them(oracle, kwargs, names):
    with pytest.raises(ValueError) as e:
        LLM(oracle[0], dtype="float64", max_model_len=MAX_MODEL_LEN, **kwargs)
    for name in names:
        assert name in str(e.value)


def test_a_budget_below_max_model_len_is_fine_with_chunking(oracle):
    folder, prompts, max_tokens, refs = oracle
    e = engine(folder, 8)
    assert e.args.max_num_batched_tokens == 8 < e.args.max_model_len
    assert [o.outputs[0].token_ids for o in run_engine(e, prompts[-2:], greedy(max_tokens[-2:]))] == refs[-2:]
    assert LLM(folder, dtype="float64", max_model_len=MAX_MODEL_LEN).llm_engine.args.max_num_batched_tokens == 8192


# --- the scheduler alone, driven by hypothesis with a fake runner ----------------------------------
op = st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(1, 3), min_size=1, max_size=30), st.integers(1, 6)),
    st.tuples(st.just("step"), st.integers(0, 3)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


@pytest.mark.parametrize("manager", [BlockManager, ChunkedPrefixCachingBlockManager, PrefixCachingBlockManager])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=5, max_size=60), block_size=st.integers(1, 4), num_blocks=st.integers(8, 24),
       max_num_seqs=st.integers(1, 4), extra_budget=st.integers(0, 12), threshold=st.integers(0, 6),
       chunking=st.booleans())
def test_scheduler_contract(manager, ops, block_size, num_blocks, max_num_seqs, extra_budget, threshold, chunking):
    """Tiny vocabulary (tokens 1-3) so prefixes repeat. After every `schedule`: the budget holds; no chunk
    runs past `num_tokens` or the threshold; running sequences come before waiting ones unless the
    budget ran out; a newly admitted sequence starts at its block-aligned prefix-cache hit; a running
    sequence is served within a bounded number of steps; the block invariants hold."""
    max_model_len = 30
    budget = max_num_seqs + extra_budget if chunking else max_model_len + extra_budget
    s = ChunkedPrefillScheduler(manager(num_blocks, block_size), max_num_seqs, budget, max_model_len, {0},
                                enable_chunked_prefill=chunking, long_prefill_token_threshold=threshold)
    bound = -(-max_num_seqs * max_model_len // budget) + 1  # steps a running sequence may wait, at most
    waited: dict[int, int] = {}
    live: list[Sequence] = []

    def step(token: int) -> None:
        before_running, before_waiting = list(s.running), list(s.waiting)
        preemptions = s.num_preemptions
        batch, is_prefill = s.schedule()
        assert batch or s.is_finished(), "nothing scheduled although sequences are waiting or running"
        assert sum(x.num_scheduled_tokens for x in batch) <= budget
        for x in batch:
            assert 1 <= x.num_scheduled_tokens and x.num_computed_tokens + x.num_scheduled_tokens <= x.num_tokens
            if chunking and threshold and x.num_tokens - x.num_computed_tokens > 1:
                assert x.num_scheduled_tokens <= threshold
            if not chunking:
                assert x.num_computed_tokens + x.num_scheduled_tokens == x.num_tokens  # whole prompts only
        admitted = [x for x in batch if x in before_waiting]
        assert batch[:len(batch) - len(admitted)] == [x for x in batch if x not in admitted]  # running first
        left = budget - sum(x.num_scheduled_tokens for x in batch)
        if admitted:
            assert s.num_preemptions == preemptions
            assert all(x in batch for x in before_running), "a running sequence was skipped for a waiting one"
            for x in admitted:
                assert x.num_computed_tokens == x.num_cached_tokens and x.num_cached_tokens % block_size == 0
                assert x.num_cached_tokens <= x.num_tokens - 1
        for x in before_running:
            if x.status == SequenceStatus.RUNNING and x not in batch:
                assert left == 0, "a running sequence was skipped with budget left"
                waited[x.seq_id] = waited.get(x.seq_id, 0) + 1
                assert waited[x.seq_id] <= bound, f"{x} waited {waited[x.seq_id]} steps"
            else:
                waited.pop(x.seq_id, None)
        assert is_prefill == any(x.num_computed_tokens + 1 != x.num_tokens or x.num_computed_tokens < x.num_prompt_tokens
                                 for x in batch)
        tokens = [token if x.num_computed_tokens + x.num_scheduled_tokens == x.num_tokens else None for x in batch]
        advanced = s.postprocess(batch, tokens)
        assert advanced == [x for x, t in zip(batch, tokens) if t is not None]
        check_invariants(s)

    for o in ops:
        if o[0] == "add":
            x = Sequence(o[1], SamplingParams(max_tokens=o[2]), block_size=block_size)
            if x.num_blocks <= num_blocks and x.num_tokens < max_model_len:  # what the engine accepts
                s.add(x)
                live.append(x)
        elif o[0] == "step":
            step(o[1])
        elif live:
            s.abort(live[o[1] % len(live)])
        live = [x for x in live if not x.is_finished]
        check_invariants(s)
    for _ in range(3000):  # drain: everything finishes, nothing hangs
        if s.is_finished():
            break
        step(1)
    assert s.is_finished()
    assert s.block_manager.num_free_blocks == num_blocks


def test_engine_args_defaults_follow_vllm():
    args = EngineArgs()
    assert args.enable_chunked_prefill is True and args.long_prefill_token_threshold == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("budget", [7, None])
def test_gpu_mixed_steps_and_graph_replays_equal_transformers(oracle, budget):
    """On CUDA the default assembly runs decode steps through chapter 08's graphs and mixed steps
    eagerly (float64: the plain-torch capturable backend)."""
    from minivllm.worker.cuda_graph import CapturablePagedAttention
    from minivllm.worker.mixed_batch import MixedBatchCUDAGraphModelRunner

    folder, prompts, max_tokens, refs = oracle
    e = engine(folder, budget, device="cuda", attention_backend=CapturablePagedAttention)
    assert isinstance(e.model_runner, MixedBatchCUDAGraphModelRunner) and e.model_runner.decode_graphs is not None
    outs = run_engine(e, prompts, greedy(max_tokens))
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert any(not st.is_prefill for st in e.stats) and any(st.is_prefill for st in e.stats)
