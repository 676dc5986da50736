"""Chapter 02: our decoder against transformers (the oracle), the naive loops, the sampler, bad input,
the oneDNN-packed linear layers."""
import json
import shutil

import pytest
import torch

from minivllm.model_executor.models.llama import attention_reference
from minivllm.model_executor.model_loader import load_model
from minivllm.baselines.naive import CausalAttention, naive_generate
from minivllm.sampling_params import SamplingParams


def our_logits(model, ids):
    scale = model.model.layers[0].self_attn.scale
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), CausalAttention(scale)))


def hf_greedy(hf_model, prompt, n, eos_token_id=None):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                eos_token_id=eos_token_id, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_logits_equal_transformers_float64(tiny_model):
    folder, hf = tiny_model
    ours = load_model(folder, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    for length in (1, 7, 200):
        ids = torch.randint(0, 128, (length,), generator=g)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0]
        diff = (our_logits(ours, ids) - ref).abs().max().item()
        assert diff < 1e-9, f"length {length}: max abs diff {diff}"


def test_the_oracle_test_can_fail(tiny_llama):
    """A perturbation far below what any real bug causes must still break the 1e-9 bound."""
    folder, hf = tiny_llama
    ours = load_model(folder, dtype=torch.float64)
    with torch.no_grad():
        ours.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-6
        ids = torch.arange(20)
        assert (our_logits(ours, ids) - hf(ids[None]).logits[0]).abs().max() > 1e-9


@pytest.mark.parametrize("use_kv_cache", [False, True])
def test_naive_loops_equal_transformers_generate(tiny_model, use_kv_cache):
    folder, hf = tiny_model
    ours = load_model(folder, dtype=torch.float64)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    g = torch.Generator().manual_seed(2)
    for length in (1, 13, 48):
        prompt = torch.randint(0, 128, (length,), generator=g).tolist()
        assert naive_generate(ours, prompt, params, use_kv_cache=use_kv_cache) == hf_greedy(hf, prompt, 16)


def test_naive_loop_stops_at_eos(tiny_llama):
    folder, hf = tiny_llama
    ours = load_model(folder, dtype=torch.float64)
    prompt = [3, 1, 4, 1, 5]
    full = naive_generate(ours, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    eos = full[5]  # pretend the 6th generated token is the end of sequence
    out = naive_generate(ours, prompt, SamplingParams(temperature=0, max_tokens=12), eos_token_id=eos)
    assert out == full[: full.index(eos) + 1] == hf_greedy(hf, prompt, 12, eos_token_id=eos)


def test_seeded_sampling_is_reproducible(tiny_llama):
    folder, _ = tiny_llama
    ours = load_model(folder, dtype=torch.float64)
    p = SamplingParams(temperature=1.0, max_tokens=20, seed=7, ignore_eos=True)
    a, b = naive_generate(ours, [1, 2, 3], p), naive_generate(ours, [1, 2, 3], p)
    c = naive_generate(ours, [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=20, seed=8, ignore_eos=True))
    assert a == b and a != c


def test_attention_reference_against_torch_sdpa():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(9, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(9, 2, 8, generator=g, dtype=torch.float64)
    mask = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=4)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=mask, scale=0.3).transpose(0, 1)
    assert torch.allclose(attention_reference(q, k, v, 0.3), ref, atol=1e-12)


# --- the default model (float32) ---------------------------------------------------------------

@pytest.fixture(scope="module")
def default_pair(default_model_dir):
    from transformers import AutoModelForCausalLM

    from minivllm.transformers_utils.model_files import load_tokenizer

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    return load_model(default_model_dir, dtype=torch.float32), hf, load_tokenizer(default_model_dir)


@pytest.mark.slow
def test_default_model_logits_float32(default_pair):
    """Tolerance 1e-3: both sides sum the same float32 products in different orders (different
    matmul shapes/kernels); float32 rounding (~6e-8 relative) grows through 30 layers to ~1e-4 on logits
    of magnitude ~20. A wrong weight, norm or rotation gives errors of order 1."""
    ours, hf, tok = default_pair
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}],
                                     add_generation_prompt=True, tokenize=False)
    ids = torch.tensor(tok.encode(prompt))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = our_logits(ours, ids)
    assert (got - ref).abs().max().item() < 1e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_default_model_greedy_text_equals_transformers(default_pair):
    ours, hf, tok = default_pair
    for question in ("What is the capital of France?", "Write a haiku about the sea."):
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
        ids = tok.encode(prompt)
        for use_kv_cache in (False, True):
            out = naive_generate(ours, ids, SamplingParams(temperature=0, max_tokens=24), tok.eos_token_id,
                                 use_kv_cache=use_kv_cache)
            assert out == hf_greedy(hf, ids, 24, tok.eos_token_id)[: len(out)]


