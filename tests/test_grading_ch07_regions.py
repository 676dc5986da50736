"""Grading tests for chapter 07's rebuild exercises (`python -m minivllm.course.grade ch07_ex2`, or `pytest -m ch07_ex2`).

ch07_ex1 (the KV-store kernel), ch07_ex2 (the online-softmax step `_attend_tile`, and its calls
with the keys each row sees in the decode and the prefill kernel) and ch07_ex3 (the split-K
reduction kernel) are graded in the package itself: in a student edition they are the student's
kernels, exported from the chapter (stubs until filled), and there is no reference to compare with.
Each is graded alone, by its contract:

* ch07_ex1: the caches after `store_kvcache` equal `index_copy_` of the rows whose slot is not -1,
  every other slot keeps a sentinel (exact: a copy), for K/V given as strided views;
* ch07_ex2: decode with one split, decode with several splits whose raw `(m, l, acc)` the grader
  merges itself (a stand-in for ch07_ex3's kernel), and causal prefill over a cached prefix, each
  against softmax attention written here in float64 over each sequence's gathered keys;
* ch07_ex3: the reduction kernel fed partial results the grader computes from keys cut into splits
  (some empty, some rows with no key at all), against attention over all the keys.

Without CUDA the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set before the
kernels' module is imported, as tests/test_triton_kernels.py does) on CPU tensors and tiny shapes;
the interpreter reports an exception inside a kernel as `InterpreterError`, which `_in_kernel`
unwraps, so an untouched stub fails with its `NotImplementedError`. With CUDA the same tests run the
compiled kernels; the compiler reports an error in a `@triton.jit` function a kernel calls
(ch07_ex2's `_attend_tile`, its stub say) at the call, and `_in_kernel` brings out the error inside
it. The dtype is one of the drawn values in the attention graders (rather than a parameter), so
that a failure is shrunk once — float32 first — since each example is slow to run.
"""
from __future__ import annotations

import importlib
import math
import os
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

INTERPRETED = not torch.cuda.is_available()
if INTERPRETED:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton): chapter 07 is not graded")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import minivllm.attention.ops.triton_attention as ta  # noqa: E402

if INTERPRETED and not isinstance(ta.paged_decode_kernel, InterpretedFunction):
    ta = importlib.reload(ta)  # imported before TRITON_INTERPRET was set: define the kernels again

from engine_helpers import one_thread  # noqa: E402

try:  # Triton's interpreter wraps what a kernel raises
    from triton.runtime.errors import InterpreterError
except ImportError:  # pragma: no cover - older Triton
    InterpreterError = RuntimeError
try:  # the compiler's errors (a GPU), each wrapping the one inside a function the kernel calls
    from triton.compiler.errors import CompilationError
except ImportError:  # pragma: no cover - older Triton
    CompilationError = InterpreterError

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
GARBAGE = 10**9  # block-table entries past a sequence's last block: not a block, must never be read
LOG2E = 1 / math.log(2)
# Against float64 attention from the same rounded inputs. float32: sums of a few dozen products in
# another order, a few ulps of O(1) values. float16 / bfloat16: the probabilities are rounded to the
# cache's dtype before the P·V product (as FlashAttention does), 11 / 8 significant bits.
ATOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
# the interpreter's tl.dot mishandles bfloat16: the attention kernels are graded in bfloat16 on a GPU only
DOT_DTYPES = (torch.float32, torch.float16) if INTERPRETED else (torch.float32, torch.float16, torch.bfloat16)
ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


