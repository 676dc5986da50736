"""Grading tests for chapter 01's extend exercise (`python -m minivllm.course.grade ch01_ex3`, or
`pytest -m ch01_ex3 --impl=exercises`).

ch01_ex3, `check_stop_strings`, is graded by its contract, written here, never by the book's code (the
engine's own `minivllm.engine.detokenizer.check_stop_strings`, chapter 10, is a tripwire: an answer that
calls it fails):
* fixed cases, each telling one rule apart: a stop string spanning the old and the new characters, one
  wholly in the old ones, one ending right at the boundary, the first in the text against the first
  listed, two starting at the same index, the cut before or after the string, nothing new;
* random texts over a small alphabet streamed in random pieces, some empty, as an engine appends a
  step's text (hypothesis): at every step, until the first stop, the answer equals the one found by
  listing every occurrence of every stop string in the whole text;
* the default model's tokenizer decoding an answer token by token: stop strings that start inside a
  token and span tokens, the text cut where the contract says;
* a text of 10**7 characters checked 200 times, one new character each, within `WINDOW_LIMIT_S`
  (searching the whole text each time takes seconds: only the new characters and a tail can hold a
  stop string that counts);
* the ValueError of each invalid `new_char_count`.
The tests at the end show that plausible wrong answers fail.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters import load, raises_value_error

HYPOTHESIS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
WINDOW_LIMIT_S = 2.0  # 200 checks of a 10**7-character text: a window takes milliseconds, the whole text seconds
ANSWER = ("The capital of France is Paris.\n\nParis is also France's largest city; its capital region is home "
          "to about twelve million people.")


@pytest.fixture(scope="module")
def ch01(impl_name):
    return load("ch01_sequences", impl_name)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _every_occurrence(text: str, new_char_count: int, stop: list[str], include: bool):
    """The contract, by listing every occurrence of every stop string in the whole text: of those that
    end among the new characters, the first to start, then the first listed."""
    boundary, best = len(text) - new_char_count, None
    for order, s in enumerate(stop):
        for i in range(len(text) - len(s) + 1):
            if text.startswith(s, i) and i + len(s) > boundary and (best is None or (i, order) < best[:2]):
                best = (i, order, s)
    if best is None:
        return None
    i, _, s = best
    return s, i + len(s) if include else i


def _check_one(mod, text, new, stop, include, want) -> None:
    got = mod.check_stop_strings(text, new, list(stop), include)
    _expect(got == want and (got is None or (type(got[0]) is str and type(got[1]) is int)),
            f"ch01_ex3: check_stop_strings({text!r}, new_char_count={new}, stop={stop!r}, "
            f"include_stop_str_in_output={include}): expected {want!r}, got {got!r}")


KNOWN = [  # (output_text, new_char_count, stop, include_stop_str_in_output, expected): what each case tells apart
    ("Paris.\n\nIt", 3, ["\n\n"], False, ("\n\n", 6)),  # the string spans the old and the new characters
    ("Paris.\n\nIt", 3, ["\n\n"], True, ("\n\n", 8)),  # ... kept: cut after it
    ("abc STOP def", 4, ["STOP"], False, None),  # wholly in the characters already checked
    ("STOPx", 1, ["STOP"], False, None),  # ends right at the boundary: checked at the step before
    ("xSTOPy", 2, ["STOP"], True, ("STOP", 5)),  # its last character is new
    ("abcabc", 3, ["bc"], False, ("bc", 4)),  # an earlier occurrence ended in the old characters
    ("ab", 2, ["b", "a"], False, ("a", 0)),  # the first in the text, not the first listed
    ("xabc", 3, ["bc", "ab"], True, ("ab", 3)),  # the first to start, kept: cut after it
    ("xabc", 3, ["abc", "ab"], True, ("abc", 4)),  # two start together: the first listed
    ("hello", 0, ["lo"], False, None),  # nothing new
    ("hello", 5, [], True, None),  # no stop strings
    ("hello", 5, ["hello"], False, ("hello", 0)),  # the whole text, all of it new
]


def _check_known(mod) -> None:
    for text, new, stop, include, want in KNOWN:
        assert _every_occurrence(text, new, stop, include) == want, "grader: a known case disagrees with the contract"
        _check_one(mod, text, new, stop, include, want)


@pytest.mark.ch01
@pytest.mark.ch01_ex3
def test_ch01_ex3_known_cases(ch01):
    _check_known(ch01)


def _stream(mod, pieces: list[str], stop: list[str], include: bool) -> None:
    """Append the pieces one by one, as an engine appends a step's text, checking after each until a stop."""
    text = ""
    for piece in pieces:
        text += piece
        want = _every_occurrence(text, len(piece), stop, include)
        _check_one(mod, text, len(piece), stop, include, want)
        if want is not None:
            return


def _check_streams(mod) -> None:
    chars = st.sampled_from("ab\n")

    @settings(max_examples=300, **HYPOTHESIS)
    @given(pieces=st.lists(st.text(chars, max_size=5), min_size=1, max_size=12),
           stop=st.lists(st.text(chars, min_size=1, max_size=4), max_size=3), include=st.booleans())
    def run(pieces, stop, include):
        _stream(mod, pieces, stop, include)
    run()


@pytest.mark.ch01
@pytest.mark.ch01_ex3
def test_ch01_ex3_streamed_texts_against_every_occurrence(ch01):
    _check_streams(ch01)


@pytest.fixture(scope="module")
def tokenizer():
    from minivllm.transformers_utils.model_files import load_tokenizer

    return load_tokenizer()


