"""Grading tests for chapter 14's extend exercise (`pytest -m ch14_ex3 --impl=exercises`); see test_grading.py.

`AdaptiveNgramProposer` (prompt lookup with a per-request `k_i`, lowered after a rejection and raised after a
full acceptance) is graded by its contract, never by comparison with minivllm's code, in named groups:
* k adapts: driven step by step as the engine drives a proposer, with scripted acceptances (drafts always
  rejected bring `k_i` down to 1 and keep it there, drafts always accepted bring it back up to `k`), then
  random scripts (hypothesis: several requests, partial prefills, drafts trimmed by the budget, random
  acceptances): after every call the drafts are the lookup of at most `k_i` tokens and `current_k` is
  `k_i`; in the engine (`AdaptiveNgramModelRunner`) on a model whose greedy token is always 0, a request
  whose drafts are always rejected ends at `k_i = 1` and one whose drafts start being accepted gets back
  to `k`, with the contract checked at every step;
* greedy is exact: plugged into the engine, the greedy tokens equal plain decoding's and transformers'
  (tiny float64 model, prompts that repeat themselves so that drafts are proposed, accepted and rejected);
* follows p: seeded sampled requests through the engine (a float64 model with 8 tokens, 3 tokens each)
  against the exact distribution of the three tokens, computed from transformers' logits (Pearson's
  chi-square test, p-value from `torch.special.gammaincc`, seeded so that it cannot flake).
The rebuild regions of chapter 14 (the rejection sampler, `ngram_lookup`) are the grader's stand-ins here
(`test_grading_ch14_regions.graded(None)`), so only the proposer is graded. The tests at the end (marked
`ch14` only, not graded) show that plausible wrong answers fail these graders.
"""
from __future__ import annotations

import itertools
import random
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from adapters import load
from engine_helpers import hf_greedy, make_model, one_thread, random_prompts
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence
from test_grading_ch14_regions import _grader_ngram_lookup, chi_square_p_value

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)
ADAPTS, GREEDY, FOLLOWS_P = "k adapts", "greedy is exact", "follows p"
MAX_MODEL_LEN = 128
ALPHA = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _rebuild_regions_are_the_graders():
    """The rejection sampler and `ngram_lookup` (stubs in a student edition of chapter 14) are the grader's
    stand-ins here: the proposer is graded alone."""
    from test_grading_ch14_regions import graded

    with graded(None):
        yield


@pytest.fixture(scope="module")
def ch14(impl_name):
    return load("ch14_speculative_decoding", impl_name)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


@contextmanager
def your_code(group: str, what: str):
    """An error of the code under grading (not a stub's NotImplementedError, not a check's AssertionError)
    re-raised as an AssertionError naming the exercise, the group and what was running."""
    try:
        yield
    except (NotImplementedError, AssertionError):
        raise
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"ch14_ex3 ({group}): {what} raised {type(e).__name__}: {e} (the traceback shows "
                             "where)") from e


def _next_k(k_i: int, k: int, verified: int, new) -> int:
    """The contract's update of `k_i` after a step that verified `verified` drafts and gave `new` tokens."""
    if new is None or verified == 0:
        return k_i
    return min(k, k_i + 1) if len(new) == verified + 1 else max(1, k_i - 1)