@contextmanager
def _in_kernel(ex: str):
    """Run a kernel; a stub's NotImplementedError comes out as itself, any other failure names `ex` (and,
    compiled, the error inside the function the kernel calls where the compiler reports only the call)."""
    try:
        yield
    except InterpreterError as e:
        if isinstance(e.__cause__, NotImplementedError):
            raise e.__cause__ from None
        raise AssertionError(f"{ex}: the kernel raised under Triton's interpreter: {e.__cause__ or e!r}") from e
    except CompilationError as e:
        inner = e
        while isinstance(inner.__cause__, CompilationError):  # a jit function the kernel calls (inlined)
            inner = inner.__cause__
        if inner is e:
            raise
        raise AssertionError(f"{ex}: the kernel did not compile, in a function it calls: "
                             f"{type(inner).__name__}: {inner}") from e


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _close(ex: str, got: torch.Tensor, want: torch.Tensor, atol: float, what: str) -> None:
    """assert_close with a message naming the exercise and the case (it gives the largest difference and where)."""
    if got.shape != want.shape:
        raise AssertionError(f"{ex}: expected shape {tuple(want.shape)}, got {tuple(got.shape)} ({what})")
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), atol=atol, rtol=atol,
                               msg=lambda m: f"{ex} ({what}): {m}")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, visible=None) -> torch.Tensor:
    """Softmax attention in float64. q `[rows, num_heads, d]`, k/v `[T, num_kv_heads, d]` (grouped
    heads: query head h reads K/V head h // group); visible `[rows, T]` bool (None: every key)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("rhd,thd->rht", q, k) * scale
    if visible is not None:
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("rht,thd->rhd", torch.softmax(s, dim=-1), v)


def _paged(lens, block_size, num_kv_heads, head_dim, dtype, seed):
    """K/V caches holding each sequence's keys in blocks drawn from a shuffled pool (a few blocks
    owned by nobody), block tables padded with GARBAGE; also each sequence's keys gathered in order."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    perm, start = torch.randperm(num_blocks, generator=g).tolist(), 0
    tables = torch.full((len(lens), max(need) + 1), GARBAGE, dtype=torch.int64)
    ks, vs = [], []
    for i, (n, b) in enumerate(zip(lens, need)):
        blocks = perm[start:start + b]
        start += b
        tables[i, :b] = torch.tensor(blocks, dtype=torch.int64)
        ks.append(k_cache[blocks].flatten(0, 1)[:n])
        vs.append(v_cache[blocks].flatten(0, 1)[:n])
    return k_cache, v_cache, tables, ks, vs, g


def _dev(*tensors):
    return [t.to(DEVICE) for t in tensors]


# --- ch07_ex1: the KV store ----------------------------------------------------------------------
SENTINEL = -7.0  # every cache slot no row names must keep it


@pytest.mark.ch07
@pytest.mark.ch07_ex1
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@settings(max_examples=6, deadline=None)
@given(num_blocks=st.integers(1, 5), block_size=st.sampled_from([1, 3, 4]), num_kv_heads=st.integers(1, 3),
       head_dim=st.sampled_from([5, 8, 12]), num_tokens=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_ch07_ex1_store_writes_each_slot_and_skips_minus_one(dtype, num_blocks, block_size, num_kv_heads,
                                                              head_dim, num_tokens, seed):
    """Each row's K and V land in its slot; rows with slot -1 and slots no row names are untouched."""
    g = torch.Generator().manual_seed(seed)
    num_slots = num_blocks * block_size
    slots = torch.randperm(max(num_slots, num_tokens), generator=g)[:num_tokens]
    slots[(slots >= num_slots) | (torch.rand(num_tokens, generator=g) < 0.3)] = -1  # padded rows
    kv = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, generator=g).to(dtype)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads + 1:]  # strided views, as a fused projection gives them
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # each cache is the middle of a larger tensor (contiguous all the same): a write outside the cache
    # lands in a guard and is reported, where the interpreter would otherwise write to unowned memory
    guarded = [torch.full((3 * num_blocks + 2, *shape[1:]), SENTINEL, dtype=dtype, device=DEVICE) for _ in range(2)]
    k_cache, v_cache = (t[num_blocks + 1:2 * num_blocks + 1] for t in guarded)
    with _in_kernel("ch07_ex1"):
        ta.store_kvcache(*_dev(k, v), k_cache, v_cache, slots.to(DEVICE))
    keep = slots >= 0
    for name, t in zip("KV", guarded):
        outside = torch.cat([t[:num_blocks + 1], t[2 * num_blocks + 1:]])
        _expect(bool((outside == SENTINEL).all()),
                f"ch07_ex1 ({dtype}): the kernel wrote outside the {name} cache (slot_mapping {slots.tolist()}, "
                f"-1 = write nothing; a cache of {num_blocks * block_size} slots, {num_kv_heads} KV heads of {head_dim})")
    for name, got, x in (("K", k_cache, k), ("V", v_cache, v)):
        want = torch.full(shape, SENTINEL, dtype=dtype)
        want.view(-1, num_kv_heads, head_dim).index_copy_(0, slots[keep], x[keep])
        diff = (got.cpu() != want).any(-1).any(-1).flatten().nonzero().flatten().tolist()
        if diff:
            raise AssertionError(
                f"ch07_ex1 ({dtype}): the {name} cache differs from the expected copy at flat slots {diff} "
                f"(slot_mapping {slots.tolist()}, -1 = write nothing; {num_kv_heads} KV heads of {head_dim}; "
                f"a slot no row names must keep {SENTINEL})")


