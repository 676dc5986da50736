"""SamplingParams: vLLM's whole field list, defaults and checks; arguments minivllm lacks are a
ValueError that says so (never a bare TypeError)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from minivllm.sampling_params import RequestOutputKind, SamplingParams

VLLM_DEFAULTS = dict(n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, temperature=1.0,
                     top_p=1.0, top_k=0, min_p=0.0, seed=None, stop=[], stop_token_ids=[], ignore_eos=False,
                     max_tokens=16, min_tokens=0, logprobs=None, prompt_logprobs=None, detokenize=True,
                     skip_special_tokens=True, spaces_between_special_tokens=True, include_stop_str_in_output=False,
                     output_kind=RequestOutputKind.CUMULATIVE, structured_outputs=None)


def test_vllm_fields_and_defaults():
    p = SamplingParams()
    assert {f.name: getattr(p, f.name) for f in dataclasses.fields(p)} == VLLM_DEFAULTS
    assert p.changed_fields() == {}
    assert [k.value for k in RequestOutputKind] == [0, 1, 2]


def test_vllm_quickstart_line_and_normalization():
    p = SamplingParams(temperature=0.8, top_p=0.95)
    assert p.changed_fields() == {"temperature": 0.8, "top_p": 0.95}
    q = SamplingParams(stop="###", stop_token_ids=(np.int64(5), 7), top_k=-1, n=np.int64(2), max_tokens=None)
    assert q.stop == ["###"] and q.stop_token_ids == [5, 7] and type(q.stop_token_ids[0]) is int
    assert q.top_k == 0 and type(q.n) is int and q.max_tokens is None
    # a greedy request's filters are switched off: they cannot change an argmax (vLLM does the same)
    g = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert (g.top_p, g.top_k, g.min_p) == (1.0, 0, 0.0) and g.greedy


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"), (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
    (dict(top_p=float("nan")), "top_p"), (dict(top_k=-2), "top_k"), (dict(top_k=2.0), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(seed=0.5), "seed"),
    (dict(stop=[""]), "stop"), (dict(stop=5), "stop"), (dict(stop=["a", 3]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids=3), "stop_token_ids"),
    (dict(ignore_eos=1), "ignore_eos"), (dict(detokenize="yes"), "detokenize"),
    (dict(skip_special_tokens=None), "skip_special_tokens"), (dict(include_stop_str_in_output=0), "include_stop_str"),
    (dict(spaces_between_special_tokens=1), "spaces_between"), (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(logprobs=-2), "logprobs"), (dict(prompt_logprobs=1.5), "prompt_logprobs"),
    (dict(output_kind="delta"), "output_kind"), (dict(stop=["x"], detokenize=False), "detokenize"),
])
def test_out_of_range_is_a_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("name, value", [("logit_bias", {1: 2.0}), ("best_of", 3), ("bad_words", ["x"]),
                                         ("allowed_token_ids", [1, 2]), ("truncate_prompt_tokens", 5)])
def test_vllm_arguments_minivllm_lacks(name, value):
    assert SamplingParams(**{name: None}) == SamplingParams()  # vLLM's "off" value is accepted
    with pytest.raises(ValueError, match=f"does not have vLLM's {name}"):
        SamplingParams(**{name: value})


def test_unknown_and_positional_arguments_are_value_errors():
    with pytest.raises(ValueError, match="did you mean 'temperature'"):
        SamplingParams(temprature=0.5)
    with pytest.raises(ValueError, match="keyword arguments"):
        SamplingParams(0.8)


def test_replace_checks_again():
    p = SamplingParams(top_p=0.5)
    p.top_p = 0.0  # set after construction
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(p)


# --- engines refuse what none of their parts acts on; LLM takes vLLM's arguments at their one value ----

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from engine_helpers import make_model

    path = tmp_path_factory.mktemp("sampling-params-engine")
    make_model(path, "llama")
    return path


@pytest.mark.parametrize("kwargs", [dict(top_p=0.9), dict(top_k=5), dict(min_p=0.1), dict(presence_penalty=0.5),
                                    dict(repetition_penalty=1.2), dict(n=2), dict(stop_token_ids=[3]),
                                    dict(min_tokens=2), dict(logprobs=1), dict(prompt_logprobs=0),
                                    dict(spaces_between_special_tokens=False)])
def test_chapter_04_engine_refuses_fields_no_part_acts_on(folder, kwargs):
    from minivllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(model=folder, dtype="float64", max_model_len=64, num_kvcache_blocks=8)
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"does not implement {name}="):
        engine.add_request(None, [1, 2, 3], SamplingParams(temperature=1.0, **kwargs))
    assert not engine.has_unfinished_requests()


def test_chapter_04_output_kinds(folder):
    from minivllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(model=folder, dtype="float64", max_model_len=64, num_kvcache_blocks=8)
    kinds = {k: engine.add_request(k.name, [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                                     output_kind=k)) for k in RequestOutputKind}
    seen = {k: [] for k in RequestOutputKind}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[RequestOutputKind[out.request_id]].append(out.outputs[0].token_ids)
    full = seen[RequestOutputKind.CUMULATIVE][-1]
    assert len(full) == 3 and seen[RequestOutputKind.CUMULATIVE] == [full[:1], full[:2], full]
    assert seen[RequestOutputKind.DELTA] == [[t] for t in full]
    assert seen[RequestOutputKind.FINAL_ONLY] == [full]


def test_llm_takes_vllm_arguments_at_their_one_value(folder, tmp_path):
    from minivllm.llm import LLM

    llm = LLM(str(folder), dtype="float64", max_model_len=64, num_kvcache_blocks=8, tensor_parallel_size=1, trust_remote_code=False,
              tokenizer=str(folder), enforce_eager=True, disable_log_stats=True, quantization=None)
    assert llm.llm_engine.args.enforce_eager is True
    for kwargs, message in [(dict(pipeline_parallel_size=2), "does not have vLLM's pipeline_parallel_size=2"),
                            (dict(trust_remote_code=True), "trust_remote_code"),
                            (dict(enable_chunked_prefill="yes"), "enable_chunked_prefill"),  # chapter 11's: a bool
                            (dict(swap_space=4), "swap_space"),
                            (dict(tokenizer=str(tmp_path)), "tokenizer"),
                            (dict(max_num_seq=4), "did you mean 'max_num_seqs'"),
                            (dict(gpu_memory_utilisation=0.5), "gpu_memory_utilization")]:
        with pytest.raises(ValueError, match=message):
            LLM(str(folder), dtype="float64", max_model_len=64, num_kvcache_blocks=8, **kwargs)


def test_llm_engine_unknown_argument_is_a_value_error(folder):
    from minivllm.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="LLMEngine has no argument 'blocksize'"):
        LLMEngine(model=folder, blocksize=4)


def test_naive_loop_refuses_what_it_does_not_implement_and_takes_max_tokens_none(folder):
    from minivllm.model_executor.model_loader import load_model
    from minivllm.baselines.naive import naive_generate

    model = load_model(folder, dtype=__import__("torch").float64)
    with pytest.raises(ValueError, match="naive loop does not implement top_p=0.5"):
        naive_generate(model, [1, 2], SamplingParams(top_p=0.5))
    out = naive_generate(model, [1, 2], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(out) == model.config.max_position_embeddings - 2


def test_static_batching_refuses_what_it_does_not_implement(folder):
    from minivllm.model_executor.model_loader import load_model
    from minivllm.baselines.static_batching import static_generate

    model = load_model(folder, dtype=__import__("torch").float64)
    for params, message in [(SamplingParams(top_k=3), "static batching does not implement top_k=3"),
                            (SamplingParams(max_tokens=None), "max_tokens=None")]:
        with pytest.raises(ValueError, match=message):
            static_generate(model, [[1, 2]], params)
