"""Grading tests for chapter 14's rebuild exercises (`python -m minivllm.course.grade ch14_ex1`, or `pytest -m ch14_ex1`).

ch14_ex1 (`greedy_verify` and `rejection_sample`, in `minivllm.sample.rejection_sampler`) and ch14_ex2
(`ngram_lookup`, in `minivllm.spec_decode.ngram_proposer`) are graded in the package itself: in a student
edition they are the student's code, exported from the chapter (stubs until filled), and there is no
reference to compare with. Each is graded alone: the grader's own stand-ins for the other
(`_grader_greedy_verify`, `_grader_rejection_sample`, `_grader_ngram_lookup`, written here, differently
from the chapter) take its place (`graded`; `STAND_INS` serves `tests/stand_ins.py` for editions of several
chapters and for chapter 14's extend exercise). The engine tests of ch14_ex1 draft with a draft model, so
they need no prompt lookup at all.

What is checked is the contract, never this chapter's code. ch14_ex1, in named groups (a failure names its
group, so that a student sees which part works):
* greedy is exact: `greedy_verify` on hand-made and random cases (the target's argmax while the drafts
  agree, the target's token at the first disagreement, the bonus token after a full acceptance), and the
  engine's greedy tokens with a draft model (one that agrees sometimes, one that always agrees) equal
  transformers' greedy `generate`;
* follows p: Pearson chi-square tests (p-values from `torch.special.gammaincc`, seeded runs that cannot
  flake, 2 * 10^4 draws each) that the first token follows `p_0` for random `p`, `q` over 16 tokens and for
  one-hot `q` (`draft_probs=None`), and with two drafts that the second token, given the first draft
  accepted, follows `p_1`, and the bonus token, given both accepted, `p_2`;
* uses each uniform once: the output is a function of the arguments (same arguments, same tokens; the
  arguments left unchanged), draft `j` is accepted with probability `min(1, p/q)` over `uniforms[j]`, a
  rejection's replacement follows `max(0, p - q)` normalized over `uniforms[j + 1]`, the bonus token
  follows `p_k` over `uniforms[k]`, and the uniforms after the one that drew are never read; seeded
  sampled requests through the engine come out the same twice.
ch14_ex2: `ngram_lookup` against a brute-force search on random sequences (hypothesis): the longest `n` in
`[min_n, max_n]` first (at most `len - 1`), the earliest start of the suffix n-gram before the suffix's own
start (overlaps allowed), then up to `k` following tokens; [] when no suffix occurred before.
The tests at the end (marked `ch14` only, not graded) show that plausible wrong answers fail these graders.
"""
from __future__ import annotations

import random
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import minivllm.sample.rejection_sampler as rs
import minivllm.spec_decode.ngram_proposer as ngram
from engine_helpers import hf_greedy, make_model, one_thread, random_prompts
from minivllm.course.grade import EXERCISES as GRADED
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)

GREEDY, FOLLOWS_P, UNIFORMS = (name for name, _ in GRADED["ch14_ex1"].groups)
VOCAB = 16  # the unit tests' vocabulary
NUM_DRAWS = 20_000  # per chi-square test: a wrong answer's p-value is below 1e-20 at this size
ALPHA = 1e-4  # a p-value below it fails (the runs are seeded: a right answer's values are fixed, far above)
GRID = 2000  # uniforms (i + 0.5) / GRID: a draw's frequencies over the grid are its distribution
GRID_TOL = 0.01  # ... within this much per token (an inverse transform is within 1 / GRID)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


@contextmanager
def your_code(ex: str, what: str):
    """An error of the code under grading (not a stub's NotImplementedError, not a check's
    AssertionError) re-raised as an AssertionError naming `ex` and what was running."""
    try:
        yield
    except (NotImplementedError, AssertionError):
        raise
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{ex}: {what} raised {type(e).__name__}: {e} (the traceback shows where)") from e


# --- the grader's stand-ins ----------------------------------------------------------------------
def _grader_greedy_verify(draft_token_ids, target_argmax):
    """The argmaxes up to and including the first one a draft disagrees with (or the bonus)."""
    agree = 0
    while agree < len(draft_token_ids) and int(draft_token_ids[agree]) == int(target_argmax[agree]):
        agree += 1
    return [int(t) for t in target_argmax[:agree + 1]]


def _grader_inverse_cdf(weights, u: float) -> int:
    """The first token, in vocabulary order, whose running total of `weights` (>= 0) exceeds `u` times the total."""
    w = [float(x) for x in weights]
    goal, acc, last = u * sum(w), 0.0, max(i for i, x in enumerate(w) if x > 0)
    for i, x in enumerate(w):
        acc += x
        if x > 0 and acc > goal:
            return i
    return last


