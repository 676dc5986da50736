"""Grading tests for the chapter exercises. Run against the reference (`--impl=solutions`, default)
or a student's work (`--impl=exercises`); select one exercise with `-m ch02_ex1`.

Each exercise is checked against an oracle on random inputs (hypothesis) and by plugging it into a
model or engine whose output must not change. Chapter 02's exercises are variants the chapter does
not show, graded against transformers and torch.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters import load
from minivllm.model_executor.models.llama import RotaryEmbedding
from minivllm.model_executor.model_loader import load_model
from minivllm.baselines.naive import CausalAttention


@pytest.fixture(scope="module")
def ch02(impl_name):
    return load("ch02_model", impl_name)


@pytest.fixture(scope="module", autouse=True)
def _rebuild_regions_are_the_graders():
    """Each extend exercise is graded alone: the rebuild regions of chapters 01 and 02 (stubs in a
    student edition) are the grader's stand-ins here (see test_grading_ch01_regions.py and _ch02_)."""
    from test_grading_ch01_regions import graded as ch01_stand_ins
    from test_grading_ch02_regions import graded as ch02_stand_ins

    with ch01_stand_ins(None), ch02_stand_ins(None):
        yield


# --- chapter 02 -------------------------------------------------------------------------------
# Both exercises are variants the chapter does not show; their oracles are transformers and torch.

