"""Chapter 07's Triton kernels (`minivllm.attention.ops.triton_attention`): the KV store, paged decode (one
split and split-K) and paged prefill over a cached prefix, against chapter 05's plain-torch reference;
the Triton backend in the engine against transformers; which backend the default assembly chooses.

Without CUDA the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`) on CPU tensors: the
same kernel code, one program at a time, with NumPy for each block operation. Triton reads that
variable when a kernel is defined, so this module sets it before the kernels' module is imported
(and re-imports that module if something imported it earlier without it). Shapes are kept small:
the interpreter is slow. With CUDA the same tests run the compiled kernels on the GPU. Without
`triton` installed the tests skip.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
import torch

INTERPRETED = not torch.cuda.is_available()
if INTERPRETED:
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed (pip install triton): the Triton kernels are not tested")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import minivllm.attention.ops.triton_attention as ta  # noqa: E402

if INTERPRETED and not isinstance(ta.paged_decode_kernel, InterpretedFunction):
    ta = importlib.reload(ta)  # imported before TRITON_INTERPRET was set: define the kernels again

from engine_helpers import check_invariants, hf_greedy, make_model, one_thread  # noqa: E402
from minivllm import defaults  # noqa: E402
from minivllm.attention.backend import AttentionMetadata  # noqa: E402
from minivllm.attention.backends.flash_attn import FlashAttnPagedAttention  # noqa: E402
from minivllm.attention.backends.triton_attn import TritonPagedAttention  # noqa: E402
from minivllm.llm import LLM  # noqa: E402
from minivllm.attention.paged_attention import PagedAttention, gather_kv, paged_decode_attention, prefill_attention  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
GARBAGE = 10**9  # block-table entries past a sequence's last block: not a block, must never be read
# Tolerances against a float64 reference computed from the same (rounded) inputs. float32: sums of
# under a hundred products in another order (online softmax, splits) differ by a few ulps of O(1)
# values. float16 / bfloat16: the probabilities are rounded to the cache's dtype before the P·V
# product (as FlashAttention does): 11 / 8 significant bits on outputs of size O(1).
ATOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float64: 1e-12}
INTERPRETER_DTYPES = (torch.float32, torch.float16)  # the interpreter's tl.dot mishandles bfloat16

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


def random_paged_batch(context_lens, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Random K/V caches and block tables: each sequence's blocks drawn from a shuffled pool, the
    table padded with `GARBAGE` (one extra column at least), a few blocks owned by nobody."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(context_lens, dtype=torch.int64)
    n_blocks = (lens + block_size - 1) // block_size
    num_blocks = int(n_blocks.sum()) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.full((len(lens), int(n_blocks.max()) + 1), GARBAGE, dtype=torch.int64)
    perm, start = torch.randperm(num_blocks, generator=g), 0
    for i, n in enumerate(n_blocks.tolist()):
        tables[i, :n] = perm[start:start + n]
        start += n
    return k_cache, v_cache, tables, lens, g


def minus_one(tables):
    """The plain-torch reference wants -1 padding (it reads block 0 there and masks it)."""
    return tables.masked_fill(tables == GARBAGE, -1)


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def kernel_dtypes():
    return INTERPRETER_DTYPES if INTERPRETED else (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------- KV store

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("block_size, num_kv_heads, head_dim", [(1, 1, 64), (16, 2, 128), (256, 3, 48)])
def test_store_kvcache_writes_each_slot_and_skips_minus_one(dtype, block_size, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(block_size)
    num_blocks = max(2, 40 // block_size)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:12]
    slots[[0, 5]] = -1
    kv = torch.randn(12, 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]  # strided views, as a fused projection gives them
    k_cache_d, v_cache_d = on_device(k_cache, v_cache)
    ta.store_kvcache(*on_device(k, v), k_cache_d, v_cache_d, slots.to(DEVICE))
    keep = slots >= 0
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots[keep], k[keep])
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots[keep], v[keep])
    assert torch.equal(k_cache_d.cpu(), k_cache) and torch.equal(v_cache_d.cpu(), v_cache)


# ------------------------------------------------------------------------------------------- decode

# (query heads per KV head, num_kv_heads, block_size, head_dim): every grouping 1/2/4/8, block sizes
# 1/16/256, head dims 64/128, each at least twice; then block sizes that are not powers of two (3, 5)
# and heads of 80 (padded to 128 columns) and 8 (padded to 16: a GPU's tl.dot needs 16)
DECODE_SHAPES = [(1, 2, 16, 64), (2, 2, 1, 128), (4, 1, 256, 64), (8, 1, 16, 128), (4, 2, 1, 64), (2, 1, 256, 128),
                 (1, 1, 1, 128), (8, 1, 256, 64), (2, 2, 3, 80), (4, 1, 5, 8)]
# ragged lengths: longer than a tile (16), a single token, exactly one tile, short, several tiles
DECODE_LENS = [37, 1, 16, 5, 70]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "g{}-kv{}-bs{}-d{}".format(*s))
def test_decode_equals_the_reference(shape, dtype, num_splits):
    group, num_kv_heads, block_size, head_dim = shape
    k_cache, v_cache, tables, lens, g = random_paged_batch(DECODE_LENS, num_kv_heads, head_dim, block_size, dtype)
    q = torch.randn(len(lens), group * num_kv_heads, head_dim, generator=g).to(dtype)
    out = ta.paged_decode_attention_triton(*on_device(q, k_cache, v_cache, tables, lens), head_dim ** -0.5,
                                           num_splits=num_splits, block_n=16)
    ref = paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), minus_one(tables), lens,
                                 head_dim ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.cpu().double(), ref, atol=ATOL[dtype], rtol=0)


def test_decode_splits_are_merged_not_dropped():
    """Many splits, most of them empty for the short sequences: the same result as one split, and not
    bit-identical (the split path really ran)."""
    k_cache, v_cache, tables, lens, g = random_paged_batch([70, 1, 33], 2, 64, 4, torch.float64)
    q = torch.randn(3, 4, 64, generator=g, dtype=torch.float64)
    args = (*on_device(q, k_cache, v_cache, tables, lens), 0.125)
    one = ta.paged_decode_attention_triton(*args, num_splits=1, block_n=16)
    many = ta.paged_decode_attention_triton(*args, num_splits=5, block_n=16)
    torch.testing.assert_close(many, one, atol=1e-12, rtol=0)
    assert not torch.equal(many, one)
    # a query that is a view (rows of a wider tensor, or numbers with a stride): the same result
    for view in (torch.cat([q, q], dim=1)[:, :4], torch.stack([q, q], dim=-1)[..., 0]):
        out = ta.paged_decode_attention_triton(view.to(DEVICE), *args[1:], num_splits=1, block_n=16)
        assert torch.equal(out, one)


def test_decode_of_a_padded_row_is_zero_and_leaves_the_others_alone():
    k_cache, v_cache, tables, lens, g = random_paged_batch([20, 9], 1, 64, 4, torch.float32)
    lens[1] = 0  # a padded row (a CUDA-graph batch): context length 0
    q = torch.randn(2, 2, 64, generator=g)
    for num_splits in (1, 2):
        out = ta.paged_decode_attention_triton(*on_device(q, k_cache, v_cache, tables, lens), 0.125,
                                               num_splits=num_splits, block_n=16).cpu()
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        ref = paged_decode_attention(q[:1], k_cache, v_cache, minus_one(tables[:1]), lens[:1], 0.125)
        torch.testing.assert_close(out[:1], ref, atol=ATOL[torch.float32], rtol=0)


class CapturePartials:
    """Stands in for `reduce_splits_kernel`: keeps each launch's partial sums `l`
    `[num_seqs, num_heads, num_splits]`, then runs the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.l = kernel, []

    def __getitem__(self, grid):
        def launch(acc, m, l, *args, **kwargs):
            self.kernel[grid](acc, m, l, *args, **kwargs)
            self.l.append(l.cpu().clone())
        return launch


