"""Chapter 02's own float32 matrix multiply (appendix C, `minivllm.model_executor.layers.cpu_gemm`):
`PanelLinear` against the exact product, where the engine uses it and where not, and clear errors.

Tolerance: each output is a float32 sum of K products (and the bias), so it may differ from the exact
sum of the same float32 numbers by at most about `terms * 2**-24 * (sum(|x| |w|) + |bias|)` (the
standard bound for a recursive sum, fused multiply-adds or not; terms = K, plus one with a bias). Every output is held to that bound, computed per output; oneDNN's
`PackedLinear` meets the same bound on the same inputs.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
import torch.nn.functional as F
from torch import nn

from engine_helpers import make_model, require_built, runner_switch_ab, swap_with_kernels_off
from minivllm.model_executor.cpp_extension import load_extension
from minivllm.model_executor.layers.cpu_gemm import CPU_GEMM, PANEL_WIDTH, PanelLinear, cpu_gemm, use_panel_linear
from minivllm.model_executor.layers.linear import PackedLinear


@pytest.fixture(scope="module")
def gemm():
    module = require_built(load_extension(CPU_GEMM), "the C++ float32 GEMM")
    if not module.kernel_isa():
        assert cpu_gemm() is None  # built, but not used: the kernel needs AVX-512, or AVX2 with FMA
        pytest.skip("this CPU has neither AVX-512 nor AVX2 with FMA: the C++ GEMM is not used (oneDNN keeps the layers)")
    return module


def share_of_bound(out: torch.Tensor, x: torch.Tensor, linear: nn.Linear) -> float:
    """The largest |out - exact| / (terms * 2**-24 * (sum |x||w| + |bias|)) over the outputs (exact: float64
    over the same float32 numbers; terms: K, plus one for a bias)."""
    w = linear.weight.detach().double()
    b = torch.zeros(w.shape[0], dtype=torch.float64) if linear.bias is None else linear.bias.detach().double()
    exact = x.double() @ w.T + b
    terms = x.shape[-1] + (linear.bias is not None)  # the bias is one more term of the sum
    bound = terms * 2.0 ** -24 * (x.double().abs() @ w.abs().T + b.abs())
    return ((out.double() - exact).abs() / bound.clamp_min(1e-300)).max().item() if out.numel() else 0.0


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 200), k_in=st.integers(1, 300), n_out=st.integers(1, 3 * PANEL_WIDTH + 5),
       bias=st.booleans(), seed=st.integers(0, 2**16))
@example(rows=1, k_in=576, n_out=960, bias=False, seed=0)       # a decode row of the default model's q/k/v
@example(rows=30, k_in=64, n_out=100, bias=True, seed=1)        # a panel half full, its bias columns offset
@example(rows=97, k_in=130, n_out=64, bias=False, seed=2)       # two row blocks, a K block cut short
@example(rows=7, k_in=1, n_out=5, bias=True, seed=3)            # K = 1, one narrow panel
@torch.inference_mode()
def test_panel_linear_is_a_float32_product(gemm, rows, k_in, n_out, bias, seed):
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(k_in, n_out, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n_out, k_in, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(n_out, generator=g))
    x = torch.randn(rows, k_in, generator=g) * 3
    out = PanelLinear(linear)(x)
    assert out.shape == (rows, n_out) and out.dtype == torch.float32
    assert share_of_bound(out, x, linear) <= 1.0
    assert share_of_bound(PackedLinear(linear)(x), x, linear) <= 1.0  # the bound is one oneDNN meets too


@torch.inference_mode()
def test_leading_dims_and_strided_inputs(gemm):
    linear = nn.Linear(96, 70, bias=True)
    layer = PanelLinear(linear)
    x = torch.randn(2, 3, 96)
    assert torch.equal(layer(x), layer(x.reshape(6, 96)).reshape(2, 3, 70))
    wide = torch.randn(5, 200)[:, 10:106]  # a view whose rows are not contiguous
    assert torch.equal(layer(wide), layer(wide.contiguous()))
    assert share_of_bound(layer(wide), wide, linear) <= 1.0


@torch.inference_mode()
def test_a_row_does_not_depend_on_how_many_rows_come_with_it(gemm):
    """Each output is one multiply-add chain over k in the same order for any number of rows (the
    K blocks only store and reload the float32 sums), so a sequence's logits are the same bits in a
    batch of 1 or of 300: greedy tokens cannot depend on how a step was batched."""
    layer = PanelLinear(nn.Linear(300, 130, bias=True))
    x = torch.randn(301, 300)
    full = layer(x)
    for rows in (1, 5, 6, 7, 96, 97, 200):
        assert torch.equal(layer(x[:rows]), full[:rows]), rows


@torch.inference_mode()
def test_the_same_bits_on_any_number_of_threads(gemm):
    """Up to 96 rows the threads share the (panel, row) pairs equally, so a panel may be split by rows
    between threads (9 panels for 2 threads): each output is still one multiply-add chain over k in the
    same order, whichever thread computes it, and no pair is left out. (A pair done twice gives the same
    bits unless two threads race on it: no output test can promise to see that.)"""
    linear = nn.Linear(200, 9 * PANEL_WIDTH - 3, bias=True)
    layer, x = PanelLinear(linear), torch.randn(97, 200)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = {rows: layer(x[:rows]) for rows in (1, 2, 5, 31, 96, 97)}
        for threads in (2, 3, 4):
            torch.set_num_threads(threads)
            for rows, out in alone.items():
                shared = layer(x[:rows])
                assert torch.equal(shared, out), (threads, rows)
                assert share_of_bound(shared, x[:rows], linear) <= 1.0
    finally:
        torch.set_num_threads(before)


def test_bad_input_is_refused_clearly(gemm):
    layer = PanelLinear(nn.Linear(8, 16))
    with pytest.raises(ValueError, match="float32 weights; got a torch.bfloat16 input"):
        layer(torch.randn(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="takes 8 input features; got x of shape \\(2, 9\\)"):
        layer(torch.randn(2, 9))
    with pytest.raises(ValueError, match="float32 CPU weight"):
        PanelLinear(nn.Linear(8, 16).double())
    with pytest.raises(RuntimeError, match="200 columns do not fit 1 panels"):
        gemm.linear(torch.randn(2, 8), gemm.pack_weight(torch.randn(16, 8)), None, 200)  # more columns than panels


@torch.inference_mode()
def test_no_input_features_gives_the_bias(gemm):
    """K = 0 is a legal `nn.Linear` (F.linear returns the bias, or zeros); the kernel must not divide
    by its zero K blocks (that killed the process with SIGFPE)."""
    for bias in (True, False):
        linear = nn.Linear(0, 70, bias=bias)
        x = torch.randn(2, 3, 0)
        assert torch.equal(PanelLinear(linear)(x), F.linear(x, linear.weight, linear.bias))
    out = gemm.linear(torch.randn(4, 0), gemm.pack_weight(torch.randn(5, 0)), torch.arange(5.0), 5)
    assert torch.equal(out, torch.arange(5.0).expand(4, 5))


def test_inputs_off_the_cpu_are_refused_clearly(gemm):
    """The kernel reads raw CPU pointers: a tensor on another device must be refused, not read
    (a CUDA pointer read on the host is a crash). The meta device stands in for any other device."""
    layer = PanelLinear(nn.Linear(8, 16))
    with pytest.raises(ValueError, match="runs on the CPU; got x on meta"):
        layer(torch.randn(2, 8, device="meta"))
    packed = gemm.pack_weight(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="must be on the CPU"):
        gemm.linear(torch.randn(2, 8, device="meta"), packed, None, 16)
    with pytest.raises(RuntimeError, match="bias must be a float32 CPU tensor"):
        gemm.linear(torch.randn(2, 8), packed, torch.zeros(16, device="meta"), 16)
    with pytest.raises(RuntimeError, match="a 2-D float32 CPU weight"):
        gemm.pack_weight(torch.randn(16, 8, device="meta"))


def test_no_silent_loss_of_gradients(gemm):
    """The kernel has no backward: with autograd recording, an input that requires grad is refused
    (the output would silently leave the graph); under no_grad or inference_mode the same input runs."""
    layer = PanelLinear(nn.Linear(8, 16))
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(ValueError, match="no gradients"):
        layer(x)
    with torch.no_grad():
        assert torch.equal(layer(x), layer(x.detach()))
    assert not layer(x.detach()).requires_grad  # grad mode on, nothing to differentiate: runs


def test_swapped_in_only_where_it_applies(gemm, monkeypatch):
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 4).double(), nn.Linear(16, 8)))
    assert use_panel_linear(model) == 2
    assert [type(m) for m in (model[0], model[1][0], model[1][1])] == [PanelLinear, nn.Linear, PanelLinear]
    assert swap_with_kernels_off(monkeypatch, cpu_gemm, use_panel_linear, nn.Sequential(nn.Linear(8, 16))) == 0


def test_the_engine_uses_it_in_float32_with_the_same_greedy_tokens(gemm, tmp_path):
    """The model runner puts float32 linear layers on the C++ GEMM (greedy tokens equal to an engine on
    oneDNN, on a tiny Qwen2 with q/k/v biases) and leaves float64 models on `nn.Linear`."""
    make_model(tmp_path, "qwen2")
    outs, kinds = runner_switch_ab(tmp_path, "cpu_gemm",
                                   lambda model: {type(m).__name__ for m in model.modules() if hasattr(m, "in_features")})
    assert kinds == {"on": {"PanelLinear"}, "off": {"PackedLinear"}, "float64": {"Linear"}}
    assert outs["on"] == outs["off"]
