"""Chapter 10's sampler: each operation equals transformers' logits processors in float64 (1e-12: the
two compute the same formula; float64 leaves only rounding in the last bits), the fast top-k/top-p path
(the pivot draw: no sort) keeps exactly the tokens the sort-based filter keeps, seeded draws follow the filtered distribution (a chi-square test with fixed
seeds, so it cannot flake), a seeded request's tokens depend neither on its batch mates nor on
preemption, and the engine with this sampler still equals transformers."""
from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from engine_helpers import check_invariants, make_model, one_thread, random_prompts, run_engine
from minivllm.core.block_manager import BlockManager
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sample.generator import make_generator
from minivllm.attention.paged_attention import PagedAttention
from minivllm.core.prefix_caching import PrefixCachingBlockManager
from minivllm.sample.metadata import pad_token_ids, sampling_metadata
from minivllm.sample.ops import (apply_min_p, apply_penalties, apply_top_k_top_p, gather_logprobs, greedy_sample,
                                 mass_ranked_before, random_sample, sample_top_k_top_p, top_k_mask)
from minivllm.sample.sampler import Sampler, argmax_only
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)
TOL = 1e-12  # float64: the same formula on both sides, only last-bit rounding may differ
INF = float("-inf")


def rows_of_logits(seed: int, rows: int, vocab: int, scale: float = 4.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, dtype=torch.float64, generator=gen) * scale


def assert_same_filtered(ours: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(want))
    kept = ~torch.isinf(want)
    assert (ours[kept] - want[kept]).abs().max() <= TOL


# --- the operations against transformers ------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), vocab=st.integers(2, 40), data=st.data())
def test_penalties_equal_transformers_and_openai(seed, vocab, data):
    rows = 3
    prompts = [data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8)) for _ in range(rows)]
    outputs = [data.draw(st.lists(st.integers(0, vocab - 1), max_size=8)) for _ in range(rows)]
    rep = torch.tensor([data.draw(st.floats(0.1, 3.0)) for _ in range(rows)], dtype=torch.float64)
    freq = torch.tensor([data.draw(st.floats(-2, 2)) for _ in range(rows)], dtype=torch.float64)
    pres = torch.tensor([data.draw(st.floats(-2, 2)) for _ in range(rows)], dtype=torch.float64)
    logits = rows_of_logits(seed, rows, vocab)
    ours = apply_penalties(logits, pad_token_ids(prompts, vocab, "cpu"), pad_token_ids(outputs, vocab, "cpu"),
                           pres, freq, rep)
    for i in range(rows):
        want = RepetitionPenaltyLogitsProcessor(float(rep[i]))(torch.tensor([prompts[i] + outputs[i]]),
                                                                 logits[i:i + 1].clone())[0]
        for t in set(outputs[i]):
            want[t] -= freq[i] * outputs[i].count(t) + pres[i]
        assert (ours[i] - want).abs().max() <= TOL


def test_penalties_off_leave_a_row_bit_for_bit():
    logits = rows_of_logits(1, 2, 30)
    ids = pad_token_ids([[1, 2, 3], [4, 4]], 30, "cpu")
    one, zero = torch.ones(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    assert torch.equal(apply_penalties(logits, ids, ids, zero, zero, one), logits)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), vocab=st.integers(2, 60), temperature=st.floats(0.05, 3.0),
       min_p=st.floats(0.0, 0.5), top_k=st.integers(1, 70), top_p=st.floats(0.01, 1.0))
