"""Chapter 05's CPU backend prefill: `CPUPagedAttention` runs each sequence's causal attention through
`prefill_attention_cpu`: with head_dim 64 or 128, the appendix's C++ prefill kernel in float32 where the
library was built for AVX-512 or AVX2 and its AMX kernel in bfloat16 where the CPU has AMX; otherwise torch's fused
`scaled_dot_product_attention` (`prefill_attention_sdpa`, a batch of one so that torch's fused CPU
kernel takes it), which accumulates in float32 for bfloat16.
`prefill_attention_grouped` (one product per K/V head and query chunk), the unfused alternative the
chapter measures, is checked too.

Oracle: `attention_reference` in float64 on the same bfloat16-rounded inputs."""
import pytest
import torch

from minivllm.attention.backend import AttentionMetadata
from minivllm.attention.backends.cpu_attn import (CPUPagedAttention, prefill_attention_grouped,
                                                  prefill_attention_sdpa)
from minivllm.model_executor.models.llama import attention_reference
from minivllm.attention.paged_attention import PagedAttention

# The fused kernel keeps scores, softmax and the weighted sum in float32 and rounds its output to
# bfloat16 once: at most half a bfloat16 spacing, up to 2^-8 of |output| (2^-9 where the output lies
# just below a power of two) <= 2^-8 of max |v|. The bound allows 2^-8 of max |v|: the rounding's worst
# case, with the float32 sums' error on top only where the output is below max |v|, as it nearly always
# is; about 1 in 18,000 random draws exceeds it, for torch's fused path and the AMX kernel alike. The
# cases here are fixed (seeded). (bfloat16 einsums, which round the scores and the probabilities, miss
# this bound by up to 6x on these cases.)
BF16_TOL = 2.0 ** -8

CASES = [(1, 1), (7, 7), (130, 130), (5, 40), (64, 200), (1, 50)]  # (Tq, Tk): no prefix, then a cached one


