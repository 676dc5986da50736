"""Chapter 14: speculative decoding (n-gram and draft-model proposers, the rejection sampler).

What is proved here, on tiny random float64 models (no argmax near-tie can flip):
* greedy: the tokens equal plain decoding's and transformers' `generate` for k = 1..5, with both
  proposers, under preemption, chunked prefill and prefix caching (with hits on blocks that accepted
  drafts filled); a draft that is the target itself accepts every draft, greedy or sampled;
* sampled: the rejection sampler's outputs follow the target's distribution (chi-square p-values from
  `torch.special.gammaincc`, seeded so nothing can flake), wrong samplers fail the same tests at the
  same sizes, and the whole engine's three-token continuations follow transformers' exact
  distribution, filters and penalties included;
* stops inside an accepted run (EOS, stop token, stop string, max_tokens) give plain decoding's
  outputs, and the counters count no accepted token after the stop;
* bad configurations raise a ValueError naming the values; unit tests of the pieces.
Invariants (`spec_helpers.check_spec_invariants`) are checked after every step of every engine run.
"""
from __future__ import annotations

import bisect
import copy
import itertools
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_helpers import hf_greedy, make_model, one_thread, random_prompts, run_engine
from minivllm.llm import LLM
from minivllm.sample.rejection_sampler import (DraftPosition, RejectionSampler, draft_positions, draw,
                                               greedy_verify, rejection_sample)
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.sequence import Sequence
from minivllm.spec_decode.config import SpecDecodeEngineArgs, SpeculativeConfig
from minivllm.spec_decode.engine import SpecDecodeLLMEngine
from minivllm.spec_decode.metrics import SpecDecodingStats
from minivllm.spec_decode.model_runner import SpecDecodeModelRunner, flat_batch, verify_row
from minivllm.spec_decode.ngram_proposer import NgramProposer, ngram_lookup
from minivllm.spec_decode.scheduler import SpecDecodeScheduler
from spec_helpers import check_spec_invariants, chi_square_pvalue, perturbed_copy, run_spec

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)

MAX_MODEL_LEN = 128
ALPHA = 1e-3  # a correct sampler fails a test with probability 1e-3 per seed choice; the seeds are fixed


def ngram(k: int, lo: int = 1, hi: int = 3) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}


def draft_model(folder, k: int) -> dict:
    return {"model": str(folder), "num_speculative_tokens": k}


def make_llm(folder, spec=None, **kwargs):
    kwargs = {"dtype": "float64", "device": "cpu", "block_size": 4, "num_kvcache_blocks": 256,
              "max_model_len": MAX_MODEL_LEN, **kwargs}
    return LLM(folder, speculative_config=spec, **kwargs)


def engine(folder, spec=None, **kwargs):
    return make_llm(folder, spec, **kwargs).llm_engine


def greedy(max_tokens, **kw):
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, **kw) for m in max_tokens]


