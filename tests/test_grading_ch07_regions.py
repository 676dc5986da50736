"""Grading tests for chapter 07's rebuild exercises (`python -m minivllm.course.grade ch07`, or `pytest -m ch07_ex2`).

ch07_ex1 (the KV-store kernel) and ch07_ex2 (the build: paged decode attention with split-K, in three
kernels: the online-softmax step `_attend_tile`, the per-split `paged_decode_kernel`, the reduction
`reduce_splits_kernel`) are graded in the package itself: in a student edition they are the student's
kernels, exported from the chapter (stubs until filled), and there is no reference to compare with.
Each is graded by its contract, against references written here (each sequence's keys gathered through
its block table, softmax in float64):

* ch07_ex1: the caches after `store_kvcache` equal `index_copy_` of the rows whose slot is not -1,
  every other slot keeps a sentinel (exact: a copy), for K/V given as strided views;
* ch07_ex2, in six parts (`@pytest.mark.group`, the groups of `EXERCISES["ch07_ex2"]`), each kernel
  with the grader's own version of the others where it can be (`_rebuilt`): the step, walked by the
  grader's kernel (its m, l and acc / l); the per-split kernel with one split, and with several splits
  whose partial results (in buffers that start as NaN) the grader checks (each split's m and l against
  the split's own scores) and merges, q always a strided view (sliced out of a fused qkv tensor); the
  reduction fed partial results the grader computes (also with every split's m shifted by +-200, which
  must not change the output); the engine on all three against transformers' greedy tokens, with
  tiles of 16 keys so that its decodes really run two splits and the reduction; and, on a GPU only,
  the speed. The tests at the end check that plausible wrong answers lose exactly their parts.

Hypothesis draws tiny shapes, derandomized (the same answer always scores the same points). Without
CUDA the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set before the kernels' module
is imported, as tests/test_triton_kernels.py does) on CPU tensors; the interpreter reports an exception
inside a kernel as `InterpreterError`, which `_in_kernel` unwraps, so an untouched stub fails with its
`NotImplementedError`. With CUDA the same tests run the compiled kernels; the compiler reports an error
in a `@triton.jit` function a kernel calls (`_attend_tile`'s stub, say) at the call, and `_in_kernel`
brings out the error inside it. The dtype is one of the drawn values in the attention graders (rather
than a parameter), so that a failure is shrunk once, float32 first, since each example is slow to run.
"""
from __future__ import annotations

import importlib
import math
import os
import types
from contextlib import ExitStack, contextmanager
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

INTERPRETED = not torch.cuda.is_available()
if INTERPRETED:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton): chapter 07 is not graded")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import minivllm.attention.ops.triton_attention as ta  # noqa: E402

if INTERPRETED and not isinstance(ta.paged_decode_kernel, InterpretedFunction):
    ta = importlib.reload(ta)  # imported before TRITON_INTERPRET was set: define the kernels again

from engine_helpers import one_thread, speed_ratio  # noqa: E402

from minivllm.attention.backends.triton_attn import TritonPagedAttention  # noqa: E402
from minivllm.course.grade import EXERCISES as GRADED, SPEED_RATIO  # noqa: E402
from minivllm.course.testing import make_tiny_model  # noqa: E402
from minivllm.llm import LLM  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402

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
    compiled, the error inside the function the kernel calls where the compiler reports only the call).
    Under the interpreter NumPy's floating-point warnings are off: a right answer computes lanes that
    `tl.where` then drops (`exp2(-inf - -inf)` for an empty row, say), and NumPy would warn "invalid value
    encountered in subtract" for them; what a kernel stores is checked against the reference anyway."""
    try:
        with np.errstate(all="ignore"):
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
@settings(max_examples=6, deadline=None, database=None, derandomize=True, report_multiple_bugs=False)
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


# --- ch07_ex2: the build, paged decode attention with split-K ------------------------------------
# Six parts (the last, speed, on a GPU only). Each kernel of the build is graded with the grader's own version of the others where it
# can be: `_rebuilt` makes a fresh copy of a kernel whose global names (the `@triton.jit` functions it
# calls) point at other functions, which works compiled as well as under the interpreter (the compiler
# reads a kernel's globals from its function, and the copy's cache is its own).
STEP, ONE_SPLIT, SPLIT_K, REDUCE, ENGINE, SPEED = (name for name, _ in GRADED["ch07_ex2"].groups)
_REBUILT: dict = {}


def _rebuilt(kernel, **names):
    """`kernel` (a `@triton.jit` function) with the global `names` bound to other objects (cached)."""
    key = (id(kernel), tuple(sorted((k, id(v)) for k, v in names.items())))
    if key not in _REBUILT:
        fn = kernel.fn
        copy = types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__, fn.__defaults__,
                                  fn.__closure__)
        _REBUILT[key] = (triton.jit(copy), kernel, names)  # keep the originals alive: ids stay unique
    return _REBUILT[key][0]


@triton.jit
def _grader_attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """The grader's online-softmax step (the stand-in for `_attend_tile` in the decode kernel's parts)."""
    scores = tl.where(visible, tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=ACC_DTYPE) * qk_scale,
                      -float("inf"))
    top = tl.maximum(m_i, tl.max(scores, axis=1))
    keep = tl.exp2(m_i - top)  # what the old running values are worth against the new maximum
    w = tl.exp2(scores - top[:, None])
    acc = acc * keep[:, None] + tl.dot(w.to(v.dtype), v, input_precision=PRECISION, out_dtype=ACC_DTYPE)
    return top, l_i * keep + tl.sum(w, axis=1), acc


