"""Chapter 05's C++ CPU decode kernel (`minivllm.attention.backends.cpu_attn`): equal to the plain-torch paged
decode, refuses bad input, is built once per source, flags, Python, torch and CPU and then loaded
directly (no build tool runs again), and the backend falls back to plain torch where it is not built.

The kernel is compiled on first use (tens of seconds; the library is cached on disk). Tests that
need it skip where it cannot be built (a warning says why), except under `MINIVLLM_REQUIRE_CPU_KERNEL=1`,
which CI sets: there they fail.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import minivllm.attention.backends.cpu_attn as cd
import minivllm.model_executor.cpp_extension as ce
from engine_helpers import require_cpu_kernel
from minivllm.attention.backend import AttentionMetadata
from minivllm.attention.decode_planner import paged_decode_attention_planned, plan_decode
from minivllm.attention.backends.cpu_attn import (DECODE_KERNEL, CPUPagedAttention, cpu_decode_kernel,
                                         cpu_reshape_and_cache, paged_decode_attention_cpu)
from minivllm.model_executor.cpp_extension import _build_lock, build_dir, library_path
from minivllm.attention.paged_attention import PagedAttention, paged_decode_attention


@pytest.fixture
def kernel():
    return require_cpu_kernel()


needs_kernel = pytest.mark.usefixtures("kernel")
PAD_ID = 10**9  # block-table entries past a sequence's last block: garbage the kernel must not read


def plain(tables: torch.Tensor) -> torch.Tensor:
    """The same tables for the plain-torch version, which wants -1 padding (it clamps it to block 0)."""
    return tables.masked_fill(tables == PAD_ID, -1)

# (num_heads, num_kv_heads, head_dim, block_size): the default model's shape, Qwen3-0.6B's head_dim
# 128, no grouping, one K/V head for all, odd sizes that take the generic (runtime head_dim) path
SHAPES = [(9, 3, 64, 16), (16, 8, 128, 1), (4, 4, 8, 5), (6, 1, 32, 256), (4, 2, 16, 4)]


def random_batch(num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, num_seqs=7, num_blocks=60):
    """A cache with shuffled block tables; table entries past a sequence's last block are `PAD_ID`."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g, dtype=dtype)
    capacity = min(40, num_blocks * block_size // num_seqs)
    lens = torch.randint(1, capacity + 1, (num_seqs,), generator=g)
    lens[0], lens[1] = 1, block_size * max(1, capacity // block_size)  # one token; whole blocks
    n_blocks = (lens + block_size - 1) // block_size
    tables = torch.full((num_seqs, int(n_blocks.max()) + 1), PAD_ID, dtype=torch.int64)
    perm = torch.randperm(num_blocks, generator=g)
    start = 0
    for i, n in enumerate(n_blocks.tolist()):
        tables[i, :n] = perm[start:start + n]
        start += n
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g, dtype=dtype)
    return q, k_cache, v_cache, tables, lens


def test_the_kernel_is_the_built_function(kernel):
    assert callable(kernel) and cpu_decode_kernel() is kernel


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_equals_plain_torch_decode(shape, dtype, threads):
    q, k_cache, v_cache, tables, lens = random_batch(*shape, dtype)
    scale = shape[2] ** -0.5
    plain_tables = plain(tables)
    ref = paged_decode_attention(q, k_cache, v_cache, plain_tables, lens, scale)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, scale)
        # a non-contiguous q (a strided view) gives the same: heads apart (copied), or sequences' rows
        # apart, as a fused q/k/v projection's split gives them (read in place)
        wide = torch.cat([q, torch.zeros_like(q)], dim=2)[:, :, :shape[2]]
        assert not wide.is_contiguous()
        out_strided = paged_decode_attention_cpu(wide, k_cache, v_cache, tables, lens, scale)
        rows = torch.cat([q.flatten(1), torch.full((q.shape[0], 7), float("nan"), dtype=dtype)], 1)
        rows = rows[:, :q[0].numel()].view(q.shape)
        assert not rows.is_contiguous() or q.shape[0] == 1
        out_rows = paged_decode_attention_cpu(rows, k_cache, v_cache, tables, lens, scale)
    finally:
        torch.set_num_threads(before)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, ref, atol=tol, rtol=0)
    torch.testing.assert_close(out_strided, out, atol=0, rtol=0)
    torch.testing.assert_close(out_rows, out, atol=0, rtol=0)
    assert out_rows.is_contiguous()
    plan = plan_decode(plain_tables, lens, shape[3], dtype)
    torch.testing.assert_close(paged_decode_attention_planned(q, k_cache, v_cache, plan, scale), out, atol=tol, rtol=0)


