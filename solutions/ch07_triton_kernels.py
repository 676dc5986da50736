"""Chapter 07's extend exercise. Your answers go between the TODO lines; see the chapter notebook
(the rebuild exercises ch07_ex1 and ch07_ex2 are in the chapter's export cells).

Exercise 3 (ch07_ex3) — vLLM's `copy_blocks` as a Triton kernel: given (source, destination) block
pairs, copy each source block of every layer's K and V cache into its destination block. This is the
copy behind copy-on-write: when two sequences forked from one share a partly filled last block, the
one that writes next first gets a copy of that block. Write `copy_blocks_kernel` (one program copies
one block of one cache, tile by tile) and the launch in `copy_blocks`. Graded under Triton's
interpreter on small CPU caches (on a GPU, compiled): every destination block equals its source,
every other element of the cache is untouched and nothing outside it is written, in float32, float16
and bfloat16, for blocks that take several tiles and for an empty pair list:
`python -m minivllm.course.grade ch07_ex3`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def copy_blocks_kernel(cache_ptr, block_mapping_ptr, stride_cache, stride_block,
                       BLOCK_NUMEL: tl.constexpr, TILE: tl.constexpr):
    """Program `(c, p)`: copy block `block_mapping[p, 0]` of cache `c` onto block `block_mapping[p, 1]`.

    The caches are `[num_caches, num_blocks, BLOCK_NUMEL]` (flat, contiguous): cache `c` starts at
    element `c · stride_cache`, block `b` of it `b · stride_block` further. `block_mapping` is int64
    `[num_pairs, 2]`, contiguous. A block is copied in tiles of `TILE` elements (a power of two; the
    last tile masked). Compute the offsets in int64: a real cache has more than 2**31 elements.
    """
    cache = tl.program_id(0).to(tl.int64)
    pair = tl.program_id(1).to(tl.int64)
    # TODO: load the pair's source and destination ids, then copy the block tile by tile (masked)
    ### BEGIN SOLUTION
    src = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    base = cache_ptr + cache * stride_cache
    for start in range(0, BLOCK_NUMEL, TILE):
        offs = start + tl.arange(0, TILE)
        mask = offs < BLOCK_NUMEL
        x = tl.load(base + src * stride_block + offs, mask=mask)
        tl.store(base + dst * stride_block + offs, x, mask=mask)
    ### END SOLUTION


def check_block_mapping(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Raise ValueError unless `kv_cache` is a contiguous 6-D cache and `block_mapping` an int64
    `[num_pairs, 2]` tensor on its device whose ids are blocks of it, destinations distinct and none
    of them a source (else the result would depend on the order the programs run in)."""
    if kv_cache.dim() != 6 or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be a contiguous [2, num_layers, num_blocks, block_size, num_kv_heads, "
                         f"head_dim] tensor, got shape {tuple(kv_cache.shape)}")
    if block_mapping.dtype != torch.int64 or block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be int64 [num_pairs, 2], got {block_mapping.dtype} "
                         f"{tuple(block_mapping.shape)}")
    if block_mapping.device != kv_cache.device:
        raise ValueError(f"block_mapping is on {block_mapping.device}, kv_cache on {kv_cache.device}")
    ids = block_mapping.cpu()
    num_blocks = kv_cache.shape[2]
    if ids.numel() and (ids.min() < 0 or ids.max() >= num_blocks):
        raise ValueError(f"block ids must be in [0, {num_blocks}), got {ids.tolist()}")
    dst = ids[:, 1].tolist()
    if len(set(dst)) != len(dst) or set(dst) & set(ids[:, 0].tolist()):
        raise ValueError(f"destination blocks must be distinct and not sources, got pairs {ids.tolist()}")


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor, tile: int = 1024) -> None:
    """Copy blocks in place, in every layer's K and V cache: `kv_cache[:, :, dst] = kv_cache[:, :, src]`
    for each row `(src, dst)` of `block_mapping` (vLLM's `cache_ops.copy_blocks`).

    Args:
        kv_cache: `[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]`, contiguous, any dtype.
        block_mapping: int64 `[num_pairs, 2]` on the cache's device; `num_pairs` may be 0.
        tile: elements a program copies per step, a power of two.
    Raises:
        ValueError: see `check_block_mapping`; `tile` not a power of two.
    """
    check_block_mapping(kv_cache, block_mapping)
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two, got {tile}")
    # TODO: view the cache as [num_caches, num_blocks, block_numel]; launch one program per (cache, pair)
    ### BEGIN SOLUTION
    if block_mapping.shape[0] == 0:
        return  # a grid with no programs is not a launch
    caches = kv_cache.view(kv_cache.shape[0] * kv_cache.shape[1], kv_cache.shape[2], -1)
    copy_blocks_kernel[(caches.shape[0], block_mapping.shape[0])](
        caches, block_mapping.contiguous(), caches.stride(0), caches.stride(1),
        BLOCK_NUMEL=caches.shape[2], TILE=tile)
    ### END SOLUTION
