"""Bad input fails at submission with a clear ValueError; other requests go on; nothing hangs."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine_helpers import check_invariants, make_model, one_thread, run_engine
from minivllm.engine.llm_engine import LLMEngine
from minivllm.llm import LLM
from minivllm.sampling_params import SamplingParams

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine-bad-input")
    make_model(path, "llama")
    return path


@pytest.fixture(scope="module")
def llm(folder):
    # 16 blocks of 16 = 256 tokens of KV cache, max_model_len 256 (a longer one is refused at start-up)
    return LLM(folder, dtype="float64", max_model_len=256, num_kvcache_blocks=16)


@pytest.mark.parametrize("prompt, message", [
    ([], "empty"),
    ({"prompt_token_ids": []}, "empty"),
    (list(range(100)) * 3, "max_model_len"),  # 300 tokens >= 256
    ([1] * 256, "max_model_len"),  # exactly max_model_len tokens
    ([1, 2, 128], r"\[0, 128\)"),
    ([1, -2], r"\[0, 128\)"),
    ([1, 2.5], r"\[0, 128\)"),
    ([1, torch.tensor(2.7)], r"\[0, 128\)"),  # a float tensor must not be truncated to token 2
    (torch.tensor([1.0, 2.0]), r"\[0, 128\)"),
    ([1, True], r"\[0, 128\)"),
    ([1, torch.tensor(True)], r"\[0, 128\)"),
    ([1, torch.tensor([2])], r"\[0, 128\)"),  # a one-element 1-D tensor is a list, not a token id
    (torch.tensor([[1], [2]]), r"\[0, 128\)"),
    ({"prompt_token_ids": [1], "prompt": 5}, "'prompt' must be text"),
    ("hello", "no tokenizer"),
    ({"prompt": "hello"}, "no tokenizer"),  # vLLM's TextPrompt is text
    ({"text": [1]}, r"needs 'prompt' \(text, vLLM's TextPrompt\) or 'prompt_token_ids'"),
    ({"prompt": None}, r"needs 'prompt' \(text, vLLM's TextPrompt\) or 'prompt_token_ids'"),
    ({"prompt": 5}, "'prompt' must be text"),
    (42, "prompt must be"),
])
def test_bad_prompt_is_refused_and_others_complete(llm, prompt, message):
    engine = llm.llm_engine
    good = engine.add_request(None, [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match=message):
        engine.add_request(None, prompt, GREEDY)
    outs = run_engine(engine, [[4, 5]], GREEDY)
    assert outs[0].finished and len(outs[0].outputs[0].token_ids) == 4
    assert good not in engine.requests  # finished too
    check_invariants(engine)


def test_bad_sampling_params(llm):
    for kwargs, message in [(dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.5), "temperature"),
                            (dict(temperature=float("nan")), "temperature")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.llm_engine.add_request(None, [1, 2], {"temperature": 0})
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate([[1], [2], [3]], [GREEDY, GREEDY], use_tqdm=False)


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm):
    """A stop token id no step can sample is refused at submission, as a prompt id out of range is."""
    engine = llm.llm_engine
    for ids in ([128], [1, 10**6]):
        with pytest.raises(ValueError, match=r"stop_token_ids must be integers in \[0, 128\); got \[" + str(ids[-1])):
            engine.add_request(None, [1, 2], SamplingParams(max_tokens=2, stop_token_ids=ids))
    with pytest.raises(ValueError, match="prompt 0: stop_token_ids"):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[128]), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    out = llm.generate([[1, 2]], SamplingParams(max_tokens=3, stop_token_ids=[0, 127], ignore_eos=True), use_tqdm=False)
    assert out[0].finished


def test_generate_with_one_bad_prompt_queues_nothing(llm):
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([[1, 2], [], [3]], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    outs = llm.generate([[1, 2], [3]], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


def test_longest_allowed_prompts(llm):
    """A prompt of max_model_len - 1 tokens gets one token, "length" (the cache holds max_model_len tokens:
    the two run one after the other)."""
    engine = llm.llm_engine
    outs = run_engine(engine, [[1] * 255, [2] * 255], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for o in outs:
        assert len(o.outputs[0].token_ids) == 1 and o.outputs[0].finish_reason == "length"
    big = LLM(llm.llm_engine.args.model, dtype="float64", max_model_len=64, num_kvcache_blocks=64)
    out = big.generate([[3] * 63], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_abort_and_duplicate_ids(llm):
    engine = llm.llm_engine
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.add_request("b", [4, 5, 6], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [1], GREEDY)
    engine.step()
    engine.step()
    engine.abort_request("a")
    engine.abort_request("no-such-request")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
        check_invariants(engine)
    assert finished == ["b"]
    check_invariants(engine)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=0), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(num_kvcache_blocks=0), "num_kvcache_blocks"),
    (dict(max_model_len=10_000), "max_position_embeddings"),
    (dict(max_model_len=256, max_num_batched_tokens=100), "max_num_batched_tokens"),
    (dict(kv_cache_memory_bytes=10), "KV cache"),
    (dict(block_manager_cls="paged"), "block_manager_cls must be a class"),
    (dict(attention_backend="torch"), "attention_backend must be a class"),
    (dict(block_size=True), "block_size"),
    (dict(enable_prefix_caching=1), "enable_prefix_caching"),
    (dict(dtype="float17"), "dtype"),
    (dict(seed=2 ** 64), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(max_model_len=1), "max_model_len"),  # no room for a prompt token and a generated one
    (dict(device="meta"), "meta"),
])
def test_bad_engine_args(folder, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(model=folder, **kwargs)


def test_missing_model_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(tmp_path / "nothing-here")


def test_an_interrupted_step_leaves_no_unwritten_block_in_the_prefix_cache(tmp_path_factory):
    """If the forward pass dies (Ctrl-C, out of memory), the blocks it was to fill must not be
    found by a later request with the same prefix: their K/V was never written."""
    import torch

    from conftest import make_tiny_model
    from minivllm import SamplingParams

    folder, hf = make_tiny_model(tmp_path_factory, "llama")
    llm = LLM(str(folder), dtype="float64", num_kvcache_blocks=16, block_size=16)
    model = llm.llm_engine.model_runner.model
    real_forward, calls = model.forward, [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        return real_forward(*args, **kwargs)

    model.forward = flaky
    prompt = list(range(40))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt], params, use_tqdm=False)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 40, dtype=torch.long), max_new_tokens=5,
                           do_sample=False, eos_token_id=None, pad_token_id=0)[0, 40:].tolist()
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == want


def test_auto_request_ids_skip_user_ids_and_int_ids_abort(tmp_path_factory):
    from conftest import make_tiny_model
    from minivllm import SamplingParams

    folder, _ = make_tiny_model(tmp_path_factory, "llama")
    engine = LLMEngine(model=str(folder), dtype="float64", num_kvcache_blocks=16, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=3)
    assert engine.add_request("0", [5, 6], params) == "0"
    assert engine.add_request(None, [1, 2], params) != "0"
    assert engine.add_request(7, [1, 2], params) == "7"
    engine.abort_request(7)
    engine.abort_request("0")
    assert sorted(engine.requests) == ["1"]
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.requests


def test_integer_token_ids_of_any_kind_are_accepted(llm):
    """numpy integers and integer tensors are token ids; they give the same tokens as Python ints."""
    want = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for prompt in ([np.int64(1), np.int32(2), 3], {"prompt_token_ids": np.array([1, 2, 3])},
                   {"prompt_token_ids": torch.tensor([1, 2, 3])}, [torch.tensor(1), 2, torch.tensor(3)]):
        out = llm.generate(prompt, GREEDY, use_tqdm=False)
        assert len(out) == 1 and out[0].outputs[0].token_ids == want
        assert out[0].prompt_token_ids == [1, 2, 3] and all(type(t) is int for t in out[0].prompt_token_ids)


def test_vllm_text_prompt_dicts_are_text(llm, monkeypatch):
    """vLLM's `TextPrompt` `{"prompt": text}` is encoded as the text alone is; a `TokensPrompt` runs its ids,
    a "prompt" beside them being only the text its output shows (as `LLM.chat` passes its prompts)."""
    class Words:  # a tokenizer for the tokenizer-less test model: a word's token id is its length
        def encode(self, text: str) -> list[int]:
            return [len(w) for w in text.split()]

    monkeypatch.setattr(llm.llm_engine.processor, "tokenizer", Words())
    prompts = ["ab c", {"prompt": "ab c"}, {"prompt": "abc d"}, {"prompt_token_ids": [2, 1], "prompt": "x"}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[2, 1], [2, 1], [3, 1], [2, 1]]
    assert [o.prompt for o in outs] == ["ab c", "ab c", "abc d", "x"]
    assert outs[1].outputs[0].token_ids == outs[0].outputs[0].token_ids == outs[3].outputs[0].token_ids
    single = llm.generate({"prompt": "ab c"}, GREEDY, use_tqdm=False)  # one TextPrompt is one prompt
    assert len(single) == 1 and single[0].prompt_token_ids == [2, 1]
    check_invariants(llm.llm_engine)


def test_generate_refuses_bad_containers_and_foreign_requests(llm):
    with pytest.raises(ValueError, match="list of prompts"):
        llm.generate(None, use_tqdm=False)
    outs = llm.generate([torch.tensor([1]), torch.tensor([2])], GREEDY, use_tqdm=False)  # two prompts, not one
    assert [o.prompt_token_ids for o in outs] == [[1], [2]]
    outs = llm.generate((p for p in [[1, 2], [3]]), GREEDY, use_tqdm=False)  # any iterable of prompts
    assert [o.prompt_token_ids for o in outs] == [[1, 2], [3]]
    engine = llm.llm_engine
    rid = engine.add_request("mine", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="add_request"):
        llm.generate([[3, 4]], GREEDY, use_tqdm=False)
    assert engine.get_num_unfinished_requests() == 1  # nothing queued, the direct request untouched
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == [rid] and len(outs[0].outputs[0].token_ids) == 4
    check_invariants(engine)


@pytest.mark.parametrize("kwargs, asked", [
    (dict(kv_cache_memory_bytes=200 * 2**30), "kv_cache_memory_bytes=214748364800"),
    (dict(num_kvcache_blocks=10**9), "num_kvcache_blocks=1000000000"),
])
@pytest.mark.parametrize("front", ["LLM", "LLMEngine"])
def test_a_kv_cache_larger_than_memory_is_refused_before_allocating(folder, monkeypatch, kwargs, asked, front):
    """200 GiB on a machine with 24 GiB, or 10**9 blocks: a ValueError naming the size asked for and
    what is available, raised before the cache (or the block pool's bookkeeping) is allocated."""
    import minivllm.engine.core as engine_module  # where kv_cache_num_tokens looks the memory up

    monkeypatch.setattr(engine_module, "available_memory_bytes", lambda device: 24 * 2**30)
    with pytest.raises(ValueError, match=r"asks for .* GiB \(" + asked + r"\) but only 24.00 GiB is available"):
        (LLM(folder, dtype="float64", **kwargs) if front == "LLM" else LLMEngine(model=folder, dtype="float64", **kwargs))


def test_available_memory_is_read_from_the_system():
    from minivllm.engine.core import available_memory_bytes

    cpu = available_memory_bytes(torch.device("cpu"))
    assert 0 < cpu <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_a_cache_that_fits_is_allocated(folder, monkeypatch):
    import minivllm.engine.core as engine_module  # where kv_cache_num_tokens looks the memory up

    monkeypatch.setattr(engine_module, "available_memory_bytes", lambda device: 10 * 2**20)
    engine = LLMEngine(model=folder, dtype="float64", kv_cache_memory_bytes=2**20, max_model_len=256)
    per_token = engine.model_runner.kv_cache.element_size() * engine.model_runner.kv_cache[:, :, 0, 0].numel()
    assert engine.block_manager.num_blocks == 2**20 // per_token // 256


def test_numpy_engine_args_are_python_numbers(folder):
    """Engine settings given as NumPy scalars are checked and used as Python numbers: a NumPy seed
    seeds the engine, and a NumPy block count cannot overflow int64 into a small cache."""
    args = dict(dtype="float64", max_model_len=np.int64(64), num_kvcache_blocks=np.int64(16), block_size=np.int32(4),
                max_num_seqs=np.int64(2), seed=np.int64(3), gpu_memory_utilization=np.float32(0.5))
    engine = LLM(folder, **args).llm_engine
    assert engine.block_manager.num_blocks == 16 and type(engine.args.seed) is int
    assert all(type(getattr(engine.args, k)) is (float if k == "gpu_memory_utilization" else int)
               for k in args if k != "dtype")
    with pytest.raises(ValueError, match="KV cache asks for"):  # 16 * 2**60 * bytes per token: no wrap-around
        LLM(folder, dtype="float64", num_kvcache_blocks=np.int64(2**60), block_size=16)


@pytest.mark.parametrize("device, message", [("foo", "unknown device 'foo'"), (3.5, "unknown device")]
                         + ([] if torch.cuda.is_available() else [("cuda", "CUDA devices")]))
def test_bad_device_is_a_value_error(folder, device, message):
    for front in (lambda: LLM(folder, device=device), lambda: LLMEngine(model=folder, device=device)):
        with pytest.raises(ValueError, match=message):
            front()


def test_sampling_params_changed_after_construction_are_checked_again(llm):
    """A `SamplingParams` field set after construction is checked at submission (NaN would sample
    garbage), and the request keeps its own copy: changing the caller's object later changes nothing."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    params.temperature = float("nan")
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([[1, 2]], params, use_tqdm=False)
    params.temperature, params.max_tokens = 0, 0
    with pytest.raises(ValueError, match="max_tokens"):
        llm.llm_engine.add_request(None, [1, 2], params)
    params.max_tokens = 3
    rid = llm.llm_engine.add_request(None, [1, 2], params)
    params.max_tokens = 1
    outs = []
    while llm.llm_engine.has_unfinished_requests():
        outs += [o for o in llm.llm_engine.step() if o.finished]
    assert [o.request_id for o in outs] == [rid] and len(outs[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("ids", [b"\x01\x02", bytearray(b"\x01"), {1, 2}, frozenset({3})],
                         ids=["bytes", "bytearray", "set", "frozenset"])
def test_token_ids_without_order_or_as_bytes_are_refused(llm, ids):
    """A set has no order (its ids would be fed in hash order) and bytes are not token ids."""
    engine = llm.llm_engine
    for prompt in (ids, {"prompt_token_ids": ids}):
        with pytest.raises(ValueError, match="a prompt must be text, a list of token ids or a dict"):
            engine.add_request(None, prompt, SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()


def test_a_model_that_is_not_a_path_is_refused():
    with pytest.raises(ValueError, match="model must be a folder"):
        LLM(123)


def test_an_id_taken_by_a_request_or_by_its_completions_is_refused(llm):
    """A request with n > 1 holds its id until its last completion finishes, and its other completions
    take `{i}_{id}` (vLLM's names): an id that clashes with either is refused at submission."""
    engine = llm.llm_engine
    varied = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    engine.add_request("x", [1, 2, 3], varied)
    engine.add_request("1_z", [6], GREEDY)
    engine.step()  # x's second completion "1_x" is forked after x's first step
    for rid, params in [("x", GREEDY), ("1_x", GREEDY), ("z", varied)]:  # z's second completion would be "1_z"
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request(rid, [5], params)
    engine.abort_request("1_x")  # x's second completion ends first: "x" stays taken until the first one ends
    engine.step()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [5], GREEDY)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        check_invariants(engine)
    assert set(outs) == {"x", "1_z"} and outs["x"][-1].finished and outs["1_z"][-1].finished
    engine.add_request("x", [5], varied)  # free again
    while engine.has_unfinished_requests():
        engine.step()


def test_a_fresh_id_skips_ids_a_requests_completions_would_clash_with(llm):
    engine = llm.llm_engine
    engine.add_request("1_0", [1, 2], GREEDY)
    engine.add_request("1_1", [1, 2], GREEDY)
    rid = engine.add_request(None, [3, 4], SamplingParams(n=2, temperature=0, max_tokens=3, ignore_eos=True))
    assert f"1_{rid}" not in ("1_0", "1_1")
    done = set()
    while engine.has_unfinished_requests():
        done |= {o.request_id for o in engine.step() if o.finished}
    assert done == {"1_0", "1_1", rid}


def test_a_request_whose_penalty_overflows_the_logits_does_not_stop_the_others(folder):
    """`repetition_penalty` > 0 is all vLLM asks; 1e-40 divides float32 logits into +inf. That request
    still gets tokens of the vocabulary, and its batch mates the tokens they get alone."""
    llm = LLM(folder, dtype="float32", num_kvcache_blocks=16)
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = llm.generate([[4, 5]], good, use_tqdm=False)[0].outputs[0].token_ids
    for bad in (SamplingParams(temperature=1.0, repetition_penalty=1e-40, max_tokens=4, ignore_eos=True, seed=1),
                SamplingParams(temperature=0, repetition_penalty=1e-40, max_tokens=4, ignore_eos=True),
                SamplingParams(top_p=0.5, repetition_penalty=1e-40, max_tokens=4, ignore_eos=True, seed=2)):
        outs = llm.generate([[4, 5], [1, 2, 3]], [good, bad], use_tqdm=False)
        assert outs[0].outputs[0].token_ids == alone
        assert len(outs[1].outputs[0].token_ids) == 4 and all(0 <= t < 128 for t in outs[1].outputs[0].token_ids)
        check_invariants(llm.llm_engine)


@pytest.mark.parametrize("messages, message", [
    ("hello", "messages must be"), ({"role": "user", "content": "hi"}, "messages must be"), ([], "messages must be"),
    (["hello"], "conversation"), ([[]], "conversation"), ([{"role": "user"}], "message"),
    ([{"role": "user", "content": 5}], "message"), ([{"role": "user", "content": None}], "message"),
    ([[{"role": "user", "content": "hi"}], [{"content": "hi"}]], "message"),
])
def test_malformed_chat_messages_are_refused_naming_the_problem(default_model_dir, messages, message):
    from transformers import AutoTokenizer

    from minivllm.engine.processor import chat_prompts

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    assert len(chat_prompts(tokenizer, [{"role": "user", "content": "hi"}])) == 1
    with pytest.raises(ValueError, match=message):
        chat_prompts(tokenizer, messages)


def test_chat_template_kwargs_are_template_variables(default_model_dir):
    """`chat_prompts`' (and `LLM.chat`'s) `chat_template_kwargs` reach the template as variables, as in
    vLLM; a value that is not a dict, or a key that is an argument of `apply_chat_template` itself
    (`chat_template` would swap the template), is refused naming the problem."""
    from transformers import AutoTokenizer

    from minivllm.engine.processor import chat_prompts

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.chat_template = "{% if shout %}LOUD {% endif %}{{ messages[0]['content'] }}"
    hi = [{"role": "user", "content": "hi"}]
    assert chat_prompts(tokenizer, hi, chat_template_kwargs={"shout": True})[0]["prompt"] == "LOUD hi"
    assert chat_prompts(tokenizer, hi)[0]["prompt"] == chat_prompts(tokenizer, hi, chat_template_kwargs={})[0]["prompt"] == "hi"
    for bad, match in [({"chat_template": "{{ 1 }}"}, r"own arguments \['chat_template'\]"),
                       ({"tokenize": True, "shout": 1}, r"\['tokenize'\]"), ("shout", "must be a dict")]:
        with pytest.raises(ValueError, match=match):
            chat_prompts(tokenizer, hi, chat_template_kwargs=bad)


def test_a_max_model_len_the_kv_cache_cannot_hold_is_refused_or_lowered(folder):
    """vLLM's start-up rule. 4 blocks of 16 hold 64 tokens: an explicit max_model_len=128 is refused,
    naming both numbers and what to change; without one, the model's 512 is lowered to 64 with a
    warning (before, it was accepted and a 10-token prompt asking 100 tokens got 54, "length")."""
    from minivllm.attention.paged_attention import PagedAttention
    from minivllm.core.block_manager import BlockManager
    from minivllm.core.kv_cache_manager import ContiguousBlockManager

    small = dict(model=folder, dtype="float64", num_kvcache_blocks=4, block_size=16)
    for parts in (dict(block_manager_cls=BlockManager, attention_backend=PagedAttention), {}):
        with pytest.raises(ValueError, match=r"max_model_len=128 is more than the KV cache holds \(64 tokens\): "
                                             r"lower max_model_len, or raise num_kvcache_blocks"):
            LLMEngine(max_model_len=128, **small, **parts)
        with pytest.warns(UserWarning, match=r"holds 64 tokens, fewer than the model's max_position_embeddings "
                                             r"\(512\): max_model_len is lowered to 64"):
            engine = LLMEngine(**small, **parts)
        assert engine.args.max_model_len == engine.scheduler.max_model_len == engine.processor.max_model_len == 64
        assert type(engine.block_manager) is parts.get("block_manager_cls", ContiguousBlockManager)
        with pytest.raises(ValueError, match="max_model_len=64"):
            engine.add_request(None, list(range(1, 65)), GREEDY)  # refused at submission, not cut short


def test_a_kv_cache_of_fewer_than_two_tokens_is_refused_at_start_up(folder):
    """Lowering max_model_len to what the cache holds must not go below a prompt token and a generated
    one: one block of one token used to give an engine that refused every prompt."""
    with pytest.raises(ValueError, match=r"the KV cache holds 1 tokens: a sequence needs at least 2"):
        LLMEngine(model=folder, dtype="float64", num_kvcache_blocks=1, block_size=1)


def test_more_completions_than_kv_blocks_are_refused_and_others_complete(llm):
    """n is checked at submission against the cache's blocks (each completion holds one of its own):
    an enormous n used to build a list of n completion ids and run the process out of memory."""
    engine = llm.llm_engine
    for n in (17, 10**9):
        with pytest.raises(ValueError, match=rf"n={n} is more than the KV cache's 16 blocks"):
            engine.add_request(None, [1, 2, 3], SamplingParams(n=n, max_tokens=2))
    outs = run_engine(engine, [[4, 5]], GREEDY)
    assert outs[0].finished and len(outs[0].outputs[0].token_ids) == 4
    check_invariants(engine)


def test_aborting_a_request_whose_first_completion_finished_forgets_it(folder):
    """An n > 1 request aborted after one completion finished left its prefix-cache count behind, and a
    later request with the same id reported it."""
    engine = LLM(folder, dtype="float64", block_size=4, num_kvcache_blocks=64, max_model_len=64).llm_engine
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=1, n=2))
    engine.step()  # completion 0 finishes in its prefill step; completion 1 is queued
    engine.abort_request("a")
    assert not engine.has_unfinished_requests() and engine.core.num_cached_tokens == {}
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=1))
    assert [o.num_cached_tokens for o in engine.step()] == [4]  # the first block, found in the cache
    check_invariants(engine)