# --- k adapts: the proposer driven as the engine drives it ------------------------------------------
class _Driver:
    """Calls `proposer.propose` as `SpecDecodeModelRunner.run` does (each sequence's verified drafts in
    `seq.spec_token_ids`, its new tokens, or None for a partial prefill), then appends the new tokens and
    keeps the drafts as the scheduler does; checks each call against the contract."""

    def __init__(self, proposer, k: int, min_n: int, max_n: int, max_len: int, group: str = ADAPTS):
        self.proposer, self.k, self.min_n, self.max_n, self.max_len = proposer, k, min_n, max_n, max_len
        self.group, self.k_i, self.steps = group, {}, 0

    def step(self, seqs: list[Sequence], new_token_ids: list, verified: list[list[int]] | None = None) -> list:
        """One call; `verified` (default: each sequence's drafts) are the drafts the step verified."""
        self.steps += 1
        for seq, v in zip(seqs, verified or [s.spec_token_ids for s in seqs]):
            seq.spec_token_ids = list(v)
        at = f"ch14_ex3 ({self.group}): call {self.steps}"
        with your_code(self.group, f"propose() at call {self.steps}"):
            out = self.proposer.propose(seqs, [None if n is None else list(n) for n in new_token_ids], {}, None)
        _expect(isinstance(out, tuple) and len(out) == 2 and len(out[0]) == len(seqs) and list(out[1]) ==
                [None] * len(seqs), f"{at}: propose must return (a list of drafts per sequence, [None] per sequence), "
                f"got {out!r}")
        for seq, new, drafts in zip(seqs, new_token_ids, out[0]):
            before = self.k_i.get(seq.seq_id, self.k)
            self.k_i[seq.seq_id] = k_i = _next_k(before, self.k, len(seq.spec_token_ids), new)
            what = (f"{at}: sequence {seq.seq_id} ({seq.num_tokens} tokens, new tokens {new}, verified drafts "
                    f"{seq.spec_token_ids}; k_i was {before})")
            got_k = self.proposer.current_k(seq.seq_id)
            _expect(got_k == k_i, f"{what}: current_k is {got_k}, expected {k_i} (k={self.k}: -1 after a rejected "
                    "draft, +1 after all were accepted, unchanged without drafts; within [1, k])")
            if new is None:
                want = []
            else:
                tokens = seq.token_ids + list(new)
                want = _grader_ngram_lookup(tokens, self.min_n, self.max_n, min(k_i, self.max_len - len(tokens)))
            _expect(isinstance(drafts, list) and list(drafts) == want, f"{what}: drafts {drafts}, expected {want} "
                    f"(prompt lookup of at most k_i={k_i} tokens on the tokens with the new ones, none past "
                    f"max_model_len={self.max_len}; none for a partial prefill)")
        for seq, new, drafts in zip(seqs, new_token_ids, out[0]):
            for t in new or []:
                seq.append_token(t)
            seq.spec_token_ids = list(drafts) if new is not None else []
        return out[0]


def _seq(tokens: list[int]) -> Sequence:
    seq = Sequence(list(tokens), SamplingParams(max_tokens=1000))
    seq.spec_token_ids = []
    return seq


CYCLE = [1, 2, 3, 4, 5]


def _other(token: int) -> int:
    """A token of CYCLE that is not `token` (so that lookups keep finding drafts)."""
    return CYCLE[(CYCLE.index(token) + 2) % len(CYCLE)] if token in CYCLE else CYCLE[0]


@pytest.mark.ch14
@pytest.mark.ch14_ex3
@pytest.mark.parametrize("k", [1, 4])
def test_ch14_ex3_k_adapts_rejected_down_to_1_accepted_back_to_k(ch14, k):
    """A sequence that repeats itself, so that a lookup always finds k tokens: every draft rejected for 6
    steps (k_i goes k, k - 1, ..., 1 and stays at 1), then every draft accepted for 6 steps (back up to k)."""
    proposer = ch14.AdaptiveNgramProposer(k, 1, 3, MAX_MODEL_LEN)
    _expect(proposer.current_k(12345) == k, f"ch14_ex3 ({ADAPTS}): current_k of a request not seen yet is "
            f"{proposer.current_k(12345)}, expected k={k}")
    drive, seq = _Driver(proposer, k, 1, 3, MAX_MODEL_LEN), _seq(CYCLE * 4)
    drafts = drive.step([seq], [[1]])[0]  # the step that finished the prompt
    seen = []
    for _ in range(6):
        drafts = drive.step([seq], [[_other(drafts[0])]])[0]
        seen.append(proposer.current_k(seq.seq_id))
    _expect(seen[-1] == 1 and len(drafts) == 1, f"ch14_ex3 ({ADAPTS}): drafts always rejected: k_i per step {seen}, "
            f"last drafts {drafts}; expected to end at 1")
    for _ in range(6):
        drafts = drive.step([seq], [drafts + [_other(drafts[-1])]])[0]
        seen.append(proposer.current_k(seq.seq_id))
    _expect(seen[-1] == k and len(drafts) == k, f"ch14_ex3 ({ADAPTS}): drafts always accepted after k_i fell to 1: "
            f"k_i per step {seen}, last drafts {drafts}; expected back at k={k}")


@st.composite
def _scripts(draw):
    """(k, min_n, max_n, max_len, prompts, steps): each step, per sequence, None (a partial prefill) or
    (how many drafts the budget let through, how many of those were accepted, the target's token)."""
    k, min_n = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    max_n = min_n + draw(st.integers(0, 2))
    prompts = draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=4))
    max_len = max(map(len, prompts)) + draw(st.integers(6, 40))
    steps = draw(st.lists(st.lists(st.one_of(st.none(), st.tuples(st.integers(0, 5), st.integers(0, 5),
                                                                     st.integers(0, 3))),
                                   min_size=len(prompts), max_size=len(prompts)), min_size=1, max_size=14))
    return k, min_n, max_n, max_len, prompts, steps