def expected_all_accepted(num_tokens: int, k: int) -> tuple[int, int]:
    """`(verification steps with drafts, accepted drafts)` of one request whose every draft is accepted
    (draft = target) and that ended with `num_tokens` completion tokens. Its prefill samples token 1 and
    proposes k drafts; each verification then adds k accepted drafts and a bonus token (k + 1 tokens),
    except the last, which a stop or max_tokens may cut after `c` tokens: it keeps min(c, k) drafts (a
    token cut away was accepted but not kept, so it is not counted)."""
    rest = num_tokens - 1
    steps = -(-rest // (k + 1))
    return steps, (0 if steps == 0 else k * (steps - 1) + min(rest - (k + 1) * (steps - 1), k))


# --- models ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(folder, transformers model) of the tiny target (vocabulary 128, 512 positions)."""
    folder = tmp_path_factory.mktemp("spec-target")
    return folder, make_model(folder, "llama", seed=0)


@pytest.fixture(scope="module")
def close_draft(target, tmp_path_factory):
    """A draft that agrees with the target often but not always: its weights plus a little noise."""
    folder = tmp_path_factory.mktemp("spec-close-draft")
    perturbed_copy(target[1], folder, noise=0.003, seed=5)
    return folder


@pytest.fixture(scope="module", params=["llama", "qwen3-1-layer"])
def random_draft(tmp_path_factory, request):
    """An unrelated draft with the same vocabulary (it rarely agrees with the target): another seed of
    the target's architecture, or a Qwen3 of one layer and one K/V head (its own cache shape)."""
    folder = tmp_path_factory.mktemp("spec-random-draft")
    if request.param == "llama":
        make_model(folder, "llama", seed=1)
    else:
        make_model(folder, "qwen3", seed=2, num_hidden_layers=1, num_key_value_heads=1)
    return folder


@pytest.fixture(scope="module")
def greedy_case(target):
    """(prompts, max_tokens, transformers' greedy completions). Prompts repeat a random phrase (so
    n-gram drafts come up and are accepted); three share a 27-token prefix (prefix-cache hits)."""
    _, model = target
    base = random_prompts(6, 2, 7, seed=1)
    rng = random.Random(2)
    prompts = [p * rng.randint(2, 5) for p in base]
    shared = list(range(3, 30))
    prompts += [shared + p for p in base[:3]]
    max_tokens = [rng.randint(5, 30) for _ in prompts]
    return prompts, max_tokens, [hf_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]


# --- 1. greedy: identical to plain decoding and to transformers ---------------------------------------

SCENARIOS = {
    # 40 blocks of 4 = 160 tokens: the longest sequence (62) fits alone, the batch does not
    "preemption": dict(num_kvcache_blocks=40),
    # 8 tokens a step, at most 5 per prompt chunk: prompts (up to 32 tokens) and drafts are cut to the budget;
    # the CPU runs each step in forward passes of at most 3 scheduled tokens
    "chunked": dict(max_num_batched_tokens=8, max_num_seqs=4, long_prefill_token_threshold=5,
                    enable_prefix_caching=False),
    "prefix_caching": dict(),
}


@pytest.fixture(scope="module")
def plain_outputs(target, greedy_case):
    """The engine without speculative decoding, per scenario (computed once)."""
    folder, _ = target
    prompts, max_tokens, _ = greedy_case
    cache = {}

    def get(scenario):
        if scenario not in cache:
            e = engine(folder, None, **SCENARIOS[scenario])
            assert not isinstance(e, SpecDecodeLLMEngine)
            cache[scenario] = [o.outputs[0] for o in run_engine(e, prompts, greedy(max_tokens, logprobs=1))]
        return cache[scenario]
    return get


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_tokens_equal_plain_decoding_and_transformers(target, close_draft, greedy_case, plain_outputs,
                                                            monkeypatch, scenario, method, k):
    folder, model = target
    prompts, max_tokens, refs = greedy_case
    if scenario == "chunked":
        monkeypatch.setattr(SpecDecodeModelRunner, "prefill_microbatch_tokens", 3)
    spec = ngram(k) if method == "ngram" else draft_model(close_draft, k)
    e = engine(folder, spec, **SCENARIOS[scenario])
    assert isinstance(e, SpecDecodeLLMEngine) and isinstance(e.scheduler, SpecDecodeScheduler)
    outs = run_spec(e, prompts, greedy(max_tokens, logprobs=1))
    plain = plain_outputs(scenario)
    for i, (out, ref, base) in enumerate(zip(outs, refs, plain)):
        c = out.outputs[0]
        assert c.token_ids == ref == base.token_ids, f"prompt {i}"
        assert len(c.logprobs) == len(c.token_ids)
        for x, y in zip(c.logprobs, base.logprobs):  # the model's own log-probabilities, from a batch of
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-9 for t in x)  # another shape
    stats = e.spec_decoding_stats
    assert stats.num_spec_tokens == k and stats.num_drafts > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens <= k * stats.num_drafts  # accepted and rejected
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    assert stats.num_accepted_tokens <= sum(len(r) - 1 for r in refs)
    if scenario == "preemption":
        assert e.scheduler.num_preemptions > 0
    if scenario == "chunked":
        assert max(map(len, prompts)) > 8 and all(s.num_tokens <= 8 for s in e.stats)
    if scenario == "prefix_caching":
        assert sum(o.num_cached_tokens for o in outs) > 0  # the shared prefix
        # again, each prompt followed by its completion: hits on the blocks that accepted drafts filled
        again = [p + r for p, r in zip(prompts, refs)]
        before = stats.num_accepted_tokens
        outs = run_spec(e, again, greedy([4] * len(again)))
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 4) for p in again]
        assert sum(o.num_cached_tokens for o in outs) >= sum(len(p) // 4 * 4 - 4 for p in again)
        assert stats.num_accepted_tokens > before


def test_greedy_with_penalties_and_min_tokens_equals_plain_decoding(target, close_draft, greedy_case):
    """Penalties and `min_tokens` see the drafts before each verified position (`DraftPosition`)."""
    folder, _ = target
    prompts, max_tokens, _ = greedy_case
    params = [SamplingParams(temperature=0, max_tokens=m, repetition_penalty=1.3, frequency_penalty=0.2,
                             presence_penalty=0.1, min_tokens=m // 2) for m in max_tokens]
    plain = run_engine(engine(folder), prompts, params)
    # the most frequent plain token ends sequences: min_tokens holds it back at first
    eos = int(torch.bincount(torch.tensor([t for o in plain for t in o.outputs[0].token_ids])).argmax())
    for spec in (ngram(3), draft_model(close_draft, 4), draft_model(folder, 2)):
        outs = {}
        for name, cfg in (("plain", None), ("spec", spec)):
            e = engine(folder, cfg)
            e.eos_token_ids = e.scheduler.eos_token_ids = e.model_runner.sampler.eos_token_ids = frozenset({eos})
            outs[name] = (run_spec if cfg else run_engine)(e, prompts, params)
        a, b = ([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs[n]] for n in ("plain", "spec"))
        assert a == b, spec
        assert {r for _, r in a} == {"stop", "length"}
        assert all(len(t) >= m // 2 for (t, _), m in zip(a, max_tokens))


def test_a_random_draft_keeps_the_greedy_tokens_exact(target, random_draft, greedy_case):
    folder, _ = target
    prompts, max_tokens, refs = greedy_case
    e = engine(folder, draft_model(random_draft, 3), num_kvcache_blocks=40)  # preemption too
    outs = run_spec(e, prompts, greedy(max_tokens))
    assert [o.outputs[0].token_ids for o in outs] == refs
    stats = e.spec_decoding_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens / 4
    assert e.scheduler.num_preemptions > 0


def test_abort_and_streaming_with_drafts(target, greedy_case):
    """An aborted request frees its blocks and its drafts; DELTA outputs add up to the whole completion."""
    folder, _ = target
    prompts, max_tokens, refs = greedy_case
    e = engine(folder, draft_model(folder, 3))
    stream = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
              for m in max_tokens]
    ids = [e.add_request(None, p, sp) for p, sp in zip(prompts, stream)]
    got = {i: [] for i in ids}
    for step in range(4):
        for o in e.step():
            got[o.request_id] += o.outputs[0].token_ids
        if step == 2:
            e.abort_request(ids[0])
    while e.has_unfinished_requests():
        for o in e.step():
            got[o.request_id] += o.outputs[0].token_ids
    check_spec_invariants(e)  # idle: no blocks, no generators, no draft distributions left
    assert all(got[i] == r for i, r in zip(ids[1:], refs[1:]))
    assert got[ids[0]] == refs[0][:len(got[ids[0]])] and len(got[ids[0]]) < len(refs[0])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data(), method=st.sampled_from(["ngram", "draft_model"]), k=st.integers(1, 5),
       block_size=st.sampled_from([1, 2, 4, 8]), extra_blocks=st.integers(0, 12),
       budget=st.sampled_from([6, 8, 16, None]), threshold=st.sampled_from([0, 3]), caching=st.booleans(),
       chunking=st.booleans())
def test_random_schedules_keep_the_greedy_tokens(target, close_draft, data, method, k, block_size, extra_blocks,
                                                 budget, threshold, caching, chunking):
    """hypothesis over engine settings (block size, a KV cache from barely enough to ample, token budget,
    chunk threshold, prefix caching, chunking off) and prompts over a small alphabet (so they repeat):
    the tokens equal the engine's without drafts in the same settings (checked against transformers
    above)."""
    folder, _ = target
    prompts = data.draw(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=24), min_size=1, max_size=5))
    max_tokens = data.draw(st.lists(st.integers(1, 20), min_size=len(prompts), max_size=len(prompts)))
    max_model_len = 48
    kwargs = dict(block_size=block_size, num_kvcache_blocks=-(-max_model_len // block_size) + extra_blocks,
                  max_model_len=max_model_len, long_prefill_token_threshold=threshold, enable_prefix_caching=caching)
    if budget is not None:
        kwargs.update(max_num_batched_tokens=budget, max_num_seqs=min(4, budget))
    elif not chunking:  # without chunking every prompt must fit one step's budget (the default one does)
        kwargs.update(enable_chunked_prefill=False)
    plain = run_engine(engine(folder, **kwargs), prompts, greedy(max_tokens))
    spec = ngram(k, 1, 2) if method == "ngram" else draft_model(close_draft, k)
    outs = run_spec(engine(folder, spec, **kwargs), prompts, greedy(max_tokens))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_seeded_samples_do_not_depend_on_the_batch_and_prompt_logprobs_are_plain(target, close_draft):
    """A seeded request draws its drafts and its verification uniforms from its own generator: alone
    or in a batch it gets the same tokens (with room enough that its drafts do not depend on the
    others). Its prompt_logprobs are those of the engine without drafts."""
    folder, _ = target
    prompts = [p * 3 for p in random_prompts(5, 3, 8, seed=3)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=50 + i, max_tokens=20, ignore_eos=True,
                             prompt_logprobs=2) for i in range(len(prompts))]
    plain = run_engine(engine(folder), prompts, params)
    for spec in (draft_model(close_draft, 3), ngram(3)):
        together = run_spec(engine(folder, spec), prompts, params)
        alone = [run_spec(engine(folder, spec), [p], [sp])[0] for p, sp in zip(prompts, params)]
        assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
        for a, b in zip(together, plain):
            assert len(a.prompt_logprobs) == len(b.prompt_logprobs) and a.prompt_logprobs[0] is None
            for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-9 for t in x)


