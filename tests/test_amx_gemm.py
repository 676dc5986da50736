"""Chapter 02's own bfloat16 matrix multiply on AMX tiles (appendix C, `minivllm.model_executor.layers.amx_gemm`):
`AMXLinear` against the exact product, the hand-over to oneDNN above `max_rows`, where the engine uses
it, and clear errors. Skipped where the CPU has no AMX (the library is built without the kernel there).

Tolerance: each output is a float32 sum of K exact bfloat16 products (and the bias), rounded once to
bfloat16. The float32 sum may differ from the exact one by at most `a = terms * 2**-24 * (sum |x||w| + |bias|)`
(the standard bound for a recursive sum; terms = K, plus one with a bias), and rounding to bfloat16 (8
significant bits, round to nearest even) adds at most 2**-8 of the rounded value's size:
`|out - exact| <= 2**-8 * (|exact| + a) + a`, computed per output. oneDNN's bfloat16 `PackedLinear`
meets the same bound on the same inputs.
The bound is for normal numbers: `tdpbf16ps` flushes subnormal products and sums (below 2**-126) to
zero, and the rounding to bfloat16 a subnormal result (test_subnormals_read_as_zero).
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from engine_helpers import cpu_has_amx, make_model, require_built, run_engine, swap_with_kernels_off
from minivllm.model_executor.cpp_extension import load_extension
from minivllm.model_executor.layers.amx_gemm import CPU_AMX_GEMM, AMXLinear, amx_gemm, use_amx_linear
from minivllm.model_executor.layers.linear import PackedLinear

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def amx():
    module = require_built(load_extension(CPU_AMX_GEMM), "the C++ bfloat16 AMX GEMM")
    if not module.has_amx():
        assert amx_gemm() is None  # built, but not used
        if cpu_has_amx():  # the compiler could not target AMX, or Linux refused the tile state
            require_built(None, "the C++ bfloat16 AMX GEMM with AMX on this AMX CPU")  # fails under CI, else skips
        pytest.skip("this CPU has no AMX: bfloat16 layers stay on oneDNN")
    return module


def share_of_bound(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> float:
    """The largest |out - exact| / (2**-8 (|exact| + a) + a) over the outputs (exact: float64 over the same
    bfloat16 numbers; a: the float32 sum's bound, terms = K plus one for a bias)."""
    w = weight.double()
    b = torch.zeros(w.shape[0], dtype=torch.float64) if bias is None else bias.double()
    exact = x.double() @ w.T + b
    a = (x.shape[-1] + (bias is not None)) * 2.0 ** -24 * (x.double().abs() @ w.abs().T + b.abs())
    bound = 2.0 ** -8 * (exact.abs() + a) + a
    return ((out.double() - exact).abs() / bound.clamp_min(1e-300)).max().item() if out.numel() else 0.0


def bf16_linear(k_in: int, n_out: int, bias: bool, g: torch.Generator) -> nn.Linear:
    linear = nn.Linear(k_in, n_out, bias=bias, dtype=BF16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n_out, k_in, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(n_out, generator=g))
    return linear


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 300), k_in=st.integers(1, 300), n_out=st.integers(1, 200), bias=st.booleans(),
       seed=st.integers(0, 2**16))
@example(rows=1, k_in=576, n_out=960, bias=False, seed=0)    # a decode row of the default model's q/k/v
@example(rows=37, k_in=1536, n_out=576, bias=True, seed=1)   # down_proj, three 16-row blocks
@example(rows=129, k_in=33, n_out=65, bias=True, seed=2)     # two row blocks of 128, K and N one past a tile
@example(rows=16, k_in=32, n_out=64, bias=False, seed=3)     # one tile of x, one pass of four panels
@torch.inference_mode()
def test_the_kernel_is_a_bfloat16_product(amx, rows, k_in, n_out, bias, seed):
    g = torch.Generator().manual_seed(seed)
    linear = bf16_linear(k_in, n_out, bias, g)
    x = (torch.randn(rows, k_in, generator=g) * 3).to(BF16)
    out = amx.linear(x, amx.pack_weight(linear.weight), linear.bias, n_out)  # the kernel for any number of rows
    assert out.shape == (rows, n_out) and out.dtype == BF16
    assert share_of_bound(out, x, linear.weight, linear.bias) <= 1.0
    assert share_of_bound(PackedLinear(linear)(x), x, linear.weight, linear.bias) <= 1.0  # oneDNN meets it too