def test_filters_equal_transformers_warpers_in_vllms_order(seed, vocab, temperature, min_p, top_k, top_p):
    logits = rows_of_logits(seed, 1, vocab)
    ours = apply_top_k_top_p(apply_min_p(logits / temperature, torch.tensor([min_p], dtype=torch.float64)),
                             torch.tensor([min(top_k, vocab)]), torch.tensor([top_p], dtype=torch.float64))
    want = logits.clone()
    for warper in (TemperatureLogitsWarper(temperature), MinPLogitsWarper(min_p), TopKLogitsWarper(top_k)):
        want = warper(None, want)
    # Top-p keeps a token when the probability mass ranked below it exceeds 1 - top_p. Where that mass lies
    # within 1e-12 of the cut (hypothesis found top_p = 1 - 1e-16 with a token of probability ~1e-16), the
    # order of the float additions decides, and keeping or dropping it are both right: such draws are skipped.
    mass_below = want.softmax(dim=-1).sort(dim=-1).values.cumsum(dim=-1)
    assume(bool(((mass_below - (1 - top_p)).abs() > 1e-12).all()))
    want = TopPLogitsWarper(top_p)(None, want)
    assert_same_filtered(ours, want)


def test_min_tokens_mask_equals_transformers_min_new_tokens():
    vocab, eos = 20, {3, 7}
    logits = rows_of_logits(2, 1, vocab)
    seq = Sequence([1, 2, 5], SamplingParams(min_tokens=3, stop_token_ids=[9], temperature=0))
    seq.append_token(4)
    md = sampling_metadata([seq], {}, make_generator(0), frozenset(eos), vocab, torch.float64, "cpu")
    masked = logits.index_put((md.min_tokens_rows, md.min_tokens_ids), torch.tensor(INF, dtype=torch.float64))
    want = MinNewTokensLengthLogitsProcessor(3, 3, sorted(eos | {9}))(torch.tensor([[1, 2, 5, 4]]), logits.clone())
    assert torch.equal(masked, want)
    seq.token_ids += [4, 4]  # three completion tokens: no more mask
    assert sampling_metadata([seq], {}, make_generator(0), frozenset(eos), vocab, torch.float64,
                             "cpu").min_tokens_rows.numel() == 0


def test_min_tokens_masks_eos_whatever_ignore_eos_says():
    """vLLM masks the model's EOS ids until `min_tokens` also with `ignore_eos` (its
    `update_from_generation_config` adds them to the stop ids `min_tokens` uses, whatever `ignore_eos`)."""
    eos = frozenset({3, 7})
    for ignore_eos in (False, True):
        seq = Sequence([1, 2], SamplingParams(min_tokens=2, stop_token_ids=[9], ignore_eos=ignore_eos))
        md = sampling_metadata([seq], {}, make_generator(0), eos, 20, torch.float64, "cpu")
        assert md.min_tokens_rows.tolist() == [0, 0, 0] and md.min_tokens_ids.tolist() == [3, 7, 9]


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10_000), vocab=st.integers(2, 80), top_k=st.integers(1, 90), use_k=st.booleans(),
       top_p=st.floats(0.01, 1.0), ties=st.booleans())
def test_pivot_test_keeps_what_the_sort_keeps(seed, vocab, top_k, use_k, top_p, ties):
    """The pivot draw's rules against `apply_top_k_top_p` (one stable sort): the top-k mask keeps the
    same tokens, and a token with a probability passes the top-p test (mass ranked before it < top_p)
    exactly when the sort keeps it. `ties`: logits rounded to integers, so many tokens tie."""
    logits = rows_of_logits(seed, 1, vocab)
    if ties:
        logits = logits.round()
    k = torch.tensor([min(top_k, vocab) if use_k else vocab])
    p = torch.tensor([top_p], dtype=torch.float64)
    mask = top_k_mask(logits, k)[0]
    assert torch.equal(mask > 0, (apply_top_k_top_p(logits, k, None) > INF)[0])
    probs = logits.softmax(-1)[0] * mask
    probs = probs / probs.sum()
    before = mass_ranked_before(logits.expand(vocab, -1).contiguous(), probs.expand(vocab, -1).contiguous(),
                                torch.arange(vocab))
    kept = (apply_top_k_top_p(logits, k, p) > INF)[0]
    assert torch.equal(((before < top_p) | (top_p >= 1)) & (probs > 0), kept & (probs > 0))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), vocab=st.integers(2, 300), top_k=st.integers(1, 300), use_k=st.booleans(),
       top_p=st.floats(0.01, 1.0), scale=st.sampled_from([0.1, 1.0, 4.0]), ties=st.booleans())
