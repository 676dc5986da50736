"""Grading tests for chapter 15's extend exercise (`pytest -m ch15_ex3 --impl=exercises`); see test_grading.py.

`FastForwardScheduler` (the tokens a grammar forces appended right after the sampled token, so that the
next step computes them at once) is graded by plugging it into the engine (`LLM(scheduler_cls=...)`) on a
tiny random float64 Llama with SmolLM2's tokenizer (49,152 tokens), against chapter 15's own
`StructuredOutputScheduler` on the same requests, never against minivllm's answer, in named groups:
* same text, fewer steps: greedy requests under choice lists and regexes whose forced parts are long
  (the rest of a choice once its first token is sampled; `-answer-is-final-`; a JSON key), beside an
  unconstrained request: the same outputs (text, token ids, finish reason) as the chapter's scheduler,
  each valid under its constraint, in strictly fewer engine steps; after every step no running sequence's
  matcher forces anything (`compute_ff_tokens()` is empty: every forced token was appended), and the
  block manager's invariants hold (`engine_helpers.check_invariants`: a running sequence's block table
  covers its tokens, reference counts, an idle engine holds no block);
* stops and limits: `max_tokens` of 1 to 7 and a `max_model_len` that end a request inside a forced run:
  the same outputs as the chapter's scheduler (the run cut at the limit, finish reason "length"), never
  more tokens than allowed;
* KV blocks: a cache too small for the requests at once (preemption), prefix caching, a token budget of
  8 (forced runs computed in chunks): the same outputs as the chapter's scheduler, valid, the invariants
  after every step, every block free at the end.
Greedy only: a seeded sampled request draws once per sampled token, so fewer sampled tokens give other
draws (and other text) by design. The rebuild regions of chapter 15 (`apply_token_bitmask`, `token_mask`)
are the grader's stand-ins here (`test_grading_ch15_regions.graded(None)`), so only the scheduler is
graded. The tests at the end (marked `ch15` only, not graded) show that plausible wrong answers fail these
graders.
"""
from __future__ import annotations

import re
from contextlib import contextmanager

import pytest
import regex

from adapters import load
from engine_helpers import MAX_STEPS, check_invariants, one_thread
from minivllm.llm import LLM
from minivllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from minivllm.structured_output.scheduler import StructuredOutputScheduler

pytest.importorskip("llguidance")

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)
SAME, LIMITS, BLOCKS = "same text, fewer steps", "stops and limits", "KV blocks"
BLOCK_SIZE = 4

CHOICES = ["The quick brown fox jumps over the lazy dog", "Pack my box with five dozen liquor jugs",
           "Sphinx of black quartz, judge my vow"]
REGEXES = [r"(yes|no), because the (sky|grass) is (blue|green) today\.", r"[0-9]{3}-answer-is-final-[a-c]{2}!",
           r'\{"name": "(Ada|Alan)", "age": [0-9]{2}\}']


@pytest.fixture(scope="module", autouse=True)
def _rebuild_regions_are_the_graders():
    """`apply_token_bitmask` and `token_mask` (stubs in a student edition of chapter 15) are the grader's
    stand-ins here: the scheduler is graded alone."""
    from test_grading_ch15_regions import graded

    with graded(None):
        yield


@pytest.fixture(scope="module")
def ch15(impl_name):
    return load("ch15_structured_outputs", impl_name)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random float64 Llama with SmolLM2-135M-Instruct's tokenizer and vocabulary size."""
    from serving_helpers import make_tiny_chat_model

    return make_tiny_chat_model(tmp_path_factory.mktemp("ch15-grading"), seed=15)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


@contextmanager
def your_code(group: str, what: str):
    """An error of the code under grading (not a stub's NotImplementedError) re-raised as an AssertionError
    naming the exercise, the group and what was running (an `assert` that failed inside the engine too)."""
    try:
        yield
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"ch15_ex3 ({group}): {what} raised {type(e).__name__}: {e} (the traceback shows "
                             "where)") from e


def _constraint(kind: str, spec) -> StructuredOutputsParams:
    return StructuredOutputsParams(**{kind: spec})


def _prompt(i: int, length: int = 5) -> list[int]:
    """A prompt of `length` token ids (plain words of SmolLM2's vocabulary), different for each `i`."""
    return [(1000 + 37 * i + 101 * j) % 40000 + 300 for j in range(length)]


