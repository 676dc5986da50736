"""Grading tests for chapter 03's exercise (`pytest -m ch03_ex1 --impl=exercises`); see test_grading.py."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import load
from minivllm import static_batching
from minivllm.models.llama import load_model
from minivllm.naive import naive_generate
from minivllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def ch03(impl_name):
    return load("ch03_batching", impl_name)


@pytest.mark.ch03
@pytest.mark.ch03_ex1
@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 12), min_size=1, max_size=4), kv_heads=st.sampled_from([1, 2]),
       groups=st.sampled_from([1, 3]), decode=st.booleans(), seed=st.integers(0, 2**16))
def test_ch03_ex1_padded_attention_matches(ch03, lens, kv_heads, groups, decode, seed):
    g = torch.Generator().manual_seed(seed)
    width = max(lens)
    pad_lens = torch.tensor([width - n for n in lens])
    tk = width + 2 if decode else width
    tq = 1 if decode else width
    q = torch.randn(len(lens), tq, kv_heads * groups, 8, generator=g, dtype=torch.float64)
    k = torch.randn(len(lens), tk, kv_heads, 8, generator=g, dtype=torch.float64)
    v = torch.randn(len(lens), tk, kv_heads, 8, generator=g, dtype=torch.float64)
    got = ch03.padded_attention(q, k, v, pad_lens, 0.3)
    assert got.shape == q.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, static_batching.padded_attention(q, k, v, pad_lens, 0.3), atol=1e-12, rtol=0)


@pytest.mark.ch03
@pytest.mark.ch03_ex1
def test_ch03_ex1_static_generate_unchanged(ch03, tiny_llama, monkeypatch):
    folder, _ = tiny_llama
    model = load_model(folder, dtype=torch.float64)
    monkeypatch.setattr(static_batching, "padded_attention", ch03.padded_attention)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 17, 1, 9)]
    params = SamplingParams(temperature=0, max_tokens=8)
    result = static_batching.static_generate(model, prompts, params)
    assert result.outputs == [naive_generate(model, p, params) for p in prompts]