# --- 2. draft = target: every draft accepted ---------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_draft_equal_to_the_target_is_always_accepted(target, sampled, k):
    """The counters sum over the requests, and with every draft accepted each request's share follows
    from its length (`expected_all_accepted`). The drafts a request's last step verified past its
    `max_tokens` are accepted but cut: they are the only drafts not counted as accepted."""
    folder, model = target
    prompts = random_prompts(6, 3, 20, seed=4)
    rng = random.Random(k)
    max_tokens = [rng.randint(1, 25) for _ in prompts]
    filters = dict(temperature=1.0, top_k=20, top_p=0.9) if sampled else dict(temperature=0)
    params = [SamplingParams(max_tokens=m, ignore_eos=True, seed=100 + i, logprobs=1, **filters)
              for i, m in enumerate(max_tokens)]
    e = engine(folder, draft_model(folder, k))
    outs = run_spec(e, prompts, params)
    stats = e.spec_decoding_stats
    expected = [expected_all_accepted(len(o.outputs[0].token_ids), k) for o in outs]
    assert [len(o.outputs[0].token_ids) for o in outs] == max_tokens
    assert stats.num_drafts == sum(s for s, _ in expected)
    assert stats.num_draft_tokens == k * stats.num_drafts
    assert stats.num_accepted_tokens == sum(a for _, a in expected)
    cut = sum(k - a % k if a % k else 0 for _, a in expected)  # drafts past max_tokens in each last step
    assert stats.num_draft_tokens - stats.num_accepted_tokens == cut
    check_path_against_transformers(model, prompts, params, outs)


def record_verifications(e) -> list[tuple[int, int]]:
    """Wrap `e`'s model runner: the list it returns fills with `(drafts verified, tokens returned)` for
    each sequence of each step that verified drafts."""
    real, log = e.model_runner.run, []

    def run(seqs, is_prefill):
        drafts = [len(s.spec_token_ids) for s in seqs]
        outs = real(seqs, is_prefill)
        log.extend((n, len(o[0])) for n, o in zip(drafts, outs) if o is not None and n)
        return outs
    e.model_runner.run = run
    return log


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_draft_equal_to_the_target_accepts_every_draft_whatever_the_schedule(target, greedy_case, monkeypatch,
                                                                              scenario, sampled):
    """The draft model keeps its own K/V in the target's blocks: after preemption and recomputation,
    prefill chunks, prefix-cache hits (round 2: blocks that accepted drafts filled) and forks (n = 2),
    a draft equal to the target must still propose exactly the target's tokens, so every verified
    draft is accepted: any stale or misplaced draft K/V would show as a rejection."""
    folder, model = target
    prompts, max_tokens, refs = greedy_case
    if scenario == "chunked":
        monkeypatch.setattr(SpecDecodeModelRunner, "prefill_microbatch_tokens", 3)
    e = engine(folder, draft_model(folder, 3), **SCENARIOS[scenario])
    log = record_verifications(e)
    if sampled:
        params = [SamplingParams(n=2, temperature=1.0, top_k=30, top_p=0.95, seed=i, max_tokens=m, ignore_eos=True,
                                 logprobs=1) for i, m in enumerate(max_tokens)]
    else:
        params = greedy(max_tokens)
    outs = run_spec(e, prompts, params)
    if sampled:
        check_path_against_transformers(model, prompts, params, outs)
    else:
        assert [o.outputs[0].token_ids for o in outs] == refs
    if scenario == "prefix_caching":
        again = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
        outs = run_spec(e, again, greedy([9] * len(again)))
        assert sum(o.num_cached_tokens for o in outs) > 0
    if scenario == "preemption":
        assert e.scheduler.num_preemptions > 0
    assert len(log) > 10 and all(returned == n + 1 for n, returned in log), log


def check_path_against_transformers(model, prompts, params, outs, tol=1e-9):
    """Each completion token's log-probability equals transformers' for the same prefix (so the K/V the
    engine attended over was right), and a sampled token lies in its filtered set (top-k, top-p)."""
    for prompt, p, out in zip(prompts, params, outs):
        for c in out.outputs:
            ids = prompt + c.token_ids
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, len(prompt) - 1:-1]
            logprobs = logits.log_softmax(-1)
            assert len(c.logprobs) == len(c.token_ids)
            for j, (t, row) in enumerate(zip(c.token_ids, c.logprobs)):
                assert abs(row[t].logprob - float(logprobs[j, t])) < tol, (j, t)
                if p.greedy:
                    assert t == int(logits[j].argmax())
                else:
                    assert float(filtered_probs(logits[j], p)[t]) > 0, (j, t)


def filtered_probs(logits: torch.Tensor, p: SamplingParams, seen=(), output=()) -> torch.Tensor:
    """The distribution a sampled request draws from, by hand in vLLM's order: repetition penalty (on
    tokens `seen` in prompt or output), frequency and presence penalties (on `output` tokens),
    temperature, min-p, top-k, then top-p (a token stays while the probability ranked before it is
    below top_p). `logits [vocab_size]` float64."""
    logits = logits.clone().double()
    for t in set(seen):
        logits[t] = logits[t] / p.repetition_penalty if logits[t] > 0 else logits[t] * p.repetition_penalty
    for t in set(output):
        logits[t] -= p.frequency_penalty * list(output).count(t) + p.presence_penalty
    logits = logits / p.temperature
    probs = logits.softmax(-1)
    keep = probs >= p.min_p * probs.max()
    order = torch.argsort(logits, descending=True, stable=True)
    if 0 < p.top_k < len(logits):
        keep[order[p.top_k:]] = False
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    kept = kept / kept.sum()
    before = 0.0
    for t in order.tolist():
        if keep[t] and before >= p.top_p:
            keep[t] = False
        before += float(kept[t])
    out = torch.where(keep, probs, torch.zeros_like(probs))
    return out / out.sum()


def test_sampled_requests_with_n_completions_keep_their_kv_intact(target, close_draft):
    """Forked completions (n > 1) sampled with a draft model: every token's log-probability is
    transformers' for its own prefix, so no completion attended over another's K/V or over stale drafts."""
    folder, model = target
    prompts = random_prompts(4, 3, 12, seed=8)
    params = [SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=7 + i, max_tokens=15, ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]
    for spec in (draft_model(close_draft, 3), draft_model(folder, 2), ngram(2)):
        e = engine(folder, spec, num_kvcache_blocks=48)  # tight enough to preempt now and then
        outs = run_spec(e, prompts, params)
        assert all(len(o.outputs) == 3 for o in outs)
        check_path_against_transformers(model, prompts, params, outs)


# --- 3. statistics: the sampler alone --------------------------------------------------------------

