"""The explorers of chapters 02 and 05: each callback recomputes `state` for the controls' new values,
and that state equals a computation done here independently of the chapter's code (transformers'
attention weights for chapter 02; a free queue and block tables kept by hand for chapter 05)."""
from __future__ import annotations

import os
import random
from collections import deque

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")

from minivllm.course.widgets.block_table import block_table_run  # noqa: E402


# --- chapter 02: the attention explorer ---------------------------------------------------------

class WordTokenizer:
    """A toy tokenizer for the tiny models: each word a token, its id a stable function of the word."""

    def encode(self, text: str) -> list[int]:
        return [sum(map(ord, w)) % 128 for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return "".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_pair(request, tmp_path_factory):
    """Our decoder and transformers' eager one (which returns its attention weights), same tiny weights."""
    from minivllm.course.testing import make_tiny_model
    from minivllm.model_executor.model_loader import load_model

    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(folder, request.param, num_attention_heads=4, num_key_value_heads=2)
    hf.set_attn_implementation("eager")
    return load_model(folder, dtype=torch.float64), hf


def hf_weights(hf, token_ids: list[int]) -> torch.Tensor:
    """transformers' attention weights, `[num_layers, num_heads, N, N]` (its eager softmax runs in float32,
    so they agree with float64 ones to about 1e-7)."""
    with torch.no_grad():
        out = hf(torch.tensor([token_ids]), output_attentions=True)
    return torch.stack([a[0] for a in out.attentions])


def test_attention_maps_are_transformers_attention_weights(tiny_pair):
    from minivllm.course.widgets.attention import attention_maps

    ours, hf = tiny_pair
    ids = torch.randint(0, 128, (17,), generator=torch.Generator().manual_seed(0)).tolist()
    maps = attention_maps(ours, ids)
    assert (maps["num_heads"], maps["num_kv_heads"]) == (4, 2)
    ref = hf_weights(hf, ids)
    assert maps["weights"].shape == ref.shape == (2, 4, 17, 17)
    torch.testing.assert_close(maps["weights"], ref, rtol=0, atol=1e-6)


def test_attention_explorer_follows_its_controls_and_runs_the_model_once_per_sentence(tiny_pair):
    pytest.importorskip("ipywidgets")
    from minivllm.course.widgets.attention import attention_explorer

    ours, hf = tiny_pair
    calls = []
    forward = ours.forward
    ours.forward = lambda *args: calls.append(1) or forward(*args)
    try:
        tok = WordTokenizer()
        box = attention_explorer(ours, tok, text="one two three four five", max_tokens=4)
        c = box.controls
        assert set(c) == {"text", "layer", "head"} and (c["layer"].max, c["head"].max) == (1, 3)
        for text, layer, head in (("one two three four five", 1, 3), ("one two three four five", 0, 2),
                                  ("a b a b c d", 1, 1), ("a b a b c d", 1, 0)):
            c["text"].value, c["layer"].value, c["head"].value = text, layer, head
            ids = tok.encode(text)[:4]
            state = box.state
            assert state["tokens"] == [f"w{i}" for i in ids] and state["num_tokens"] == len(text.split())
            torch.testing.assert_close(torch.tensor(state["weights"], dtype=torch.float64),
                                       hf_weights(hf, ids)[layer, head], rtol=0, atol=1e-6)
            assert state["kv_head"] == head // 2  # 4 query heads over 2 K/V heads: pairs (0, 1), (2, 3)
            assert state["shared_with"] == [h for h in range(4) if h // 2 == head // 2]
            weights = torch.tensor(state["weights"])
            assert state["strongest"] == [state["tokens"][int(i)] for i in weights.argmax(-1)]
        assert len(calls) == 2, "the sliders must not run the model again; each new sentence runs it once"
        c["text"].value = ""
        assert box.state["tokens"] == [] and len(calls) == 2
    finally:
        del ours.forward


# --- chapter 05: the block-table explorer -------------------------------------------------------

def replay_by_hand(lengths, block_size, num_blocks, max_len, actions):
    """The explorer's rules, kept with a deque of free ids: allocation takes the front, a finished or
    preempted sequence returns its blocks to the back, its last block first (as the chapter's
    `deallocate` does). Returns (tokens, tables, statuses, free ids, preemptions)."""
    free, tokens = deque(range(num_blocks)), list(lengths)
    tables, status = [[] for _ in lengths], ["waiting"] * len(lengths)
    waiting, running, preemptions = list(range(len(lengths))), [], 0

    def blocks(n):
        return (n + block_size - 1) // block_size

    def release(i):
        free.extend(reversed(tables[i]))
        tables[i] = []

    def admit():
        while waiting and blocks(tokens[waiting[0]]) <= len(free):
            i = waiting.pop(0)
            tables[i] = [free.popleft() for _ in range(blocks(tokens[i]))]
            running.append(i)
            status[i] = "running"

    def finish(i):
        release(i)
        running.remove(i)
        status[i] = "finished"

    admit()
    for a in actions:
        if a == "f" and running:
            finish(running[0])
        elif a == "s":
            for i in list(running):
                if i not in running:
                    continue
                tokens[i] += 1
                new_block = blocks(tokens[i]) > len(tables[i])
                while new_block and not free:
                    j = running.pop()
                    release(j)
                    waiting.insert(0, j)
                    status[j] = "waiting"
                    preemptions += 1
                    if j == i:
                        break
                if i in running:
                    if new_block:
                        tables[i].append(free.popleft())
                    if tokens[i] >= max_len:
                        finish(i)
        admit()
    return tokens, tables, status, list(free), preemptions


def check_block_state(state, lengths, block_size, num_blocks, max_len, actions):
    tokens, tables, status, free, preemptions = replay_by_hand(lengths, block_size, num_blocks, max_len, actions)
    assert [s["tokens"] for s in state["seqs"]] == tokens
    assert [s["block_table"] for s in state["seqs"]] == tables
    assert [s["status"] for s in state["seqs"]] == status
    assert state["free"] == free and state["num_preemptions"] == preemptions
    assert state["steps"] == actions.count("s")
    owner = [None] * num_blocks
    for i, t in enumerate(tables):
        for b in t:
            assert owner[b] is None, "a block in two tables"
            owner[b] = i
    assert state["owner"] == owner and sorted(free + [b for t in tables for b in t]) == list(range(num_blocks))
    live = [i for i, s in enumerate(status) if s == "running"]
    used, paged = sum(tokens[i] for i in live), sum(len(tables[i]) for i in live) * block_size
    assert (state["used_slots"], state["paged_slots"], state["contiguous_slots"]) == (used, paged, len(live) * max_len)
    assert state["paged_waste"] == pytest.approx(1 - used / paged if paged else 0)
    assert state["contiguous_waste"] == pytest.approx(1 - used / (len(live) * max_len) if live else 0)
    assert all(len(tables[i]) * block_size - tokens[i] < block_size for i in live), "waste only in last blocks"
    assert state["fits_contiguous"] == num_blocks * block_size // max_len


def test_block_table_run_matches_the_chapter_example():
    state = block_table_run([6, 4, 9], block_size=4, num_blocks=8, max_len=24)
    assert [s["block_table"] for s in state["seqs"]] == [[0, 1], [2], [3, 4, 5]] and state["free"] == [6, 7]
    # the oldest finishes; a waiting one is admitted into the freed blocks, the youngest freed first
    assert block_table_run([6, 4, 9, 7], 4, 7, 24)["seqs"][3]["status"] == "waiting"  # 2 blocks wanted, 1 free
    state = block_table_run([6, 4, 9, 7], block_size=4, num_blocks=7, max_len=24, actions="f")
    assert state["seqs"][3]["block_table"] == [6, 1] and state["free"] == [0]  # not contiguous
    state = block_table_run([6, 4, 9, 7], block_size=4, num_blocks=7, max_len=24, actions="ff")
    assert state["free"] == [0, 2]
    check_block_state(state, [6, 4, 9, 7], 4, 7, 24, "ff")


@pytest.mark.parametrize("seed", range(12))
def test_block_table_run_keeps_tables_as_the_rules_say(seed):
    rng = random.Random(seed)
    block_size, max_len = rng.randint(1, 6), rng.randint(4, 40)
    lengths = [rng.randint(1, max_len) for _ in range(rng.randint(1, 6))]
    num_blocks = max(rng.randint(1, 30), -(-max(lengths) // block_size))
    actions = "".join(rng.choice("sssssf") for _ in range(rng.randint(0, 60)))
    check_block_state(block_table_run(lengths, block_size, num_blocks, max_len, actions),
                      lengths, block_size, num_blocks, max_len, actions)


def test_block_table_run_refuses_bad_input():
    for bad in (dict(lengths=[0]), dict(lengths=[25]), dict(block_size=0), dict(num_blocks=0), dict(actions="sx")):
        with pytest.raises(ValueError):
            block_table_run(**{"lengths": [3], "block_size": 4, "num_blocks": 4, "max_len": 24, **bad})


def test_block_table_explorer_replays_its_clicks_on_every_control():
    pytest.importorskip("ipywidgets")
    from minivllm.course.widgets.block_table import block_table_explorer

    box = block_table_explorer(lengths="6 4 9 3", block_size=4, num_blocks=12, max_len=24)
    c = box.controls
    assert set(c) == {"lengths", "block_size", "num_blocks", "max_len", "step", "finish", "reset"}
    check_block_state(box.state, [6, 4, 9, 3], 4, 12, 24, "")
    clicks = ""
    for name in ("step", "step", "finish", "step", "step", "step", "finish", "step"):
        c[name].click()
        clicks += name[0]
        assert box.state["actions"] == clicks
        check_block_state(box.state, [6, 4, 9, 3], 4, 12, 24, clicks)
    for name, value in (("block_size", 1), ("num_blocks", 5), ("max_len", 10), ("lengths", "1, 2 3 10 8")):
        c[name].value = value  # the same clicks, replayed with the new value
        lens = [int(w) for w in c["lengths"].value.replace(",", " ").split()]
        check_block_state(box.state, lens, c["block_size"].value, c["num_blocks"].value, c["max_len"].value, clicks)
    assert box.state["num_preemptions"] > 0  # 5 blocks of 1 slot for sequences of up to 10 tokens
    c["lengths"].value = "3 99"  # longer than max_len: a message, no state, no exception
    assert "error" in box.state and "99" in box.state["error"]
    c["lengths"].value = "5 5"
    c["reset"].click()
    assert box.state["actions"] == "" and box.state["steps"] == 0
    check_block_state(box.state, [5, 5], 1, 5, 10, "")