@pytest.mark.ch02
@pytest.mark.ch02_ex1
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 16), hidden=st.integers(1, 96), eps=st.sampled_from([1e-6, 1e-5]),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16))
def test_ch02_ex1_gemma_rms_norm_bit_identical_to_transformers(ch02, n, hidden, eps, dtype, seed):
    """bfloat16/float16 catch the cast order: multiplying after casting back gives other bits."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, hidden, generator=g, dtype=torch.float64) * 3).to(dtype)
    ref = GemmaRMSNorm(hidden, eps=eps).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(hidden, generator=g) * 0.5)
        want = ref(x)
    got = ch02.gemma_rms_norm(x, ref.weight.detach(), eps)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want)


@pytest.mark.ch02
@pytest.mark.ch02_ex1
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 16), heads=st.integers(1, 4), half=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_ch02_ex1_interleaved_rope_matches_gptj(ch02, n, heads, half, seed):
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions

    g = torch.Generator().manual_seed(seed)
    head_dim = 2 * half
    positions = torch.randint(0, 64, (n,), generator=g)
    sin, cos = create_sinusoidal_positions(64, head_dim)[positions].double().split(half, dim=-1)
    x = torch.randn(n, heads, head_dim, generator=g, dtype=torch.float64)
    want = apply_rotary_pos_emb(x[None], sin[None], cos[None])[0]
    got = ch02.apply_rope_interleaved(x, cos, sin)
    assert got.shape == x.shape
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


def interleave_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo transformers' Llama conversion permute: per head, rows (i, i + d/2) become rows (2i, 2i+1)."""
    out_features, in_features = weight.shape
    head_dim = out_features // num_heads
    return weight.view(num_heads, 2, head_dim // 2, in_features).transpose(1, 2).reshape(out_features, in_features)


@pytest.mark.ch02
@pytest.mark.ch02_ex1
def test_ch02_ex1_interleaved_rope_runs_a_meta_layout_llama(ch02, tiny_llama, monkeypatch):
    """q/k rows permuted back to Meta's interleaved layout + interleaved RoPE = transformers' logits."""
    folder, hf = tiny_llama
    model = load_model(folder, dtype=torch.float64)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.copy_(interleave_rows(attn.q_proj.weight, attn.num_heads))
            attn.k_proj.weight.copy_(interleave_rows(attn.k_proj.weight, attn.num_kv_heads))

    def rope_forward(self, positions, q, k):
        half = self.head_dim // 2  # the table's first half holds one angle per pair
        cos, sin = self.cos[positions, :half].to(q.dtype), self.sin[positions, :half].to(q.dtype)
        return ch02.apply_rope_interleaved(q, cos, sin), ch02.apply_rope_interleaved(k, cos, sin)

    monkeypatch.setattr(RotaryEmbedding, "forward", rope_forward)
    ids = torch.randint(0, 128, (33,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = model.compute_logits(model(ids, torch.arange(33), CausalAttention(model.model.layers[0].self_attn.scale)))
        ref = hf(ids[None]).logits[0]
    assert (got - ref).abs().max() < 1e-9


def sdpa_oracle(q, k, v, scale, causal, window):
    """torch's scaled_dot_product_attention with the mask spelled out position by position."""
    tq, tk, groups = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    allowed = torch.ones(tq, tk, dtype=torch.bool)
    for i in range(tq):
        p = i + tk - tq
        for j in range(tk):
            allowed[i, j] = (not causal or j <= p) and (window is None or p - j < window)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(groups, 1).transpose(0, 1),
        v.repeat_interleave(groups, 1).transpose(0, 1), attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.ch02
@pytest.mark.ch02_ex2
@settings(max_examples=80, deadline=None)
@given(tq=st.integers(1, 12), extra=st.integers(0, 12), kv_heads=st.integers(1, 3), groups=st.integers(1, 3),
       window=st.one_of(st.none(), st.integers(1, 30)), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_ch02_ex2_attention_matches_torch(ch02, tq, extra, kv_heads, groups, window, causal, seed):
    if window is not None and not causal:
        causal = True  # a window is defined together with the causal rule
    g = torch.Generator().manual_seed(seed)
    tk = tq + extra
    q = torch.randn(tq, kv_heads * groups, 8, generator=g, dtype=torch.float64)
    k = torch.randn(tk, kv_heads, 8, generator=g, dtype=torch.float64)
    v = torch.randn(tk, kv_heads, 8, generator=g, dtype=torch.float64)
    got = ch02.attention(q, k, v, 0.35, causal=causal, sliding_window=window)
    assert got.shape == q.shape
    assert torch.allclose(got, sdpa_oracle(q, k, v, 0.35, causal, window), rtol=0, atol=1e-12)


WINDOW = 6


@pytest.fixture(scope="module")
def sliding_qwen2(tmp_path_factory):
    """A tiny Qwen2 whose second layer sees the last WINDOW tokens, and our decoder on its weights
    (loaded from a copy whose config turns the window off, since load_model refuses it)."""
    import json
    import shutil

    from minivllm.course.testing import make_tiny_model

    folder = tmp_path_factory.mktemp("sliding-qwen2")
    hf = make_tiny_model(folder, "qwen2", seed=1, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    windows = [WINDOW if t == "sliding_attention" else None for t in hf.config.layer_types]
    assert windows == [None, WINDOW]
    plain = tmp_path_factory.mktemp("sliding-qwen2-off")
    shutil.copytree(folder, plain, dirs_exist_ok=True)
    cfg = json.loads((plain / "config.json").read_text())
    cfg.update(use_sliding_window=False, layer_types=None)
    (plain / "config.json").write_text(json.dumps(cfg))
    return hf, load_model(plain, dtype=torch.float64), windows


class StudentKVCache:
    """A KV cache backend (one growing tensor per layer) that attends with the student's function."""

    def __init__(self, attention, scale, windows):
        self.attention, self.scale, self.windows, self.k, self.v, self.calls = attention, scale, windows, {}, {}, 0

    def __call__(self, layer_idx, q, k, v):
        self.k[layer_idx] = torch.cat([self.k[layer_idx], k]) if layer_idx in self.k else k
        self.v[layer_idx] = torch.cat([self.v[layer_idx], v]) if layer_idx in self.v else v
        self.calls += 1
        return self.attention(q, self.k[layer_idx], self.v[layer_idx], self.scale, causal=True,
                              sliding_window=self.windows[layer_idx])


@pytest.mark.ch02
@pytest.mark.ch02_ex2
def test_ch02_ex2_sliding_qwen2_logits_equal_transformers(ch02, sliding_qwen2):
    hf, model, windows = sliding_qwen2
    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = model.compute_logits(model(ids, torch.arange(30), StudentKVCache(
            ch02.attention, model.model.layers[0].self_attn.scale, windows)))
        ref = hf(ids[None]).logits[0]
        plain = model.compute_logits(model(ids, torch.arange(30), CausalAttention(model.model.layers[0].self_attn.scale)))
    assert (plain - ref).abs().max() > 1e-6  # the window matters for this input
    assert (got - ref).abs().max() < 1e-9


@pytest.mark.ch02
@pytest.mark.ch02_ex2
def test_ch02_ex2_sliding_qwen2_generates_through_a_kv_cache(ch02, sliding_qwen2):
    hf, model, windows = sliding_qwen2
    prompt, new_tokens = [9, 8, 7, 6, 5, 4, 3], 14
    cache = StudentKVCache(ch02.attention, model.model.layers[0].self_attn.scale, windows)
    tokens = list(prompt)
    with torch.no_grad():
        for step in range(new_tokens):  # prefill, then one token per step
            start = 0 if step == 0 else len(tokens) - 1
            hidden = model(torch.tensor(tokens[start:]), torch.arange(start, len(tokens)), cache)
            tokens.append(int(model.compute_logits(hidden[-1]).argmax()))
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    assert tokens[len(prompt):] == out[0, len(prompt):].tolist()
    assert cache.calls == new_tokens * model.config.num_hidden_layers  # every step, every layer