def test_every_sequence_spreads_its_keys_over_the_splits(monkeypatch):
    """A CUDA graph's block tables are as wide as max_model_len allows, and the split count is chosen
    for that width: each sequence must still cut its own keys into the splits (whole tiles, the last
    ones empty for a short sequence), not leave them all to the first split."""
    k_cache, v_cache, tables, lens, g = random_paged_batch([64, 20, 1], 1, 16, 4, torch.float64)
    wide = torch.cat([tables, torch.full((3, 60), GARBAGE)], dim=1)  # 77 columns: room for 308 keys
    q = torch.randn(3, 2, 16, generator=g, dtype=torch.float64)
    capture = CapturePartials(ta.reduce_splits_kernel)
    monkeypatch.setattr(ta, "reduce_splits_kernel", capture)
    out = ta.paged_decode_attention_triton(*on_device(q, k_cache, v_cache, wide, lens), 0.25, num_splits=4, block_n=16)
    (l,) = capture.l
    assert l.shape == (3, 2, 4)
    # keys per split (tiles of 16): 64 -> 16, 16, 16, 16; 20 -> 16, 4, -, -; 1 -> 1, -, -, -
    assert (l > 0).tolist() == [[[True] * 4] * 2, [[True, True, False, False]] * 2, [[True, False, False, False]] * 2]
    ref = paged_decode_attention(q, k_cache, v_cache, minus_one(wide), lens, 0.25)
    torch.testing.assert_close(out.cpu(), ref, atol=ATOL[torch.float64], rtol=0)


