"""Chapter 03: static batching with padding equals one-at-a-time decoding and transformers."""
from __future__ import annotations

import pytest
import torch

from minivllm.model_executor.models.llama import attention_reference
from minivllm.model_executor.model_loader import load_model
from minivllm.baselines.naive import naive_generate
from minivllm.sampling_params import SamplingParams
from minivllm.baselines.static_batching import (IDLE, OUTPUT, PADDING, PROMPT, StaticBatchKVCache, pad_batch,
                                      slot_fractions, slot_grid, static_generate)

PROMPT_LENS = (1, 7, 30, 12, 3, 50, 2)
MAX_TOKENS = (10, 25, 5, 40, 20, 15, 1)


def _prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_greedy(hf_model, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                                max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_pad_batch_left_pads_and_counts_positions_from_the_prompt():
    batch = pad_batch([[5, 6, 7], [8], [1, 2, 3, 4]], pad_token_id=9)
    assert batch.input_ids.tolist() == [[9, 5, 6, 7], [9, 9, 9, 8], [1, 2, 3, 4]]
    assert batch.positions.tolist() == [[0, 0, 1, 2], [0, 0, 0, 0], [0, 1, 2, 3]]
    assert batch.pad_lens.tolist() == [1, 3, 0]


@pytest.mark.parametrize("prompts", [[], [[1, 2], []]])
def test_pad_batch_rejects_empty_input(prompts):
    with pytest.raises(ValueError):
        pad_batch(prompts)


def test_backend_equals_per_sequence_attention():
    g = torch.Generator().manual_seed(1)
    lens, heads, kv_heads, dim, new = [4, 1, 9, 6], 4, 2, 8, 3
    batch = pad_batch([[0] * n for n in lens])
    width = batch.max_prompt_len
    cache = StaticBatchKVCache(dim ** -0.5, batch.pad_lens, max_len=width + new)
    q, k, v = (torch.randn(len(lens), width + new, h, dim, generator=g, dtype=torch.float64)
               for h in (heads, kv_heads, kv_heads))
    outs = [cache(0, q[:, :width].reshape(-1, heads, dim), k[:, :width].reshape(-1, kv_heads, dim),
                  v[:, :width].reshape(-1, kv_heads, dim)).view(len(lens), width, heads, dim)]
    for c in range(width, width + new):
        outs.append(cache(0, q[:, c], k[:, c], v[:, c])[:, None])
    got = torch.cat(outs, dim=1)
    assert torch.isfinite(got).all()  # padding queries must not produce NaN
    for b, n in enumerate(lens):
        pad = width - n
        ref = attention_reference(q[b, pad:], k[b, pad:], v[b, pad:], dim ** -0.5)
        torch.testing.assert_close(got[b, pad:], ref, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="KV cache full"):
        cache(0, q[:, 0], k[:, 0], v[:, 0])


def test_greedy_equals_transformers_and_naive(tiny_model):
    folder, hf_model = tiny_model
    model = load_model(folder, dtype=torch.float64)
    prompts = _prompts(hf_model.config.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    # make a token that request 3 produces the EOS token, so some requests stop early
    eos = naive_generate(model, prompts[3], params[3])[8]
    result = static_generate(model, prompts, params, eos_token_id=eos)
    assert any(out[-1] == eos and len(out) < sp.max_tokens for out, sp in zip(result.outputs, params))
    for prompt, sp, out in zip(prompts, params, result.outputs):
        assert out == _hf_greedy(hf_model, prompt, sp.max_tokens, eos)
        assert out == naive_generate(model, prompt, sp, eos)
    assert result.num_steps == max(len(o) for o in result.outputs)


def test_seeded_sampling_equals_one_at_a_time(tiny_llama):
    folder, _ = tiny_llama
    model = load_model(folder, dtype=torch.float64)
    prompts = _prompts(128, seed=2)
    params = [SamplingParams(temperature=0.8, max_tokens=n, seed=i) for i, n in enumerate(MAX_TOKENS)]
    result = static_generate(model, prompts, params)
    for prompt, sp, out in zip(prompts, params, result.outputs):
        assert out == naive_generate(model, prompt, sp)


def test_ignore_eos_runs_to_max_tokens(tiny_llama):
    folder, _ = tiny_llama
    model = load_model(folder, dtype=torch.float64)
    prompts = _prompts(128)[:3]
    eos = naive_generate(model, prompts[0], SamplingParams(temperature=0, max_tokens=2))[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    result = static_generate(model, prompts, params, eos_token_id=eos)
    assert [len(o) for o in result.outputs] == [6, 6, 6]


def test_bad_input_raises(tiny_llama):
    folder, _ = tiny_llama
    model = load_model(folder, dtype=torch.float64)
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="max_position_embeddings"):
        static_generate(model, [[1] * 10, [2]], SamplingParams(temperature=0, max_tokens=limit - 5))
    with pytest.raises(ValueError, match="sampling params"):
        static_generate(model, [[1], [2]], [SamplingParams(temperature=0)])
    with pytest.raises(ValueError, match="empty"):
        static_generate(model, [[1], []], SamplingParams(temperature=0))


def test_slot_accounting():
    grid = slot_grid([3, 1], [1, 4])
    assert grid.tolist() == [[PROMPT, PROMPT, PROMPT, IDLE, IDLE, IDLE],
                             [PADDING, PADDING, PROMPT, OUTPUT, OUTPUT, OUTPUT]]
    fractions = slot_fractions(grid)
    assert fractions == pytest.approx({"padding": 2 / 12, "prompt": 4 / 12, "output": 3 / 12, "idle": 3 / 12})


def test_seeds_beyond_32_bits_give_their_own_streams(tiny_llama):
    folder, _ = tiny_llama
    model = load_model(folder, dtype=torch.float64)
    prompts = _prompts(128)[:2]
    runs = [static_generate(model, prompts, SamplingParams(temperature=1.0, max_tokens=12, seed=seed)).outputs
            for seed in (1, 1 + 2**32, 1)]
    assert runs[0] == runs[2] and runs[0] != runs[1]


def test_result_lengths_and_reserved_cache():
    result_lens = slot_grid([4, 2], [3, 1]).shape
    assert result_lens == (2, 4 + 3 - 1)
    cache = StaticBatchKVCache(0.5, torch.tensor([0, 2]), max_len=7)
    k = torch.zeros(2 * 4, 1, 8)
    cache(0, k, k, k)
    assert cache.num_bytes == 2 * (2 * 7 * 1 * 8 * 4)  # K and V, the whole rectangle reserved at once
