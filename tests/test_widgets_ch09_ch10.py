"""The explorers of chapters 09 and 10: each callback recomputes `state` for the controls' new values,
and that state equals a computation done here from the definitions (the roofline's formulas written
out from a config; top-k, top-p, min-p and the penalties in plain Python), not by the chapter's code."""
from __future__ import annotations

import math
import os
from collections import Counter

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

from minivllm.benchmarks.roofline import DevicePeaks  # noqa: E402
from minivllm.course.testing import tiny_config  # noqa: E402
from minivllm.course.widgets.roofline import decode_point, roofline_explorer  # noqa: E402
from minivllm.course.widgets.sampling import filter_distribution, sampling_explorer  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


# --- chapter 09: the roofline explorer ----------------------------------------------------------

def decode_bound(config, itemsize: int, peaks: DevicePeaks, batch: int, context: int) -> dict:
    """A decode step's roofline from a Llama or Qwen3 config, written out: every linear weight times 2
    FLOPs per token, the LM head once per sequence, q·k and p·v for each of the `context` keys; bytes: all
    weights but the embedding (a tied head counts as the head), the K/V read and the new K/V written."""
    h, n_layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // heads
    linear = h * heads * d * 2 + h * kv_heads * d * 2 + 3 * h * config.intermediate_size  # q, o, k, v, mlp
    norms = 2 * h + (2 * d if config.model_type == "qwen3" else 0)  # qwen3: q_norm and k_norm
    weights = n_layers * (linear + norms) + h + h * vocab  # layers, final norm, LM head
    flops = batch * (2 * n_layers * linear + 2 * h * vocab + 4 * n_layers * heads * d * context)
    num_bytes = itemsize * weights + batch * (context + 1) * 2 * n_layers * kv_heads * d * itemsize
    t_compute, t_memory = flops / peaks.matmul_flops_per_s, num_bytes / peaks.copy_bytes_per_s
    return dict(flops=flops, bytes=num_bytes, seconds=max(t_compute, t_memory), memory_bound=t_memory >= t_compute,
                tok_s=batch / max(t_compute, t_memory), intensity=flops / num_bytes)


CONFIGS = {"tiny llama": tiny_config("llama"),
           "tiny qwen3": tiny_config("qwen3", num_hidden_layers=3, num_key_value_heads=1, tie_word_embeddings=True)}
DEVICES = {"slow matmul, float32": DevicePeaks(4e9, 1e9, dict(dtype="float32")),  # ridge 4 FLOP/byte
           "fast matmul, bfloat16": DevicePeaks(5e14, 2e12, dict(dtype="bfloat16"))}  # ridge 250 FLOP/byte
ITEMSIZE = {"float32": 4, "bfloat16": 2}


def check_roofline_state(box) -> None:
    c = {name: control.value for name, control in box.controls.items()}
    dtype = DEVICES[c["device"]].detail["dtype"]
    want = decode_bound(CONFIGS[c["model"]], ITEMSIZE[dtype], DEVICES[c["device"]], c["batch_size"], c["context_len"])
    s = box.state
    assert (s["model"], s["device"], s["dtype"], s["batch_size"], s["context_len"]) == (
        c["model"], c["device"], dtype, c["batch_size"], c["context_len"])
    assert (s["flops"], s["bytes"], s["memory_bound"]) == (want["flops"], want["bytes"], want["memory_bound"])
    for key in ("seconds", "tok_s", "intensity"):
        assert s[key] == pytest.approx(want[key], rel=1e-12), key
    assert s["ridge"] == pytest.approx(DEVICES[c["device"]].matmul_flops_per_s / DEVICES[c["device"]].copy_bytes_per_s)
    assert s["flops_per_s"] == pytest.approx(min(DEVICES[c["device"]].matmul_flops_per_s,
                                                 DEVICES[c["device"]].copy_bytes_per_s * want["intensity"]), rel=1e-12)


def test_roofline_explorer_recomputes_its_state_on_every_change():
    box = roofline_explorer(CONFIGS, DEVICES, batch_size=8, context_len=100, max_batch_size=512, max_context_len=4096)
    assert set(box.controls) == {"model", "device", "batch_size", "context_len"}
    check_roofline_state(box)
    sides = set()
    for name, value in [("batch_size", 1), ("context_len", 1),  # the smallest step there is
                        ("batch_size", 512),  # many sequences of one token: past the slow device's ridge
                        ("model", "tiny qwen3"), ("context_len", 4096), ("device", "fast matmul, bfloat16"),
                        ("batch_size", 1), ("model", "tiny llama"), ("context_len", 37)]:
        box.controls[name].value = value
        assert box.controls[name].value == value
        check_roofline_state(box)
        sides.add(box.state["memory_bound"])
    assert sides == {True, False}  # the cases cross the ridge both ways


def test_decode_point_refuses_an_empty_step():
    from minivllm.benchmarks.roofline import model_cost

    cost = model_cost(CONFIGS["tiny llama"], torch.float32)
    for batch, context in ((0, 10), (4, 0)):
        with pytest.raises(ValueError, match="at least 1"):
            decode_point(cost, DEVICES["slow matmul, float32"], batch, context)