def test_choose_num_splits():
    choose = ta.choose_num_splits
    assert choose(1, 8, 100, 132) == 1  # short: never cut below MIN_SPLIT_TOKENS
    assert choose(256, 8, 65536, 132) == 1  # the grid is full already
    assert choose(1, 8, 65536, 132) == ta.MAX_SPLITS  # one long sequence on an idle GPU: as many as allowed
    assert 1 < choose(4, 8, 4096, 132) <= 4096 // ta.MIN_SPLIT_TOKENS
    assert choose(0, 8, 0, 132) == 1


# ------------------------------------------------------------------------------------------ prefill

# (group, num_kv_heads, block_size, head_dim), the last two as in DECODE_SHAPES
PREFILL_SHAPES = [(1, 2, 16, 64), (2, 1, 1, 128), (4, 1, 256, 64), (8, 1, 16, 128), (2, 2, 256, 128), (4, 1, 1, 64),
                  (2, 2, 3, 80), (1, 2, 5, 8)]
# (context length, new tokens): a prefix across a block boundary with more new tokens than a tile,
# nothing cached, a single new token over a prefix, a single-token prompt, a prefix of whole tiles
PREFILL_SEQS = [(45, 20), (18, 18), (30, 1), (1, 1), (37, 5)]


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: "g{}-kv{}-bs{}-d{}".format(*s))
def test_prefill_over_a_cached_prefix_equals_the_reference(shape, dtype):
    group, num_kv_heads, block_size, head_dim = shape
    context_lens, q_lens = zip(*PREFILL_SEQS)
    k_cache, v_cache, tables, lens, g = random_paged_batch(context_lens, num_kv_heads, head_dim, block_size, dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    q = torch.randn(int(cu[-1]), group * num_kv_heads, head_dim, generator=g).to(dtype)
    out = ta.paged_prefill_attention_triton(*on_device(q, k_cache, v_cache, tables, lens), cu, head_dim ** -0.5,
                                            block_m=16, block_n=16).cpu()
    assert out.dtype == dtype and out.shape == q.shape
    for i, n in enumerate(context_lens):
        k, v = (gather_kv(c.double(), tables[i], n) for c in (k_cache, v_cache))
        ref = prefill_attention(q[cu[i]:cu[i + 1]].double(), k, v, head_dim ** -0.5)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]].double(), ref, atol=ATOL[dtype], rtol=0)