@torch.inference_mode()
def test_the_bound_catches_a_wrong_product(amx):
    """The check can fail: a product that drops the last block of 32 k, or rounds the sums to bfloat16
    twice (after each half of K), is outside the bound."""
    g = torch.Generator().manual_seed(0)
    linear = bf16_linear(96, 64, False, g)
    x = torch.randn(8, 96, generator=g).to(BF16)
    dropped = amx.linear(x[:, :64].contiguous(), amx.pack_weight(linear.weight[:, :64].contiguous()), None, 64)
    assert share_of_bound(dropped, x, linear.weight, None) > 1.0
    halves = [F.linear(x[:, s], linear.weight[:, s]).float() for s in (slice(0, 48), slice(48, 96))]
    twice = (halves[0] + halves[1]).to(BF16)
    assert share_of_bound(twice, x, linear.weight, None) > 1.0


@torch.inference_mode()
def test_subnormals_read_as_zero(amx):
    """64 products 2**-65 * 2**-65 = 2**-130 (subnormal in float32) sum to the normal 2**-124, yet come
    out as 0, outside the bound; a subnormal bias over a zero product comes out as 0 too."""
    x = torch.full((1, 64), 2.0 ** -65, dtype=BF16)
    w = torch.full((3, 64), 2.0 ** -65, dtype=BF16)
    out = amx.linear(x, amx.pack_weight(w), None, 3)
    assert out.tolist() == [[0.0, 0.0, 0.0]] and share_of_bound(out, x, w, None) > 1.0
    bias = torch.tensor([2.0 ** -130, 1.0, -2.0 ** -127], dtype=BF16)  # subnormal, normal, subnormal
    assert amx.linear(torch.zeros_like(x), amx.pack_weight(w), bias, 3).tolist() == [[0.0, 1.0, 0.0]]


@torch.inference_mode()
def test_a_row_does_not_depend_on_the_rows_beside_it(amx):
    """Up to `max_rows`, each output is the same float32 tile sum over k for any number of rows: a row's
    outputs of this layer are the same bits in a batch of 1 or of 128 (so a decode step's rows do not
    depend on which other sequences share the step)."""
    layer = AMXLinear(nn.Linear(300, 130, bias=True, dtype=BF16))
    x = torch.randn(AMXLinear.max_rows, 300).to(BF16)
    full = layer(x)
    for rows in (1, 5, 15, 16, 17, 33, 100):
        assert torch.equal(layer(x[:rows]), full[:rows]), rows


@torch.inference_mode()
def test_many_rows_go_to_onednn(amx):
    """Above `max_rows` rows `AMXLinear` calls oneDNN's layer of the same weight and returns its product;
    up to it, the kernel's. The call count tells the two apart (on these inputs their bits agree)."""
    g = torch.Generator().manual_seed(0)
    linear = bf16_linear(576, 96, True, g)
    layer, onednn = AMXLinear(linear), PackedLinear(linear)
    calls = []
    layer.many_rows.register_forward_hook(lambda *args: calls.append(1))
    packed = amx.pack_weight(linear.weight)
    x = torch.randn(AMXLinear.max_rows + 1, 576, generator=g).to(BF16)
    ours = amx.linear(x, packed, linear.bias, 96)
    assert torch.equal(layer(x), onednn(x)) and calls == [1]
    few = x[:AMXLinear.max_rows]
    assert torch.equal(layer(few), ours[:AMXLinear.max_rows]) and calls == [1]