def test_more_logprobs_than_max_logprobs_are_refused(llm):
    """As vLLM's engine refuses more than its `max_logprobs` (20 by default) log-probabilities per token,
    sampled or of the prompt (-1, the whole vocabulary, counts as its size), naming the limit; the server
    checks the same constant."""
    from minivllm.engine.processor import MAX_LOGPROBS
    from minivllm.entrypoints.openai import protocol

    assert MAX_LOGPROBS == 20 and getattr(protocol, "MAX_LOGPROBS", MAX_LOGPROBS) is MAX_LOGPROBS
    for kwargs, message in [(dict(logprobs=50), r"logprobs=50 is more than max_logprobs=20"),
                            (dict(prompt_logprobs=21), r"prompt_logprobs=21 is more than max_logprobs=20"),
                            (dict(logprobs=-1), r"logprobs=-1 \(the whole vocabulary, 128 tokens\) is more than "
                                                r"max_logprobs=20")]:
        with pytest.raises(ValueError, match=message):
            llm.generate([[1, 2]], SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
        with pytest.raises(ValueError, match=message):
            llm.llm_engine.add_request(None, [1, 2], SamplingParams(max_tokens=2, **kwargs))
    out = llm.generate([[1, 2]], SamplingParams(max_tokens=2, logprobs=20, prompt_logprobs=20), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs) == 2 and all(20 <= len(step) <= 21 for step in out.outputs[0].logprobs)
    check_invariants(llm.llm_engine)