# ---------------------------------------------------------------------------------------- bad input

def test_the_wrappers_refuse_bad_input_with_a_clear_error():
    k_cache, v_cache, tables, lens, g = random_paged_batch([5, 3], 2, 16, 4, torch.float32)
    q = torch.randn(2, 4, 16, generator=g)
    decode = lambda **kw: ta.paged_decode_attention_triton(**{**dict(q=q, k_cache=k_cache, v_cache=v_cache,  # noqa: E731
                                                                      block_tables=tables, context_lens=lens,
                                                                      scale=0.25), **kw})
    cases = {
        "num_heads a multiple of num_kv_heads": dict(q=torch.randn(2, 3, 16)),
        "one dtype": dict(q=q.double()),
        "contiguous": dict(k_cache=k_cache.transpose(1, 2).contiguous().transpose(1, 2)),
        "block_tables must be int64": dict(block_tables=tables.int()),
        "context_lens must be 1-D int64": dict(context_lens=lens.int()),
        "of one shape and dtype": dict(v_cache=v_cache[:1]),
        "the Triton kernels take": dict(q=q.int(), k_cache=k_cache.int(), v_cache=v_cache.int()),
    }
    for message, kw in cases.items():
        with pytest.raises(ValueError, match=message):
            decode(**kw)
    for kw in (dict(block_n=8), dict(block_n=48)):
        with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
            decode(**kw)
    for bad in (0, ta.MAX_SPLITS + 1, 2.0):
        with pytest.raises(ValueError, match="num_splits must be None or an int"):
            decode(num_splits=bad)
    with pytest.raises(ValueError, match="cu_seqlens_q must be int64"):
        ta.paged_prefill_attention_triton(q, k_cache, v_cache, tables, lens, torch.tensor([0, 1]), 0.25)
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16"):
        ta.paged_prefill_attention_triton(q, k_cache, v_cache, tables, lens, torch.tensor([0, 1, 2]), 0.25, block_m=8)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        ta.store_kvcache(q[:, :2], q[:, :2], k_cache, v_cache, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="k and v must be"):
        ta.store_kvcache(q, q, k_cache, v_cache, torch.tensor([0, 1]))


# ------------------------------------------------------------------------------- a GPU's compiler

def test_every_launch_lowers_for_a_gpu_with_int64_cache_offsets():
    """The interpreter accepts what a GPU compiler refuses (a tl.dot over fewer than 16 columns) and
    computes every offset exactly. `triton_lowering.py` records the wrappers' launches over the
    shapes above (block sizes 3 and 5, heads of 8 and 80, GQA, one split and split-K, three dtypes)
    and lowers each through Triton's front end for an sm_90 GPU, in a process without the interpreter,
    with no GPU. Every launch must lower, and every offset added to a KV-cache pointer (or to the KV
    store's inputs) must be int64: one layer's cache on a large GPU can hold more than 2**31 elements."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, stated (newer releases warn otherwise)
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("triton_lowering.py"))], env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode == 3:
        pytest.skip(run.stderr.strip())
    assert run.returncode == 0, run.stderr[-3000:]
    launches = json.loads(run.stdout)
    assert {x["kernel"] for x in launches} == {"store_kvcache_kernel", "paged_decode_kernel", "reduce_splits_kernel",
                                              "paged_prefill_kernel"}
    errors = [(x["kernel"], x["constexprs"], x["error"]) for x in launches if x["error"]]
    assert not errors, errors
    for x in launches:
        if x["kernel"] != "reduce_splits_kernel":
            assert x["cache_offsets"] and all(o == "i64" or o.endswith("xi64>") for o in x["cache_offsets"]), x


# ------------------------------------------------------------------------------------------- engine

class _CountedKernel:
    """A kernel launched as `kernel[grid](...)` that counts its launches in `TwoSplitTriton.reductions`."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        TwoSplitTriton.reductions += 1
        return self.kernel[grid]


