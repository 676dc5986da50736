"""The padding explorer of chapter 03: its callbacks recompute `state` for the controls' new values,
and that state equals a count done here from the definitions of padding, prompt, output and idle slots
(not by the chapter's `slot_grid`)."""
from __future__ import annotations

import os
import random

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

from minivllm.course.widgets.padding import draw_padding, padding_state, parse_lengths  # noqa: E402

PADDING, PROMPT, OUTPUT, IDLE = 0, 1, 2, 3


def expected_row(prompt_len: int, output_len: int, width: int, steps: int) -> list[int]:
    """A request's slots in a batch whose longest prompt is `width` and longest output `steps`: left
    padding, its prompt, each generated token fed back but the last, then idle until the batch ends."""
    return ([PADDING] * (width - prompt_len) + [PROMPT] * prompt_len + [OUTPUT] * (output_len - 1)
            + [IDLE] * (steps - output_len))


def check_padding_state(state: dict, prompt_lens: list[int], output_lens: list[int], batch_size: int) -> None:
    chunks = [list(range(i, min(i + batch_size, len(prompt_lens)))) for i in range(0, len(prompt_lens), batch_size)]
    assert [b["requests"] for b in state["batches"]] == chunks
    counts = {"padding": 0, "prompt": 0, "output": 0, "idle": 0}
    for b, rows in zip(state["batches"], chunks):
        width, steps = max(prompt_lens[i] for i in rows), max(output_lens[i] for i in rows)
        assert b["steps"] == steps
        assert b["grid"] == [expected_row(prompt_lens[i], output_lens[i], width, steps) for i in rows]
        counts["padding"] += sum(width - prompt_lens[i] for i in rows)
        counts["prompt"] += sum(prompt_lens[i] for i in rows)
        counts["output"] += sum(output_lens[i] - 1 for i in rows)
        counts["idle"] += sum(steps - output_lens[i] for i in rows)
    assert state["counts"] == counts
    total = sum(counts.values())
    assert state["num_slots"] == total
    assert state["shares"] == pytest.approx({k: v / total for k, v in counts.items()})
    assert state["wasted"] == pytest.approx((counts["padding"] + counts["idle"]) / total)


@pytest.mark.parametrize("seed", range(8))
def test_padding_state_counts_every_slot(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    prompt_lens = [rng.randint(1, 40) for _ in range(n)]
    output_lens = [rng.randint(1, 30) for _ in range(n)]
    for batch_size in {1, rng.randint(1, n), n}:
        check_padding_state(padding_state(prompt_lens, output_lens, batch_size), prompt_lens, output_lens, batch_size)


def test_padding_state_edges_and_errors():
    state = padding_state([4, 4], [3, 3], 2)  # equal lengths: nothing wasted
    assert state["wasted"] == 0 and state["counts"] == {"padding": 0, "prompt": 8, "output": 4, "idle": 0}
    assert padding_state([1, 9], [1, 1], 1)["wasted"] == 0  # one at a time: nothing padded, nobody waits
    assert padding_state([1, 9], [1, 1], 2)["counts"]["padding"] == 8
    for args in (([1, 2], [1], 1), ([], [], 1), ([0], [1], 1), ([1], [0], 1), ([1, 2], [1, 2], 3), ([1], [1], 0)):
        with pytest.raises(ValueError):
            padding_state(*args)
    assert parse_lengths("12, 3 40", "x") == [12, 3, 40]
    for bad in ("", " , ", "3, a", "0", "-2", "2.5"):
        with pytest.raises(ValueError, match="lengths"):
            parse_lengths(bad, "prompt lengths")


def test_draw_padding_stacks_the_batches():
    state = padding_state([5, 1, 3], [2, 6, 1], 2)
    ax = draw_padding(state)
    image = ax.images[0].get_array()
    assert image.shape == (3, max(len(b["grid"][0]) for b in state["batches"]))
    assert image[2].tolist()[len(state["batches"][1]["grid"][0]):] == [4] * (image.shape[1] - 3)  # batch done
    import matplotlib.pyplot as plt
    plt.close(ax.figure)


def test_padding_explorer_recomputes_on_every_control():
    pytest.importorskip("ipywidgets")
    from minivllm.course.widgets.padding import padding_explorer

    box = padding_explorer([5, 12, 3, 9], [4, 1, 7, 2], batch_size=4)
    c = box.controls
    assert set(c) == {"prompt_lens", "output_lens", "batch_size"}
    check_padding_state(box.state, [5, 12, 3, 9], [4, 1, 7, 2], 4)
    c["batch_size"].value = 1
    check_padding_state(box.state, [5, 12, 3, 9], [4, 1, 7, 2], 1)
    assert box.state["wasted"] == 0
    c["batch_size"].value = 3
    check_padding_state(box.state, [5, 12, 3, 9], [4, 1, 7, 2], 3)
    c["prompt_lens"].value = "5, 12, 3"  # 3 prompts, 4 outputs: refused, the state stays
    assert "not changed" in box.children[3].value and box.state["prompt_lens"] == [5, 12, 3, 9]
    c["output_lens"].value = "1 1 20"  # now 3 and 3: the slider's range shrinks to the requests
    assert c["batch_size"].max == 3 and c["batch_size"].value == 3
    check_padding_state(box.state, [5, 12, 3], [1, 1, 20], 3)
    c["prompt_lens"].value = "5, x"
    assert "not changed" in box.children[3].value and box.state["prompt_lens"] == [5, 12, 3]
    c["prompt_lens"].value = "2 2 2 2 2 2"
    c["output_lens"].value = "1, 2, 3, 4, 5, 6"
    assert c["batch_size"].max == 6
    c["batch_size"].value = 6
    check_padding_state(box.state, [2] * 6, [1, 2, 3, 4, 5, 6], 6)
    assert box.state["counts"]["padding"] == 0 and box.state["counts"]["idle"] == 15
