"""Grading tests for the chapter exercises. Run against the reference (`--impl=solutions`, default)
or a student's work (`--impl=exercises`); select one exercise with `-m ch02_ex1`.

Each exercise is checked twice: differentially against minivllm's own implementation on random
inputs (hypothesis), and by plugging it into the real model or engine, whose output must not change.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import load
from minivllm.models.llama import RMSNorm, RotaryEmbedding, attention_reference, load_model
from minivllm.naive import CausalAttention, naive_generate
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence


@pytest.fixture(scope="module")
def ch01(impl_name):
    return load("ch01_sequences", impl_name)


@pytest.fixture(scope="module")
def ch02(impl_name):
    return load("ch02_model", impl_name)


# --- chapter 01 -------------------------------------------------------------------------------

@pytest.mark.ch01
@pytest.mark.ch01_ex1
@settings(max_examples=200, deadline=None)
@given(num_tokens=st.integers(1, 300), block_size=st.integers(1, 64), extra=st.integers(0, 40))
def test_ch01_ex1_block_helpers_match_sequence(ch01, num_tokens, block_size, extra):
    tokens = list(range(num_tokens))
    mine, ref = ch01.BlockSequence(tokens, block_size=block_size), Sequence(tokens, block_size=block_size)
    for t in range(extra):  # generated tokens move the last block forward
        mine.append_token(t)
        ref.append_token(t)
    assert mine.num_blocks == ref.num_blocks
    assert mine.last_block_num_tokens == ref.last_block_num_tokens
    assert [mine.block(i) for i in range(ref.num_blocks)] == [ref.block(i) for i in range(ref.num_blocks)]
    for bad in (-1, ref.num_blocks):
        with pytest.raises(IndexError):
            mine.block(bad)


# --- chapter 02 -------------------------------------------------------------------------------

@pytest.mark.ch02
@pytest.mark.ch02_ex1
@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 16), heads=st.integers(1, 4), half=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_ch02_ex1_rms_norm_and_rope_match(ch02, n, heads, half, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = 2 * half
    x = torch.randn(n, hidden, generator=g, dtype=torch.float64) * 3
    norm = RMSNorm(hidden, eps=1e-5).to(torch.float64)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g))
        assert torch.allclose(ch02.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=0, atol=1e-12)
    rope = RotaryEmbedding(hidden, 64, 10000.0)
    positions = torch.randint(0, 64, (n,), generator=g)
    q = torch.randn(n, heads, hidden, generator=g, dtype=torch.float64)
    ref_q, _ = rope(positions, q, q[:, :1])
    cos, sin = rope.cos[positions].to(q.dtype), rope.sin[positions].to(q.dtype)
    assert torch.allclose(ch02.apply_rope(q, cos, sin), ref_q, rtol=0, atol=1e-12)


@pytest.mark.ch02
@pytest.mark.ch02_ex1
def test_ch02_ex1_plugged_into_the_decoder(ch02, tiny_llama, monkeypatch):
    folder, hf = tiny_llama
    model = load_model(folder, dtype=torch.float64)
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x: ch02.rms_norm(x, self.weight, self.eps))

    def rope_forward(self, positions, q, k):
        cos, sin = self.cos[positions].to(q.dtype), self.sin[positions].to(q.dtype)
        return ch02.apply_rope(q, cos, sin), ch02.apply_rope(k, cos, sin)

    monkeypatch.setattr(RotaryEmbedding, "forward", rope_forward)
    ids = torch.randint(0, 128, (33,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = model.compute_logits(model(ids, torch.arange(33), CausalAttention(model.model.layers[0].self_attn.scale)))
        ref = hf(ids[None]).logits[0]
    assert (got - ref).abs().max() < 1e-9


@pytest.mark.ch02
@pytest.mark.ch02_ex2
@settings(max_examples=60, deadline=None)
@given(tq=st.integers(1, 12), extra=st.integers(0, 12), kv_heads=st.integers(1, 3), groups=st.integers(1, 3),
       causal=st.booleans(), seed=st.integers(0, 2**16))
def test_ch02_ex2_attention_matches_reference(ch02, tq, extra, kv_heads, groups, causal, seed):
    g = torch.Generator().manual_seed(seed)
    tk = tq + extra
    q = torch.randn(tq, kv_heads * groups, 8, generator=g, dtype=torch.float64)
    k = torch.randn(tk, kv_heads, 8, generator=g, dtype=torch.float64)
    v = torch.randn(tk, kv_heads, 8, generator=g, dtype=torch.float64)
    got = ch02.attention(q, k, v, 0.35, causal=causal)
    assert got.shape == q.shape
    assert torch.allclose(got, attention_reference(q, k, v, 0.35, causal=causal), rtol=0, atol=1e-12)


@pytest.mark.ch02
@pytest.mark.ch02_ex2
def test_ch02_ex2_generates_through_a_kv_cache(ch02, tiny_llama, monkeypatch):
    folder, _ = tiny_llama
    model = load_model(folder, dtype=torch.float64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = [9, 8, 7, 6, 5, 4, 3]
    want = naive_generate(model, prompt, params, use_kv_cache=False)
    import minivllm.naive as naive

    calls = []

    def student_attention(*args, **kwargs):
        calls.append(1)
        return ch02.attention(*args, **kwargs)

    monkeypatch.setattr(naive, "attention_reference", student_attention)  # ContiguousKVCache calls it
    assert naive_generate(model, prompt, params, use_kv_cache=True) == want
    assert len(calls) == 12 * model.config.num_hidden_layers  # every step, every layer went through it