def _grader_rejection_sample(draft_token_ids, target_probs, draft_probs, uniforms):
    """Leviathan et al.'s Algorithm 1, position by position, in Python floats."""
    p = target_probs.double().cpu()
    for j, d in enumerate(draft_token_ids):
        q = torch.zeros_like(p[j]) if draft_probs is None else draft_probs[j].double().cpu()
        if draft_probs is None:
            q[d] = 1.0
        if uniforms[j] * float(q[d]) < float(p[j, d]):
            continue
        residual = (p[j] - q).clamp(min=0)
        return [int(x) for x in draft_token_ids[:j]] + [
            _grader_inverse_cdf(residual if float(residual.sum()) > 0 else p[j], uniforms[j + 1])]
    k = len(draft_token_ids)
    return [int(x) for x in draft_token_ids] + [_grader_inverse_cdf(p[k], uniforms[k])]


def _grader_ngram_lookup(token_ids, min_n, max_n, k):
    """Brute force: every n from the longest, every start from the first."""
    tokens = [int(t) for t in token_ids]
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + max(k, 0)]
    return []


# exercise -> [(owner, attribute, stand-in)] (the format tests/stand_ins.py reads)
STAND_INS = {"ch14_ex1": [(rs, "greedy_verify", _grader_greedy_verify),
                          (rs, "rejection_sample", _grader_rejection_sample)],
             "ch14_ex2": [(ngram, "ngram_lookup", _grader_ngram_lookup)]}


@contextmanager
def graded(ex: str | None):
    """The package's (the student's) code for `ex`, the grader's stand-ins for chapter 14's other
    exercise (None: for both), also where a module imported the function by name."""
    from stand_ins import stand_ins_for

    with stand_ins_for([other for other in STAND_INS if other != ex]):
        yield


# --- ch14_ex1, greedy is exact -------------------------------------------------------------------
def _greedy_rule(drafts, argmax):
    """The definition, written as the chapter states it."""
    out = []
    for j, d in enumerate(drafts):
        out.append(argmax[j])
        if argmax[j] != d:
            return out
    return out + [argmax[len(drafts)]]


GREEDY_CASES = [  # (drafts, target argmax, expected), each with what it shows
    ([], [5], [5]),  # no drafts: the target's own token
    ([3], [3, 8], [3, 8]),  # the draft accepted, then the bonus
    ([3], [4, 8], [4]),  # rejected: the target's token instead
    ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]),  # all accepted: k + 1 tokens
    ([1, 2, 3], [1, 9, 3, 4], [1, 9]),  # the first disagreement ends it, the later agreement counts for nothing
    ([1, 2, 3], [7, 2, 3, 4], [7]),
    ([0, 0, 0, 0], [0, 0, 0, 1, 1], [0, 0, 0, 1]),
]


def _check_greedy(drafts, argmax, what: str) -> None:
    want = _greedy_rule(drafts, argmax)
    with your_code(f"ch14_ex1 ({GREEDY})", f"greedy_verify({drafts}, {argmax})"):
        got = rs.greedy_verify(list(drafts), list(argmax))
    _expect(isinstance(got, list) and all(isinstance(t, int) for t in got),
            f"ch14_ex1 ({GREEDY}): greedy_verify must return a list of ints, got {got!r}")
    _expect(got == want, f"ch14_ex1 ({GREEDY}): greedy_verify(drafts={drafts}, target_argmax={argmax}) returned "
            f"{got}, expected {want} ({what}: the target's argmax while the drafts agree, its own token at the "
            "first disagreement, the bonus token after the last draft)")


@pytest.mark.ch14
@pytest.mark.ch14_ex1
@pytest.mark.group(GREEDY)
def test_ch14_ex1_greedy_is_exact_by_example():
    with graded("ch14_ex1"):
        for drafts, argmax, want in GREEDY_CASES:
            assert _greedy_rule(drafts, argmax) == want  # the grader's own rule, as stated
            _check_greedy(drafts, argmax, "a hand-made case")


@st.composite
def _greedy_cases(draw):
    """(drafts, target_argmax): k drafts, each the target's argmax at its position or a random token."""
    k = draw(st.integers(0, 7))
    argmax = draw(st.lists(st.integers(0, 2), min_size=k + 1, max_size=k + 1))
    agree = draw(st.lists(st.booleans(), min_size=k, max_size=k))
    return [a if ok else draw(st.integers(0, 2)) for a, ok in zip(argmax, agree)], argmax


@pytest.mark.ch14
@pytest.mark.ch14_ex1
@settings(max_examples=300, deadline=None, report_multiple_bugs=False)
# fixed cases first (the draws depend on where the test is called from): a rejection at the second draft, a
# full acceptance (the bonus token)
@pytest.mark.group(GREEDY)
@example(case=([0, 1], [0, 2, 1]))
@example(case=([0], [0, 1]))
@given(case=_greedy_cases())
def test_ch14_ex1_greedy_is_exact_on_random_cases(case):
    drafts, argmax = case
    with graded("ch14_ex1"):
        _check_greedy(drafts, argmax, "a random case")


MAX_MODEL_LEN = 128


