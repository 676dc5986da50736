"""The Scheduler (chapter 04) with the chapter 04-06 KV managers, driven without a model."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_helpers import check_invariants
from minivllm.core.block_manager import BlockManager
from minivllm.core.prefix_caching import PrefixCachingBlockManager
from minivllm.sampling_params import SamplingParams
from minivllm.core.kv_cache_manager import ContiguousBlockManager, slot_mapping
from minivllm.core.sched.scheduler import Scheduler
from minivllm.sequence import Sequence, SequenceStatus


def make(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
         manager=BlockManager, eos=(0,)):
    bm = manager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, max_model_len, set(eos))


def seq(n, block_size=4, first=1, **params):
    params.setdefault("max_tokens", 4)
    return Sequence(list(range(first, first + n)), SamplingParams(**params), block_size=block_size)


def test_prefill_first_then_decode_in_admission_order():
    s = make()
    a, b = seq(5), seq(3)
    s.add(a)
    s.add(b)
    batch, is_prefill = s.schedule()
    assert is_prefill and batch == [a, b]
    assert a.status == b.status == SequenceStatus.RUNNING
    s.postprocess(batch, [9, 9])
    c = seq(2)
    s.add(c)
    batch, is_prefill = s.schedule()  # a newcomer is prefilled before the running ones decode
    assert is_prefill and batch == [c]
    s.postprocess(batch, [9])
    batch, is_prefill = s.schedule()
    assert not is_prefill and batch == [a, b, c]
    check_invariants(s)


def test_limits_max_num_seqs_and_batched_tokens():
    s = make(max_num_seqs=2)
    seqs = [seq(3) for _ in range(3)]
    for x in seqs:
        s.add(x)
    assert s.schedule()[0] == seqs[:2]
    s = make(max_num_batched_tokens=10, max_model_len=10)
    seqs = [seq(4), seq(4), seq(4)]
    for x in seqs:
        s.add(x)
    assert s.schedule()[0] == seqs[:2]  # 8 tokens; a third would make 12 > 10
    assert list(s.waiting) == seqs[2:]


def test_bad_limits_are_refused_once_at_the_boundary():
    """`EngineArgs` refuses a bad limit with a ValueError naming it; the scheduler, built from checked
    settings, only asserts (no validation call of its own)."""
    from minivllm.config import EngineArgs

    for kwargs in (dict(max_num_seqs=0), dict(max_num_batched_tokens=0), dict(max_model_len=0)):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            EngineArgs(**kwargs).check()
        with pytest.raises(AssertionError):
            make(**kwargs)


def test_finish_reasons():
    s = make(max_model_len=8)
    stop, ignore, capped, long = seq(2), seq(2, ignore_eos=True), seq(2, max_tokens=1), seq(6, max_tokens=10)
    for x in (stop, ignore, capped, long):
        s.add(x)
    batch, _ = s.schedule()
    s.postprocess(batch, [0, 0, 5, 5])
    assert stop.finish_reason == "stop" and stop.completion_token_ids == [0]
    assert ignore.finish_reason is None
    assert capped.finish_reason == "length"
    batch, _ = s.schedule()
    s.postprocess(batch, [5, 5])
    assert long.num_tokens == 8 and long.finish_reason == "length"  # reached max_model_len
    assert list(s.running) == [ignore]
    check_invariants(s)


def test_preemption_sends_the_newest_to_the_front_of_waiting():
    s = make(num_blocks=4, block_size=2)
    a, b = seq(2, block_size=2, max_tokens=10), seq(2, block_size=2, max_tokens=10)
    late = seq(5, block_size=2)
    s.add(a)
    s.add(b)
    s.postprocess(*(lambda r: (r[0], [7] * len(r[0])))(s.schedule()))  # prefill a, b: 2 blocks
    s.add(late)  # needs 3 blocks, only 2 free: waits
    for _ in range(2):
        batch, is_prefill = s.schedule()
        assert not is_prefill
        s.postprocess(batch, [7] * len(batch))
        check_invariants(s)
    # a and b each grew a second block; the cache is full; the next block forces a preemption
    batch, _ = s.schedule()
    s.postprocess(batch, [7] * len(batch))
    batch, _ = s.schedule()
    assert s.num_preemptions == 1
    assert batch == [a] and list(s.waiting) == [b, late]  # b was admitted last
    assert b.status == SequenceStatus.WAITING and not b.block_table
    check_invariants(s)


def test_abort_frees_blocks():
    s = make()
    a, b = seq(5), seq(3)
    s.add(a)
    s.add(b)
    s.schedule()
    assert s.abort(a) and a.finish_reason == "abort"
    assert s.abort(b) and not s.abort(b)
    assert s.is_finished()
    check_invariants(s)


def test_contiguous_manager_reserves_one_region_per_sequence():
    s = Scheduler(ContiguousBlockManager(2, 32), 8, 64, 32)
    xs = [seq(3, block_size=32) for _ in range(3)]
    for x in xs:
        s.add(x)
    batch, _ = s.schedule()
    assert batch == xs[:2] and [x.block_table for x in xs] == [[0], [1], []]
    with pytest.raises(AssertionError):
        ContiguousBlockManager(0, 32)


def test_contiguous_manager_from_cache_size_and_discard_unwritten():
    m = ContiguousBlockManager.from_cache_size(1000, 16, 300)  # one region of max_model_len per sequence
    assert (m.num_blocks, m.block_size) == (3, 300)
    x = seq(5, block_size=300)
    m.allocate(x)
    m.discard_unwritten([x])  # nothing to forget: the region stays with its sequence
    assert x.block_table == [0] and m.num_free_blocks == 2
    with pytest.raises(AssertionError):  # the engine refuses it first (fit_max_model_len)
        ContiguousBlockManager.from_cache_size(299, 16, 300)


def test_slot_mapping_is_block_then_offset():
    assert slot_mapping([5, 2], 4, 0, 8) == [20, 21, 22, 23, 8, 9, 10, 11]
    assert slot_mapping([5, 2], 4, 3, 6) == [23, 8, 9]
    assert slot_mapping([7], 100, 99, 100) == [799]


# --- property-based: random add / step / abort against the invariants ------------------------------
op = st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 2), min_size=1, max_size=10), st.integers(1, 12),
              st.booleans()),
    st.tuples(st.just("step"), st.lists(st.integers(0, 2), min_size=8, max_size=8)),
    st.tuples(st.just("step"), st.lists(st.integers(1, 2), min_size=8, max_size=8)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


@pytest.mark.parametrize("manager", [BlockManager, PrefixCachingBlockManager])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=10, max_size=60), block_size=st.integers(1, 4), num_blocks=st.integers(3, 10),
       max_num_seqs=st.integers(1, 5))
def test_random_operations_keep_invariants(manager, ops, block_size, num_blocks, max_num_seqs):
    """Tiny vocabulary (tokens 0-2) so prefixes repeat and cache hits, sharing and preemption happen."""
    max_model_len = 20
    s = Scheduler(manager(num_blocks, block_size), max_num_seqs, max_model_len, max_model_len, {0})
    live: list[Sequence] = []
    for o in ops:
        if o[0] == "add":
            _, tokens, max_tokens, ignore_eos = o
            x = Sequence([t + 1 for t in tokens], SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                         block_size=block_size)
            if x.num_blocks <= num_blocks:  # the engine refuses larger prompts at submission
                s.add(x)
                live.append(x)
        elif o[0] == "step":
            batch, _ = s.schedule()
            assert batch or s.is_finished(), "nothing scheduled although sequences are waiting or running"
            s.postprocess(batch, o[1][:len(batch)] + [1] * max(0, len(batch) - 8))
        elif live:
            s.abort(live[o[1] % len(live)])
        live = [x for x in live if not x.is_finished]
        check_invariants(s)
    for _ in range(2000):  # drain: everything finishes, nothing hangs
        if s.is_finished():
            break
        batch, _ = s.schedule()
        assert batch
        s.postprocess(batch, [1] * len(batch))
        check_invariants(s)
    assert s.is_finished()
    assert s.block_manager.num_free_blocks == num_blocks


def test_fork_admits_the_child_into_running_beside_its_parent():
    """The scheduler moves the forked sequence itself: into `running` with the parent's blocks shared
    (the block manager's `fork`), or into `waiting` when it cannot (no seat, parent finished, or a
    manager without reference counts)."""
    s = make(max_num_seqs=2)
    parent = seq(6)
    s.add(parent)
    s.postprocess(s.schedule()[0], [9])
    child = seq(6)
    copies = s.fork(parent, child)
    assert child.status == SequenceStatus.RUNNING and list(s.running) == [parent, child]
    assert copies == [(parent.block_table[1], child.block_table[1])] and child.num_cached_tokens == 5
    assert s.block_manager.blocks[parent.block_table[0]].ref_count == 2
    third = seq(6)
    assert s.fork(parent, third) is None and list(s.waiting) == [third]  # no free seat: it waits
    check_invariants(s)
    contiguous = make(manager=lambda n, bs: ContiguousBlockManager(2, 64))
    p = seq(6)
    contiguous.add(p)
    contiguous.postprocess(contiguous.schedule()[0], [9])
    c = seq(6)
    assert contiguous.fork(p, c) is None and list(contiguous.waiting) == [c]


def test_undo_failed_step_sends_a_prefill_back_and_keeps_a_decode_running():
    s = make()
    a, b = seq(5), seq(3)
    s.add(a)
    s.add(b)
    batch, is_prefill = s.schedule()
    s.undo_failed_step(batch, is_prefill)
    assert list(s.waiting) == [a, b] and not s.running and a.block_table == [] == b.block_table
    batch, is_prefill = s.schedule()
    s.postprocess(batch, [9, 9])
    batch, is_prefill = s.schedule()
    assert not is_prefill
    s.undo_failed_step(batch, is_prefill)
    assert list(s.running) == [a, b] and not s.waiting
    check_invariants(s)
