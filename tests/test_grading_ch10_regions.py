"""Grading tests for chapter 10's build assignment (`python -m minivllm.course.grade ch10_ex1`, or `pytest -m ch10_ex1`).

ch10_ex1 builds the sampler's filters whole: `apply_penalties`, `apply_min_p`, `apply_top_k_top_p`, and
the pivot draw's ranking and keep test (`ranked_before`, `mass_ranked_before`). It scores in four parts
(`@pytest.mark.group`, the groups of `EXERCISES["ch10_ex1"]`), one per piece, and is graded in the
package itself: in a student edition the pieces are the student's code, exported from the chapter
(stubs until filled), and there is no reference to compare with. The oracles are transformers' logits processors and warpers (`RepetitionPenaltyLogitsProcessor`,
`MinPLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`) in float64 on random logits, OpenAI's formulas
for the frequency and presence penalties written out token by token, and the ranking rule written here (a
larger logit first; equal logits: the smaller id, as argmax and a stable sort). The draw is graded by where
its tokens land (only on kept tokens) and, with fixed seeds, by a chi-square test of their frequencies.

Each part is graded alone: where the sampler runs, `graded` puts the grader's own versions of the other
three pieces in place, so a filled piece scores whatever state the others are in. Hypothesis draws
are derandomized (the same answer always scores the same points). The tests at the end check that
plausible wrong answers lose their own part's points.

Dtypes: float64 (transformers' result to 1e-12), float32 and bfloat16 (the same rule on the same rounded
values; a kept set may differ only for tokens whose margin to the threshold is within the dtype's rounding,
and a kept logit never changes); bfloat16 rows are full of ties, where the tie rule shows.
"""
from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import failed_checks
import minivllm.sample.ops as ops
import minivllm.sample.sampler as sampler_module
from minivllm.course.grade import EXERCISES as GRADED
from minivllm.sample.generator import make_generator
from minivllm.sample.sampler import Sampler
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

INF = float("-inf")
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _where_largest(got: torch.Tensor, want: torch.Tensor) -> str:
    """The largest difference, where it is, and the two values there."""
    diff = (got.double() - want.double()).abs().nan_to_num(nan=float("inf"))
    i = tuple(int(j) for j in torch.unravel_index(diff.argmax(), diff.shape))
    return (f"largest difference {diff.max().item():.3g} at index {list(i)} (got {got[i].item():.6g}, "
            f"expected {want[i].item():.6g})")


def _tensor_of(got, shape, dtype, at: str) -> None:
    _expect(isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(shape) and got.dtype == dtype,
            f"{at}: expected a tensor of shape {tuple(shape)} and dtype {dtype}, got "
            f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}"
            f"{' ' + str(got.dtype) if isinstance(got, torch.Tensor) else ''}")


