"""Chapter 02's fused small ops (appendix B, `minivllm.model_executor.models.fused_layers`): each C++ op
against the plain module it replaces, the fused decoder against the plain one, the engine using it
where it applies and not elsewhere, and clear errors.

Tolerances: float64, 1e-12 (the kernel takes float64 statistics there; the reference is the same
formula in float64). float32: a few units in the last place (a row's squares are summed in another
order: rtol 1e-6). bfloat16: one unit in the last place (a statistic that differs in its last float32
bit can round a value the other way), and almost every value equal. The rotation rounds exactly where
the plain version does: equal bit for bit in every dtype.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from engine_helpers import make_model, require_built, runner_switch_ab
from minivllm.course.testing import tiny_config
from minivllm.model_executor.models.fused_layers import (FusedDecoderLayer, FusedDecoderModel, FusedRMSNorm,
                                                         FusedRotaryEmbedding, cpu_fused_ops, fuse_small_ops)
from minivllm.model_executor.models.llama import MODEL_REGISTRY, DecoderModel, RMSNorm, RotaryEmbedding


@pytest.fixture(scope="module")
def ops():
    return require_built(cpu_fused_ops(), "the C++ fused small ops")


def fused(module, cls):
    out = copy.deepcopy(module)
    out.__class__ = cls
    return out


def norm_f64(weight, eps):
    """RMSNorm's formula with float64 statistics: what the kernel computes for float64."""
    return lambda h: weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values at each of x's magnitudes."""
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), torch.frexp(x.float().abs()).exponent - 8)


def assert_norm_close(got, want, dtype):
    if dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    elif dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        diff = (got.float() - want.float()).abs()
        assert (diff <= bf16_ulp(want)).all(), f"bfloat16: beyond one unit in the last place: {diff.max()}"
        assert (diff == 0).float().mean() > 0.98, "bfloat16: more than 2% of the values off by one unit"