# --- bad input ---------------------------------------------------------------------------------

def test_unsupported_architecture(tmp_path, tiny_llama):
    folder, _ = tiny_llama
    shutil.copytree(folder, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*gpt2"):
        load_model(tmp_path / "m")


def test_malformed_config(tmp_path, tiny_llama):
    folder, _ = tiny_llama
    shutil.copytree(folder, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(tmp_path / "m")


def test_missing_and_misshapen_weights(tmp_path, tiny_llama):
    from safetensors.torch import load_file, save_file

    folder, _ = tiny_llama
    shutil.copytree(folder, tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "layers.1.mlp" not in k}, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match="weights missing.*layers.1.mlp"):
        load_model(tmp_path / "m")
    weights["model.norm.weight"] = torch.ones(3, dtype=torch.float64)
    save_file(weights, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        load_model(tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (tmp_path / "m" / "model.safetensors").write_bytes(data[:len(data) // 2])  # a download cut short
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        load_model(tmp_path / "m")


def test_unknown_dtype(tiny_llama):
    for bad in ("float7", "int8", torch.int8):
        with pytest.raises(ValueError, match="unknown dtype"):
            load_model(tiny_llama[0], dtype=bad)


def test_naive_loop_rejects_empty_and_too_long_prompts(tiny_llama):
    ours = load_model(tiny_llama[0], dtype=torch.float64)
    with pytest.raises(ValueError, match="empty"):
        naive_generate(ours, [], SamplingParams(temperature=0))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        naive_generate(ours, [1] * 1020, SamplingParams(temperature=0, max_tokens=10))


def test_llama_with_attention_bias_biases_o_proj_too(tmp_path):
    """transformers' Llama puts a bias on o_proj as well as q/k/v when attention_bias=True."""
    from minivllm.course.testing import make_tiny_model

    hf = make_tiny_model(tmp_path, "llama", seed=4, attention_bias=True)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.float64)
    ids = torch.arange(3, 30)
    with torch.no_grad():
        assert (our_logits(ours, ids) - hf(ids[None]).logits[0]).abs().max() < 1e-9


def test_unsupported_activation_and_unknown_tensors_are_refused(tmp_path, tiny_llama):
    from safetensors.torch import load_file, save_file

    folder, _ = tiny_llama
    shutil.copytree(folder, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        load_model(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    weights = load_file(tmp_path / "m" / "model.safetensors")
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64, dtype=torch.float64)
    save_file(weights, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match="o_proj.bias has no matching parameter"):
        load_model(tmp_path / "m")


def test_tiny_temperatures_are_greedy(tiny_llama):
    ours = load_model(tiny_llama[0], dtype=torch.float64)
    greedy = naive_generate(ours, [1, 2, 3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert naive_generate(ours, [1, 2, 3], SamplingParams(temperature=1e-320, max_tokens=8, ignore_eos=True)) == greedy


# --- oneDNN-packed linear layers (the engine's CPU fast path) ------------------------------------

from engine_helpers import float32_cpu_linear  # noqa: E402
from minivllm.model_executor.layers.linear import PackedLinear, onednn_packing_supported, pack_linear_layers  # noqa: E402

needs_onednn = pytest.mark.skipif(not onednn_packing_supported(torch.float32),
                                  reason="this PyTorch build has no oneDNN float32 linear")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(bias):
    """float32: the two libraries sum in different orders, so equal up to ~1e-6 relative, not bits."""
    g = torch.Generator().manual_seed(0)
    for in_f, out_f in ((8, 3), (576, 192), (64, 1000)):
        lin = torch.nn.Linear(in_f, out_f, bias=bias)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(out_f, in_f, generator=g))
            if bias:
                lin.bias.copy_(torch.randn(out_f, generator=g))
        packed = PackedLinear(lin)
        for shape in ((1, in_f), (5, in_f), (2, 3, in_f), (in_f,), (0, in_f)):
            x = torch.randn(*shape, generator=g)
            want, got = lin(x), packed(x)
            assert got.shape == want.shape and got.dtype == want.dtype
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * in_f ** 0.5)
        xt = torch.randn(in_f, 7, generator=g).t()  # a non-contiguous input
        torch.testing.assert_close(packed(xt), lin(xt), rtol=1e-5, atol=1e-5 * in_f ** 0.5)


@needs_onednn
def test_packed_linear_refuses_what_onednn_cannot_run():
    with pytest.raises(ValueError, match="cannot pack a torch.float64 weight"):
        PackedLinear(torch.nn.Linear(4, 4).double())
    packed = PackedLinear(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="holds torch.float32 weights; got a torch.float64 input"):
        packed(torch.zeros(2, 4, dtype=torch.float64))


@needs_onednn
def test_pack_linear_layers_keeps_the_logits(tiny_model):
    folder, _ = tiny_model
    plain = load_model(folder, dtype=torch.float32)
    packed = load_model(folder, dtype=torch.float32)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in plain.modules())
    assert pack_linear_layers(packed) == n_linear and n_linear > 0
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    ids = torch.randint(0, 128, (33,), generator=torch.Generator().manual_seed(3))
    want, got = our_logits(plain, ids), our_logits(packed, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # float32 rounding through 2 layers, not bits
    # float64 models are left alone (oneDNN has no float64 kernels): the oracle tests run nn.Linear
    f64 = load_model(folder, dtype=torch.float64)
    assert pack_linear_layers(f64) == 0


@needs_onednn
def test_engine_packs_on_cpu_only_where_the_dtype_allows(tiny_llama):
    from minivllm import LLM
    from minivllm.worker.model_runner import ModelRunner

    folder, _ = tiny_llama
    f32 = LLM(str(folder), dtype="float32", num_kvcache_blocks=8).llm_engine.model_runner.model
    fast = float32_cpu_linear()  # chapter 02's own GEMM where the CPU has AVX-512 or AVX2, else oneDNN's
    assert isinstance(f32.lm_head, fast) and isinstance(f32.model.layers[0].mlp.down_proj, fast)
    f64 = LLM(str(folder), dtype="float64", num_kvcache_blocks=8).llm_engine.model_runner.model
    assert isinstance(f64.lm_head, torch.nn.Linear)
    assert ModelRunner.pack_cpu_linears is True



# --- chapter 02's appendix: one product for q, k and v ------------------------------------------------
from minivllm.model_executor.models.fused_qkv import QKVFusedAttention, fuse_qkv_projections  # noqa: E402


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])  # no bias, q/k/v biases, q/k norms
def test_fused_qkv_gives_the_same_logits_bit_for_bit(kind):
    """Each output column of the stacked product is the same dot product as before: float64 logits are
    equal, not just close; the model keeps every other module, and the stacked layer replaces the three."""
    import copy
    from minivllm.course.testing import tiny_config
    from minivllm.model_executor.models.llama import MODEL_REGISTRY

    cfg = tiny_config(kind)
    torch.manual_seed(0)
    plain = MODEL_REGISTRY[cfg.model_type](cfg).double()
    with torch.no_grad():
        for m in plain.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_()  # Qwen2's biases: not zero, so a dropped one would show
    fused = copy.deepcopy(plain)
    assert fuse_qkv_projections(fused) == cfg.num_hidden_layers
    attn = fused.model.layers[0].self_attn
    assert type(attn) is QKVFusedAttention and not hasattr(attn, "q_proj")
    assert attn.qkv_proj.out_features == (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim
    assert (attn.qkv_proj.bias is not None) == (plain.model.layers[0].self_attn.q_proj.bias is not None)
    assert fuse_qkv_projections(fused) == 0  # already fused
    ids = torch.randint(0, cfg.vocab_size, (17,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(our_logits(fused, ids), our_logits(plain, ids))


def test_fused_qkv_order_matters_and_other_projections_are_left_alone():
    """The check can fail: stacking k before q changes the logits. Projections that are not plain
    `nn.Linear` (chapter 13's tensor-parallel layers) are not fused."""
    import copy
    from minivllm.course.testing import tiny_config
    from minivllm.model_executor.models.llama import MODEL_REGISTRY

    cfg = tiny_config("llama", num_key_value_heads=4)  # equal widths, so a swapped stack still runs
    torch.manual_seed(2)
    plain = MODEL_REGISTRY[cfg.model_type](cfg).double()
    swapped = copy.deepcopy(plain)
    for layer in swapped.model.layers:
        a = layer.self_attn
        a.q_proj, a.k_proj = a.k_proj, a.q_proj
    fuse_qkv_projections(swapped)
    ids = torch.arange(9)
    assert not torch.allclose(our_logits(swapped, ids), our_logits(plain, ids))

    class OtherLinear(torch.nn.Linear):
        pass
    other = copy.deepcopy(plain)
    other.model.layers[0].self_attn.v_proj.__class__ = OtherLinear
    assert fuse_qkv_projections(other) == cfg.num_hidden_layers - 1
    assert hasattr(other.model.layers[0].self_attn, "q_proj")


def test_engine_fuses_qkv_on_cpu(tiny_llama):
    from minivllm import LLM

    folder, _ = tiny_llama
    for dtype in ("float32", "float64"):
        model = LLM(str(folder), dtype=dtype, num_kvcache_blocks=8).llm_engine.model_runner.model
        assert all(type(layer.self_attn) is QKVFusedAttention for layer in model.model.layers)

# --- the sampler: 64-bit seeds, inverse transform sampling -----------------------------------------

from minivllm.sample.generator import CounterGenerator, make_generator, sample  # noqa: E402
from minivllm.sampling_params import SEED_MAX, SEED_MIN  # noqa: E402


def draws(seed, n=32, logits=None):
    logits = torch.zeros(1000, dtype=torch.float64) if logits is None else logits
    gen = make_generator(seed, "cpu")
    return [sample(logits, 1.0, gen) for _ in range(n)]


def test_seeds_that_agree_in_their_low_32_bits_give_different_samples():
    """torch's CPU Generator keeps 32 bits of a seed: 1 and 1 + 2**32 would give one stream."""
    seeds = [1, 1 + 2**32, 1 + 2**33, -1, SEED_MIN, SEED_MIN + 1, SEED_MAX, SEED_MAX - 1, 2**63, 2**63 - 1, 0]
    streams = [tuple(draws(s)) for s in seeds]
    assert len(set(streams)) == len(seeds)
    for s, stream in zip(seeds, streams):
        assert tuple(draws(s)) == stream  # the same seed: the same samples


def test_seeded_engine_level_streams_are_distinct_in_naive_generate(tiny_llama):
    ours = load_model(tiny_llama[0], dtype=torch.float64)
    outs = {s: naive_generate(ours, [1, 2, 3], SamplingParams(temperature=2.0, max_tokens=24, seed=s, ignore_eos=True))
            for s in (1, 1 + 2**32, -(2**63), 2**64 - 1)}
    assert len(set(map(tuple, outs.values()))) == len(outs)


def test_make_generator_refuses_bad_seeds():
    for bad in (True, 1.0, "1", SEED_MIN - 1, SEED_MAX + 1, None):
        with pytest.raises(ValueError, match="seed must be an int"):
            make_generator(bad, "cpu")


def test_sample_refuses_a_torch_generator():
    with pytest.raises(TypeError, match="make_generator"):
        sample(torch.zeros(5), 1.0, torch.Generator().manual_seed(1))


def test_sampling_follows_the_softmax_distribution():
    """Inverse transform sampling: frequencies match softmax(logits / T) (chi-square, 4000 draws)."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5])
    for temperature in (0.5, 1.0, 2.0):
        probs = torch.softmax(logits.double() / temperature, -1)
        gen, n = make_generator(123, "cpu"), 4000
        counts = torch.bincount(torch.tensor([sample(logits, temperature, gen) for _ in range(n)]), minlength=6)
        assert counts[4] == 0  # probability 0 is never drawn
        keep = probs > 0
        expected = n * probs[keep]
        chi2 = (((counts[keep] - expected) ** 2) / expected).sum().item()
        assert chi2 < 20.5, (temperature, counts, expected)  # 5 degrees of freedom: p < 0.001


def test_generator_draws_are_uniform_and_depend_only_on_seed_and_index():
    gen = CounterGenerator(7)
    us = torch.tensor([gen.random() for _ in range(20000)], dtype=torch.float64)
    assert 0 <= us.min() and us.max() < 1
    assert abs(us.mean().item() - 0.5) < 0.01 and abs(us.var().item() - 1 / 12) < 0.005
    assert CounterGenerator(7).random() == us[0].item() and gen.counter == 20000


def test_sample_extremes():
    logits = torch.tensor([0.0, 100.0, 0.0])
    assert draws(5, 10, logits) == [1] * 10  # near one-hot
    assert sample(torch.tensor([3.0, 7.0]), 0.0) == 1  # greedy ignores the generator
    one = torch.tensor([float("-inf")] * 4 + [0.0])
    assert set(draws(9, 50, one)) == {4}


# --- minivllm.course.testing ---------------------------------------------------------------------------

def test_tiny_model_factory(tmp_path):
    from minivllm.course import testing

    state = torch.random.get_rng_state()
    m1 = testing.make_tiny_model(tmp_path / "a", "qwen2", seed=3, num_hidden_layers=3)
    m2 = testing.make_tiny_model(tmp_path / "b", "qwen2", seed=3, num_hidden_layers=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global generator is untouched
    assert m1.config.num_hidden_layers == 3 and m1.dtype == torch.float64
    b1 = m1.model.layers[0].self_attn.q_proj.bias
    assert torch.equal(b1, m2.model.layers[0].self_attn.q_proj.bias) and b1.abs().sum() > 0
    assert (tmp_path / "a" / "config.json").exists()
    with pytest.raises(ValueError, match="unknown tiny model kind"):
        testing.tiny_config("gpt2")
    prompts = testing.random_prompts(5, 2, 9, seed=1, vocab=50)
    assert prompts == testing.random_prompts(5, 2, 9, seed=1, vocab=50) and len(prompts) == 5
    assert all(2 <= len(p) <= 9 and all(0 <= t < 50 for t in p) for p in prompts)


# --- sliding-window configs: decided per layer, as transformers does ------------------------------

QWQ_LIKE = dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)  # 2 = num_hidden_layers


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_sliding_window_on_no_layer_loads_and_equals_transformers(tmp_path, kind):
    """use_sliding_window true with max_window_layers == num_hidden_layers (QwQ-32B's config has
    max_window_layers equal to its 64 layers): every layer attends over the whole sequence in
    transformers, so the model loads and its logits match (the 40-token input is far longer than the
    8-token window, so a window applied anywhere would show)."""
    from minivllm.course.testing import make_tiny_model

    hf = make_tiny_model(tmp_path, kind, **QWQ_LIKE)
    assert set(hf.config.layer_types) == {"full_attention"}
    ours = load_model(tmp_path, dtype=torch.float64)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (our_logits(ours, ids) - hf(ids[None]).logits[0]).abs().max() < 1e-9


def test_a_window_that_no_position_can_exceed_loads(tmp_path):
    from minivllm.course.testing import make_tiny_model

    hf = make_tiny_model(tmp_path, "qwen2", **{**QWQ_LIKE, "max_window_layers": 0, "sliding_window": 1024})
    assert set(hf.config.layer_types) == {"sliding_attention"}
    ours = load_model(tmp_path, dtype=torch.float64)
    ids = torch.arange(60)
    with torch.no_grad():
        assert (our_logits(ours, ids) - hf(ids[None]).logits[0]).abs().max() < 1e-9


@pytest.mark.parametrize("max_window_layers", [0, 1])
def test_a_window_applied_on_some_layer_is_refused(tmp_path, max_window_layers):
    from minivllm.course.testing import make_tiny_model

    hf = make_tiny_model(tmp_path, "qwen2", **{**QWQ_LIKE, "max_window_layers": max_window_layers})
    windowed = [i for i, t in enumerate(hf.config.layer_types) if t == "sliding_attention"]
    assert windowed == list(range(max_window_layers, 2))
    with pytest.raises(ValueError, match=rf"sliding-window attention is not supported: layers \{windowed}\ of 2 "
                                         r"see only the last sliding_window=8 tokens"):
        load_model(tmp_path, dtype=torch.float64)


def test_layer_types_in_the_config_decide(tmp_path, tiny_llama):
    """An explicit `layer_types` wins over max_window_layers (transformers reads it per layer)."""
    from minivllm.model_executor.models.llama import sliding_window_layers
    from minivllm.course.testing import make_tiny_model, tiny_config

    make_tiny_model(tmp_path, "qwen2", **QWQ_LIKE, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match=r"layers \[0\] of 2"):
        load_model(tmp_path, dtype=torch.float64)
    off = tiny_config("qwen2", sliding_window=8, max_window_layers=0)  # use_sliding_window False
    assert sliding_window_layers(off) == []

    class Old:  # a config from before transformers had layer_types: Qwen2's rule
        num_hidden_layers, max_position_embeddings = 4, 64
        use_sliding_window, sliding_window, max_window_layers = True, 8, 3

    assert sliding_window_layers(Old()) == [3]
    Old.max_window_layers = 4
    assert sliding_window_layers(Old()) == []
    Old.layer_types = ["full_attention", "chunked_attention", "full_attention", "full_attention"]
    with pytest.raises(ValueError, match="unsupported layer_types"):
        sliding_window_layers(Old())


def test_rms_norm_is_bit_identical_to_transformers_in_bfloat16_and_float64():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from minivllm.model_executor.models.llama import RMSNorm

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        x = (torch.randn(16, 96, generator=g, dtype=torch.float64) * 3).to(dtype)
        ours, ref = RMSNorm(96, 1e-6).to(dtype), LlamaRMSNorm(96, 1e-6).to(dtype)
        with torch.no_grad():
            ours.weight.copy_(torch.randn(96, generator=g))
            ref.weight.copy_(ours.weight)
            assert torch.equal(ours(x), ref(x)), dtype


# --- the chapter 02 graders can fail -------------------------------------------------------------

def test_ch02_graders_reject_near_miss_answers():
    """Answers that are right in float64 or without a window must fail: Llama's cast order for
    Gemma's norm (wrong in 16-bit types), rotate-half for interleaved RoPE, attention that ignores
    the window."""
    from types import SimpleNamespace

    import test_grading as grading
    from adapters import load
    from minivllm.model_executor.models.llama import attention_reference

    def llama_order(x, weight, eps):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (1.0 + weight) * h.to(x.dtype)

    def rotate_half(x, cos, sin):
        cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def no_window(q, k, v, scale, causal=True, sliding_window=None):
        return attention_reference(q, k, v, scale, causal)

    cases = [(grading.test_ch02_ex1_gemma_rms_norm_bit_identical_to_transformers, {"gemma_rms_norm": llama_order},
              dict(n=4, hidden=64, eps=1e-6, dtype=torch.bfloat16, seed=0)),
             (grading.test_ch02_ex1_interleaved_rope_matches_gptj, {"apply_rope_interleaved": rotate_half},
              dict(n=4, heads=2, half=8, seed=0)),
             (grading.test_ch02_ex2_attention_matches_torch, {"attention": no_window},
              dict(tq=6, extra=6, kv_heads=1, groups=2, window=3, causal=True, seed=0))]
    for test, answer, example in cases:  # the graders' bodies on one example each (no hypothesis search)
        with pytest.raises(AssertionError):
            test.hypothesis.inner_test(ch02=SimpleNamespace(**answer), **example)
    solutions = SimpleNamespace(**{name: getattr(load("ch02_model", "solutions"), name)
                                   for name in ("gemma_rms_norm", "apply_rope_interleaved", "attention")})
    for test, _, example in cases:  # and the worked answers pass the same examples
        test.hypothesis.inner_test(ch02=solutions, **example)


def test_temporary_folder_lives_as_long_as_its_process():
    """A `temporary_folder` is there (and empty) while the process that made it runs, and gone once it
    exits: a chapter run again and again leaves no tiny models behind (`tempfile.mkdtemp`'s would stay)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; from minivllm.course.testing import temporary_folder, make_tiny_model\n"
            "a, b = temporary_folder('minivllm-test-'), temporary_folder('minivllm-test-')\n"
            "assert a != b and a.is_dir() and not any(a.iterdir()), a\n"
            "make_tiny_model(b / 'tiny')\n"
            "assert (b / 'tiny' / 'config.json').exists()\n"
            "print(a, b, sep='\\n')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    folders = [Path(line) for line in r.stdout.split()]
    assert len(folders) == 2 and all(f.name.startswith("minivllm-test-") for f in folders), r.stdout
    assert not any(f.exists() for f in folders), folders
