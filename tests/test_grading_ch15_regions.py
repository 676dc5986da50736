"""Grading tests for chapter 15's rebuild exercises (`python -m minivllm.course.grade ch15_ex1`, or `pytest -m ch15_ex1`).

ch15_ex1 (`apply_token_bitmask`, in `minivllm.structured_output.bitmask`) and ch15_ex2 (`token_mask`, in
`minivllm.structured_output.regex_index`) are graded in the package itself: in a student edition they are
the student's code, exported from the chapter (stubs until filled), and the chapter's answer is not there
to compare with. Each is graded alone: the grader's own stand-ins (`_grader_apply_token_bitmask`,
`_grader_token_mask`, written here, differently from the chapter) take the other's place (`graded`;
`STAND_INS` serves `tests/stand_ins.py` for editions of several chapters and for chapter 15's extend
exercise, whose engine samples through `apply_token_bitmask`).

What is checked is the contract, against llguidance (the grammar library of the chapter), never this
chapter's code. ch15_ex1, in named groups (a failure names its group, so that a student sees which part
works), against `llguidance.torch.apply_token_bitmask_inplace` on random masks (words with the sign bit
set, all ones, all zeros) for float32, float64 and bfloat16 logits:
* the bits: vocabularies within the mask's bits (a multiple of 32, not a multiple, shorter than the
  mask's bits: the bits past the vocabulary are ignored): the returned logits are -inf exactly where
  llguidance's are, the others unchanged to the bit;
* padded vocabulary: logits wider than `32 * width` (a model's embedding padded past the tokenizer's
  vocabulary): the ids past the mask are -inf too;
* in place: the logits passed in are the ones changed, and returned; the bitmask is left unchanged.
llguidance's function runs its kernel through `torch.compile`, which takes about 20 s per shape and dtype
on a CPU; the grader calls the same kernel uncompiled (`_torchdynamo_orig_callable`: the same code).

ch15_ex2, in named groups, against llguidance on 250 seeded random regexes over "abc12-x" (literals,
classes `[a-c]`, `\\d`, groups, alternation, `?`, `*`, `+`, `{m,n}`) with a toy vocabulary of 50 short
tokens (a Hugging Face fast tokenizer built with `tokenizers`, EOS in the middle of the vocabulary, two
tokens with no text), at every prefix of a random walk over the tokens llguidance allows:
* prefixes: each token with text is allowed exactly when llguidance's matcher allows it after the
  prefix's tokens;
* EOS: allowed exactly when llguidance accepts the prefix as a whole match (`is_accepting`);
* empty tokens: never allowed (llguidance never allows a token with no text, here special tokens).
Where the two definitions differ, the comparison is made where they agree: inside a *forced* span
(llguidance's `compute_ff_bytes()` is not empty, e.g. after `a` under `abc-12|x`), llguidance allows only
the tokenizer's own split of the forced text (the chapter shows it: "tion" but not "t" after
`{"name": "Ada", "na`), while the exercise's contract allows every token that keeps the text a prefix of
a match. There the reference is llguidance with a one-character-per-character vocabulary, fed the text
character by character: every text has one split, so nothing is refused for its split, and a token is
allowed when the matcher would take all of its characters (`validate_tokens`). Outside forced spans the
toy vocabulary's own mask is the reference.
The tests at the end (marked `ch15` only, not graded) show that plausible wrong answers fail these graders.
"""
from __future__ import annotations

import random
from contextlib import contextmanager
from functools import lru_cache
from unittest import mock

import pytest
import regex
import torch

import minivllm.structured_output.bitmask as bitmask_mod
import minivllm.structured_output.regex_index as regex_index