def _noisy_copy(model, folder, scale: float, seed: int):
    """A draft model: `model` with Gaussian noise (`scale` times each weight's std) on every weight, saved in `folder`."""
    import copy

    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale * float(p.std() if p.numel() > 1 else 0))
    draft.save_pretrained(folder)
    return draft


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """(target folder, {draft name: folder}, prompts, max_tokens, transformers' greedy completions)."""
    root = tmp_path_factory.mktemp("ch14-grading")
    model = make_model(root / "target", "llama", seed=14)
    drafts = {"a noisy copy (accepts some)": root / "noisy", "the target itself (accepts all)": root / "same"}
    _noisy_copy(model, drafts["a noisy copy (accepts some)"], 0.25, seed=3)
    model.save_pretrained(drafts["the target itself (accepts all)"])
    prompts = random_prompts(6, 1, 40, seed=41) + [[7, 8, 9] * 6]
    rng = random.Random(4)
    max_tokens = [rng.randint(3, 24) for _ in prompts]
    return root / "target", drafts, prompts, max_tokens, [hf_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]


def _spec_engine(ex: str, target, draft, k: int, **kwargs):
    kwargs.setdefault("num_kvcache_blocks", 4 * MAX_MODEL_LEN)
    with your_code(ex, "building the engine"):
        return LLM(str(target), dtype="float64", device="cpu", block_size=4, max_model_len=MAX_MODEL_LEN,
                   speculative_config={"model": str(draft), "num_speculative_tokens": k}, **kwargs).llm_engine


def _run(ex: str, group: str, engine, prompts, params) -> list:
    """Every prompt through `engine`, outputs in order. Each step gives every running request at least
    one token, so a run that takes more steps than tokens asked for is stuck (a verification that
    returned no token)."""
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    done, steps = {}, 2 * sum(sp.max_tokens for sp in params) + 10
    with your_code(f"{ex} ({group})", "the engine's steps"):
        for _ in range(steps):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    _expect(not engine.has_unfinished_requests(), f"{ex} ({group}): the engine did not finish in {steps} steps "
            f"for {sum(sp.max_tokens for sp in params)} tokens: a verification must give at least one token")
    bm = engine.block_manager
    _expect(bm.num_free_blocks == bm.num_blocks, f"{ex} ({group}): the idle engine still holds KV-cache blocks")
    return [done[i] for i in ids]


@pytest.mark.ch14
@pytest.mark.ch14_ex1
@pytest.mark.parametrize("draft, k", [("a noisy copy (accepts some)", 3), ("the target itself (accepts all)", 2),
                                      ("a noisy copy (accepts some)", 1)])
@pytest.mark.group(GREEDY)
def test_ch14_ex1_greedy_is_exact_in_the_engine(oracle, draft, k):
    target, drafts, prompts, max_tokens, refs = oracle
    with graded("ch14_ex1"):
        engine = _spec_engine(f"ch14_ex1 ({GREEDY})", target, drafts[draft], k)
        outs = _run("ch14_ex1", GREEDY, engine, prompts,
                    [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens])
    stats = engine.spec_decoding_stats
    _expect(stats.num_draft_tokens > 0, "ch14_ex1: no draft was verified (the grader's set-up is wrong)")
    for i, (out, ref) in enumerate(zip(outs, refs)):
        got = list(out.outputs[0].token_ids)
        _expect(got == ref, f"ch14_ex1 ({GREEDY}): with drafts from {draft}, k={k}: prompt {i} "
                f"({len(prompts[i])} tokens): greedy tokens {got}, transformers' {ref} ({stats.num_accepted_tokens} "
                f"of {stats.num_draft_tokens} drafts accepted)")


# --- ch14_ex1, follows p -------------------------------------------------------------------------
def chi_square_p_value(counts, probs) -> float:
    """Pearson's test of `counts [n]` against `probs [n]` (summing to 1): categories expected fewer than
    5 times are pooled; a count where the probability is 0 gives 0. The p-value is the chi-square
    distribution's upper tail, `gammaincc(dof / 2, stat / 2)`."""
    counts = torch.as_tensor(counts, dtype=torch.float64)
    probs = torch.as_tensor(probs, dtype=torch.float64)
    if bool(((probs == 0) & (counts > 0)).any()):
        return 0.0
    expected = probs * counts.sum()
    small = (expected < 5) & (probs > 0)
    keep = (expected >= 5)
    obs, exp = counts[keep], expected[keep]
    if small.any():
        obs, exp = torch.cat([obs, counts[small].sum()[None]]), torch.cat([exp, expected[small].sum()[None]])
    if len(obs) < 2:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64), stat / 2))


def _distributions(seed: int, rows: int, vocab: int = VOCAB, scale: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale, dim=-1)