V = 16  # tokens in the sampler's tests
# rejection_sample takes ~30 us a call (2-core machine): 50,000 draws are ~1.5 s a run. 10^5 would double
# that for nothing: at 50,000 (and at 30,000) every wrong sampler below scores p < 1e-120, and a
# correct one's 15-dof test would detect a 25 % error in a cell of probability 0.02 with power > 0.99.
N_DRAWS = 50_000


def random_dists(seed: int) -> dict:
    """p0, p1, p2 (target) and q0, q1 (draft) over V tokens, Dirichlet(0.7) (numpy, seeded): uneven, with
    tokens of probability 0 (as top-k leaves them) in p and in q, where the other has mass."""
    rng = np.random.default_rng(1000 + seed)
    d = {name: torch.from_numpy(rng.gamma(0.7, size=V)) for name in ("p0", "p1", "p2", "q0", "q1")}
    d["p0"][V - 1] = d["p1"][V - 2] = d["q0"][0] = d["q1"][V - 1] = 0.0
    return {k: v / v.sum() for k, v in d.items()}


def sample_runs(sampler, k: int, one_hot: bool, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """`n` calls of `sampler(drafts, p, q, uniforms)` with k drafts, each drawn from q (`one_hot`: the
    n-gram case, q None and the drafts fixed tokens 3, 5) and fresh uniforms from a seeded generator.
    Returns (drafts, output) pairs."""
    d = random_dists(seed)
    p = torch.stack([d["p0"], d["p1"], d["p2"]][:k + 1])
    q = None if one_hot else torch.stack([d["q0"], d["q1"]][:k])
    rng = np.random.default_rng(seed)
    drafts = (np.tile([3, 5][:k], (n, 1)) if one_hot else
              np.stack([rng.choice(V, size=n, p=q[j].numpy()) for j in range(k)], axis=1))
    uniforms = rng.random((n, k + 1))
    runs = []
    for ds, us in zip(drafts.tolist(), uniforms.tolist()):
        runs.append((ds, sampler(ds, p, q, us)))
    return runs


def first_and_second_pvalues(runs, seed: int) -> tuple[float, float | None]:
    """p-values of (1) the first output token against p0 over all runs, and (2) for k >= 2, the second
    output token against p1 over the runs whose first draft was accepted. (2) is the right conditional:
    the first output equals the first draft exactly when it was accepted (at a rejection the residual
    max(p0 - q0, 0) is 0 at a draft that could be rejected), and given that, the second token is
    verified against p1 like a first one; so it must follow p1 whatever q1 is."""
    d = random_dists(seed)
    n = len(runs)
    first = np.bincount([out[0] for _, out in runs], minlength=V)
    p_first, _ = chi_square_pvalue(first, n * d["p0"])
    accepted = [out for ds, out in runs if len(ds) >= 2 and out[0] == ds[0]]
    if not accepted:
        return p_first, None
    assert all(len(out) >= 2 for out in accepted)
    second = np.bincount([out[1] for out in accepted], minlength=V)
    p_second, _ = chi_square_pvalue(second, len(accepted) * d["p1"])
    return p_first, p_second


@pytest.mark.parametrize("k, one_hot", [(1, False), (2, False), (1, True), (2, True)])
def test_rejection_sample_outputs_follow_the_target(k, one_hot):
    seed = 10 * k + one_hot
    runs = sample_runs(rejection_sample, k, one_hot, N_DRAWS, seed)
    assert all(1 <= len(out) <= k + 1 for _, out in runs)
    assert all(out[:-1] == ds[:len(out) - 1] for ds, out in runs)  # accepted drafts, then one token of its own
    lengths = np.bincount([len(out) for _, out in runs], minlength=k + 2)
    assert lengths[1] > 0 and lengths[k + 1] > 0  # rejections and full acceptances both happen
    p_first, p_second = first_and_second_pvalues(runs, seed)
    assert p_first > ALPHA, p_first
    assert p_second is None or p_second > ALPHA, p_second
    # a draft of target probability 0 is never output; an n-gram draft is accepted as often as p gives it
    d = random_dists(seed)
    assert all(d["p0"][out[0]] > 0 for _, out in runs)
    if one_hot:
        rate = np.mean([len(out) > 1 or out[0] == 3 for _, out in runs])
        assert abs(rate - float(d["p0"][3])) < 5 * math.sqrt(0.25 / len(runs))


def wrong_residual(drafts, p, q, uniforms):
    """A plausible bug: at a rejection, draw from p itself instead of max(p - q, 0)."""
    for j, t in enumerate(drafts):
        if uniforms[j] * float(q[j, t]) < float(p[j, t]):
            continue
        return list(drafts[:j]) + [draw(p[j], uniforms[j + 1])]
    return list(drafts) + [draw(p[len(drafts)], uniforms[len(drafts)])]


def wrong_match_rule(drafts, p, q, uniforms):
    """Another: accept a draft when a fresh sample from the target equals it, else take the residual."""
    for j, t in enumerate(drafts):
        if draw(p[j], uniforms[j]) == t:
            continue
        return list(drafts[:j]) + [draw((p[j] - q[j]).clamp(min=0), uniforms[j + 1])]
    return list(drafts) + [draw(p[len(drafts)], uniforms[len(drafts)])]


def wrong_reused_uniform(drafts, p, q, uniforms):
    """A subtle one: the uniform that rejected the draft also draws its replacement (given a rejection
    it lies in [p/q, 1), so the replacement is biased to the end of the vocabulary)."""
    return rejection_sample(drafts, p, q, [uniforms[0], uniforms[0]] + list(uniforms[2:]))


@pytest.mark.parametrize("wrong", [wrong_residual, wrong_match_rule, wrong_reused_uniform])
def test_wrong_samplers_fail_the_same_test_at_the_same_size(wrong):
    """The negative control: the test above, same k, q, seed and number of draws, rejects each outright
    (measured: p = 0.0 in float64 for all three; at 30,000 draws still p < 1e-120: the power is ample)."""
    runs = sample_runs(wrong, 1, False, N_DRAWS, seed=10)
    p_first, _ = first_and_second_pvalues(runs, seed=10)
    assert p_first < 1e-12, p_first


def markov_paths(sampler, k: int, n: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """The engine in miniature: a target and a draft whose next-token distributions depend on the
    previous token (rows of V x V matrices P and Q; row V: the first token's). Each of `n` sequences is
    generated as the engine does: propose k drafts from the draft's chain, verify them with `sampler`
    against the target's rows along the drafts, append what it returns, repeat until it has 2 tokens.
    Returns the counts `[V, V]` of the first two tokens and their exact probability under the target
    alone, `P[V, a] * P[a, b]`. This checks the joint distribution over one or two verification steps,
    a rejection followed by new drafts included."""
    rng = np.random.default_rng(seed)
    P, Q = (torch.from_numpy(rng.gamma(0.6, size=(V + 1, V))) for _ in range(2))  # Dirichlet(0.6) rows;
    P, Q = P / P.sum(-1, keepdim=True), Q / Q.sum(-1, keepdim=True)  # row V: the first token's distribution
    q_cdf = np.cumsum(Q.numpy(), axis=1).tolist()
    uniforms = iter(rng.random(n * 2 * (2 * k + 1)).tolist())  # enough for two steps each, drawn at once
    counts = np.zeros((V, V), dtype=np.int64)
    for _ in range(n):
        seq = []
        while len(seq) < 2:
            prev = seq[-1] if seq else V
            drafts, ctx = [], prev
            for _ in range(k):  # the draft's chain, by inverse transform
                ctx = min(bisect.bisect_right(q_cdf[ctx], next(uniforms) * q_cdf[ctx][-1]), V - 1)
                drafts.append(ctx)
            rows = [prev] + drafts
            seq += sampler(drafts, P[rows], Q[rows[:-1]], [next(uniforms) for _ in range(k + 1)])
        counts[seq[0], seq[1]] += 1
    return counts, P[V][:, None] * P[:V]


def test_rejection_sample_paths_over_several_steps_follow_the_target():
    """256 cells, ~117 draws expected in each; the reused-uniform control gives p = 0.0 at this size."""
    n = 30_000
    counts, exact = markov_paths(rejection_sample, 2, n, seed=3)
    p_value, dof = chi_square_pvalue(counts, n * exact)
    assert dof > 100 and p_value > ALPHA, p_value
    counts, _ = markov_paths(wrong_reused_uniform, 2, n, seed=3)
    assert chi_square_pvalue(counts, n * exact)[0] < 1e-6


# --- 3c. statistics: the whole engine against transformers' exact distribution ---------------------------

VOCAB8 = dict(vocab_size=8, initializer_range=0.2)  # uneven next-token distributions over 8 tokens


@pytest.fixture(scope="module")
def vocab8(tmp_path_factory):
    """(target folder, target model, draft folder): vocabulary 8, another seed for the draft."""
    t, d = tmp_path_factory.mktemp("v8-target"), tmp_path_factory.mktemp("v8-draft")
    model = make_model(t, "llama", seed=3, **VOCAB8)
    make_model(d, "llama", seed=4, **VOCAB8)
    assert model.config.vocab_size == 8
    return t, model, d


def exact_continuations(model, prompt: list[int], p: SamplingParams) -> torch.Tensor:
    """`[8, 8, 8]`: the probability of each three-token continuation under the target's filtered
    distribution (`filtered_probs`), from transformers' float64 logits, all 512 paths enumerated."""
    paths = torch.tensor(list(itertools.product(range(8), repeat=2)))
    with torch.no_grad():
        logits = model(torch.cat([torch.tensor(prompt).expand(64, -1), paths], 1)).logits[:, len(prompt) - 1:]
    exact = torch.zeros(8, 8, 8, dtype=torch.float64)
    p0 = filtered_probs(logits[0, 0], p, prompt)
    for (a, b), row in zip(paths.tolist(), logits):
        p1 = filtered_probs(row[1], p, prompt + [a], [a])
        p2 = filtered_probs(row[2], p, prompt + [a, b], [a, b])
        exact[a, b] = p0[a] * p1[b] * p2
    assert abs(float(exact.sum()) - 1) < 1e-9
    return exact


ENGINE_VARIANTS = {
    # a draft model, k = 2, the plain distribution
    "draft-k2": (lambda d: draft_model(d, 2), dict(temperature=1.0), 6000),
    # a draft model, k = 1 (bonus tokens), every filter
    "draft-k1-filters": (lambda d: draft_model(d, 1), dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.02), 5000),
    # n-gram drafts (q one-hot) with the three penalties, which must count the drafts before each position
    "ngram-k2-penalties": (lambda d: ngram(2), dict(temperature=1.0, repetition_penalty=1.2, frequency_penalty=1.0,
                                                    presence_penalty=0.5), 8000),
}
PROMPT8 = [1, 5, 2, 7, 1, 5, 2, 7, 1, 5]  # repeats itself: n-gram drafts for any next token


def engine_continuations(folder, spec, params: dict, n: int, **kwargs) -> tuple[np.ndarray, SpecDecodingStats]:
    """Counts `[8, 8, 8]` of `n` seeded requests' three-token continuations of PROMPT8 (one generate)."""
    llm = make_llm(folder, spec, max_model_len=32, max_num_seqs=256, max_num_batched_tokens=2048,
                   num_kvcache_blocks=2048, **kwargs)
    sps = [SamplingParams(max_tokens=3, ignore_eos=True, seed=1000 + i, **params) for i in range(n)]
    outs = llm.generate([PROMPT8] * n, sps, use_tqdm=False)
    counts = np.zeros((8, 8, 8), dtype=np.int64)
    for o in outs:
        counts[tuple(o.outputs[0].token_ids)] += 1
    check_spec_invariants(llm.llm_engine)
    return counts, llm.llm_engine.spec_decoding_stats


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_engine_samples_follow_the_targets_exact_distribution(vocab8, variant):
    """Chi-square over the 512 continuations (cells expected fewer than 5 times pooled; with top-k,
    top-p and min-p many paths have probability 0, and a sample on one fails outright). Sizes: 5000 to
    8000 requests, ~1 ms each; the engine-bug control below shows the power at the n-gram size."""
    folder, model, draft = vocab8
    spec, params, n = ENGINE_VARIANTS[variant]
    counts, stats = engine_continuations(folder, spec(draft), params, n)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both acceptance and rejection happen
    exact = exact_continuations(model, PROMPT8, SamplingParams(**params))
    p_value, dof = chi_square_pvalue(counts, n * exact)
    assert dof >= 30 and p_value > ALPHA, (p_value, dof)


def test_the_engine_test_fails_penalties_that_miss_the_drafts(vocab8, monkeypatch):
    """The negative control of the engine test, at the same size: a plausible engine bug, penalties at
    each verified position that see the sequence's tokens but not the drafts before that position (the
    sampler alone is right; `DraftPosition` loses the drafts). Measured p ~ 1e-58."""
    import minivllm.sample.rejection_sampler as rs

    folder, model, draft = vocab8
    real_init = rs.DraftPosition.__init__
    monkeypatch.setattr(rs.DraftPosition, "__init__", lambda self, seq, drafts: real_init(self, seq, []))
    spec, params, n = ENGINE_VARIANTS["ngram-k2-penalties"]
    counts, _ = engine_continuations(folder, spec(draft), params, n)
    exact = exact_continuations(model, PROMPT8, SamplingParams(**params))
    assert chi_square_pvalue(counts, n * exact)[0] < 1e-6


# --- 4. stops inside an accepted run -------------------------------------------------------------------

@pytest.fixture(scope="module")
def worded(tmp_path_factory):
    """(folder, prompt ids, plain greedy completion): a tiny model over test_detokenize's 25 pieces with
    its Llama-2-style tokenizer, so stop strings and text work; its greedy text varies ("isi capital...")."""
    from test_detokenize import PIECES, PROMPT, sentencepiece_tokenizer

    folder = tmp_path_factory.mktemp("spec-worded")
    make_model(folder, "llama", vocab_size=len(PIECES), seed=9)
    tok = sentencepiece_tokenizer("llama2")
    tok.save_pretrained(folder)
    prompt = tok.encode(PROMPT)
    base = run_engine(engine(folder), [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    return folder, prompt, base[0].outputs[0]


K_STOP = 4


def stop_params(base) -> list[SamplingParams]:
    """Requests that stop inside a run: on each token of the plain completion (its first occurrence), on
    stop strings spanning two or three tokens at every offset, with the stop string kept, at max_tokens
    1..12, and with min_tokens holding a stop token back. All greedy, with logprobs."""
    params = [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[t], logprobs=2, ignore_eos=True)
              for t in sorted(set(base.token_ids))]
    text = base.text
    stops = sorted({text[i:i + n] for i in range(1, 30) for n in (2, 3, 5) if len(text[i:i + n]) == n})
    params += [SamplingParams(temperature=0, max_tokens=40, stop=[s], logprobs=2, ignore_eos=True) for s in stops]
    params += [SamplingParams(temperature=0, max_tokens=40, stop=[s], include_stop_str_in_output=True,
                              ignore_eos=True) for s in stops[::3]]
    params += [SamplingParams(temperature=0, max_tokens=m, logprobs=2, ignore_eos=True) for m in range(1, 13)]
    params += [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[t], min_tokens=6, logprobs=2)
               for t in sorted(set(base.token_ids))]
    params += [SamplingParams(temperature=0, max_tokens=40, logprobs=2)]  # the model's own EOS (id 2, "<s>")
    return params


def completion_fields(c):
    return (c.token_ids, c.text, c.finish_reason, c.stop_reason, len(c.logprobs or ()),
            [sorted(r) for r in c.logprobs or ()])


@pytest.mark.parametrize("method", ["draft=target", "ngram"])
def test_stops_inside_an_accepted_run_match_plain_decoding(worded, method):
    folder, prompt, base = worded
    spec = draft_model(folder, K_STOP) if method == "draft=target" else ngram(K_STOP, 1, 2)
    params = stop_params(base)
    plain = run_engine(engine(folder), [prompt] * len(params), params)
    e = engine(folder, spec)
    outs = run_spec(e, [prompt] * len(params), params)
    for p, a, b in zip(params, plain, outs):
        a, b = a.outputs[0], b.outputs[0]
        assert completion_fields(a) == completion_fields(b), p
        for x, y in zip(a.logprobs or (), b.logprobs or ()):
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-9 for t in x)
    lengths = {len(o.outputs[0].token_ids) for o in plain}
    assert {(n - 1) % (K_STOP + 1) for n in lengths if n > 1} == set(range(K_STOP + 1))  # every offset in a run
    assert {o.outputs[0].finish_reason for o in plain} == {"stop", "length"}
    assert any(o.outputs[0].stop_reason is None and o.outputs[0].finish_reason == "stop" for o in plain)  # EOS
    stats = e.spec_decoding_stats
    assert stats.num_accepted_tokens > 0