def _ids(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()


# --- the grader's rules, written here -------------------------------------------------------------
def _rank(row: torch.Tensor) -> torch.Tensor:
    """Each token's rank in a row (0: the likeliest): larger logit first, equal logits by smaller id."""
    order = sorted(range(len(row)), key=lambda t: (-float(row[t]), t))
    rank = torch.empty(len(row), dtype=torch.int64)
    rank[torch.tensor(order)] = torch.arange(len(row))
    return rank


def _mass_before(row: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """float64: for every token, the probability of the tokens ranked before it (summed in rank order)."""
    rank = _rank(row)
    by_rank = torch.zeros(len(row), dtype=torch.float64)
    by_rank[rank] = probs.double()
    return (by_rank.cumsum(0) - by_rank)[rank]


def _top_k_top_p_rule(row: torch.Tensor, k: int | None, p: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 on the row's values: (kept [V] bool, each token's distance to the top-p threshold)."""
    x = row.double()
    kept = torch.ones(len(x), dtype=torch.bool) if k is None else _rank(x) < k
    margin = torch.full((len(x),), float("inf"), dtype=torch.float64)
    if p is not None and p < 1:
        before = _mass_before(x, x.masked_fill(~kept, INF).softmax(-1))
        margin = torch.where(kept, (before - p).abs(), margin)
        kept &= before < p
    return kept, margin


def _min_p_rule(row: torch.Tensor, min_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: (kept [V] bool, each token's distance to the threshold in log-probability)."""
    x = row.double()
    gap = x - x.max()  # log(p / p_max)
    if min_p <= 0:
        return torch.ones(len(x), dtype=torch.bool), torch.full((len(x),), float("inf"), dtype=torch.float64)
    return gap >= math.log(min_p), (gap - math.log(min_p)).abs()


def _penalties_reference(logits: torch.Tensor, prompts: list, outputs: list, pres, freq, rep) -> torch.Tensor:
    """float64: transformers' repetition penalty over prompt and output, then OpenAI's two formulas."""
    from transformers import RepetitionPenaltyLogitsProcessor

    want = logits.double().clone()
    for i in range(len(want)):
        seen = prompts[i] + outputs[i]
        if seen:
            want[i:i + 1] = RepetitionPenaltyLogitsProcessor(float(rep[i]))(torch.tensor([seen]), want[i:i + 1])
        for t in set(outputs[i]):
            want[i, t] -= float(freq[i]) * outputs[i].count(t) + float(pres[i])
    return want


def _padded(rows: list, vocab: int) -> torch.Tensor:
    width = max(map(len, rows), default=0)
    return torch.tensor([r + [vocab] * (width - len(r)) for r in rows], dtype=torch.int64).reshape(len(rows), width)


# --- the grader's stand-ins, for the pieces an exercise is not about --------------------------------
def _penalties_stand_in(logits, prompt_token_ids, output_token_ids, presence_penalties, frequency_penalties,
                        repetition_penalties):
    vocab = logits.shape[1]

    def counts(ids):
        return F.one_hot(ids, vocab + 1)[..., :vocab].sum(1).to(logits.dtype)

    out = counts(output_token_ids)
    seen = (counts(prompt_token_ids) + out) > 0
    r = repetition_penalties[:, None]
    x = torch.where(seen & (logits > 0), logits / r, torch.where(seen, logits * r, logits))
    return x - frequency_penalties[:, None] * out - presence_penalties[:, None] * (out > 0).to(logits.dtype)


def _min_p_stand_in(logits, min_p):
    p = logits.softmax(-1)
    return logits.masked_fill(p < min_p[:, None] * p.max(-1, keepdim=True).values, INF)


def _top_k_top_p_stand_in(logits, top_k, top_p):
    out = logits.clone()
    for i in range(len(logits)):
        kept, _ = _top_k_top_p_rule(logits[i], None if top_k is None else int(top_k[i]),
                                    None if top_p is None else float(top_p[i]))
        out[i] = logits[i].masked_fill(~kept, INF)
    return out


def _ranked_before_stand_in(logits, token_ids):
    own = logits[torch.arange(len(logits)), token_ids][:, None]
    ids = torch.arange(logits.shape[1])[None, :]
    return torch.where(logits == own, ids < token_ids[:, None], logits > own).to(logits.dtype)


def _mass_ranked_before_stand_in(logits, probs, token_ids):
    return (probs * _ranked_before_stand_in(logits, token_ids).to(probs.dtype)).sum(-1)


# the build's parts: part -> [(owner, attribute, stand-in)]
PIECES = {"penalties": [(ops, "apply_penalties", _penalties_stand_in)],
          "min_p": [(ops, "apply_min_p", _min_p_stand_in)],
          "top_k_top_p": [(ops, "apply_top_k_top_p", _top_k_top_p_stand_in)],
          "pivot": [(ops, "ranked_before", _ranked_before_stand_in),
                    (ops, "mass_ranked_before", _mass_ranked_before_stand_in)]}
PENALTIES, MIN_P, TOP_K_TOP_P, PIVOT = (name for name, _ in GRADED["ch10_ex1"].groups)
PART_GROUP = dict(zip(PIECES, (PENALTIES, MIN_P, TOP_K_TOP_P, PIVOT)))
# exercise -> [(owner, attribute, stand-in)] (the format tests/stand_ins.py reads for editions of several chapters)
STAND_INS = {"ch10_ex1": [patch for patches in PIECES.values() for patch in patches]}


@contextmanager
def graded(part: str | None):
    """The package's (the student's) piece for `part` (a key of `PIECES`), the grader's stand-ins for
    the build's other pieces, in `sample.ops` and wherever the sampler imported them (None: stand-ins for all)."""
    with ExitStack() as stack:
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        for other, patches in PIECES.items():
            for owner, name, fn in patches if other != part else ():
                for module in {owner, sampler_module}:
                    if hasattr(module, name):
                        mp.setattr(module, name, fn)
        yield


def _random_logits(seed: int, rows: int, vocab: int, scale: float = 3.0, ties: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, dtype=torch.float64, generator=g) * scale
    return x.round() if ties else x


# --- ch10_ex1: the penalties ----------------------------------------------------------------------
_penalty = st.one_of(st.just(None), st.floats(-2.0, 2.0))


@pytest.mark.ch10
@pytest.mark.ch10_ex1
@pytest.mark.group(PENALTIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=15, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), vocab=st.integers(2, 40), data=st.data())
def test_ch10_ex1_penalties_equal_transformers(dtype, seed, vocab, data):
    """Random rows, token lists and penalties (each sometimes off) against transformers'
    `RepetitionPenaltyLogitsProcessor` over prompt and output tokens, then OpenAI's frequency and presence
    formulas, in float64 on the same (rounded) values. float64: to 1e-12 (the same formula; only the last
    bits' rounding may differ). float32 and bfloat16: within two units of the dtype's rounding of the
    terms' magnitude (each of the three operations rounds once, by half a unit). A row with every
    penalty off comes back exactly as it was, and the input is not modified."""
    rows = data.draw(st.integers(1, 4), label="rows")
    tokens = st.lists(st.integers(0, vocab - 1), max_size=8)
    prompts = [data.draw(tokens, label=f"prompt {i}") for i in range(rows)]
    outputs = [data.draw(tokens, label=f"output {i}") for i in range(rows)]
    rep = [data.draw(st.one_of(st.just(1.0), st.floats(0.5, 2.5)), label=f"repetition {i}") for i in range(rows)]
    freq = [data.draw(st.one_of(st.just(0.0), st.floats(-2.0, 2.0)), label=f"frequency {i}") for i in range(rows)]
    pres = [data.draw(st.one_of(st.just(0.0), st.floats(-2.0, 2.0)), label=f"presence {i}") for i in range(rows)]
    logits = _random_logits(seed, rows, vocab).to(dtype)
    pres_t, freq_t, rep_t = (torch.tensor(v, dtype=torch.float64).to(dtype) for v in (pres, freq, rep))
    before = logits.clone()
    got = ops.apply_penalties(logits, _padded(prompts, vocab), _padded(outputs, vocab), pres_t, freq_t, rep_t)
    at = (f"ch10_ex1 ({dtype}): apply_penalties on {rows} row(s) of {vocab} logits (seed {seed}), prompts {prompts}, "
          f"outputs {outputs}, presence {pres_t.tolist()}, frequency {freq_t.tolist()}, repetition {rep_t.tolist()}")
    _tensor_of(got, logits.shape, dtype, at)
    _expect(torch.equal(logits, before), f"{at}: the input logits were modified; return a new tensor")
    want = _penalties_reference(logits, prompts, outputs, pres_t, freq_t, rep_t)
    counts = torch.stack([torch.bincount(torch.tensor(o, dtype=torch.int64), minlength=vocab)[:vocab]
                          for o in outputs]).double()
    r = rep_t.double()[:, None]
    magnitude = (logits.double().abs() * torch.maximum(r, 1 / r) + freq_t.double().abs()[:, None] * counts
                 + pres_t.double().abs()[:, None])
    tol = 1e-12 * (1 + magnitude) if dtype == torch.float64 else 2 * torch.finfo(dtype).eps * magnitude
    bad = (got.double() - want).abs() > tol
    if bad.any():
        i, t = (int(j) for j in bad.nonzero()[0])
        seen_prompt, seen_out = t in prompts[i], outputs[i].count(t)
        raise AssertionError(f"{at}: differs from transformers' repetition penalty + OpenAI's formulas at "
                             f"{int(bad.sum())} of {bad.numel()} logits; first at row {i}, token {t} (in the prompt: "
                             f"{seen_prompt}, {seen_out} times in the output); {_where_largest(got, want)}")
    for i in range(rows):
        if rep[i] == 1.0 and freq[i] == 0.0 and pres[i] == 0.0:
            _expect(torch.equal(got[i], logits[i]), f"{at}: row {i} has every penalty off but changed; "
                    f"{_where_largest(got[i], logits[i])}")


@pytest.mark.ch10
@pytest.mark.ch10_ex1
@pytest.mark.group(PENALTIES)
def test_ch10_ex1_penalties_known_cases():
    """A fixed case (the random tests' draws depend on where they are called from): repetition 2 over the
    prompt's tokens 0, 1 and the output's 2 (a positive logit halved, a negative one doubled), then
    frequency 0.5 and presence 1 on token 2, generated twice; a second row with every penalty off."""
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5], [1.0, -1.0, 2.0, 0.5]], dtype=torch.float64)
    prompts, outputs = [[0, 1], [0, 1]], [[2, 2], [2, 2]]
    pres, freq, rep = (torch.tensor(v, dtype=torch.float64) for v in ([1.0, 0.0], [0.5, 0.0], [2.0, 1.0]))
    want = torch.tensor([[0.5, -2.0, -1.0, 0.5], [1.0, -1.0, 2.0, 0.5]], dtype=torch.float64)
    assert torch.allclose(_penalties_reference(logits, prompts, outputs, pres, freq, rep), want), "grader: known case"
    got = ops.apply_penalties(logits, _padded(prompts, 4), _padded(outputs, 4), pres, freq, rep)
    at = ("ch10_ex1: apply_penalties on logits [1, -1, 2, 0.5], prompt [0, 1], output [2, 2], repetition 2, "
          "frequency 0.5, presence 1 (and a row with every penalty off)")
    _tensor_of(got, logits.shape, torch.float64, at)
    _expect(torch.allclose(got, want, rtol=0, atol=1e-12), f"{at}: expected {want.tolist()} (the repetition penalty "
            f"covers the prompt's tokens too; then frequency times the count and presence once), got {got.tolist()}")