# bfloat16: the kernel reads bfloat16 K/V and q, computes in float32 and rounds the output once. The
# reference is float64 attention over the same bfloat16 values (widening to float64 is exact), so the
# only differences are float32 arithmetic (relative ~1e-6, hence the absolute 1e-5 for outputs near
# zero) and that one rounding to bfloat16's 8 significant bits: at most 2**-8 of the value.
BF16_ROUNDING = 2.0 ** -8
FLOAT32_ARITHMETIC = 1e-5


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bfloat16_kernel_against_the_float64_reference(shape, threads):
    q, k_cache, v_cache, tables, lens = random_batch(*shape, torch.bfloat16, seed=1)
    scale = shape[2] ** -0.5
    exact = paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), plain(tables), lens, scale)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, scale)
    finally:
        torch.set_num_threads(before)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.double(), exact, atol=FLOAT32_ARITHMETIC, rtol=BF16_ROUNDING)
    # the plain-torch bfloat16 decode rounds its output too, and also its attention probabilities
    # (relative 2**-8 each, weighting V rows: at most 2**-8 * max|V| in all), so the two agree within
    # the sum of both sides' rounding
    torch_bf16 = paged_decode_attention(q, k_cache, v_cache, plain(tables), lens, scale).double()
    bound = 2 * FLOAT32_ARITHMETIC + BF16_ROUNDING * (2 * exact.abs() + v_cache.abs().max().double())
    assert ((out.double() - torch_bf16).abs() <= bound).all()
    # and the kernel does not merely round like the reference: a float32 cache gives float32 accuracy
    out32 = paged_decode_attention_cpu(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    torch.testing.assert_close(out32.double(), exact, atol=2e-6, rtol=0)
    assert (out.double() != exact).any()


# The kernel takes a K/V head's query heads in tiles of up to four (a group of five: a tile of four and
# one of one) and head_dim in whole SIMD registers plus a scalar rest (24 = 16 + 8 values in float32):
# every tile size and both paths, against the plain-torch decode, with the tolerances used above.
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 24])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5])
def test_every_head_tile_and_head_dim_path(group, head_dim, block_size, dtype):
    q, k_cache, v_cache, tables, lens = random_batch(2 * group, 2, head_dim, block_size, dtype, seed=group,
                                                     num_blocks=max(60, 300 // block_size))
    assert lens.min() == 1 and lens.max() >= 2 * block_size  # ragged: one token, two blocks or more
    scale = head_dim ** -0.5
    out = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, scale)
    exact = paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), plain(tables), lens, scale)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(out.double(), exact, atol=FLOAT32_ARITHMETIC, rtol=BF16_ROUNDING)
    else:
        torch.testing.assert_close(out.double(), exact, atol=1e-12 if dtype == torch.float64 else 2e-6, rtol=0)


# The decode with AMX scores (`cpu_amx_decode_kernel`), called through the library's
# `paged_decode_attention_amx` so that it runs on every CPU: where the build or the CPU has no AMX, and for
# shapes the tile does not take, it is the AVX-512 decode. Against float64 with the bfloat16 tolerances
# above: 3 to 16 query heads per K/V head in one tile, more than one tile's worth of heads (32 = 4 x 8:
# two passes), head_dim 64 and 128, block sizes 16 and 32, and shapes that fall back (2 or 17 heads per
# K/V head, block_size 8, head_dim 24); scores of an ordinary range and of one far wider than 2**x's: query and
# keys whole numbers in [-8, 8], so that every product and sum of a score is exact in float32 and the
# tolerances stay those of one rounding (a score's median gap to its row's max is about 50: most
# probabilities lie below 2**-64, and about a tenth below float32's normal range).
AMX_SHAPES = [(9, 3, 64, 16), (16, 1, 64, 16), (32, 8, 64, 16), (15, 3, 128, 32), (4, 2, 128, 16),
              (17, 1, 64, 16), (6, 2, 64, 8), (6, 2, 24, 16)]