@pytest.mark.parametrize("kind", ["stop_token_ids", "max_tokens", "eos", "stop"])
def test_a_stop_inside_an_accepted_run_counts_no_accepted_token_after_it(worded, kind):
    """With draft = target every draft is accepted, so the counters are known from each output's
    length (`expected_all_accepted`): a token after the stop must not be counted, whatever stopped it.
    One request per engine, so each count is the request's own."""
    folder, prompt, base = worded
    params = [p for p in stop_params(base) if {"stop_token_ids": bool(p.stop_token_ids) and not p.min_tokens,
                                                 "max_tokens": p.max_tokens < 40,
                                                 "eos": not p.ignore_eos and not p.stop_token_ids,
                                                 "stop": bool(p.stop) and p.logprobs}[kind]]
    assert params
    wrong = []
    for p in params:
        e = engine(folder, draft_model(folder, K_STOP))
        c = run_spec(e, [prompt], p)[0].outputs[0]
        steps, accepted = expected_all_accepted(len(c.token_ids), K_STOP)
        stats = e.spec_decoding_stats
        got = (stats.num_drafts, stats.num_accepted_tokens, sum(stats.num_accepted_tokens_per_pos))
        if got != (steps, accepted, accepted):
            wrong.append((p.stop or p.stop_token_ids or p.max_tokens, len(c.token_ids), got, (steps, accepted)))
    assert not wrong, f"(stop, tokens emitted, counted (drafts, accepted, per position), expected): {wrong}"