class TwoSplitTriton(TritonPagedAttention):
    """Two splits asked for in every decode, in tiles of 16 keys: the wrapper launches no more splits than
    tiles, so with its default 64-key tiles these contexts (under 64 keys) would never take the split-K
    path. `reductions` counts the reductions run (a class attribute: the engine makes the instances)."""

    num_splits = 2
    reductions = 0

    def decode(self, q, k_cache, v_cache, md):
        with mock.patch.object(ta, "reduce_splits_kernel", _CountedKernel(ta.reduce_splits_kernel)):
            return ta.paged_decode_attention_triton(q, k_cache, v_cache, md.block_tables, md.context_lens, self.scale,
                                                    num_splits=self.num_splits, block_n=16)


def test_engine_with_the_triton_backend_equals_transformers(tmp_path):
    """Float64 tiny Llama, prefix caching on, blocks of 8: one prompt, then three that share its first
    16 tokens (a cache hit, prefixes of 16 in one ragged prefill) and one that does not."""
    model = make_model(tmp_path, "llama")
    gen = torch.Generator().manual_seed(3)
    first = torch.randint(1, 128, (21,), generator=gen).tolist()
    later = [first[:16] + torch.randint(1, 128, (n,), generator=gen).tolist() for n in (1, 6, 11)]
    later.append(torch.randint(1, 128, (9,), generator=gen).tolist())
    llm = LLM(tmp_path, dtype="float64", device=DEVICE.type, attention_backend=TwoSplitTriton, block_size=8,
              num_kvcache_blocks=24, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    TwoSplitTriton.reductions = 0
    outs = llm.generate([first], params, use_tqdm=False) + llm.generate(later, params, use_tqdm=False)
    assert TwoSplitTriton.reductions > 0  # the split-K path ran
    for prompt, out in zip([first, *later], outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 6)
    assert [o.num_cached_tokens for o in outs] == [0, 16, 16, 16, 0]
    check_invariants(llm.llm_engine)


def test_chunked_prefill_through_the_triton_kernels_equals_transformers(tmp_path):
    """Chapter 11's mixed steps with the Triton backend: a budget of 8 tokens and a threshold of 5, so
    chunks of several prompts run beside decodes and read their cached prefixes through the kernels."""
    model = make_model(tmp_path, "llama")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 128, (n,), generator=gen).tolist() for n in (13, 3, 9)]
    prompts.append(prompts[0][:8] + [5, 6, 7])  # a hit on the first prompt's first block
    llm = LLM(tmp_path, dtype="float64", device=DEVICE.type, attention_backend=TwoSplitTriton, block_size=4,
              num_kvcache_blocks=24, max_model_len=64, max_num_batched_tokens=8, max_num_seqs=4,
              long_prefill_token_threshold=5)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 4)
    stats = llm.llm_engine.stats
    assert any(s.is_prefill and s.num_seqs > 1 for s in stats) and max(s.num_tokens for s in stats) <= 8
    check_invariants(llm.llm_engine)


# ------------------------------------------------------------------------------ the backend choice

def test_triton_is_chosen_on_cuda_only():
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        assert defaults.attention_backend_for(torch.device("cpu"), dtype) not in (TritonPagedAttention,
                                                                                  FlashAttnPagedAttention)
    assert TritonPagedAttention.is_available("cuda", torch.float32)
    assert not TritonPagedAttention.is_available("cuda", torch.float64)