@pytest.mark.ch14
@pytest.mark.ch14_ex3
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], report_multiple_bugs=False)
# fixed cases first (the draws depend on where the test is called from): k=2, two one-token prompts; a draft
# rejected, then one trimmed away by the budget (nothing verified: k_i unchanged)
@example(script=(2, 1, 1, 7, [[0], [0]], [[(0, 0, 0), None], [(1, 0, 0), None]]))
@example(script=(2, 1, 1, 7, [[0], [0]], [[(0, 0, 0), None], [(0, 0, 0), None]]))
@given(script=_scripts())
def test_ch14_ex3_k_adapts_on_random_scripts(ch14, script):
    """Several requests in one call, partial prefills (no new tokens), drafts trimmed to the budget before
    they are verified, any number accepted: after every call, each request's drafts and `current_k`."""
    k, min_n, max_n, max_len, prompts, steps = script
    proposer = ch14.AdaptiveNgramProposer(k, min_n, max_n, max_len)
    drive, seqs = _Driver(proposer, k, min_n, max_n, max_len), [_seq(p) for p in prompts]
    for step in steps:
        live = [(s, a) for s, a in zip(seqs, step) if s.num_tokens + 1 + len(s.spec_token_ids) <= max_len]
        if not live:
            break
        new, verified = [], []
        for seq, action in live:
            if action is None:
                new.append(None)
                verified.append([])
                continue
            through, accepted, token = action
            drafts = seq.spec_token_ids[:through]  # what the budget let through
            accepted = min(accepted, len(drafts))
            rejected_token = token if accepted == len(drafts) or token != drafts[accepted] else (token + 1) % 4
            new.append(drafts[:accepted] + [rejected_token])
            verified.append(drafts)
        drive.step([s for s, _ in live], new, verified)


# --- the engine ---------------------------------------------------------------------------------
def _engine(ch14, folder, k: int, min_n: int, max_n: int, runner=None, group: str = GREEDY, **kwargs):
    """`LLM` with prompt lookup and the adaptive proposer (`runner`: the model runner class, default the
    exercise's `AdaptiveNgramModelRunner`)."""
    kwargs.setdefault("num_kvcache_blocks", 4 * MAX_MODEL_LEN)
    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    with your_code(group, "building the engine with AdaptiveNgramModelRunner"):
        engine = LLM(str(folder), dtype="float64", device="cpu", block_size=4, model_runner_cls=runner or
                     ch14.AdaptiveNgramModelRunner, speculative_config={
                         "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": min_n,
                         "prompt_lookup_max": max_n}, **kwargs).llm_engine
    _expect(isinstance(engine.model_runner.proposer, ch14.AdaptiveNgramProposer),
            f"ch14_ex3 ({group}): the engine's proposer is {type(engine.model_runner.proposer).__name__}, expected "
            "an AdaptiveNgramProposer")
    return engine