# --- ch10_ex1, min-p ------------------------------------------------------------------------------
@pytest.mark.ch10
@pytest.mark.ch10_ex1
@pytest.mark.group(MIN_P)
@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), vocab=st.integers(1, 60), rows=st.integers(1, 4), data=st.data())
def test_ch10_ex1_min_p_equals_transformers(seed, vocab, rows, data):
    """float64, random rows and `min_p` (some 0: off, some 1: only the likeliest): the same tokens kept as
    transformers' `MinPLogitsWarper`, kept logits unchanged, the rest -inf, an off row exactly as it was."""
    from transformers import MinPLogitsWarper

    min_p = [data.draw(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.001, 0.9)), label=f"min_p {i}")
             for i in range(rows)]
    logits = _random_logits(seed, rows, vocab)
    got = ops.apply_min_p(logits, torch.tensor(min_p, dtype=torch.float64))
    at = f"ch10_ex1 (torch.float64): apply_min_p on {rows} row(s) of {vocab} logits (seed {seed}), min_p {min_p}"
    _tensor_of(got, logits.shape, torch.float64, at)
    for i in range(rows):
        want = logits[i:i + 1].clone() if min_p[i] == 0 else MinPLogitsWarper(min_p[i])(None, logits[i:i + 1].clone())
        kept, want_kept = got[i] > INF, want[0] > INF
        _expect(torch.equal(kept, want_kept), f"{at}: row {i} (min_p={min_p[i]}) keeps tokens {_ids(kept)}, "
                f"transformers' MinPLogitsWarper keeps {_ids(want_kept)}")
        _expect(torch.equal(got[i][kept], logits[i][kept]), f"{at}: row {i}: a kept logit changed; "
                f"{_where_largest(got[i], logits[i].masked_fill(~kept, INF))}")