attend_tile = _grader_attend_tile  # the step `_step_kernel` calls; `_rebuilt` binds the package's (the student's)
STEP_ROWS, STEP_TILE = 16, 16  # rows of q in `_step_kernel` (a GPU's tl.dot wants 16 or more), keys per tile


@triton.jit
def _step_kernel(q_ptr, k_ptr, v_ptr, vis_ptr, m_ptr, l_ptr, acc_ptr, num_keys, qk_scale, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ACC_DTYPE: tl.constexpr,
                 PRECISION: tl.constexpr):
    """The grader's walk: contiguous q `[ROWS, HEAD_DIM]`, k, v `[num_keys, HEAD_DIM]`, visibility `[ROWS,
    num_keys]` int8, fed tile by tile to `attend_tile`; stores the final m, l `[ROWS]` and acc `[ROWS, BLOCK_D]`."""
    r = tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    cols = d[None, :] < HEAD_DIM
    q = tl.load(q_ptr + r[:, None] * HEAD_DIM + d[None, :], mask=cols, other=0.0)
    m = tl.full([ROWS], -float("inf"), ACC_DTYPE)
    l = tl.zeros([ROWS], ACC_DTYPE)
    acc = tl.zeros([ROWS, BLOCK_D], ACC_DTYPE)
    for t0 in range(0, num_keys, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        inside = t < num_keys
        k = tl.load(k_ptr + t[:, None] * HEAD_DIM + d[None, :], mask=inside[:, None] & cols, other=0.0)
        v = tl.load(v_ptr + t[:, None] * HEAD_DIM + d[None, :], mask=inside[:, None] & cols, other=0.0)
        vis = tl.load(vis_ptr + r[:, None] * num_keys + t[None, :], mask=inside[None, :], other=0) != 0
        m, l, acc = attend_tile(q, k, v, vis, m, l, acc, qk_scale, ACC_DTYPE, PRECISION)
    tl.store(m_ptr + r, m)
    tl.store(l_ptr + r, l)
    tl.store(acc_ptr + r[:, None] * BLOCK_D + d[None, :], acc)


# m and l of the step against float64 from the same rounded inputs: scores are sums of HEAD_DIM products
# accumulated in float32 (a few ulps of values of a few units: 1e-4 in log2 units covers them, float16
# inputs' products are exact in float32), l a sum of 2^(s - m) in float32 (1e-4 relative); acc / l: ATOL.
STEP_TOL = 1e-4


def check_step(num_keys: int, head_dim: int, dtype, seed: int, attend=None) -> None:
    """`attend` (default: the package's `_attend_tile`, the student's) walked over `num_keys` keys by the
    grader's kernel, rows seeing random keys (key 0 always: the contract), the first rows causal (row r
    sees keys 0..r, so later tiles hide every key from it): m, l and acc / l against float64."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, head_dim, generator=g).to(dtype) for n in (STEP_ROWS, num_keys, num_keys))
    t = torch.arange(num_keys)
    visible = (torch.rand(STEP_ROWS, num_keys, generator=g) < 0.6) | (t[None, :] == 0)
    visible[:4] = t[None, :] <= torch.arange(4)[:, None]
    scale = head_dim ** -0.5
    block_d = ta._block_d(head_dim)
    acc_dtype = torch.float32
    m, l = (torch.full((STEP_ROWS,), float("nan"), dtype=acc_dtype, device=DEVICE) for _ in range(2))
    acc = torch.full((STEP_ROWS, block_d), float("nan"), dtype=acc_dtype, device=DEVICE)
    kernel = _rebuilt(_step_kernel, attend_tile=attend if attend is not None else ta._attend_tile)
    with _in_kernel("ch07_ex2"):
        kernel[(1,)](*_dev(q, k, v, visible.to(torch.int8)), m, l, acc, num_keys, scale * LOG2E, HEAD_DIM=head_dim,
                     BLOCK_D=block_d, ROWS=STEP_ROWS, BLOCK_N=STEP_TILE, ACC_DTYPE=tl.float32, PRECISION=_precision(dtype))
    s = (q.double() @ k.double().T * scale * LOG2E).masked_fill(~visible, float("-inf"))
    m_want = s.max(dim=1).values
    w = torch.exp2(s - m_want[:, None])
    l_want, acc_want = w.sum(1), w @ v.double()
    what = (f"_attend_tile ({dtype}) walked over {num_keys} keys in tiles of {STEP_TILE} by the grader's kernel, "
            f"{STEP_ROWS} rows of head_dim {head_dim}, random visibility (rows 0-3 causal), m in log2 units")
    _close("ch07_ex2", m.cpu(), m_want, STEP_TOL, f"m, the running maximum: {what}")
    _close("ch07_ex2", l.cpu(), l_want, STEP_TOL, f"l, the sum of 2^(s - m): {what}")
    _close("ch07_ex2", acc.cpu()[:, :head_dim] / l.cpu()[:, None], acc_want / l_want[:, None], ATOL[dtype],
           f"acc / l, the attention output: {what}")


def _precision(dtype) -> str:
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


@pytest.mark.ch07
@pytest.mark.ch07_ex2
@pytest.mark.group(STEP)
@settings(max_examples=20, deadline=None, database=None, derandomize=True, report_multiple_bugs=False)
@given(dtype=st.sampled_from(DOT_DTYPES), num_keys=st.integers(1, 48), head_dim=st.sampled_from([8, 12, 16]),
       seed=st.integers(0, 2**16))
def test_ch07_ex2_online_softmax_step(dtype, num_keys, head_dim, seed):
    """`_attend_tile`, called tile by tile by the grader's kernel over contiguous keys, keeps m (the largest
    visible score, log2 units), l = sum 2^(s - m) and acc = sum 2^(s - m) v: checked against float64."""
    check_step(num_keys, head_dim, dtype, seed)


class _GraderReduce:
    """A stand-in for `reduce_splits_kernel`, launched as `[grid](...)`: merges the decode kernel's
    partial `(m, l, acc)` in float64 (m in log2 units, as the kernel's scores); keeps the last m and l
    it was given (`partials`) for the grader to check."""

    partials: tuple | None = None

    def __getitem__(self, grid):
        def launch(acc, m, l, out, num_splits, *args, **kwargs):
            self.partials = (m.detach().cpu().clone(), l.detach().cpu().clone())
            m64, l64, acc64 = m.double(), l.double(), acc.double()
            top = m64.max(dim=-1, keepdim=True).values
            w = torch.exp2(m64 - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
            total = (w * l64).sum(-1, keepdim=True)
            o = (w[..., None] * acc64).sum(-2) / torch.where(total > 0, total, torch.ones_like(total))
            out.copy_(o.to(out.dtype))
        return launch


class _CountLaunches:
    """Wraps a kernel launched as `kernel[grid](...)`, keeping each launch's grid (`grids`)."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


class _NaNTorch:
    """`torch` as the decode wrapper sees it in the split-K part, with `empty` and `empty_like` filled with
    NaN: an entry of the partial buffers that the kernel should write and does not shows in the merge."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        return torch.empty(*args, **kwargs).fill_(float("nan"))

    @staticmethod
    def empty_like(*args, **kwargs):
        return torch.empty_like(*args, **kwargs).fill_(float("nan"))


def _fused_q(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, g) -> torch.Tensor:
    """q `[num_seqs, num_heads, head_dim]` as the model hands it over: a view sliced out of a fused qkv
    projection `[num_seqs, (num_heads + 2 * num_kv_heads) * head_dim]`, so a sequence's row stride is
    not num_heads * head_dim (the last dim contiguous, as the wrapper wants), on DEVICE."""
    qkv = torch.randn(num_seqs, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype).to(DEVICE)
    return qkv[:, :num_heads * head_dim].view(num_seqs, num_heads, head_dim)


def _check_partials(partials, q, ks, lens, scale, dtype, what) -> None:
    """The decode kernel's partial m and l `[num_seqs, num_heads, num_splits]` against each split's own
    scores (the docstring's split rule, tiles of 16): m = the split's largest score in log2 units (-inf
    when empty), l = sum 2^(s - m) (0 when empty). The merge alone cannot see a wrong m: the reduction's
    weights cancel any common shift, so a running max started at 0 instead of -inf passes it."""
    m_got, l_got = partials
    num_splits = m_got.shape[-1]
    m_want, l_want = torch.empty(m_got.shape, dtype=torch.float64), torch.empty(l_got.shape, dtype=torch.float64)
    group = q.shape[1] // ks[0].shape[1] if ks else 1
    for i, n in enumerate(lens):
        split_len = max(-(-(-(-n // num_splits)) // 16) * 16, 16)
        for h in range(q.shape[1]):
            s = (ks[i][:, h // group].double() @ q[i, h].double()) * scale * LOG2E
            for p in range(num_splits):
                sp = s[p * split_len:(p + 1) * split_len]
                m_want[i, h, p] = sp.max() if sp.numel() else float("-inf")
                l_want[i, h, p] = torch.exp2(sp - sp.max()).sum() if sp.numel() else 0.0
    _close("ch07_ex2", m_got, m_want, STEP_TOL, f"the partial m (each split's largest score, log2 units; "
           f"-inf for an empty split) [sequence, head, split]: {what}")
    _close("ch07_ex2", l_got, l_want, STEP_TOL, f"the partial l = sum 2^(s - m) over each split's keys "
           f"[sequence, head, split]: {what}")


def check_decode(lens, block_size, num_kv_heads, group, head_dim, dtype, num_splits, seed, kernel=None) -> None:
    """`kernel` (default: the package's `paged_decode_kernel`, the student's) with the grader's
    `_attend_tile`, launched by the book's wrapper (tiles of 16) over shuffled block tables padded with
    garbage, q a strided view (`_fused_q`); with several splits the partial buffers start as NaN, the
    grader checks each split's m and l (`_check_partials`) and merges them. Each sequence against
    softmax over its gathered keys in float64 (0 keys: zeros)."""
    k_cache, v_cache, tables, ks, vs, g = _paged(lens, block_size, num_kv_heads, head_dim, dtype, seed)
    q_dev = _fused_q(len(lens), num_kv_heads * group, num_kv_heads, head_dim, dtype, g)
    q = q_dev.cpu()
    scale = head_dim ** -0.5
    decode = _rebuilt(kernel if kernel is not None else ta.paged_decode_kernel, _attend_tile=_grader_attend_tile)
    reduce = _GraderReduce()
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(ta, "paged_decode_kernel", decode))
        if num_splits > 1:
            stack.enter_context(mock.patch.object(ta, "reduce_splits_kernel", reduce))
            stack.enter_context(mock.patch.object(ta, "torch", _NaNTorch()))
        stack.enter_context(_in_kernel("ch07_ex2"))
        got = ta.paged_decode_attention_triton(q_dev, *_dev(k_cache, v_cache, tables, torch.tensor(lens)), scale,
                                               num_splits=num_splits, block_n=16)
    what = (f"paged_decode_kernel, {dtype}, context_lens {lens}, block_size {block_size}, {group * num_kv_heads} "
            f"query heads over {num_kv_heads} KV heads of {head_dim}, {num_splits} splits of whole 16-key tiles")
    for i, n in enumerate(lens):
        want = _attend(q[i:i + 1], ks[i], vs[i], scale)[0] if n else torch.zeros(q.shape[1:], dtype=torch.float64)
        _close("ch07_ex2", got[i], want, ATOL[dtype],
               f"paged_decode_kernel, {dtype}, sequence {i} of context_lens {lens}, block_size {block_size}, "
               f"{group * num_kv_heads} query heads over {num_kv_heads} KV heads of {head_dim}, "
               + ("one split (ONE_SPLIT: the kernel stores o = acc / l)" if num_splits == 1 else
                  f"{num_splits} splits of whole 16-key tiles, your partial acc, m, l merged by the grader "
                  "(NaN: an entry never written; an empty split stores m = -inf, l = 0, acc = 0)")
               + f"; q a view whose sequence stride is {q_dev.stride(0)}, not num_heads * head_dim = "
               f"{q.shape[1] * head_dim}")
    if num_splits > 1 and min(num_splits, -(-tables.shape[1] * block_size // 16)) > 1:
        _expect(reduce.partials is not None, f"ch07_ex2: the partial results were never merged ({what})")
        _check_partials(reduce.partials, q, ks, lens, scale, dtype, what)


DECODE_SHAPES = dict(lens=st.lists(st.integers(0, 40), min_size=1, max_size=3), block_size=st.sampled_from([1, 3, 4, 16]),
                     num_kv_heads=st.integers(1, 2), group=st.sampled_from([1, 2, 4, 8]),
                     head_dim=st.sampled_from([8, 12, 16]), seed=st.integers(0, 2**16))


@pytest.mark.ch07
@pytest.mark.ch07_ex2
@pytest.mark.group(ONE_SPLIT)
@settings(max_examples=25, deadline=None, database=None, derandomize=True, report_multiple_bugs=False)
@given(dtype=st.sampled_from(DOT_DTYPES), **DECODE_SHAPES)
def test_ch07_ex2_one_split_equals_attention(dtype, lens, block_size, num_kv_heads, group, head_dim, seed):
    """One split: each sequence's query heads over its keys (tiles of 16 through a shuffled block table;
    lengths 0 to 40, blocks of 1, 3, 4 and 16 tokens, 1 to 8 query heads per KV head) equal attention."""
    check_decode(lens, block_size, num_kv_heads, group, head_dim, dtype, 1, seed)


@pytest.mark.ch07
@pytest.mark.ch07_ex2
@pytest.mark.group(SPLIT_K)
@settings(max_examples=25, deadline=None, database=None, derandomize=True, report_multiple_bugs=False)
@given(dtype=st.sampled_from(DOT_DTYPES), num_splits=st.integers(2, 4), **DECODE_SHAPES)
def test_ch07_ex2_split_k_partials_merge_to_attention(dtype, num_splits, lens, block_size, num_kv_heads, group,
                                                      head_dim, seed):
    """Two to four splits (the short sequences' last ones empty): the partial results, merged by the
    grader, equal attention."""
    check_decode(lens, block_size, num_kv_heads, group, head_dim, dtype, num_splits, seed)


# --- the reduction ---------------------------------------------------------------------------------
def _partials(q, keys, values, scale, split_len, num_splits, offset=0.0):
    """The decode kernel's contract for one (sequence, head): per split, m = the largest score (log2
    units, -inf when the split is empty), l = sum 2^(s - m), acc = sum 2^(s - m) v. float64, with m
    rounded to float32 first (the buffers' dtype) and l, acc computed against that m, so the three
    agree exactly. `offset` is added to every score (log2 units): it moves every m and leaves l, acc
    and the attention output as they are."""
    s = (keys.double() @ q.double()) * scale * LOG2E + offset
    ms, ls, accs = [], [], []
    for p in range(num_splits):
        sp, vp = s[p * split_len:(p + 1) * split_len], values[p * split_len:(p + 1) * split_len].double()
        if sp.numel() == 0:
            ms.append(float("-inf")), ls.append(0.0), accs.append(torch.zeros(values.shape[1], dtype=torch.float64))
            continue
        top = float(sp.max().float())
        w = torch.exp2(sp - top)
        ms.append(top), ls.append(float(w.sum())), accs.append(w @ vp)
    return torch.tensor(ms, dtype=torch.float64), torch.tensor(ls, dtype=torch.float64), torch.stack(accs)


def check_reduce(lens, num_heads, head_dim, num_splits, split_len, dtype, seed, kernel=None, offset=0.0) -> None:
    """`kernel` (default: the package's `reduce_splits_kernel`, the student's) fed the grader's partial
    results of keys cut into `num_splits` splits (the tail ones empty when the keys run out; a sequence
    of 0 keys has only empty splits and wants zeros), against softmax attention over all the keys.
    `offset` (log2 units) is added to every score, so to every split's m: the output must not change
    (weights 2^m without subtracting the largest m overflow at +200 and underflow at -200 in float32)."""
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
            m64, l64, acc64 = _partials(q, keys, values, scale, split_len, num_splits, offset)
            m[i, h], l[i, h], acc[i, h] = m64, l64, acc64
            if n:
                want[i, h] = torch.softmax(keys @ q * scale, dim=0) @ values
    # the grader's partials are exact to float32 rounding; the output's own dtype rounds once more
    out = torch.full((len(lens), num_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    acc_d, m_d, l_d = _dev(acc, m, l)
    with _in_kernel("ch07_ex2"):
        (kernel if kernel is not None else ta.reduce_splits_kernel)[(len(lens), num_heads)](
            acc_d, m_d, l_d, out, num_splits, out.stride(0), out.stride(1), NUM_HEADS=num_heads,
            HEAD_DIM=head_dim, BLOCK_P=triton.next_power_of_2(num_splits), BLOCK_D=ta._block_d(head_dim))
    _close("ch07_ex2", out, want, ATOL[dtype],
           f"reduce_splits_kernel, {dtype} output, context_lens {lens} cut into {num_splits} splits of {split_len} "
           f"keys (m = -inf, l = 0 for an empty split), {num_heads} head(s) of {head_dim}; rows of 0 keys want zeros"
           + (f"; every score and m shifted by {offset:+g} (log2 units), which leaves the output as it is" if offset else ""))


@pytest.mark.ch07
@pytest.mark.ch07_ex2
@pytest.mark.group(REDUCE)
@settings(max_examples=20, deadline=None, database=None, derandomize=True, report_multiple_bugs=False)
@given(dtype=st.sampled_from(ALL_DTYPES), lens=st.lists(st.integers(0, 40), min_size=1, max_size=3),
       num_heads=st.integers(1, 3), head_dim=st.sampled_from([8, 12]), num_splits=st.integers(1, 5),
       split_len=st.sampled_from([4, 16]), offset=st.sampled_from([0.0, 200.0, -200.0]), seed=st.integers(0, 2**16))
def test_ch07_ex2_reduction_merges_partials(dtype, lens, num_heads, head_dim, num_splits, split_len, offset, seed):
    """The partial results of keys cut into splits, merged by the kernel, equal attention over all the keys,
    also when every split's m carries a common offset of +-200 (log2 units: weights must be 2^(m - max m))."""
    check_reduce(lens, num_heads, head_dim, num_splits, split_len, dtype, seed, offset=offset)


# --- the engine ------------------------------------------------------------------------------------
ENGINE_BLOCK_N = 16  # keys per decode tile in the engine part: the wrapper caps the splits at the tiles


class _GraderKVStore(TritonPagedAttention):
    """The Triton backend asking for two splits in every decode, with tiles of 16 keys (the wrapper
    launches no more splits than tiles: with its default 64-key tiles these contexts of at most 31
    keys would be one split, and neither the partial store nor the reduction would run), and the
    grader's KV store (ch07_ex1 is graded on its own): your three kernels, and the book's prefill
    kernel, which calls your `_attend_tile`."""

    num_splits = 2

    def decode(self, q, k_cache, v_cache, md):
        return ta.paged_decode_attention_triton(q, k_cache, v_cache, md.block_tables, md.context_lens, self.scale,
                                                num_splits=self.num_splits, block_n=ENGINE_BLOCK_N)

    def store_kvcache(self, layer_idx, k, v):
        slots = self.metadata.slot_mapping
        keep = slots >= 0
        for cache, new in zip(self.layer_kv_cache(layer_idx), (k, v)):
            cache.view(-1, *cache.shape[2:])[slots[keep]] = new[keep]


@pytest.fixture(scope="module")
def ch07_engine_case(tmp_path_factory):
    """A tiny float64 Llama, three prompts (the last two share 16 tokens: a prefill over a cached
    prefix), and transformers' greedy tokens."""
    folder = tmp_path_factory.mktemp("grading-ch07")
    model = make_tiny_model(folder, "llama", seed=0)
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(1, 128, (16,), generator=g).tolist()
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (11,)] + \
        [shared + torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 9)]
    ref = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                          max_new_tokens=ENGINE_TOKENS, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
           for p in prompts]
    return folder, prompts, ref


