"""Chapter 10's stopping, incremental detokenization, streaming, logprobs and n > 1, through the engine.

A tiny float64 model carries the engine tests. Its final norm is zeroed for the tokenizer tests, so
all logits are equal: greedy picks token 0 ("▁paris" in the SentencePiece-style tokenizer of
test_detokenize), and sampling is uniform. The detokenization rule is checked with hypothesis on the
default model's byte-level tokenizer (marked slow: it needs the converted model folder).
"""
from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine_helpers import check_invariants, make_model, one_thread, random_prompts, run_engine
from minivllm.core.block_manager import BlockManager
from minivllm.engine.detokenizer import IncrementalDetokenizer, check_stop_strings, finish_text, update_text
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.output_processor import OutputProcessor, compute_prompt_logprobs, iter_outputs
from minivllm.attention.paged_attention import PagedAttention
from minivllm.core.prefix_caching import PrefixCachingBlockManager
from minivllm.engine.processor import completion_text
from minivllm.sample.sampler import Sampler
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from test_detokenize import PIECES, PROMPT, sentencepiece_tokenizer

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)
CH10 = dict(sampler_cls=Sampler, output_processor_cls=OutputProcessor)


@pytest.fixture(scope="module")
def paris(tmp_path_factory):
    """A tiny model whose greedy token is always "▁paris" (id 0), with a Llama-2-style tokenizer."""
    folder = tmp_path_factory.mktemp("paris")
    hf = make_model(folder, "llama", vocab_size=len(PIECES))
    with torch.no_grad():
        hf.model.norm.weight.zero_()
    hf.save_pretrained(folder)
    sentencepiece_tokenizer("llama2").save_pretrained(folder)
    return folder


def paris_engine(folder, **kw):
    return LLMEngine(model=folder, dtype="float64", max_model_len=64, num_kvcache_blocks=32, block_size=4,
                     block_manager_cls=BlockManager, attention_backend=PagedAttention, **CH10, **kw)


def one(engine, prompt, params):
    return run_engine(engine, [prompt], params)[0]


# --- stopping ----------------------------------------------------------------------------------

def test_check_stop_strings_finds_the_earliest_in_the_new_text_only():
    assert check_stop_strings("abc END x", 5, ["END", "x"], False) == ("END", 4)
    assert check_stop_strings("abc END x", 5, ["END"], True) == ("END", 7)
    assert check_stop_strings("abc END x", 1, ["END"], False) is None  # END was in text already searched
    assert check_stop_strings("abcE", 1, ["ND"], False) is None


def test_stop_string_split_across_two_tokens_stops_and_is_cut(paris):
    engine = paris_engine(paris)
    out = one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=10, stop=["s p"]))
    c = out.outputs[0]
    assert c.token_ids == [0, 0] and c.text == " pari"  # " paris" + " paris": "s p" spans the two tokens
    assert (c.finish_reason, c.stop_reason) == ("stop", "s p")
    c = one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=10, stop=["s p"],
                                           include_stop_str_in_output=True)).outputs[0]
    assert c.text == " paris p" and c.stop_reason == "s p"
    check_invariants(engine)


def test_stop_token_ids_min_tokens_and_precedence_over_length(paris):
    engine = paris_engine(paris)
    c = one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[0])).outputs[0]
    assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == ([0], "", "stop", 0)
    c = one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[0],
                                           include_stop_str_in_output=True)).outputs[0]
    assert c.text == " paris"
    # min_tokens: token 0 is masked for three tokens, then it is drawn and stops
    c = one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[0], min_tokens=3)).outputs[0]
    assert c.token_ids[:3] == [1, 1, 1] and c.token_ids[3:] == [0] and c.stop_reason == 0
    # and stop strings are not looked for before min_tokens
    c = one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=10, stop=["paris"], min_tokens=2)).outputs[0]
    assert c.token_ids == [0, 0, 0] and c.text == " paris paris " and c.stop_reason == "paris"
    # a stop at the token that also reaches max_tokens: "stop"
    c = one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=2, stop=["s p"])).outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "s p"
    c = one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=1, stop_token_ids=[0])).outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == 0
    check_invariants(engine)