@torch.inference_mode()
def test_the_same_bits_on_any_number_of_threads(amx):
    """Each thread configures its own tiles for its panels: 1, 2, 3 and 4 threads give the same bits
    (a thread that used unconfigured tiles would crash the process instead)."""
    g = torch.Generator().manual_seed(1)
    linear = bf16_linear(300, 700, True, g)  # 44 panels: shares of 22 at 2 threads, 14 or 15 at 3, 11 at 4
    packed = amx.pack_weight(linear.weight)
    x = torch.randn(200, 300, generator=g).to(BF16)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            outs.append(amx.linear(x, packed, linear.bias, 700))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    assert share_of_bound(outs[0], x, linear.weight, linear.bias) <= 1.0


# Run in a child process (a read past an end kills the process): x, the packed weight and the bias each
# placed right before a page that may not be read, and right after one, then the same product as from
# ordinary memory, bit for bit. A kernel that read past the last panel of a share (say, always four panels)
# or before the first crashes the child. Shapes: K a multiple of 32 (else x is padded, a copy) and not;
# N a multiple of 64, of 16, and neither; rows a tile, less and more; 1 to 3 threads.
GUARDED_PRODUCTS = r"""
import ctypes, mmap, sys
import torch
from minivllm.model_executor.layers.amx_gemm import amx_gemm

PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
keep = []

def guarded(t, at_end):
    # a copy of t whose bytes end where an unreadable page starts (at_end) or start where one ends
    size = t.numel() * t.element_size()
    pages = -(-size // PAGE)
    region = mmap.mmap(-1, (pages + 2) * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    for page in (0, pages + 1):
        assert libc.mprotect(base + page * PAGE, PAGE, 0) == 0, ctypes.get_errno()
    offset = PAGE + pages * PAGE - size if at_end else PAGE
    keep.append(region)
    out = torch.frombuffer(region, dtype=torch.uint8, count=size, offset=offset)
    return out.view(t.dtype).view(t.shape).copy_(t)

amx = amx_gemm()
g = torch.Generator().manual_seed(0)
cases = 0
for k in (64, 70):
    for n in (1, 17, 48, 64, 100, 700):
        w = torch.randn(n, k, generator=g).bfloat16()
        packed, bias = amx.pack_weight(w), torch.randn(n, generator=g).bfloat16()
        for rows in (1, 16, 40):
            x = torch.randn(rows, k, generator=g).bfloat16()
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                plain = amx.linear(x, packed, bias, n)
                for at_end in (True, False):
                    out = amx.linear(guarded(x, at_end), guarded(packed, at_end), guarded(bias, at_end), n)
                    assert torch.equal(out, plain), (k, n, rows, threads, at_end)
                    cases += 1
print("ok", cases)
"""