def test_pivot_draws_only_kept_tokens(seed, vocab, top_k, use_k, top_p, scale, ties):
    """64 seeded draws per case (flat rows: scale 0.1; peaked: 4.0): each is a token the sort keeps."""
    logits = rows_of_logits(seed, 1, vocab, scale).float()
    if ties:
        logits = logits.round()
    rows = 64
    k = torch.full((rows,), min(top_k, vocab) if use_k else vocab)
    p = torch.full((rows,), top_p)
    generators = [make_generator(seed * rows + i) for i in range(rows)]
    uniforms = torch.tensor([g.random() for g in generators], dtype=torch.float64)
    tokens = sample_top_k_top_p(logits.expand(rows, -1), k if use_k else None, p, uniforms, generators)
    kept = (apply_top_k_top_p(logits, k[:1], p[:1]) > INF)[0]
    assert kept[tokens].all()


# --- cases from public bug reports ------------------------------------------------------------------

def test_top_p_0_6_over_four_probabilities_keeps_exactly_the_two_largest():
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64).log()
    kept = apply_top_k_top_p(logits, None, torch.tensor([0.6], dtype=torch.float64)) > INF
    assert kept.tolist() == [[False, False, True, True]]
    generators = [make_generator(i) for i in range(200)]  # the pivot draw agrees
    uniforms = torch.tensor([g.random() for g in generators], dtype=torch.float64)
    tokens = sample_top_k_top_p(logits.expand(200, -1), None, torch.full((200,), 0.6, dtype=torch.float64), uniforms,
                                generators)
    assert set(tokens.tolist()) == {2, 3}


def test_the_pivot_draw_stops_with_a_clear_error_when_no_token_can_be_accepted(monkeypatch):
    """Each rejection drops the rejected token, so a right draw ends within vocab_size rounds. A
    `mass_ranked_before` that also counts the token's own probability (a wrong answer to ch10_ex1)
    rejects even the likeliest token, and the draw would loop forever: it stops with a RuntimeError
    that says what to look at instead."""
    import minivllm.sample.ops as ops

    right = ops.mass_ranked_before
    monkeypatch.setattr(ops, "mass_ranked_before", lambda logits, probs, ids: right(logits, probs, ids)
                        + probs.gather(1, ids[:, None]).squeeze(1))
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64).log()
    with pytest.raises(RuntimeError, match="did not finish in 4 rounds"):
        sample_top_k_top_p(logits, None, torch.tensor([0.05], dtype=torch.float64),
                           torch.tensor([0.99], dtype=torch.float64), [make_generator(0)])


def test_top_k_1_with_tied_maxima_equals_greedy():
    logits = torch.tensor([[1.0, 5.0, 2.0, 5.0, 5.0]])
    seqs = [Sequence([1], SamplingParams(temperature=1.0, top_k=1, seed=s)) for s in range(40)]
    gens = {s.seq_id: make_generator(i) for i, s in enumerate(seqs)}
    tokens = Sampler()(logits.expand(40, -1), seqs, gens, make_generator(0))
    assert set(tokens) == {int(logits.argmax())} == {1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tiny_temperature_with_top_p_gives_no_nan(dtype):
    logits = torch.tensor([[30.0, 29.5, -10.0, 12.0]], dtype=dtype)
    seq = Sequence([1], SamplingParams(temperature=1e-5, top_p=0.9, seed=0))
    sampler = Sampler()
    md = sampling_metadata([seq], {}, make_generator(0), frozenset(), 4, torch.float32, "cpu")
    scaled = logits.float() / md.temperature[:, None]
    assert not apply_top_k_top_p(scaled, None, md.top_p).softmax(-1).isnan().any()
    assert sampler(logits, [seq], {seq.seq_id: make_generator(0)}, make_generator(0)) == [0]


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0), dict(top_k=3), dict(top_p=0.5),
                                    dict(min_p=0.1), dict(top_k=3, top_p=0.5, logprobs=2), dict(temperature=1e-3)])