@pytest.mark.ch10
@pytest.mark.ch10_ex1
@pytest.mark.group(MIN_P)
def test_ch10_ex1_min_p_known_cases():
    """A fixed case (the random tests' draws depend on where they are called from): probabilities 0.5, 0.3,
    0.15, 0.05 with min_p 0.2 keep every token of probability >= 0.2 * 0.5 = 0.1, the first three."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64).log()
    got = ops.apply_min_p(logits, torch.tensor([0.2], dtype=torch.float64))
    at = "ch10_ex1: apply_min_p over probabilities [0.5, 0.3, 0.15, 0.05] with min_p 0.2"
    _tensor_of(got, logits.shape, torch.float64, at)
    kept = _ids(got[0] > INF)
    _expect(kept == [0, 1, 2], f"{at}: keeps tokens {kept}, expected [0, 1, 2] (min_p scales the likeliest token's "
            "probability: the floor is 0.1, not 0.2)")
    _expect(torch.equal(got[0, :3], logits[0, :3]), f"{at}: a kept logit changed")


@pytest.mark.ch10
@pytest.mark.ch10_ex1
@pytest.mark.group(MIN_P)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@settings(max_examples=15, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), vocab=st.integers(2, 60), min_p=st.floats(0.001, 0.9))
def test_ch10_ex1_min_p_in_lower_precision(dtype, seed, vocab, min_p):
    """float32 and bfloat16: the kept set is the rule's (probability >= min_p times the largest) on the same
    rounded values, computed in float64, except for tokens within the dtype's rounding of the threshold (4
    units, relative to 1 + the log-probability gap: softmax rounds each probability by about that much);
    the likeliest token is always kept, kept logits unchanged, the dtype kept."""
    logits = _random_logits(seed, 3, vocab).to(dtype)
    mp = torch.tensor([min_p, 0.0, 1.0], dtype=dtype)
    got = ops.apply_min_p(logits, mp)
    at = f"ch10_ex1 ({dtype}): apply_min_p on 3 rows of {vocab} logits (seed {seed}), min_p {mp.tolist()}"
    _tensor_of(got, logits.shape, dtype, at)
    for i in range(3):
        kept = got[i] > INF
        want, margin = _min_p_rule(logits[i], float(mp[i]))
        gap = (logits[i].double() - logits[i].double().max()).abs()
        wrong = (kept != want) & (margin > 4 * torch.finfo(dtype).eps * (1 + gap))
        _expect(not wrong.any(), f"{at}: row {i} (min_p={float(mp[i])}) keeps {_ids(kept)}, the rule keeps "
                f"{_ids(want)} (tokens {_ids(wrong)} are clear of the threshold)")
        _expect(bool(kept[logits[i].argmax()]), f"{at}: row {i}: the likeliest token was dropped")
        _expect(torch.equal(got[i][kept], logits[i][kept]), f"{at}: row {i}: a kept logit changed")


# --- ch10_ex1, top-k and top-p --------------------------------------------------------------------
def _draw_filters(data, rows: int, vocab: int):
    top_k = [data.draw(st.one_of(st.just(vocab), st.integers(1, vocab)), label=f"top_k {i}") for i in range(rows)]
    top_p = [data.draw(st.one_of(st.just(1.0), st.floats(0.05, 0.99)), label=f"top_p {i}") for i in range(rows)]
    use_k, use_p = data.draw(st.sampled_from([(True, True), (True, False), (False, True)]), label="(top_k, top_p) used")
    return (top_k if use_k else None), (top_p if use_p else None)


ORACLE_NAME = "transformers' TopKLogitsWarper then TopPLogitsWarper"


def _check_top_k_top_p(got, logits, top_k, top_p, dtype, at, tol: float, oracle=None):
    _tensor_of(got, logits.shape, dtype, at)
    for i in range(len(logits)):
        k, p = (None if top_k is None else top_k[i]), (None if top_p is None else top_p[i])
        kept = got[i] > INF
        if oracle is not None:
            want, margin = oracle(logits[i], k, p), torch.full((logits.shape[1],), float("inf"))
        else:
            want, margin = _top_k_top_p_rule(logits[i], k, p)
        wrong = (kept != want) & (margin > tol)
        if wrong.any():
            rank = _rank(logits[i].double())
            raise AssertionError(
                f"{at}: row {i} (top_k={k}, top_p={p}) keeps tokens {_ids(kept)}, expected {_ids(want)} "
                f"({ORACLE_NAME if oracle else 'the rule: a stable sort'}); "
                f"first wrong: token {_ids(wrong)[0]} of rank {int(rank[_ids(wrong)[0]])} (0: likeliest; equal "
                f"logits: the smaller id ranks first)")
        _expect(torch.equal(got[i][kept], logits[i][kept]), f"{at}: row {i}: a kept logit changed; "
                f"{_where_largest(got[i][kept], logits[i][kept])}")


def _transformers_top_k_top_p(row, k, p):
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    x = row[None].clone()
    if k is not None:
        x = TopKLogitsWarper(k)(None, x)
    if p is not None and p < 1:
        x = TopPLogitsWarper(p)(None, x)
    return x[0] > INF


@pytest.mark.ch10
@pytest.mark.ch10_ex1
@pytest.mark.group(TOP_K_TOP_P)
@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), vocab=st.integers(1, 60), rows=st.integers(1, 4), data=st.data())
def test_ch10_ex1_top_k_top_p_equals_transformers(seed, vocab, rows, data):
    """float64, random rows (no ties) with random `top_k` and `top_p` (some off: k = vocab_size, p = 1;
    or the whole tensor None): the same tokens kept as transformers' `TopKLogitsWarper` then
    `TopPLogitsWarper` (top-p measured on what top-k left), kept logits unchanged, the rest -inf."""
    top_k, top_p = _draw_filters(data, rows, vocab)
    logits = _random_logits(seed, rows, vocab)
    got = ops.apply_top_k_top_p(logits, None if top_k is None else torch.tensor(top_k),
                                None if top_p is None else torch.tensor(top_p, dtype=torch.float64))
    at = (f"ch10_ex1 (torch.float64): apply_top_k_top_p on {rows} row(s) of {vocab} logits (seed {seed}), "
          f"top_k {top_k}, top_p {top_p}")
    _check_top_k_top_p(got, logits, top_k, top_p, torch.float64, at, 0.0, oracle=_transformers_top_k_top_p)


@pytest.mark.ch10
@pytest.mark.ch10_ex1
@pytest.mark.group(TOP_K_TOP_P)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=15, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), vocab=st.integers(1, 40), rows=st.integers(1, 4), data=st.data())
def test_ch10_ex1_top_k_top_p_with_ties(dtype, seed, vocab, rows, data):
    """Rows full of ties (logits rounded to integers; in bfloat16 also by the dtype): the kept set is the
    rule's on the same values, in float64: rank by a stable sort (equal logits: the smaller id first, so
    `top_k=1` is the argmax), keep the first `top_k`, then each token whose higher-ranked tokens hold less
    than `top_p` of what top-k left. Exact in float64 except within 1e-12 of `top_p`; float32 and bfloat16
    within vocab_size units of the dtype's rounding of `top_p` (a running sum of as many probabilities)."""
    top_k, top_p = _draw_filters(data, rows, vocab)
    logits = _random_logits(seed, rows, vocab, scale=data.draw(st.sampled_from([1.0, 3.0]), label="scale"),
                            ties=True).to(dtype)
    got = ops.apply_top_k_top_p(logits, None if top_k is None else torch.tensor(top_k),
                                None if top_p is None else torch.tensor(top_p, dtype=torch.float64).to(dtype))
    at = (f"ch10_ex1 ({dtype}): apply_top_k_top_p on {rows} row(s) of {vocab} tied logits {logits.tolist()}, "
          f"top_k {top_k}, top_p {top_p}")
    tol = 1e-12 if dtype == torch.float64 else vocab * torch.finfo(dtype).eps
    rounded_p = None if top_p is None else torch.tensor(top_p, dtype=torch.float64).to(dtype).double().tolist()
    _check_top_k_top_p(got, logits, top_k, rounded_p, dtype, at, tol)


