"""Grading tests for chapter 01's rebuild exercises (`python -m minivllm.course.grade ch01_ex2`, or `pytest -m ch01_ex2`).

ch01_ex2 (the token blocks: `blocks_needed` and `token_block`, behind `Sequence.num_blocks` and
`Sequence.block(i)`) and ch01_ex3 (`check_sampling_filters`, the range checks of temperature, top_p,
top_k and min_p behind `SamplingParams`) are graded in the package itself: in a student edition they
are the student's code, exported from the chapter (stubs until filled), and there is no reference to
compare with. What is checked is the contract, written in the tests: the block arithmetic on random
sequences that grow (hypothesis), vLLM's ranges on random values of every type, then the engine with
the student's blocks in place (prefix caching reads `block(i)`), whose greedy tokens must equal
transformers'. Each exercise is graded alone: the other one, and chapter 02's graded pieces, are the
grader's stand-ins (`graded`).
"""
from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minivllm.sampling_params as sp
from engine_helpers import one_thread
import minivllm.sequence as sequence
from minivllm.utils.checks import require_int, require_number
from minivllm.sampling_params import SAMPLING_EPS, SamplingParams
from minivllm.sequence import Sequence


_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


# --- the grader's stand-ins ------------------------------------------------------------------------
def _blocks_needed_stand_in(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def _token_block_stand_in(token_ids: list[int], block_size: int, i: int) -> list[int]:
    if i < 0 or i * block_size >= len(token_ids):
        raise IndexError(f"block {i} out of range")
    return list(token_ids[i * block_size:(i + 1) * block_size])


def _filters_stand_in(p) -> None:
    p.temperature = require_number("temperature", p.temperature, minimum=0.0)
    p.top_p = require_number("top_p", p.top_p, maximum=1.0)
    if not p.top_p > 0:
        raise ValueError(f"top_p must be > 0, got {p.top_p!r}")
    p.top_k = 0 if require_int("top_k", p.top_k, minimum=-1) == -1 else int(p.top_k)
    p.min_p = require_number("min_p", p.min_p, 0.0, 1.0)
    if p.temperature < SAMPLING_EPS:
        p.top_p, p.top_k, p.min_p = 1.0, 0, 0.0


STAND_INS = {"ch01_ex2": [(sequence, "blocks_needed", _blocks_needed_stand_in),
                          (sequence, "token_block", _token_block_stand_in)],
             "ch01_ex3": [(sp, "check_sampling_filters", _filters_stand_in)]}


@contextmanager
def graded(ex: str | None):
    """The package's (the student's) code for `ex`, the grader's stand-ins for chapter 01's other
    graded pieces (None: stand-ins for all of them)."""
    with ExitStack() as stack:
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        for other, patches in STAND_INS.items():
            if other != ex:
                for module, name, fn in patches:
                    mp.setattr(module, name, fn)
        yield


# --- ch01_ex2: the token blocks --------------------------------------------------------------------
@pytest.mark.ch01
@pytest.mark.ch01_ex2
@settings(max_examples=150, deadline=None)
@given(prompt=st.lists(st.integers(0, 50), min_size=1, max_size=40), block_size=st.integers(1, 12),
       generated=st.lists(st.integers(0, 50), max_size=30))
def test_ch01_ex2_blocks_tile_a_growing_sequence(prompt, block_size, generated):
    """After the prompt and after every appended token: `num_blocks` is ceil(num_tokens / block_size),
    the blocks are the tokens in order, `block_size` each but the last (1..block_size), and a block
    index outside `range(num_blocks)` (negative included) is an IndexError."""
    with graded("ch01_ex2"):
        seq = Sequence(list(prompt), sampling_params=object(), block_size=block_size)
        for step in range(len(generated) + 1):
            if step:
                seq.append_token(generated[step - 1])
            n, tokens = seq.num_tokens, list(seq.token_ids)
            at = f"ch01_ex2: a sequence of {n} tokens {tokens} in blocks of {block_size}"
            want = -(-n // block_size)
            got = seq.num_blocks
            _expect(type(got) is int and got == want, f"{at}: num_blocks should be the int {want} "
                    f"(ceil({n} / {block_size})), got {got!r}")
            blocks = [seq.block(i) for i in range(want)]
            for i, b in enumerate(blocks):
                expect = tokens[i * block_size:(i + 1) * block_size]
                _expect(isinstance(b, list) and b == expect, f"{at}: block({i}) should be the list {expect}, got {b!r}")
            _expect(seq.token_ids == tokens, f"{at}: reading the blocks changed the tokens to {seq.token_ids}")
            for bad in (want, want + 3, -1):
                try:
                    out = seq.block(bad)
                except IndexError:
                    continue
                raise AssertionError(f"{at}: block({bad}) should raise IndexError (there are {want} blocks, "
                                     f"0..{want - 1}), returned {out!r}")


@pytest.mark.ch01
@pytest.mark.ch01_ex2
def test_ch01_ex2_block_counts_without_floats():
    """Huge counts, where ceil through a float goes wrong (2**53 + 1 is not a float): integer arithmetic."""
    with graded("ch01_ex2"):
        for num_tokens, block_size in [(2**53 + 1, 1), (2**60 + 1, 2), (10**18 + 1, 10**9), (1, 2**40), (0, 4)]:
            got = sequence.blocks_needed(num_tokens, block_size)
            want = -(-num_tokens // block_size)
            _expect(got == want and type(got) is int, f"ch01_ex2: blocks_needed({num_tokens}, {block_size}) "
                    f"should be the int {want}, got {got!r} (use integer arithmetic, not float division)")


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
@pytest.mark.ch01_ex2
def test_ch01_ex2_engine_equals_transformers(ch01_engine_case):
    """The paged engine with prefix caching (blocks of 4, a cache of 20 blocks, two rounds) runs on
    your blocks: greedy tokens equal transformers', the second round finds the shared preamble cached."""
    from engine_helpers import run_engine
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.attention.paged_attention import PagedAttention
    from minivllm.core.prefix_caching import PrefixCachingBlockManager
    from test_grading_ch02_regions import graded as ch02_stand_ins

    folder, prompts, ref = ch01_engine_case
    with graded("ch01_ex2"), ch02_stand_ins(None):
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        engine = LLMEngine(model=folder, dtype="float64", max_model_len=64, block_size=4, num_kvcache_blocks=20,
                           block_manager_cls=PrefixCachingBlockManager, attention_backend=PagedAttention)
        outs = [run_engine(engine, prompts, params) for _ in range(2)]
    for round_outs in outs:
        for p, o, want in zip(prompts, round_outs, ref):
            got = o.outputs[0].token_ids
            _expect(got == want, f"ch01_ex2: prompt {p} ({len(p)} tokens, blocks of 4): the engine generated "
                    f"{got}, transformers {want}")
    _expect(sum(o.num_cached_tokens for o in outs[1]) > 0, "ch01_ex2: the second round found no block of the "
            "shared preamble in the prefix cache: block(i) must give the tokens of block i")


# --- ch01_ex3: the sampling filters' ranges ----------------------------------------------------------
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
@pytest.mark.ch01_ex3
@settings(max_examples=300, deadline=None)
@given(values=st.fixed_dictionaries({}, optional=FIELDS))
def test_ch01_ex3_sampling_filters_follow_vllms_ranges(values):
    """`SamplingParams(**values)`: a value out of range or of the wrong type is a ValueError naming
    its field; valid ones are kept as Python floats (top_k: an int, -1 stored as 0), and a greedy
    request (temperature < 1e-5) has top_p, top_k, min_p switched off (1.0, 0, 0.0)."""
    at = f"ch01_ex3: SamplingParams({', '.join(f'{k}={v!r}' for k, v in values.items())})"
    bad = [k for k, v in values.items() if _problem(k, v)]
    with graded("ch01_ex3"):
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