def test_overflowing_or_nan_logits_still_give_tokens_of_the_vocabulary(params):
    """A repetition penalty near 0 divides positive logits by it: they overflow to +inf, and softmax
    of a row with +inf is NaN. Such tokens stay the likeliest (tied), NaN is never drawn, and a row that
    excludes every token draws from all alike: every token is in the vocabulary, whatever the filters."""
    vocab, seed = 12, 0
    rows = torch.tensor([[1.0, 5.0, 5.0, -2.0] + [0.5] * (vocab - 4),
                         [float("nan")] * vocab,
                         [float("nan"), 2.0] + [1.0] * (vocab - 2),
                         [0.25] * vocab], dtype=torch.float32)
    prompts = [[1, 2], [1], [3], [4]]
    params_of = [dict(repetition_penalty=1e-40), {}, {}, dict(min_tokens=2)]
    seqs = [Sequence(p, SamplingParams(**params, **extra, seed=seed + i, stop_token_ids=list(range(vocab))
                                       if "min_tokens" in extra else None))
            for i, (p, extra) in enumerate(zip(prompts, params_of))]
    gens = {s.seq_id: make_generator(seed + i) for i, s in enumerate(seqs)}
    for _ in range(20):
        tokens = Sampler(frozenset({0}))(rows, seqs, gens, make_generator(99))
        assert all(0 <= t < vocab for t in tokens), tokens
        assert tokens[0] in (1, 2)  # the prompt's tokens: 5 / 1e-40 overflows, so they tie at the top
        assert tokens[2] != 0  # NaN is never drawn


# --- greedy rows: the argmax ------------------------------------------------------------------------

SPECIAL = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(0, 5), vocab=st.sampled_from([1, 2, 3, 7, 64, 96, 1000, 1024, 2048,
                                                                                   3072, 5000, 49152]),
       chunk=st.sampled_from([1, 2, 16, 1024, 4096]), min_chunk=st.sampled_from([1, 2, 32]),
       levels=st.integers(1, 6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       special=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 49151), st.sampled_from(sorted(SPECIAL))),
                        max_size=4))
def test_greedy_sample_is_the_first_argmax(seed, rows, vocab, chunk, min_chunk, levels, dtype, special):
    """Ties (a few distinct values: many equal maxima, within and across slices), NaN, +-inf, every dtype,
    vocabulary sizes that the slices divide and that they do not: the index `max(dim=-1)` gives."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=gen).to(dtype)
    for r, t, name in special:
        if r < rows:
            logits[r, t % vocab] = SPECIAL[name]
    want = logits.max(dim=-1).indices
    got = greedy_sample(logits, chunk, min_chunk)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, want)
    assert torch.equal(got, logits.float().max(dim=-1).indices)  # widening to float32 changes no argmax


def test_greedy_sample_finds_a_maximum_in_the_last_slice_and_a_late_tie():
    logits = torch.zeros(3, 4096)
    logits[0, 4095] = 1.0  # the last token of the last slice
    logits[1, [3000, 1023, 1024]] = 2.0  # ties across slices: the first in the row wins
    logits[2] = float("-inf")  # nothing but -inf: token 0, as argmax
    assert greedy_sample(logits).tolist() == [4095, 1023, 0]
    for chunk, min_chunk in ((0, 32), (1024, 0)):
        with pytest.raises(ValueError, match="chunk and min_chunk must be at least 1"):
            greedy_sample(logits, chunk, min_chunk)


class RecordingSampler(Sampler):
    """A Sampler that notes the dtype its one pass receives."""

    def forward(self, logits, md):
        self.seen_dtype = logits.dtype
        return super().forward(logits, md)


@pytest.mark.parametrize("extra", [{}, dict(logprobs=2), dict(repetition_penalty=1.2), dict(min_tokens=3),
                                   dict(temperature=0.7, seed=1)])
def test_a_plain_greedy_step_takes_the_argmax_in_the_models_dtype(extra):
    """bfloat16 logits: a step of plain greedy rows is not copied to float32 (its argmax is the same); any
    penalty, min_tokens, log-probabilities or random row on one of the rows sends the step through float32.
    Either way the greedy rows' tokens are the float32 argmax (with min_tokens: of the masked logits)."""
    vocab = 4096
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (3, vocab), generator=gen).to(torch.bfloat16)  # many ties at the top
    seqs = [Sequence([5], SamplingParams(temperature=0)), Sequence([6], SamplingParams(temperature=0)),
            Sequence([7], SamplingParams(**{"temperature": 0, **extra}))]
    sampler = RecordingSampler(frozenset({int(logits[2].float().argmax())}))
    tokens = sampler(logits, seqs, {}, make_generator(0))
    md = sampling_metadata(seqs, {}, make_generator(0), sampler.eos_token_ids, vocab, torch.float32, "cpu")
    assert argmax_only(md) == (not extra)
    assert sampler.seen_dtype == (torch.bfloat16 if not extra else torch.float32)
    assert tokens[:2] == logits[:2].float().argmax(dim=-1).tolist()
    if "min_tokens" in extra:  # its EOS (the row's argmax) is masked: the next of the tied maxima
        assert tokens[2] != int(logits[2].float().argmax()) and logits[2, tokens[2]] == logits[2].max()
    elif "temperature" not in extra:
        assert tokens[2] == int(logits[2].float().argmax())