@pytest.mark.ch10
@pytest.mark.ch10_ex1
@pytest.mark.group(TOP_K_TOP_P)
def test_ch10_ex1_rows_alone_and_known_cases():
    """A row's result does not depend on its batch mates; the cases from public bug reports: top_p=0.6
    over probabilities 0.1, 0.2, 0.3, 0.4 keeps exactly 0.3 and 0.4; top_k=1 with tied maxima keeps the
    smaller id; top_k=2 then top_p=0.5 there keeps only 0.4 (top-p renormalized after top-k); top_p=0.5 over four
    equal probabilities keeps two (the boundary: a token with exactly top_p before it goes); both filters None
    return the logits as they are."""
    at = "ch10_ex1: apply_top_k_top_p"
    logits = _random_logits(5, 6, 30)
    top_k, top_p = torch.tensor([30, 3, 30, 10, 1, 30]), torch.tensor([1.0, 0.5, 0.3, 1.0, 0.9, 0.8], dtype=torch.float64)
    batch = ops.apply_top_k_top_p(logits, top_k, top_p)
    _tensor_of(batch, logits.shape, torch.float64, at)
    for i in range(6):
        alone = ops.apply_top_k_top_p(logits[i:i + 1], top_k[i:i + 1], top_p[i:i + 1])[0]
        _expect(torch.equal(alone, batch[i]), f"{at}: row {i} (top_k={int(top_k[i])}, top_p={float(top_p[i])}) "
                f"keeps {_ids(alone > INF)} alone and {_ids(batch[i] > INF)} in a batch of 6")
    _expect(torch.equal(batch[0], logits[0]), f"{at}: a row with top_k = vocab_size and top_p = 1 changed")
    four = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64).log()
    kept = _ids(ops.apply_top_k_top_p(four, None, torch.tensor([0.6], dtype=torch.float64))[0] > INF)
    _expect(kept == [2, 3], f"{at}: top_p=0.6 over probabilities [0.1, 0.2, 0.3, 0.4] keeps tokens {kept}, "
            "expected [2, 3] (0.4 alone holds less than 0.6, so 0.3 stays; 0.4 + 0.3 reach it)")
    kept = _ids(ops.apply_top_k_top_p(four, torch.tensor([2]), torch.tensor([0.5], dtype=torch.float64))[0] > INF)
    _expect(kept == [3], f"{at}: top_k=2 then top_p=0.5 over probabilities [0.1, 0.2, 0.3, 0.4] keeps tokens {kept}, "
            "expected [3] (top-p measures what top-k left: 0.4 / 0.7 = 0.57 already reaches 0.5)")
    uniform = torch.zeros(1, 4, dtype=torch.float64)
    kept = _ids(ops.apply_top_k_top_p(uniform, None, torch.tensor([0.5], dtype=torch.float64))[0] > INF)
    _expect(kept == [0, 1], f"{at}: top_p=0.5 over four equal probabilities keeps tokens {kept}, expected [0, 1] "
            "(token 2 has exactly 0.5 ranked before it: tokens 0 and 1 already reach top_p, so it goes)")
    tied = torch.tensor([[1.0, 3.0, 0.5, 3.0]])
    kept = _ids(ops.apply_top_k_top_p(tied, torch.tensor([1]), None)[0] > INF)
    _expect(kept == [1], f"{at}: top_k=1 over logits [1, 3, 0.5, 3] keeps {kept}, expected [1] (the argmax: "
            "equal logits rank by the smaller id)")
    same = ops.apply_top_k_top_p(tied, None, None)
    _expect(isinstance(same, torch.Tensor) and torch.equal(same, tied), f"{at}: with top_k and top_p both None "
            "the logits must come back unchanged")


