"""Grading tests for chapter 10 (`pytest -m ch10_ex2 --impl=exercises`, ...); see test_grading.py.

Each answer is graded by its contract, not by comparison with minivllm's own code: transformers'
logits processors (float64 to 1e-12: the same formula, only last-bit rounding may differ; float32 on
fixed rows), the detokenization rule on random token streams (hypothesis), and the engine's greedy
tokens against transformers' `generate`.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import NoRepeatNGramLogitsProcessor, TypicalLogitsWarper

from adapters import load
from engine_helpers import check_invariants, make_model, one_thread, random_prompts, run_engine
from minivllm.core.block_manager import BlockManager
from minivllm.engine.llm_engine import LLMEngine
from minivllm.attention.paged_attention import PagedAttention
from minivllm.engine.processor import completion_text
from minivllm.sampling_params import SamplingParams

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


@pytest.fixture(scope="module")
def ch10(impl_name):
    return load("ch10_sampling", impl_name)


def random_logits(seed: int, rows: int, vocab: int, dtype=torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, dtype=torch.float64, generator=gen) * 3).to(dtype)


# --- exercise 5: typical sampling ------------------------------------------------------------------

def typical_reference(logits: torch.Tensor, mass: float) -> torch.Tensor:
    return TypicalLogitsWarper(mass)(None, logits.clone())


@pytest.mark.ch10
@pytest.mark.ch10_ex2
@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 100_000), vocab=st.integers(2, 60), rows=st.integers(1, 4), data=st.data())
def test_ch10_ex2_typical_p_equals_transformers(ch10, seed, vocab, rows, data):
    logits = random_logits(seed, rows, vocab)
    masses = [data.draw(st.floats(0.05, 0.99)) for _ in range(rows)]
    ours = ch10.apply_typical_p(logits, torch.tensor(masses, dtype=torch.float64))
    assert ours.shape == logits.shape and ours.dtype == logits.dtype
    for i, mass in enumerate(masses):
        want = typical_reference(logits[i:i + 1], mass)[0]
        dropped, want_dropped = torch.isinf(ours[i]), torch.isinf(want)
        assert torch.equal(dropped, want_dropped), (
            f"row {i}, typical_p={mass}: you keep tokens {(~dropped).nonzero().flatten().tolist()}, "
            f"transformers keeps {(~want_dropped).nonzero().flatten().tolist()}")
        assert torch.equal(ours[i][~dropped], logits[i][~dropped]), "kept logits must not change"


@pytest.mark.ch10
@pytest.mark.ch10_ex2
def test_ch10_ex2_typical_p_rows_alone_and_float32(ch10):
    logits = random_logits(3, 6, 40)
    masses = torch.tensor([0.2, 1.0, 0.5, 0.9, 1.0, 0.7], dtype=torch.float64)
    batch = ch10.apply_typical_p(logits, masses)
    for i in range(6):
        assert torch.equal(ch10.apply_typical_p(logits[i:i + 1], masses[i:i + 1])[0], batch[i]), \
            f"row {i} changed when batched with others"
    assert torch.equal(batch[1], logits[1]) and torch.equal(batch[4], logits[4]), "typical_p=1 must leave a row alone"
    f32 = ch10.apply_typical_p(logits.float(), masses.float())
    assert f32.dtype == torch.float32
    for i in (0, 2, 3, 5):  # fixed rows whose cut-off is far from a rounding tie
        assert torch.equal(torch.isinf(f32[i]), torch.isinf(typical_reference(logits[i:i + 1].float(),
                                                                               float(masses[i]))[0])), i


# --- exercise 6: the offset detokenizer -------------------------------------------------------------

@pytest.fixture(scope="module")
def smol():
    from minivllm.transformers_utils.model_files import load_tokenizer

    tok = load_tokenizer(None)
    pieces = tok.encode("🌟👌 中文 日本語 ü € ∑ naïve") + tok.all_special_ids
    pieces += [i for i in range(len(tok)) if tok.decode([i]).endswith("\ufffd")][:60]
    return tok, pieces


@pytest.mark.ch10
@pytest.mark.ch10_ex3
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_ch10_ex3_offset_detokenizer_contract(ch10, smol, data):
    tok, pieces = smol
    token = st.one_of(st.sampled_from(pieces), st.integers(0, len(tok) - 1))
    prompt = tok.encode(data.draw(st.sampled_from(["Note:", "The capital of France is", "中文 text", "Hi"])))
    ids = data.draw(st.lists(token, min_size=1, max_size=14))
    d = ch10.MyIncrementalDetokenizer(tok, prompt)
    text = ""
    for i, t in enumerate(ids):
        piece = d.decode_next(t)
        assert isinstance(piece, str), f"decode_next returned {piece!r}, not a str"
        text += piece
        target = completion_text(tok, prompt, ids[:i + 1])
        assert target.startswith(text), f"after tokens {ids[:i + 1]}: your text {text!r} is not a prefix of {target!r}"
        assert not text.endswith("\ufffd"), f"after tokens {ids[:i + 1]}: the text ends in an incomplete character"
        if not target.endswith("\ufffd"):
            assert text == target, f"after tokens {ids[:i + 1]}: expected {target!r}, got {text!r}"


@pytest.mark.ch10
@pytest.mark.ch10_ex3
def test_ch10_ex3_cases_by_name(ch10, smol):
    tok, _ = smol
    star = tok.encode("🌟")
    d = ch10.MyIncrementalDetokenizer(tok, tok.encode("Stars:"))
    assert [d.decode_next(t) for t in star] == ["", "", "🌟"]
    d = ch10.MyIncrementalDetokenizer(tok, tok.encode("The capital of France is"))
    assert "".join(d.decode_next(t) for t in tok.encode(" Paris.") + [tok.eos_token_id]) == " Paris."


# --- exercise 7: no repeated n-grams ----------------------------------------------------------------

@pytest.mark.ch10
@pytest.mark.ch10_ex4
@settings(max_examples=120, deadline=None)
@given(data=st.data(), n=st.integers(1, 4), vocab=st.integers(2, 8), seed=st.integers(0, 1000))
def test_ch10_ex4_no_repeat_ngram_equals_transformers(ch10, data, n, vocab, seed):
    rows = data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12), min_size=1, max_size=3))
    logits = random_logits(seed, len(rows), vocab)
    ours = ch10.apply_no_repeat_ngram(logits, rows, n)
    for i, ids in enumerate(rows):
        want = NoRepeatNGramLogitsProcessor(n)(torch.tensor([ids]), logits[i:i + 1].clone())[0]
        assert torch.equal(ours[i], want), (f"row {ids}, n={n}: you ban {torch.isinf(ours[i]).nonzero().flatten().tolist()}"
                                            f", transformers bans {torch.isinf(want).nonzero().flatten().tolist()}")


@pytest.mark.ch10
@pytest.mark.ch10_ex4
def test_ch10_ex4_engine_greedy_equals_transformers_generate(ch10, tmp_path):
    hf = make_model(tmp_path, "llama", vocab_size=12)  # a small vocabulary: repeats are frequent
    prompts = random_prompts(4, 3, 12, seed=2, vocab=12)
    engine = LLMEngine(model=tmp_path, dtype="float64", max_model_len=64, block_size=4, num_kvcache_blocks=64,
                       block_manager_cls=BlockManager, attention_backend=PagedAttention, sampler_cls=ch10.NoRepeatNGramSampler)
    outs = run_engine(engine, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    check_invariants(engine)
    for p, o in zip(prompts, outs):
        with torch.inference_mode():
            want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               do_sample=False, max_new_tokens=12, no_repeat_ngram_size=3, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == want, f"prompt {p}"