def test_a_sequence_reaching_max_model_len_inside_a_run_stops_there(target, greedy_case):
    folder, _ = target
    prompts = [p[:20] for p in greedy_case[0]]
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    plain = run_engine(engine(folder, max_model_len=37), prompts, params)
    for spec in (ngram(5), draft_model(folder, 5)):
        e = engine(folder, spec, max_model_len=37)
        outs = run_spec(e, prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
        assert all(len(p) + len(o.outputs[0].token_ids) == 37 for p, o in zip(prompts, outs))


# --- 5. bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, words", [
    ({"method": "ngram", "num_speculative_tokens": 0}, ["num_speculative_tokens", "0"]),
    ({"method": "ngram", "num_speculative_tokens": -2}, ["num_speculative_tokens", "-2"]),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, ["num_speculative_tokens", "2.5"]),
    ({"method": "ngram"}, ["num_speculative_tokens"]),
    ({"method": "eagle", "num_speculative_tokens": 2}, ["method", "eagle", "ngram", "draft_model"]),
    ({"num_speculative_tokens": 2}, ["method", "None"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     ["prompt_lookup_min=4", "prompt_lookup_max=2"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, ["prompt_lookup_min", "0"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0, "prompt_lookup_max": 3},
     ["prompt_lookup_min", "0"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 0},
     ["prompt_lookup", "0"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, ["draft_tensor_parallel_size"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, ["ngram", "model", "'x'"]),
    ({"method": "draft_model", "num_speculative_tokens": 2}, ["draft_model", "model"]),
    ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, ["prompt_lookup"]),
    ("ngram", ["dict", "'ngram'"]),
])
def test_bad_speculative_config_is_refused_naming_the_values(target, config, words):
    with pytest.raises(ValueError) as err:
        SpeculativeConfig.from_dict(config)
    assert all(w in str(err.value) for w in words), str(err.value)
    with pytest.raises(ValueError) as err:  # LLM refuses it too, before loading anything
        make_llm(target[0], config)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_a_bad_bound_given_alone_is_named_by_its_own_key():
    """Only prompt_lookup_max=0 given: the message must name prompt_lookup_max, the key the user set
    (`from_dict` copies it into prompt_lookup_min first and then blames prompt_lookup_min)."""
    for key in ("prompt_lookup_max", "prompt_lookup_min"):
        with pytest.raises(ValueError) as err:
            SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, key: 0})
        assert f"{key} must be" in str(err.value) or f"{key}=0" in str(err.value), str(err.value)