# each config: engine settings, then (prompt, kind, spec, max_tokens) per request (kind None: unconstrained)
CONFIGS = {
    SAME: (dict(max_model_len=96, num_kvcache_blocks=96), [
        (_prompt(0), "choice", CHOICES, 40), (_prompt(1), "choice", CHOICES, 40), (_prompt(2), "regex", REGEXES[0], 40),
        (_prompt(3), "regex", REGEXES[1], 40), (_prompt(4), "regex", REGEXES[2], 40), (_prompt(5), None, None, 12)]),
    LIMITS: (dict(max_model_len=32, num_kvcache_blocks=96), [
        (_prompt(6), "choice", CHOICES, 1), (_prompt(7), "choice", CHOICES, 2), (_prompt(8), "choice", CHOICES, 5),
        (_prompt(9), "regex", REGEXES[1], 3), (_prompt(10), "regex", REGEXES[2], 7),
        (_prompt(11, 24), "choice", CHOICES, 40), (_prompt(12, 26), "regex", REGEXES[0], 40)]),  # max_model_len cuts
    BLOCKS: (dict(max_model_len=48, num_kvcache_blocks=12, enable_prefix_caching=True, max_num_batched_tokens=8,
                  max_num_seqs=4), [
        (_prompt(13 + i % 3, 5 + i % 4), kind, spec, 40) for i, (kind, spec) in enumerate(
            [("choice", CHOICES)] * 3 + [("regex", r) for r in REGEXES] + [("choice", CHOICES),
                                                                           ("regex", REGEXES[1])])]),
}


