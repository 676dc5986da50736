"""Grading tests for chapter 03's extend exercises (`pytest -m ch03_ex1 --impl=exercises`, `-m ch03_ex3`);
see test_grading.py.

Graded by contract only. ch03_ex1: torch's own attention on each sequence alone, and transformers' logits.
ch03_ex3: the order the contract gives, the least padding of any split into batches of the same sizes
(every split of a few requests tried), and transformers' greedy tokens and the seeded draws of each request
alone, in arrival order. The tests at the end show that plausible wrong answers fail.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from adapters import load, raises_value_error
from minivllm.baselines import static_batching
from minivllm.model_executor.model_loader import load_model
from minivllm.sampling_params import SamplingParams
from test_grading_ch03_regions import graded


@pytest.fixture(scope="module")
def ch03(impl_name):
    return load("ch03_batching", impl_name)


def _cu_seqlens(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lens).cumsum(0)


@pytest.mark.ch03
@pytest.mark.ch03_ex1
@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 12), min_size=1, max_size=5), kv_heads=st.sampled_from([1, 2]),
       groups=st.sampled_from([1, 3]), seed=st.integers(0, 2**16))
def test_ch03_ex1_varlen_attention_equals_each_sequence_alone(ch03, lens, kv_heads, groups, seed):
    g = torch.Generator().manual_seed(seed)
    n, heads, scale = sum(lens), kv_heads * groups, 0.3
    q = torch.randn(n, heads, 8, generator=g, dtype=torch.float64)
    k = torch.randn(n, kv_heads, 8, generator=g, dtype=torch.float64)
    v = torch.randn(n, kv_heads, 8, generator=g, dtype=torch.float64)
    cu = _cu_seqlens(lens)
    got = ch03.varlen_attention(q, k, v, cu, scale)
    assert got.shape == q.shape and got.dtype == q.dtype and torch.isfinite(got).all()
    for s in range(len(lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)))
        want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
        torch.testing.assert_close(got[a:b], want, atol=1e-12, rtol=0)


@pytest.mark.ch03
@pytest.mark.ch03_ex1
def test_ch03_ex1_packed_prefill_equals_transformers(ch03, tiny_model):
    folder, hf = tiny_model
    model = load_model(folder, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    lens = [3, 17, 1, 9]
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g) for n in lens]
    cu = _cu_seqlens(lens)
    scale = model.model.layers[0].self_attn.scale

    def attn(layer_idx, q, k, v):
        return ch03.varlen_attention(q, k, v, cu, scale)

    positions = torch.cat([torch.arange(n) for n in lens])  # each sequence starts at position 0
    with torch.no_grad():
        logits = model.compute_logits(model(torch.cat(prompts), positions, attn))
        for s, p in enumerate(prompts):
            want = hf(p[None]).logits[0]
            assert (logits[int(cu[s]):int(cu[s + 1])] - want).abs().max() < 1e-9, s


# --- ch03_ex3: sort before batching ------------------------------------------------------------------
# Graded by its contract, written here: the order (longest prompt first, ties by arrival), the padding
# (no split into batches of the same sizes pads less: every split of a few requests tried), and on the
# tiny model each request's own tokens in arrival order, with its padding within its own batch.
HYPOTHESIS = dict(deadline=None, derandomize=True, database=None)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _cut(order: list[int], sizes: list[int]) -> list[list[int]]:
    out, k = [], 0
    for size in sizes:
        out.append(order[k:k + size])
        k += size
    return out


def _contract_batches(lens: list[int], batch_size: int, rest_last=False, ties_earliest=False) -> list[list[int]]:
    """Longest first, ties by arrival; cut into batches of batch_size, the batch of the rest at the place of
    least padding, the latest of equals. (`rest_last`, `ties_earliest`: two wrong answers.)"""
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    full, rest = len(lens) // batch_size, len(lens) % batch_size
    if not rest or rest_last:
        return _cut(order, [batch_size] * full + [rest] * (rest > 0))
    splits = [_cut(order, [batch_size] * j + [rest] + [batch_size] * (full - j)) for j in range(full + 1)]
    least = min(_padding(lens, s) for s in splits)
    places = [j for j, s in enumerate(splits) if _padding(lens, s) == least]
    return splits[places[0] if ties_earliest else places[-1]]


def _padding(lens: list[int], batches) -> int:
    return sum(max(lens[i] for i in b) - lens[i] for b in batches for i in b)


def _least_padding(lens: list[int], batch_size: int) -> int:
    """The least padding of any split into batches of these sizes: every order of the requests, cut the same way."""
    from itertools import permutations

    return min(_padding(lens, [p[i:i + batch_size] for i in range(0, len(p), batch_size)])
               for p in permutations(range(len(lens))))


KNOWN_BATCHES = [  # (prompt lengths, batch_size, batches): what each case tells apart
    ([5, 5, 1], 2, [[0, 1], [2]]),  # the batch of the rest gets the shortest prompt (ascending pads 4 slots)
    ([2, 2, 3], 2, [[2], [0, 1]]),  # ... or the longest (the rest last pads 1 slot)
    ([1, 2, 10], 2, [[2], [1, 0]]),  # longest first (ascending pads as little, in another order; the rest last 8)
    ([3, 7, 3, 7, 3], 2, [[1, 3], [0, 2], [4]]),  # equal lengths in arrival order; of equal paddings the latest place
    ([4, 9, 2, 9, 6, 1, 6], 3, [[1, 3, 4], [6], [0, 2, 5]]),  # the rest in the middle
    ([8], 4, [[0]]), ([2, 2, 2], 1, [[0], [1], [2]]), ([6, 1, 6, 1], 2, [[0, 2], [1, 3]]),
]


def _check_batches_known(mod) -> None:
    for lens, batch_size, want in KNOWN_BATCHES:
        assert _contract_batches(lens, batch_size) == want, "grader: a known case disagrees with the contract"
        got = mod.length_sorted_batches(list(lens), batch_size)
        _expect(got == want, f"ch03_ex3: length_sorted_batches({lens}, batch_size={batch_size}): expected {want} "
                             f"(longest first, equal lengths in arrival order, the batch of the rest where it pads "
                             f"least, the latest of equal places), got {got!r}")


def _check_batches_random(mod) -> None:
    @settings(max_examples=150, **HYPOTHESIS)
    # fixed cases first (the draws depend on where the check is called from): equal lengths, the rest's place
    @example(lens=[3, 7, 3, 7, 3], batch_size=2)
    @example(lens=[2, 2, 3], batch_size=2)
    @example(lens=[5, 5, 1], batch_size=2)
    @given(lens=st.lists(st.integers(1, 9), min_size=1, max_size=40), batch_size=st.integers(1, 9))
    def run(lens, batch_size):
        got = mod.length_sorted_batches(list(lens), batch_size)
        want = _contract_batches(lens, batch_size)
        _expect(got == want, f"ch03_ex3: length_sorted_batches({lens}, batch_size={batch_size}): expected {want}, "
                             f"got {got!r}")
        arrival = [list(range(i, min(i + batch_size, len(lens)))) for i in range(0, len(lens), batch_size)]
        assert _padding(lens, want) <= _padding(lens, arrival), "grader: sorting padded more than arrival order"
    run()


def _check_least_padding(mod) -> None:
    @settings(max_examples=120, **HYPOTHESIS)
    @example(lens=[5, 5, 1], batch_size=2)  # fixed cases first: ascending, arrival order, the rest last pad more
    @example(lens=[1, 5, 1, 5], batch_size=2)
    @example(lens=[2, 2, 3], batch_size=2)
    @given(lens=st.lists(st.integers(1, 5), min_size=1, max_size=6), batch_size=st.integers(2, 4))
    def run(lens, batch_size):
        got = mod.length_sorted_batches(list(lens), batch_size)
        least = _least_padding(lens, batch_size)
        ok = sorted(i for b in got for i in b) == list(range(len(lens))) and sorted(map(len, got)) == \
            sorted([batch_size] * (len(lens) // batch_size) + [len(lens) % batch_size] * (len(lens) % batch_size > 0))
        _expect(ok and _padding(lens, got) == least,
                f"ch03_ex3: length_sorted_batches({lens}, batch_size={batch_size}) = {got!r}: expected every request "
                f"once, in batches of {batch_size} and the rest, padding {least} slots (the least of any such split)"
                + (f", got {_padding(lens, got)}" if ok else ""))
    run()


@pytest.mark.ch03
@pytest.mark.ch03_ex3
def test_ch03_ex3_batches_known_cases(ch03):
    _check_batches_known(ch03)


@pytest.mark.ch03
@pytest.mark.ch03_ex3
def test_ch03_ex3_batches_random_lengths(ch03):
    _check_batches_random(ch03)


@pytest.mark.ch03
@pytest.mark.ch03_ex3
def test_ch03_ex3_no_split_of_the_same_sizes_pads_less(ch03):
    _check_least_padding(ch03)



_INVALID = [([], 2, "no requests"), ([3, 0], 2, "a length 0"), ([3, 2.0], 2, "a float length"),
            ([3, True], 2, "a bool length"), ([3, 4], 0, "batch_size 0"), ([3, 4], True, "batch_size a bool"),
            ([3, 4], 1.5, "a float batch_size")]


@pytest.mark.ch03
@pytest.mark.ch03_ex3
@pytest.mark.parametrize("lens,batch_size,what", _INVALID, ids=[c[-1] for c in _INVALID])
def test_ch03_ex3_batches_invalid_input(ch03, lens, batch_size, what):
    raises_value_error(lambda: ch03.length_sorted_batches(lens, batch_size),
                        f"ch03_ex3: length_sorted_batches({lens!r}, batch_size={batch_size!r}) ({what})")


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    folder, hf = tiny_llama
    return load_model(folder, dtype=torch.float64), hf


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _check_generate(mod, tiny) -> None:
    """Eight prompts of mixed lengths in batches of 3; greedy with an EOS token the model produces, and
    seeded sampling: each request's own tokens (transformers', or drawn alone), in arrival order."""
    from minivllm.baselines.naive import naive_generate

    model, hf = tiny
    g = torch.Generator().manual_seed(5)
    lens = [3, 11, 1, 7, 11, 2, 9, 4]
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    full = [_hf_greedy(hf, p, 7) for p in prompts]
    eos = max(set(full[1][:5]) | set(full[5][:5]), key=lambda t: sum(t in out[:5] for out in full))
    params = [SamplingParams(temperature=0, max_tokens=7 if i % 3 else 5) for i in range(len(prompts))]
    want = []
    for out, sp in zip(full, params):
        out = out[:sp.max_tokens]
        want.append(out[:out.index(eos) + 1] if eos in out else out)
    assert any(len(w) < sp.max_tokens for w, sp in zip(want, params)), "grader: no request stops at EOS"
    batches = _contract_batches(lens, 3)
    res = mod.sorted_static_generate(model, prompts, params, 3, eos_token_id=eos, pad_token_id=0)
    _expect(res.batches == batches, f"ch03_ex3: sorted_static_generate on prompts of lengths {lens} in batches of 3 "
                                    f"ran the batches {res.batches!r}, expected {batches}")
    for i, (got, w) in enumerate(zip(res.outputs, want)):
        _expect(got == w, f"ch03_ex3: request {i} (prompt of {lens[i]} tokens, max_tokens={params[i].max_tokens}, "
                          f"eos {eos}): sorted_static_generate gave {got}, transformers' greedy tokens cut by the rule "
                          f"are {w} (outputs in arrival order)")
    pads = [max(lens[j] for j in b) - lens[i] for b in batches for i in b]
    pads = [pads[[i for b in batches for i in b].index(k)] for k in range(len(lens))]
    _expect(list(res.pad_lens) == pads, f"ch03_ex3: pad_lens {list(res.pad_lens)!r}, expected {pads} (in arrival order, "
                                        "each request's padding within its own batch)")
    steps = sum(max(len(want[i]) for i in b) for b in batches)
    _expect(res.num_steps == steps, f"ch03_ex3: num_steps {res.num_steps!r}, expected {steps} (each batch runs until "
                                    "its longest output is done)")
    seeded = [SamplingParams(temperature=0.8, max_tokens=3 + i, seed=10 + i) for i in range(5)]
    drawn = mod.sorted_static_generate(model, prompts[:5], seeded, 2).outputs
    alone = [naive_generate(model, p, sp) for p, sp in zip(prompts[:5], seeded)]
    _expect(drawn == alone, f"ch03_ex3: seeded requests (temperature 0.8, seeds 10-14) should draw what each draws "
                            f"alone, in arrival order: {alone}; got {drawn}")
    one = mod.sorted_static_generate(model, prompts[:4], SamplingParams(temperature=0, max_tokens=2), 4)
    _expect(one.outputs == [f[:2] for f in full[:4]] and one.batches == [[1, 3, 0, 2]],
            f"ch03_ex3: one SamplingParams for four requests in one batch: expected outputs "
            f"{[f[:2] for f in full[:4]]} and batches [[1, 3, 0, 2]], got {one.outputs} and {one.batches}")
    raises_value_error(lambda: mod.sorted_static_generate(model, prompts[:3], params[:2], 2),
                        "ch03_ex3: sorted_static_generate with 2 sampling params for 3 prompts")


@pytest.mark.ch03
@pytest.mark.ch03_ex3
def test_ch03_ex3_outputs_in_arrival_order_equal_transformers(ch03, tiny):
    _check_generate(ch03, tiny)


# --- ch03_ex3: plausible wrong answers fail (not graded: they check the graders) --------------------
def _wrong_batches(ascending=False, unsorted=False, ties_reversed=False, rest_last=False, ties_earliest=False):
    def length_sorted_batches(prompt_lens, batch_size):
        n = len(prompt_lens)
        if ascending or unsorted or ties_reversed:
            key = (lambda i: i) if unsorted else (lambda i: (prompt_lens[i], i))
            order = sorted(range(n), key=key, reverse=ties_reversed)
            return [order[i:i + batch_size] for i in range(0, n, batch_size)]
        return _contract_batches(prompt_lens, batch_size, rest_last=rest_last, ties_earliest=ties_earliest)
    return length_sorted_batches


def _wrong_generate(sorted_order=False, global_padding=False):
    def sorted_static_generate(model, prompts, sampling_params, batch_size, eos_token_id=None, pad_token_id=0):
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else sampling_params
        if len(params) != len(prompts):
            raise ValueError("wrong length")
        lens = [len(p) for p in prompts]
        batches = _contract_batches(lens, batch_size)
        outputs, pads, steps = [None] * len(prompts), [0] * len(prompts), 0
        for b in batches:
            r = static_batching.static_generate(model, [prompts[i] for i in b], [params[i] for i in b], eos_token_id,
                                                pad_token_id)
            for row, i in enumerate(b):
                outputs[i], pads[i] = r.outputs[row], (max(lens) - lens[i] if global_padding else r.pad_lens[row])
            steps += r.num_steps
        if sorted_order:
            outputs = [outputs[i] for b in batches for i in b]
        return SimpleNamespace(outputs=outputs, pad_lens=pads, batches=batches, num_steps=steps)
    return sorted_static_generate


_BATCH_CHECKS = [_check_batches_known, _check_batches_random, _check_least_padding]
WRONG_BATCHES = {"ascending": _wrong_batches(ascending=True), "arrival-order": _wrong_batches(unsorted=True),
                 "ties-reversed": _wrong_batches(ties_reversed=True), "the-rest-always-last": _wrong_batches(rest_last=True),
                 "the-earliest-of-equal-places": _wrong_batches(ties_earliest=True)}
PADS_LEAST = {"ties-reversed", "the-earliest-of-equal-places"}  # the order, not the padding, tells them apart
WRONG_GENERATE = {"outputs-in-sorted-order": _wrong_generate(sorted_order=True),
                  "padding-to-the-longest-of-all": _wrong_generate(global_padding=True)}


@pytest.mark.parametrize("name", list(WRONG_BATCHES))
def test_ch03_ex3_wrong_batches_fail(name):
    """Each wrong order fails the fixed cases and the random lengths; the padding check catches those
    that pad more (`PADS_LEAST`: those pad as little, and only the order tells them apart)."""
    wrong = SimpleNamespace(length_sorted_batches=WRONG_BATCHES[name])
    for check in _BATCH_CHECKS[:2] + (_BATCH_CHECKS[2:] if name not in PADS_LEAST else []):
        with pytest.raises(AssertionError, match="ch03_ex3: "):
            check(wrong)


@pytest.mark.parametrize("name", list(WRONG_GENERATE))
def test_ch03_ex3_wrong_generate_fails(name, tiny):
    """(The grader's own static batching runs each batch: in a student edition the chapter's is a stub.)"""
    with graded(None), pytest.raises(AssertionError, match="ch03_ex3: "):
        _check_generate(SimpleNamespace(sorted_static_generate=WRONG_GENERATE[name]), tiny)


def test_ch03_ex3_graders_own_answers_pass(tiny):
    for check in _BATCH_CHECKS:
        check(SimpleNamespace(length_sorted_batches=_contract_batches))
    with graded(None):
        _check_generate(SimpleNamespace(sorted_static_generate=_wrong_generate()), tiny)