def _run(engine, prompts, params, group: str, driver: _Driver | None = None, trace: dict | None = None) -> list:
    """Every prompt through `engine`, outputs in order. With `driver`: after each step, each request still
    running is checked against the contract (its new tokens, the drafts it had, the drafts it has now);
    `trace`: request id -> `current_k` after each of its steps."""
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    done, proposer = {}, engine.model_runner.proposer
    for step in range(1, 4 * sum(sp.max_tokens for sp in params) + 10):
        if not engine.has_unfinished_requests():
            break
        before = {rid: (list(s.token_ids), list(getattr(s, "spec_token_ids", []))) for rid, s in engine.requests.items()}
        seqs = dict(engine.requests)
        with your_code(group, f"the engine's step {step}"):
            outs = engine.step()
        done.update((o.request_id, o) for o in outs if o.finished)
        for rid, seq in seqs.items():
            if rid not in engine.requests or len(seq.token_ids) == len(before[rid][0]):
                continue  # finished (its drafts were dropped), or still waiting
            tokens, drafts = before[rid]
            new = seq.token_ids[len(tokens):]
            if trace is not None:
                trace.setdefault(rid, []).append(proposer.current_k(seq.seq_id))
            if driver is not None:
                k_i = driver.k_i[seq.seq_id] = _next_k(driver.k_i.get(seq.seq_id, driver.k), driver.k, len(drafts), new)
                want = _grader_ngram_lookup(seq.token_ids, driver.min_n, driver.max_n,
                                            min(k_i, proposer.max_model_len - seq.num_tokens))
                at = (f"ch14_ex3 ({group}): request {rid} at step {step} (verified drafts {drafts}, new tokens {new})")
                _expect(proposer.current_k(seq.seq_id) == k_i, f"{at}: current_k is "
                        f"{proposer.current_k(seq.seq_id)}, expected {k_i}")
                _expect(seq.spec_token_ids == want, f"{at}: drafts {seq.spec_token_ids}, expected {want} (k_i={k_i})")
    _expect(not engine.has_unfinished_requests(), f"ch14_ex3 ({group}): the engine did not finish")
    _expect(not getattr(proposer, "k_per_seq", {}), f"ch14_ex3 ({group}): the idle engine's proposer still holds "
            f"k_per_seq={proposer.k_per_seq} (`drop` forgets a request that left)")
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def always_zero(tmp_path_factory):
    """A tiny model whose final norm is zero: every logit is 0, so its greedy token is always 0."""
    folder = tmp_path_factory.mktemp("ch14-always-zero")
    model = make_model(folder, "llama", seed=5)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.save_pretrained(folder)
    return folder, model


@pytest.mark.ch14
@pytest.mark.ch14_ex3
def test_ch14_ex3_k_adapts_in_the_engine(ch14, always_zero):
    """Greedy token always 0. Prompt [0, 5, 1, 2, 3, 4], 1-grams: the lookup always drafts what followed the
    first 0 (5, 1, ...): every draft rejected, k_i = 4, 3, 2, 1, 1, ... Prompt [7, 0, 5, 1, 0], 1- and
    2-grams: rejected once (k_i 3), then [0, 0] is found and its drafts are accepted: back to 4."""
    folder, model = always_zero
    cases = [([0, 5, 1, 2, 3, 4], 1, 1, [4, 3, 2, 1, 1, 1]), ([7, 0, 5, 1, 0], 1, 2, [4, 3, 4, 4])]
    for prompt, min_n, max_n, want in cases:
        engine = _engine(ch14, folder, 4, min_n, max_n, group=ADAPTS)
        trace: dict = {}
        driver = _Driver(engine.model_runner.proposer, 4, min_n, max_n, 0)
        out = _run(engine, [prompt], [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)], ADAPTS,
                   driver, trace)[0]
        _expect(out.outputs[0].token_ids == [0] * 14, "ch14_ex3: the grader's model did not give 0s (set-up)")
        got = next(iter(trace.values()))
        _expect(got[:len(want)] == want and got[-1] == want[-1], f"ch14_ex3 ({ADAPTS}): prompt {prompt}, lookup of "
                f"{min_n}- to {max_n}-grams, k=4: current_k after each step {got}, expected {want} and then "
                f"{want[-1]} (drafts {'always rejected' if want[-1] == 1 else 'rejected once, then accepted'})")


PROMPTS_SEED = 61


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """(model folder, prompts that repeat themselves or not, max_tokens, transformers' greedy completions)."""
    folder = tmp_path_factory.mktemp("ch14-extend-llama")
    model = make_model(folder, "llama", seed=3)
    rng = random.Random(PROMPTS_SEED)
    prompts = [p * rng.randint(2, 4) for p in random_prompts(4, 2, 9, seed=PROMPTS_SEED)]
    prompts += random_prompts(3, 1, 30, seed=PROMPTS_SEED + 1, vocab=6)
    max_tokens = [rng.randint(8, 40) for _ in prompts]
    return folder, prompts, max_tokens, [hf_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]