def _params(kind, spec, max_tokens: int) -> SamplingParams:
    """Greedy, the final output only (as `LLM.generate` asks: chapter 10's output processor makes the text
    from every token at the end; streamed text sees a step's last token only, see the exercise)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY,
                          structured_outputs=None if kind is None else _constraint(kind, spec))


def _run(folder, scheduler_cls, config: str, group: str, check_forced: bool = False) -> tuple[list, int]:
    """The requests of `config` through an engine with `scheduler_cls`: ([(text, token ids, finish reason)]
    in order, steps). After each step: the block manager's invariants, and with `check_forced` that no
    running sequence's matcher forces a token."""
    settings, requests = CONFIGS[config]
    who = "the chapter's StructuredOutputScheduler" if scheduler_cls is StructuredOutputScheduler else "your scheduler"
    with your_code(group, f"building an engine with {scheduler_cls.__name__}"):
        engine = LLM(str(folder), dtype="float64", device="cpu", block_size=BLOCK_SIZE, scheduler_cls=scheduler_cls,
                     **settings).llm_engine
    ids = [engine.add_request(None, p, _params(kind, spec, m)) for p, kind, spec, m in requests]
    done = {}
    for step in range(1, MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        with your_code(group, f"the engine's step {step} ({config!r} requests, {who})"):
            outs = engine.step()
        done.update((o.request_id, o) for o in outs if o.finished)
        try:
            check_invariants(engine)
        except AssertionError as e:
            raise AssertionError(f"ch15_ex3 ({group}): after step {step} ({config!r} requests, {who}) the KV blocks "
                                 f"are inconsistent: {e!r:.400} (a running sequence's block table must cover all its "
                                 "tokens but the newest, each block counted once)") from e
        for seq in list(engine.scheduler.running) if check_forced else []:
            request = getattr(seq, "structured_output_request", None)
            forced = request.grammar.matcher.compute_ff_tokens() if request is not None else []
            _expect(not forced, f"ch15_ex3 ({group}): after step {step}, request {seq.request_id}'s grammar "
                    f"({seq.num_completion_tokens} tokens) still forces {len(forced)} tokens {forced}: fast_forward "
                    "appends every token compute_ff_tokens() returns, each fed to the grammar by check_stop (up to "
                    "a stop)")
    _expect(not engine.has_unfinished_requests(), f"ch15_ex3 ({group}): the engine did not finish ({who})")
    bm = engine.block_manager
    _expect(bm.num_free_blocks == bm.num_blocks, f"ch15_ex3 ({group}): the idle engine still holds KV-cache blocks "
            f"({who})")
    return [(done[i].outputs[0].text, list(done[i].outputs[0].token_ids), done[i].outputs[0].finish_reason)
            for i in ids], len(engine.stats)


_BOOK: dict = {}


def _book(folder, config: str):
    """The chapter's scheduler on `config` (once per model folder and config)."""
    key = (str(folder), config)
    if key not in _BOOK:
        _BOOK[key] = _run(folder, StructuredOutputScheduler, config, config)
    return _BOOK[key]


def _valid(kind, spec, text: str, finish_reason: str) -> bool:
    """The text is a whole match of the constraint (finished with "stop"), or a prefix of one ("length")."""
    if kind == "choice":
        return text in spec if finish_reason == "stop" else any(c.startswith(text) for c in spec)
    if kind == "regex":
        return (re.fullmatch(spec, text) is not None if finish_reason == "stop"
                else regex.fullmatch(spec, text, partial=True) is not None)
    return True


def _compare(ch15, folder, config: str, check_forced: bool = False) -> tuple[int, int]:
    """Your scheduler's outputs of `config` against the chapter's; returns (your steps, the chapter's)."""
    (want, book_steps), requests = _book(folder, config), CONFIGS[config][1]
    got, steps = _run(folder, ch15.FastForwardScheduler, config, config, check_forced)
    for i, ((text, ids, reason), (w_text, w_ids, w_reason), (_, kind, spec, max_tokens)) in enumerate(
            zip(got, want, requests)):
        what = f"ch15_ex3 ({config}): request {i} ({kind or 'unconstrained'} {spec!r:.60}, max_tokens={max_tokens})"
        _expect(len(ids) <= max_tokens, f"{what}: {len(ids)} tokens, more than max_tokens (forced tokens count too; "
                "check_stop after each)")
        _expect((text, ids, reason) == (w_text, w_ids, w_reason), f"{what}: gave {text!r} ({reason}, token ids {ids}); "
                f"the chapter's scheduler gives {w_text!r} ({w_reason}, token ids {w_ids}): forced tokens are the "
                "ones its masks allow, so the outputs are the same")
        _expect(_valid(kind, spec, text, reason), f"{what}: {text!r} ({reason}) does not match the constraint")
    return steps, book_steps


@pytest.mark.ch15
@pytest.mark.ch15_ex3
def test_ch15_ex3_same_text_in_fewer_steps(ch15, model):
    steps, book_steps = _compare(ch15, model, SAME, check_forced=True)
    _expect(all(r == "stop" for _, _, r in _book(model, SAME)[0][:5]), "ch15_ex3: the grader's requests did not finish")
    _expect(steps < book_steps, f"ch15_ex3 ({SAME}): {steps} engine steps, the chapter's scheduler takes {book_steps}: "
            "forced tokens are appended in the step that sampled the token before them, and computed together")


@pytest.mark.ch15
@pytest.mark.ch15_ex3
def test_ch15_ex3_stops_and_limits(ch15, model):
    _compare(ch15, model, LIMITS)
    want = _book(model, LIMITS)[0]
    _expect(all(r == "length" for _, _, r in want), "ch15_ex3: the grader's limits did not cut every request")


@pytest.mark.ch15
@pytest.mark.ch15_ex3
def test_ch15_ex3_kv_blocks_preemption_prefix_caching_chunks(ch15, model):
    _compare(ch15, model, BLOCKS)


# --- the graders catch plausible wrong answers (not graded; the wrong answers are written here) ------
def _wrong_schedulers(ch15) -> dict:
    base = ch15.FastForwardScheduler

    def forced_tokens(seq):
        request = getattr(seq, "structured_output_request", None)
        return request.grammar.matcher.compute_ff_tokens() if request is not None else []

    class NeverForwards(base):  # the parent's behaviour: right text, no step saved
        def fast_forward(self, seq):
            return 0

    class NoRoomCheck(base):  # takes a block for each forced token without asking whether one is free
        def fast_forward(self, seq):
            forced = forced_tokens(seq)
            if forced:
                self.block_manager.may_append(seq)
            for i, t in enumerate(forced):
                seq.append_token(t)
                self.block_manager.may_append(seq)
                if self.check_stop(seq):
                    return i + 1
            return len(forced)

    class RunPastLimits(base):  # feeds the grammar itself and checks the stop rules once, after the run
        def fast_forward(self, seq):
            forced = forced_tokens(seq)
            if not forced or self.block_manager.num_free_blocks < len(forced) // BLOCK_SIZE + 2:
                return 0
            self.block_manager.may_append(seq)
            for t in forced:
                seq.append_token(t)
                self.block_manager.may_append(seq)
                seq.structured_output_request.grammar.accept_tokens(seq.request_id, [t])
            return len(forced)

    class GrammarNotFed(base):  # appends the forced tokens but never advances the grammar over them
        def fast_forward(self, seq):
            forced, bm = forced_tokens(seq), self.block_manager
            if not forced or bm.num_free_blocks < len(forced) // BLOCK_SIZE + 2:
                return 0
            bm.may_append(seq)
            for i, t in enumerate(forced):
                seq.append_token(t)
                bm.may_append(seq)
                if super(StructuredOutputScheduler, self).check_stop(seq):  # chapter 04's rules only
                    return i + 1
            return len(forced)

    return {"never fast-forwards": NeverForwards, "no room check": NoRoomCheck, "runs past the limits": RunPastLimits,
            "grammar not fed": GrammarNotFed}


@pytest.mark.ch15
@pytest.mark.parametrize("name, groups", [("never fast-forwards", [SAME]), ("no room check", [BLOCKS]),
                                          ("runs past the limits", [LIMITS]), ("grammar not fed", [SAME, BLOCKS])])
def test_ch15_ex3_grader_catches(ch15, model, name, groups):
    class Wrong:  # the exercise's module with the wrong scheduler in place
        FastForwardScheduler = _wrong_schedulers(ch15)[name]

    tests = {SAME: test_ch15_ex3_same_text_in_fewer_steps, LIMITS: test_ch15_ex3_stops_and_limits,
             BLOCKS: test_ch15_ex3_kv_blocks_preemption_prefix_caching_chunks}
    for group in groups:
        with pytest.raises(AssertionError, match=rf"ch15_ex3 \({group}\)"):
            tests[group](Wrong, model)