def test_eos_from_the_folder_stops_with_no_stop_reason(paris):
    engine = paris_engine(paris)
    engine.scheduler.eos_token_ids = engine.model_runner.sampler.eos_token_ids = frozenset({0})
    c = one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=5)).outputs[0]
    assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == ([0], "", "stop", None)
    c = one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=5, min_tokens=2)).outputs[0]
    assert c.token_ids == [1, 1, 0] and c.finish_reason == "stop"


def test_min_tokens_holds_eos_back_even_with_ignore_eos(paris):
    """vLLM adds the model's EOS to the ids `min_tokens` masks whatever `ignore_eos` says
    (`SamplingParams.update_from_generation_config`): with `ignore_eos` the EOS is held back for
    `min_tokens` tokens, then drawn like any token, and it does not stop the completion."""
    engine = paris_engine(paris)
    engine.scheduler.eos_token_ids = engine.model_runner.sampler.eos_token_ids = frozenset({0})
    c = one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=5, min_tokens=2, ignore_eos=True)).outputs[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason) == ([1, 1, 0, 0, 0], "length", None)
    check_invariants(engine)


# --- streaming -----------------------------------------------------------------------------------

def test_output_kinds_and_held_back_stop_prefix(paris):
    """Random (uniform) tokens with a stop string: concatenated DELTA texts equal the final text, each
    CUMULATIVE text extends the one before, nothing sent is ever cut, FINAL_ONLY sends once."""
    engine = paris_engine(paris)
    for seed in range(6):
        params = dict(temperature=1.0, seed=seed, max_tokens=30, stop=["is a", "ri"])
        ids = {k: engine.add_request(f"{k.name}{seed}", PROMPT, SamplingParams(output_kind=k, **params))
               for k in RequestOutputKind}
        seen = {k: [] for k in RequestOutputKind}
        while engine.has_unfinished_requests():
            for out in engine.step():
                kind = next(k for k, i in ids.items() if i == out.request_id)
                seen[kind].append(out)
        final = seen[RequestOutputKind.CUMULATIVE][-1].outputs[0]
        assert final.finished()
        texts = [o.outputs[0].text for o in seen[RequestOutputKind.CUMULATIVE]]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert "".join(o.outputs[0].text for o in seen[RequestOutputKind.DELTA]) == final.text
        assert sum((o.outputs[0].token_ids for o in seen[RequestOutputKind.DELTA]), []) == final.token_ids
        assert len(seen[RequestOutputKind.FINAL_ONLY]) == 1
        assert seen[RequestOutputKind.FINAL_ONLY][0].outputs[0].text == final.text
        assert not any(s in final.text for s in params["stop"])
    check_invariants(engine)


def test_step_returns_only_requests_that_advanced(paris):
    engine = paris_engine(paris, max_num_seqs=1)
    engine.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=2))
    engine.add_request("b", PROMPT, SamplingParams(temperature=0, max_tokens=2))
    steps = []
    while engine.has_unfinished_requests():
        steps.append([o.request_id for o in engine.step()])
    assert steps == [["a"], ["a"], ["b"], ["b"]]


def test_iter_outputs_streams_one_request_and_leaves_the_engine_clean(paris):
    engine = paris_engine(paris)
    outs = list(iter_outputs(engine, PROMPT, SamplingParams(temperature=0, max_tokens=3,
                                                               output_kind=RequestOutputKind.DELTA)))
    assert [o.outputs[0].text for o in outs] == [" paris"] * 3 and outs[-1].finished
    for out in iter_outputs(engine, PROMPT, SamplingParams(temperature=0, max_tokens=50)):
        break  # a consumer that stops early
    assert not engine.has_unfinished_requests() and not engine.output_processor.requests
    check_invariants(engine)
    engine.add_request("other", PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="unfinished"):
        next(iter_outputs(engine, PROMPT))


def test_cli_generate_stream(paris, capsys):
    from minivllm.entrypoints.cli import main

    assert main(["generate", "--model", str(paris), "--no-chat", "--stream", "--max-tokens", "3",
                 "--dtype", "float64", PROMPT]) == 0
    assert capsys.readouterr().out == " paris paris paris\n"


