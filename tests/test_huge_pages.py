"""Chapter 02's tensors in 2 MiB pages (appendix C: `minivllm.utils.huge_pages.huge_page_zeros`, and
`use_huge_pages` for the packed weights) and chapter 04's KV cache in them. The tensors are zeros of the
shape and dtype asked for, start on a 2 MiB boundary, and their mapping is marked for transparent huge
pages: Linux's /proc/self/smaps says `THPeligible: 1` for it wherever the system setting
(/sys/kernel/mm/transparent_hugepage/enabled) is `always` or `madvise`. Whether the kernel then finds
free 2 MiB pages is up to the machine, so the tests ask only for the mark. Moving a model's packed
weights changes no bit of its output.
"""
from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch
from torch import nn

from engine_helpers import make_model, require_built, runner_switch_ab
from minivllm.model_executor.cpp_extension import load_extension
from minivllm.model_executor.layers.cpu_gemm import CPU_GEMM, PanelLinear, use_huge_pages, use_panel_linear
from minivllm.utils.huge_pages import HUGE_PAGE, huge_page_zeros

needs_madvise = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE here (not Linux)")


def thp_setting() -> str | None:
    """The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled ("always", "madvise", "never"), or None."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    return path.read_text().split("[")[1].split("]")[0]


def smaps_field(address: int, field: str) -> str | None:
    """`field`'s value for the mapping of this process that holds `address` (/proc/self/smaps), or None."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == field + ":":
                return line.split()[1]
    return None


@needs_madvise
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_zeros_on_a_2mib_boundary_marked_for_huge_pages(dtype):
    t = huge_page_zeros((3, 1000, 700), dtype)
    assert t.shape == (3, 1000, 700) and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0 and not t.any()
    assert t.untyped_storage().nbytes() > t.numel() * t.element_size()  # the mapping, a page longer
    t[1, 2, 3] = 5
    assert t.sum().item() == 5
    if thp_setting() in ("always", "madvise") and smaps_field(t.data_ptr(), "THPeligible") is not None:
        assert smaps_field(t.data_ptr(), "THPeligible") == "1"  # older kernels do not show the field


@needs_madvise
def test_the_memory_lives_as_long_as_a_view_of_it():
    t = huge_page_zeros((1024, 1024), torch.float32)
    t += 1
    row = t[5]
    del t
    gc.collect()
    assert row.sum().item() == 1024


def test_small_tensors_and_other_platforms_get_plain_zeros(monkeypatch):
    small = huge_page_zeros((10, 10), torch.float32)  # below one huge page
    assert small.shape == (10, 10) and not small.any()
    assert small.untyped_storage().nbytes() == 400  # torch's own allocation, no mapping
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)  # as on a platform without it
    big = huge_page_zeros((1024, 1024), torch.bfloat16)
    assert big.dtype == torch.bfloat16 and not big.any() and big.untyped_storage().nbytes() == 2 * 2**20


@pytest.fixture(scope="module")
def gemm():
    module = require_built(load_extension(CPU_GEMM), "the C++ float32 GEMM")
    if not module.kernel_isa():
        pytest.skip("this CPU has neither AVX-512 nor AVX2 with FMA: the engine keeps oneDNN's layers, and no panels")
    return module


@torch.inference_mode()
def test_moving_the_panels_changes_no_bit(gemm):
    model = nn.Sequential(nn.Linear(576, 960), nn.Linear(960, 100), nn.Linear(100, 576, bias=False))
    assert use_panel_linear(model) == 3
    x = torch.randn(7, 576)
    before, panels = model(x), [m.panels.clone() for m in model]
    moved = use_huge_pages(model)
    assert torch.equal(model(x), before)
    assert all(torch.equal(m.panels, p) for m, p in zip(model, panels))
    sizes = [p.numel() * p.element_size() for p in panels]
    assert moved == sum(-(-s // 64) * 64 for s in sizes) > HUGE_PAGE
    storage = {m.panels.untyped_storage().data_ptr() for m in model}
    assert len(storage) == 1  # one buffer for all
    starts = [m.panels.data_ptr() - model[0].panels.data_ptr() for m in model]
    assert starts == [0, -(-sizes[0] // 64) * 64, -(-sizes[0] // 64) * 64 + -(-sizes[1] // 64) * 64]
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert model[0].panels.data_ptr() % HUGE_PAGE == 0
    assert use_huge_pages(nn.Sequential(nn.Linear(4, 4))) == 0  # no PanelLinear, nothing to move


def test_the_engine_keeps_its_panels_and_kv_cache_in_huge_pages(gemm, tmp_path):
    from minivllm.llm import LLM

    make_model(tmp_path, "llama")
    runner = LLM(str(tmp_path), dtype="float32").llm_engine.model_runner
    layers = [m for m in runner.model.modules() if isinstance(m, PanelLinear)]
    assert layers and len({m.panels.untyped_storage().data_ptr() for m in layers}) == 1
    kv = runner.kv_cache
    assert kv.dtype == torch.float32 and kv.shape[0] == 2 and not kv.any()
    per_block = kv[0, 0, 0].numel() * kv.element_size() * 2 * kv.shape[1]
    big = runner.allocate_kv_cache(2 * HUGE_PAGE // per_block + 1, kv.shape[3])  # past one huge page
    assert big.shape[2:] == (2 * HUGE_PAGE // per_block + 1, *kv.shape[3:]) and not big.any()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert big.data_ptr() % HUGE_PAGE == 0
        if thp_setting() in ("always", "madvise") and smaps_field(big.data_ptr(), "THPeligible") is not None:
            assert smaps_field(big.data_ptr(), "THPeligible") == "1"


def test_the_switch_turns_both_off_and_changes_no_token(gemm, tmp_path):
    """`huge_pages = False` on a `ModelRunner` subclass: each `PanelLinear` keeps its own panels and the KV
    cache is `torch.zeros`'s (storage exactly the tensor's bytes, no longer mapping); greedy tokens are
    those of the engine with the switch on."""
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.worker.model_runner import ModelRunner

    make_model(tmp_path, "llama")
    storages = lambda model: len({m.panels.untyped_storage().data_ptr()  # noqa: E731
                                  for m in model.modules() if isinstance(m, PanelLinear)})
    outs, seen = runner_switch_ab(tmp_path, "huge_pages", storages)
    assert seen["on"] == 1 and seen["off"] > 1 and outs["on"] == outs["off"]
    plain = type("PlainPagesRunner", (ModelRunner,), {"huge_pages": False})
    runner = LLMEngine(model=str(tmp_path), dtype="float32", model_runner_cls=plain, num_kvcache_blocks=32).model_runner
    kv = runner.allocate_kv_cache(4 * HUGE_PAGE // (runner.kv_cache[:, :, 0].numel() * 4) + 1, runner.kv_cache.shape[3])
    assert kv.numel() * 4 > HUGE_PAGE and kv.untyped_storage().nbytes() == kv.numel() * 4 and not kv.any()