# --- the draws -------------------------------------------------------------------------------------

@pytest.mark.parametrize("params", [dict(top_p=0.9, top_k=10, min_p=0.02, temperature=0.9), dict(temperature=1.3),
                                    dict(top_k=5, temperature=0.7), dict(presence_penalty=1.0, top_p=0.8),
                                    dict(top_p=0.6), dict(top_k=8, top_p=0.7, temperature=1.2), dict(min_p=0.2),
                                    dict(min_p=0.1, top_p=0.85)])
def test_seeded_draws_follow_the_filtered_distribution(params):
    """20,000 draws (seeds 0..19,999, one batched call) against the filtered softmax: a chi-square test
    whose p-value must exceed 0.001. The seeds are fixed, so the outcome is too; a sampler that
    ignored a filter or drew from the unfiltered distribution gives p < 1e-10 here. With top-p, many
    first draws fall outside the nucleus of a 16-token row: the pivot's later rounds are tested too
    (each took one more number from its row's generator)."""
    vocab, draws = 16, 20_000
    logits = rows_of_logits(7, 1, vocab, scale=1.0).float()
    seqs = [Sequence([3, 4], SamplingParams(seed=i, **params)) for i in range(draws)]
    for s in seqs:
        s.append_token(5)  # an output token, for the presence penalty
    gens = {s.seq_id: make_generator(i) for i, s in enumerate(seqs)}
    tokens = torch.tensor(Sampler()(logits.expand(draws, -1), seqs, gens, make_generator(0)))
    p = seqs[0].sampling_params
    redraws = sum(g.counter for g in gens.values()) - draws
    assert (redraws > 1000) == (p.top_p < 1)
    want = logits.double()
    want = apply_penalties(want, pad_token_ids([[3, 4]], vocab, "cpu"), pad_token_ids([[5]], vocab, "cpu"),
                           torch.tensor([p.presence_penalty], dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
                           torch.ones(1, dtype=torch.float64)) / p.temperature
    want = apply_top_k_top_p(apply_min_p(want, torch.tensor([p.min_p], dtype=torch.float64)),
                             torch.tensor([p.top_k or vocab]), torch.tensor([p.top_p], dtype=torch.float64))
    expected = want.softmax(-1)[0]
    counts = torch.bincount(tokens, minlength=vocab).double()
    support = expected > 0
    assert counts[~support].sum() == 0
    chi2 = float(((counts - draws * expected)[support] ** 2 / (draws * expected[support])).sum())
    dof = int(support.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(chi2 / 2)))
    assert p_value > 1e-3, (chi2, dof, p_value)