@needs_kernel
@pytest.mark.parametrize("wide", [False, True], ids=["normal", "wide"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", AMX_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_amx_decode_against_the_float64_reference(shape, threads, wide):
    module = ce.load_extension(DECODE_KERNEL)
    q, k_cache, v_cache, tables, lens = random_batch(*shape, torch.bfloat16, seed=3, num_blocks=max(60, 600 // shape[3]))
    if wide:
        g = torch.Generator().manual_seed(5)
        q, k_cache = (torch.randint(-8, 9, t.shape, generator=g).bfloat16() for t in (q, k_cache))
    scale = shape[2] ** -0.5
    exact = paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), plain(tables), lens, scale)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = module.paged_decode_attention_amx(q, k_cache, v_cache, tables, lens, scale)
    finally:
        torch.set_num_threads(before)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.double(), exact, atol=FLOAT32_ARITHMETIC, rtol=BF16_ROUNDING)
    # sequences' rows apart (a fused q/k/v split's view, read in place; NaN between the rows): the same bits
    rows = torch.cat([q.flatten(1), torch.full((q.shape[0], 5), float("nan")).bfloat16()], 1)
    rows = rows[:, :q[0].numel()].view(q.shape)
    assert torch.equal(module.paged_decode_attention_amx(rows, k_cache, v_cache, tables, lens, scale), out)
    wrong = module.paged_decode_attention_amx(q, k_cache, v_cache, tables, (lens - 1).clamp(min=1), scale)
    assert (wrong.double() - exact).abs().max() > 1e-2  # the check can fail: one token short


# The AMX tile reads 16 K rows at a time, also past a sequence's last token in its last block: those rows
# must reach no score that is used. Every cache slot outside the sequences' contexts set to NaN changes
# nothing, bit for bit.
@needs_kernel
@pytest.mark.parametrize("block_size", [16, 32])
def test_amx_decode_never_uses_rows_past_the_context(block_size):
    module = ce.load_extension(DECODE_KERNEL)
    q, k_cache, v_cache, tables, lens = random_batch(9, 3, 64, block_size, torch.bfloat16, seed=4, num_blocks=60)
    assert (lens % block_size != 0).any()  # some last blocks only partly used
    clean = module.paged_decode_attention_amx(q, k_cache, v_cache, tables, lens, 0.125)
    used = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for i, n in enumerate(lens.tolist()):
        t = torch.arange(n)
        used[tables[i, t // block_size], t % block_size] = True
    k_dirty, v_dirty = k_cache.clone(), v_cache.clone()
    k_dirty[~used], v_dirty[~used] = float("nan"), float("nan")
    out = module.paged_decode_attention_amx(q, k_dirty, v_dirty, tables, lens, 0.125)
    assert out.isfinite().all() and torch.equal(out, clean)


# A NaN or inf in one K/V head's K, inside a context, reaches that head's group of query heads only, as in
# the reference: the AMX tile's zeros in the other groups' columns must not meet it (0 * NaN is NaN).
@needs_kernel
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_amx_decode_keeps_a_bad_key_within_its_group(bad):
    module = ce.load_extension(DECODE_KERNEL)
    q, k_cache, v_cache, tables, lens = random_batch(8, 2, 64, 16, torch.bfloat16, seed=6)
    k_cache[tables[2, 0], 3, 1, 5] = bad  # sequence 2, token 3, K/V head 1: query heads 4-7
    assert lens[2] > 3
    exact = paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), plain(tables), lens, 0.125)
    out = module.paged_decode_attention_amx(q, k_cache, v_cache, tables, lens, 0.125).double()
    assert torch.equal(out.isnan(), exact.isnan()) and exact[2, 4:].isnan().any() and not exact[2, :4].isnan().any()
    fine = ~exact.isnan()
    torch.testing.assert_close(out[fine], exact[fine], atol=FLOAT32_ARITHMETIC, rtol=BF16_ROUNDING)


# The softmax runs eight float32 scores at a time with a scalar rest: every context length from 1 to
# 2 * 8 + 1, with scores that span far more than exp's range (query and keys scaled up: most
# probabilities underflow to the clamp at exp(-87), a few carry the sum), against float64.
@needs_kernel
@pytest.mark.parametrize("spread", [1.0, 30.0])
def test_softmax_lanes_and_rest_over_every_length_and_a_wide_score_range(spread):
    g = torch.Generator().manual_seed(11)
    lens = torch.arange(1, 18)
    k_cache = spread * torch.randn(18, 17, 1, 16, generator=g)
    v_cache = torch.randn(18, 17, 1, 16, generator=g)
    q = spread * torch.randn(len(lens), 2, 16, generator=g)
    tables = torch.arange(17)[:, None]  # one block of 17 slots per sequence
    exact = paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), tables, lens, 0.25)
    out = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, 0.25)
    torch.testing.assert_close(out.double(), exact, atol=2e-6, rtol=0)
    wrong = paged_decode_attention_cpu(q, k_cache, v_cache, tables, (lens - 1).clamp(min=1), 0.25)
    assert (wrong.double() - exact).abs().max() > 1e-3  # the check can fail: one slot short


