"""Grading tests for chapters 04-06 (`pytest -m ch05_ex1 --impl=exercises`, ...); see test_grading.py.

Each rebuilt class is compared with minivllm's own on random operation sequences (hypothesis), then
plugged into the real engine, whose greedy outputs must not change.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import load
from engine_helpers import check_invariants, make_model, one_thread, random_prompts, run_engine
from minivllm.block_manager import BlockManager
from minivllm.engine import LLMEngine
from minivllm.models.llama import attention_reference
from minivllm.prefix_caching import PrefixCachingBlockManager
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler import Scheduler
from minivllm.sequence import Sequence

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


@pytest.fixture(scope="module")
def ch04(impl_name):
    return load("ch04_scheduler", impl_name)


@pytest.fixture(scope="module")
def ch05(impl_name):
    return load("ch05_paged_attention", impl_name)


@pytest.fixture(scope="module")
def ch06(impl_name):
    return load("ch06_prefix_caching", impl_name)


@pytest.fixture(scope="module")
def engine_case(tmp_path_factory):
    """A tiny model, 12 prompts, and minivllm's own greedy outputs on a cache small enough to preempt."""
    folder = tmp_path_factory.mktemp("grading-engine")
    make_model(folder, "llama")
    prompts = random_prompts(12, 1, 80, seed=3, vocab=8)  # a small vocabulary: shared prefixes happen
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kwargs = dict(model=folder, dtype="float64", max_model_len=128, block_size=4, num_kvcache_blocks=40)
    ref = [o.outputs[0].token_ids for o in run_engine(LLMEngine(**kwargs), prompts, params)]
    return kwargs, prompts, params, ref


def _engine_unchanged(engine_case, **plug):
    kwargs, prompts, params, ref = engine_case
    engine = LLMEngine(**{**kwargs, **plug})
    assert [o.outputs[0].token_ids for o in run_engine(engine, prompts, params)] == ref
    assert engine.scheduler.num_preemptions > 0
    check_invariants(engine)


def _random_ops(rng, n=40) -> list[tuple]:
    """A random workload: adds of short prompts over a 3-token vocabulary, many steps, a few aborts."""
    ops = []
    for _ in range(n):
        r = rng.random()
        if r < 0.4:
            ops.append(("add", [rng.randint(1, 3) for _ in range(rng.randint(1, 10))], rng.randint(1, 10)))
        elif r < 0.92:
            ops.append(("step", [rng.randint(1, 3) for _ in range(6)]))
        else:
            ops.append(("abort", rng.randint(0, 30)))
    return ops


OPS = st.randoms(use_true_random=False).map(_random_ops)


def _trace(scheduler_cls, manager_cls, ops, block_size, num_blocks, max_num_seqs):
    """Drive a scheduler through `ops`; return what it did at each step."""
    sched = scheduler_cls(manager_cls(num_blocks, block_size), max_num_seqs, 24, 24, {0})
    seqs, trace = [], []
    for op in ops:
        if op[0] == "add":
            seq = Sequence(op[1], SamplingParams(max_tokens=op[2]), block_size=block_size, seq_id=len(seqs))
            seqs.append(seq)
            if seq.num_blocks <= num_blocks:
                sched.add(seq)
        elif op[0] == "step":
            batch, is_prefill = sched.schedule()
            sched.postprocess(batch, (op[1] * 10)[:len(batch)])
            trace.append((is_prefill, [s.seq_id for s in batch]))
        elif seqs:
            sched.abort(seqs[op[1] % len(seqs)])
        check_invariants(sched)
        trace.append([(s.seq_id, list(s.block_table), s.num_cached_tokens) for s in seqs])
    return trace


@pytest.mark.ch04
@pytest.mark.ch04_ex1
@settings(max_examples=150, deadline=None)
@given(ops=OPS, block_size=st.integers(1, 4), num_blocks=st.integers(3, 10), max_num_seqs=st.integers(1, 4))
def test_ch04_ex1_schedule_matches(ch04, ops, block_size, num_blocks, max_num_seqs):
    args = (ops, block_size, num_blocks, max_num_seqs)
    assert _trace(ch04.MyScheduler, BlockManager, *args) == _trace(Scheduler, BlockManager, *args)


@pytest.mark.ch04
@pytest.mark.ch04_ex1
def test_ch04_ex1_engine_unchanged(ch04, engine_case):
    _engine_unchanged(engine_case, scheduler_cls=ch04.MyScheduler)


@pytest.mark.ch05
@pytest.mark.ch05_ex1
@settings(max_examples=150, deadline=None)
@given(ops=OPS, block_size=st.integers(1, 4), num_blocks=st.integers(3, 10), max_num_seqs=st.integers(1, 4))
def test_ch05_ex1_block_tables_match(ch05, ops, block_size, num_blocks, max_num_seqs):
    args = (ops, block_size, num_blocks, max_num_seqs)
    assert _trace(Scheduler, ch05.MyBlockManager, *args) == _trace(Scheduler, BlockManager, *args)


@pytest.mark.ch05
@pytest.mark.ch05_ex1
def test_ch05_ex1_engine_unchanged(ch05, engine_case):
    _engine_unchanged(engine_case, kv_manager=ch05.MyBlockManager)


@pytest.mark.ch05
@pytest.mark.ch05_ex2
@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 20), min_size=1, max_size=5), block_size=st.integers(1, 6),
       groups=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_ch05_ex2_paged_decode_matches_reference(ch05, lens, block_size, groups, seed):
    g = torch.Generator().manual_seed(seed)
    kvh, d = 2, 8
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 1
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, start = [], 0
    for k in need:
        tables.append(perm[start:start + k])
        start += k
    bt = torch.tensor([t + [-1] * (max(need) - len(t)) for t in tables])
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=g, dtype=torch.float64)
    q = torch.randn(len(lens), kvh * groups, d, generator=g, dtype=torch.float64)
    got = ch05.paged_decode_attention(q, k_cache, v_cache, bt, torch.tensor(lens), 0.35)
    for i, n in enumerate(lens):
        k = k_cache[tables[i]].flatten(0, 1)[:n]
        v = v_cache[tables[i]].flatten(0, 1)[:n]
        torch.testing.assert_close(got[i], attention_reference(q[i:i + 1], k, v, 0.35)[0], atol=1e-12, rtol=0)


@pytest.mark.ch06
@pytest.mark.ch06_ex1
@settings(max_examples=150, deadline=None)
@given(ops=OPS, block_size=st.integers(1, 4), num_blocks=st.integers(3, 10), max_num_seqs=st.integers(1, 4))
def test_ch06_ex1_cached_block_tables_match(ch06, ops, block_size, num_blocks, max_num_seqs):
    args = (ops, block_size, num_blocks, max_num_seqs)
    got = _trace(Scheduler, ch06.MyPrefixCachingBlockManager, *args)
    assert got == _trace(Scheduler, PrefixCachingBlockManager, *args)


@pytest.mark.ch06
@pytest.mark.ch06_ex1
def test_ch06_ex1_engine_unchanged(ch06, engine_case):
    _engine_unchanged(engine_case, kv_manager=ch06.MyPrefixCachingBlockManager)