# --- ch07_ex2: the online softmax in the decode and prefill kernels --------------------------------
class _GraderReduce:
    """A stand-in for `reduce_splits_kernel` (ch07_ex3), launched as `[grid](...)`: merges the decode
    kernel's partial `(m, l, acc)` in float64 (m in log2 units, as the kernel's scores)."""

    def __getitem__(self, grid):
        def launch(acc, m, l, out, num_splits, *args, **kwargs):
            m64, l64, acc64 = m.double(), l.double(), acc.double()
            top = m64.max(dim=-1, keepdim=True).values
            w = torch.exp2(m64 - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
            total = (w * l64).sum(-1, keepdim=True)
            o = (w[..., None] * acc64).sum(-2) / torch.where(total > 0, total, torch.ones_like(total))
            out.copy_(o.to(out.dtype))
        return launch


@pytest.mark.ch07
@pytest.mark.ch07_ex2
@settings(max_examples=10, deadline=None)
@given(dtype=st.sampled_from(DOT_DTYPES), lens=st.lists(st.integers(1, 40), min_size=1, max_size=3), block_size=st.sampled_from([1, 4, 16]),
       group=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([8, 16]), num_splits=st.sampled_from([1, 2, 3]),
       seed=st.integers(0, 2**16))
def test_ch07_ex2_decode_equals_attention(dtype, lens, block_size, group, head_dim, num_splits, seed):
    """One query per sequence over its keys (tiles of 16, through a shuffled block table) equals
    softmax attention; with several splits, the kernel's partial results merged by the grader do."""
    num_kv_heads = 2
    k_cache, v_cache, tables, ks, vs, g = _paged(lens, block_size, num_kv_heads, head_dim, dtype, seed)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    with mock.patch.object(ta, "reduce_splits_kernel", _GraderReduce()), _in_kernel("ch07_ex2"):
        got = ta.paged_decode_attention_triton(*_dev(q, k_cache, v_cache, tables, torch.tensor(lens)), scale,
                                               num_splits=num_splits, block_n=16)
    for i, n in enumerate(lens):
        want = _attend(q[i:i + 1], ks[i], vs[i], scale)[0]
        _close("ch07_ex2", got[i], want, ATOL[dtype],
               f"decode, {dtype}, sequence {i} of context_lens {lens}, block_size {block_size}, "
               f"{group * num_kv_heads} query heads over {num_kv_heads} KV heads, {num_splits} split(s) of whole "
               f"16-key tiles{'' if num_splits == 1 else ' merged by the grader'}")


@pytest.mark.ch07
@pytest.mark.ch07_ex2
@settings(max_examples=8, deadline=None)
@given(dtype=st.sampled_from(DOT_DTYPES), cases=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 20)), min_size=1, max_size=3),
       block_size=st.sampled_from([1, 4, 16]), group=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_ch07_ex2_prefill_equals_causal_attention(dtype, cases, block_size, group, seed):
    """Each sequence's new tokens (after a cached prefix) over all its keys up to their own position
    equal causal softmax attention."""
    num_kv_heads, head_dim = 2, 16
    prefixes, news = [p for p, _ in cases], [n for _, n in cases]
    lens = [p + n for p, n in cases]
    k_cache, v_cache, tables, ks, vs, g = _paged(lens, block_size, num_kv_heads, head_dim, dtype, seed)
    q = torch.randn(sum(news), num_kv_heads * group, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0] + news).cumsum(0)
    scale = head_dim ** -0.5
    with _in_kernel("ch07_ex2"):
        got = ta.paged_prefill_attention_triton(*_dev(q, k_cache, v_cache, tables, torch.tensor(lens), cu),
                                                scale, block_m=16, block_n=16)
    for i, (p, n) in enumerate(cases):
        visible = torch.arange(p + n)[None, :] <= torch.arange(p, p + n)[:, None]
        want = _attend(q[cu[i]:cu[i + 1]], ks[i], vs[i], scale, visible)
        _close("ch07_ex2", got[cu[i]:cu[i + 1]], want, ATOL[dtype],
               f"prefill, {dtype}, sequence {i} of (cached prefix, new tokens) {cases}, block_size {block_size}, "
               f"{group * num_kv_heads} query heads over {num_kv_heads} KV heads; rows are the new tokens")