def _sample_runs(k: int, one_hot: bool, seed: int, num: int = NUM_DRAWS, filtered: bool = False):
    """`num` calls of the student's `rejection_sample` on one fixed (p, q): drafts drawn from q (one-hot
    q: p's likeliest token 7 times in 10, else any token; the drafts then count as certain), uniforms
    from a seeded generator; `filtered`: p is 0 outside each row's 8 likeliest tokens (as after top-k),
    q is not. Returns (p, the outputs)."""
    p = _distributions(seed, k + 1)
    if filtered:
        p[p < p.topk(VOCAB // 2, dim=-1).values[:, -1:]] = 0.0
        p /= p.sum(dim=-1, keepdim=True)
    q = _distributions(seed + 1000, max(k, 1))[:k]
    rng = np.random.default_rng(seed)
    if one_hot:
        best = p.argmax(dim=-1).tolist()
        drafts = np.stack([np.where(rng.random(num) < 0.7, best[j], rng.integers(0, VOCAB, num)) for j in range(k)],
                          axis=1)
    else:
        drafts = np.stack([rng.choice(VOCAB, size=num, p=q[j].numpy() / q[j].sum().item()) for j in range(k)], axis=1)
    uniforms = rng.random((num, k + 1))
    out = []
    with your_code(f"ch14_ex1 ({FOLLOWS_P})", "rejection_sample"):
        for i in range(num):
            out.append(rs.rejection_sample([int(d) for d in drafts[i]], p, None if one_hot else q,
                                           uniforms[i].tolist()))
    return p, out


def _check_shape(out: list, k: int) -> None:
    for tokens in out[:50]:
        _expect(isinstance(tokens, list) and 1 <= len(tokens) <= k + 1 and all(isinstance(t, int) for t in tokens),
                f"ch14_ex1 ({FOLLOWS_P}): rejection_sample with {k} drafts must return a list of 1 to {k + 1} ints, "
                f"got {tokens!r}")


def _check_follows(counts, probs, what: str) -> None:
    pv = chi_square_p_value(counts, probs)
    n = int(torch.as_tensor(counts).sum())
    _expect(n >= 1000, f"ch14_ex1 ({FOLLOWS_P}): {what}: only {n} of {NUM_DRAWS} runs got there (the test needs "
            "many; is the draft accepted with probability min(1, p/q), is there a bonus token?)")
    _expect(pv >= ALPHA, f"ch14_ex1 ({FOLLOWS_P}): {what}: the tokens do not follow p (chi-square p-value {pv:.2e} "
            f"over {n} tokens, below {ALPHA}); counts {torch.as_tensor(counts).long().tolist()}, expected "
            f"{[round(x, 1) for x in (torch.as_tensor(probs) * n).tolist()]}")


def _counts(tokens) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=VOCAB).double()


@pytest.mark.ch14
@pytest.mark.ch14_ex1
@pytest.mark.parametrize("one_hot, filtered", [(False, False), (True, False), (False, True)],
                         ids=["random q", "one-hot q", "p filtered to 8 tokens"])
@pytest.mark.group(FOLLOWS_P)
def test_ch14_ex1_follows_p_with_one_draft(one_hot, filtered):
    """Whatever the draft, the first token returned follows p_0; given the draft accepted, the bonus follows p_1."""
    with graded("ch14_ex1"):
        p, out = _sample_runs(1, one_hot, seed=7 + one_hot + 2 * filtered, filtered=filtered)
    _check_shape(out, 1)
    what = "one-hot q" if one_hot else "random q, p zero outside 8 tokens" if filtered else "random p, q"
    _check_follows(_counts([t[0] for t in out]), p[0], f"{what}, one draft: the first token")
    accepted = [t[1] for t in out if len(t) == 2]
    _check_follows(_counts(accepted), p[1], f"{what}, one draft: the bonus token after the draft was accepted")


@pytest.mark.ch14
@pytest.mark.ch14_ex1
@pytest.mark.group(FOLLOWS_P)
@pytest.mark.parametrize("one_hot", [False, True], ids=["random q", "one-hot q"])
def test_ch14_ex1_follows_p_with_two_drafts(one_hot):
    """Two drafts: given the first accepted, the second token follows p_1; given both, the bonus follows p_2."""
    with graded("ch14_ex1"):
        p, out = _sample_runs(2, one_hot, seed=21 + one_hot)
    _check_shape(out, 2)
    what = f"{'one-hot q' if one_hot else 'random p, q'}, two drafts"
    _check_follows(_counts([t[0] for t in out]), p[0], f"{what}: the first token")
    _check_follows(_counts([t[1] for t in out if len(t) >= 2]), p[1],
                   f"{what}: the second token, given the first draft accepted")
    _check_follows(_counts([t[2] for t in out if len(t) == 3]), p[2], f"{what}: the bonus token, given both accepted")


# --- ch14_ex1, uses each uniform once ------------------------------------------------------------
def _call(drafts, p, q, uniforms):
    with your_code(f"ch14_ex1 ({UNIFORMS})", f"rejection_sample({list(drafts)}, ..., uniforms={list(uniforms)})"):
        out = rs.rejection_sample(list(drafts), p, q, list(uniforms))
    _expect(isinstance(out, list) and 1 <= len(out) <= len(drafts) + 1 and all(
        isinstance(t, int) and 0 <= t < p.shape[1] for t in out), f"ch14_ex1 ({UNIFORMS}): rejection_sample with "
        f"{len(drafts)} drafts must return a list of 1 to {len(drafts) + 1} token ids (ints), got {out!r}")
    return out


def _grid() -> list[float]:
    return [(i + 0.5) / GRID for i in range(GRID)]


def _check_grid_freq(tokens: list, want: torch.Tensor, what: str) -> None:
    got = _counts(tokens) / len(tokens)
    want = want / want.sum()
    worst = int((got - want).abs().argmax())
    _expect(float((got - want).abs().max()) <= GRID_TOL,
            f"ch14_ex1 ({UNIFORMS}): {what}: over {GRID} evenly spread values of that uniform token {worst} came out "
            f"with frequency {float(got[worst]):.4f}, its probability is {float(want[worst]):.4f} (frequencies "
            f"{[round(x, 3) for x in got.tolist()]}, probabilities {[round(x, 3) for x in want.tolist()]})")


@pytest.mark.ch14
@pytest.mark.ch14_ex1
@pytest.mark.group(UNIFORMS)
def test_ch14_ex1_uses_each_uniform_once_deterministic_and_pure():
    """The same arguments give the same tokens; the arguments are left as they were; the uniforms after the
    one that drew the last token are never read; the accepted drafts come out as they were."""
    rng = np.random.default_rng(5)
    with graded("ch14_ex1"):
        for trial in range(300):
            k = trial % 5
            p, q = _distributions(100 + trial, k + 1), _distributions(500 + trial, max(k, 1))[:k]
            one_hot = trial % 3 == 0
            drafts = [int(rng.choice(VOCAB, p=(q[j] / q[j].sum()).numpy())) for j in range(k)]
            uniforms = rng.random(k + 1).tolist()
            p0, q0, u0 = p.clone(), q.clone(), list(uniforms)
            out = _call(drafts, p, None if one_hot else q, uniforms)
            at = f"drafts {drafts}, uniforms {[round(u, 4) for u in uniforms]}, {'one-hot' if one_hot else 'random'} q"
            _expect(torch.equal(p, p0) and torch.equal(q, q0) and uniforms == u0,
                    f"ch14_ex1 ({UNIFORMS}): {at}: rejection_sample changed its arguments (target_probs, draft_probs "
                    "or uniforms)")
            _expect(out[:-1] == drafts[:len(out) - 1], f"ch14_ex1 ({UNIFORMS}): {at}: returned {out}: every token but "
                    "the last must be an accepted draft, in order")
            again = _call(drafts, p.clone(), None if one_hot else q.clone(), uniforms)
            _expect(again == out, f"ch14_ex1 ({UNIFORMS}): {at}: the same arguments gave {out}, then {again}: the "
                    "tokens must be a function of the uniforms (no other randomness)")
            used = len(out) if len(out) <= k else k  # a rejection at j draws with uniforms[j + 1]; the bonus, uniforms[k]
            if used + 1 <= k:
                changed = uniforms[:used + 1] + rng.random(k - used).tolist()
                other = _call(drafts, p, None if one_hot else q, changed)
                _expect(other == out, f"ch14_ex1 ({UNIFORMS}): {at}: returned {out}, and {other} once the uniforms "
                        f"after uniforms[{used}] changed: a rejection at draft j draws with uniforms[j + 1], and "
                        "reads none after it")


def _rejecting_uniform(drafts, p, q, j: int, uniforms: list) -> float | None:
    """A value of uniforms[j] that rejects draft j (the drafts before it accepted), or None."""
    for u in _grid()[::-1]:
        tokens = _call(drafts, p, q, uniforms[:j] + [u] + uniforms[j + 1:])
        if len(tokens) == j + 1:
            return u
    return None


@pytest.mark.ch14
@pytest.mark.ch14_ex1
@pytest.mark.group(UNIFORMS)
@pytest.mark.parametrize("one_hot", [False, True], ids=["random q", "one-hot q"])
def test_ch14_ex1_uses_each_uniform_once_accept_replace_bonus(one_hot):
    """Over evenly spread values of one uniform, the others fixed: draft j is accepted as often as
    min(1, p/q) says, a rejection's replacement (drawn with uniforms[j + 1]) follows the residual
    max(0, p - q) normalized, and after k acceptances the bonus (drawn with uniforms[k]) follows p_k."""
    k, g = 2, torch.Generator().manual_seed(9)
    p = _distributions(31, k + 1)
    q = None if one_hot else _distributions(32, k)
    qq = torch.zeros(k, VOCAB, dtype=torch.float64) if one_hot else q
    # draft 0: a token q makes more likely than p (p/q about 0.3-0.7); draft 1: a token p/q >= 1 keeps
    ratio = (p[:k] / (qq + 1e-300)) if not one_hot else p[:k]
    d0 = int(torch.argmin((ratio[0] - 0.5).abs()))  # accepted about half the time
    d1 = int(ratio[1].argmax())  # p/q >= 1 (one-hot q: the likeliest token)
    if one_hot:
        qq[0, d0] = qq[1, d1] = 1.0
    drafts = [d0, d1]
    accept_p = min(1.0, float(p[0, d0] / qq[0, d0]))
    with graded("ch14_ex1"):
        spare = torch.rand(k + 1, generator=g, dtype=torch.float64).tolist()
        accepted = sum(len(_call(drafts, p, q, [u] + spare[1:])) > 1 for u in _grid()) / GRID
        _expect(abs(accepted - accept_p) <= GRID_TOL, f"ch14_ex1 ({UNIFORMS}): over {GRID} evenly spread values of "
                f"uniforms[0], draft {d0} was accepted {accepted:.4f} of the time; min(1, p/q) = {accept_p:.4f} "
                f"(p = {float(p[0, d0]):.4f}, q = {float(qq[0, d0]):.4f}): uniforms[0] decides draft 0")
        u0 = _rejecting_uniform(drafts, p, q, 0, spare)
        _expect(u0 is not None, f"ch14_ex1 ({UNIFORMS}): draft {d0} (p/q = {accept_p:.3f}) is accepted whatever "
                "uniforms[0] is")
        replaced = []
        for u in _grid():
            tokens = _call(drafts, p, q, [u0, u, spare[2]])
            _expect(len(tokens) == 1, f"ch14_ex1 ({UNIFORMS}): uniforms[0]={u0} rejected draft {d0}, yet with "
                    f"uniforms[1]={u} it was accepted ({tokens}): draft 0 is decided by uniforms[0] alone")
            replaced.append(tokens[0])
        residual = (p[0] - qq[0]).clamp(min=0)
        _check_grid_freq(replaced, residual, f"draft {d0} rejected: the replacement drawn with uniforms[1] must follow "
                         "max(0, p_0 - q_0) normalized")
        _expect(len({_call(drafts, p, q, [u0, 0.3, u])[0] for u in _grid()[::50]}) == 1,
                f"ch14_ex1 ({UNIFORMS}): after a rejection of draft 0 the replacement changed with uniforms[2]: it is "
                "drawn with uniforms[1] alone")
        # both drafts accepted with certainty: tokens with p/q >= 1 (one-hot q: p made one-hot there)
        sure, p_sure = [int(ratio[0].argmax()), d1], p.clone()
        if one_hot:
            p_sure[:k] = 0.0
            p_sure[0, sure[0]] = p_sure[1, sure[1]] = 1.0
        bonus = []
        for u in _grid():
            tokens = _call(sure, p_sure, q, [spare[0], spare[1], u])
            _expect(len(tokens) == k + 1 and tokens[:k] == sure, f"ch14_ex1 ({UNIFORMS}): drafts {sure} have "
                    f"p/q >= 1 and must both be accepted, then a bonus token: got {tokens}")
            bonus.append(tokens[k])
        _check_grid_freq(bonus, p[k], "both drafts accepted: the bonus token drawn with uniforms[2] must follow p_2")
        fixed = {_call(sure, p_sure, q, [a, b, 0.37])[k] for a, b in zip(_grid()[::97], _grid()[::-97])}
        _expect(len(fixed) == 1, f"ch14_ex1 ({UNIFORMS}): with uniforms[2] fixed the bonus token changed with "
                "uniforms[0] and uniforms[1] (drafts accepted with certainty): it is drawn with uniforms[k] alone")
        no_drafts = [_call([], p[2:], None, [u])[0] for u in _grid()]
        _check_grid_freq(no_drafts, p[2], "no drafts: the token drawn with uniforms[0] must follow p_0")


@pytest.mark.ch14
@pytest.mark.ch14_ex1
@pytest.mark.group(UNIFORMS)
def test_ch14_ex1_uses_each_uniform_once_in_the_engine(oracle):
    """Seeded sampled requests with drafts from a noisy copy of the target: the same tokens twice, each
    request of max_tokens tokens from the vocabulary."""
    target, drafts, prompts, max_tokens, _ = oracle
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=m, ignore_eos=True)
              for i, m in enumerate(max_tokens)]
    runs = []
    with graded("ch14_ex1"):
        for _ in range(2):
            engine = _spec_engine(f"ch14_ex1 ({UNIFORMS})", target, drafts["a noisy copy (accepts some)"], 3)
            runs.append([list(o.outputs[0].token_ids) for o in _run("ch14_ex1", UNIFORMS, engine, prompts, params)])
    for i, (a, b) in enumerate(zip(*runs)):
        _expect(len(a) == max_tokens[i] and all(0 <= t < 128 for t in a),
                f"ch14_ex1 ({UNIFORMS}): seeded request {i}: {len(a)} tokens {a}, expected {max_tokens[i]} token ids")
        _expect(a == b, f"ch14_ex1 ({UNIFORMS}): seeded request {i} gave {a}, then {b}: each token must be a function "
                "of the request's uniforms")