DTYPES = [torch.float64, torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(33, 576), (5, 96), (7, 4, 64), (1, 3, 100)])  # rows; heads (Qwen3's q/k norms)
def test_rms_norm_and_fused_add_equal_the_plain_norm(ops, dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x, r = (3 * torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    norm = RMSNorm(shape[-1], 1e-6).to(dtype)
    norm.weight.data = torch.randn(shape[-1], generator=g, dtype=torch.float64).to(dtype)
    plain = norm_f64(norm.weight, 1e-6) if dtype == torch.float64 else norm
    fnorm = fused(norm, FusedRMSNorm)
    assert_norm_close(fnorm(x), plain(x), dtype)
    xs, rs = x.clone(), r.clone()
    assert fnorm(xs, rs) == (xs, rs)
    assert torch.equal(rs, x + r)  # the residual add rounds as torch's does
    assert_norm_close(xs, plain(x + r), dtype)


def test_rms_norm_reads_strided_heads(ops):
    """q and k are column slices of the q/k/v product, viewed as heads: the kernel reads them in place."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(6, 5 * 32, generator=g)
    q = qkv[:, 32:96].view(6, 2, 32)  # not contiguous: row stride 160
    norm = RMSNorm(32, 1e-6)
    norm.weight.data = torch.rand(32, generator=g) + 0.5
    torch.testing.assert_close(fused(norm, FusedRMSNorm)(q), norm(q), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_equals_the_plain_one_bit_for_bit(ops, dtype):
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(64, 300, 10000.0)
    qkv = torch.randn(17, 15 * 64, generator=g, dtype=torch.float64).to(dtype)
    q, k = qkv[:, :9 * 64].view(17, 9, 64), qkv[:, 9 * 64:12 * 64].view(17, 3, 64)
    pos = torch.randint(0, 300, (17,), generator=g)
    want_q, want_k = rope(pos, q, k)
    got_q, got_k = q.clone(), k.clone()
    assert fused(rope, FusedRotaryEmbedding)(pos, got_q, got_k) == (got_q, got_k)  # rotated in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    views = qkv.clone()  # in place on the views: only q's and k's columns change
    fused(rope, FusedRotaryEmbedding)(pos, views[:, :576].view(17, 9, 64), views[:, 576:768].view(17, 3, 64))
    assert torch.equal(views[:, 768:], qkv[:, 768:]) and torch.equal(views[:, :576].view(17, 9, 64), want_q)


def test_bad_input_is_refused_clearly(ops):
    rope = fused(RotaryEmbedding(8, 16, 10000.0), FusedRotaryEmbedding)
    q, k = torch.zeros(2, 2, 8), torch.zeros(2, 1, 8)
    with pytest.raises(RuntimeError, match="position 16 outside the table of 16"):
        rope(torch.tensor([0, 16]), q, k)
    with pytest.raises(RuntimeError, match="positions must be"):
        rope(torch.tensor([0, 1], dtype=torch.int32), q, k)
    with pytest.raises(RuntimeError, match="one dtype"):
        rope(torch.tensor([0, 1]), q, k.double())
    norm = fused(RMSNorm(8), FusedRMSNorm)
    with pytest.raises(RuntimeError, match="last dimension must be contiguous"):
        norm(torch.zeros(8, 3).t())
    with pytest.raises(RuntimeError, match="weight must be"):
        norm(torch.zeros(3, 8, dtype=torch.float64))  # a float32 weight
    with pytest.raises(RuntimeError, match="residual must match"):
        norm(torch.zeros(3, 8), torch.zeros(4, 8))


def logits(model, ids):
    from minivllm.model_executor.models.llama import attention_reference

    scale = model.model.layers[0].self_attn.scale
    attn = lambda i, q, k, v: attention_reference(q, k, v, scale)  # noqa: E731
    return model.compute_logits(model(ids, torch.arange(len(ids)), attn))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_decoder_equals_the_plain_one(ops, kind, dtype):
    cfg = tiny_config(kind)
    plain = MODEL_REGISTRY[cfg.model_type](cfg).to(dtype)
    for p in plain.parameters():  # norms with weights other than one, so that their order shows
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(p.numel()))
    model = copy.deepcopy(plain)
    assert fuse_small_ops(model) and type(model.model) is FusedDecoderModel
    assert all(type(layer) is FusedDecoderLayer for layer in model.model.layers)
    ids = torch.randint(0, cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        a, b = logits(plain, ids), logits(model, ids)
    tol = 1e-5 if dtype == torch.float32 else 0.1  # bfloat16: a flipped last bit grows through the layers
    torch.testing.assert_close(b.float(), a.float(), rtol=tol, atol=tol)
    if dtype == torch.float32:
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_fusion_applies_only_where_it_should(ops, monkeypatch):
    cfg = tiny_config("llama")
    for dtype in (torch.float64, torch.float16):  # float64: RMSNorm's float32 statistics stay exact to transformers
        model = MODEL_REGISTRY[cfg.model_type](cfg).to(dtype)
        assert not fuse_small_ops(model) and type(model.model) is DecoderModel
    model = MODEL_REGISTRY[cfg.model_type](cfg).float()
    model.model.layers[0].__class__ = type("OtherLayer", (type(model.model.layers[0]),), {})
    assert not fuse_small_ops(model) and type(model.model) is DecoderModel  # a layer it does not know
    monkeypatch.setenv("MINIVLLM_CPU_KERNEL", "0")
    cpu_fused_ops.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # switched off on purpose: no warning
            assert not fuse_small_ops(MODEL_REGISTRY[cfg.model_type](cfg).float())
    finally:
        cpu_fused_ops.cache_clear()


def test_the_engine_fuses_float32_and_keeps_float64_plain(ops, tmp_path):
    """The engine's model runner fuses on CPU in float32 (its greedy tokens equal a plain engine's on
    a tiny model) and leaves float64, the oracle tests' dtype, on the plain path."""
    make_model(tmp_path, "qwen3")
    outs, decoders = runner_switch_ab(tmp_path, "fuse_cpu_small_ops", lambda model: type(model.model))
    assert decoders == {"on": FusedDecoderModel, "off": DecoderModel, "float64": DecoderModel}
    assert outs["on"] == outs["off"]
