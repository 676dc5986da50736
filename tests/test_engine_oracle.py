"""The engine's greedy tokens equal transformers' `generate(do_sample=False)` (chapters 04-06).

Float64 tiny random Llama and Qwen3 models, 32 prompts of 1-300 tokens, under each engine
configuration; transformers' references are computed once per model and reused.
"""
from __future__ import annotations

import random

import pytest
import torch

from engine_helpers import (check_invariants, float32_cpu_linear, hf_greedy, make_model, one_thread, random_prompts,
                            run_engine)
from minivllm.attention.backend import ContiguousAttention
from minivllm.engine.llm_engine import LLMEngine
from minivllm.core.kv_cache_manager import ContiguousBlockManager
from minivllm.model_executor.layers.linear import onednn_packing_supported
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams

NUM_PROMPTS = 32
MAX_MODEL_LEN = 400

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def oracle(request, tmp_path_factory):
    """(model folder, transformers model, prompts, max_tokens per prompt, reference completions)."""
    folder = tmp_path_factory.mktemp(f"engine-{request.param}")
    model = make_model(folder, request.param)
    prompts = random_prompts(NUM_PROMPTS - 2, 1, 300, seed=1) + [[7], list(range(100)) * 3]
    rng = random.Random(2)
    max_tokens = [rng.randint(1, 10) for _ in prompts]
    refs = [hf_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    return folder, model, prompts, max_tokens, refs


def default_engine(folder, **kwargs) -> LLMEngine:
    """The engine `LLM` assembles from `minivllm.defaults` (paged blocks, prefix caching, best backend)."""
    return LLM(folder, **kwargs).llm_engine


def _params(max_tokens):
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]