@pytest.mark.ch14
@pytest.mark.ch14_ex3
@pytest.mark.parametrize("k, min_n, max_n", [(4, 1, 3), (2, 2, 2), (6, 1, 5)])
def test_ch14_ex3_greedy_is_exact_in_the_engine(ch14, oracle, k, min_n, max_n):
    folder, prompts, max_tokens, refs = oracle
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    engine = _engine(ch14, folder, k, min_n, max_n)
    driver = _Driver(engine.model_runner.proposer, k, min_n, max_n, 0, GREEDY)
    outs = _run(engine, prompts, params, GREEDY, driver)
    with your_code(GREEDY, "plain decoding"):
        plain = LLM(str(folder), dtype="float64", device="cpu", block_size=4, max_model_len=MAX_MODEL_LEN,
                    num_kvcache_blocks=4 * MAX_MODEL_LEN).generate(prompts, params, use_tqdm=False)
    stats = engine.spec_decoding_stats
    _expect(0 < stats.num_accepted_tokens < stats.num_draft_tokens, f"ch14_ex3: the grader's prompts should give "
            f"drafts both accepted and rejected ({stats}) (set-up)")
    for i, (out, ref, base) in enumerate(zip(outs, refs, plain)):
        got = list(out.outputs[0].token_ids)
        _expect(got == ref == list(base.outputs[0].token_ids), f"ch14_ex3 ({GREEDY}): k={k}, {min_n}- to {max_n}-grams: "
                f"prompt {i} ({len(prompts[i])} tokens): greedy tokens {got}, transformers' {ref}, plain decoding's "
                f"{list(base.outputs[0].token_ids)}")


# --- follows p -----------------------------------------------------------------------------------
SMALL_VOCAB, NUM_REQUESTS, NEW_TOKENS = 8, 6000, 3


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A float64 model with 8 tokens whose next-token distributions are far from uniform (its LM head
    scaled up), a prompt that repeats itself, and the exact joint distribution of the next 3 tokens
    (`[8, 8, 8]`), from transformers' logits."""
    folder = tmp_path_factory.mktemp("ch14-extend-vocab8")
    model = make_model(folder, "llama", seed=8, vocab_size=SMALL_VOCAB)
    with torch.no_grad():
        model.lm_head.weight.mul_(6)
    model.save_pretrained(folder)
    prompt = [1, 6, 5, 1, 6, 5, 1, 6]
    conts = torch.tensor(list(itertools.product(range(SMALL_VOCAB), repeat=NEW_TOKENS - 1)))  # every (t1, t2)
    ids = torch.cat([torch.tensor(prompt).expand(len(conts), -1), conts], dim=1)
    with torch.no_grad():
        logp = model(ids).logits[:, -NEW_TOKENS:].log_softmax(-1)  # [64, 3, 8]
    joint = torch.zeros((SMALL_VOCAB,) * NEW_TOKENS, dtype=torch.float64)
    for row, (a, b) in enumerate(conts.tolist()):
        joint[a, b] = (logp[row, 0, a] + logp[row, 1, b] + logp[row, 2]).exp()
    assert abs(float(joint.sum()) - 1) < 1e-9
    return folder, prompt, joint


@pytest.mark.ch14
@pytest.mark.ch14_ex3
def test_ch14_ex3_follows_p_in_the_engine(ch14, small_vocab):
    """6000 seeded requests of 3 tokens, k=3, 1- to 2-grams: the triples follow the model's distribution."""
    folder, prompt, joint = small_vocab
    engine = _engine(ch14, folder, 3, 1, 2, group=FOLLOWS_P, max_model_len=32, num_kvcache_blocks=8192,
                     max_num_seqs=256)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=NEW_TOKENS, ignore_eos=True)
              for i in range(NUM_REQUESTS)]
    outs = _run(engine, [prompt] * NUM_REQUESTS, params, FOLLOWS_P)
    stats = engine.spec_decoding_stats
    _expect(0 < stats.num_accepted_tokens < stats.num_draft_tokens, f"ch14_ex3 ({FOLLOWS_P}): drafts should be both "
            f"accepted and rejected here ({stats})")
    counts = torch.zeros(SMALL_VOCAB ** NEW_TOKENS, dtype=torch.float64)
    for o in outs:
        t = list(o.outputs[0].token_ids)
        _expect(len(t) == NEW_TOKENS, f"ch14_ex3 ({FOLLOWS_P}): a request of {NEW_TOKENS} tokens gave {t}")
        counts[(t[0] * SMALL_VOCAB + t[1]) * SMALL_VOCAB + t[2]] += 1
    pv = chi_square_p_value(counts, joint.flatten())
    _expect(pv >= ALPHA, f"ch14_ex3 ({FOLLOWS_P}): the engine's sampled triples do not follow the model's "
            f"distribution (chi-square p-value {pv:.2e} over {NUM_REQUESTS} requests, below {ALPHA})")


