"""Grading tests for chapter 03's exercise (`pytest -m ch03_ex1 --impl=exercises`); see test_grading.py.

Graded by contract only: torch's own attention on each sequence alone, and transformers' logits.
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import load
from minivllm.model_executor.model_loader import load_model


@pytest.fixture(scope="module")
def ch03(impl_name):
    return load("ch03_batching", impl_name)


def _cu_seqlens(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lens).cumsum(0)


@pytest.mark.ch03
@pytest.mark.ch03_ex1
@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 12), min_size=1, max_size=5), kv_heads=st.sampled_from([1, 2]),
       groups=st.sampled_from([1, 3]), seed=st.integers(0, 2**16))
def test_ch03_ex1_varlen_attention_equals_each_sequence_alone(ch03, lens, kv_heads, groups, seed):
    g = torch.Generator().manual_seed(seed)
    n, heads, scale = sum(lens), kv_heads * groups, 0.3
    q = torch.randn(n, heads, 8, generator=g, dtype=torch.float64)
    k = torch.randn(n, kv_heads, 8, generator=g, dtype=torch.float64)
    v = torch.randn(n, kv_heads, 8, generator=g, dtype=torch.float64)
    cu = _cu_seqlens(lens)
    got = ch03.varlen_attention(q, k, v, cu, scale)
    assert got.shape == q.shape and got.dtype == q.dtype and torch.isfinite(got).all()
    for s in range(len(lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)))
        want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
        torch.testing.assert_close(got[a:b], want, atol=1e-12, rtol=0)


@pytest.mark.ch03
@pytest.mark.ch03_ex1
def test_ch03_ex1_packed_prefill_equals_transformers(ch03, tiny_model):
    folder, hf = tiny_model
    model = load_model(folder, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    lens = [3, 17, 1, 9]
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g) for n in lens]
    cu = _cu_seqlens(lens)
    scale = model.model.layers[0].self_attn.scale

    def attn(layer_idx, q, k, v):
        return ch03.varlen_attention(q, k, v, cu, scale)

    positions = torch.cat([torch.arange(n) for n in lens])  # each sequence starts at position 0
    with torch.no_grad():
        logits = model.compute_logits(model(torch.cat(prompts), positions, attn))
        for s, p in enumerate(prompts):
            want = hf(p[None]).logits[0]
            assert (logits[int(cu[s]):int(cu[s + 1])] - want).abs().max() < 1e-9, s