def test_speculative_config_defaults():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max, c.model) == \
        ("ngram", 3, 5, 5, None)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_max": 7})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (7, 7)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1,
                                     "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 4)
    c = SpeculativeConfig.from_dict({"model": "/some/where", "num_speculative_tokens": 4})
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/some/where", 4)
    args = SpecDecodeEngineArgs(model="m", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    args.check()
    assert isinstance(args.speculative_config, SpeculativeConfig)
    args = SpecDecodeEngineArgs(model="m")
    args.check()
    assert args.speculative_config is None


@pytest.mark.parametrize("name", ["tensor_parallel_size", "data_parallel_size"])
def test_drafts_with_parallel_ranks_are_refused(target, name):
    with pytest.raises(ValueError, match=f"{name}=2"):
        make_llm(target[0], ngram(2), **{name: 2})


def test_pieces_that_cannot_verify_drafts_are_refused(target):
    from minivllm.core.sched.scheduler import Scheduler
    from minivllm.sample.sampler import Sampler

    from minivllm.worker.model_runner import ModelRunner

    with pytest.raises(ValueError, match="scheduler_cls"):
        make_llm(target[0], ngram(2), scheduler_cls=Scheduler)
    with pytest.raises(ValueError, match="sampler_cls"):
        make_llm(target[0], ngram(2), sampler_cls=Sampler)
    with pytest.raises(ValueError, match="model_runner_cls"):  # the runner named, not the scheduler it implies
        make_llm(target[0], ngram(2), model_runner_cls=ModelRunner)


@pytest.fixture(scope="module")
def misfit_drafts(tmp_path_factory):
    """Drafts for the target: another vocabulary size, a shorter context, and a target with a tokenizer
    with a draft without one (accepted) and a draft with another token -> id map (refused)."""
    from test_detokenize import PIECES, sentencepiece_tokenizer

    made = {}
    made["vocab"] = tmp_path_factory.mktemp("draft-vocab64")
    make_model(made["vocab"], "llama", vocab_size=64)
    made["short"] = tmp_path_factory.mktemp("draft-short")
    make_model(made["short"], "llama", max_position_embeddings=64)
    made["tok_target"] = tmp_path_factory.mktemp("target-tok")
    make_model(made["tok_target"], "llama", vocab_size=len(PIECES))
    sentencepiece_tokenizer("llama2").save_pretrained(made["tok_target"])
    made["no_tok"] = tmp_path_factory.mktemp("draft-no-tok")
    make_model(made["no_tok"], "llama", vocab_size=len(PIECES), seed=2)
    made["other_tok"] = tmp_path_factory.mktemp("draft-other-tok")
    make_model(made["other_tok"], "llama", vocab_size=len(PIECES), seed=3)
    other = sentencepiece_tokenizer("llama2")
    vocab = other.backend_tokenizer.to_str()
    other = type(other)(tokenizer_object=type(other.backend_tokenizer).from_str(
        vocab.replace('"▁paris"', '"▁lyon"')), bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    other.save_pretrained(made["other_tok"])
    return made


def test_misfit_draft_models_are_refused_naming_both_values(target, misfit_drafts):
    folder, _ = target
    with pytest.raises(ValueError) as err:
        make_llm(folder, draft_model(misfit_drafts["vocab"], 2))
    assert "vocab_size" in str(err.value) and "64" in str(err.value) and "128" in str(err.value)
    with pytest.raises(ValueError) as err:
        make_llm(folder, draft_model(misfit_drafts["short"], 2), max_model_len=128)
    assert "max_position_embeddings=64" in str(err.value) and "max_model_len=128" in str(err.value)
    make_llm(folder, draft_model(misfit_drafts["short"], 2), max_model_len=64)  # short enough: accepted
    tok_target = misfit_drafts["tok_target"]
    with pytest.raises(ValueError) as err:
        make_llm(tok_target, draft_model(misfit_drafts["other_tok"], 2))
    assert str(misfit_drafts["other_tok"]) in str(err.value) and str(tok_target) in str(err.value), str(err.value)
    # a folder without tokenizer files on either side is taken to use the other's (vLLM never loads the
    # draft's tokenizer): only two token -> id maps that differ are refused
    make_llm(tok_target, draft_model(misfit_drafts["no_tok"], 2))
    make_llm(misfit_drafts["no_tok"], draft_model(tok_target, 2))


def test_after_a_refused_request_the_engine_still_serves(target, greedy_case):
    folder, _ = target
    prompts, max_tokens, refs = greedy_case
    llm = make_llm(folder, draft_model(folder, 3))
    e = llm.llm_engine
    good = e.add_request(None, prompts[0], greedy(max_tokens[:1])[0])
    for bad, params in (([], greedy([3])[0]), ([1, 128], greedy([3])[0]), ([1] * MAX_MODEL_LEN, greedy([3])[0]),
                        ([1, 2], SamplingParams(temperature=0, max_tokens=3, stop=["x"]))):  # no tokenizer: no stop
        with pytest.raises(ValueError):
            e.add_request(None, bad, params)
    done = {}
    while e.has_unfinished_requests():
        done.update((o.request_id, o) for o in e.step() if o.finished)
    assert done[good].outputs[0].token_ids == refs[0]
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([prompts[0], []], greedy([3])[0], use_tqdm=False)
    outs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    check_spec_invariants(e)


# --- 6. unit tests ------------------------------------------------------------------------------------

def brute_force_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest suffix n-gram (min_n <= n <= max_n) that occurred earlier (overlaps allowed), at its
    first occurrence: the k tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), max_size=30), min_n=st.integers(1, 4), extra=st.integers(0, 3),
       k=st.integers(0, 6))
def test_ngram_lookup_matches_brute_force(tokens, min_n, extra, k):
    assert ngram_lookup(tokens, min_n, min_n + extra, k) == brute_force_lookup(tokens, min_n, min_n + extra, k)


def test_ngram_lookup_examples_and_the_proposer():
    assert ngram_lookup([1, 2, 3, 9, 1, 2], 1, 3, 2) == [3, 9]  # "1 2" followed by 3, 9
    assert ngram_lookup([1, 2, 3, 9, 2], 2, 3, 2) == []  # "9 2" never occurred; 1-grams not allowed
    assert ngram_lookup([5, 5, 5], 1, 2, 4) == [5]  # overlapping: "5 5" at 0, then one token is left
    assert ngram_lookup([7], 1, 1, 3) == []
    p = NgramProposer(3, 1, 2, max_model_len=10)
    assert p.propose_one([1, 2, 3, 1, 2]) == [3, 1, 2]
    assert p.propose_one([1, 2, 3, 4, 5, 6, 1, 2]) == [3, 4]  # the last draft sits at position 9
    assert p.propose_one([1, 2, 3, 4, 5, 6, 7, 8, 9, 1]) == []
    seq = Sequence([1, 2, 3, 1], block_size=4)
    drafts, probs = p.propose([seq, seq], [[2], None])
    assert drafts == [[3, 1, 2], []] and probs == [None, None]