# --- ch10_ex1: the pivot draw's ranking and keep test -------------------------------------------------
@pytest.mark.ch10
@pytest.mark.ch10_ex1
@pytest.mark.group(PIVOT)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=20, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), vocab=st.integers(1, 40), rows=st.integers(1, 6), ties=st.booleans(),
       data=st.data())
def test_ch10_ex1_ranked_before(dtype, seed, vocab, rows, ties, data):
    """Random rows (half of them full of ties; bfloat16 adds its own), any token asked about: 1.0 exactly on
    the tokens ranked before it by a stable sort (a larger logit, or an equal logit and a smaller id; never
    the token itself), 0.0 elsewhere, in the logits' dtype; the input is not modified."""
    logits = _random_logits(seed, rows, vocab, ties=ties).to(dtype)
    token_ids = torch.tensor([data.draw(st.integers(0, vocab - 1), label=f"token {i}") for i in range(rows)])
    before = logits.clone()
    got = ops.ranked_before(logits, token_ids)
    at = (f"ch10_ex1 ({dtype}): ranked_before on {rows} row(s) of {vocab} logits {logits.tolist()}, "
          f"token_ids {token_ids.tolist()}")
    _tensor_of(got, (rows, vocab), dtype, at)
    _expect(torch.equal(logits, before), f"{at}: the input logits were modified")
    for i in range(rows):
        rank = _rank(logits[i].double())
        want = rank < rank[token_ids[i]]
        _expect(torch.equal(got[i], want.to(dtype)), f"{at}: row {i}, token {int(token_ids[i])}: marked "
                f"{_ids(got[i] != 0)}, the tokens ranked before it are {_ids(want)} (larger logits, and equal "
                "logits of smaller id)")


