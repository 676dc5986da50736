"""Grading tests for chapter 01's rebuild exercises (`python -m minivllm.course.grade ch01_ex1`, or `pytest -m ch01_ex1`).

ch01_ex1 is the build of the sequence: the token views (`_TokenViews`), `Sequence.__init__` and
`append_token`, the block arithmetic (`blocks_needed`, `token_block`) and its views (`_BlockViews`),
and the stop rules (`check_stop`). ch01_ex2 is `check_sampling_filters`, the range checks of
temperature, top_p, top_k and min_p behind `SamplingParams`. Both are graded in the package itself: in
a student edition they are the student's code, exported from the chapter (stubs until filled), and
there is no reference to compare with. What is checked is the contract, written in the tests.

The build scores by parts (`@pytest.mark.group`, the groups of `EXERCISES["ch01_ex1"]`), each on its
own: the grader's own pieces (`_PARTS`, written differently from the book's) stand in for the parts a
test is not about (`graded`), so a student sees which part works. Random inputs are derandomized (the
same answer always scores the same points). The tests at the end show that plausible wrong answers
lose exactly their part's points.
"""
from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import minivllm.sampling_params as sp
from engine_helpers import one_thread
import minivllm.sequence as sequence
from minivllm.course.grade import EXERCISES
from minivllm.utils.checks import is_int, require_int, require_number
from minivllm.sampling_params import SAMPLING_EPS, SamplingParams
from minivllm.sequence import Sequence, SequenceStatus


_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)
TOKENS, BLOCKS, STOPS = (name for name, _ in EXERCISES["ch01_ex1"].groups)
SETTINGS = dict(deadline=None, derandomize=True, database=None)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


# --- the grader's stand-ins ------------------------------------------------------------------------
def _init_stand_in(self, token_ids, sampling_params=None, block_size=sequence.DEFAULT_BLOCK_SIZE, prompt=None,
                   seq_id=None):
    ids = list(token_ids)
    bad = [t for t in ids if not is_int(t) or t < 0]
    if not ids or bad:
        raise ValueError(f"a prompt is a non-empty list of ints >= 0, got {ids!r:.80}")
    if not is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    self.token_ids, self.num_prompt_tokens = [int(t) for t in ids], len(ids)
    self.sampling_params = SamplingParams() if sampling_params is None else sampling_params
    self.block_size, self.prompt, self.request_id = int(block_size), prompt, None
    self.seq_id = seq_id if seq_id is not None else next(Sequence._ids)
    self.status, self.num_cached_tokens, self.block_table = SequenceStatus.WAITING, 0, []


def _append_stand_in(self, token_id):
    self.token_ids += [token_id]