def test_no_read_outside_the_inputs(amx):
    done = subprocess.run([sys.executable, "-c", GUARDED_PRODUCTS], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.split() == ["ok", "216"], (done.returncode, done.stderr[-2000:])


@torch.inference_mode()
def test_leading_dims_strided_inputs_and_no_input_features(amx):
    linear = nn.Linear(96, 70, bias=True, dtype=BF16)
    layer = AMXLinear(linear)
    x = torch.randn(2, 3, 96).to(BF16)
    assert torch.equal(layer(x), layer(x.reshape(6, 96)).reshape(2, 3, 70))
    wide = torch.randn(5, 200).to(BF16)[:, 10:106]  # a view whose rows are not contiguous
    assert torch.equal(layer(wide), layer(wide.contiguous()))
    for bias in (True, False):  # K = 0: the bias, or zeros
        empty = nn.Linear(0, 70, bias=bias, dtype=BF16)
        x0 = torch.randn(2, 3, 0).to(BF16)
        assert torch.equal(AMXLinear(empty)(x0), F.linear(x0, empty.weight, empty.bias))


def test_bad_input_is_refused_clearly(amx):
    layer = AMXLinear(nn.Linear(8, 16, dtype=BF16))
    with pytest.raises(ValueError, match="AMXLinear holds bfloat16 weights; got a torch.float32 input"):
        layer(torch.randn(2, 8))
    with pytest.raises(ValueError, match="AMXLinear takes 8 input features; got x of shape \\(2, 9\\)"):
        layer(torch.randn(2, 9).to(BF16))
    with pytest.raises(ValueError, match="AMXLinear runs on the CPU; got x on meta"):
        layer(torch.randn(2, 8, device="meta").to(BF16))
    with pytest.raises(ValueError, match="needs a bfloat16 CPU weight"):
        AMXLinear(nn.Linear(8, 16))
    with pytest.raises(ValueError, match="no gradients"):
        layer(torch.randn(2, 8).to(BF16).requires_grad_())
    packed = amx.pack_weight(torch.randn(16, 8).to(BF16))
    with pytest.raises(RuntimeError, match="200 columns do not fit 1 panels"):
        amx.linear(torch.randn(2, 8).to(BF16), packed, None, 200)
    with pytest.raises(RuntimeError, match="does not fit bfloat16 x"):
        amx.linear(torch.randn(2, 40).to(BF16), packed, None, 16)  # two blocks of 32 k against one
    with pytest.raises(RuntimeError, match="contiguous 2-D bfloat16"):
        amx.linear(torch.randn(2, 8), packed, None, 16)
    with pytest.raises(RuntimeError, match="bias must be a bfloat16 CPU tensor"):
        amx.linear(torch.randn(2, 8).to(BF16), packed, torch.zeros(16), 16)
    with pytest.raises(RuntimeError, match="must be on the CPU"):
        amx.linear(torch.randn(2, 8, device="meta").to(BF16), packed, None, 16)
    with pytest.raises(RuntimeError, match="a 2-D bfloat16 CPU weight"):
        amx.pack_weight(torch.randn(16, 8))


def test_swapped_in_only_where_it_applies(amx, monkeypatch):
    model = nn.Sequential(nn.Linear(8, 16, dtype=BF16), nn.Sequential(nn.Linear(16, 4), nn.Linear(16, 8, dtype=BF16)))
    assert use_amx_linear(model) == 2
    assert [type(m) for m in (model[0], model[1][0], model[1][1])] == [AMXLinear, nn.Linear, AMXLinear]
    one_layer = nn.Sequential(nn.Linear(8, 16, dtype=BF16))
    assert swap_with_kernels_off(monkeypatch, amx_gemm, use_amx_linear, one_layer) == 0


def test_the_engine_uses_it_in_bfloat16(amx, tmp_path):
    """The model runner puts bfloat16 linear layers on `AMXLinear` (the LM head too), with the class switch
    `cpu_gemm` on; off, on oneDNN. Greedy tokens of the two agree on a tiny Qwen2 (q/k/v biases); they
    may part only where bfloat16 logits are nearly tied, which these prompts do not reach."""
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sampling_params import SamplingParams
    from minivllm.worker.model_runner import ModelRunner

    make_model(tmp_path, "qwen2")
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs, kinds = {}, {}
    for name, runner in (("on", ModelRunner), ("off", type("Off", (ModelRunner,), {"cpu_gemm": False}))):
        engine = LLMEngine(model=str(tmp_path), dtype="bfloat16", model_runner_cls=runner, num_kvcache_blocks=32)
        model = engine.model_runner.model
        kinds[name] = {type(m).__name__ for path, m in model.named_modules()  # AMXLinear's own oneDNN layer aside
                       if hasattr(m, "in_features") and not path.endswith(".many_rows")}
        kinds[name].add(f"lm_head: {type(model.lm_head).__name__}")
        outs[name] = [o.outputs[0].token_ids for o in run_engine(engine, prompts, params)]
    assert kinds == {"on": {"AMXLinear", "lm_head: AMXLinear"}, "off": {"PackedLinear", "lm_head: PackedLinear"}}
    assert outs["on"] == outs["off"]