def test_spaces_between_special_tokens(paris):
    """False joins consecutive special tokens without the space a decoder may put between them
    (vLLM's rule); with a Metaspace decoder, decode() puts none, so both read the same here."""
    tok = sentencepiece_tokenizer("metaspace")
    ids = [2, 3, 3, 0]  # <s> </s> </s> ▁paris
    for spaces in (True, False):
        d = IncrementalDetokenizer(tok, tok.encode("the"), SamplingParams(skip_special_tokens=False,
                                                                          spaces_between_special_tokens=spaces))
        text = "".join(d.decode_next(t) for t in ids)
        assert text.replace(" ", "") == "<s></s></s>paris"
    d = IncrementalDetokenizer(tok, tok.encode("the"), SamplingParams(skip_special_tokens=False,
                                                                      spaces_between_special_tokens=False))
    assert [d.decode_next(t) for t in ids][1:3] == ["</s>", "</s>"]


# --- log-probabilities --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stream-tiny")
    return folder, make_model(folder, "llama")


def tiny_engine(folder, kv=BlockManager, **kw):
    return LLMEngine(**{**dict(model=folder, dtype="float64", max_model_len=128, block_size=4, block_manager_cls=kv,
                               attention_backend=PagedAttention, num_kvcache_blocks=64, **CH10), **kw})


@pytest.mark.parametrize("caching", [False, True])
def test_logprobs_equal_transformers_log_softmax(tiny, caching):
    """The chosen and top tokens' log-probabilities, and the prompt's, equal transformers' log-softmax
    (float64, 1e-12), also when the prompt came from the prefix cache (sent twice)."""
    folder, hf = tiny
    engine = tiny_engine(folder, PrefixCachingBlockManager if caching else BlockManager)
    prompt = list(range(3, 14))
    for _ in range(2):
        out = one(engine, prompt, SamplingParams(temperature=0.8, seed=1, top_k=20, max_tokens=6, ignore_eos=True,
                                                 logprobs=3, prompt_logprobs=2))
        c = out.outputs[0]
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt + c.token_ids])).logits[0].log_softmax(-1)
        L = len(prompt)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == L
        for i, (t, pos) in enumerate(zip(c.token_ids, c.logprobs)):
            assert len(pos) in (4, 3)  # the chosen token and the top 3 (the chosen one may be among them)
            for tok, lp in pos.items():
                assert abs(lp.logprob - float(ref[L - 1 + i, tok])) <= 1e-12
            assert pos[t].rank == int((ref[L - 1 + i] > ref[L - 1 + i, t]).sum()) + 1
        for i in range(1, L):
            pos = out.prompt_logprobs[i]
            assert abs(pos[prompt[i]].logprob - float(ref[i - 1, prompt[i]])) <= 1e-12
            assert sorted(lp.rank for t, lp in pos.items() if t != prompt[i] or lp.rank <= 2)[:2] == [1, 2]
        assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)),
                                                     abs=1e-12)
    assert out.num_cached_tokens == (8 if caching else 0)