CONFIGS = {
    "prefix-caching-on": dict(enable_prefix_caching=True),
    "prefix-caching-off": dict(enable_prefix_caching=False),
    "block-size-1": dict(block_size=1),
    "block-size-256": dict(block_size=256),
    "contiguous-ch04": dict(block_manager_cls=ContiguousBlockManager, attention_backend=ContiguousAttention,
                            num_kvcache_blocks=6 * MAX_MODEL_LEN // 16),
    "few-seqs-small-budget": dict(max_num_seqs=3, max_num_batched_tokens=MAX_MODEL_LEN),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_engine_greedy_equals_transformers(oracle, config):
    folder, _, prompts, max_tokens, refs = oracle
    engine = default_engine(folder, dtype="float64", max_model_len=MAX_MODEL_LEN, **CONFIGS[config])
    outs = run_engine(engine, prompts, _params(max_tokens))
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} ({len(prompts[i])} tokens)"
        assert out.outputs[0].finish_reason == "length"
        assert out.prompt_token_ids == prompts[i]


@pytest.mark.parametrize("caching", [True, False])
def test_repeated_preemption_keeps_outputs(oracle, caching):
    folder, _, prompts, max_tokens, refs = oracle
    # 84 blocks of 4 = 336 tokens (so max_model_len 336): the longest sequence (322 tokens) fits alone, the batch does not
    engine = default_engine(folder, dtype="float64", max_model_len=84 * 4, num_kvcache_blocks=84,
                            block_size=4, enable_prefix_caching=caching)
    outs = run_engine(engine, prompts, _params([m + 12 for m in max_tokens]))
    assert engine.scheduler.num_preemptions >= 3, engine.scheduler.num_preemptions
    for out, ref, m in zip(outs, refs, max_tokens):
        assert out.outputs[0].token_ids[:m] == ref


@pytest.mark.parametrize("block_size", [1, 16])
def test_prompt_of_whole_blocks_submitted_twice(oracle, block_size):
    folder, model, _, _, _ = oracle
    prompt = random_prompts(1, 3 * 16, 3 * 16, seed=5)[0]  # exactly k * block_size tokens
    ref = hf_greedy(model, prompt, 6)
    llm = LLM(folder, dtype="float64", max_model_len=MAX_MODEL_LEN, block_size=block_size)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    second = llm.generate([prompt], params, use_tqdm=False)[0]  # fully cached: the last block is recomputed
    both = llm.generate([prompt, prompt], params, use_tqdm=False)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == ref
    assert [o.outputs[0].token_ids for o in both] == [ref, ref]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == len(prompt) - block_size
    check_invariants(llm.llm_engine)


def test_identical_prompts_in_one_step(oracle):
    folder, model, prompts, _, _ = oracle
    batch = [prompts[0]] * 4 + [prompts[1]] * 3 + [prompts[0][:17]] * 2
    refs = {tuple(p): hf_greedy(model, p, 5) for p in batch}
    engine = default_engine(folder, dtype="float64", max_model_len=MAX_MODEL_LEN)
    outs = run_engine(engine, batch, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(engine.stats) == 5 and engine.stats[0].num_seqs == len(batch)  # one prefill, four decodes
    for p, out in zip(batch, outs):
        assert out.outputs[0].token_ids == refs[tuple(p)]


def test_shared_prefix_is_computed_once(oracle):
    folder, _, prompts, _, _ = oracle
    long = prompts[int(torch.tensor([len(p) for p in prompts]).argmax())]
    llm = LLM(folder, dtype="float64", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate([long[:200] + [1]], params, use_tqdm=False)
    outs = llm.generate([long[:200] + [t] for t in range(2, 6)], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [192] * 4
    check_invariants(llm.llm_engine)


def test_stops_at_eos_like_transformers(oracle):
    folder, model, prompts, _, _ = oracle
    # the model's EOS would almost never come up; declare the most frequent greedy token the EOS instead
    counts = torch.bincount(torch.tensor([t for p in prompts[:8] for t in hf_greedy(model, p, 8)]), minlength=128)
    eos = int(counts.argmax())
    engine = default_engine(folder, dtype="float64", max_model_len=MAX_MODEL_LEN)
    engine.eos_token_ids = engine.scheduler.eos_token_ids = frozenset({eos})
    outs = run_engine(engine, prompts[:8], SamplingParams(temperature=0, max_tokens=8))
    reasons = set()
    for p, out in zip(prompts[:8], outs):
        ref = hf_greedy(model, p, 8, eos_token_id=eos)
        assert out.outputs[0].token_ids == ref
        reasons.add(out.outputs[0].finish_reason)
        assert out.outputs[0].finish_reason == ("stop" if ref[-1] == eos else "length")
    assert "stop" in reasons


def test_seeded_sampling_does_not_depend_on_the_batch(oracle):
    folder, _, prompts, _, _ = oracle
    llm = LLM(folder, dtype="float64", max_model_len=MAX_MODEL_LEN)
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    alone = llm.generate([prompts[2]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True)] * 5
    crowd = llm.generate(prompts[:6], others[:2] + [seeded] + others[2:], use_tqdm=False)
    assert crowd[2].outputs[0].token_ids == alone
    assert len(set(tuple(o.outputs[0].token_ids) for o in crowd)) > 1  # sampling did happen
    check_invariants(llm.llm_engine)


def test_attention_backend_plugs_in(oracle):
    """The engine takes its attention backend from its arguments (any class with the backend interface plugs in)."""
    from minivllm.attention.paged_attention import PagedAttention

    calls = []

    class CountingAttention(PagedAttention):  # chapter 05's interface: the engine calls prefill and decode
        def prefill(self, *args):
            calls.append(True)
            return super().prefill(*args)

        def decode(self, *args):
            calls.append(False)
            return super().decode(*args)

    folder, _, prompts, max_tokens, refs = oracle
    engine = default_engine(folder, dtype="float64", max_model_len=MAX_MODEL_LEN, attention_backend=CountingAttention)
    outs = run_engine(engine, prompts[:4], _params(max_tokens[:4]))
    assert [o.outputs[0].token_ids for o in outs] == refs[:4]
    assert True in calls and (False in calls or max(max_tokens[:4]) == 1)


@pytest.mark.slow
def test_default_model_chat_greedy_text_equals_transformers():
    """On SmolLM2-135M-Instruct in float32, greedy chat completions read exactly like transformers'."""
    from transformers import AutoModelForCausalLM

    from minivllm.transformers_utils.model_files import resolve_model

    questions = ["What is the capital of France?", "Name three primary colours.", "What is 12 times 12?",
                 "Write a haiku about the sea.", "Who wrote Hamlet?", "What is photosynthesis? One sentence.",
                 "Translate 'good morning' into Spanish.", "Give me a synonym for 'happy'."]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0, max_tokens=40)
    llm = LLM(None, dtype="float32", max_model_len=2048)
    if onednn_packing_supported(torch.float32):  # so this test also covers the CPU's fast linear layers
        assert isinstance(llm.llm_engine.model_runner.model.lm_head, float32_cpu_linear())
    outs = llm.chat(conversations, params, use_tqdm=False)
    check_invariants(llm.llm_engine)
    tok = llm.get_tokenizer()
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float32).eval()
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40,
                              pad_token_id=tok.eos_token_id)
        ref_text = tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
        assert out.outputs[0].text == ref_text, (out.prompt, out.outputs[0].text, ref_text)


def test_generate_accepts_vllm_prompt_forms_and_keeps_input_order(oracle):
    folder, _, prompts, max_tokens, refs = oracle
    llm = LLM(folder, dtype="float64", max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
    assert llm.get_tokenizer() is None  # a tokenizer-less folder: token-id prompts only
    mixed = [prompts[0], {"prompt_token_ids": prompts[1]}, {"prompt_token_ids": prompts[2], "prompt": "x"}]
    outs = llm.generate(mixed, _params(max_tokens[:3]), use_tqdm=True)
    assert [o.outputs[0].token_ids for o in outs] == refs[:3]
    assert [o.prompt for o in outs] == [None, None, "x"] and all(o.finished for o in outs)
    assert [o.outputs[0].text for o in outs] == ["", "", ""]
    single = llm.generate({"prompt_token_ids": prompts[3]}, _params(max_tokens[3:4])[0], use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == refs[3]
    assert llm.generate([], use_tqdm=False) == []
    check_invariants(llm.llm_engine)


@pytest.mark.parametrize("limit", [None, 1, 150])
def test_prefill_microbatches_keep_outputs(oracle, monkeypatch, limit):
    """A prefill step run in forward passes of at most `limit` new tokens (1: one sequence per pass;
    None: the whole step in one pass) gives transformers' tokens all the same."""
    from minivllm.worker.model_runner import ModelRunner

    folder, _, prompts, max_tokens, refs = oracle
    from minivllm.core.sched.scheduler import Scheduler

    monkeypatch.setattr(ModelRunner, "prefill_microbatch_tokens", limit)
    engine = default_engine(folder, dtype="float64", max_model_len=MAX_MODEL_LEN, scheduler_cls=Scheduler)  # ch04's steps
    passes = []
    real = engine.model_runner.forward_logits
    monkeypatch.setattr(engine.model_runner, "forward_logits", lambda seqs, p: passes.append((len(seqs), p)) or real(seqs, p))
    outs = run_engine(engine, prompts, _params(max_tokens))
    assert [o.outputs[0].token_ids for o in outs] == refs
    prefill_passes = [n for n, is_prefill in passes if is_prefill]
    if limit == 1:
        assert set(prefill_passes) == {1} and len(prefill_passes) == len(prompts)
    elif limit is None:
        assert len(prefill_passes) == sum(1 for s in engine.stats if s.is_prefill)
    else:
        assert len(prefill_passes) > sum(1 for s in engine.stats if s.is_prefill)


def test_microbatches_cut_in_order_under_the_limit():
    from types import SimpleNamespace

    from minivllm.worker.model_runner import split_prefill

    seqs = [SimpleNamespace(num_tokens=n + c, num_cached_tokens=c) for n, c in
            [(30, 0), (70, 16), (1, 0), (250, 32), (60, 0), (40, 5), (1, 0)]]
    assert split_prefill(seqs, None) == [seqs]
    groups = split_prefill(seqs, 100)
    assert [s for g in groups for s in g] == seqs
    assert [len(g) for g in groups] == [2, 1, 1, 2, 1]
    for g in groups:
        new = sum(s.num_tokens - s.num_cached_tokens for s in g)
        assert new <= 100 or len(g) == 1


@pytest.mark.skipif(not onednn_packing_supported(torch.float32), reason="no oneDNN float32 linear here")
def test_packed_float32_engine_gives_the_same_tokens_in_any_passes(oracle, monkeypatch):
    """The engine's real CPU path (float32, chapter 02's C++ GEMM where the CPU has AVX-512 or AVX2, else
    oneDNN-packed layers) with prefill passes of one sequence each and with no limit: neither
    kernel's rows depend on how many rows it is given, so the greedy tokens must be identical (not
    just close)."""
    from minivllm.worker.model_runner import ModelRunner

    folder, _, prompts, max_tokens, _ = oracle
    outs = {}
    for limit in (None, 1):
        monkeypatch.setattr(ModelRunner, "prefill_microbatch_tokens", limit)
        engine = default_engine(folder, dtype="float32", max_model_len=MAX_MODEL_LEN)
        assert isinstance(engine.model_runner.model.lm_head, float32_cpu_linear())
        outs[limit] = [o.outputs[0].token_ids for o in run_engine(engine, prompts, _params(max_tokens))]
    assert outs[None] == outs[1]


@pytest.mark.parametrize("backend", ["cpu-kernel", "plain-torch", "contiguous"])
def test_each_attention_backend_equals_transformers(oracle, backend):
    """The engine runs exactly the attention backend it is given: chapter 05's C++ decode kernel,
    its plain-torch paged attention, and this chapter's contiguous one all give transformers' tokens."""
    from minivllm.core.block_manager import BlockManager
    from minivllm.attention.paged_attention import PagedAttention

    if backend == "cpu-kernel":
        from engine_helpers import require_cpu_kernel
        from minivllm.attention.backends.cpu_attn import CPUPagedAttention

        require_cpu_kernel()
    cls, manager = {"cpu-kernel": (CPUPagedAttention if backend == "cpu-kernel" else None, BlockManager),
                    "plain-torch": (PagedAttention, BlockManager),
                    "contiguous": (ContiguousAttention, ContiguousBlockManager)}[backend]
    folder, _, prompts, max_tokens, refs = oracle
    engine = LLMEngine(model=folder, dtype="float64", max_model_len=MAX_MODEL_LEN, device="cpu",
                       block_manager_cls=manager, attention_backend=cls, num_kvcache_blocks=6 * MAX_MODEL_LEN // 16)
    assert type(engine.model_runner.attn) is cls and type(engine.block_manager) is manager
    outs = run_engine(engine, prompts, _params(max_tokens))
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_llm_engine_defaults_to_chapter_04_pieces(oracle):
    from minivllm.core.sched.scheduler import Scheduler

    engine = LLMEngine(model=oracle[0], dtype="float64", max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=100)
    assert type(engine.block_manager) is ContiguousBlockManager and engine.block_manager.block_size == MAX_MODEL_LEN
    assert type(engine.model_runner.attn) is ContiguousAttention and type(engine.scheduler) is Scheduler


def test_the_runner_scores_a_prompt_and_copies_blocks(oracle):
    """The model runner's services to the rest of the engine: `prompt_logits` (every position, no KV
    cache, in chunks of rows: whole, several with a shorter last one, one row each) equals transformers'
    logits in float64, and `copy_blocks` copies K and V of every layer."""
    folder, model, prompts, _, _ = oracle
    engine = LLMEngine(model=folder, dtype="float64", max_model_len=MAX_MODEL_LEN)
    runner, prompt = engine.model_runner, prompts[-1]  # 300 tokens
    with torch.inference_mode():
        want = model(torch.tensor([prompt])).logits[0]
    for chunk, sizes in [(None, [300]), (64, [64] * 4 + [44]), (1, [1] * 300)]:
        chunks = list(runner.prompt_logits(prompt, chunk))
        assert [len(c) for c in chunks] == sizes
        assert (torch.cat(chunks) - want).abs().max().item() < 1e-9, chunk
    with pytest.raises(ValueError, match="chunk_tokens must be at least 1; got 0"):
        runner.prompt_logits(prompt, 0)
    cache = runner.kv_cache
    cache[:, :, 0].normal_()
    runner.copy_blocks([(0, 2)])
    assert torch.equal(cache[:, :, 2], cache[:, :, 0]) and not torch.equal(cache[:, :, 1], cache[:, :, 0])


def test_one_class_per_name_for_the_engine_parts():
    """One `Sampler` (chapter 10's, sample/sampler.py; chapter 04 samples with `sample_batch`), one
    block-manager interface name: no class of the package is defined twice under the same name."""
    import ast
    import pathlib
    from collections import defaultdict

    root = pathlib.Path(__file__).resolve().parent.parent / "minivllm"
    where = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(str(path.relative_to(root)))
    assert where["Sampler"] == ["sample/sampler.py"]
    assert not {name: files for name, files in where.items() if len(files) > 1}
    assert "KVCacheManager" not in where and "ContiguousKVManager" not in where