# --- ch14_ex2: prompt lookup ---------------------------------------------------------------------
@pytest.mark.ch14
@pytest.mark.ch14_ex2
@settings(max_examples=400, deadline=None, report_multiple_bugs=False)
# fixed cases first (the draws depend on where the test is called from): the earliest of two occurrences, the
# longest n first, the suffix never matches itself
@example(tokens=[3, 1, 2, 0, 1, 2, 3, 1, 2], min_n=1, extra=1, k=1)
@example(tokens=[2, 0, 1, 2, 1, 2], min_n=1, extra=1, k=2)
@example(tokens=[3, 3], min_n=1, extra=3, k=3)
@given(tokens=st.lists(st.integers(0, 3), max_size=40), min_n=st.integers(1, 4), extra=st.integers(0, 3),
       k=st.integers(0, 6))
def test_ch14_ex2_ngram_lookup_equals_brute_force(tokens, min_n, extra, k):
    max_n = min_n + extra
    before = list(tokens)
    with graded("ch14_ex2"), your_code("ch14_ex2", f"ngram_lookup({tokens}, {min_n}, {max_n}, {k})"):
        got = ngram.ngram_lookup(tokens, min_n, max_n, k)  # before the expected value exists
    want = _grader_ngram_lookup(before, min_n, max_n, k)
    _expect(tokens == before, "ch14_ex2: ngram_lookup changed its token_ids")
    _expect(isinstance(got, list) and all(type(t) is int for t in got),
            f"ch14_ex2: ngram_lookup must return a list of Python ints, got {got!r}")
    _expect(got == want, f"ch14_ex2: ngram_lookup(token_ids={tokens}, min_n={min_n}, max_n={max_n}, k={k}) returned "
            f"{got}, expected {want} (the longest suffix n-gram, n <= len - 1, seen at an earlier start, overlaps "
            "allowed; its earliest occurrence; the up to k tokens after it)")