def qkv(tq, tk, heads, kv_heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(tq, heads, head_dim, generator=g, dtype=torch.float64)
    k = 2 * torch.randn(tk, kv_heads, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(tk, kv_heads, head_dim, generator=g, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("tq,tk", CASES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_sdpa_prefill_in_bfloat16_is_within_one_rounding_of_the_float64_reference(tq, tk, heads, kv_heads, head_dim):
    q, k, v = (x.bfloat16() for x in qkv(tq, tk, heads, kv_heads, head_dim))
    scale = head_dim ** -0.5
    ref = attention_reference(q.double(), k.double(), v.double(), scale)
    out = prefill_attention_sdpa(q, k, v, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (tq, heads, head_dim)
    err = (out.double() - ref).abs().max().item()
    assert err <= BF16_TOL * v.double().abs().max().item(), f"max error {err:.3g}"


@pytest.mark.parametrize("tq,tk", CASES)
def test_sdpa_prefill_in_float64_equals_the_reference(tq, tk):
    q, k, v = qkv(tq, tk, 9, 3, 64, seed=1)
    torch.testing.assert_close(prefill_attention_sdpa(q, k, v, 0.125), attention_reference(q, k, v, 0.125),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tq,tk", CASES)
def test_sdpa_prefill_in_float32_is_close_to_the_float64_reference(tq, tk):
    """float32 throughout: 1e-5 relative, as the grouped products below."""
    q, k, v = qkv(tq, tk, 9, 3, 64, seed=6)
    out = prefill_attention_sdpa(q.float(), k.float(), v.float(), 0.125)
    assert out.dtype == torch.float32 and out.shape == (tq, 9, 64)
    torch.testing.assert_close(out.double(), attention_reference(q, k, v, 0.125), rtol=1e-5, atol=1e-5)


def test_the_check_can_fail():
    """A mask aligned to the first key instead of the last (SDPA's own `is_causal` with Tq < Tk) is caught."""
    q, k, v = (x.bfloat16() for x in qkv(5, 40, 9, 3, 64))
    wrong = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                             is_causal=True, enable_gqa=True).transpose(0, 1)
    ref = attention_reference(q.double(), k.double(), v.double(), 64 ** -0.5)
    assert (wrong.double() - ref).abs().max().item() > BF16_TOL * v.double().abs().max().item()


@pytest.mark.parametrize("tq,tk", CASES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_grouped_prefill_in_float64_equals_the_reference(tq, tk, heads, kv_heads, chunk):
    q, k, v = qkv(tq, tk, heads, kv_heads, 40, seed=5)
    torch.testing.assert_close(prefill_attention_grouped(q, k, v, 0.2, chunk=chunk),
                               attention_reference(q, k, v, 0.2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tq,tk", CASES)
def test_grouped_prefill_in_float32_is_close_to_the_float64_reference(tq, tk):
    """float32 products and softmax: 1e-5 relative (scores of size ~30 carry ~2e-6 of rounding into exp)."""
    q, k, v = qkv(tq, tk, 9, 3, 64, seed=6)
    out = prefill_attention_grouped(q.float(), k.float(), v.float(), 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), attention_reference(q, k, v, 0.125), rtol=1e-5, atol=1e-5)


def test_grouped_prefill_mask_off_by_one_is_caught():
    """The check can fail: a chunk that lets each query see one key past its own position differs."""
    q, k, v = qkv(20, 30, 9, 3, 64, seed=7)
    ref = attention_reference(q, k, v, 0.125)
    leaky = torch.cat([attention_reference(q[i:i + 1], k[:min(30, 10 + i + 2)], v[:min(30, 10 + i + 2)], 0.125,
                                           causal=False) for i in range(20)])
    assert (leaky - ref).abs().max().item() > 1e-3
    assert (prefill_attention_grouped(q, k, v, 0.125, chunk=7) - ref).abs().max().item() < 1e-12


def metadata(lens_q: list[int], lens: list[int], block_size: int, num_blocks: int) -> AttentionMetadata:
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3))
    width = max(-(-n // block_size) for n in lens)
    tables = torch.stack([perm[i * width:(i + 1) * width] for i in range(len(lens))])
    cu = torch.tensor([0] + lens_q).cumsum(0)
    return AttentionMetadata(is_prefill=True, cu_seqlens_q=cu, context_lens=torch.tensor(lens), block_tables=tables,
                             slot_mapping=torch.cat([tables[i, torch.arange(n - m, n) // block_size] * block_size +
                                                     torch.arange(n - m, n) % block_size
                                                     for i, (m, n) in enumerate(zip(lens_q, lens))]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backend_prefill_over_a_cached_prefix(dtype):
    """The whole backend call: the new tokens of three sequences, two of them over a cached prefix read
    through shuffled block tables, through `prefill_attention_cpu` (the C++ kernel in float32 where the
    CPU has AVX-512, the AMX kernel in bfloat16 where it has AMX, torch's fused path otherwise): bfloat16
    within one rounding of plain torch
    in float64 on the same inputs; float32 within 1e-5 of plain torch in float32 (the same sums in
    another order)."""
    lens_q, lens, block_size, num_blocks = [6, 1, 33], [6, 20, 50], 16, 16
    md = metadata(lens_q, lens, block_size, num_blocks)
    q, k, v = qkv(sum(lens_q), sum(lens_q), 9, 3, 64, seed=2)
    cache = torch.randn(2, 1, num_blocks, block_size, 3, 64, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(4))
    q, k, v, cache = (x.to(dtype) for x in (q, k, v, cache))
    backend = CPUPagedAttention(cache.clone(), 0.125)
    backend.metadata = md
    out = backend(0, q, k, v)
    if dtype == torch.float32:
        plain = PagedAttention(cache.clone(), 0.125)
        plain.metadata = md
        torch.testing.assert_close(out, plain(0, q, k, v), rtol=1e-5, atol=1e-5)
    else:
        plain = PagedAttention(cache.double(), 0.125)
        plain.metadata = md
        ref = plain(0, q.double(), k.double(), v.double())
        err = (out.double() - ref).abs().max().item()
        assert err <= BF16_TOL * max(v.double().abs().max().item(), cache[1].double().abs().max().item()), \
            f"max error {err:.3g}"


def test_backend_through_steps_in_turn_equals_plain_torch():
    """One backend through a run's kinds of steps in turn, as the model runner drives it (two layers; each
    step's metadata a new object, the last one dropped first): a prefill with nothing cached, a prefill over
    the prefix it stored, a decode, then new sequences' prefill. Every layer's output equals plain torch's
    (float32, 1e-5: the same sums in another order) and so do the caches: what the backend keeps from one
    layer to the next (`keys_all_new`'s answer, the decode plan) must not leak into the next step. A kept
    answer of "nothing cached" would make the second step's attention skip its prefix."""
    block_size, num_blocks, layers = 16, 16, 2
    old, new = torch.tensor([[3, 7, 1, 9], [10, 2, 5, 12]]), torch.tensor([[0, 4, 6, 8], [11, 13, 14, 15]])
    steps = [(True, [6, 33], [6, 33], old), (True, [4, 17], [10, 50], old), (False, [1, 1], [11, 51], old),
             (True, [20, 3], [20, 3], new)]  # (is_prefill, new tokens, context lengths, block tables)
    g = torch.Generator().manual_seed(6)
    cache = torch.randn(2, layers, num_blocks, block_size, 3, 64, generator=g)
    backend, plain = CPUPagedAttention(cache.clone(), 0.125), PagedAttention(cache.clone(), 0.125)
    for is_prefill, lens_q, lens, tables in steps:
        cu = torch.tensor([0, *lens_q]).cumsum(0)
        slots = torch.cat([tables[i, (t := torch.arange(n - m, n)) // block_size] * block_size + t % block_size
                           for i, (m, n) in enumerate(zip(lens_q, lens))])
        context_lens = torch.tensor(lens)
        backend.metadata = plain.metadata = None  # the last step's metadata is freed (its memory often reused)
        backend.metadata = plain.metadata = AttentionMetadata(is_prefill, cu, context_lens, slots, tables)
        for layer in range(layers):
            q, k, v = (torch.randn(int(cu[-1]), heads, 64, generator=g) for heads in (9, 3, 3))
            torch.testing.assert_close(backend(layer, q, k, v), plain(layer, q, k, v), rtol=1e-5, atol=1e-5)
        assert torch.equal(backend.kv_cache, plain.kv_cache)

# The C++ prefill kernel (chapter 05's appendix): float32, FlashAttention-2's tiles of six query rows
# (a K/V head's query heads at consecutive tokens) over blocks of 64 keys (4 AVX-512 vectors, 8 AVX2 ones). It is
# called here directly from the library, which builds its function on every machine; the backend uses it
# where the CPU has AVX-512 or AVX2 (`cpu_prefill_kernel`). Same tolerance as the other float32 paths
# above: float32 scores, exp and sums, in another order than the reference's. Not covered on a given
# machine: the other vector width's build (AVX-512's on an AVX2 CPU, and the reverse), and, in the decode
# kernel's tests, whichever bfloat16 score path this CPU does not take (vdpbf16ps or widening).
@pytest.fixture
def prefill_kernel():
    from engine_helpers import require_cpu_kernel
    from minivllm.attention.backends.cpu_attn import DECODE_KERNEL
    from minivllm.model_executor.cpp_extension import load_extension

    require_cpu_kernel()
    return load_extension(DECODE_KERNEL).prefill_attention


LONG_CASES = [*CASES, (32, 32), (33, 33), (64, 64), (65, 65), (200, 200), (70, 333)]  # one, two, several blocks


@pytest.mark.parametrize("tq,tk", LONG_CASES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3), (8, 1), (16, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_kernel_is_close_to_the_float64_reference(prefill_kernel, tq, tk, heads, kv_heads, head_dim):
    q, k, v = qkv(tq, tk, heads, kv_heads, head_dim, seed=8)
    scale = head_dim ** -0.5
    out = prefill_kernel(q.float(), k.float(), v.float(), scale)
    assert out.dtype == torch.float32 and out.shape == (tq, heads, head_dim)
    # 1e-5 per 64 products in a score: a score's float32 rounding grows with the products it sums (torch's
    # fused path and the grouped products reach 1.2e-5 on some of these head_dim-128 cases, as this kernel)
    tol = 1e-5 * head_dim / 64
    torch.testing.assert_close(out.double(), attention_reference(q, k, v, scale), rtol=tol, atol=tol)


@pytest.mark.parametrize("spread", [1.0, 30.0])
def test_prefill_kernel_over_a_wide_score_range_errs_no_more_than_torch(prefill_kernel, spread):
    """Scores that span far more than exp's range (q and k scaled up: most probabilities underflow, a few
    carry the sums): finite, and within twice torch's fused float32 error of the float64 reference (the
    error grows with the scores' size, in both)."""
    q, k, v = qkv(70, 333, 9, 3, 64, seed=11)
    q, k = q * spread, k * spread
    ref = attention_reference(q, k, v, 0.125)
    out = prefill_kernel(q.float(), k.float(), v.float(), 0.125).double()
    torch_err = (prefill_attention_sdpa(q.float(), k.float(), v.float(), 0.125).double() - ref).abs().max().item()
    assert out.isfinite().all()
    assert (out - ref).abs().max().item() <= 2 * torch_err + 1e-6


def test_prefill_kernel_masks_each_row_at_its_own_token(prefill_kernel):
    """The check can fail: without the causal mask, or with each row seeing one key more, the outputs differ
    by far more than the tolerance; the kernel matches neither."""
    q, k, v = qkv(70, 333, 9, 3, 64, seed=9)
    out = prefill_kernel(q.float(), k.float(), v.float(), 0.125).double()
    ref = attention_reference(q, k, v, 0.125)
    unmasked = attention_reference(q, k, v, 0.125, causal=False)
    one_more = torch.cat([attention_reference(q[i:i + 1], k[:264 + i + 1], v[:264 + i + 1], 0.125) for i in range(69)])
    assert (out - ref).abs().max() < 1e-5
    assert (out - unmasked).abs().max() > 1e-2 and (out[:69] - one_more).abs().max() > 1e-3


def same_bits_on_threads_and_views(kernel, dtype: torch.dtype) -> None:
    """`kernel`'s output on a 100-token prompt (9 query heads over 3 K/V heads of 64) is bit for bit the same
    on 1, 2 and 3 threads, and for q, k, v given as the strided views of one fused q/k/v projection."""
    q, k, v = (x.to(dtype) for x in qkv(100, 100, 9, 3, 64, seed=10))
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)  # [T, (9 + 3 + 3) * 64]
    qv, kv, vv = (fused[:, a * 64:b * 64].view(100, b - a, 64) for a, b in ((0, 9), (9, 12), (12, 15)))
    assert not kv.is_contiguous()
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(kernel(q, k, v, 0.125))
        outs.append(kernel(qv, kv, vv, 0.125))
    finally:
        torch.set_num_threads(before)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_prefill_kernel_rows_do_not_depend_on_threads_or_strides(prefill_kernel):
    """Each tile is one thread's, in a fixed order: the same bits on any number of threads and for strided
    views."""
    same_bits_on_threads_and_views(prefill_kernel, torch.float32)


def test_prefill_kernel_refuses_bad_input_with_a_clear_error(prefill_kernel):
    q, k, v = (x.float() for x in qkv(5, 40, 9, 3, 64))
    cases = {
        "takes float32": (q.double(), k.double(), v.double()),
        "head_dim 64 or 128": (q[..., :40], k[..., :40], v[..., :40]),
        "multiple of num_kv_heads": (q[:, :8], k, v),
        "at least Tq": (q, k[:4], v[:4]),
        "k, v both": (q, k, v[:, :2]),
        "CPU tensors": (q, k, torch.empty(40, 3, 64, device="meta")),
    }
    for message, args in cases.items():
        with pytest.raises(ValueError, match=message):
            prefill_kernel(*args, 0.125)
    assert prefill_kernel(q[:0], k, v, 0.125).shape == (0, 9, 64)


def test_the_backend_takes_the_kernel_for_float32_only(prefill_kernel, monkeypatch):
    """`prefill_attention_cpu` calls the kernel for float32 with head_dim 64 or 128 where it is available
    (`cpu_prefill_kernel`), and torch's fused path for every other dtype and head_dim."""
    import minivllm.attention.backends.cpu_attn as cd

    calls = []
    monkeypatch.setattr(cd, "cpu_prefill_kernel", lambda: (lambda *a: calls.append(a[0].dtype) or prefill_kernel(*a)))
    for dtype, head_dim in ((torch.float32, 64), (torch.float32, 128), (torch.bfloat16, 64), (torch.float64, 64),
                            (torch.float32, 40)):
        q, k, v = (x.to(dtype) for x in qkv(7, 20, 4, 2, head_dim))
        out = cd.prefill_attention_cpu(q, k, v, 0.25)
        torch.testing.assert_close(out.double(), attention_reference(q.double(), k.double(), v.double(), 0.25),
                                   rtol=1e-5 if dtype != torch.bfloat16 else 0, atol=1e-5 if dtype != torch.bfloat16
                                   else BF16_TOL * v.double().abs().max().item())
    assert calls == [torch.float32, torch.float32]
    monkeypatch.setattr(cd, "cpu_prefill_kernel", lambda: None)  # neither AVX-512 nor AVX2: torch's fused path
    q, k, v = (x.float() for x in qkv(7, 20, 4, 2, 64))
    torch.testing.assert_close(cd.prefill_attention_cpu(q, k, v, 0.25), prefill_attention_sdpa(q, k, v, 0.25))


def test_the_kernel_is_taken_as_its_build_says_whatever_torchs_dispatch_level(prefill_kernel, tmp_path):
    """`cpu_prefill_kernel` asks the library which vector width it was built for (`kernel_isa`, the same answer
    as chapter 02's GEMM library gives), not torch's dispatch level: with `ATEN_CPU_CAPABILITY=default`, which
    turns torch's own vector kernels off, an AVX-512 or AVX2 build is still taken."""
    import os
    import subprocess
    import sys

    from minivllm.attention.backends.cpu_attn import DECODE_KERNEL, cpu_prefill_kernel
    from minivllm.model_executor.cpp_extension import load_extension
    from minivllm.model_executor.layers.cpu_gemm import CPU_GEMM

    isa = load_extension(DECODE_KERNEL).kernel_isa()
    gemm = load_extension(CPU_GEMM)
    assert gemm is None or gemm.kernel_isa() == isa
    assert (cpu_prefill_kernel() is not None) == (isa in ("avx512", "avx2"))
    code = ("import torch; from minivllm.attention.backends.cpu_attn import cpu_prefill_kernel; "
            "print(torch.backends.cpu.get_cpu_capability(), cpu_prefill_kernel() is not None)")
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-2:] == ["DEFAULT", str(isa in ("avx512", "avx2"))]


def test_the_engine_with_the_prefill_kernel_gives_the_same_greedy_tokens(prefill_kernel, monkeypatch, tmp_path):
    """A tiny Qwen3 with head_dim 64, float32, `CPUPagedAttention`: greedy tokens with the kernel's batch form
    in prefill (the backend's default), with the one-sequence kernel, and with torch's fused path are the same
    (prompts of 5 to 130 tokens: one to three blocks of keys)."""
    import minivllm.attention.backends.cpu_attn as cd
    from engine_helpers import make_model, run_engine
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sampling_params import SamplingParams

    make_model(tmp_path, "qwen3", head_dim=64)
    prompts = [[3 + i % 120 for i in range(n)] for n in (5, 17, 40, 130)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batch_form = cd.cpu_prefill_varlen_kernel(torch.float32)
    calls, outs = {"batch": 0, "per sequence": 0}, {}
    count = lambda name, fn: lambda *a: calls.__setitem__(name, calls[name] + 1) or fn(*a)  # noqa: E731
    for name, batch, one in (("batch", count("batch", batch_form), prefill_kernel),
                             ("per sequence", None, count("per sequence", prefill_kernel)), ("torch", None, None)):
        monkeypatch.setattr(cd, "cpu_prefill_varlen_kernel", lambda dtype, batch=batch: batch)
        monkeypatch.setattr(cd, "cpu_prefill_kernel", lambda one=one: one)
        engine = LLMEngine(model=str(tmp_path), dtype="float32", num_kvcache_blocks=64,
                           attention_backend=cd.CPUPagedAttention)
        outs[name] = [o.outputs[0].token_ids for o in run_engine(engine, prompts, params)]
    assert calls["batch"] and calls["per sequence"]
    assert outs["batch"] == outs["per sequence"] == outs["torch"]


def test_prefill_kernel_over_a_wide_score_range_and_a_nan_in_a_later_key(prefill_kernel):
    """The online softmax across blocks of 64 keys when the running max jumps by hundreds (the first block's
    keys scaled by -20, the second's by +20: rescale factors underflow to 0, most numerators to the clamp at
    exp(-87)), against float64 on the same float32 inputs. The error of float32 scores grows with their size,
    so the bound is 16 float32 ulps of the largest |score| (the kernel and torch's fused path reach ~4). Then a
    NaN in key 150: rows that may not see it (tokens 0..19, offset 130) stay finite and as before, as in the
    reference (a hidden score and its numerator are replaced, not added to: a kernel that masks by adding
    -inf and takes exp of every lane fails here); rows that see it are NaN."""
    q, k, v = (x.float() for x in qkv(70, 200, 9, 3, 128, seed=12))
    k[:64] *= -20
    k[64:128] *= 20
    for scale in (128 ** -0.5, 2.0):
        ref = attention_reference(q.double(), k.double(), v.double(), scale)
        scores = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(3, 1)) * scale
        out = prefill_kernel(q, k, v, scale).double()
        assert (out - ref).abs().max().item() <= 16 * 2.0 ** -24 * scores.abs().max().item()
    before = prefill_kernel(q, k, v, 0.125)
    k[150, 1, 7] = float("nan")
    out = prefill_kernel(q, k, v, 0.125)
    ref = attention_reference(q.double(), k.double(), v.double(), 0.125)
    assert torch.equal(out[:20], before[:20]) and torch.isfinite(ref[:20]).all()
    assert out[20:, 3:6].isnan().all() and ref[20:, 3:6].isnan().all() and torch.isfinite(out[20:, :3]).all()


# The bfloat16 prefill kernel on AMX tiles (chapter 05's appendix): the same walk in tiles of 16 query rows
# and blocks of 32 keys, S = Q K^T and P V by tdpbf16ps, the softmax in float32 with a cubic 2**x, the
# probabilities rounded to bfloat16 before P V. The bound is the one torch's fused bfloat16 path meets above
# (2**-8 of max |v|: the output's own rounding is half of it); on the wide score ranges, twice torch's error.
@pytest.fixture
def amx_prefill():
    from engine_helpers import cpu_has_amx, require_built, require_cpu_kernel
    from minivllm.attention.backends.cpu_attn import DECODE_KERNEL, cpu_amx_prefill_kernel
    from minivllm.model_executor.cpp_extension import load_extension

    require_cpu_kernel()
    module = load_extension(DECODE_KERNEL)
    if not module.amx_available():
        assert cpu_amx_prefill_kernel() is None  # built, not used
        if cpu_has_amx():  # the compiler could not target AMX, or Linux refused the tile state
            require_built(None, "the AMX prefill kernel on this AMX CPU")  # fails under CI, else skips
        pytest.skip("this CPU has no AMX: bfloat16 prefill stays on torch's fused path")
    return module.prefill_attention_amx


@pytest.mark.parametrize("tq,tk", [*LONG_CASES, (31, 31), (33, 47), (16, 16)])  # blocks of 16 and 32 keys, ragged
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3), (8, 1), (16, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_amx_prefill_is_within_one_rounding_of_the_float64_reference(amx_prefill, tq, tk, heads, kv_heads, head_dim):
    q, k, v = (x.bfloat16() for x in qkv(tq, tk, heads, kv_heads, head_dim, seed=13))
    scale = head_dim ** -0.5
    out = amx_prefill(q, k, v, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (tq, heads, head_dim)
    err = (out.double() - attention_reference(q.double(), k.double(), v.double(), scale)).abs().max().item()
    assert err <= BF16_TOL * v.double().abs().max().item(), f"max error {err:.3g}"


@pytest.mark.parametrize("spread", [1.0, 30.0])
def test_amx_prefill_over_a_wide_score_range_errs_no_more_than_torch(amx_prefill, spread):
    """Scores spanning far more than exp's range: finite, and within twice the error of torch's fused bfloat16
    path on the same inputs (a float32 score of size s carries s * 2**-24 of error in both, and the cubic
    2**x adds about 1e-4 relative to a probability, below bfloat16's rounding of it)."""
    q, k, v = (x.bfloat16() for x in qkv(70, 333, 9, 3, 64, seed=11))
    q, k = (x * spread for x in (q, k))
    ref = attention_reference(q.double(), k.double(), v.double(), 0.125)
    out = amx_prefill(q, k, v, 0.125).double()
    torch_err = (prefill_attention_sdpa(q, k, v, 0.125).double() - ref).abs().max().item()
    assert out.isfinite().all()
    assert (out - ref).abs().max().item() <= 2 * torch_err + 1e-6


@pytest.mark.parametrize("step", [0.5, 3.0, 12.0, 40.0])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_amx_prefill_as_the_scores_climb_block_after_block(amx_prefill, step, head_dim):
    """The AMX tile moves a row's reference max only when a score rises more than 8 above it in base 2 (then
    the row's sums, in tiles for head_dim 64, are rescaled). Here every query's scores climb by `step` (in base
    2) from one block of 32 keys to the next: by 0.5, no block after the first moves the reference and the
    probabilities grow to 2**7; by 3, every third block does; by 12 and 40, every block does. Within one
    bfloat16 rounding of float64, as for random scores. A tile that misapplied a rescale is off by far more;
    one that never moved the reference is caught by the climb of 40 only (2**40 per block overflows float32
    within the 7 blocks; by 12 the sums reach only 2**72, which float32 holds, and any reference gives the
    same quotient): both checked by breaking the kernel."""
    tq = tk = 200
    g = torch.Generator().manual_seed(17)
    q = torch.zeros(tq, 9, head_dim, dtype=torch.float64)
    q[..., 0] = 1.0
    k = 0.1 * torch.randn(tk, 3, head_dim, generator=g, dtype=torch.float64)
    scale = head_dim ** -0.5
    k[..., 0] = (torch.arange(tk) // 32 * step / (scale * 1.4426950408889634)).double()[:, None]  # scores in base 2
    v = torch.randn(tk, 3, head_dim, generator=g, dtype=torch.float64)
    q, k, v = (x.bfloat16() for x in (q, k, v))
    out = amx_prefill(q, k, v, scale).double()
    ref = attention_reference(q.double(), k.double(), v.double(), scale)
    err = (out - ref).abs().max().item()
    assert err <= BF16_TOL * v.double().abs().max().item(), f"max error {err:.3g}"


def test_amx_prefill_masks_each_row_at_its_own_token(amx_prefill):
    """The check can fail: without the causal mask, or with each row seeing one key more, the outputs differ by
    far more than the tolerance; the kernel matches neither."""
    q, k, v = (x.bfloat16().double() for x in qkv(70, 333, 9, 3, 64, seed=9))
    out = amx_prefill(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.125).double()
    tol = BF16_TOL * v.abs().max().item()
    ref = attention_reference(q, k, v, 0.125)
    unmasked = attention_reference(q, k, v, 0.125, causal=False)
    one_more = torch.cat([attention_reference(q[i:i + 1], k[:264 + i + 1], v[:264 + i + 1], 0.125) for i in range(69)])
    assert (out - ref).abs().max() <= tol
    assert (out - unmasked).abs().max() > 4 * tol and (out[:69] - one_more).abs().max() > 4 * tol


def test_amx_prefill_rows_do_not_depend_on_threads_or_strides(amx_prefill):
    """The same bits on any number of threads (each configures its own tiles), and for the strided views of a
    fused q/k/v projection (K's words gathered, V's rows read where they lie)."""
    same_bits_on_threads_and_views(amx_prefill, torch.bfloat16)


def test_amx_prefill_refuses_bad_input_with_a_clear_error(amx_prefill):
    q, k, v = (x.bfloat16() for x in qkv(5, 40, 9, 3, 64))
    cases = {
        "takes bfloat16": (q.float(), k.float(), v.float()),
        "head_dim 64 or 128": (q[..., :40], k[..., :40], v[..., :40]),
        "multiple of num_kv_heads": (q[:, :8], k, v),
        "at least Tq": (q, k[:4], v[:4]),
        "k, v both": (q, k, v[:, :2]),
        "CPU tensors": (q, k, torch.empty(40, 3, 64, device="meta", dtype=torch.bfloat16)),
    }
    for message, args in cases.items():
        with pytest.raises(ValueError, match=message):
            amx_prefill(*args, 0.125)
    assert amx_prefill(q[:0], k, v, 0.125).shape == (0, 9, 64)


def test_amx_prefill_with_a_nan_in_a_later_key(amx_prefill):
    """Across blocks of 32 keys with the running max jumping by hundreds (the first 32 keys scaled by -20, the
    next 32 by +20), within twice torch's fused error; then a NaN in key 150: rows that may not see it (tokens
    0..19, offset 130) stay finite and as before; rows that see it are NaN, as in the reference (the clamp of
    2**x keeps a NaN: a max that dropped it would turn the row finite)."""
    q, k, v = (x.bfloat16() for x in qkv(70, 200, 9, 3, 128, seed=12))
    k[:32] *= -20
    k[32:64] *= 20
    ref = attention_reference(q.double(), k.double(), v.double(), 0.125)
    torch_err = (prefill_attention_sdpa(q, k, v, 0.125).double() - ref).abs().max().item()
    before = amx_prefill(q, k, v, 0.125)
    assert (before.double() - ref).abs().max().item() <= 2 * torch_err + 1e-6
    k[150, 1, 7] = float("nan")
    out = amx_prefill(q, k, v, 0.125)
    ref = attention_reference(q.double(), k.double(), v.double(), 0.125)
    assert torch.equal(out[:20], before[:20]) and torch.isfinite(ref[:20]).all()
    assert out[20:, 3:6].isnan().all() and ref[20:, 3:6].isnan().all() and torch.isfinite(out[20:, :3]).all()


def test_the_backend_takes_the_amx_kernel_for_bfloat16(amx_prefill, monkeypatch):
    """`prefill_attention_cpu` calls the AMX kernel for bfloat16 with head_dim 64 or 128 where it is available
    (`cpu_amx_prefill_kernel`), torch's fused path for bfloat16 with another head_dim or without the kernel."""
    import minivllm.attention.backends.cpu_attn as cd

    calls = []
    monkeypatch.setattr(cd, "cpu_amx_prefill_kernel", lambda: (lambda *a: calls.append(a[0].shape[-1]) or amx_prefill(*a)))
    for head_dim in (64, 128, 40):
        q, k, v = (x.bfloat16() for x in qkv(7, 20, 4, 2, head_dim))
        out = cd.prefill_attention_cpu(q, k, v, 0.25)
        ref = attention_reference(q.double(), k.double(), v.double(), 0.25)
        assert (out.double() - ref).abs().max().item() <= BF16_TOL * v.double().abs().max().item()
    assert calls == [64, 128]
    monkeypatch.setattr(cd, "cpu_amx_prefill_kernel", lambda: None)
    q, k, v = (x.bfloat16() for x in qkv(7, 20, 4, 2, 64))
    assert torch.equal(cd.prefill_attention_cpu(q, k, v, 0.25), prefill_attention_sdpa(q, k, v, 0.25))


@pytest.mark.parametrize("overflowed", [32, 40, 64])
def test_amx_prefill_when_a_whole_block_of_scores_overflows_to_minus_inf(amx_prefill, overflowed):
    """Finite inputs whose float32 scores overflow to -inf for the first `overflowed` keys (q·k about -1e40):
    a row whose first block of 32 keys holds only such scores has a running max of -inf there, and 2**(x - max)
    is then 2**(-inf + inf) = NaN unless the kernel takes the max as 0 (it did not: every row came out NaN).
    Rows that see a finite score match the float64 reference (those keys weigh nothing); rows that see none
    give torch's fused path's answer, 0, whichever rows share their tile (found by a tester)."""
    q, k, v = (x.bfloat16() for x in qkv(40, 70, 4, 2, 64, seed=5))
    q[:, :, 0] = 1e20
    k[:, :, 0] = 0
    k[:overflowed, :, 0] = -1e20
    ref = attention_reference(q.double(), k.double(), v.double(), 0.125)
    out = amx_prefill(q, k, v, 0.125).double()
    assert ref.isfinite().all() and not out.isnan().any()
    sees_finite = torch.arange(40) + 30 >= overflowed
    assert (out - ref)[sees_finite].abs().max().item() <= BF16_TOL * v.double().abs().max().item()
    blind = ~sees_finite
    assert torch.equal(out[blind], prefill_attention_sdpa(q, k, v, 0.125).double()[blind])


@pytest.mark.parametrize("overflowed", [64, 70, 100])
def test_prefill_kernel_when_a_whole_block_of_scores_overflows_to_minus_inf(prefill_kernel, overflowed):
    """The float32 kernel on the AMX kernel's case above, with its blocks of 64 keys: float32 scores that
    overflow to -inf for the first `overflowed` keys (finite inputs) made every row NaN (a running max of -inf);
    now rows that see a finite score match the float64 reference within the float32 tolerance, and rows that
    see none give torch's fused float32 path's answer, 0."""
    q, k, v = (x.float() for x in qkv(40, 100, 4, 2, 64, seed=5))
    q[:, :, 0] = 1e20
    k[:, :, 0] = 0
    k[:overflowed, :, 0] = -1e20
    ref = attention_reference(q.double(), k.double(), v.double(), 0.125)
    out = prefill_kernel(q, k, v, 0.125).double()
    assert ref.isfinite().all() and not out.isnan().any()
    sees_finite = torch.arange(40) + 60 >= overflowed
    torch.testing.assert_close(out[sees_finite], ref[sees_finite], rtol=1e-5, atol=1e-5)
    blind = ~sees_finite
    assert blind.any() and torch.equal(out[blind], prefill_attention_sdpa(q, k, v, 0.125).double()[blind])


@pytest.mark.parametrize("layout", ["sparse", "mkldnn"])
def test_amx_prefill_refuses_a_sparse_or_mkldnn_tensor_with_a_value_error(amx_prefill, layout):
    """A sparse or mkldnn q, k or v is refused up front with a ValueError that names the layout (before: a
    RuntimeError or NotImplementedError from deep inside, "unsupported memory format option Contiguous" or
    "Cannot access data pointer"; found by a tester)."""
    q, k, v = (x.bfloat16() for x in qkv(5, 40, 9, 3, 64))
    for i in range(3):
        args = [q, k, v]
        args[i] = args[i].to_sparse() if layout == "sparse" else args[i].to_mkldnn()
        with pytest.raises(ValueError, match="dense"):
            amx_prefill(*args, 0.125)


def test_amx_prefill_with_a_token_stride_of_k_past_int32_offsets(amx_prefill):
    """A k whose token stride is 2**29 elements (a view into 9 GiB of address space, 10 rows touched): when K's
    words were gathered 16 keys at a time with int32 offsets of lane * token stride, lane 8's offset passed
    2**31 and the gather read outside the tensor (the process died of a segmentation fault; found by a
    tester). K's rows are now loaded one by one at their own addresses; the output equals that of a
    contiguous copy."""
    tk, stride = 10, 2 ** 29
    try:
        store = torch.empty((tk - 1) * stride + 64, dtype=torch.bfloat16)  # untouched pages take no memory
    except RuntimeError:
        pytest.skip("no 9 GiB of address space for the strided view")
    q, k, v = (x.bfloat16() for x in qkv(3, tk, 2, 1, 64, seed=14))
    k_far = store.as_strided((tk, 1, 64), (stride, 64, 1))
    k_far.copy_(k)
    assert torch.equal(amx_prefill(q, k_far, v, 0.125), amx_prefill(q, k, v, 0.125))


# The batch form of both kernels (`prefill_attention_varlen`, `prefill_attention_amx_varlen`; the backend's
# `CPUPagedAttention.prefill`): the sequences of a step laid end to end with their prefix sums, as
# FlashAttention's varlen functions take them. Each tile is the one-sequence kernel's, so the oracle is that
# kernel, bit for bit (itself checked against float64 above).
VARLEN_BATCH = [(40, 40), (1, 1), (0, 5), (130, 130), (5, 70), (17, 17), (64, 200), (3, 3)]  # (Tq, Tk), cached prefixes


def varlen_inputs(dtype, head_dim=64, batch=VARLEN_BATCH):
    """q, k, v of `batch`'s sequences laid end to end, as strided views of one fused projection each (q's rows
    and k's rows), and their int64 prefix sums."""
    tq, tk = sum(a for a, _ in batch), sum(b for _, b in batch)
    g = torch.Generator().manual_seed(21)
    q = torch.randn(tq, 15, head_dim, generator=g).to(dtype)[:, :9]
    kv = torch.randn(tk, 15, head_dim, generator=g).to(dtype)
    cu_q = torch.tensor([0] + [a for a, _ in batch]).cumsum(0)
    cu_k = torch.tensor([0] + [b for _, b in batch]).cumsum(0)
    return q, kv[:, 9:12], kv[:, 12:], cu_q, cu_k


@pytest.fixture(params=["float32", "bfloat16"])
def one_and_batch(request):
    """(dtype, the one-sequence kernel, its batch form)."""
    from minivllm.attention.backends.cpu_attn import DECODE_KERNEL
    from minivllm.model_executor.cpp_extension import load_extension

    if request.param == "float32":
        kernel = request.getfixturevalue("prefill_kernel")
        return torch.float32, kernel, load_extension(DECODE_KERNEL).prefill_attention_varlen
    kernel = request.getfixturevalue("amx_prefill")
    return torch.bfloat16, kernel, load_extension(DECODE_KERNEL).prefill_attention_amx_varlen


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_batch_form_gives_the_one_sequence_kernels_bits(one_and_batch, head_dim):
    """A batch of eight sequences (one with no new token, three over a cached prefix) in one call equals the
    one-sequence kernel called on each, bit for bit, on 1, 2 and 3 threads; and a one-row error in the prefix
    sums (a sequence's last query given to the next) changes the output."""
    dtype, one, batch = one_and_batch
    q, k, v, cu_q, cu_k = varlen_inputs(dtype, head_dim)
    a, b = cu_q.tolist(), cu_k.tolist()
    expected = torch.cat([one(q[a[i]:a[i + 1]], k[b[i]:b[i + 1]], v[b[i]:b[i + 1]], 0.125) for i in range(len(a) - 1)])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = batch(q, k, v, cu_q, cu_k, 0.125)
            assert out.dtype == dtype and out.shape == q.shape and torch.equal(out, expected), threads
    finally:
        torch.set_num_threads(before)
    shifted = cu_q.clone()
    shifted[4] -= 1  # the 130-token sequence's last query now belongs to the next one (5 queries over 70 keys)
    assert not torch.equal(batch(q, k, v, shifted, cu_k, 0.125), expected)


@pytest.mark.parametrize("lens,cached,heads,kv_heads", [((64, 64), 0, 9, 3), ((64,), 0, 4, 2), ((60, 20, 30), 10, 9, 3),
                                                         ((64,), 10, 9, 3)])
def test_the_batch_form_gives_the_same_bits_however_its_work_is_dealt(one_and_batch, lens, cached, heads, kv_heads):
    """On two threads the batch form deals its work one of three ways (chapter 05): whole sequences to the
    threads (two equal sequences), a sequence's K/V heads one by one (one sequence with two K/V heads; three
    sequences of 60, 20 and 30 new tokens, the last over `cached` keys before them), or, where neither splits
    evenly, the keys packed in a pass of their own and the tiles dealt one by one (one sequence with three K/V
    heads). Every way, the end-to-end and the paged form give the one-sequence kernel's bits."""
    from minivllm.attention.backends.cpu_attn import DECODE_KERNEL
    from minivllm.model_executor.cpp_extension import load_extension

    dtype, one, batch = one_and_batch
    module = load_extension(DECODE_KERNEL)
    paged = module.prefill_attention_paged if dtype == torch.float32 else module.prefill_attention_amx_paged
    g = torch.Generator().manual_seed(5)
    keys = [*lens[:-1], lens[-1] + cached]
    cu_q, cu_k = (torch.tensor([0, *lengths]).cumsum(0) for lengths in (lens, keys))
    q = torch.randn(int(cu_q[-1]), heads, 64, generator=g).to(dtype)
    k, v = (torch.randn(int(cu_k[-1]), kv_heads, 64, generator=g).to(dtype) for _ in range(2))
    a, b = cu_q.tolist(), cu_k.tolist()
    k_cache, v_cache, context_lens, tables = paged_copy(k, v, cu_k, 16)
    before = torch.get_num_threads()
    try:
        # the reference: one sequence at a time on more threads than its K/V heads, so always the third way
        torch.set_num_threads(kv_heads + 1)
        expected = torch.cat([one(q[a[i]:a[i + 1]], k[b[i]:b[i + 1]], v[b[i]:b[i + 1]], 0.125)
                              for i in range(len(lens))])
        torch.set_num_threads(2)
        assert torch.equal(batch(q, k, v, cu_q, cu_k, 0.125), expected)
        assert torch.equal(paged(q, k_cache, v_cache, cu_q, context_lens, tables, 0.125), expected)
    finally:
        torch.set_num_threads(before)


def paged_copy(k, v, cu_k, block_size, seed=3):
    """k, v (sequences end to end at `cu_k`) stored in a paged cache the way the engine stores them: each
    sequence's tokens in its own blocks, taken in a shuffled order from a pool with room to spare. Returns
    (k_cache, v_cache, context_lens, block_tables)."""
    lens = (cu_k[1:] - cu_k[:-1]).tolist()
    need = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(need) + 7
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    k_cache = torch.zeros(num_blocks, block_size, *k.shape[1:], dtype=k.dtype)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.full((len(lens), max(need) + 2), -1, dtype=torch.long)
    for i, n in enumerate(lens):
        ids, order = order[:need[i]], order[need[i]:]
        tables[i, :need[i]] = torch.tensor(ids, dtype=torch.long)
        for t in range(n):
            k_cache[ids[t // block_size], t % block_size] = k[cu_k[i] + t]
            v_cache[ids[t // block_size], t % block_size] = v[cu_k[i] + t]
    return k_cache, v_cache, torch.tensor(lens), tables


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_the_paged_form_gives_the_batch_forms_bits(one_and_batch, head_dim, block_size):
    """The batch form over a paged cache (keys read through the block tables, as the backend calls it when
    some sequence has cached tokens) equals the batch form over the same keys laid end to end, bit for bit,
    on 1 and 2 threads; a block table that points one block at another sequence's changes the output (the
    check can fail; swapping two of a sequence's own blocks would not, where every query sees both)."""
    from minivllm.attention.backends.cpu_attn import DECODE_KERNEL
    from minivllm.model_executor.cpp_extension import load_extension

    dtype, _, batch = one_and_batch
    module = load_extension(DECODE_KERNEL)
    paged = module.prefill_attention_paged if dtype == torch.float32 else module.prefill_attention_amx_paged
    q, k, v, cu_q, cu_k = varlen_inputs(dtype, head_dim)
    k_cache, v_cache, lens, tables = paged_copy(k, v, cu_k, block_size)
    expected = batch(q, k, v, cu_q, cu_k, 0.125)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(paged(q, k_cache, v_cache, cu_q, lens, tables, 0.125), expected), threads
    finally:
        torch.set_num_threads(before)
    wrong = tables.clone()
    wrong[6, 0] = tables[0, 0]  # the 200-key sequence's first block: the 40-token sequence's
    assert not torch.equal(paged(q, k_cache, v_cache, cu_q, lens, wrong, 0.125), expected)


def test_the_paged_form_refuses_bad_tables_with_a_clear_error(one_and_batch):
    from minivllm.attention.backends.cpu_attn import DECODE_KERNEL
    from minivllm.model_executor.cpp_extension import load_extension

    dtype, _, _ = one_and_batch
    module = load_extension(DECODE_KERNEL)
    paged = module.prefill_attention_paged if dtype == torch.float32 else module.prefill_attention_amx_paged
    q, k, v, cu_q, cu_k = varlen_inputs(dtype)
    k_cache, v_cache, lens, tables = paged_copy(k, v, cu_k, 16)
    outside, last_outside, last_padding = tables.clone(), tables.clone(), tables.clone()
    outside[6, 2] = k_cache.shape[0]
    last_outside[6, 12] = 10 ** 12  # the 200-key sequence's last block, 8 of its 16 slots read
    last_padding[6, 12] = -1
    short, huge = lens.clone(), lens.clone()
    short[6] = tables.shape[1] * 16 + 1
    huge[6] = 2 ** 63 - 1  # rounded up to whole blocks, it would wrap around
    halves = (x.view(-1, 8, 3, k.shape[-1]) for x in (k_cache, v_cache))  # the same cache in blocks of 8
    cases = {
        "multiple of 16": (q, *halves, cu_q, lens, tables),
        "not a block of the cache": (q, k_cache, v_cache, cu_q, lens, outside),
        "12\\] = 1000000000000 is not a block": (q, k_cache, v_cache, cu_q, lens, last_outside),
        "12\\] = -1 is not a block": (q, k_cache, v_cache, cu_q, lens, last_padding),
        "does not fit its": (q, k_cache, v_cache, cu_q, short, tables),
        "= 9223372036854775807 does not fit": (q, k_cache, v_cache, cu_q, huge, tables),
        "int64 CPU tensors": (q, k_cache, v_cache, cu_q, lens.int(), tables),
        "at least Tq": (q, k_cache, v_cache, cu_q, torch.where(lens == 130, 129, lens), tables),
    }
    for message, args in cases.items():
        with pytest.raises(ValueError, match=message):
            paged(*args, 0.125)


def test_the_batch_form_refuses_bad_prefix_sums(one_and_batch):
    dtype, _, batch = one_and_batch
    q, k, v, cu_q, cu_k = varlen_inputs(dtype)
    bad_end, bad_start, decreasing, short = cu_q.clone(), cu_q.clone(), cu_q.clone(), cu_k.clone()
    bad_end[-1] -= 1
    bad_start[0] = 1
    decreasing[2] = cu_q[1] - 1  # the second sequence ends before it starts
    short[5] = short[4] + 1  # the sequence of 5 queries given 1 key (and the next one 4 more)
    cases = {
        "end at q's rows .* and cu_seqlens_k at k's": (bad_end, cu_k),
        "start at 0": (bad_start, cu_k),
        "must not decrease": (decreasing, cu_k),
        "sequence 4 has 5 queries but 1 keys": (cu_q, short),
        "must be int64 CPU tensors": (cu_q.int(), cu_k.int()),
        "both be \\[num_seqs \\+ 1\\]": (cu_q, cu_k[:-1]),
    }
    for message, (cq, ck) in cases.items():
        with pytest.raises(ValueError, match=message):
            batch(q, k, v, cq, ck, 0.125)
    empty = torch.zeros(1, dtype=torch.int64)
    assert batch(q[:0], k[:0], v[:0], empty, empty, 0.125).shape == (0, 9, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backend_prefills_a_batch_in_one_call_with_the_same_bits(dtype, monkeypatch):
    """`CPUPagedAttention.prefill` calls the batch form once per layer: with this step's k and v as they are
    when nothing is cached; its paged form (the keys read through the block tables) when some are, with
    blocks of 16; the batch form over every sequence's keys laid end to end (the cached ones gathered) when
    some are with blocks of 8, which the paged form does not take. Each time its output equals the
    per-sequence path's (the batch forms switched off) bit for bit."""
    import minivllm.attention.backends.cpu_attn as cd

    if cd.cpu_prefill_varlen_kernel(dtype) is None:
        pytest.skip(f"no C++ prefill kernel for {dtype} on this CPU")
    real, real_paged = cd.cpu_prefill_varlen_kernel(dtype), cd.cpu_prefill_paged_kernel(dtype)
    for lens_q, lens, block_size, kind in (([6, 1, 33], [6, 1, 33], 16, "varlen"),
                                           ([6, 1, 33], [6, 20, 50], 16, "paged"),
                                           ([6, 1, 33], [6, 20, 50], 8, "varlen")):
        md = metadata(lens_q, lens, block_size, 32)
        q, k, v = (x.to(dtype) for x in qkv(sum(lens_q), sum(lens_q), 9, 3, 64, seed=2))
        cache = torch.randn(2, 1, 32, block_size, 3, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
        outs, calls = [], []
        for on in (True, False):
            varlen = (lambda *a: calls.append(("varlen", a[1].shape[0])) or real(*a)) if on else None
            paged = (lambda *a: calls.append(("paged", int(a[4].sum()))) or real_paged(*a)) if on else None
            monkeypatch.setattr(cd, "cpu_prefill_varlen_kernel", lambda dt, f=varlen: f)
            monkeypatch.setattr(cd, "cpu_prefill_paged_kernel", lambda dt, f=paged: f)
            backend = cd.CPUPagedAttention(cache.clone(), 0.125)
            backend.metadata = md
            outs.append(backend(0, q, k, v))
        assert calls == [(kind, sum(lens))] and torch.equal(outs[0], outs[1]), (lens, block_size)


@pytest.mark.parametrize("chunked", [False, True])
def test_the_engine_over_cached_prefixes_takes_the_paged_form(prefill_kernel, monkeypatch, tmp_path, chunked):
    """A tiny llama with head_dim 64 in float32 (the C++ kernels' shapes), prefix caching on, and with
    `chunked` small chunks too (chapter 11): prompts that share a cached prefix, and chunks after the
    first, reach `CPUPagedAttention.prefill` with cached tokens, which calls the paged form; greedy tokens
    and prompt logprobs equal those of the same engine with the paged form swapped for a gather of the
    keys in torch and the batch form over them (checked to fail with `key_row` ignoring the tables)."""
    from engine_helpers import make_model, random_prompts, run_engine
    import minivllm.attention.backends.cpu_attn as cd
    from minivllm.attention.paged_attention import gather_kv
    from minivllm.llm import LLM
    from minivllm.sampling_params import SamplingParams

    make_model(tmp_path, "llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    shared = list(range(3, 40))
    base = random_prompts(4, 1, 60, seed=11)
    prompts = base + [shared + p[:20] for p in base[:3]] + [shared + [5] * 30]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    extra = dict(max_num_batched_tokens=16, max_num_seqs=8, long_prefill_token_threshold=5) if chunked else {}
    real, varlen, calls = cd.cpu_prefill_paged_kernel(torch.float32), cd.cpu_prefill_varlen_kernel(torch.float32), []

    def gathered(q, k_cache, v_cache, cu_q, lens, tables, scale):  # the keys end to end, then the batch form
        keys = [(gather_kv(k_cache, tables[i], n), gather_kv(v_cache, tables[i], n))
                for i, n in enumerate(lens.tolist())]
        cu_k = torch.nn.functional.pad(lens.cumsum(0), (1, 0))
        return varlen(q, torch.cat([a for a, _ in keys]), torch.cat([b for _, b in keys]), cu_q, cu_k, scale)

    results = []
    for form in (lambda *a: calls.append(1) or real(*a), gathered):
        monkeypatch.setattr(cd, "cpu_prefill_paged_kernel", lambda dtype, form=form: form)
        engine = LLM(str(tmp_path), dtype="float32", max_model_len=128, enable_prefix_caching=True, **extra).llm_engine
        outs = run_engine(engine, prompts, params)
        logprobs = [[d and {t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs] for o in outs]
        results.append([(o.outputs[0].token_ids, lp) for o, lp in zip(outs, logprobs)])
    assert calls and results[0] == results[1]


def test_the_batch_form_refuses_prefix_sums_that_wrap_around(one_and_batch):
    """Prefix sums whose differences overflow int64 (2**63 - 1, then -2) look non-decreasing to a check that
    subtracts; the kernel compares the values, and refuses them (a breaking helper crashed the process with
    these before)."""
    dtype, _, batch = one_and_batch
    q, k, v = torch.randn(10, 4, 64).to(dtype), torch.randn(20, 2, 64).to(dtype), torch.randn(20, 2, 64).to(dtype)
    wrap = lambda last: torch.tensor([0, 2**63 - 1, -2, last])  # noqa: E731
    with pytest.raises(ValueError, match="must not decrease"):
        batch(q, k, v, wrap(10), wrap(20), 0.125)


def test_a_one_token_key_with_any_token_stride(one_and_batch):
    """One key with a token stride far past int32 offsets (a view: its stride is meaningless, contiguous()
    keeps it): copied densely, not refused."""
    dtype, one, _ = one_and_batch
    q, k, v = (x.to(dtype) for x in qkv(1, 1, 2, 1, 64, seed=30))
    storage = torch.zeros(64, dtype=dtype)
    storage.copy_(k.flatten())
    k_odd = storage.as_strided((1, 1, 64), (2**40, 64, 1))
    assert torch.equal(one(q, k_odd, v, 0.125), one(q, k, v, 0.125))