def test_flash_attn_is_chosen_only_where_it_imports(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # find_spec: not importable
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert defaults.attention_backend_for(torch.device("cuda"), dtype) is TritonPagedAttention
    fake = types.ModuleType("flash_attn")
    fake.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    assert defaults.attention_backend_for(torch.device("cuda"), torch.bfloat16) is FlashAttnPagedAttention
    assert defaults.attention_backend_for(torch.device("cuda"), torch.float32) is TritonPagedAttention
    assert defaults.attention_backend_for(torch.device("cpu"), torch.bfloat16) is not FlashAttnPagedAttention


def fake_flash_attn() -> types.ModuleType:
    """A stand-in for flash-attn's two paged functions, written from their documented semantics in
    plain torch: it checks the backend's plumbing (shapes, int32 offsets, lengths), not flash-attn."""
    def with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal):
        assert q.shape[1] == 1 and cache_seqlens.dtype == block_table.dtype == torch.int32
        o = paged_decode_attention(q[:, 0], k_cache, v_cache, block_table.long(), cache_seqlens.long(), softmax_scale)
        return o[:, None]

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, block_table):
        assert causal and cu_q.dtype == cu_k.dtype == block_table.dtype == torch.int32
        out = []
        for i in range(len(cu_q) - 1):
            n = int(cu_k[i + 1] - cu_k[i])
            assert int(cu_q[i + 1] - cu_q[i]) <= max_q and n <= max_k
            ki, vi = (gather_kv(c, block_table[i].long(), n) for c in (k, v))
            out.append(prefill_attention(q[cu_q[i]:cu_q[i + 1]], ki, vi, softmax_scale))
        return torch.cat(out)

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_with_kvcache, fake.flash_attn_varlen_func = with_kvcache, varlen
    return fake