BITS, PADDED, IN_PLACE = "the bits", "padded vocabulary", "in place"
PREFIXES, EOS_GROUP, EMPTY = "prefixes", "EOS", "empty tokens"
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


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
def _grader_apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Token i's word and bit by integer division, gathered per token; -inf past the mask's words."""
    vocab, width = logits.shape[-1], bitmask.shape[-1]
    ids = torch.arange(vocab, device=logits.device)
    words = bitmask.to(logits.device).long()[:, (ids // 32).clamp(max=width - 1)]
    keep = ((words >> (ids % 32)) & 1).bool() & (ids < 32 * width)
    return logits.masked_fill_(~keep, float("-inf"))


def _grader_token_mask(pattern: str, prefix: str, vocab: list[str], eos_token_id: int) -> list[bool]:
    """The contract, token by token, with the `regex` package's partial matching."""
    compiled = regex.compile(pattern)
    complete = compiled.fullmatch(prefix) is not None
    return [complete if i == eos_token_id else
            (len(t) > 0 and compiled.fullmatch(prefix + t, partial=True) is not None) for i, t in enumerate(vocab)]


# exercise -> [(owner, attribute, stand-in)] (the format tests/stand_ins.py reads)
STAND_INS = {"ch15_ex1": [(bitmask_mod, "apply_token_bitmask", _grader_apply_token_bitmask)],
             "ch15_ex2": [(regex_index, "token_mask", _grader_token_mask)]}


@contextmanager
def graded(ex: str | None):
    """The package's (the student's) code for `ex`, the grader's stand-ins for chapter 15's other
    exercise (None: for both), also where a module imported the function by name (the sampler)."""
    from stand_ins import stand_ins_for

    with stand_ins_for([other for other in STAND_INS if other != ex]):
        yield


# --- ch15_ex1: against llguidance's apply_token_bitmask_inplace ----------------------------------
def _llguidance_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """llguidance's `apply_token_bitmask_inplace` on a copy, its kernel run uncompiled (same code)."""
    lt = pytest.importorskip("llguidance.torch")
    kernel = lt.apply_token_bitmask_inplace_kernel
    kernel = getattr(kernel, "_torchdynamo_orig_callable", kernel)
    out = logits.clone()
    with mock.patch.object(lt, "apply_token_bitmask_inplace_kernel", kernel):
        lt.apply_token_bitmask_inplace(out, bitmask.clone())
    return out