# --- chapter 10: the sampling explorer ----------------------------------------------------------

VOCAB = 64
SEEN = [3, 3, 7]  # token 3 generated twice, token 7 once


def example_logits() -> torch.Tensor:
    logits = torch.randn(VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 1.5
    logits[3] = logits.max() + 0.5  # the raw argmax, which the penalties can push down
    return logits


def expected_filter(logits: torch.Tensor, c: dict) -> tuple[list[int], dict[int, float]]:
    """The kept tokens (likeliest first) and their probabilities, from the definitions, in plain Python:
    penalties on SEEN, then greedy (temperature < 1e-5) or temperature, min-p, top-k, top-p."""
    x = [float(v) for v in logits]
    for t, n in Counter(SEEN).items():
        x[t] = x[t] / c["repetition_penalty"] if x[t] > 0 else x[t] * c["repetition_penalty"]
        x[t] -= c["frequency_penalty"] * n + c["presence_penalty"]
    if c["temperature"] < 1e-5:
        best = max(range(VOCAB), key=lambda i: (x[i], -i))
        return [best], {best: 1.0}
    z = [v / c["temperature"] for v in x]
    top = max(z)
    weights = [math.exp(v - top) for v in z]
    total = sum(weights)
    probs = [w / total for w in weights]
    alive = [i for i in range(VOCAB) if probs[i] >= c["min_p"] * max(probs)]  # min-p
    ranked = sorted(alive, key=lambda i: (-z[i], i))  # likeliest first, ties by id
    if c["top_k"] > 0:
        ranked = ranked[:c["top_k"]]  # top-k
    mass = sum(weights[i] for i in ranked)
    kept, before = [], 0.0
    for i in ranked:  # top-p: kept while the tokens before it hold less than top_p
        if c["top_p"] < 1 and before >= c["top_p"]:
            break
        kept.append(i)
        before += weights[i] / mass
    mass = sum(weights[i] for i in kept)
    return kept, {i: weights[i] / mass for i in kept}


def check_sampling_state(box, logits: torch.Tensor) -> None:
    c = {name: control.value for name, control in box.controls.items()}
    kept, probs = expected_filter(logits, c)
    s = box.state
    assert s["kept"] == kept and s["num_kept"] == len(kept), c
    want = torch.zeros(VOCAB, dtype=torch.float64)
    for i, p in probs.items():
        want[i] = p
    torch.testing.assert_close(s["after"], want, rtol=0, atol=1e-12)
    torch.testing.assert_close(s["before"], logits.softmax(-1), rtol=0, atol=1e-15)
    assert s["params"].greedy == (c["temperature"] < 1e-5)
    filters = ("top_k", "top_p", "min_p")  # a greedy SamplingParams turns them off (chapter 01's rule)
    assert all(getattr(s["params"], name) == value for name, value in c.items()
               if not (s["params"].greedy and name in filters))


def test_sampling_explorer_recomputes_its_state_on_every_change():
    logits = example_logits()
    box = sampling_explorer(logits, output_token_ids=SEEN)
    assert set(box.controls) == {"temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                 "frequency_penalty", "presence_penalty"}
    check_sampling_state(box, logits)
    assert box.state["num_kept"] == VOCAB  # every filter off: nothing removed
    sizes = set()
    for name, value in [("top_k", 1),  # greedy by top-k
                        ("top_k", 10), ("top_p", 0.5), ("temperature", 2.0), ("min_p", 0.2),
                        ("temperature", 0.05),  # very cold: min-p leaves the likeliest only
                        ("temperature", 1.0), ("min_p", 0.0), ("top_k", 0), ("top_p", 0.01),  # a tiny nucleus
                        ("top_p", 0.9), ("frequency_penalty", 2.0), ("presence_penalty", -1.0),
                        ("repetition_penalty", 3.0), ("min_p", 0.05),
                        ("temperature", 0.0),  # greedy, after the penalties
                        ("temperature", 1.0), ("min_p", 1.0)]:  # min_p 1: the likeliest only
        box.controls[name].value = value
        check_sampling_state(box, logits)
        sizes.add(box.state["num_kept"])
    assert 1 in sizes and len(sizes) > 3


def test_greedy_sees_the_penalties_and_top_k_one_is_greedy():
    logits = example_logits()
    raw_argmax = int(logits.argmax())
    greedy = filter_distribution(logits, SamplingParams(temperature=0.0), SEEN)
    assert greedy["kept"] == [raw_argmax] == [3]
    penalized = filter_distribution(logits, SamplingParams(temperature=0.0, frequency_penalty=2.0), SEEN)
    assert penalized["kept"] != [3] and penalized["after"].sum() == 1.0
    top1 = filter_distribution(logits, SamplingParams(top_k=1, frequency_penalty=2.0), SEEN)
    assert top1["kept"] == penalized["kept"]
