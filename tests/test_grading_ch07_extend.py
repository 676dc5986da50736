"""Grading tests for chapter 07's extend exercise (`python -m minivllm.course.grade ch07_ex3`, or
`pytest -m ch07_ex3 --impl=exercises`).

ch07_ex3, `copy_blocks` as a Triton kernel, is graded by its contract, with nothing to compare
against but `kv_cache[:, :, dst] = kv_cache[:, :, src]` written here: after random (source,
destination) pairs (a source may be copied to several destinations, as when one sequence forks into
many), every destination block of every layer's K and V cache equals its source as it was, every
other element is untouched, and nothing is written outside the cache (the cache is the middle of a
larger buffer whose guards keep a sentinel). A copy is exact, in every dtype. Tiles smaller than a
block make the kernel loop, block sizes that are not powers of two make it mask. Without CUDA the
kernel runs under Triton's interpreter (`TRITON_INTERPRET=1`, set before the answer is loaded) on
CPU tensors and tiny shapes; with CUDA, compiled.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

INTERPRETED = not torch.cuda.is_available()
if INTERPRETED:
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed (pip install triton): chapter 07 is not graded")

from adapters import load  # noqa: E402
from engine_helpers import one_thread  # noqa: E402

from test_grading_ch07_regions import _in_kernel  # noqa: E402  (a stub's error as itself, others name the exercise)

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SENTINEL = -7.0  # the guards around the cache must keep it
GUARD = 37  # elements of guard before and after the cache (not a multiple of any block)

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


@pytest.fixture(scope="module")
def ch07(impl_name):
    return load("ch07_triton_kernels", impl_name)


def _guarded_cache(shape, dtype, seed):
    """A contiguous cache of random values that is the middle of a buffer with SENTINEL guards."""
    g = torch.Generator().manual_seed(seed)
    numel = torch.Size(shape).numel()
    buf = torch.full((numel + 2 * GUARD,), SENTINEL, dtype=dtype)
    buf[GUARD:GUARD + numel] = (torch.randn(numel, generator=g) + 3 * torch.rand(numel, generator=g)).to(dtype)
    buf = buf.to(DEVICE)
    return buf, buf[GUARD:GUARD + numel].view(shape)


def _check(before: torch.Tensor, buf: torch.Tensor, cache: torch.Tensor, pairs: list, what: str) -> None:
    """The cache equals `before` with each destination block replaced by its source; guards intact."""
    guards = torch.cat([buf[:GUARD], buf[-GUARD:]]).cpu()
    if not bool((guards == SENTINEL).all()):
        where = (guards != SENTINEL).nonzero().flatten().tolist()
        raise AssertionError(f"ch07_ex3 ({what}): the kernel wrote outside the cache (guard elements {where[:8]} "
                             f"changed; {len(where) // 2 or 1}+ of {GUARD} before, then after)")
    want = before.clone()
    for src, dst in pairs:
        want[:, :, dst] = before[:, :, src]
    got = cache.cpu()
    bad = (got != want).flatten(3).any(-1)  # [2, num_layers, num_blocks]
    if bool(bad.any()):
        kv, layer, block = bad.nonzero()[0].tolist()
        diff = (got.double() - want.double()).abs().nan_to_num(float("inf"))
        at = tuple(torch.unravel_index(diff.argmax(), diff.shape))
        wrong = [("KV"[k], l_, b) for k, l_, b in bad.nonzero().tolist()]
        role = ("a destination" if block in [d for _, d in pairs] else "not a destination: it must keep its values")
        raise AssertionError(
            f"ch07_ex3 ({what}): blocks (cache, layer, block) {wrong[:10]} differ from the expected copy; "
            f"the first, {'KV'[kv]} layer {layer} block {block}, is {role}; largest difference "
            f"{float(diff.max()):.4g} at index {tuple(int(i) for i in at)} (got {float(got[at])}, want {float(want[at])})")


@st.composite
def _cases(draw):
    num_blocks = draw(st.integers(2, 6))
    num_pairs = draw(st.integers(1, num_blocks - 1))
    order = draw(st.permutations(range(num_blocks)))
    dsts = order[:num_pairs]
    srcs = [draw(st.sampled_from(order[num_pairs:])) for _ in range(num_pairs)]  # a source may repeat (forks)
    return dict(num_layers=draw(st.integers(1, 2)), num_blocks=num_blocks, block_size=draw(st.sampled_from([1, 3, 4])),
                num_kv_heads=draw(st.integers(1, 2)), head_dim=draw(st.sampled_from([3, 8])),
                tile=draw(st.sampled_from([4, 16, 1024])), pairs=list(zip(srcs, dsts)), seed=draw(st.integers(0, 2**16)))


@pytest.mark.ch07
@pytest.mark.ch07_ex3
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=6, deadline=None)
@given(case=_cases())
def test_ch07_ex3_copy_blocks_copies_each_pair_and_nothing_else(ch07, dtype, case):
    """Each destination block of every layer's K and V equals its source; nothing else changes."""
    shape = (2, case["num_layers"], case["num_blocks"], case["block_size"], case["num_kv_heads"], case["head_dim"])
    buf, cache = _guarded_cache(shape, dtype, case["seed"])
    before = cache.cpu().clone()
    mapping = torch.tensor(case["pairs"], dtype=torch.int64, device=DEVICE)
    with _in_kernel("ch07_ex3"):
        ch07.copy_blocks(cache, mapping, tile=case["tile"])
    _check(before, buf, cache, case["pairs"],
           f"{dtype}, pairs (src, dst) {case['pairs']}, cache {list(shape)}, tile {case['tile']} elements "
           f"of blocks of {shape[3] * shape[4] * shape[5]}")


@pytest.mark.ch07
@pytest.mark.ch07_ex3
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ch07_ex3_copy_blocks_empty_pair_list_changes_nothing(ch07, dtype):
    """No pairs: no error, and the cache keeps every value."""
    shape = (2, 2, 3, 4, 2, 8)
    buf, cache = _guarded_cache(shape, dtype, 0)
    before = cache.cpu().clone()
    with _in_kernel("ch07_ex3"):
        ch07.copy_blocks(cache, torch.empty(0, 2, dtype=torch.int64, device=DEVICE))
    _check(before, buf, cache, [], f"{dtype}, an empty block_mapping [0, 2]")


@pytest.mark.ch07
@pytest.mark.ch07_ex3
def test_ch07_ex3_copy_blocks_a_real_block_size(ch07):
    """Blocks of 16 tokens, 2 KV heads of 64 (2,048 elements, two tiles of 1,024), three layers: a fork's
    last block copied twice, as when one sequence forks into three."""
    shape = (2, 3, 5, 16, 2, 64)
    buf, cache = _guarded_cache(shape, torch.bfloat16, 1)
    before = cache.cpu().clone()
    pairs = [(1, 3), (1, 0)]
    with _in_kernel("ch07_ex3"):
        ch07.copy_blocks(cache, torch.tensor(pairs, dtype=torch.int64, device=DEVICE))
    _check(before, buf, cache, pairs, f"bfloat16, pairs (src, dst) {pairs}, cache {list(shape)}, the default tile")
