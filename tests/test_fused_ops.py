"""Chapter 02's fused small ops (appendix B, `minivllm.model_executor.models.fused_layers`): each C++ op
against the plain module it replaces, the fused decoder against the plain one, the engine using it
where it applies and not elsewhere, and clear errors.

Tolerances: float64, 1e-12 (the kernel takes float64 statistics there; the reference is the same
formula in float64). float32: a few units in the last place (a row's squares are summed in another
order: rtol 1e-6). bfloat16: one unit in the last place (a statistic that differs in its last float32
bit can round a value the other way), and almost every value equal. The rotation rounds exactly where
the plain version does: equal bit for bit in every dtype. `silu_and_mul` takes its exponential from a
polynomial, torch from its vector library, each within about one unit in the last place: float32
within rtol 5e-7 of torch (a few units: the exponential's and the quotient's roundings, then the
product's) and, against float64, no worse than torch's own worst error plus half a unit; bfloat16
within one unit and at least 99.9% equal; float64 (`std::exp`) within 1e-12 relative.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from engine_helpers import make_model, require_built, runner_switch_ab
from minivllm.course.testing import tiny_config
from minivllm.model_executor.models.fused_layers import (FusedDecoderLayer, FusedDecoderModel, FusedMLP,
                                                         FusedRMSNorm, FusedRotaryEmbedding, cpu_fused_ops,
                                                         fuse_small_ops)
from minivllm.model_executor.models.llama import MLP, MODEL_REGISTRY, DecoderModel, RMSNorm, RotaryEmbedding


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


def test_bfloat16_subnormals_and_nans_round_as_torch(ops):
    """bfloat16 values below float32's normal range (2**-126) and NaNs, in every op and in the vector loops
    (16 wide) as in their tails: rounded as torch rounds them, subnormals kept (not flushed to zero), NaN as a
    NaN. The kernels convert with AVX512-BF16's vcvtneps2bf16 where the CPU has it, which takes a subnormal
    input as zero: those vectors must go the other way."""
    g = torch.Generator().manual_seed(7)
    tiny = 2.0 ** -130  # subnormal in float32 and in bfloat16
    x = (torch.randn(3, 40, generator=g) * tiny).bfloat16()  # 40: two vectors and a tail
    x[0, 3], x[1, 37] = float("nan"), float("nan")
    x.view(torch.int16)[1, 5] = -64  # 0xFFC0: a NaN with its sign bit set
    assert (x.float().abs() < 2.0 ** -126).float().mean() > 0.9 and (x != 0).float().mean() > 0.9
    r = (torch.randn(3, 40, generator=g) * tiny).bfloat16()
    norm = fused(RMSNorm(40, 1e-6).bfloat16(), FusedRMSNorm)
    xs, rs = x.clone(), r.clone()
    norm(xs, rs)  # the residual add: subnormals kept, NaN where either is
    assert torch.equal(rs.isnan(), (x + r).isnan()) and torch.equal(rs.nan_to_num(), (x + r).nan_to_num())
    norm.weight.data = ((torch.rand(40, generator=g) + 0.5) * 2.0 ** -127).bfloat16()  # normalised rows times
    # subnormal weights: subnormal outputs
    h = torch.randn(3, 40, generator=g).bfloat16()
    want = RMSNorm.forward(norm, h)
    assert ((want != 0) & (want.float().abs() < 2.0 ** -126)).float().mean() > 0.75
    assert torch.equal(norm(h), want)
    gate, up = torch.randn(3, 40, generator=g).bfloat16(), x.clone()  # silu(gate) times subnormal values
    got = torch.empty_like(gate)
    ops.silu_and_mul(got, gate, up)
    want = torch.nn.functional.silu(gate) * up
    assert torch.equal(got.isnan(), want.isnan()) and (want.nan_to_num() != 0).float().mean() > 0.5
    assert_silu_mul_close(got.nan_to_num(), want.nan_to_num(), torch.bfloat16)
    rope = RotaryEmbedding(64, 16, 10000.0)
    q = (torch.randn(4, 2, 64, generator=g) * tiny).bfloat16()
    q[1, 0, 5] = float("nan")
    q.view(torch.int16)[2, 1, 40] = -64  # 0xFFC0
    k = (torch.randn(4, 1, 64, generator=g) * tiny).bfloat16()
    pos = torch.tensor([0, 3, 7, 15])
    want_q, want_k = rope(pos, q, k)
    got_q, got_k = fused(rope, FusedRotaryEmbedding)(pos, q.clone(), k.clone())
    assert torch.equal(got_q.isnan(), want_q.isnan()) and torch.equal(got_q.nan_to_num(), want_q.nan_to_num())
    # a NaN among normal values (no subnormal in its vector): written as from_f writes one, 0x7FC0, whatever
    # its sign (vcvtneps2bf16 would keep 0xFFC0's)
    a, b = (torch.randn(3, 40, generator=g) + 4).bfloat16(), (torch.randn(3, 40, generator=g) + 4).bfloat16()
    a.view(torch.int16)[0, 3], a.view(torch.int16)[1, 36] = -64, -64  # 0xFFC0, in a vector and in a tail
    residual, silu = b.clone(), torch.empty_like(a)
    norm(a.clone(), residual)
    ops.silu_and_mul(silu, b, a)
    q = (torch.randn(4, 2, 64, generator=g) + 4).bfloat16()
    q.view(torch.int16)[1, 0, 3] = -64
    rotated = fused(rope, FusedRotaryEmbedding)(pos, q, k.clone())[0]
    for out in (residual, silu, rotated):
        assert out.isnan().any() and (out.view(torch.int16)[out.isnan()] == 0x7FC0).all()
    assert torch.equal(got_k, want_k) and (want_k != 0).float().mean() > 0.5


def assert_silu_mul_close(got, want, dtype):
    if dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-300)
    elif dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=5e-7, atol=1e-30)
    else:  # bfloat16: one unit at most, and (8 significant bits) nearly always the same value
        diff = (got.float() - want.float()).abs()
        assert (diff <= bf16_ulp(want)).all(), f"bfloat16: beyond one unit in the last place: {diff.max()}"
        assert (diff == 0).float().mean() > 0.999, "bfloat16: more than 0.1% of the values off by one unit"


def test_silu_and_mul_float32_is_as_close_as_torch(ops):
    """Against float64: the exponential's error shows where torch's does not. Our float32 values may be off
    the exact `silu(g) * u` (each rounding, float32's) by at most half a unit in the last place more than
    torch's worst; a polynomial of one degree less (4.3 units against torch's 2.7 here) fails. Results
    below float32's normal range (2**-126, from gates below about -80) have a coarser spacing: not counted."""
    g = torch.linspace(-20, 20, 1_000_003, dtype=torch.float64).float()[None]  # e**-g over 2**-29 .. 2**29
    up = torch.full_like(g, 1.7)
    exact = torch.nn.functional.silu(g.double()) * up.double()
    ours = torch.empty_like(g)
    ops.silu_and_mul(ours, g, up)
    normal = exact.abs() >= 2.0 ** -120
    ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact).exponent - 24)  # float32's spacing there
    err_ours = ((ours.double() - exact).abs() / ulp)[normal].max().item()
    err_torch = (((torch.nn.functional.silu(g) * up).double() - exact).abs() / ulp)[normal].max().item()
    assert err_ours <= err_torch + 0.5, (err_ours, err_torch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, d", [(33, 1536), (5, 40), (1, 7)])  # 40, 7: a tail after the 16-wide vectors
def test_silu_and_mul_equals_torch(ops, dtype, rows, d):
    """Two projections' outputs, or the halves of one stacked output (views a wider stride apart, as
    vLLM's gate_up_proj gives them); out a new tensor or the gate itself."""
    g = torch.Generator().manual_seed(rows * d)
    wide = (3 * torch.randn(rows, 2 * d + 5, generator=g, dtype=torch.float64)).to(dtype)
    gate, up = wide[:, 2:d + 2], wide[:, d + 2:2 * d + 2]
    want = torch.nn.functional.silu(gate) * up
    out = torch.empty(rows, d, dtype=dtype)
    ops.silu_and_mul(out, gate, up)
    assert_silu_mul_close(out, want, dtype)
    in_place = gate.clone()
    ops.silu_and_mul(in_place, in_place, up.clone())
    assert torch.equal(in_place, out)
    into_up = up.clone()
    ops.silu_and_mul(into_up, gate.clone(), into_up)
    assert torch.equal(into_up, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_at_the_edges(ops, dtype):
    """Where e**-g overflows, underflows or is not a number: torch's values (-0 where e**-g is inf,
    g where it is 0, NaN from NaN and from -inf), and finite values up to the edge of float32's range."""
    edge = [0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 87.0, -87.0, 87.6, -87.6, 88.4, -88.4, 88.6, -88.6, 88.8,
            -88.8, 100.0, -100.0, 1e30, -1e30, float("inf"), float("-inf"), float("nan")]
    gate = torch.tensor(edge * 2, dtype=dtype)[None]  # 46 values: two 16-wide vectors and a tail
    up = torch.full_like(gate, 1.5)
    got, want = torch.empty_like(gate), torch.nn.functional.silu(gate) * 1.5
    ops.silu_and_mul(got, gate, up)
    same = (got == want) | (got.isnan() & want.isnan()) | ((got - want).abs() <= 5e-7 * want.abs())
    assert same.all(), [(gate[0, i].item(), got[0, i].item(), want[0, i].item()) for i in (~same[0]).nonzero().flatten()]
    assert torch.equal(torch.signbit(got[want == 0]), torch.signbit(want[want == 0]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fused_mlp_equals_the_plain_one(ops, dtype):
    g = torch.Generator().manual_seed(3)
    mlp = MLP(48, 80, bias=True).to(dtype)
    for p in mlp.parameters():
        p.data = torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype) / 4
    x = torch.randn(9, 48, generator=g, dtype=torch.float64).to(dtype)
    with torch.inference_mode():
        want, got = mlp(x), fused(mlp, FusedMLP)(x)
        tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 0.05}[dtype]  # bfloat16: one unit of
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)  # the activation, through the down projection
        batched = fused(mlp, FusedMLP)(x.view(3, 3, 48))  # any leading dimensions, as MLP
        torch.testing.assert_close(batched, want.view(3, 3, 48), rtol=tol, atol=tol)


def test_the_fused_mlp_keeps_gradients_right(ops):
    """Where autograd records the projections, the C++ op (no backward) must not write into the gate's
    output behind autograd's back: the gradients equal the plain MLP's."""
    g = torch.Generator().manual_seed(4)
    plain = MLP(16, 40)
    for p in plain.parameters():
        p.data = torch.randn(p.shape, generator=g) / 4
    fast = fused(plain, FusedMLP)
    x = torch.randn(5, 16, generator=g)
    plain(x).square().sum().backward()
    fast(x).square().sum().backward()
    for a, b in zip(plain.parameters(), fast.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-6)


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
    with pytest.raises(RuntimeError, match=r"gate, up and out must be \[N, d\] each"):
        ops.silu_and_mul(torch.empty(2, 3), torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match=r"gate, up and out must be \[N, d\] each"):
        ops.silu_and_mul(torch.empty(2, 3, 1), torch.zeros(2, 3, 1), torch.zeros(2, 3, 1))
    with pytest.raises(RuntimeError, match="last dimension must be contiguous"):
        ops.silu_and_mul(torch.empty(4, 2), torch.zeros(2, 4).t(), torch.zeros(4, 2))
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.silu_and_mul(torch.empty(2, 4, dtype=torch.float64), torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match="single memory location"):  # out's rows all in one place
        ops.silu_and_mul(torch.zeros(1, 32).expand(4, 32), torch.zeros(4, 32), torch.zeros(4, 32))
    buf = torch.randn(1, 40)
    with pytest.raises(RuntimeError, match="single memory location"):  # out overlaps gate, shifted by one
        ops.silu_and_mul(buf[:, 1:33], buf[:, 0:32], torch.ones(1, 32))


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
    assert all(type(layer.mlp) is FusedMLP for layer in model.model.layers)
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
    outs, decoders = runner_switch_ab(tmp_path, "fuse_cpu_small_ops",
                                      lambda model: (type(model.model), type(model.model.layers[0].mlp)))
    assert decoders == {"on": (FusedDecoderModel, FusedMLP), "off": (DecoderModel, MLP),
                        "float64": (DecoderModel, MLP)}
    assert outs["on"] == outs["off"]