ENGINE_TOKENS = 6
# decode launches with two splits, in each of the tiny model's 2 layers: the first prompt's 5 decodes see
# 12 to 16 keys (two blocks of 8: one tile, one split), the other two prompts' 5 + 5 see 22 to 30 keys
# (three or four blocks: two tiles, two splits)
ENGINE_SPLIT_K_LAUNCHES = 2 * (5 + 5)


@pytest.mark.ch07
@pytest.mark.ch07_ex2
@pytest.mark.group(ENGINE)
def test_ch07_ex2_engine_equals_transformers(ch07_engine_case):
    """The engine with the Triton backend (your kernels; without a GPU under the interpreter), prefix
    caching on, two splits asked for in every decode with tiles of 16 keys (so that the decodes of
    contexts past 16 keys run two splits and the reduction: counted): greedy tokens equal
    transformers' (float64: no near-tie flips)."""
    folder, prompts, ref = ch07_engine_case
    llm = LLM(str(folder), dtype="float64", device=DEVICE.type, attention_backend=_GraderKVStore, block_size=8,
              num_kvcache_blocks=16, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=ENGINE_TOKENS, ignore_eos=True)
    decode, reduce = _CountLaunches(ta.paged_decode_kernel), _CountLaunches(ta.reduce_splits_kernel)
    with mock.patch.object(ta, "paged_decode_kernel", decode), mock.patch.object(ta, "reduce_splits_kernel", reduce), \
            _in_kernel("ch07_ex2"):
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # one by one: the last hits the cache
    for i, (p, o, r) in enumerate(zip(prompts, outs, ref)):
        _expect(o.outputs[0].token_ids == r, f"ch07_ex2: prompt {i} ({len(p)} tokens, {o.num_cached_tokens} cached): "
                f"the engine with your kernels generated {o.outputs[0].token_ids}, transformers {r}")
    _expect(outs[2].num_cached_tokens == 16, "grader setup: the third prompt should reuse 16 cached tokens")
    split_k = [grid for grid in decode.grids if grid[2] == 2]
    _expect(len(split_k) >= ENGINE_SPLIT_K_LAUNCHES and len(reduce.grids) == len(split_k),
            f"grader setup: the decodes should run two splits and the reduction at least {ENGINE_SPLIT_K_LAUNCHES} "
            f"times; decode grids {decode.grids}, reductions {len(reduce.grids)}")