NGRAM_CASES = [  # (token_ids, min_n, max_n, k, expected), each with what it shows
    ([1, 2, 3, 9, 1, 2, 3], 1, 3, 4, [9, 1, 2, 3]),  # the suffix [1, 2, 3] seen at 0: what followed it
    ([5, 1, 2, 7, 1, 2, 8, 1, 2], 1, 2, 1, [7]),  # the earliest of two occurrences
    ([4, 1, 2, 6, 2, 3, 1, 2], 1, 3, 2, [6, 2]),  # [3, 1, 2] not seen: [1, 2] is, before [2] alone
    ([1, 1, 1, 1], 2, 3, 5, [1]),  # overlaps: [1, 1, 1] at 0, followed by the last 1
    ([3, 3], 2, 4, 3, []),  # n is at most len - 1: the suffix may not match itself
    ([3, 3], 1, 4, 3, [3]),
    ([1, 2, 3], 1, 5, 2, []),  # no suffix occurred before
    ([], 1, 3, 2, []), ([7], 1, 1, 2, []),
    ([2, 5, 6, 2], 1, 2, 0, []),  # k = 0
    ([9, 2, 5, 6, 8, 2, 5], 3, 4, 2, []),  # only [2, 5] repeats, shorter than min_n
]


@pytest.mark.ch14
@pytest.mark.ch14_ex2
def test_ch14_ex2_ngram_lookup_by_example():
    for tokens, min_n, max_n, k, want in NGRAM_CASES:
        assert _grader_ngram_lookup(tokens, min_n, max_n, k) == want, (tokens, want)  # the grader's own search
        with graded("ch14_ex2"), your_code("ch14_ex2", f"ngram_lookup({tokens}, {min_n}, {max_n}, {k})"):
            got = ngram.ngram_lookup(list(tokens), min_n, max_n, k)
        _expect(got == want, f"ch14_ex2: ngram_lookup(token_ids={tokens}, min_n={min_n}, max_n={max_n}, k={k}) "
                f"returned {got}, expected {want}")