def _random_bitmask(g: torch.Generator, rows: int, width: int) -> torch.Tensor:
    """Random int32 words, with rows of all ones, all zeros and one allowed token mixed in."""
    words = torch.randint(-2**31, 2**31, (rows, width), generator=g, dtype=torch.int64)
    density = torch.rand(rows, 1, generator=g)
    sparse = torch.randint(-2**31, 2**31, (rows, width), generator=g, dtype=torch.int64)
    words = torch.where(density < 0.3, words & sparse, words)  # fewer allowed tokens in some rows
    if rows > 2:
        words[0], words[1] = -1, 0
        words[2] = 0
        words[2, width // 2] = -(1 << 31)  # only the sign bit: token 32 * (width // 2) + 31
    return words.to(torch.int32)


# (vocab_size, width): a multiple of 32, not a multiple, shorter than the mask's bits, tiny, the
# default model's; and padded past the mask (more logits than 32 * width)
WITHIN = [(64, 2), (70, 3), (40, 3), (1, 1), (31, 1), (33, 2), (49152, 1536)]
PADDED_SHAPES = [(100, 3), (33, 1), (64, 1), (130, 2), (49216, 1536)]


def _check_apply(vocab: int, width: int, dtype: torch.dtype, seed: int, group: str) -> None:
    g = torch.Generator().manual_seed(seed)
    rows = 5
    bitmask = _random_bitmask(g, rows, width)
    logits = (torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3).to(dtype)
    what = f"apply_token_bitmask(logits [{rows}, {vocab}] {dtype}, bitmask [{rows}, {width}] int32)"
    with your_code(f"ch15_ex1 ({group})", what):  # the answer runs before the expected value exists
        got = bitmask_mod.apply_token_bitmask(logits.clone(), bitmask.clone())
    want = _llguidance_apply(logits, bitmask)
    _expect(isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == dtype,
            f"ch15_ex1 ({group}): {what} must return the logits ([{rows}, {vocab}] {dtype}), got "
            f"{type(got).__name__} {getattr(got, 'shape', '')} {getattr(got, 'dtype', '')}")
    got_inf, want_inf = torch.isneginf(got), torch.isneginf(want)
    if not torch.equal(got_inf, want_inf):
        r, t = (got_inf != want_inf).nonzero()[0].tolist()
        why = ("past the mask's 32 * width ids: padded ids are always -inf" if t >= 32 * width else
               f"word {t // 32}, bit {t % 32} of row {r} is {(int(bitmask[r, t // 32]) >> (t % 32)) & 1}: token i is "
               "bit i % 32 of word i // 32")
        _expect(False, f"ch15_ex1 ({group}): {what}: token {t} of row {r} is {'-inf' if got_inf[r, t] else 'kept'}, "
                f"llguidance's apply_token_bitmask_inplace {'masks' if want_inf[r, t] else 'keeps'} it ({why}); "
                f"{int((got_inf != want_inf).sum())} tokens differ")
    kept = ~want_inf
    _expect(torch.equal(got[kept], want[kept]), f"ch15_ex1 ({group}): {what}: the allowed tokens' logits changed "
            "(they must stay as they were, to the bit)")


@pytest.mark.ch15
@pytest.mark.ch15_ex1
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("vocab, width", WITHIN)
def test_ch15_ex1_the_bits_equal_llguidances(vocab, width, dtype):
    with graded("ch15_ex1"):
        for seed in range(3):
            _check_apply(vocab, width, dtype, 100 * vocab + seed, BITS)


@pytest.mark.ch15
@pytest.mark.ch15_ex1
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("vocab, width", PADDED_SHAPES)
def test_ch15_ex1_padded_vocabulary_is_masked(vocab, width, dtype):
    with graded("ch15_ex1"):
        for seed in range(3):
            _check_apply(vocab, width, dtype, 7 * vocab + seed, PADDED)


@pytest.mark.ch15
@pytest.mark.ch15_ex1
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("vocab, width", [(70, 3), (100, 3)])
def test_ch15_ex1_in_place(vocab, width, dtype):
    """The logits passed in are changed and returned (the sampler applies the mask to its own copy);
    the bitmask, which the grammar fills again next step, is left as it was."""
    g = torch.Generator().manual_seed(vocab)
    bitmask = _random_bitmask(g, 4, width)
    logits = torch.randn(4, vocab, generator=g, dtype=torch.float64).to(dtype)
    want, before = _llguidance_apply(logits, bitmask), bitmask.clone()
    what = f"apply_token_bitmask(logits [4, {vocab}] {dtype}, bitmask [4, {width}])"
    with graded("ch15_ex1"), your_code(f"ch15_ex1 ({IN_PLACE})", what):
        got = bitmask_mod.apply_token_bitmask(logits, bitmask)
    _expect(got is logits or (isinstance(got, torch.Tensor) and got.data_ptr() == logits.data_ptr()
                              and got.shape == logits.shape), f"ch15_ex1 ({IN_PLACE}): {what} must return the logits "
            f"it was given (changed in place), got {type(got).__name__}" +
            (" (a new tensor)" if isinstance(got, torch.Tensor) else ""))
    _expect(torch.equal(torch.isneginf(logits), torch.isneginf(want)), f"ch15_ex1 ({IN_PLACE}): {what}: the logits "
            "passed in were not masked in place")
    _expect(torch.equal(bitmask, before), f"ch15_ex1 ({IN_PLACE}): {what} changed the bitmask")


@pytest.mark.ch15
@pytest.mark.ch15_ex1
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ch15_ex1_logits_on_the_gpu_bitmask_on_the_cpu():
    """As the sampler calls it: the grammar fills the bitmask on the CPU, the logits are on the GPU."""
    g = torch.Generator().manual_seed(5)
    bitmask = _random_bitmask(g, 4, 3)
    logits = torch.randn(4, 100, generator=g, dtype=torch.float32)
    want = _llguidance_apply(logits, bitmask)
    with graded("ch15_ex1"), your_code(f"ch15_ex1 ({BITS})", "apply_token_bitmask on CUDA logits"):
        got = bitmask_mod.apply_token_bitmask(logits.cuda(), bitmask)
    _expect(got.device.type == "cuda" and torch.equal(got.cpu(), want), f"ch15_ex1 ({BITS}): with logits on "
            "the GPU and the bitmask on the CPU the result differs from llguidance's (or left the GPU)")


# --- ch15_ex2: a toy vocabulary, and llguidance as the reference ---------------------------------
ALPHABET = "abc12-x"
EOS_TEXT, NO_TEXT = "</s>", ("<none>", "<nothing>")  # the toy tokenizer's EOS and two tokens without text
NUM_REGEXES = 250
MAX_WALK = 6


def _toy_pieces() -> list[str]:
    rng = random.Random(15)
    pieces = set(ALPHABET) | {"ab", "bc", "abc", "12", "-1", "a-", "1-", "--"}
    while len(pieces) < 47:
        pieces.add("".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 3))))
    return sorted(pieces)


