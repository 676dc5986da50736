"""The completion's text follows vLLM's rule: `decode(prompt) + text == decode(prompt + completion)`.

Decoding the completion on its own loses the leading space with SentencePiece-style tokenizers
(Llama-2, Mistral, TinyLlama: `▁` pieces and a decoder that strips the first space). The tokenizers
here are built with the `tokenizers` library, so no model hub is needed.
"""
from __future__ import annotations

import random

import pytest
import torch

from engine_helpers import check_invariants, make_model, one_thread
from minivllm.engine.processor import completion_text
from minivllm.sampling_params import SamplingParams

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)

# "▁paris" is id 0: a model whose logits are all equal picks it greedily (argmax takes the first)
PIECES = ["▁paris", "<unk>", "<s>", "</s>", "▁the", "▁capital", "▁of", "▁france", "▁is", "▁", "▁a",
          "p", "a", "r", "i", "s", "t", "h", "e", "c", "o", "f", "n", "l", "."]
PROMPT = "the capital of france is"


def sentencepiece_tokenizer(kind: str = "llama2"):
    """A Llama-2-style tokenizer: Unigram `▁` pieces, BOS added, decoder Replace ▁ -> space,
    ByteFallback, Fuse, Strip one leading space ("llama2"); or Mistral's newer Metaspace form ("metaspace")."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = [(p, 0.0 if p.startswith("<") else -1.0 - 0.01 * i) for i, p in enumerate(PIECES)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=1, byte_fallback=False))
    if kind == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("kind", ["llama2", "metaspace"])
def test_the_leading_space_is_kept(kind):
    tok = sentencepiece_tokenizer(kind)
    ids = tok.encode(PROMPT)
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "▁the", "▁capital", "▁of", "▁france", "▁is"]
    assert tok.decode([0]) == "paris"  # the fault: decoded alone, the space is gone
    assert completion_text(tok, ids, [0]) == " paris"
    assert PROMPT + completion_text(tok, ids, [0, 0]) == tok.decode(ids + [0, 0], skip_special_tokens=True)


def _check_rule(tok, prompts, completions):
    for p, c in zip(prompts, completions):
        prefix = tok.decode(p, skip_special_tokens=True)
        assert prefix + completion_text(tok, p, c) == tok.decode(p + c, skip_special_tokens=True), (p, c)


@pytest.mark.parametrize("kind", ["llama2", "metaspace"])
def test_rule_on_random_token_sequences(kind):
    tok = sentencepiece_tokenizer(kind)
    rng = random.Random(0)
    prompts = [tok.encode(" ".join(rng.choice(["the", "a", "paris", "is", "of"]) for _ in range(rng.randint(1, 6))))
               for _ in range(50)]
    completions = [[rng.randrange(len(PIECES)) for _ in range(rng.randint(1, 8))] for _ in prompts]
    _check_rule(tok, prompts, completions)


@pytest.mark.slow
def test_rule_on_the_default_models_bpe_tokenizer_and_chat_prompts():
    """Byte-level BPE (SmolLM2): chat prompts full of special tokens, completions with special tokens too."""
    from minivllm.transformers_utils.model_files import load_tokenizer

    tok = load_tokenizer(None)
    rng = random.Random(1)
    chats = [[{"role": "user", "content": q}] for q in ["What is the capital of France?", "Say hi.", "2 + 2?"]]
    prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False) for c in chats]
    prompts += [tok.encode("The capital of France is"), tok.encode("Paris,")]
    specials = tok.all_special_ids
    completions = [[rng.choice(specials) if rng.random() < 0.2 else rng.randrange(1000, 20000)
                    for _ in range(rng.randint(1, 12))] for _ in prompts]
    completions.append(tok.encode(" Paris.") + [tok.eos_token_id])
    _check_rule(tok, prompts + prompts[:1], completions)


def test_engine_text_reads_on_from_the_prompt(tmp_path):
    """Through the engine: a tiny model whose greedy token is always "▁paris" (its final norm is
    zero, so all logits are equal) and the Llama-2-style tokenizer in the folder."""
    from minivllm.engine.llm_engine import LLMEngine

    hf = make_model(tmp_path, "llama", vocab_size=len(PIECES))
    with torch.no_grad():
        hf.model.norm.weight.zero_()
    hf.save_pretrained(tmp_path)
    tok = sentencepiece_tokenizer("llama2")
    tok.save_pretrained(tmp_path)
    engine = LLMEngine(model=tmp_path, dtype="float64", max_model_len=64, num_kvcache_blocks=64)
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    check_invariants(engine)
    out = outs[0]
    assert out.outputs[0].token_ids == [0, 0]
    assert out.outputs[0].text == " paris paris"
    assert out.prompt + out.outputs[0].text == engine.get_tokenizer().decode(
        out.prompt_token_ids + out.outputs[0].token_ids, skip_special_tokens=True)