# The K/V store (vLLM's reshape_and_cache) in one C++ call: the same cache as the two `index_copy_` of
# the plain backend, bit for bit, for rows that come as the q/k/v split's strided views; slot -1 skipped.
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_reshape_and_cache_equals_the_plain_store(dtype):
    store = cpu_reshape_and_cache()
    g = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(2, 2, 10, 4, 3, 16, generator=g).to(dtype)  # [K/V, layers, blocks, block_size, heads, dim]
    qkv = torch.randn(6, 9 * 16, generator=g).to(dtype)  # as the fused projection gives them: strided views
    k, v = qkv[:, 3 * 16:6 * 16].view(6, 3, 16), qkv[:, 6 * 16:].view(6, 3, 16)
    assert not k.is_contiguous()
    slots = torch.tensor([5, 39, 0, 17, 22, 8])
    plain_backend = PagedAttention(kv_cache.clone(), 0.25)
    backend = CPUPagedAttention(kv_cache.clone(), 0.25)
    md = AttentionMetadata(False, torch.arange(7), torch.ones(6, dtype=torch.int64), slots,
                           torch.zeros(6, 1, dtype=torch.int64))
    plain_backend.metadata = backend.metadata = md
    plain_backend.store_kvcache(1, k, v)
    backend.store_kvcache(1, k, v)
    assert torch.equal(backend.kv_cache, plain_backend.kv_cache)
    assert not torch.equal(backend.kv_cache, kv_cache)  # something was written
    # slot -1 (a padded row) writes nothing, anywhere in the whole cache (layer 1: a write before the
    # first slot would land in layer 0); the other rows are written as index_copy_ writes them
    cache, expected = kv_cache.clone(), kv_cache.clone()
    padded = torch.tensor([5, -1, 0, -1, 22, 8])
    store(k, v, cache[0, 1], cache[1, 1], padded)
    kept = padded >= 0
    for layer_cache, new in ((expected[0, 1], k), (expected[1, 1], v)):
        layer_cache.view(-1, 3, 16).index_copy_(0, padded[kept], new[kept])
    assert torch.equal(cache, expected)
    store(k[:0], v[:0], cache[0, 0], cache[1, 0], slots[:0])  # no tokens: nothing to do
    assert torch.equal(cache, expected)


# stream=True writes with streaming stores where each row is whole 64-byte lines and both caches start on a
# line, else with plain copies: the same cache as index_copy_ writes, asked either way. Rows of 2 x 32 values
# are whole lines in every dtype; 3 x 8 are not (float32, bfloat16); a cache one element off its allocation
# does not start on a line. 300 rows: two threads' shares (runs of at least 256), each fenced.
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("heads, dim", [(2, 32), (3, 8)])
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("stream", [True, False])
def test_reshape_and_cache_with_and_without_streaming_stores(dtype, heads, dim, offset, stream):
    store = cpu_reshape_and_cache()
    g = torch.Generator().manual_seed(4)
    n, shape = 300, (40, 16, heads, dim)  # 640 slots for 300 rows
    numel = torch.Size(shape).numel()
    buffers = [torch.randn(numel + 64, generator=g).to(dtype) for _ in range(2)]
    caches = [b[offset:offset + numel].view(shape) for b in buffers]
    assert all((c.data_ptr() % 64 == 0) == (offset == 0) for c in caches)  # torch's allocations start on a line
    expected = [c.clone() for c in caches]
    qkv = torch.randn(n, 3 * heads * dim, generator=g).to(dtype)  # strided views, as the fused projection gives
    k, v = qkv[:, heads * dim:2 * heads * dim].view(n, heads, dim), qkv[:, 2 * heads * dim:].view(n, heads, dim)
    slots = torch.randperm(40 * 16, generator=g)[:n]
    slots[::7] = -1  # padded rows: skipped
    store(k, v, caches[0], caches[1], slots, stream=stream)
    kept = slots >= 0
    for cache, new in zip(expected, (k, v)):
        cache.view(-1, heads, dim).index_copy_(0, slots[kept], new[kept])
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