def test_flash_attn_backend_plumbing_with_a_stand_in(monkeypatch):
    """Untestable for real here (no flash-attn): with the stand-in, its prefill and decode over blocks
    of 256 give plain torch's results; with blocks of 16 it uses the Triton kernels."""
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn())
    for block_size in (256, 16):
        g = torch.Generator().manual_seed(0)
        kv_cache = torch.randn(2, 1, 3, block_size, 2, 16, dtype=torch.float64, generator=g).to(DEVICE)
        flash, plain = FlashAttnPagedAttention(kv_cache.clone(), 0.25), PagedAttention(kv_cache.clone(), 0.25)
        tables = torch.tensor([[2, -1], [0, 1]]) if block_size == 16 else torch.tensor([[2, -1], [0, -1]])
        lens, cu = torch.tensor([9, 20]), torch.tensor([0, 4, 24])  # 5 tokens cached, then nothing cached
        slots = torch.cat([tables[0, 0] * block_size + torch.arange(5, 9),
                           (tables[1, torch.arange(20) // block_size] * block_size + torch.arange(20) % block_size)])
        decode_slots = torch.stack([tables[i, n // block_size] * block_size + n % block_size
                                    for i, n in enumerate(lens.tolist())])
        steps = [AttentionMetadata(True, cu, *on_device(lens, slots, tables)),
                 AttentionMetadata(False, torch.tensor([0, 1, 2]), *on_device(lens + 1, decode_slots, tables))]
        for md in steps:
            n = int(md.cu_seqlens_q[-1])
            q, k, v = (torch.randn(n, h, 16, dtype=torch.float64, generator=g).to(DEVICE) for h in (4, 2, 2))
            for backend in (flash, plain):
                backend.metadata = md
            torch.testing.assert_close(flash(0, q, k, v), plain(0, q, k, v), atol=1e-12, rtol=0)
        assert torch.equal(flash.kv_cache, plain.kv_cache)


def check_all_kernels(dtype, shape, decode_lens, prefill_seqs, tiles=None, num_splits=(None, 1, 4)):
    """The KV store, decode (each `num_splits`) and prefill against the float64 reference for one
    dtype and `(group, num_kv_heads, block_size, head_dim)`; `tiles`: `block_n` (and `block_m`), None
    for the wrappers' defaults."""
    group, num_kv_heads, block_size, head_dim = shape
    k_cache, v_cache, tables, lens, g = random_paged_batch(decode_lens, num_kv_heads, head_dim, block_size, dtype)
    k_dev, v_dev = on_device(k_cache, v_cache)
    slots = torch.randperm(k_cache.shape[0] * block_size, generator=g)[:7]
    slots[2] = -1
    kv = torch.randn(7, num_kv_heads, head_dim, generator=g).to(dtype)
    k_stored, v_stored = k_dev.clone(), v_dev.clone()
    ta.store_kvcache(*on_device(kv, -kv), k_stored, v_stored, slots.to(DEVICE))
    keep = slots >= 0
    k_new, v_new = k_cache.clone(), v_cache.clone()
    k_new.view(-1, num_kv_heads, head_dim)[slots[keep]] = kv[keep]
    v_new.view(-1, num_kv_heads, head_dim)[slots[keep]] = -kv[keep]
    assert torch.equal(k_stored.cpu(), k_new) and torch.equal(v_stored.cpu(), v_new)
    q = torch.randn(len(lens), group * num_kv_heads, head_dim, generator=g).to(dtype)
    ref = paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), minus_one(tables), lens,
                                 head_dim ** -0.5)
    tile = {} if tiles is None else {"block_n": tiles}
    for n in num_splits:
        out = ta.paged_decode_attention_triton(q.to(DEVICE), k_dev, v_dev, *on_device(tables, lens), head_dim ** -0.5,
                                               num_splits=n, **tile)
        torch.testing.assert_close(out.cpu().double(), ref, atol=ATOL[dtype], rtol=0)
    context_lens, q_lens = zip(*prefill_seqs)
    k_cache, v_cache, tables, lens, g = random_paged_batch(context_lens, num_kv_heads, head_dim, block_size, dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    q = torch.randn(int(cu[-1]), group * num_kv_heads, head_dim, generator=g).to(dtype)
    tile = {} if tiles is None else {"block_m": tiles, "block_n": tiles}
    out = ta.paged_prefill_attention_triton(*on_device(q, k_cache, v_cache, tables, lens), cu, head_dim ** -0.5,
                                            **tile).cpu()
    for i, n in enumerate(context_lens):
        k, v = (gather_kv(c.double(), tables[i], n) for c in (k_cache, v_cache))
        ref = prefill_attention(q[cu[i]:cu[i + 1]].double(), k, v, head_dim ** -0.5)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]].double(), ref, atol=ATOL[dtype], rtol=0)


def test_check_all_kernels_runs_under_the_interpreter():
    """The GPU test's helper, on small shapes and tiles of 16 (it must not first fail on a GPU)."""
    check_all_kernels(torch.float32, (2, 2, 3, 80), [37, 1, 20], [(30, 20), (1, 1)], tiles=16, num_splits=(None, 3))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="needs CUDA: the kernels compiled for a GPU, at the engine's tile sizes")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gpu_kernels_at_their_default_tiles_equal_the_reference(dtype):
    """What the engine runs on a GPU: the compiled kernels with their default tiles (64), contexts of
    several tiles and splits, GQA 1/2/4/8, block sizes 3/5/16/256, heads of 8/64/80/128."""
    decode_lens, prefill_seqs = [700, 1, 64, 5, 300, 129], [(700, 150), (64, 64), (300, 1), (1, 1), (130, 65)]
    for shape in [(2, 8, 16, 128), (4, 2, 3, 80), (8, 1, 5, 8), (1, 2, 256, 64)]:
        check_all_kernels(dtype, shape, decode_lens, prefill_seqs)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="needs CUDA: the interpreter's tl.dot mishandles bfloat16")
def test_bfloat16_on_the_gpu():
    k_cache, v_cache, tables, lens, g = random_paged_batch(DECODE_LENS, 2, 128, 16, torch.bfloat16)
    q = torch.randn(len(lens), 8, 128, generator=g).to(torch.bfloat16)
    ref = paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), minus_one(tables), lens, 128 ** -0.5)
    for num_splits in (1, 3):
        out = ta.paged_decode_attention_triton(*on_device(q, k_cache, v_cache, tables, lens), 128 ** -0.5,
                                               num_splits=num_splits, block_n=16)
        torch.testing.assert_close(out.cpu().double(), ref, atol=ATOL[torch.bfloat16], rtol=0)