@pytest.mark.ch10
@pytest.mark.ch10_ex1
@pytest.mark.group(PIVOT)
def test_ch10_ex1_ranked_before_known_cases():
    """A fixed case (the random tests' draws depend on where they are called from): logits [1, 3, 3, 0.5],
    tokens 1, 2 and 0 asked about: ties rank the smaller id first, a token is never before itself."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5]] * 3)
    got = ops.ranked_before(logits, torch.tensor([1, 2, 0]))
    at = "ch10_ex1: ranked_before on logits [1, 3, 3, 0.5] (three rows), tokens [1, 2, 0]"
    _tensor_of(got, (3, 4), torch.float32, at)
    want = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    _expect(torch.equal(got, want), f"{at}: expected {want.tolist()} (larger logits, and equal logits of smaller "
            f"id), got {got.tolist()}")


@pytest.mark.ch10
@pytest.mark.ch10_ex1
@pytest.mark.group(PIVOT)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@settings(max_examples=20, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), vocab=st.integers(1, 40), rows=st.integers(1, 6), ties=st.booleans(),
       data=st.data())
def test_ch10_ex1_mass_ranked_before(dtype, seed, vocab, rows, ties, data):
    """Random rows (half of them full of ties), probabilities zero on a random filtered-out set, any token
    asked about (kept or not): the probability of the tokens ranked before it (a larger logit, or an
    equal logit and a smaller id), summed here in rank order in float64. float64 to 1e-12, float32 within
    vocab_size units of float32 rounding (a sum of as many probabilities, in any order)."""
    logits = _random_logits(seed, rows, vocab, ties=ties).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    dropped = torch.rand(rows, vocab, generator=g) < data.draw(st.sampled_from([0.0, 0.5]), label="share filtered")
    dropped[torch.arange(rows), logits.argmax(-1)] = False
    probs = logits.double().masked_fill(dropped, INF).softmax(-1).to(dtype)
    token_ids = torch.tensor([data.draw(st.integers(0, vocab - 1), label=f"token {i}") for i in range(rows)])
    got = ops.mass_ranked_before(logits, probs, token_ids)
    at = (f"ch10_ex1 ({dtype}): mass_ranked_before on {rows} row(s) of {vocab} logits (seed {seed}, "
          f"{'with' if ties else 'without'} ties), token_ids {token_ids.tolist()}")
    _tensor_of(got, (rows,), dtype, at)
    want = torch.stack([_mass_before(logits[i].double(), probs[i])[token_ids[i]] for i in range(rows)])
    tol = 1e-12 if dtype == torch.float64 else vocab * torch.finfo(dtype).eps
    bad = (got.double() - want).abs() > tol
    if bad.any():
        i = int(bad.nonzero()[0])
        t = int(token_ids[i])
        n_tied = int((logits[i] == logits[i, t]).sum()) - 1
        raise AssertionError(f"{at}: row {i}, token {t} (logit {float(logits[i, t]):.6g}, tied with {n_tied} other "
                             f"token(s)): got {float(got[i]):.6g}, expected {float(want[i]):.6g} (the tokens ranked "
                             f"before it: larger logits, and equal logits of smaller id; not the token itself); "
                             f"{_where_largest(got, want)}")


class _Budget:
    """A generator that refuses to draw past a budget: a keep test that never accepts would loop forever."""

    def __init__(self, seed: int, budget: int):
        self.inner, self.budget = make_generator(seed), budget

    def random(self) -> float:
        if self.inner.counter >= self.budget:
            raise AssertionError(f"ch10_ex1: the pivot draw rejected {self.budget} draws of one row in a row; "
                                 "the keep test never accepts (is the mass before a token too large?)")
        return self.inner.random()


def _draws(row: torch.Tensor, top_k: int | None, top_p: float, n: int) -> torch.Tensor:
    gens = [_Budget(seed, 200) for seed in range(n)]
    uniforms = torch.tensor([g.random() for g in gens], dtype=torch.float64)
    return ops.sample_top_k_top_p(row.expand(n, -1).contiguous(), None if top_k is None else torch.full((n,), top_k),
                                  torch.full((n,), top_p, dtype=row.dtype), uniforms, gens)


DRAWS = 3000  # seeded draws per row: 3,000 gives each expected count >= 5 at the rows' smallest kept share


@pytest.mark.ch10
@pytest.mark.ch10_ex1
@pytest.mark.group(PIVOT)
@pytest.mark.parametrize("top_k, top_p", [(None, 0.7), (8, 0.9), (None, 0.95)], ids=str)
def test_ch10_ex1_pivot_draws_follow_the_filtered_softmax(top_k, top_p):
    """`sample_top_k_top_p` with your keep test on a fixed 12-token row (float64; seeds 0 to 2,999): every
    draw lands on a token transformers' `TopKLogitsWarper` and `TopPLogitsWarper` keep, and the counts pass
    a chi-square test against the filtered softmax (p > 0.001; the seeds are fixed, so the test gives the
    same answer every time, and the book's answer passes with room)."""
    row = torch.tensor([[2.0, 1.5, 1.4, 1.0, 0.8, 0.5, 0.4, 0.0, -0.3, -0.5, -1.0, -2.0]], dtype=torch.float64)
    row = row[:, torch.randperm(12, generator=torch.Generator().manual_seed(0))]  # not in rank order
    kept = _transformers_top_k_top_p(row[0], top_k, top_p)
    expected = row[0].masked_fill(~kept, INF).softmax(-1)
    tokens = _draws(row, top_k, top_p, DRAWS)
    at = f"ch10_ex1: {DRAWS} seeded pivot draws over logits {row[0].tolist()} with top_k={top_k}, top_p={top_p}"
    _tensor_of(tokens, (DRAWS,), torch.int64, at)
    counts = torch.bincount(tokens, minlength=12).double()
    outside = _ids((counts > 0) & ~kept)
    _expect(not outside, f"{at}: draws landed on tokens {outside} ({[int(counts[t]) for t in outside]} times), which "
            f"top-k/top-p drop; the kept tokens are {_ids(kept)}")
    chi2 = float(((counts - DRAWS * expected)[kept] ** 2 / (DRAWS * expected[kept])).sum())
    dof = int(kept.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(chi2 / 2))) if dof else 1.0
    share = {t: (round(float(counts[t]) / DRAWS, 3), round(float(expected[t]), 3)) for t in _ids(kept)}
    _expect(p_value > 1e-3, f"{at}: the counts do not follow the filtered softmax: chi-square {chi2:.1f} with {dof} "
            f"degrees of freedom, p = {p_value:.2g}; token: (share of draws, expected) {share}")


@pytest.mark.ch10
@pytest.mark.ch10_ex1
@pytest.mark.group(PIVOT)
def test_ch10_ex1_pivot_draws_on_tied_rows_in_float32():
    """float32 rows full of ties (rounded logits), top_k and top_p: each of 300 seeded draws per row lands on
    a token the rule keeps (rank by the stable sort's order, then less than top_p before it)."""
    logits = _random_logits(11, 4, 24, scale=2.0, ties=True).float()
    for i, (k, p) in enumerate([(None, 0.5), (5, 0.8), (3, 0.99), (None, 0.9)]):
        kept, margin = _top_k_top_p_rule(logits[i], k, p)
        tokens = _draws(logits[i:i + 1], k, p, 300)
        outside = sorted({t for t in tokens.tolist() if not kept[t] and margin[t] > 1e-5})
        _expect(not outside, f"ch10_ex1 (torch.float32): pivot draws over tied logits {logits[i].tolist()} with "
                f"top_k={k}, top_p={p} landed on tokens {outside}; the rule keeps {_ids(kept)} (equal logits: the "
                "smaller id ranks first)")


# --- each piece inside the Sampler, the other pieces the grader's ----------------------------------
def _batch(vocab: int):
    """Sequences with prompts and completions; greedy and random rows with penalties and filters."""
    params = [SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5),
              SamplingParams(temperature=0.9, min_p=0.1, presence_penalty=1.0, seed=1),
              SamplingParams(temperature=0.8, top_k=6, top_p=0.7, repetition_penalty=1.3, seed=2),
              SamplingParams(temperature=1.2, top_p=0.5, min_p=0.05, frequency_penalty=-0.5, seed=3),
              SamplingParams(temperature=0, presence_penalty=2.0)]
    seqs = []
    for i, sp in enumerate(params):
        s = Sequence([(3 * i + j) % vocab for j in range(5)], sp)
        for t in [(7 * i + j) % vocab for j in range(4)]:
            s.append_token(t)
        seqs.append(s)
    return seqs