# --- the graders catch plausible wrong answers (not graded; the wrong answers are written here) ------
def _wrong_greedy_stops_early(draft_token_ids, target_argmax):  # the rejected position yields nothing
    out = []
    for d, t in zip(draft_token_ids, target_argmax):
        if d != t:
            return out
        out.append(t)
    return out + [target_argmax[len(draft_token_ids)]]


def _wrong_greedy_no_bonus(draft_token_ids, target_argmax):  # a full acceptance gives k tokens
    out = []
    for d, t in zip(draft_token_ids, target_argmax):
        out.append(t)
        if d != t:
            return out
    return out or [target_argmax[0]]


def _wrong_greedy_draft_at_disagreement(draft_token_ids, target_argmax):  # keeps the rejected draft
    out = []
    for d, t in zip(draft_token_ids, target_argmax):
        out.append(d)
        if d != t:
            return out
    return out + [target_argmax[len(draft_token_ids)]]


def _rs_variant(accept_ignores_q=False, replace_from_p=False, no_bonus=False, reuse_uniform=False):
    """The book's algorithm with one plausible mistake."""
    def wrong(draft_token_ids, target_probs, draft_probs, uniforms):
        out = []
        for j, d in enumerate(draft_token_ids):
            p = target_probs[j]
            q_d = 1.0 if draft_probs is None or accept_ignores_q else float(draft_probs[j, d])
            if uniforms[j] * q_d < float(p[d]):
                out.append(d)
                continue
            if replace_from_p:
                residual = p
            elif draft_probs is None:
                residual = p.clone()
                residual[d] = 0.0
            else:
                residual = (p - draft_probs[j]).clamp(min=0.0)
            return out + [rs.draw(residual, uniforms[j] if reuse_uniform else uniforms[j + 1])]
        k = len(draft_token_ids)
        return out if no_bonus and k else out + [rs.draw(target_probs[k], uniforms[k])]
    return wrong


