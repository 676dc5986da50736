"""The engine in bfloat16 on a CPU, against transformers in bfloat16 on the default model.

`LLM(dtype="bfloat16")` on a CPU runs the linear layers in bfloat16 (oneDNN's packed bfloat16 layers
where the CPU has bfloat16 instructions, torch's matmul elsewhere), keeps the KV cache in bfloat16, and
decodes through the C++ kernel, which computes attention in float32. Two bfloat16 implementations
round in different places, so greedy tokens may part where the two best logits are nearly tied; the
test checks that every first difference is such a tie, not a share of equal requests.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from minivllm import LLM, SamplingParams
from minivllm.attention.backends.cpu_attn import CPUPagedAttention
from minivllm.model_executor.layers.linear import PackedLinear, onednn_packing_supported
from minivllm.transformers_utils.model_files import load_tokenizer

pytestmark = pytest.mark.slow

QUESTIONS = ("What is the capital of France?", "List three prime numbers.", "Write a haiku about the sea.",
             "Who wrote Hamlet?")
NEW_TOKENS = 16  # bfloat16 matmuls are slow on CPUs without bfloat16 instructions: a short run
# bfloat16 keeps 8 significant bits, so near a logit x its neighbours are up to 2**-7 * |x| apart (the
# spacing). On the default model our decoder's and transformers' bfloat16 top-1 minus top-2 gaps
# differ by 0.6 spacings (median) and 2.8 at most (measured over 71 positions of two chat prompts),
# so two logits less than 4 spacings apart may swap places between the two; further apart, a swap is
# a bug.
NEAR_TIE_SPACINGS = 4
BF16_SPACING = 2.0 ** -7


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    tok = load_tokenizer(default_model_dir)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False)) for q in QUESTIONS]


def hf_bf16_greedy(model_dir, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers in bfloat16, one left-padded greedy `generate`: each prompt's `n` new tokens and each
    step's logits (`[len(prompts), vocab_size]`, float32 copies of the bfloat16 logits)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, width:].tolist(), [step.float() for step in out.logits]


def first_differences(engine: list[list[int]], hf: list[list[int]], hf_logits: list[torch.Tensor]) -> list[dict]:
    """Where each request's tokens first differ: its step, both tokens, transformers' logit gap between
    its own token and the engine's at that step (the prefixes are still equal there) and the spacing."""
    found = []
    for i, (ours, theirs) in enumerate(zip(engine, hf)):
        step = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if step is None:
            continue
        logits = hf_logits[step][i]
        found.append(dict(request=i, step=step, engine=ours[step], hf=theirs[step],
                          gap=(logits[theirs[step]] - logits[ours[step]]).item(),
                          spacing=BF16_SPACING * logits.max().abs().item()))
    return found


def test_engine_bf16_on_cpu_matches_transformers_bf16_up_to_near_ties(default_model_dir, prompts):
    llm = LLM(default_model_dir, dtype="bfloat16", device="cpu")
    runner = llm.llm_engine.model_runner
    assert runner.kv_cache.dtype == torch.bfloat16
    if CPUPagedAttention.is_available("cpu", torch.bfloat16):  # the C++ kernel decodes (float32 inside)
        assert isinstance(runner.attn, CPUPagedAttention)
    linears = [m for m in runner.model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    packed = onednn_packing_supported(torch.bfloat16)  # oneDNN's bfloat16 kernels where the CPU has them
    assert linears and all(isinstance(m, PackedLinear) == packed for m in linears)
    assert all((m.dtype if isinstance(m, PackedLinear) else m.weight.dtype) == torch.bfloat16 for m in linears)

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    engine = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    hf, hf_logits = hf_bf16_greedy(default_model_dir, prompts, NEW_TOKENS)
    assert all(len(t) == NEW_TOKENS for t in engine + hf)
    differences = first_differences(engine, hf, hf_logits)
    not_ties = [d for d in differences if not d["gap"] <= NEAR_TIE_SPACINGS * d["spacing"]]
    assert not not_ties, f"tokens differ where transformers' logits are not nearly tied: {not_ties}"


def test_the_near_tie_check_can_fail():
    """A difference at a step where transformers' own token leads by many spacings is reported."""
    logits = torch.zeros(1, 10)
    logits[0, 3], logits[0, 5] = 20.0, 20.0 - 8 * BF16_SPACING * 20.0
    far = first_differences([[5]], [[3]], [logits])
    assert far[0]["gap"] > NEAR_TIE_SPACINGS * far[0]["spacing"]
    logits[0, 5] = 20.0 - BF16_SPACING * 20.0
    near = first_differences([[5, 1]], [[3, 2]], [logits, logits])
    assert near[0]["step"] == 0 and near[0]["gap"] <= NEAR_TIE_SPACINGS * near[0]["spacing"]
    assert first_differences([[1, 2]], [[1, 2]], [logits, logits]) == []