@pytest.mark.ch10
@pytest.mark.ch10_ex1
@pytest.mark.parametrize("part", [pytest.param(part, marks=pytest.mark.group(PART_GROUP[part]), id=part)
                                  for part in ("penalties", "min_p", "pivot")])
def test_ch10_piece_in_the_sampler(part):
    """The engine's `Sampler` on a float32 batch of greedy and random rows with penalties, min-p, top-k and
    top-p, with your piece and the grader's others, 40 seeded steps: greedy rows take the argmax of the
    penalized logits (transformers' and OpenAI's penalties), random rows land only on tokens the filtered
    distribution keeps (the rule in float64, except within float32 rounding of a threshold)."""
    vocab = 32
    seqs = _batch(vocab)
    prompts = [s.prompt_token_ids for s in seqs]
    outputs = [s.completion_token_ids for s in seqs]
    sp = [s.sampling_params for s in seqs]
    ex = "ch10_ex1"
    with graded(part):
        for step in range(40):
            logits = _random_logits(100 + step, len(seqs), vocab).float()
            gens = {s.seq_id: make_generator(1000 * step + i) for i, s in enumerate(seqs)}
            tokens = Sampler()(logits, seqs, gens, make_generator(step))
            penalized = _penalties_reference(logits, prompts, outputs, [p.presence_penalty for p in sp],
                                             [p.frequency_penalty for p in sp], [p.repetition_penalty for p in sp])
            for i, (t, p) in enumerate(zip(tokens, sp)):
                at = f"{ex}: the Sampler, step {step}, row {i} ({p})"
                if p.temperature == 0:
                    top2 = penalized[i].topk(2).values
                    _expect(t == int(penalized[i].argmax()) or float(top2[0] - top2[1]) < 1e-5,
                            f"{at}: greedy row took token {t}, the argmax of the penalized logits is "
                            f"{int(penalized[i].argmax())}")
                    continue
                x = penalized[i] / p.temperature
                kept, margin = _min_p_rule(x, p.min_p)
                x = x.masked_fill(~kept, INF)
                k_kept, k_margin = _top_k_top_p_rule(x, p.top_k if 0 < p.top_k < vocab else None, p.top_p)
                margin = torch.minimum(margin, k_margin)
                _expect(0 <= t < vocab and (bool(kept[t] and k_kept[t]) or float(margin[t]) < 1e-4),
                        f"{at}: drew token {t}, which the filters drop; they keep {_ids(kept & k_kept)}")


# --- plausible wrong answers lose their own part's points (not graded: they check the graders) ------
def _min_p_absolute(logits, min_p):
    """min-p read as an absolute floor on the probability, not relative to the likeliest token's."""
    return logits.masked_fill(logits.softmax(-1) < min_p[:, None], INF)


def _top_p_drops_the_crossing_token(logits, top_k, top_p):
    """top-p that keeps tokens while the mass *including* them stays within p (drops the token that crosses p)."""
    out = _top_k_top_p_stand_in(logits, top_k, None)
    if top_p is None:
        return out
    for i in range(len(out)):
        order = torch.sort(out[i], descending=True, stable=True).indices
        cum = out[i][order].softmax(-1).cumsum(-1)
        drop = order[cum > top_p[i]]
        out[i, drop] = INF
    return out


def _penalties_on_outputs_only(logits, prompt_token_ids, output_token_ids, presence_penalties, frequency_penalties,
                               repetition_penalties):
    """The repetition penalty on generated tokens only (it also covers the prompt's)."""
    empty = torch.full_like(prompt_token_ids[:, :0], 0)
    return _penalties_stand_in(logits, empty, output_token_ids, presence_penalties, frequency_penalties,
                               repetition_penalties)


def _ranked_before_ties_by_larger_id(logits, token_ids):
    """Ties broken the wrong way: equal logits rank the larger id first."""
    own = logits[torch.arange(len(logits)), token_ids][:, None]
    ids = torch.arange(logits.shape[1])[None, :]
    return torch.where(logits == own, ids > token_ids[:, None], logits > own).to(logits.dtype)


@pytest.mark.parametrize("name, wrong, checks", [
    ("apply_min_p", _min_p_absolute,
     [test_ch10_ex1_min_p_known_cases, lambda: test_ch10_ex1_min_p_equals_transformers()]),
    ("apply_top_k_top_p", _top_p_drops_the_crossing_token,
     [lambda: test_ch10_ex1_top_k_top_p_equals_transformers(), test_ch10_ex1_rows_alone_and_known_cases]),
    ("apply_penalties", _penalties_on_outputs_only,
     [test_ch10_ex1_penalties_known_cases, lambda: test_ch10_ex1_penalties_equal_transformers(dtype=torch.float64)]),
    ("ranked_before", _ranked_before_ties_by_larger_id,
     [test_ch10_ex1_ranked_before_known_cases, lambda: test_ch10_ex1_ranked_before(dtype=torch.float32)]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_ch10_ex1_wrong_answers_lose_their_part(name, wrong, checks, monkeypatch):
    """Each wrong piece, put in the package's place, fails at least one check of its own part."""
    monkeypatch.setattr(ops, name, wrong)
    failures = failed_checks(checks)
    assert failures, f"a wrong {name} passed every check of its part"