# --- the graders catch plausible wrong answers (not graded; the wrong answers are written here) ------
def _wrong_proposers(ch14):
    class NeverAdapts(ch14.AdaptiveNgramProposer):  # the chapter's proposer: k drafts whatever happened
        def propose(self, seqs, new_token_ids, generators=None, default_generator=None):
            return ch14.NgramProposer.propose(self, seqs, new_token_ids, generators, default_generator)

    class Inverted(ch14.AdaptiveNgramProposer):  # raises k_i after a rejection, lowers it after an acceptance
        def propose(self, seqs, new_token_ids, generators=None, default_generator=None):
            for seq, new in zip(seqs, new_token_ids):
                if new is not None and seq.spec_token_ids:
                    k_i = self.current_k(seq.seq_id)
                    full = len(new) == len(seq.spec_token_ids) + 1
                    self.k_per_seq[seq.seq_id] = max(1, k_i - 1) if full else min(self.k, k_i + 1)
            return self._drafts(seqs, new_token_ids)

        def _drafts(self, seqs, new_token_ids):
            return [[] if new is None else ch14.ngram_lookup(
                seq.token_ids + new, self.min_n, self.max_n,
                min(self.current_k(seq.seq_id), self.max_model_len - seq.num_tokens - len(new)))
                for seq, new in zip(seqs, new_token_ids)], [None] * len(seqs)

    class OwnDrafts(Inverted):  # judges its own last drafts, not the ones the scheduler let through
        def propose(self, seqs, new_token_ids, generators=None, default_generator=None):
            last = getattr(self, "last", {})
            for seq, new in zip(seqs, new_token_ids):
                if new is not None and last.get(seq.seq_id):
                    k_i = self.current_k(seq.seq_id)
                    full = len(new) == len(last[seq.seq_id]) + 1
                    self.k_per_seq[seq.seq_id] = min(self.k, k_i + 1) if full else max(1, k_i - 1)
            drafts, probs = self._drafts(seqs, new_token_ids)
            self.last = {**last, **{s.seq_id: d for s, d in zip(seqs, drafts)}}
            return drafts, probs

    return {"never adapts": NeverAdapts, "inverted": Inverted, "judges its own drafts": OwnDrafts}


@pytest.mark.ch14
@pytest.mark.parametrize("name", ["never adapts", "inverted", "judges its own drafts"])
def test_ch14_ex3_grader_catches(ch14, always_zero, name):
    wrong = _wrong_proposers(ch14)[name]

    class Wrong:  # the exercise's module with the wrong proposer in place
        AdaptiveNgramProposer = wrong
        NgramProposer = ch14.NgramProposer
        AdaptiveNgramModelRunner = type("WrongRunner", (ch14.AdaptiveNgramModelRunner,), {"proposer_cls": wrong})

    with pytest.raises(AssertionError, match=rf"ch14_ex3 \({ADAPTS}\)"):
        test_ch14_ex3_k_adapts_on_random_scripts(Wrong)
    if name != "judges its own drafts":  # the same as the right answer while nothing is trimmed
        with pytest.raises(AssertionError, match=rf"ch14_ex3 \({ADAPTS}\)"):
            test_ch14_ex3_k_adapts_rejected_down_to_1_accepted_back_to_k(Wrong, 4)
        with pytest.raises(AssertionError, match=rf"ch14_ex3 \({ADAPTS}\)"):
            test_ch14_ex3_k_adapts_in_the_engine(Wrong, always_zero)


@pytest.mark.ch14
def test_ch14_ex3_grader_catches_a_proposer_that_breaks_sampling(ch14, small_vocab):
    """Draft probabilities that are not the drafts' (uniform instead of one-hot) bias the sampled tokens."""
    class UniformQ(ch14.AdaptiveNgramProposer):  # k drafts, said to be drawn from the uniform distribution
        def propose(self, seqs, new_token_ids, generators=None, default_generator=None):
            drafts, _ = ch14.NgramProposer.propose(self, seqs, new_token_ids, generators, default_generator)
            return drafts, [torch.full((len(d), SMALL_VOCAB), 1 / SMALL_VOCAB, dtype=torch.float64) if d else None
                            for d in drafts]

    class Wrong:
        AdaptiveNgramProposer = ch14.AdaptiveNgramProposer
        AdaptiveNgramModelRunner = type("WrongRunner", (ch14.AdaptiveNgramModelRunner,), {"proposer_cls": UniformQ})

    with pytest.raises(AssertionError, match=rf"ch14_ex3 \({FOLLOWS_P}\)"):
        test_ch14_ex3_follows_p_in_the_engine(Wrong, small_vocab)