def test_chi_square_catches_an_unfiltered_sampler():
    """The test above can fail: the unfiltered softmax's draws are far from the top-p distribution."""
    vocab, draws = 16, 20_000
    logits = rows_of_logits(7, 1, vocab, scale=1.0)
    uniforms = torch.tensor([make_generator(i).random() for i in range(draws)], dtype=torch.float64)
    tokens = random_sample(logits.expand(draws, -1), uniforms)
    expected = apply_top_k_top_p(logits, None, torch.tensor([0.8], dtype=torch.float64)).softmax(-1)[0]
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[expected == 0].sum() > 0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 1000), mates=st.lists(st.sampled_from(["greedy", "temp", "topp", "topk", "minp", "pen",
                                                                   "logprobs", "min_tokens"]), max_size=6))
def test_a_seeded_rows_token_does_not_depend_on_its_batch_mates(seed, mates):
    vocab = 300
    logits = rows_of_logits(seed, 1 + len(mates), vocab).float()
    kinds = {"greedy": dict(temperature=0), "temp": dict(temperature=0.7), "topp": dict(top_p=0.5),
             "topk": dict(top_k=3), "minp": dict(min_p=0.1), "pen": dict(repetition_penalty=1.5, frequency_penalty=1.0),
             "logprobs": dict(logprobs=2), "min_tokens": dict(min_tokens=2)}
    for mine in (dict(top_p=0.9, seed=seed), dict(temperature=0.8, seed=seed), dict(top_k=7, min_p=0.01, seed=seed)):
        def token(rows):
            seqs = [Sequence([1, 2], SamplingParams(**mine))] + [Sequence([3], SamplingParams(**kinds[m])) for m in rows]
            gens = {seqs[0].seq_id: make_generator(seed)}
            return Sampler(frozenset({0}))(logits[:len(seqs)], seqs, gens, make_generator(99))[0]
        assert token(mates) == token([])


# --- log-probabilities -------------------------------------------------------------------------------

def test_gather_logprobs_ranks_and_top_tokens():
    lp = torch.tensor([[0.1, 0.4, 0.2, 0.3]], dtype=torch.float64).log()
    (ids, values, rank), = gather_logprobs(lp, torch.tensor([2]), [2])
    assert ids == [2, 1, 3] and rank == 3 and values[0] == pytest.approx(float(lp[0, 2]))
    (ids, values, rank), = gather_logprobs(lp, torch.tensor([1]), [-1])
    assert ids == [1, 1, 3, 2, 0] and rank == 1
    assert gather_logprobs(lp, torch.tensor([1]), [None]) == [None]


def test_sampler_logprobs_are_the_raw_log_softmax():
    logits = rows_of_logits(3, 2, 30)
    seqs = [Sequence([1], SamplingParams(temperature=0.5, top_k=3, repetition_penalty=2.0, logprobs=4, seed=1)),
            Sequence([2], SamplingParams(temperature=0))]
    sampler = Sampler()
    tokens = sampler(logits, seqs, {seqs[0].seq_id: make_generator(1)}, make_generator(0))
    ids, values, rank = sampler.logprobs[seqs[0].seq_id]
    raw = logits[0].log_softmax(-1)
    assert ids[0] == tokens[0] and len(ids) == 5 and seqs[1].seq_id not in sampler.logprobs
    assert max(abs(v - float(raw[t])) for t, v in zip(ids, values)) <= TOL
    assert rank == int((raw > raw[tokens[0]]).sum()) + 1


# --- the engine ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sampler-engine")
    hf = make_model(folder, "llama")
    hf.generation_config.eos_token_id = None  # transformers never stops early, like ignore_eos
    return folder, hf