class CreatedShapes(TorchDispatchMode):
    """Records the shape of every tensor an operation creates while active (no timing, no allocator)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def test_prompt_logprobs_hold_one_chunk_of_scores_and_logits_at_a_time(tmp_path):
    """A 400-token prompt's logprobs, 32 rows at a time (12 chunks and a shorter one): no attention
    scores beyond `[num_heads, 32, 400]` (q, k and v, `[400, heads, head_dim]`, are smaller) and no
    logits or log-softmax beyond 32 rows (a vocabulary of 250, unlike any other width of the model),
    where the whole prompt at once made `[4, 400, 400]` scores and `[400, 250]` logits. The values equal
    transformers' log-softmax (float64) and the unchunked pass's."""
    vocab, chunk, heads = 250, 32, 4
    hf = make_model(tmp_path, "llama", vocab_size=vocab, num_attention_heads=heads)
    runner = tiny_engine(tmp_path, max_model_len=512, num_kvcache_blocks=128).model_runner
    prompt = [(7 * i + 3) % vocab for i in range(400)]
    runner.prompt_chunk_tokens = chunk
    with CreatedShapes() as created:
        got = compute_prompt_logprobs(runner, prompt, 3)
    scores = max((s for s in created.shapes if len(s) == 3), key=math.prod)
    assert math.prod(scores) <= heads * chunk * len(prompt), scores
    assert max(s[0] for s in created.shapes if len(s) == 2 and s[1] == vocab) <= chunk
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert got[0] is None and len(got) == len(prompt)
    for i in range(1, len(prompt)):
        assert len(got[i]) in (3, 4) and prompt[i] in got[i]
        assert all(abs(lp.logprob - float(ref[i - 1, t])) <= 1e-9 for t, lp in got[i].items())
    runner.prompt_chunk_tokens = len(prompt)
    whole = compute_prompt_logprobs(runner, prompt, 3)
    assert all(a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) <= 1e-12 and a[t].rank == b[t].rank
                                            for t in a) for a, b in zip(got[1:], whole[1:]))


def test_without_detokenize_logprobs_have_no_decoded_token(paris):
    """vLLM's `RequestState` drops the tokenizer when `detokenize=False`: no text, and every `Logprob`'s
    `decoded_token`, of the completion and of the prompt, is None; with `detokenize` each is its token's text."""
    engine = paris_engine(paris)
    for detokenize in (True, False):
        out = one(engine, PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1,
                                                 detokenize=detokenize))
        c = out.outputs[0]
        positions = c.logprobs + out.prompt_logprobs[1:]
        decoded = [(t, lp.decoded_token) for pos in positions for t, lp in pos.items()]
        assert len(decoded) >= len(positions) > 3
        if detokenize:
            assert c.text == " paris paris paris" and all(d == engine.tokenizer.decode([t]) for t, d in decoded)
        else:
            assert c.text == "" and all(d is None for _, d in decoded)
    check_invariants(engine)


# --- n > 1 ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("prompt_len", [9, 12, 13])
def test_n_completions_share_the_prompts_blocks(tiny, caching, prompt_len):
    """After the prefill, the other completions hold references to the prompt's blocks wholly before its
    last token (ref count n) and a copy of the block holding it; all invariants hold at every step; each
    completion equals a single request seeded with seed + index (vLLM's rule)."""
    folder, _ = tiny
    kv = PrefixCachingBlockManager if caching else BlockManager
    engine = tiny_engine(folder, kv)
    prompt = list(range(5, 5 + prompt_len))
    params = SamplingParams(n=4, temperature=1.0, seed=10, max_tokens=7, ignore_eos=True, top_p=0.9)
    engine.add_request("n", prompt, params)
    engine.step()
    check_invariants(engine)
    tables = [s.block_table for s in engine.scheduler.running]
    shared = (prompt_len - 1) // 4
    assert len(tables) == 4 and all(t[:shared] == tables[0][:shared] for t in tables)
    assert all(engine.block_manager.blocks[b].ref_count == 4 for b in tables[0][:shared])
    copies = [t[shared] for t in tables if len(t) > shared]
    assert len(set(copies)) == len(copies)  # the block holding the last prompt token: one per completion
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        check_invariants(engine)
    final = outs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert sum(o.finished for o in outs) == 1
    single = tiny_engine(folder, kv)
    for c in final.outputs:
        alone = one(single, prompt, SamplingParams(temperature=1.0, seed=10 + c.index, max_tokens=7, ignore_eos=True,
                                                   top_p=0.9)).outputs[0]
        assert c.token_ids == alone.token_ids and len(c.token_ids) == 7


def test_n_completions_when_the_first_finishes_at_once_or_seats_are_few(tiny):
    folder, _ = tiny
    for kw, params in [(dict(), SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=1, ignore_eos=True)),
                       (dict(max_num_seqs=2), SamplingParams(n=5, temperature=1.0, seed=2, max_tokens=4, ignore_eos=True)),
                       (dict(num_kvcache_blocks=8, max_model_len=32), SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12,
                                                                   ignore_eos=True))]:
        engine = tiny_engine(folder, **kw)
        out = run_engine(engine, [list(range(1, 11))], params)[0]
        assert [c.index for c in out.outputs] == list(range(params.n))
        assert all(len(c.token_ids) == params.max_tokens for c in out.outputs)
        check_invariants(engine)