# --- plausible wrong answers lose their part's points (not graded: they check the graders) -----------
@triton.jit
def _tile_without_rescale(q, k, v, visible, m_i, l_i, acc, qk_scale, ACC_DTYPE: tl.constexpr,
                          PRECISION: tl.constexpr):
    """The online-softmax step that forgets to rescale what it summed when the maximum grows."""
    s = tl.where(visible, tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=ACC_DTYPE) * qk_scale,
                 -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i + tl.sum(p, 1), acc + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=ACC_DTYPE)


WRONG_DECODE = tl.constexpr(0)  # 0: right; 1: m stored in natural-log units; 2: walks whole blocks; 3: empty split
# unwritten; 4: the running max starts at 0, not -inf; 5: q's sequence stride taken as num_heads * HEAD_DIM
WRONG_REDUCE = tl.constexpr(0)  # 0: right; 1: averages the splits' normalised outputs (no weights by m and l);
# 2: weighs each split by 2^m, not 2^(m - max m)


@triton.jit
def _grader_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                          out_ptr, m_ptr, l_ptr, qk_scale, min_split_len,
                          stride_q_seq, stride_q_head, stride_bt_seq, stride_o_seq, stride_o_head, stride_o_split,
                          NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_N: tl.constexpr, ONE_SPLIT: tl.constexpr, ACC_DTYPE: tl.constexpr,
                          PRECISION: tl.constexpr):
    """The grader's per-split kernel (the contract of `paged_decode_kernel`), or a wrong one (`WRONG_DECODE`)."""
    seq, kvh, split, splits = tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(2)
    n = tl.load(context_lens_ptr + seq)
    per = tl.maximum(tl.cdiv(tl.cdiv(n, splits), BLOCK_N) * BLOCK_N, min_split_len)
    lo = split * per
    hi = tl.minimum(lo + per, n)
    if WRONG_DECODE == 2:  # every key of the last block, past the context's end too
        hi = tl.minimum(lo + per, tl.cdiv(n, BLOCK_SIZE) * BLOCK_SIZE)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    rows = (h[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q_seq = stride_q_seq
    if WRONG_DECODE == 5:  # "q is contiguous"
        q_seq = NUM_KV_HEADS * GROUP * HEAD_DIM
    q = tl.load(q_ptr + seq * q_seq + (kvh * GROUP + h)[:, None] * stride_q_head + d[None, :], mask=rows, other=0.0)
    m = tl.full([BLOCK_H], -float("inf"), ACC_DTYPE)
    if WRONG_DECODE == 4:  # "any start below the scores will do"
        m = tl.zeros([BLOCK_H], ACC_DTYPE)
    l = tl.zeros([BLOCK_H], ACC_DTYPE)
    acc = tl.zeros([BLOCK_H, BLOCK_D], ACC_DTYPE)
    for i in range(0, tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)):
        t = lo + i * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = t < hi
        slot = tl.load(block_tables_ptr + seq * stride_bt_seq + t // BLOCK_SIZE, mask=ok, other=0) * BLOCK_SIZE \
            + t % BLOCK_SIZE
        addr = (slot * NUM_KV_HEADS + kvh)[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_cache_ptr + addr, mask=ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        v = tl.load(v_cache_ptr + addr, mask=ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        m, l, acc = _grader_attend_tile(q, k, v, ok[None, :], m, l, acc, qk_scale, ACC_DTYPE, PRECISION)
    head = kvh * GROUP + h
    where = seq * stride_o_seq + head[:, None] * stride_o_head + d[None, :]
    if ONE_SPLIT:
        tl.store(out_ptr + where, (acc / tl.where(l > 0, l, 1.0)[:, None]).to(out_ptr.dtype.element_ty), mask=rows)
    else:
        at = (seq * NUM_KV_HEADS * GROUP + head) * splits + split
        if WRONG_DECODE == 1:
            m = m / LOG2E_C  # "the log-sum-exp's usual units"
        if WRONG_DECODE == 3:
            if lo < hi:  # "nothing to store for an empty split"
                _store_partial(out_ptr + where + split * stride_o_split, m_ptr + at, l_ptr + at, acc, m, l, rows,
                               h < GROUP)
        else:
            _store_partial(out_ptr + where + split * stride_o_split, m_ptr + at, l_ptr + at, acc, m, l, rows, h < GROUP)


@triton.jit
def _store_partial(acc_ptrs, m_ptrs, l_ptrs, acc, m, l, rows, heads):
    tl.store(acc_ptrs, acc, mask=rows)
    tl.store(m_ptrs, m, mask=heads)
    tl.store(l_ptrs, l, mask=heads)


LOG2E_C = tl.constexpr(LOG2E)


@triton.jit
def _grader_reduce_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, num_splits, stride_o_seq, stride_o_head,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """The grader's reduction (the contract of `reduce_splits_kernel`), or a wrong one (`WRONG_REDUCE`)."""
    seq, head = tl.program_id(0), tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    base = (seq * NUM_HEADS + head) * num_splits + p
    m = tl.load(m_ptr + base, mask=p < num_splits, other=-float("inf"))
    l = tl.load(l_ptr + base, mask=p < num_splits, other=0.0)
    acc = tl.load(acc_ptr + base[:, None] * HEAD_DIM + d[None, :], mask=(p[:, None] < num_splits) & (d[None, :] < HEAD_DIM),
                  other=0.0)
    if WRONG_REDUCE == 1:
        used = l > 0
        o = tl.sum(tl.where(used[:, None], acc / tl.where(used, l, 1.0)[:, None], 0.0), 0) / \
            tl.maximum(tl.sum(used.to(tl.float32), 0), 1.0)
    elif WRONG_REDUCE == 2:  # "the common factor 2^-max m cancels anyway"
        w = tl.where(m > -float("inf"), tl.exp2(m), 0.0)
        total = tl.sum(w * l, 0)
        o = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    else:
        top = tl.max(m, 0)
        w = tl.where(m > -float("inf"), tl.exp2(m - top), 0.0)
        total = tl.sum(w * l, 0)
        o = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _speed_batch(seed: int = 11):
    """The speed part's decode batch on the GPU: 64 sequences of 256-4096 tokens in blocks of 16
    shuffled over the cache, 32 query heads over 8 KV heads of 128 (Llama-3-8B's layout), bfloat16."""
    g = torch.Generator().manual_seed(seed)
    num_seqs, kv_heads, group, head_dim, block_size = 64, 8, 4, 128, 16
    lens = torch.randint(256, 4097, (num_seqs,), generator=g)
    need = (lens + block_size - 1) // block_size
    perm = torch.randperm(int(need.sum()), generator=g)
    tables = torch.zeros(num_seqs, int(need.max()), dtype=torch.int64)
    for i, (start, k) in enumerate(zip((need.cumsum(0) - need).tolist(), need.tolist())):
        tables[i, :k] = perm[start:start + k]
    k_cache, v_cache = torch.randn(2, len(perm), block_size, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    q = torch.randn(num_seqs, kv_heads * group, head_dim, generator=g).to(torch.bfloat16)
    return (*(t.to(DEVICE) for t in (q, k_cache, v_cache, tables, lens)), head_dim ** -0.5)


@pytest.mark.ch07
@pytest.mark.ch07_ex2
@pytest.mark.gpu
@pytest.mark.group(SPEED)
def test_ch07_ex2_decode_speed_on_a_gpu(record_property):
    """The speed part (a GPU only: under the interpreter a kernel's speed means nothing): the package's
    (the student's) three kernels on `_speed_batch`, launched by the book's wrapper with its own choice
    of splits, checked against the grader's kernels (bfloat16 tolerance), then timed side by side
    with the grader's kernels in the same wrapper (`speed_ratio`, 20 launches per timing, the median of
    9 rounds). The ratio scores by `EXERCISES["ch07_ex2"].speed`'s bands."""
    if INTERPRETED:
        pytest.skip("needs a CUDA GPU: the speed part times the compiled kernels")
    batch = _speed_batch()

    def launches(n: int = 20, graders: bool = False):
        with ExitStack() as stack:
            if graders:
                stack.enter_context(mock.patch.object(ta, "paged_decode_kernel", _grader_decode_kernel))
                stack.enter_context(mock.patch.object(ta, "reduce_splits_kernel", _grader_reduce_kernel))
            for _ in range(n):
                out = ta.paged_decode_attention_triton(*batch)
            torch.cuda.synchronize()
        return out

    with _in_kernel("ch07_ex2"):
        got = launches(1)
    _close("ch07_ex2", got, launches(1, graders=True).double(), ATOL[torch.bfloat16],
           "the speed part's batch (64 sequences of 256-4096 tokens, bfloat16), against the grader's kernels")
    ratio = speed_ratio(launches, lambda: launches(graders=True), rounds=9)
    record_property(SPEED_RATIO, ratio)


# fixed cases for the checks below: lengths on and off tile (16) and block edges, an empty sequence,
# grouped heads, a head of 12; float32 and float16
PART_CHECKS = {
    STEP: lambda: [check_step(n, hd, dt, 3) for n, hd, dt in ((40, 12, torch.float32), (33, 16, torch.float16))],
    ONE_SPLIT: lambda: [check_decode([37, 1, 16, 0], 3, 2, 2, 12, torch.float32, 1, 5),
                        check_decode([20, 33], 4, 1, 8, 16, torch.float16, 1, 6)],
    SPLIT_K: lambda: [check_decode([37, 1, 16, 0], 3, 2, 2, 12, torch.float32, 3, 5),
                      check_decode([40, 9], 4, 1, 4, 16, torch.float16, 4, 6)],
    REDUCE: lambda: [check_reduce([40, 7, 0], 2, 12, 4, 16, torch.float32, 7),
                     check_reduce([30, 13], 1, 8, 3, 4, torch.float16, 8),
                     check_reduce([40, 7, 0], 2, 12, 4, 16, torch.float32, 9, offset=200.0),
                     check_reduce([30, 13], 1, 8, 3, 4, torch.float32, 10, offset=-200.0)],
}
WRONG = {  # name -> (the package's name it replaces, the wrong piece, the parts it must lose)
    "softmax without the running-max rescale": ("_attend_tile", lambda: _tile_without_rescale, {STEP}),
    "partial m in natural-log units": ("paged_decode_kernel", lambda: _rebuilt(
        _grader_decode_kernel, WRONG_DECODE=tl.constexpr(1)), {SPLIT_K}),
    "walks the last partial block whole": ("paged_decode_kernel", lambda: _rebuilt(
        _grader_decode_kernel, WRONG_DECODE=tl.constexpr(2)), {ONE_SPLIT, SPLIT_K}),
    "an empty split writes nothing": ("paged_decode_kernel", lambda: _rebuilt(
        _grader_decode_kernel, WRONG_DECODE=tl.constexpr(3)), {SPLIT_K}),
    "running max started at 0 (the partial m is wrong where a split's scores are all negative)": (
        "paged_decode_kernel", lambda: _rebuilt(_grader_decode_kernel, WRONG_DECODE=tl.constexpr(4)), {SPLIT_K}),
    "q's sequence stride assumed contiguous": ("paged_decode_kernel", lambda: _rebuilt(
        _grader_decode_kernel, WRONG_DECODE=tl.constexpr(5)), {ONE_SPLIT, SPLIT_K}),
    "reduction that averages the splits' outputs": ("reduce_splits_kernel", lambda: _rebuilt(
        _grader_reduce_kernel, WRONG_REDUCE=tl.constexpr(1)), {REDUCE}),
    "reduction weighing by 2^m, not 2^(m - max m)": ("reduce_splits_kernel", lambda: _rebuilt(
        _grader_reduce_kernel, WRONG_REDUCE=tl.constexpr(2)), {REDUCE}),
}


@pytest.mark.ch07
@pytest.mark.ch07_ex2
@pytest.mark.parametrize("part", [pytest.param(part, marks=pytest.mark.group(part), id=part) for part in PART_CHECKS])
def test_ch07_ex2_known_cases(part):
    """Each part on fixed cases that a random draw may miss: lengths on and off the 16-key tiles and the
    blocks (3 tokens: blocks that straddle tiles), an empty sequence, 8 query heads per KV head, a head of
    12 numbers, empty splits, in float32 and float16."""
    PART_CHECKS[part]()


def _failing_parts() -> set[str]:
    failed = set()
    for part, check in PART_CHECKS.items():
        try:
            check()
        except AssertionError:
            failed.add(part)
    return failed


def test_ch07_ex2_the_graders_pieces_pass_every_part():
    """The grader's own per-split kernel and reduction, in the package's place, pass every part's checks
    (so the wrong answers below differ from a right one only in what they get wrong)."""
    with mock.patch.object(ta, "paged_decode_kernel", _rebuilt(_grader_decode_kernel)), \
            mock.patch.object(ta, "reduce_splits_kernel", _rebuilt(_grader_reduce_kernel)), \
            mock.patch.object(ta, "_attend_tile", _grader_attend_tile):
        assert _failing_parts() == set()


@pytest.mark.parametrize("name", list(WRONG))
def test_ch07_ex2_wrong_answers_lose_their_part(name):
    """Each wrong piece, in the package's place, fails exactly the parts that grade it and passes the
    others (they run the grader's own version of it). The engine part, which runs every piece together,
    is left out here: it is slow, and it grades the composition."""
    attr, wrong, loses = WRONG[name]
    with mock.patch.object(ta, attr, wrong()):
        assert _failing_parts() == loses, name