def _blocks_needed_stand_in(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def _token_block_stand_in(token_ids: list[int], block_size: int, i: int) -> list[int]:
    if i < 0 or i * block_size >= len(token_ids):
        raise IndexError(f"block {i} out of range")
    return list(token_ids[i * block_size:(i + 1) * block_size])


def _block_stand_in(self, i):
    return _token_block_stand_in(self.token_ids, self.block_size, i)


def _check_stop_stand_in(seq, eos_token_ids, max_model_len) -> bool:
    p, t, n_out = seq.sampling_params, seq.token_ids[-1], len(seq.token_ids) - seq.num_prompt_tokens
    if n_out > p.min_tokens and (t in p.stop_token_ids or (not p.ignore_eos and t in eos_token_ids)):
        seq.status = SequenceStatus.FINISHED_STOPPED
        return True
    if len(seq.token_ids) >= max_model_len or (p.max_tokens is not None and n_out >= p.max_tokens):
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def _filters_stand_in(p) -> None:
    p.temperature = require_number("temperature", p.temperature, minimum=0.0)
    p.top_p = require_number("top_p", p.top_p, maximum=1.0)
    if not p.top_p > 0:
        raise ValueError(f"top_p must be > 0, got {p.top_p!r}")
    p.top_k = 0 if require_int("top_k", p.top_k, minimum=-1) == -1 else int(p.top_k)
    p.min_p = require_number("min_p", p.min_p, 0.0, 1.0)
    if p.temperature < SAMPLING_EPS:
        p.top_p, p.top_k, p.min_p = 1.0, 0, 0.0


def _views(**fns) -> list:
    return [(Sequence, name, fn if name.startswith("__") or name == "block" else property(fn)) for name, fn in fns.items()]


# part -> (owner, name, the grader's piece). `graded` reads this table (never `STAND_INS`, which the
# tripwires rewire while the build's own tests run): the grader's pieces stand in for the other parts.
_PARTS = {
    TOKENS: [(Sequence, "__init__", _init_stand_in), (Sequence, "append_token", _append_stand_in)] + _views(
        num_tokens=lambda s: len(s.token_ids), last_token=lambda s: s.token_ids[len(s.token_ids) - 1],
        num_completion_tokens=lambda s: len(s.token_ids[s.num_prompt_tokens:]),
        prompt_token_ids=lambda s: list(s.token_ids[:s.num_prompt_tokens]),
        completion_token_ids=lambda s: list(s.token_ids[s.num_prompt_tokens:]), __len__=lambda s: len(s.token_ids)),
    BLOCKS: [(sequence, "blocks_needed", _blocks_needed_stand_in), (sequence, "token_block", _token_block_stand_in)]
    + _views(num_blocks=lambda s: _blocks_needed_stand_in(len(s.token_ids), s.block_size),
             num_cached_blocks=lambda s: s.num_cached_tokens // s.block_size,
             last_block_num_tokens=lambda s: (len(s.token_ids) - 1) % s.block_size + 1, block=_block_stand_in),
    STOPS: [(sequence, "check_stop", _check_stop_stand_in)],
    "ch01_ex2": [(sp, "check_sampling_filters", _filters_stand_in)],
}
STAND_INS = {"ch01_ex1": [e for part in (TOKENS, BLOCKS, STOPS) for e in _PARTS[part]], "ch01_ex2": _PARTS["ch01_ex2"]}


@contextmanager
def graded(what: str | None, wrong: list | None = None):
    """The package's (the student's) code for `what`, the grader's pieces for chapter 01's other graded
    pieces. `what`: a part of the build (`TOKENS`, `BLOCKS`, `STOPS`), "ch01_ex1" (the whole build),
    "ch01_ex2", or None (the grader's pieces everywhere). `wrong`: (owner, name, piece) put in place of
    the package's, for the tests that show a wrong answer losing its part."""
    mine = {TOKENS, BLOCKS, STOPS} if what == "ch01_ex1" else {what}
    with ExitStack() as stack:
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        for part, patches in _PARTS.items():
            if part not in mine:
                for owner, name, fn in patches:
                    mp.setattr(owner, name, fn)
        for owner, name, fn in wrong or []:
            mp.setattr(owner, name, fn)
        yield


# --- ch01_ex1, tokens and lengths ----------------------------------------------------------------
def check_tokens() -> None:
    """Random prompts grown token by token: every view after every token, a new sequence's fields,
    a caller's prompt list left alone; the ValueErrors of a bad prompt or block size."""
    @settings(max_examples=150, **SETTINGS)
    # a fixed case first (the draws depend on where the check is called from): a grown caller's list, one
    # token generated
    @example(prompt=[1, 2], numpy=False, generated=[3], seq_id=None)
    @given(prompt=st.lists(st.integers(0, 50), min_size=1, max_size=12), numpy=st.booleans(),
           generated=st.lists(st.integers(0, 50), max_size=12), seq_id=st.one_of(st.none(), st.integers(0, 9)))
    def run(prompt, numpy, generated, seq_id):
        given_ids = [np.int64(t) for t in prompt] if numpy else list(prompt)
        params = SamplingParams(max_tokens=7)
        block_size = np.int64(4) if numpy else 4
        seq = Sequence(given_ids, params, block_size=block_size, prompt="text", seq_id=seq_id)
        at = f"ch01_ex1: Sequence({prompt}{' as NumPy ints, block_size=np.int64(4)' if numpy else ''})"
        _expect(type(seq.block_size) is int, f"{at}: block_size should be kept as a Python int, got "
                f"{seq.block_size!r} of type {type(seq.block_size).__name__}")
        fields = {"num_prompt_tokens": len(prompt), "status": SequenceStatus.WAITING, "prompt": "text",
                  "request_id": None, "num_cached_tokens": 0, "block_table": [], "block_size": 4}
        for name, want in fields.items():
            got = getattr(seq, name, "<missing>")
            _expect(got == want, f"{at}: a new sequence's {name} should be {want!r}, got {got!r}")
        _expect(seq.sampling_params is params, f"{at}: sampling_params should be the object given")
        if seq_id is not None:
            _expect(seq.seq_id == seq_id, f"{at}, seq_id={seq_id}: seq_id should be {seq_id}, got {seq.seq_id!r}")
        else:
            other = Sequence([1])
            _expect(isinstance(seq.seq_id, int) and seq.seq_id != other.seq_id,
                    f"{at}: without seq_id, each sequence gets a fresh int id; two got {seq.seq_id!r}, {other.seq_id!r}")
        first, second = Sequence([3]).sampling_params, Sequence([4]).sampling_params
        _expect(isinstance(first, SamplingParams), f"{at}: the default sampling_params should be a SamplingParams()")
        _expect(first is not second, "ch01_ex1: two sequences made without sampling_params share one SamplingParams "
                "object: each should get a new SamplingParams() (a change to one request's must not reach another)")
        tokens = list(prompt)
        for step in range(len(generated) + 1):
            if step:
                seq.append_token(generated[step - 1])
                tokens.append(generated[step - 1])
            now = f"{at} after appending {generated[:step]}"
            _expect(type(seq.token_ids) is list and seq.token_ids == tokens and all(type(t) is int for t in seq.token_ids),
                    f"{now}: token_ids should be the list of Python ints {tokens}, got {seq.token_ids!r}")
            views = {"num_tokens": len(tokens), "len(seq)": len(tokens), "last_token": tokens[-1],
                     "num_completion_tokens": step, "prompt_token_ids": list(prompt),
                     "completion_token_ids": list(generated[:step]), "num_prompt_tokens": len(prompt)}
            for name, want in views.items():
                got = len(seq) if name == "len(seq)" else getattr(seq, name)
                _expect(type(got) is type(want) and got == want, f"{now}: {name} should be {want!r}, got {got!r}")
            for name in ("prompt_token_ids", "completion_token_ids"):
                view = getattr(seq, name)
                view.append(99)
                _expect(seq.token_ids == tokens, f"{now}: changing the list {name} returned changed the sequence: "
                        "return a new list")
        _expect([int(t) for t in given_ids] == prompt and len(given_ids) == len(prompt),
                f"{at}: appending tokens changed the caller's prompt list to {given_ids}: copy the prompt")
    run()
    for prompt in ([5], [3, 1, 4, 1, 5]):
        at = f"ch01_ex1: Sequence(a generator of {prompt}) (a prompt may be any non-empty iterable)"
        try:
            seq = Sequence(t for t in prompt)
        except Exception as e:  # noqa: BLE001 (a student's error becomes the grader's message)
            raise AssertionError(f"{at} raised {type(e).__name__}: {e} (a generator has no len() and can be read "
                                 "only once)") from e
        got = (seq.token_ids, seq.num_prompt_tokens, seq.prompt_token_ids, seq.num_completion_tokens)
        want = (prompt, len(prompt), prompt, 0)
        _expect(got == want, f"{at}: (token_ids, num_prompt_tokens, prompt_token_ids, num_completion_tokens) "
                f"should be {want}, got {got}")
    for bad in ([], [1, -2], [1, 2.5], [True, 1], ["3"]):
        try:
            Sequence(bad)
        except ValueError:
            continue
        raise AssertionError(f"ch01_ex1: Sequence({bad!r}) should raise ValueError (a prompt is a non-empty list of "
                             "ints >= 0)")
    for bad in (0, -1, 2.0, True):
        try:
            Sequence([1, 2], block_size=bad)
        except ValueError:
            continue
        raise AssertionError(f"ch01_ex1: Sequence([1, 2], block_size={bad!r}) should raise ValueError (an int >= 1)")


@pytest.mark.ch01
@pytest.mark.ch01_ex1
@pytest.mark.group(TOKENS)
def test_ch01_ex1_tokens_and_lengths():
    with graded(TOKENS):
        check_tokens()


# --- ch01_ex1, blocks of the sequence ------------------------------------------------------------
def check_blocks() -> None:
    """Growing sequences in random block sizes: num_blocks, each block, the last block's tokens, the
    cached blocks, IndexError outside the blocks; counts beyond 2**53 in integer arithmetic."""
    @settings(max_examples=150, **SETTINGS)
    @example(prompt=[1, 2, 3], block_size=2, generated=[4], cached=2)  # a fixed case first: negative indices
    @given(prompt=st.lists(st.integers(0, 50), min_size=1, max_size=40), block_size=st.integers(1, 12),
           generated=st.lists(st.integers(0, 50), max_size=30), cached=st.integers(0, 80))
    def run(prompt, block_size, generated, cached):
        seq = Sequence(list(prompt), sampling_params=object(), block_size=block_size)
        for step in range(len(generated) + 1):
            if step:
                seq.append_token(generated[step - 1])
            n, tokens = seq.num_tokens, list(seq.token_ids)
            at = f"ch01_ex1: a sequence of {n} tokens {tokens} in blocks of {block_size}"
            want = -(-n // block_size)
            got = seq.num_blocks
            _expect(type(got) is int and got == want, f"{at}: num_blocks should be the int {want} "
                    f"(ceil({n} / {block_size})), got {got!r}")
            last = n - (want - 1) * block_size
            got = seq.last_block_num_tokens
            _expect(type(got) is int and got == last, f"{at}: last_block_num_tokens should be {last} "
                    f"(1..{block_size}), got {got!r}")
            for i in range(want):
                b, expect = seq.block(i), tokens[i * block_size:(i + 1) * block_size]
                _expect(isinstance(b, list) and b == expect, f"{at}: block({i}) should be the list {expect}, got {b!r}")
                b.append(-1)
            _expect(seq.token_ids == tokens, f"{at}: reading (and changing) the blocks changed the tokens to "
                    f"{seq.token_ids}: return new lists")
            for bad in (want, want + 3, -1, -want):
                try:
                    out = seq.block(bad)
                except IndexError:
                    continue
                raise AssertionError(f"{at}: block({bad}) should raise IndexError (there are {want} blocks, "
                                     f"0..{want - 1}), returned {out!r}")
        seq.num_cached_tokens = min(cached, seq.num_tokens)
        want = seq.num_cached_tokens // block_size
        _expect(seq.num_cached_blocks == want, f"ch01_ex1: {seq.num_cached_tokens} cached tokens in blocks of "
                f"{block_size}: num_cached_blocks should be {want} (whole blocks only), got {seq.num_cached_blocks!r}")
    run()
    for num_tokens, block_size in [(2**53 + 1, 1), (2**60 + 1, 2), (10**18 + 1, 10**9), (1, 2**40), (0, 4)]:
        got = sequence.blocks_needed(num_tokens, block_size)
        want = -(-num_tokens // block_size)
        _expect(got == want and type(got) is int, f"ch01_ex1: blocks_needed({num_tokens}, {block_size}) "
                f"should be the int {want}, got {got!r} (use integer arithmetic, not float division)")


@pytest.mark.ch01
@pytest.mark.ch01_ex1
@pytest.mark.group(BLOCKS)
def test_ch01_ex1_blocks_of_the_sequence():
    with graded(BLOCKS):
        check_blocks()


@pytest.fixture(scope="module")
def ch01_engine_case(tmp_path_factory):
    """A tiny float64 Llama, prompts sharing a 9-token preamble, and transformers' greedy tokens."""
    import random

    from engine_helpers import hf_greedy, make_model

    folder = tmp_path_factory.mktemp("grading-ch01-regions")
    model = make_model(folder, "llama")
    rng = random.Random(1)
    preamble = [rng.randrange(128) for _ in range(9)]
    prompts = [preamble + [rng.randrange(128) for _ in range(rng.randint(1, 7))] for _ in range(5)]
    prompts += [preamble[:8], [rng.randrange(128) for _ in range(3)]]
    return folder, prompts, [hf_greedy(model, p, 6) for p in prompts]


@pytest.mark.ch01
@pytest.mark.ch01_ex1
@pytest.mark.parametrize("part", [pytest.param(p, marks=pytest.mark.group(p), id=p.split()[0]) for p in (TOKENS, BLOCKS)])
def test_ch01_ex1_engine_equals_transformers(part, ch01_engine_case):
    """The paged engine with prefix caching (blocks of 4, a cache of 20 blocks, two rounds) runs on
    your sequence's part: greedy tokens equal transformers', the second round finds the shared preamble cached."""
    from engine_helpers import run_engine
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.attention.paged_attention import PagedAttention
    from minivllm.core.prefix_caching import PrefixCachingBlockManager
    from test_grading_ch02_regions import graded as ch02_stand_ins

    folder, prompts, ref = ch01_engine_case
    with graded(part), ch02_stand_ins(None):
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        engine = LLMEngine(model=folder, dtype="float64", max_model_len=64, block_size=4, num_kvcache_blocks=20,
                           block_manager_cls=PrefixCachingBlockManager, attention_backend=PagedAttention)
        try:
            outs = [run_engine(engine, prompts, params) for _ in range(2)]
        except AssertionError as e:
            raise AssertionError(f"ch01_ex1 ({part}): the engine running on your sequence broke its bookkeeping "
                                 f"(prompts of up to {max(map(len, prompts))} tokens, blocks of 4): {e}") from e
    for round_outs in outs:
        for p, o, want in zip(prompts, round_outs, ref):
            got = o.outputs[0].token_ids
            _expect(got == want, f"ch01_ex1 ({part}): prompt {p} ({len(p)} tokens, blocks of 4): the engine generated "
                    f"{got}, transformers {want}")
    _expect(sum(o.num_cached_tokens for o in outs[1]) > 0, f"ch01_ex1 ({part}): the second round found no block of "
            "the shared preamble in the prefix cache: block(i) must give the tokens of block i")


# --- ch01_ex1, stops by the rules ----------------------------------------------------------------
def _expected_status(seq_tokens, n_prompt, eos, p, max_model_len):
    """The rules, written from the chapter's text: a stop token past min_tokens, else the length."""
    n_out, t = len(seq_tokens) - n_prompt, seq_tokens[-1]
    is_stop = (t in eos and not p.ignore_eos) or t in p.stop_token_ids
    if is_stop and n_out > p.min_tokens:
        return SequenceStatus.FINISHED_STOPPED
    if (p.max_tokens is not None and n_out >= p.max_tokens) or len(seq_tokens) >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH_CAPPED
    return SequenceStatus.RUNNING


def check_stops() -> None:
    """Random token streams with random limits and stop tokens; then the chapter's cases by name."""
    @settings(max_examples=300, **SETTINGS)
    @given(prompt_len=st.integers(1, 12), stream=st.lists(st.integers(0, 9), min_size=1, max_size=40),
           eos=st.sets(st.integers(0, 9), max_size=3), stop_ids=st.lists(st.integers(0, 9), max_size=2),
           max_tokens=st.one_of(st.none(), st.integers(1, 30)), min_tokens=st.integers(0, 6),
           ignore_eos=st.booleans(), room=st.integers(1, 40), waiting=st.booleans())
    def run(prompt_len, stream, eos, stop_ids, max_tokens, min_tokens, ignore_eos, room, waiting):
        max_model_len = prompt_len + room
        min_tokens = min(min_tokens, max_tokens or min_tokens)
        p = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_ids)
        seq = Sequence(list(range(prompt_len)), p)
        at = (f"ch01_ex1: a {prompt_len}-token prompt, max_model_len={max_model_len}, EOS ids {sorted(eos)}, "
              f"max_tokens={max_tokens}, min_tokens={min_tokens}, ignore_eos={ignore_eos}, stop_token_ids={stop_ids}")
        for token in stream:
            seq.append_token(token)
            before = list(seq.token_ids)
            want = _expected_status(before, prompt_len, eos, p, max_model_len)
            # a sequence that does not stop keeps its status, whatever it is (WAITING where `waiting`); one
            # that stops is RUNNING (an answer may leave a sequence alone that is not RUNNING)
            start = SequenceStatus.WAITING if waiting and want is SequenceStatus.RUNNING else SequenceStatus.RUNNING
            seq.status = start
            want = start if want is SequenceStatus.RUNNING else want
            finished = sequence.check_stop(seq, set(eos), max_model_len)
            _expect(seq.token_ids == before, f"{at}: check_stop changed the tokens")
            _expect(seq.status is want, f"{at}: a {start.name} sequence after the completion {seq.completion_token_ids}: "
                    f"its status should be {want.name}{' (unchanged: it does not stop)' if want is start else ''}, "
                    f"got {seq.status.name}")
            _expect(finished is want.is_finished, f"{at}: after the completion {seq.completion_token_ids} check_stop "
                    f"should return {want.is_finished}, got {finished!r}")
            if finished:
                break
    run()

    def case(stream, eos=frozenset({2}), max_model_len=100, **params):
        seq = Sequence([7, 7, 7], SamplingParams(**params))
        seq.status = SequenceStatus.RUNNING
        for token in stream:
            seq.append_token(token)
            if sequence.check_stop(seq, set(eos), max_model_len):
                break
        return seq.completion_token_ids, seq.finish_reason

    cases = [(([5, 2, 8],), dict(max_tokens=4), ([5, 2], "stop")),
             (([5, 6, 7, 2],), dict(max_tokens=4), ([5, 6, 7, 2], "stop")),
             (([5, 6, 7, 8, 9],), dict(max_tokens=4), ([5, 6, 7, 8], "length")),
             (([5, 2, 8],), dict(max_tokens=4, ignore_eos=True), ([5, 2, 8], None)),
             (([5, 2, 6, 2, 9],), dict(max_tokens=8, min_tokens=2), ([5, 2, 6, 2], "stop")),
             (([4, 2, 9],), dict(max_tokens=8, stop_token_ids=[4], min_tokens=1), ([4, 2], "stop")),
             (([5, 4, 2],), dict(max_tokens=8, stop_token_ids=[4], ignore_eos=True), ([5, 4], "stop")),
             (([5, 6, 7, 8],), dict(max_tokens=16, max_model_len=5), ([5, 6], "length")),
             (([5] * 40,), dict(max_tokens=None, max_model_len=30), ([5] * 27, "length"))]
    for args, params, want in cases:
        mml = params.pop("max_model_len", 100)
        got = case(*args, max_model_len=mml, **params)
        _expect(got == want, f"ch01_ex1: the stream {args[0]} after a 3-token prompt, EOS 2, max_model_len={mml}, "
                f"{params}: should end as (completion, finish reason) {want}, got {got}")

    # already past a limit (tokens appended without asking): the length rules say "at least", not "exactly"
    for completion, params, mml in [([5] * 6, dict(max_tokens=4), 100), ([5] * 4, dict(max_tokens=None), 5),
                                    ([5, 6], dict(max_tokens=16), 2)]:
        seq = Sequence([7, 7, 7], SamplingParams(**params))
        seq.status = SequenceStatus.RUNNING
        for token in completion:
            seq.append_token(token)
        finished = sequence.check_stop(seq, {2}, mml)
        got = (finished, seq.status)
        _expect(got == (True, SequenceStatus.FINISHED_LENGTH_CAPPED), f"ch01_ex1: a 3-token prompt and "
                f"{len(completion)} completion tokens, {params}, max_model_len={mml}: past the limit, check_stop "
                f"should return True with status FINISHED_LENGTH_CAPPED, got {finished!r}, {seq.status.name}")


@pytest.mark.ch01
@pytest.mark.ch01_ex1
@pytest.mark.group(STOPS)
def test_ch01_ex1_stops_by_the_rules():
    with graded(STOPS):
        check_stops()


# --- ch01_ex1: wrong answers lose exactly their part ------------------------------------------------
def _prompt_not_copied(self, token_ids, sampling_params=None, block_size=sequence.DEFAULT_BLOCK_SIZE, prompt=None,
                       seq_id=None):
    """__init__ that keeps the caller's list: appending tokens grows the caller's prompt."""
    _init_stand_in(self, token_ids, sampling_params, block_size, prompt, seq_id)
    self.token_ids = token_ids if isinstance(token_ids, list) else self.token_ids


def _token_block_negative_slices(token_ids, block_size, i):
    """token_block that checks only the upper end: block(-1) quietly slices from the end."""
    if i >= -(-len(token_ids) // block_size):
        raise IndexError(f"block {i} out of range")
    return token_ids[i * block_size:(i + 1) * block_size or None]


def _stop_max_tokens_on_whole(seq, eos_token_ids, max_model_len):
    """check_stop that compares max_tokens with the whole sequence, prompt included."""
    p, t, n_out = seq.sampling_params, seq.last_token, seq.num_completion_tokens
    if n_out > p.min_tokens and (t in p.stop_token_ids or (not p.ignore_eos and t in eos_token_ids)):
        seq.status = SequenceStatus.FINISHED_STOPPED
    elif (p.max_tokens is not None and seq.num_tokens >= p.max_tokens) or seq.num_tokens >= max_model_len:
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
    return seq.is_finished


def _stop_min_tokens_only_for_stop_ids(seq, eos_token_ids, max_model_len):
    """check_stop that applies min_tokens to stop_token_ids only: EOS stops at once."""
    p, t, n_out = seq.sampling_params, seq.last_token, seq.num_completion_tokens
    if (not p.ignore_eos and t in eos_token_ids) or (t in p.stop_token_ids and n_out > p.min_tokens):
        seq.status = SequenceStatus.FINISHED_STOPPED
    elif (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= max_model_len:
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
    return seq.is_finished


_SHARED_PARAMS: list[SamplingParams] = []  # made at the first call: importing this module makes no SamplingParams
# (in an edition that released ch01_ex2, SamplingParams() raises the stub's NotImplementedError)


def _init_shared_default_params(self, token_ids, sampling_params=None, block_size=sequence.DEFAULT_BLOCK_SIZE,
                                prompt=None, seq_id=None):
    """__init__ whose default is one SamplingParams made once, shared by every sequence made without one."""
    if sampling_params is None:
        _SHARED_PARAMS[:] = _SHARED_PARAMS or [SamplingParams()]
        sampling_params = _SHARED_PARAMS[0]
    _init_stand_in(self, token_ids, sampling_params, block_size, prompt, seq_id)


def _init_len_of_the_argument(self, token_ids, sampling_params=None, block_size=sequence.DEFAULT_BLOCK_SIZE,
                              prompt=None, seq_id=None):
    """__init__ that counts the prompt with len() of the argument (a generator has none)."""
    n = len(token_ids)
    _init_stand_in(self, token_ids, sampling_params, block_size, prompt, seq_id)
    self.num_prompt_tokens = n


def _init_numpy_block_size_kept(self, token_ids, sampling_params=None, block_size=sequence.DEFAULT_BLOCK_SIZE,
                                prompt=None, seq_id=None):
    """__init__ that checks block_size but keeps it as given (a NumPy int stays one)."""
    _init_stand_in(self, token_ids, sampling_params, block_size, prompt, seq_id)
    self.block_size = block_size


def _stop_sets_running(seq, eos_token_ids, max_model_len):
    """check_stop that sets RUNNING on a sequence it does not stop (a WAITING one starts running)."""
    if _check_stop_stand_in(seq, eos_token_ids, max_model_len):
        return True
    seq.status = SequenceStatus.RUNNING
    return False


def _stop_limits_exactly(seq, eos_token_ids, max_model_len):
    """check_stop that stops at exactly max_tokens or max_model_len tokens, never past them."""
    p, t, n_out = seq.sampling_params, seq.last_token, seq.num_completion_tokens
    if n_out > p.min_tokens and (t in p.stop_token_ids or (not p.ignore_eos and t in eos_token_ids)):
        seq.status = SequenceStatus.FINISHED_STOPPED
    elif n_out == p.max_tokens or seq.num_tokens == max_model_len:
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
    return seq.is_finished


def _stop_min_tokens_as_vllm(seq, eos_token_ids, max_model_len):
    """check_stop with vLLM's early return (`n < min_tokens`): a stop token at n == min_tokens stops."""
    p, t, n_out = seq.sampling_params, seq.last_token, seq.num_completion_tokens
    if n_out >= p.min_tokens and (t in p.stop_token_ids or (not p.ignore_eos and t in eos_token_ids)):
        seq.status = SequenceStatus.FINISHED_STOPPED
    elif (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= max_model_len:
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
    return seq.is_finished


def _stop_only_when_running(seq, eos_token_ids, max_model_len):
    """A right check_stop that leaves a sequence alone unless it is RUNNING (the engine only asks about those)."""
    if seq.status is not SequenceStatus.RUNNING:
        return seq.is_finished
    return _check_stop_stand_in(seq, eos_token_ids, max_model_len)


WRONG = {
    "prompt list not copied": (TOKENS, [(Sequence, "__init__", _prompt_not_copied)]),
    "completion counted from the prompt's last token": (TOKENS, _views(
        completion_token_ids=lambda s: s.token_ids[s.num_prompt_tokens - 1:],
        num_completion_tokens=lambda s: len(s.token_ids) - s.num_prompt_tokens + 1)),
    "num_blocks one too many at an exact multiple": (BLOCKS, [(sequence, "blocks_needed", lambda n, b: n // b + 1)]),
    "a negative block index slices from the end": (BLOCKS, [(sequence, "token_block", _token_block_negative_slices)]),
    "max_tokens counted on the whole sequence": (STOPS, [(sequence, "check_stop", _stop_max_tokens_on_whole)]),
    "min_tokens ignored for EOS": (STOPS, [(sequence, "check_stop", _stop_min_tokens_only_for_stop_ids)]),
    "one default SamplingParams shared by every sequence": (TOKENS, [(Sequence, "__init__", _init_shared_default_params)]),
    "the prompt counted with len() of the argument": (TOKENS, [(Sequence, "__init__", _init_len_of_the_argument)]),
    "a NumPy block_size kept as given": (TOKENS, [(Sequence, "__init__", _init_numpy_block_size_kept)]),
    "check_stop sets RUNNING when it does not stop": (STOPS, [(sequence, "check_stop", _stop_sets_running)]),
    "the length limits compared with ==": (STOPS, [(sequence, "check_stop", _stop_limits_exactly)]),
    "vLLM's min_tokens test (n < min_tokens) copied": (STOPS, [(sequence, "check_stop", _stop_min_tokens_as_vllm)]),
}
# right answers written differently from the book's: they pass their part
RIGHT = {"check_stop that leaves a sequence alone unless it is RUNNING": (STOPS, [(sequence, "check_stop",
                                                                                 _stop_only_when_running)])}


CHECKS = {TOKENS: check_tokens, BLOCKS: check_blocks, STOPS: check_stops}


@pytest.mark.parametrize("name", list(WRONG))
def test_ch01_ex1_wrong_answers_lose_their_part(name):
    """Each wrong answer, in place of the package's piece, fails the checks of its own part, and the
    checks of the other parts (which run the grader's pieces in place of that part) still pass."""
    part, wrong = WRONG[name]
    with graded(part, wrong):
        try:
            CHECKS[part]()
        except AssertionError as e:
            _expect("ch01_ex1" in str(e), str(e))
        else:
            raise AssertionError(f"{name}: a wrong answer passed every check of its part ({part})")
    for other, check in CHECKS.items():
        if other != part:
            with pytest.MonkeyPatch.context() as mp:
                for owner, attr, fn in wrong:
                    mp.setattr(owner, attr, fn)
                with graded(other):
                    check()


@pytest.mark.parametrize("name", list(RIGHT))
def test_ch01_ex1_other_right_answers_pass(name):
    part, right = RIGHT[name]
    with graded(part, right):
        CHECKS[part]()


# --- ch01_ex2: the sampling filters' ranges ----------------------------------------------------------
def _numbers(lo, hi):
    """Valid and invalid values for a number field: in and out of [lo, hi], and of the wrong type."""
    return st.one_of(st.floats(lo - 2, hi + 2, allow_nan=False), st.integers(int(lo) - 2, int(hi) + 2),
                     st.sampled_from([float("nan"), float("inf"), -float("inf"), True, False, "0.5", None,
                                      np.float32(0.5), np.int64(1), lo, hi, math.nextafter(lo, -math.inf),
                                      math.nextafter(hi, math.inf)]))


FIELDS = {"temperature": _numbers(0.0, 3.0), "top_p": _numbers(0.0, 1.0), "min_p": _numbers(0.0, 1.0),
          "top_k": st.one_of(st.integers(-4, 60), st.sampled_from([np.int64(5), 2.0, True, "3", None, -1, 0]))}


def _real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)) \
        and math.isfinite(float(v))


def _problem(name, v) -> bool:
    """True if `v` is out of vLLM's range (or of the wrong type) for the field `name`."""
    if name == "top_k":
        return not (isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= -1)
    if not _real(v):
        return True
    v = float(v)
    return {"temperature": v < 0, "top_p": not 0 < v <= 1, "min_p": not 0 <= v <= 1}[name]


@pytest.mark.ch01
@pytest.mark.ch01_ex2
@settings(max_examples=300, deadline=None)
@given(values=st.fixed_dictionaries({}, optional=FIELDS))
def test_ch01_ex2_sampling_filters_follow_vllms_ranges(values):
    """`SamplingParams(**values)`: a value out of range or of the wrong type is a ValueError naming
    its field; valid ones are kept as Python floats (top_k: an int, -1 stored as 0), and a greedy
    request (temperature < 1e-5) has top_p, top_k, min_p switched off (1.0, 0, 0.0)."""
    at = f"ch01_ex2: SamplingParams({', '.join(f'{k}={v!r}' for k, v in values.items())})"
    bad = [k for k, v in values.items() if _problem(k, v)]
    with graded("ch01_ex2"):
        try:
            p = SamplingParams(**values)
        except ValueError as e:
            _expect(bool(bad), f"{at}: raised ValueError({str(e)!r}), but every value is in range")
            _expect(any(k in str(e) for k in bad), f"{at}: the ValueError should name the field out of range "
                    f"({' or '.join(bad)}), says {str(e)!r}")
            return
    _expect(not bad, f"{at}: accepted, but {', '.join(f'{k}={values[k]!r}' for k in bad)} is out of vLLM's range "
            "(temperature >= 0, top_p in (0, 1], top_k an int >= -1, min_p in [0, 1]; finite numbers, no bools)")
    want = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    want.update({k: (max(int(v), 0) if k == "top_k" else float(v)) for k, v in values.items()})
    if want["temperature"] < SAMPLING_EPS:
        want.update(top_p=1.0, top_k=0, min_p=0.0)
    for k, v in want.items():
        got = getattr(p, k)
        kind = int if k == "top_k" else float
        _expect(type(got) is kind and got == v, f"{at}: {k} should be the {kind.__name__} {v!r}"
                f"{' (greedy: the filters are switched off)' if want['temperature'] < SAMPLING_EPS else ''}, "
                f"got {got!r} of type {type(got).__name__}")