def test_flat_batch_runs_decodes_first_and_maps_scored_rows_back():
    a, b, c = (Sequence(list(range(n)), block_size=4) for n in (6, 9, 4))
    a.block_table, b.block_table, c.block_table = [7, 3], [1, 2, 5], [4, 6]
    rows = [(b, 2, [20, 21, 22], 0), (c, 3, [30, 31, 32], 3), (a, 5, [10], 1)]  # chunk, verify, decode
    input_ids, positions, md, sample_rows = flat_batch(rows, 4, torch.device("cpu"))
    assert input_ids.tolist() == [10, 20, 21, 22, 30, 31, 32]  # the decode row first
    assert positions.tolist() == [5, 2, 3, 4, 3, 4, 5]
    assert sample_rows.tolist() == [4, 5, 6, 0]  # rows' order: c's three positions, then a's
    assert md.num_decode_tokens == 1
    assert md.decode.context_lens.tolist() == [6] and md.decode.slot_mapping.tolist() == [3 * 4 + 1]
    assert md.prefill.cu_seqlens_q.tolist() == [0, 3, 6] and md.prefill.context_lens.tolist() == [5, 6]
    assert md.prefill.slot_mapping.tolist() == [1 * 4 + 2, 1 * 4 + 3, 2 * 4 + 0, 4 * 4 + 3, 6 * 4 + 0, 6 * 4 + 1]
    assert md.prefill.block_tables.tolist() == [[1, 2, 5], [4, 6, -1]]
    _, _, md, sample_rows = flat_batch([(a, 5, [10], 1)], 4, torch.device("cpu"))
    assert md.prefill is None and sample_rows.tolist() == [0]


def test_verify_row_scores_the_last_token_and_each_draft():
    seq = Sequence(list(range(10)), block_size=4)
    seq.spec_token_ids = []
    seq.num_computed_tokens, seq.num_scheduled_tokens = 0, 6  # a partial prefill: nothing scored
    assert verify_row(seq) == (seq, 0, list(range(6)), 0)
    seq.num_computed_tokens, seq.num_scheduled_tokens = 6, 4  # the prefill's last chunk: its last token
    assert verify_row(seq) == (seq, 6, [6, 7, 8, 9], 1)
    seq.spec_token_ids = [40, 41, 42]
    seq.num_computed_tokens, seq.num_scheduled_tokens = 9, 4  # the newest token and three drafts
    assert verify_row(seq) == (seq, 9, [9, 40, 41, 42], 4)


def test_spec_decoding_stats_arithmetic():
    s = SpecDecodingStats(3)
    assert (s.num_accepted_tokens_per_pos, s.mean_acceptance_length, s.acceptance_rate) == ([0, 0, 0], 1.0, 0.0)
    s.observe_draft(0, 0)  # no drafts: not a draft step
    s.observe_draft(3, 2)
    s.observe_draft(3, 3)
    s.observe_draft(2, 0)
    s.observe_draft(1, 1)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (4, 9, 6)
    assert s.num_accepted_tokens_per_pos == [3, 2, 1]
    assert s.mean_acceptance_length == 1 + 6 / 4 and s.acceptance_rate == 6 / 9
    assert SpecDecodingStats(2, num_accepted_tokens_per_pos=[1, 2]).num_accepted_tokens_per_pos == [1, 2]


def test_greedy_verify_and_deterministic_rejection_cases():
    assert greedy_verify([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted, then the bonus
    assert greedy_verify([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the target's token at the first disagreement
    assert greedy_verify([4], [1, 2]) == [1]
    assert greedy_verify([], [3]) == [3]
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64)
    for u in (0.0, 0.5, 0.999):  # a draft of target probability 0 is always rejected; the residual excludes it
        assert rejection_sample([0], p, q, [u, u])[0] in (1, 2)
        assert rejection_sample([0], p, None, [u, u])[0] in (1, 2)
    assert rejection_sample([1], p, q, [0.999, 0.1]) == [1, 0]  # p >= q: always accepted, then the bonus
    q = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    assert rejection_sample([2], p, q, [0.999, 0.0]) == [2, 0]  # q = 0 at the draft: accepted (p/q infinite)
    assert rejection_sample([1], p, q, [0.6, 0.0]) == [2]  # rejected (0.6 >= 0.5): the residual has only token 2


def test_draft_positions_see_the_drafts_before_each_row():
    seq = Sequence([1, 2, 3], SamplingParams(temperature=0), block_size=4)
    seq.append_token(9)
    rows = draft_positions([seq], [[4, 5]])
    assert [r.completion_token_ids for r in rows] == [[9], [9, 4], [9, 4, 5]]
    assert all(isinstance(r, DraftPosition) and r.seq_id == seq.seq_id and r.prompt_token_ids == [1, 2, 3]
               for r in rows)
    assert [r.num_completion_tokens for r in rows] == [1, 2, 3]


def test_rejection_sampler_returns_a_logprob_row_per_token():
    """`RejectionSampler.logprobs`: one row per returned token, from the model's own log-softmax of the
    row that scored it (the rows of its last token and of each draft)."""
    seq = Sequence([1, 2], SamplingParams(temperature=0, logprobs=1), block_size=4)
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]], dtype=torch.float64)
    sampler = RejectionSampler()
    assert sampler(logits, [seq], [[1, 0]], [None], {}, None) == [[1, 0, 2]]
    rows = sampler.logprobs[seq.seq_id]
    assert len(rows) == 3
    for row, token, logit in zip(rows, [1, 0, 2], logits):
        assert int(row[0][0]) == token and abs(float(row[1][0]) - float(logit.log_softmax(-1)[token])) < 1e-12


def test_the_draft_models_cache_counts_in_the_kv_budget(target):
    """A byte budget holds both caches (the draft's has as many blocks as the target's): together they
    take at most `kv_cache_memory_bytes`, where the target alone would take it all."""
    folder, _ = target
    budget = 4 * 2**20
    plain = make_llm(folder, None, kv_cache_memory_bytes=budget, num_kvcache_blocks=None)
    spec = make_llm(folder, draft_model(folder, 3), kv_cache_memory_bytes=budget, num_kvcache_blocks=None)

    def nbytes(t):
        return t.numel() * t.element_size()

    runner = spec.llm_engine.model_runner
    total = nbytes(runner.kv_cache) + nbytes(runner.proposer.runner.kv_cache)
    assert total <= budget < 2 * total, (total, budget)
    assert spec.llm_engine.block_manager.num_blocks == plain.llm_engine.block_manager.num_blocks // 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_greedy_tokens_equal_plain_decoding_in_float32(target, close_draft, device):
    """In float32 (on a GPU: the CUDA attention backends, graphs for plain decode steps), both proposers'
    greedy tokens equal plain decoding's and transformers'."""
    folder, hf = target
    prompts = [p * 3 for p in random_prompts(6, 4, 12, seed=21)]
    kwargs = dict(device=device, dtype="float32", num_kvcache_blocks=512)
    plain = [o.outputs[0].token_ids for o in make_llm(folder, None, **kwargs).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        use_tqdm=False)]
    hf32 = copy.deepcopy(hf).float()
    assert plain == [hf_greedy(hf32, p, 24) for p in prompts]
    for spec in (ngram(4), draft_model(close_draft, 3)):
        outs = make_llm(folder, spec, **kwargs).generate([{"prompt_token_ids": p} for p in prompts],
                                                          SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                                          use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == plain, spec