def test_n_with_the_contiguous_reservation_and_through_llm(tiny):
    from minivllm.llm import LLM

    folder, _ = tiny
    engine = LLMEngine(model=folder, dtype="float64", max_model_len=64, num_kvcache_blocks=16, **CH10)
    out = run_engine(engine, [[1, 2, 3]], SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs) == 3
    llm = LLM(folder, dtype="float64", max_model_len=64, num_kvcache_blocks=16)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=3,
                                                             ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 2] and outs[0].outputs[0].token_ids == out[0].outputs[0].token_ids


def test_abort_a_request_with_n_completions(tiny):
    folder, _ = tiny
    engine = tiny_engine(folder)
    engine.add_request("n", [1, 2, 3, 4, 5], SamplingParams(n=3, temperature=1.0, max_tokens=20, ignore_eos=True))
    engine.step()
    assert len(engine.scheduler.running) == 3
    engine.abort_request("n")
    assert not engine.has_unfinished_requests() and not engine.output_processor.requests
    check_invariants(engine)


# --- incremental detokenization on the default model's tokenizer ------------------------------------

@pytest.fixture(scope="module")
def smol():
    from minivllm.transformers_utils.model_files import load_tokenizer

    tok = load_tokenizer(None)
    pieces = tok.encode("🌟👌 中文 日本語 ü € ∑ naïve") + tok.all_special_ids
    mixed = [i for i in range(len(tok)) if tok.decode([i]).endswith("\ufffd") and tok.decode([i]).rstrip("\ufffd")]
    return tok, pieces + mixed  # byte pieces of multi-byte characters, and tokens like " <first byte>"


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_incremental_text_is_completion_text_less_an_incomplete_character(smol, data, skip):
    """After every token the text so far is a prefix of `completion_text` (decode prompt and completion
    together, minus the prompt) that never ends in U+FFFD, and at the end it equals it, less trailing
    U+FFFD. Prompts may end inside a character; completions are full of byte pieces."""
    tok, pieces = smol
    token = st.one_of(st.sampled_from(pieces), st.integers(0, len(tok) - 1))
    prompt = tok.encode(data.draw(st.sampled_from(["Note:", "The capital of France is", "中文"]))) + \
        data.draw(st.lists(token, max_size=4))
    ids = data.draw(st.lists(token, min_size=1, max_size=14))
    d = IncrementalDetokenizer(tok, prompt, SamplingParams(skip_special_tokens=skip))
    for i, t in enumerate(ids):
        update_text(d, [t], stop_terminated=False)
        target = completion_text(tok, prompt, ids[:i + 1], skip_special_tokens=skip)
        assert target.startswith(d.output_text) and not d.output_text.endswith("\ufffd"), (prompt, ids[:i + 1])
    finish_text(d, stop_terminated=False)
    assert d.output_text == completion_text(tok, prompt, ids, skip_special_tokens=skip).rstrip("\ufffd"), (prompt, ids)


@pytest.mark.slow
def test_multibyte_cases_by_name(smol):
    tok, _ = smol
    star = tok.encode("🌟")
    assert len(star) == 3
    d = IncrementalDetokenizer(tok, tok.encode("Stars:"), SamplingParams())
    assert [d.decode_next(t) for t in star] == ["", "", "🌟"]
    # a prompt that ends inside a character: its completion completes it
    d = IncrementalDetokenizer(tok, tok.encode("Stars:") + star[:2], SamplingParams())
    assert d.decode_next(star[2]) == "🌟"
    # max_tokens cuts a character: nothing incomplete is ever sent, and nothing is left at the end
    d = IncrementalDetokenizer(tok, tok.encode("Stars:"), SamplingParams())
    update_text(d, star[:2], stop_terminated=False)
    finish_text(d, stop_terminated=False)
    assert d.output_text == ""


@pytest.mark.slow
def test_default_model_streams_what_it_returns_at_the_end():
    from minivllm.llm import LLM

    llm = LLM(None, dtype="float32", max_model_len=512)
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Reply with three party emojis."}],
                                     add_generation_prompt=True, tokenize=False)
    for max_tokens in (2, 7, 20):
        deltas = [o.outputs[0].text for o in iter_outputs(llm.llm_engine, prompt, SamplingParams(
            temperature=0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA))]
        final = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
        assert "".join(deltas) == final.outputs[0].text and "\ufffd" not in final.outputs[0].text
