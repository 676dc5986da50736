"""Chapter 04's scheduler explorer (`minivllm.course.widgets.scheduler`), driven through its controls
as a reader's clicks would: what it shows after each click is what a scheduler driven by hand holds."""
from __future__ import annotations

import pytest

from minivllm.core.block_manager import BlockManager
from minivllm.core.sched.scheduler import Scheduler
from minivllm.course.widgets.scheduler import render_snapshot, scheduler_explorer
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

pytest.importorskip("ipywidgets")


def _three(capacity: int) -> Scheduler:
    """Three prompts of 6 tokens that each want 8 more, blocks of 2 tokens, `capacity` blocks."""
    sched = Scheduler(BlockManager(capacity, 2), max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64)
    for i in range(3):
        sched.add(Sequence([1] * 6, SamplingParams(max_tokens=8, ignore_eos=True), block_size=2, seq_id=i))
    return sched


def test_each_click_shows_what_the_scheduler_holds():
    explorer = scheduler_explorer(_three, capacity=(9, 24, 12))
    twin = _three(12)
    assert explorer.state["step"] == 0 and explorer.state["waiting"] == [0, 1, 2] and explorer.state["running"] == []
    preempted = False
    for step in range(1, 40):
        explorer.controls["step"].click()
        if twin.is_finished():
            assert explorer.state["step"] == step - 1, "a click after the end must not step"
            break
        batch, is_prefill = twin.schedule()
        twin.postprocess(batch, [7] * len(batch))
        state = explorer.state
        assert state["step"] == step and state["batch"] == [s.seq_id for s in batch]
        assert state["kind"] == ("prefill" if is_prefill else "decode")
        assert state["waiting"] == [s.seq_id for s in twin.waiting] and state["running"] == [s.seq_id for s in twin.running]
        assert state["block_tables"] == {s.seq_id: s.block_table for s in [*twin.running, *twin.waiting, *batch]}
        assert state["free_blocks"] == twin.block_manager.num_free_blocks
        assert state["num_preemptions"] == twin.num_preemptions
        preempted |= twin.num_preemptions > 0
        html = render_snapshot(state)
        assert all(f">{i}: " in html for i in state["running"] + state["waiting"])
    assert explorer.state["finished"] and preempted, "12 blocks of 2 for three sequences of 14 tokens must preempt"


def test_the_slider_starts_again_with_that_many_blocks():
    explorer = scheduler_explorer(_three, capacity=(9, 24, 12))
    for _ in range(3):
        explorer.controls["step"].click()
    explorer.controls["capacity"].value = 21  # room for all three to the end: 3 x 7 blocks
    assert explorer.state["step"] == 0 and explorer.state["num_blocks"] == 21 and explorer.state["waiting"] == [0, 1, 2]
    while not explorer.state["finished"]:
        explorer.controls["step"].click()
    assert explorer.state["num_preemptions"] == 0 and explorer.state["free_blocks"] == 21
    explorer.controls["reset"].click()
    assert explorer.state["step"] == 0 and explorer.state["free_blocks"] == 21 and explorer.state["kind"] is None
