"""Grading tests for the chapter exercises. Run against the reference (`--impl=solutions`, default)
or a student's work (`--impl=exercises`); select one exercise with `-m ch02_ex1`.

Each exercise is checked against an oracle on random inputs (hypothesis) and by plugging it into a
model or engine whose output must not change. Chapter 01's oracle is minivllm's `Sequence`; chapter
02's exercises are variants the chapter does not show, graded against transformers and torch.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import load
from minivllm.models.llama import RotaryEmbedding, load_model
from minivllm.naive import CausalAttention
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceStatus


@pytest.fixture(scope="module")
def ch01(impl_name):
    return load("ch01_sequences", impl_name)


@pytest.fixture(scope="module")
def ch02(impl_name):
    return load("ch02_model", impl_name)


# --- chapter 01 -------------------------------------------------------------------------------

@pytest.mark.ch01
@pytest.mark.ch01_ex1
@settings(max_examples=300, deadline=None)
@given(prompt_len=st.integers(1, 12), stream=st.lists(st.integers(0, 9), min_size=1, max_size=40),
       eos=st.sets(st.integers(0, 9), max_size=3), max_tokens=st.integers(1, 30), ignore_eos=st.booleans(),
       room=st.integers(1, 40))
def test_ch01_ex1_check_stop_contract(ch01, prompt_len, stream, eos, max_tokens, ignore_eos, room):
    """Feed a random token stream; after each token the sequence is finished exactly as the rules say."""
    max_model_len = prompt_len + room
    seq = Sequence(list(range(prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))
    seq.status = SequenceStatus.RUNNING
    for token in stream:
        seq.append_token(token)
        before = list(seq.token_ids)
        finished = ch01.check_stop(seq, set(eos), max_model_len)
        assert seq.token_ids == before, "check_stop must not change the tokens"
        if token in eos and not ignore_eos:
            want = SequenceStatus.FINISHED_STOPPED
        elif seq.num_completion_tokens >= max_tokens or seq.num_tokens >= max_model_len:
            want = SequenceStatus.FINISHED_LENGTH_CAPPED
        else:
            want = SequenceStatus.RUNNING
        assert seq.status is want, (token, seq.num_completion_tokens, seq.num_tokens)
        assert finished is (want is not SequenceStatus.RUNNING)
        if finished:
            break


@pytest.mark.ch01
@pytest.mark.ch01_ex1
def test_ch01_ex1_check_stop_cases(ch01):
    """The chapter's cases by name: a stop on the last allowed token is "stop"; ignore_eos goes on."""
    def run(stream, eos=frozenset({2}), max_model_len=100, **params):
        seq = Sequence([7, 7, 7], SamplingParams(**params))
        seq.status = SequenceStatus.RUNNING
        for token in stream:
            seq.append_token(token)
            if ch01.check_stop(seq, set(eos), max_model_len):
                break
        return seq.completion_token_ids, seq.finish_reason

    assert run([5, 6, 2, 8], max_tokens=16) == ([5, 6, 2], "stop")
    assert run([5, 6, 2, 8], max_tokens=2) == ([5, 6], "length")
    assert run([5, 6, 2], max_tokens=3) == ([5, 6, 2], "stop")
    assert run([5, 2, 2, 8], max_tokens=4, ignore_eos=True) == ([5, 2, 2, 8], "length")
    assert run([5, 6, 7, 8], max_tokens=16, max_model_len=5) == ([5, 6], "length")
    assert run([5, 9], eos={9, 2}, max_tokens=16) == ([5, 9], "stop")
    assert run([5, 6], max_tokens=16) == ([5, 6], None)