# --- ch07_ex3: the split reduction ---------------------------------------------------------------
def _partials(q, keys, values, scale, split_len, num_splits):
    """The decode kernel's contract for one (sequence, head): per split, m = the largest score (log2
    units, -inf when the split is empty), l = Σ 2^(s - m), acc = Σ 2^(s - m) v. float64."""
    s = (keys.double() @ q.double()) * scale * LOG2E
    ms, ls, accs = [], [], []
    for p in range(num_splits):
        sp, vp = s[p * split_len:(p + 1) * split_len], values[p * split_len:(p + 1) * split_len].double()
        if sp.numel() == 0:
            ms.append(float("-inf")), ls.append(0.0), accs.append(torch.zeros(values.shape[1], dtype=torch.float64))
            continue
        w = torch.exp2(sp - sp.max())
        ms.append(float(sp.max())), ls.append(float(w.sum())), accs.append(w @ vp)
    return torch.tensor(ms, dtype=torch.float64), torch.tensor(ls, dtype=torch.float64), torch.stack(accs)


@pytest.mark.ch07
@pytest.mark.ch07_ex3
@settings(max_examples=12, deadline=None)
@given(dtype=st.sampled_from(ALL_DTYPES), lens=st.lists(st.integers(0, 40), min_size=1, max_size=3), num_heads=st.integers(1, 3),
       head_dim=st.sampled_from([8, 12]), num_splits=st.integers(1, 5), split_len=st.sampled_from([4, 16]),
       seed=st.integers(0, 2**16))
def test_ch07_ex3_reduction_equals_attention(dtype, lens, num_heads, head_dim, num_splits, split_len, seed):
    """Partial results of keys cut into `num_splits` splits (the tail ones empty when the keys run
    out; a sequence of 0 keys has only empty splits and gets zeros), merged by the kernel, equal
    softmax attention over all the keys."""
    g = torch.Generator().manual_seed(seed)
    lens = [min(n, num_splits * split_len) for n in lens]
    scale = head_dim ** -0.5
    shape = (len(lens), num_heads, num_splits)
    m, l = torch.empty(shape, dtype=torch.float32), torch.empty(shape, dtype=torch.float32)
    acc = torch.empty(*shape, head_dim, dtype=torch.float32)
    want = torch.zeros(len(lens), num_heads, head_dim, dtype=torch.float64)
    for i, n in enumerate(lens):
        for h in range(num_heads):
            q = torch.randn(head_dim, generator=g, dtype=torch.float64)
            keys, values = (torch.randn(n, head_dim, generator=g, dtype=torch.float64) for _ in range(2))
            m64, l64, acc64 = _partials(q, keys, values, scale, split_len, num_splits)
            m[i, h], l[i, h], acc[i, h] = m64, l64, acc64
            if n:
                want[i, h] = torch.softmax(keys @ q * scale, dim=0) @ values
    # the grader's partials are exact to float32 rounding; the output's own dtype rounds once more
    out = torch.full((len(lens), num_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    acc_d, m_d, l_d = _dev(acc, m, l)
    with _in_kernel("ch07_ex3"):
        ta.reduce_splits_kernel[(len(lens), num_heads)](
            acc_d, m_d, l_d, out, num_splits, out.stride(0), out.stride(1), NUM_HEADS=num_heads,
            HEAD_DIM=head_dim, BLOCK_P=triton.next_power_of_2(num_splits), BLOCK_D=ta._block_d(head_dim))
    _close("ch07_ex3", out, want, ATOL[dtype],
           f"{dtype} output, context_lens {lens} cut into {num_splits} splits of {split_len} keys "
           f"(m = -inf, l = 0 for an empty split), {num_heads} head(s) of {head_dim}; rows of 0 keys want zeros")