def _fails(ex: str, group: str, test, *args) -> str:
    with pytest.raises(AssertionError, match=rf"{ex} \({group}\)|{ex}:") as info:
        test(*args)
    message = str(info.value)
    assert f"{ex} ({group})" in message, message
    return message


@pytest.mark.ch14
@pytest.mark.parametrize("wrong, in_the_engine", [(_wrong_greedy_stops_early, True), (_wrong_greedy_no_bonus, False),
                                                  (_wrong_greedy_draft_at_disagreement, True)],
                         ids=["stops before the target's token", "no bonus token", "the draft at a disagreement"])
def test_ch14_ex1_grader_catches_wrong_greedy(wrong, in_the_engine, oracle):
    """Each fails the hand-made and the random cases; those that change the tokens fail in the engine too
    (without the bonus token the engine's tokens stay right, only fewer per step)."""
    with mock.patch.object(rs, "greedy_verify", wrong):
        _fails("ch14_ex1", GREEDY, test_ch14_ex1_greedy_is_exact_by_example)
        _fails("ch14_ex1", GREEDY, test_ch14_ex1_greedy_is_exact_on_random_cases)
        if in_the_engine:
            _fails("ch14_ex1", GREEDY, test_ch14_ex1_greedy_is_exact_in_the_engine, oracle,
                   "a noisy copy (accepts some)", 3)


@pytest.mark.ch14
@pytest.mark.parametrize("wrong, groups", [
    (_rs_variant(accept_ignores_q=True), [FOLLOWS_P, UNIFORMS]),
    (_rs_variant(replace_from_p=True), [FOLLOWS_P, UNIFORMS]),
    (_rs_variant(no_bonus=True), [FOLLOWS_P, UNIFORMS]),
    (_rs_variant(reuse_uniform=True), [FOLLOWS_P, UNIFORMS]),
], ids=["accepts when u < p(d), ignoring q", "replacement drawn from p", "no bonus token",
        "replacement drawn with uniforms[j]"])
def test_ch14_ex1_grader_catches_wrong_rejection_sampling(wrong, groups):
    tests = {FOLLOWS_P: [(test_ch14_ex1_follows_p_with_two_drafts, False)],
             UNIFORMS: [(test_ch14_ex1_uses_each_uniform_once_accept_replace_bonus, False)]}
    with mock.patch.object(rs, "rejection_sample", wrong):
        for group in groups:
            for test, arg in tests[group]:
                _fails("ch14_ex1", group, test, arg)


def _wrong_ngram_latest(token_ids, min_n, max_n, k):  # the latest occurrence instead of the earliest
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        suffix = token_ids[len(token_ids) - n:]
        for start in range(len(token_ids) - n - 1, -1, -1):
            if token_ids[start:start + n] == suffix:
                return token_ids[start + n:start + n + k]
    return []


def _wrong_ngram_shortest(token_ids, min_n, max_n, k):  # the shortest n first
    for n in range(min_n, min(max_n, len(token_ids) - 1) + 1):
        suffix = token_ids[len(token_ids) - n:]
        for start in range(len(token_ids) - n):
            if token_ids[start:start + n] == suffix:
                return token_ids[start + n:start + n + k]
    return []


def _wrong_ngram_self_match(token_ids, min_n, max_n, k):  # n up to len: the suffix found at its own start
    for n in range(min(max_n, len(token_ids)), min_n - 1, -1):
        suffix = token_ids[len(token_ids) - n:]
        for start in range(len(token_ids) - n + 1):
            if token_ids[start:start + n] == suffix:
                return token_ids[start + n:start + n + k]
    return []


@pytest.mark.ch14
@pytest.mark.parametrize("wrong", [_wrong_ngram_latest, _wrong_ngram_shortest, _wrong_ngram_self_match],
                         ids=["latest occurrence", "shortest n first", "the suffix matches itself"])
def test_ch14_ex2_grader_catches(wrong):
    with mock.patch.object(ngram, "ngram_lookup", wrong):
        for test in (test_ch14_ex2_ngram_lookup_equals_brute_force, test_ch14_ex2_ngram_lookup_by_example):
            with pytest.raises(AssertionError, match="ch14_ex2: ngram_lookup"):
                test()


@pytest.mark.ch14
def test_ch14_grader_stand_ins_follow_the_contracts():
    """The stand-ins the graders put in place are right: the greedy rule, the brute-force search on the
    hand-made cases, and the rejection sampler through the same unit tests as an answer."""
    for drafts, argmax, want in GREEDY_CASES:
        assert _grader_greedy_verify(drafts, argmax) == want
    for tokens, min_n, max_n, k, want in NGRAM_CASES:
        assert _grader_ngram_lookup(tokens, min_n, max_n, k) == want
    with mock.patch.object(rs, "rejection_sample", _grader_rejection_sample):
        test_ch14_ex1_uses_each_uniform_once_accept_replace_bonus(False)
        test_ch14_ex1_uses_each_uniform_once_accept_replace_bonus(True)
