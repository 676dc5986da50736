"""The explorers of chapters 06, 07 and 08: each callback recomputes `state` for the controls' new
values, and that state equals a computation done here from the definitions (not by the chapter's code)."""
from __future__ import annotations

import os
import random

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

from minivllm.course.widgets.prefix_cache import prefix_cache_state, words_to_ids  # noqa: E402


# --- chapter 06: the prefix-cache explorer ------------------------------------------------------

def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_hits(prompts: list[list[int]], block_size: int) -> list[int]:
    """Blocks each prompt finds when every earlier prompt finished and nothing was evicted: the longest
    common prefix with an earlier prompt in whole blocks, never the block holding the last token."""
    return [min(max((common_prefix(p, q) for q in prompts[:k]), default=0) // block_size,
                (len(p) - 1) // block_size) for k, p in enumerate(prompts)]


def full_block_prefixes(prompts: list[list[int]], block_size: int) -> set[tuple[int, ...]]:
    return {tuple(p[:end]) for p in prompts for end in range(block_size, len(p) + 1, block_size)}


def check_prefix_state(state: dict, prompts: list[list[int]], block_size: int, num_blocks: int) -> None:
    """`state` of prompts that each finished before the next, in a pool that never had to evict."""
    rows = state["prompts"]
    assert [r["hit_blocks"] for r in rows] == expected_hits(prompts, block_size)
    assert [r["num_cached_tokens"] for r in rows] == [h * block_size for h in expected_hits(prompts, block_size)]
    for p, r in zip(prompts, rows):
        assert [t for block in r["blocks"] for t in block] == p
        assert all(len(block) == block_size for block in r["blocks"][:-1]) and 0 < len(r["blocks"][-1]) <= block_size
        assert r["admitted"] and len(r["block_table"]) == len(r["blocks"])
    # equal names exactly for equal full-block prefixes
    names = {}
    for p, r in zip(prompts, rows):
        for j, h in enumerate(r["hashes"]):
            if len(r["blocks"][j]) == block_size:
                names.setdefault(tuple(p[:(j + 1) * block_size]), set()).add(h)
            else:
                assert h == -1
    assert all(len(hs) == 1 for hs in names.values())
    assert len({next(iter(hs)) for hs in names.values()}) == len(names)
    # the pool: nothing runs; every distinct full-block prefix is cached once; the rest is empty
    assert state["in_use"] == []
    assert len(state["free_cached"]) == len(full_block_prefixes(prompts, block_size))
    assert sorted(state["free_cached"] + state["free_empty"]) == list(range(num_blocks))


@pytest.mark.parametrize("seed", range(6))
def test_prefix_state_hits_the_longest_common_full_block_prefix(seed):
    rng = random.Random(seed)
    block_size = rng.randint(1, 5)
    stem = [rng.randrange(4) for _ in range(rng.randint(0, 12))]
    prompts = [stem[:rng.randint(0, len(stem))] + [rng.randrange(4) for _ in range(rng.randint(1, 9))]
               for _ in range(rng.randint(2, 6))]
    num_blocks = sum(-(-len(p) // block_size) for p in prompts)  # room for every block: no eviction
    check_prefix_state(prefix_cache_state(prompts, block_size, num_blocks), prompts, block_size, num_blocks)


def test_prefix_state_edges():
    # a whole number of blocks sent twice: all but the block holding the last token hit
    state = prefix_cache_state([[1, 2, 3, 4, 5, 6, 7, 8]] * 2, block_size=4, num_blocks=8)
    assert [r["hit_blocks"] for r in state["prompts"]] == [0, 1]
    assert state["prompts"][1]["cached"] == [True, False]  # its last block's name is taken: not cached again
    # blocks larger than any prompt: nothing is full, nothing is named, nothing hits
    state = prefix_cache_state([[1, 2, 3], [1, 2, 3, 4]], block_size=8, num_blocks=4)
    assert [r["hit_blocks"] for r in state["prompts"]] == [0, 0] and state["free_cached"] == []
    # prompts kept running in a small pool: the third does not fit (can_allocate counts all its blocks)
    state = prefix_cache_state([[1, 2], [1, 2, 3], [1, 2, 3, 4]], block_size=1, num_blocks=6, keep_running=True)
    assert [r["admitted"] for r in state["prompts"]] == [True, True, False]
    assert state["in_use"] == sorted({b for r in state["prompts"] for b in r["block_table"]}) == [0, 1, 2]
    assert [r["hit_blocks"] for r in state["prompts"][:2]] == [0, 2]
    # a pool that must evict: the second of two unrelated prompts takes the first's blocks
    state = prefix_cache_state([[1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 9]], block_size=2, num_blocks=2)
    assert [r["hit_blocks"] for r in state["prompts"]] == [0, 0, 0]


def test_words_to_ids_gives_equal_words_equal_ids():
    ids, words = words_to_ids(["a b c", "", "  ", "a c d"])
    assert words == [["a", "b", "c"], ["a", "c", "d"]] and ids == [[0, 1, 2], [0, 2, 3]]


def test_prefix_cache_explorer_recomputes_on_every_control():
    pytest.importorskip("ipywidgets")
    from minivllm.course.widgets.prefix_cache import PRESETS, prefix_cache_explorer

    box = prefix_cache_explorer(num_blocks=48)
    assert set(box.controls) >= {"prompts", "block_size", "num_blocks", "keep_running", "preset"}
    for text, block_size in (("x y z w x\nx y z w q\nx y", 2), ("a b c d\na b c d\na b c d e", 1),
                             ("one two three\none two three four", 4)):
        box.controls["prompts"].value = text
        box.controls["block_size"].value = block_size
        prompts, _ = words_to_ids(text.splitlines())
        check_prefix_state(box.state, prompts, block_size, 48)
    box.controls["block_size"].value = 1
    box.controls["preset"].value = "one prompt twice"
    assert box.controls["prompts"].value == PRESETS["one prompt twice"]
    prompts, words = words_to_ids(PRESETS["one prompt twice"].splitlines())
    check_prefix_state(box.state, prompts, 1, 48)
    assert box.state["words"] == words
    box.controls["keep_running"].value = True
    box.controls["num_blocks"].value = 9  # 8 blocks for the first prompt, 1 free: the second is refused
    assert [r["admitted"] for r in box.state["prompts"]] == [True, False]
    assert box.state["in_use"] == list(range(8)) and box.state["num_blocks"] == 9
    box.controls["prompts"].value = ""  # no prompt: an empty state, no error
    assert box.state["prompts"] == [] and len(box.state["free_empty"]) == 9


# --- chapter 08: the capture-size explorer ------------------------------------------------------

def rule_sizes(max_num_seqs: int, max_capture_size: int) -> list[int]:
    """The capture sizes as the chapter states the rule: 1, 2, 4, 8, the multiples of 16, then the top."""
    top = min(max_num_seqs, max_capture_size)
    return sorted({s for s in (1, 2, 4, 8) if s < top} | set(range(16, top, 16)) | {top})


def check_capture_state(state: dict, max_num_seqs: int, max_capture_size: int, batch_size: int) -> None:
    sizes = rule_sizes(max_num_seqs, max_capture_size)
    assert state["capture_sizes"] == sizes
    smallest_holding = [min((s for s in sizes if s >= n), default=None) for n in range(1, max_num_seqs + 1)]
    assert state["batch_sizes"] == list(range(1, max_num_seqs + 1))
    assert state["padded_sizes"] == smallest_holding
    assert state["padded"] == smallest_holding[batch_size - 1]
    assert state["padded_rows"] == (0 if state["padded"] is None else state["padded"] - batch_size)
    waste = [0.0 if p is None else 1 - n / p for n, p in zip(range(1, max_num_seqs + 1), smallest_holding)]
    assert state["waste"] == pytest.approx(waste)
    assert state["mean_waste"] == pytest.approx(sum(waste) / max_num_seqs)
    assert state["max_waste"] == pytest.approx(max(waste))


@pytest.mark.parametrize("max_num_seqs, max_capture_size, batch_size", [
    (256, 512, 100), (20, 512, 20), (1, 512, 1), (600, 300, 450), (600, 300, 300), (17, 512, 9), (1024, 1, 2)])
def test_capture_state_is_the_smallest_size_that_holds_the_batch(max_num_seqs, max_capture_size, batch_size):
    from minivllm.course.widgets.cuda_graph import capture_size_state

    check_capture_state(capture_size_state(max_num_seqs, batch_size, max_capture_size),
                        max_num_seqs, max_capture_size, batch_size)


def test_capture_state_refuses_a_batch_above_max_num_seqs():
    from minivllm.course.widgets.cuda_graph import capture_size_state

    with pytest.raises(ValueError, match="batch_size"):
        capture_size_state(8, 9)
    with pytest.raises(ValueError, match="batch_size"):
        capture_size_state(8, 0)


def test_capture_size_explorer_recomputes_on_every_control():
    pytest.importorskip("ipywidgets")
    from minivllm.course.widgets.cuda_graph import capture_size_explorer

    box = capture_size_explorer()
    assert set(box.controls) == {"max_num_seqs", "max_capture_size", "batch_size"}
    check_capture_state(box.state, 256, 512, 100)
    c = box.controls
    for name, value in (("batch_size", 17), ("batch_size", 256), ("max_capture_size", 200), ("batch_size", 201),
                        ("max_num_seqs", 40), ("max_capture_size", 1), ("max_num_seqs", 1)):
        c[name].value = value
        check_capture_state(box.state, c["max_num_seqs"].value, c["max_capture_size"].value, c["batch_size"].value)
    # shrinking max_num_seqs clamped the batch: never a batch the scheduler could not form
    assert c["batch_size"].value == 1 and box.state["batch_size"] == 1 and box.state["padded"] == 1
    c["max_num_seqs"].value = 1024  # the batch slider reaches the new limit
    c["batch_size"].value = 1024
    assert box.state["batch_size"] == 1024 and box.state["padded"] is None  # max capture size 1: eager


# --- chapter 07: the split-K explorer -----------------------------------------------------------

def expected_num_splits(context_len, block_size, num_splits, block_n, num_seqs=1, num_kv_heads=8, num_sms=132):
    """The count the wrapper launches, from its docstrings: `choose_num_splits`'s rule when none is
    given (4 programs per SM, splits of 256 keys or more, at most 32), never more splits than tiles."""
    max_len = -(-context_len // block_size) * block_size
    if num_splits is None:
        num_splits = max(1, min(-(-4 * num_sms // (num_seqs * num_kv_heads)), -(-max_len // 256), 32))
    return min(num_splits, -(-max_len // block_n))


def check_split_state(state, context_len, block_size, num_splits, block_n, **batch):
    count = expected_num_splits(context_len, block_size, num_splits, block_n, **batch)
    assert state["num_splits"] == count == len(state["splits"])
    shortest = 256 if num_splits is None else block_n
    # the shortest whole number of tiles, no shorter than the minimum, with which `count` splits hold the keys
    split_len = next(n for n in range(block_n, 10 ** 6, block_n) if n >= shortest and count * n >= context_len)
    assert state["split_len"] == split_len
    owner = {}
    for p, (s, e) in enumerate(state["splits"]):
        assert s == p * split_len and e - s <= split_len
        for t in range(s, e):
            assert t not in owner
            owner[t] = p
        assert state["tiles"][p] == [t for t in range(s, e) if (t - s) % block_n == 0]
        assert state["blocks"][p] == sorted({t // block_size for t in range(s, e)})
    assert sorted(owner) == list(range(context_len))  # every key in exactly one split
    assert state["merged"] == [p for p, (s, e) in enumerate(state["splits"]) if e > s]
    assert state["reduction"] == (count > 1)
    assert all(e - s == split_len for s, e in state["splits"][:len(state["merged"]) - 1])


@pytest.mark.parametrize("context_len, block_size, num_splits, block_n", [
    (1000, 16, 4, 64), (37, 4, 3, 8), (130, 4, 8, 16), (1, 16, 4, 64), (1, 1, 1, 16), (100, 256, 32, 16),
    (257, 3, 5, 32), (8192, 16, None, 64), (300, 16, None, 64), (1, 16, None, 64), (4096, 1, 32, 16)])
def test_split_k_state_covers_the_context_once(context_len, block_size, num_splits, block_n):
    from minivllm.course.widgets.split_k import split_k_state

    check_split_state(split_k_state(context_len, block_size, num_splits, block_n),
                      context_len, block_size, num_splits, block_n)


def test_split_k_state_edges():
    from minivllm.course.widgets.split_k import split_k_state

    state = split_k_state(130, 4, num_splits=8, block_n=16)  # 5 splits hold keys, 3 are empty and weigh 0
    assert state["merged"] == [0, 1, 2, 3, 4] and state["splits"][5:] == [(160, 160), (192, 192), (224, 224)]
    assert split_k_state(10, 16, num_splits=32, block_n=16)["num_splits"] == 1  # one tile: one split
    state = split_k_state(5000, 16, None, 64, num_seqs=128, num_kv_heads=8)  # 1,024 programs already: no split
    assert state["num_splits"] == 1 and not state["reduction"]
    for bad in (dict(num_splits=0), dict(num_splits=33), dict(block_size=0), dict(context_len=0)):
        with pytest.raises(ValueError):
            split_k_state(**{"context_len": 100, "block_size": 16, **bad})


def test_split_k_explorer_recomputes_on_every_control():
    pytest.importorskip("ipywidgets")
    from minivllm.course.widgets.split_k import split_k_explorer

    box = split_k_explorer()
    c = box.controls
    assert set(c) == {"context_len", "block_size", "block_n", "num_splits", "auto", "num_seqs", "num_kv_heads"}
    check_split_state(box.state, 1000, 16, 4, 64)
    for name, value in (("context_len", 130), ("block_n", 16), ("num_splits", 8), ("block_size", 256),
                        ("context_len", 1), ("num_splits", 32), ("context_len", 8192), ("block_n", 256)):
        c[name].value = value
        check_split_state(box.state, c["context_len"].value, c["block_size"].value, c["num_splits"].value,
                          c["block_n"].value)
    c["auto"].value = True
    assert c["num_splits"].disabled and not c["num_seqs"].disabled
    for name, value in (("num_seqs", 4), ("num_kv_heads", 2), ("context_len", 3000), ("num_seqs", 200)):
        c[name].value = value
        check_split_state(box.state, c["context_len"].value, c["block_size"].value, None, c["block_n"].value,
                          num_seqs=c["num_seqs"].value, num_kv_heads=c["num_kv_heads"].value)