# The backend asks for streaming stores only where the step's attention reads none of the stored rows: a
# prefill with nothing cached (it reads k, v as they are); not a prefill over cached tokens (the paged form
# reads the cache) nor a decode. The caches equal the plain backend's after each store.
@needs_kernel
def test_backend_streams_the_store_only_where_the_step_reads_no_stored_row(monkeypatch):
    real, asked = cpu_reshape_and_cache(), []
    def spy(*args, stream=False):
        asked.append(stream)
        return real(*args, stream=stream)
    monkeypatch.setattr(cd, "cpu_reshape_and_cache", lambda: spy)
    g = torch.Generator().manual_seed(5)
    kv_cache = torch.randn(2, 1, 8, 16, 2, 64, generator=g)
    backend, plain_backend = CPUPagedAttention(kv_cache.clone(), 0.125), PagedAttention(kv_cache.clone(), 0.125)
    tables = torch.tensor([[0, 1, -1], [2, 3, 4]])
    steps = {  # (is_prefill, new tokens per sequence, context lengths)
        "prefill, nothing cached": (True, [3, 2], [3, 2]),
        "prefill over a cached prefix": (True, [3, 2], [3, 34]),
        "decode": (False, [1, 1], [20, 40]),
    }
    for is_prefill, new, lens in steps.values():
        cu = torch.tensor([0, *new]).cumsum(0)
        slots = torch.cat([tables[i, (t := torch.arange(l - n, l)) // 16] * 16 + t % 16
                           for i, (n, l) in enumerate(zip(new, lens))])
        k, v = torch.randn(2, int(cu[-1]), 2, 64, generator=g)
        backend.metadata = plain_backend.metadata = AttentionMetadata(is_prefill, cu, torch.tensor(lens), slots, tables)
        backend.store_kvcache(0, k, v)
        plain_backend.store_kvcache(0, k, v)
        assert torch.equal(backend.kv_cache, plain_backend.kv_cache)
    assert asked == [True, False, False], dict(zip(steps, asked))


@needs_kernel
def test_reshape_and_cache_refuses_bad_input_and_writes_nothing():
    store = cpu_reshape_and_cache()
    kv_cache = torch.zeros(2, 10, 4, 3, 16)
    k, v = torch.randn(6, 3, 16), torch.randn(6, 3, 16)
    slots = torch.tensor([5, 39, 0, 17, 22, 8])
    def call(**kw):  # the C++ function takes its arguments by position
        args = {**dict(k=k, v=v, k_cache=kv_cache[0], v_cache=kv_cache[1], slot_mapping=slots), **kw}
        return store(*args.values())
    cases = {
        "slot_mapping\\[3\\] = 40 is not -1 or a slot":
            dict(slot_mapping=slots.clone().index_fill_(0, torch.tensor([3]), 40)),
        "slot_mapping\\[0\\] = -2": dict(slot_mapping=slots.clone().index_fill_(0, torch.tensor([0]), -2)),
        "one slot per token": dict(slot_mapping=slots[:5]),
        "1-D int64": dict(slot_mapping=slots.int()),
        "one dtype": dict(k=k.double()),
        "k and v must both be": dict(v=v[:, :2]),
        "of k's heads": dict(k=torch.randn(6, 2, 16), v=torch.randn(6, 2, 16)),
        "contiguous": dict(k_cache=kv_cache[0].transpose(0, 1).contiguous().transpose(0, 1)),
        "CPU tensors": dict(slot_mapping=torch.empty(6, dtype=torch.int64, device="meta")),
    }
    for message, kw in cases.items():
        with pytest.raises(ValueError, match=message):
            call(**kw)
        assert not kv_cache.any()  # the checks come before any write
    call()
    assert torch.equal(kv_cache[0].view(-1, 3, 16)[slots], k) and torch.equal(kv_cache[1].view(-1, 3, 16)[slots], v)


@needs_kernel
def test_kernel_on_an_empty_batch():
    q, k_cache, v_cache, tables, lens = random_batch(4, 2, 16, 4, torch.float64)
    out = paged_decode_attention_cpu(q[:0], k_cache, v_cache, tables[:0], lens[:0], 0.25)
    assert out.shape == (0, 4, 16)


@needs_kernel
def test_kernel_refuses_bad_input_with_a_clear_error():
    q, k_cache, v_cache, tables, lens = random_batch(4, 2, 16, 4, torch.float64)
    call = lambda **kw: paged_decode_attention_cpu(**{**dict(q=q, k_cache=k_cache, v_cache=v_cache,
                                                             block_tables=tables, context_lens=lens, scale=0.25), **kw})
    bad_tables = tables.clone()
    bad_tables[2, 0] = -1
    late_bad = tables.clone()
    late_bad[1, 2] = k_cache.shape[0]  # sequence 1 has 8 blocks: a bad id in the middle is caught too
    cases = {
        "context_lens\\[0\\] = 0": dict(context_lens=lens.clone().index_fill_(0, torch.tensor([0]), 0)),
        "is not in \\[1, ": dict(context_lens=lens + 10**6),
        "block_tables\\[2, 0\\] = -1": dict(block_tables=bad_tables),
        "block_tables\\[1, 2\\] = 60 is not a block": dict(block_tables=late_bad),
        "one dtype": dict(q=q.float()),
        "2-D int64": dict(block_tables=tables.int()),
        "multiple of num_kv_heads": dict(q=torch.randn(7, 3, 16, dtype=torch.float64)),
        "one row per sequence": dict(context_lens=lens[:-1]),
        "contiguous": dict(k_cache=k_cache.transpose(0, 1).contiguous().transpose(0, 1)),
        "float32, float64 or bfloat16": dict(q=q.half(), k_cache=k_cache.half(), v_cache=v_cache.half()),
        "must be positive": dict(k_cache=k_cache[:, :, :0], v_cache=v_cache[:, :, :0]),
        "CPU tensors": dict(context_lens=torch.empty(7, dtype=torch.int64, device="meta")),
    }
    for message, kw in cases.items():
        with pytest.raises(ValueError, match=message):
            call(**kw)
    torch.testing.assert_close(call(), paged_decode_attention(q, k_cache, v_cache, plain(tables), lens, 0.25))


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """An empty kernel cache in `tmp_path`, the kernel switched on, `cpu_decode_kernel` forgotten."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    monkeypatch.delenv("MINIVLLM_CPU_KERNEL", raising=False)
    cpu_decode_kernel.cache_clear()
    cpu_reshape_and_cache.cache_clear()
    yield tmp_path
    cpu_decode_kernel.cache_clear()
    cpu_reshape_and_cache.cache_clear()


def test_a_failed_build_warns_and_the_backend_falls_back(monkeypatch, fresh_kernel):
    """Where the kernel cannot be built, `cpu_decode_kernel` warns and returns None, the direct call
    raises, `is_available` is False and `CPUPagedAttention` decodes with plain torch."""
    def no_compiler(ext, folder):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(ce, "build_extension", no_compiler)
    with pytest.warns(RuntimeWarning, match="could not be built or loaded"):
        assert cpu_decode_kernel() is None
    batch = random_batch(4, 2, 16, 4, torch.float64)
    with pytest.raises(RuntimeError, match="not available"):
        paged_decode_attention_cpu(*batch, 0.25)
    assert not CPUPagedAttention.is_available("cpu", torch.float64)
    q, k_cache, v_cache, tables, lens = batch
    backend = CPUPagedAttention(torch.stack([k_cache, v_cache])[:, None], 0.25)
    md = AttentionMetadata(False, torch.arange(len(lens) + 1), lens, torch.zeros(len(lens), dtype=torch.int64),
                           plain(tables))
    ref = paged_decode_attention(q, k_cache, v_cache, plain(tables), lens, 0.25)
    torch.testing.assert_close(backend.decode(q, k_cache, v_cache, md), ref, atol=1e-12, rtol=0)


def test_the_environment_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_KERNEL", "0")
    cpu_decode_kernel.cache_clear()
    cpu_reshape_and_cache.cache_clear()
    try:
        assert cpu_decode_kernel() is None and cpu_reshape_and_cache() is None
        assert not CPUPagedAttention.is_available("cpu", torch.float32)
    finally:
        cpu_decode_kernel.cache_clear()
        cpu_reshape_and_cache.cache_clear()


@needs_kernel
def test_backend_uses_the_kernel_only_for_cpu_float32_float64_and_bfloat16(monkeypatch):
    assert CPUPagedAttention.is_available("cpu", torch.float32)
    assert CPUPagedAttention.is_available(torch.device("cpu"), torch.float64)
    assert CPUPagedAttention.is_available("cpu", torch.bfloat16)
    assert not CPUPagedAttention.is_available("cpu", torch.float16)
    assert not CPUPagedAttention.is_available("meta", torch.float32)
    calls = []
    real, real_amx = cpu_decode_kernel(), cd.cpu_amx_decode_kernel()
    monkeypatch.setattr(cd, "cpu_decode_kernel", lambda: (lambda *a: calls.append(a[0].dtype) or real(*a)))
    if real_amx is not None:  # bfloat16 takes the AMX scores where the CPU has AMX
        monkeypatch.setattr(cd, "cpu_amx_decode_kernel", lambda: (lambda *a: calls.append("amx") or real_amx(*a)))
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        q, k_cache, v_cache, tables, lens = random_batch(4, 2, 16, 4, dtype)
        backend = CPUPagedAttention(torch.stack([k_cache, v_cache])[:, None], 0.25)
        md = AttentionMetadata(False, torch.arange(8), lens, torch.zeros(7, dtype=torch.int64), plain(tables))
        plain_backend = PagedAttention(backend.kv_cache, 0.25)
        # outputs within a few units (|x| < 4): bfloat16's last place there is 2**-6, float16's 2**-9
        tol = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2 * 2.0 ** -6, torch.float16: 4 * 2.0 ** -9}[dtype]
        torch.testing.assert_close(backend.decode(q, k_cache, v_cache, md),
                                   plain_backend.decode(q, k_cache, v_cache, md), atol=tol, rtol=0)
    # float16 went to plain torch
    assert calls == [torch.float32, torch.float64, torch.bfloat16 if real_amx is None else "amx"]


def test_build_folder_is_per_source_flags_python_torch_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    folder = build_dir(DECODE_KERNEL)
    assert folder.parent == tmp_path / "kernels" and torch.__version__ in folder.name
    assert build_dir(DECODE_KERNEL) == folder  # the same inputs, the same folder
    folders = {folder}
    for flags in ("flags : fpu sse2 avx2\n", "flags : fpu sse2 avx2 avx512f\n", "Features : fp asimd sve\n"):
        (tmp_path / "cpuinfo").write_text("processor : 0\n" + flags)
        monkeypatch.setattr(ce, "CPUINFO", str(tmp_path / "cpuinfo"))
        folders.add(build_dir(DECODE_KERNEL))
    other_source = tmp_path / "other.cpp"
    other_source.write_text(DECODE_KERNEL.source.read_text() + "\n// changed\n")
    folders.add(build_dir(dataclasses.replace(DECODE_KERNEL, source=other_source)))
    folders.add(build_dir(dataclasses.replace(DECODE_KERNEL, cflags=(*DECODE_KERNEL.cflags, "-DSOMETHING"))))
    folders.add(build_dir(dataclasses.replace(DECODE_KERNEL, name="another_module")))
    assert len(folders) == 7  # another instruction set, source, flag or module: another folder


def test_the_source_ships_in_the_package():
    import minivllm.attention.ops as ops

    assert DECODE_KERNEL.source.is_file() and DECODE_KERNEL.source.parent == Path(ops.__file__).parent
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"minivllm.attention.ops" = ["*.cpp"]' in pyproject  # the wheel's package data
    text = DECODE_KERNEL.source.read_text()
    assert "torch::Tensor paged_decode_attention(" in text and "PYBIND11_MODULE(TORCH_EXTENSION_NAME" in text


def test_built_once_then_loaded_without_building(monkeypatch, fresh_kernel, capsys):
    """Fault of the old loader: torch's builder ran `ninja` at every load, and two ninjas read each
    other's build logs as stale, so the kernel was compiled again. Now: one build per folder, marked
    complete; later loads import the library and never call the builder, with or without a compiler."""
    built, loaded = [], []

    def fake_build(ext, folder):
        built.append(folder)
        library_path(ext, folder).write_bytes(b"library")
        return library_path(ext, folder)

    def fake_load(ext, path):
        loaded.append(path)
        return SimpleNamespace(paged_decode_attention="the kernel")

    monkeypatch.setattr(ce, "build_extension", fake_build)
    monkeypatch.setattr(ce, "load_library", fake_load)
    folder = build_dir(DECODE_KERNEL)
    said = []
    for cxx in ("c++", "c++", "/nonexistent/c++"):  # once built, no compiler is needed
        monkeypatch.setenv("CXX", cxx)
        cpu_decode_kernel.cache_clear()
        assert cpu_decode_kernel() == "the kernel"
        said.append("compiling the C++ CPU decode kernel once" in capsys.readouterr().err)
    assert built == [folder] and said == [True, False, False]
    assert loaded == [library_path(DECODE_KERNEL, folder)] * 3 and (folder / ce.BUILT).exists()


def test_an_unfinished_build_is_built_again(monkeypatch, fresh_kernel):
    """A library without the completion mark (a build killed while linking) is not loaded."""
    folder = build_dir(DECODE_KERNEL)
    folder.mkdir(parents=True)
    library_path(DECODE_KERNEL, folder).write_bytes(b"half a library")
    built = []
    monkeypatch.setattr(ce, "build_extension", lambda e, d: built.append(d))
    monkeypatch.setattr(ce, "load_library", lambda e, p: SimpleNamespace(paged_decode_attention="ok"))
    assert cpu_decode_kernel() == "ok" and built == [folder]


def test_no_compiler_is_said_plainly(monkeypatch, fresh_kernel):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler `/nonexistent/c\\+\\+` found"):
        assert cpu_decode_kernel() is None


@needs_kernel
def test_a_fresh_process_with_another_ninja_or_none_does_not_compile(tmp_path):
    """The whole fault, end to end: the kernel is built (by the fixture); a new process whose `PATH`
    holds a different `ninja` (one that records being run) or none at all loads it without building:
    no notice on stderr, the library file untouched, no ninja run."""
    folder = build_dir(DECODE_KERNEL)
    library = library_path(DECODE_KERNEL, folder)
    before = library.stat().st_mtime_ns
    other = tmp_path / "other-ninja"
    other.mkdir()
    (other / "ninja").write_text(f"#!/bin/sh\ntouch {tmp_path}/ninja-ran\nexit 1\n")
    (other / "ninja").chmod(0o755)
    empty = tmp_path / "empty"
    empty.mkdir()
    code = ("import torch.utils.cpp_extension as c\n"
            "c.load = c.load_inline = None  # any call to torch's builder would fail\n"
            "from minivllm.attention.backends.cpu_attn import cpu_decode_kernel\n"
            "assert cpu_decode_kernel() is not None\n")
    for path in (str(other), str(empty)):
        env = {**os.environ, "PATH": path}
        env.pop("MINIVLLM_CPU_KERNEL", None)
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert "minivllm:" not in run.stderr, run.stderr  # no build notice, no warning
    assert library.stat().st_mtime_ns == before and not (tmp_path / "ninja-ran").exists()


def test_torch_still_names_its_build_lock_lock():
    """`_build_lock` removes torch's leftover `lock` file: that is the name torch's builder uses."""
    import inspect

    import torch.utils.cpp_extension as cpp

    assert "'lock')" in inspect.getsource(cpp._jit_compile)


def test_build_lock_removes_a_leftover_and_serialises_builders(tmp_path):
    import threading
    import time

    (tmp_path / "lock").touch()  # left by a killed build
    with pytest.warns(RuntimeWarning, match="did not finish"):
        with _build_lock(tmp_path):
            assert not (tmp_path / "lock").exists()
    events = []

    def builder(name):
        with _build_lock(tmp_path):
            events.append(f"{name} in")
            time.sleep(0.3)
            events.append(f"{name} out")

    threads = [threading.Thread(target=builder, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert events in (["a in", "a out", "b in", "b out"], ["b in", "b out", "a in", "a out"])


def test_building_leaves_the_flags_and_the_folder_as_they_were(monkeypatch, fresh_kernel):
    """torch's builder appends to the flag lists it is given; the loader passes copies, so the build
    folder computed after a build is the one built into."""
    import torch.utils.cpp_extension as cpp

    def appending_load(name, sources, extra_cflags, extra_ldflags, build_directory, **kwargs):
        extra_cflags.append("-DADDED")
        extra_ldflags.append("-lADDED")
        Path(build_directory, f"{name}{ce.LIBRARY_SUFFIX}").write_bytes(b"library")

    monkeypatch.setattr(cpp, "load", appending_load)
    monkeypatch.setattr(ce, "load_library", lambda e, p: SimpleNamespace(paged_decode_attention="ok"))
    folder = build_dir(DECODE_KERNEL)
    assert cpu_decode_kernel() == "ok"
    assert "-DADDED" not in DECODE_KERNEL.cflags and "-lADDED" not in DECODE_KERNEL.ldflags
    assert build_dir(DECODE_KERNEL) == folder and (folder / ce.BUILT).exists()


def test_a_missing_library_is_built_again(monkeypatch, fresh_kernel):
    """A complete mark without its library (someone deleted the file) means: build again."""
    folder = build_dir(DECODE_KERNEL)
    folder.mkdir(parents=True)
    (folder / ce.BUILT).touch()
    built = []
    monkeypatch.setattr(ce, "build_extension", lambda e, d: built.append(d) or library_path(e, d).write_bytes(b"lib"))
    monkeypatch.setattr(ce, "load_library", lambda e, p: SimpleNamespace(paged_decode_attention="ok"))
    assert cpu_decode_kernel() == "ok" and built == [folder] and ce.is_built(DECODE_KERNEL, folder)