def _check_tokenizer(mod, tokenizer) -> None:
    """The answer decoded token by token (the whole completion each time, as chapter 01 decodes); the
    stop strings chosen to start inside a token, to span tokens, and to occur twice."""
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    texts = [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    assert texts[-1] == ANSWER and all(b.startswith(a) for a, b in zip(texts, texts[1:])), \
        "grader: decoding the answer token by token does not grow its text"
    starts = {len(t) for t in texts}  # where a token's text starts
    inside = spanning = 0
    for stop, include in [(["apit"], False), (["apit"], True), ([".\n\nPar"], False), (["ital", "Paris"], True),
                          (["France's", "largest"], False), (["twelve million", "nowhere"], True)]:
        first = min(i for i in (ANSWER.find(s) for s in stop) if i != -1)
        end = first + len(next(s for s in stop if ANSWER.startswith(s, first)))
        inside += first not in starts
        spanning += any(first < p < end for p in starts)
        want_found = None
        for before, after in zip(texts, texts[1:]):
            want = _every_occurrence(after, len(after) - len(before), stop, include)
            _check_one(mod, after, len(after) - len(before), stop, include, want)
            if want is not None:
                want_found = want
                break
        assert want_found is not None and want_found[1] == (end if include else first), \
            f"grader: the stop strings {stop!r} should have cut the answer at {end if include else first}"
    assert inside and spanning, "grader: no stop string starts inside a token, or none spans tokens"


@pytest.mark.ch01
@pytest.mark.ch01_ex3
def test_ch01_ex3_a_decoded_answer_stops_where_its_text_says(ch01, tokenizer):
    _check_tokenizer(ch01, tokenizer)


def _check_window(mod) -> None:
    text, stop = "a" * 10**7 + "b", ["aaab" + "x", "ababab"]
    started = time.perf_counter()
    for _ in range(200):
        got = mod.check_stop_strings(text, 1, stop, False)
        _expect(got is None, f"ch01_ex3: no stop string occurs in the text, got {got!r}")
        if time.perf_counter() - started > WINDOW_LIMIT_S:
            raise AssertionError(f"ch01_ex3: 200 checks of a 10**7-character text with one new character each took "
                                 f"more than {WINDOW_LIMIT_S} s: search only the new characters and the "
                                 "len(s) - 1 before them")


@pytest.mark.ch01
@pytest.mark.ch01_ex3
def test_ch01_ex3_looks_only_at_the_new_characters_and_a_tail(ch01):
    _check_window(ch01)



@pytest.mark.ch01
@pytest.mark.ch01_ex3
@pytest.mark.parametrize("new", [-1, 6, True, 2.0, "2", None])
def test_ch01_ex3_invalid_new_char_count(ch01, new):
    raises_value_error(lambda: ch01.check_stop_strings("hello", new, ["lo"], False),
                        f"ch01_ex3: check_stop_strings('hello', new_char_count={new!r})")


# --- plausible wrong answers fail (not graded: they check the graders) -----------------------------
def _wrong(only_new=False, whole_text=False, tail_of_len=False, first_listed=False, never_include=False):
    def check_stop_strings(output_text, new_char_count, stop, include_stop_str_in_output):
        best = None
        for order, s in enumerate(stop):
            if only_new:
                start = len(output_text) - new_char_count
            elif whole_text:
                start = 0
            else:
                start = len(output_text) - new_char_count - len(s) + (0 if tail_of_len else 1)
            i = output_text.find(s, max(0, start))
            if new_char_count and i != -1 and (best is None or (order if first_listed else i) < best[0]):
                best = (order if first_listed else i, i, s)
        if best is None:
            return None
        _, i, s = best
        return s, i + len(s) if include_stop_str_in_output and not never_include else i
    return check_stop_strings


CHECKS = [_check_known, _check_streams]
WRONG = {"only-the-new-characters": _wrong(only_new=True), "the-whole-text": _wrong(whole_text=True),
         "a-tail-of-len-s": _wrong(tail_of_len=True), "the-first-listed": _wrong(first_listed=True),
         "never-includes-the-string": _wrong(never_include=True)}


def _whole_text(output_text, new_char_count, stop, include_stop_str_in_output):
    """Right on every case, but it searches the whole text each time (then skips what ended before)."""
    boundary, best = len(output_text) - new_char_count, None
    for s in stop:
        i = output_text.find(s)
        while i != -1 and i + len(s) <= boundary:
            i = output_text.find(s, i + 1)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return None
    i, s = best
    return s, i + len(s) if include_stop_str_in_output else i


@pytest.mark.parametrize("name", list(WRONG))
def test_ch01_ex3_wrong_answers_fail(name):
    """Each wrong answer fails the fixed cases (the streamed texts may miss some: a stream stops at its
    first stop string, so an answer that also looks at older text finds nothing more there)."""
    with pytest.raises(AssertionError, match="ch01_ex3: "):
        _check_known(SimpleNamespace(check_stop_strings=WRONG[name]))


def test_ch01_ex3_whole_text_search_is_too_slow():
    """Searching the whole text each time passes every case but fails the window's time limit."""
    answer = SimpleNamespace(check_stop_strings=_whole_text)
    for check in CHECKS:
        check(answer)
    with pytest.raises(AssertionError, match="took more than"):
        _check_window(answer)


def test_ch01_ex3_graders_reference_passes():
    right = SimpleNamespace(check_stop_strings=_wrong())
    for check in [*CHECKS, _check_window]:
        check(right)