def engine_kwargs(folder, **kw):
    return {**dict(model=folder, dtype="float64", max_model_len=128, block_size=4, block_manager_cls=BlockManager,
                   attention_backend=PagedAttention, sampler_cls=Sampler, num_kvcache_blocks=64), **kw}


@torch.inference_mode()
def hf_generate(hf, prompt, **kw):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("penalty", [1.0, 1.3, 0.8])
def test_engine_greedy_with_penalty_equals_transformers(tiny, penalty):
    folder, hf = tiny
    prompts = random_prompts(5, 2, 20, seed=4, vocab=128)
    outs = run_engine(LLMEngine(**engine_kwargs(folder)), prompts,
                      SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=penalty))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_generate(hf, p, do_sample=False, max_new_tokens=10, eos_token_id=None,
                                                      repetition_penalty=penalty)


def test_engine_min_tokens_equals_transformers_min_new_tokens(tiny):
    """EOS is the greedy token of a tiny model whose final norm is zero (all logits equal: token 0).
    min_tokens=4 holds it back for exactly four tokens, like transformers' min_new_tokens."""
    folder, hf = tiny
    prompts = random_prompts(4, 2, 10, seed=5, vocab=128)
    engine = LLMEngine(**engine_kwargs(folder))
    eos = hf.config.eos_token_id
    for p in prompts:
        first = hf_generate(hf, p, do_sample=False, max_new_tokens=1, eos_token_id=None)[0]
        engine.eos_token_ids = engine.model_runner.sampler.eos_token_ids = engine.scheduler.eos_token_ids = \
            frozenset({first})
        out = run_engine(engine, [p], SamplingParams(temperature=0, max_tokens=8, min_tokens=3))[0].outputs[0]
        want = hf_generate(hf, p, do_sample=False, max_new_tokens=8, eos_token_id=first, min_new_tokens=3)
        assert out.token_ids == want and first not in out.token_ids[:3] and eos is not None


@pytest.mark.parametrize("caching", [False, True])
def test_seeded_request_is_the_same_alone_in_a_crowd_and_when_preempted(tiny, caching):
    folder, _ = tiny
    kv = PrefixCachingBlockManager if caching else BlockManager
    prompts = random_prompts(7, 4, 20, seed=6, vocab=128)
    seeded = SamplingParams(temperature=0.9, top_p=0.8, min_p=0.02, max_tokens=20, seed=123, ignore_eos=True,
                            presence_penalty=0.5)
    others = [SamplingParams(temperature=1.1, top_k=5, max_tokens=22, ignore_eos=True, frequency_penalty=0.3)] * 6
    alone = run_engine(LLMEngine(**engine_kwargs(folder, block_manager_cls=kv)), prompts[:1], [seeded])
    small = LLMEngine(**engine_kwargs(folder, block_manager_cls=kv, num_kvcache_blocks=14, max_model_len=56))
    crowd = run_engine(small, prompts, [seeded] + others)
    assert small.scheduler.num_preemptions > 0
    assert crowd[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    check_invariants(small)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("top_p", [1e-50, 1e-30, 1e-9])
def test_a_top_p_below_the_dtypes_range_keeps_the_likeliest_token(dtype, top_p):
    """top_p is in (0, 1], but 1e-50 is 0 in float32 (1e-9 in float16): the likeliest token must still be
    kept, not every token refused until the pivot draw gives up."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.5, -2.0, 4.0, 4.5]], dtype=dtype)
    seqs = [Sequence([1], SamplingParams(temperature=1.0, top_p=top_p, seed=i)) for i in range(2)]
    gens = {s.seq_id: make_generator(i) for i, s in enumerate(seqs)}
    assert Sampler()(logits, seqs, gens, make_generator(0)) == [1, 3]
    md = sampling_metadata(seqs, gens, make_generator(0), frozenset(), 4, dtype, "cpu")
    kept = apply_top_k_top_p(logits.clone(), None, md.top_p).isfinite()
    assert kept.tolist() == [[False, True, False, False], [False, False, False, True]]