@lru_cache(maxsize=1)
def toy_vocabulary() -> tuple[list[str], int, list[int]]:
    """(the token texts as `token_mask` takes them, the EOS id, the ids of the tokens without text ("")):
    47 short pieces, EOS at id 20, the two empty tokens at 9 and at the end."""
    pieces = _toy_pieces()
    vocab = pieces[:9] + [""] + pieces[9:19] + [EOS_TEXT] + pieces[19:] + [""]
    return vocab, 20, [9, len(vocab) - 1]


def _hf_tokenizer(texts: list[str]):
    """A Hugging Face fast tokenizer whose ids are `texts` (byte-level BPE without merges: printable
    ASCII stands for itself); EOS and the no-text tokens are special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(texts)}, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in (EOS_TEXT, *NO_TEXT) if t in texts])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TEXT)
    assert hf.convert_ids_to_tokens(list(range(len(texts)))) == texts and hf.eos_token_id == texts.index(EOS_TEXT)
    return hf


@lru_cache(maxsize=1)
def _llguidance_tokenizers():
    """(llguidance's toy-vocabulary tokenizer, its one-character-per-token tokenizer, the character ids)."""
    llg = pytest.importorskip("llguidance")
    import llguidance.hf

    vocab, eos, empty = toy_vocabulary()
    texts = [NO_TEXT[empty.index(i)] if i in empty else t for i, t in enumerate(vocab)]
    chars = list(ALPHABET) + [EOS_TEXT]
    return (llg.hf.from_tokenizer(_hf_tokenizer(texts), n_vocab=len(texts)),
            llg.hf.from_tokenizer(_hf_tokenizer(chars), n_vocab=len(chars)), {c: i for i, c in enumerate(chars)})


def random_regex(rng: random.Random, depth: int = 0) -> str:
    """A random regex over ALPHABET: alternatives of 1-4 pieces, each an atom (a literal, a class, a
    group) with an optional quantifier."""
    def atom() -> str:
        r = rng.random()
        if depth < 2 and r < 0.2:
            return "(" + random_regex(rng, depth + 1) + ")"
        if r < 0.35:
            return rng.choice(["[a-c]", "[12]", r"\d", "[abx]", "[-x]"])
        return rng.choice(["a", "b", "c", "1", "2", r"\-", "x", "ab", "c-"])

    def piece() -> str:
        a, r = atom(), rng.random()
        if r < 0.1:
            return a + "?"
        if r < 0.18:
            return a + "*"
        if r < 0.24:
            return a + "+"
        if r < 0.32:
            m = rng.randint(0, 2)
            return a + "{%d,%d}" % (m, m + rng.randint(0, 2))
        return a
    return "|".join("".join(piece() for _ in range(rng.randint(1, 4))) for _ in range(rng.choice([1, 1, 2, 3])))


def _matcher(ll_tokenizer, pattern: str):
    import llguidance

    m = llguidance.LLMatcher(ll_tokenizer, llguidance.grammar_from("regex", pattern), log_level=0)
    assert not m.is_error(), (pattern, m.get_error())
    return m


def _reference_row(pattern: str, prefix: str, token_matcher) -> tuple[list[bool], bool]:
    """(llguidance's answer for every token of the toy vocabulary after `prefix`, whether a span is forced
    there): the toy matcher's mask outside forced spans, the character matcher's inside them."""
    vocab, eos, empty = toy_vocabulary()
    bias = token_matcher.compute_logit_bias()
    row = [bool(bias[i]) for i in range(len(vocab))]
    forced = bool(token_matcher.compute_ff_bytes())
    if forced:  # llguidance offers only the tokenizer's split of a forced span: ask character by character
        _, char_tokenizer, char_ids = _llguidance_tokenizers()
        chars = _matcher(char_tokenizer, pattern)
        assert chars.consume_tokens([char_ids[c] for c in prefix]), (pattern, prefix)
        for i, t in enumerate(vocab):
            if i != eos and i not in empty:
                row[i] = chars.validate_tokens([char_ids[c] for c in t]) == len(t)
        assert row[eos] == chars.is_accepting()
    return row, forced


@lru_cache(maxsize=1)
def regex_cases() -> list[tuple[str, str, list[bool], bool]]:
    """(pattern, prefix, llguidance's row, forced) at every prefix of a random walk per random regex
    (each walk step a random token the toy matcher allows, EOS excluded)."""
    token_tokenizer, _, _ = _llguidance_tokenizers()
    vocab, eos, _ = toy_vocabulary()
    rng, cases = random.Random(1515), []
    for _ in range(NUM_REGEXES):
        pattern = random_regex(rng)
        m, prefix = _matcher(token_tokenizer, pattern), ""
        for _ in range(rng.randint(0, MAX_WALK) + 1):
            row, forced = _reference_row(pattern, prefix, m)
            cases.append((pattern, prefix, row, forced))
            nxt = [i for i, ok in enumerate(row) if ok and i != eos and m.validate_tokens([i]) == 1]
            if not nxt:
                break
            token = rng.choice(nxt)
            assert m.consume_token(token)
            prefix += vocab[token]
    return cases


TOY_VOCAB = ["1", "2", "3", "12", "23", "-", "-1", "3-", "a", "123", "--", "</s>", ""]  # the chapter's, and ""
BY_EXAMPLE = [  # (pattern, prefix, eos id, allowed ids), each with what it shows
    (r"\d{3}-\d{2}", "", 11, [0, 1, 2, 3, 4, 9]),  # any start of three digits, no more
    (r"\d{3}-\d{2}", "12", 11, [0, 1, 2, 7]),  # "3-" fits, "23" would be four digits
    (r"\d{3}-\d{2}", "123", 11, [5, 6]),
    (r"\d{3}-\d{2}", "123-12", 11, [11]),  # a whole match that cannot go on: EOS only
    (r"\d{3}-\d{2}", "123-1", 11, [0, 1, 2]),  # no EOS before the match is whole
    (r"12|123", "12", 11, [2, 11]),  # a whole match that can go on: EOS and "3"
    (r"1(2|-)*", "1", 0, [0, 1, 5, 10]),  # EOS is token 0 here (its text is not read): "1" is a whole match
    (r"a", "b", 11, []),  # a prefix that matches nothing: nothing allowed
]


def _check_mask(pattern: str, prefix: str, vocab: list[str], eos: int, want: list[bool], groups: list[str],
                where: str) -> None:
    """`token_mask(pattern, prefix, vocab, eos)` against `want`, on the entries of `groups` only."""
    empty = [i for i, t in enumerate(vocab) if t == "" and i != eos]
    what = f"token_mask({pattern!r}, prefix={prefix!r}, vocab, eos_token_id={eos})"
    before = list(vocab)
    with your_code(f"ch15_ex2 ({groups[0]})", what):
        got = regex_index.token_mask(pattern, prefix, vocab, eos)
    _expect(vocab == before, f"ch15_ex2 ({groups[0]}): {what} changed its vocab")
    _expect(isinstance(got, (list, tuple)) and len(got) == len(vocab) and all(x in (True, False) for x in got),
            f"ch15_ex2 ({groups[0]}): {what} must return {len(vocab)} bools (one per token), got {got!r:.200}")
    for i, (g, w) in enumerate(zip(got, want)):
        group = EOS_GROUP if i == eos else EMPTY if i in empty else PREFIXES
        if group in groups and bool(g) != w:
            rule = {EOS_GROUP: "EOS is allowed exactly when the prefix itself is a whole match",
                    EMPTY: "a token without text adds nothing and is never allowed",
                    PREFIXES: "a token is allowed when prefix + token is a prefix of some whole match"}[group]
            _expect(False, f"ch15_ex2 ({group}): {what}: token {i} ({vocab[i]!r}) is "
                    f"{'allowed' if g else 'not allowed'}, {where} {'allows' if w else 'does not allow'} it ({rule})")


def _check_random(groups: list[str]) -> None:
    vocab, eos, _ = toy_vocabulary()
    for pattern, prefix, row, forced in regex_cases():
        where = ("llguidance (character by character: a forced span)" if forced else
                 "llguidance's matcher on the toy vocabulary")
        _check_mask(pattern, prefix, vocab, eos, row, groups, where)


@pytest.mark.ch15
@pytest.mark.ch15_ex2
def test_ch15_ex2_by_example():
    with graded("ch15_ex2"):
        for pattern, prefix, eos, allowed in BY_EXAMPLE:
            want = [i in allowed for i in range(len(TOY_VOCAB))]
            _check_mask(pattern, prefix, TOY_VOCAB, eos, want, [PREFIXES, EOS_GROUP, EMPTY], "the chapter's rule")


@pytest.mark.ch15
@pytest.mark.ch15_ex2
def test_ch15_ex2_prefixes_equal_llguidances():
    with graded("ch15_ex2"):
        _check_random([PREFIXES])


@pytest.mark.ch15
@pytest.mark.ch15_ex2
def test_ch15_ex2_eos_equals_llguidances():
    with graded("ch15_ex2"):
        _check_random([EOS_GROUP])


@pytest.mark.ch15
@pytest.mark.ch15_ex2
def test_ch15_ex2_empty_tokens_are_never_allowed():
    with graded("ch15_ex2"):
        _check_random([EMPTY])


# --- the graders catch plausible wrong answers (not graded; the wrong answers are written here) ------
def _fails(ex: str, group: str, test, *args) -> str:
    with pytest.raises(AssertionError, match=rf"{ex} \({group}\)") as info:
        test(*args)
    return str(info.value)


def _wrong_apply_forgets_padding(logits, bitmask):  # only the ids the mask covers are looked at
    vocab = min(logits.shape[-1], 32 * bitmask.shape[-1])
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    logits[:, :vocab].masked_fill_(bits.flatten(1)[:, :vocab] == 0, float("-inf"))
    return logits


def _wrong_apply_reversed_bits(logits, bitmask):  # token i as bit 31 - i % 32
    bits = (bitmask[:, :, None] >> (31 - torch.arange(32, dtype=torch.int32))) & 1
    keep = torch.zeros(logits.shape, dtype=torch.bool)
    n = min(logits.shape[-1], 32 * bitmask.shape[-1])
    keep[:, :n] = bits.flatten(1)[:, :n].bool()
    return logits.masked_fill_(~keep, float("-inf"))


def _wrong_apply_copy(logits, bitmask):  # right values, in a new tensor
    return _grader_apply_token_bitmask(logits.clone(), bitmask)


@pytest.mark.ch15
@pytest.mark.parametrize("wrong, group, test, args", [
    (_wrong_apply_forgets_padding, PADDED, test_ch15_ex1_padded_vocabulary_is_masked, (100, 3, torch.float32)),
    (_wrong_apply_reversed_bits, BITS, test_ch15_ex1_the_bits_equal_llguidances, (70, 3, torch.float32)),
    (_wrong_apply_copy, IN_PLACE, test_ch15_ex1_in_place, (70, 3, torch.float32)),
], ids=["padded ids kept", "bits reversed", "a new tensor"])
def test_ch15_ex1_grader_catches(wrong, group, test, args):
    with mock.patch.object(bitmask_mod, "apply_token_bitmask", wrong):
        _fails("ch15_ex1", group, test, *args)
        if wrong is _wrong_apply_forgets_padding:  # right within the mask's bits
            test_ch15_ex1_the_bits_equal_llguidances(70, 3, torch.bfloat16)
        if wrong is _wrong_apply_copy:  # right values
            test_ch15_ex1_the_bits_equal_llguidances(70, 3, torch.float64)
            test_ch15_ex1_padded_vocabulary_is_masked(100, 3, torch.float64)


def _wrong_mask_eos_always(pattern, prefix, vocab, eos_token_id):  # EOS allowed at every step
    out = _grader_token_mask(pattern, prefix, vocab, eos_token_id)
    out[eos_token_id] = True
    return out


def _wrong_mask_eos_partial(pattern, prefix, vocab, eos_token_id):  # EOS as a token without text
    out = _grader_token_mask(pattern, prefix, vocab, eos_token_id)
    out[eos_token_id] = regex.fullmatch(pattern, prefix, partial=True) is not None
    return out


def _wrong_mask_token_alone(pattern, prefix, vocab, eos_token_id):  # the token matched without the prefix
    out = _grader_token_mask(pattern, "", vocab, eos_token_id)
    out[eos_token_id] = regex.fullmatch(pattern, prefix) is not None
    return out


def _wrong_mask_match(pattern, prefix, vocab, eos_token_id):  # match, not fullmatch: text past a match
    out = [regex.match(pattern, prefix + t, partial=True) is not None and t != "" for t in vocab]
    out[eos_token_id] = regex.fullmatch(pattern, prefix) is not None
    return out


def _wrong_mask_allows_empty(pattern, prefix, vocab, eos_token_id):  # "" keeps any viable prefix viable
    out = _grader_token_mask(pattern, prefix, vocab, eos_token_id)
    ok = regex.fullmatch(pattern, prefix, partial=True) is not None
    return [ok if t == "" and i != eos_token_id else x for i, (t, x) in enumerate(zip(vocab, out))]


@pytest.mark.ch15
@pytest.mark.parametrize("wrong, group, test", [
    (_wrong_mask_eos_always, EOS_GROUP, test_ch15_ex2_eos_equals_llguidances),
    (_wrong_mask_eos_partial, EOS_GROUP, test_ch15_ex2_eos_equals_llguidances),
    (_wrong_mask_token_alone, PREFIXES, test_ch15_ex2_prefixes_equal_llguidances),
    (_wrong_mask_match, PREFIXES, test_ch15_ex2_prefixes_equal_llguidances),
    (_wrong_mask_allows_empty, EMPTY, test_ch15_ex2_empty_tokens_are_never_allowed),
], ids=["EOS always", "EOS on a partial match", "the token alone", "match, not fullmatch", "empty tokens allowed"])
def test_ch15_ex2_grader_catches(wrong, group, test):
    with mock.patch.object(regex_index, "token_mask", wrong):
        _fails("ch15_ex2", group, test)
        _fails("ch15_ex2", group, test_ch15_ex2_by_example)
        for other in {test_ch15_ex2_prefixes_equal_llguidances, test_ch15_ex2_eos_equals_llguidances,
                      test_ch15_ex2_empty_tokens_are_never_allowed} - {test}:
            other()  # only its own group fails


@pytest.mark.ch15
def test_ch15_grader_stand_ins_follow_the_contracts():
    """The stand-ins the graders put in place pass the graders; the random cases are varied (forced spans,
    whole matches, dead ends), and llguidance's answers agree with the partial-match rule everywhere the
    grader compares them."""
    with mock.patch.object(bitmask_mod, "apply_token_bitmask", _grader_apply_token_bitmask):
        for dtype in DTYPES:
            test_ch15_ex1_the_bits_equal_llguidances(70, 3, dtype)
            test_ch15_ex1_padded_vocabulary_is_masked(100, 3, dtype)
            test_ch15_ex1_in_place(100, 3, dtype)
    with mock.patch.object(regex_index, "token_mask", _grader_token_mask):
        test_ch15_ex2_by_example()
        test_ch15_ex2_prefixes_equal_llguidances()
        test_ch15_ex2_eos_equals_llguidances()
        test_ch15_ex2_empty_tokens_are_never_allowed()
    cases = regex_cases()
    vocab, eos, _ = toy_vocabulary()
    assert len(cases) > 3 * NUM_REGEXES
    assert sum(f for *_, f in cases) > 20  # forced spans
    assert sum(row[eos] for _, _, row, _ in cases) > 100  # whole matches
    assert sum(row[eos] and sum(row) == 1 for _, _, row, _ in cases) > 30  # EOS only
    assert sum(sum(row) >= 5 for _, _, row, _ in cases) > 200  # many tokens allowed
