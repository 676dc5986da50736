"""Chapter 05's C++ CPU decode kernel: equal to the plain-torch paged decode, refuses bad input, and
the engine falls back to plain torch where it does not build.

The kernel is compiled on first use (about half a minute; the library is cached on disk). Tests that
need it skip where it cannot be built (a warning says why), except under `MINIVLLM_REQUIRE_CPU_KERNEL=1`,
which CI sets: there they fail.
"""
from __future__ import annotations

import os

import pytest
import torch

import minivllm.paged_attention as pa
from engine_helpers import require_cpu_kernel
from minivllm.paged_attention import (_build_lock, cpu_decode_kernel, cpu_kernel_build_dir, paged_decode_attention,
                                      paged_decode_attention_cpu, paged_decode_attention_planned, plan_decode)


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
        # a non-contiguous q (a strided view) gives the same
        wide = torch.cat([q, torch.zeros_like(q)], dim=2)[:, :, :shape[2]]
        assert not wide.is_contiguous()
        out_strided = paged_decode_attention_cpu(wide, k_cache, v_cache, tables, lens, scale)
    finally:
        torch.set_num_threads(before)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, ref, atol=tol, rtol=0)
    torch.testing.assert_close(out_strided, out, atol=0, rtol=0)
    plan = plan_decode(plain_tables, lens, shape[3], dtype)
    torch.testing.assert_close(paged_decode_attention_planned(q, k_cache, v_cache, plan, scale), out, atol=tol, rtol=0)


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
        "float32 or float64": dict(q=q.bfloat16(), k_cache=k_cache.bfloat16(), v_cache=v_cache.bfloat16()),
        "must be positive": dict(k_cache=k_cache[:, :, :0], v_cache=v_cache[:, :, :0]),
        "CPU tensors": dict(context_lens=torch.empty(7, dtype=torch.int64, device="meta")),
    }
    for message, kw in cases.items():
        with pytest.raises(ValueError, match=message):
            call(**kw)
    torch.testing.assert_close(call(), paged_decode_attention(q, k_cache, v_cache, plain(tables), lens, 0.25))


def test_a_failed_build_warns_and_the_backend_falls_back(monkeypatch):
    """Where the kernel cannot be built, `cpu_decode_kernel` warns and returns None, the direct call
    raises, and `PagedAttention` decodes with plain torch."""
    import torch.utils.cpp_extension as cpp

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpp, "load_inline", no_compiler)
    monkeypatch.delenv("MINIVLLM_CPU_KERNEL", raising=False)
    cpu_decode_kernel.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="could not be built or loaded"):
            assert cpu_decode_kernel() is None
        with pytest.raises(RuntimeError, match="not available"):
            paged_decode_attention_cpu(*random_batch(4, 2, 16, 4, torch.float64), 0.25)
        kv_cache = torch.zeros(2, 1, 8, 4, 2, 16, dtype=torch.float64)
        assert pa.PagedAttention(kv_cache, 0.25).decode_kernel(torch.zeros(1, 4, 16, dtype=torch.float64)) is None
    finally:
        cpu_decode_kernel.cache_clear()


def test_the_environment_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_KERNEL", "0")
    cpu_decode_kernel.cache_clear()
    try:
        assert cpu_decode_kernel() is None
    finally:
        cpu_decode_kernel.cache_clear()


@needs_kernel
def test_backend_uses_the_kernel_only_for_cpu_float32_and_float64(monkeypatch):
    kv_cache = torch.zeros(2, 1, 8, 4, 2, 16)
    backend = pa.PagedAttention(kv_cache, 0.25)
    assert backend.decode_kernel(torch.zeros(1, 4, 16)) is cpu_decode_kernel()
    assert backend.decode_kernel(torch.zeros(1, 4, 16, dtype=torch.float64)) is cpu_decode_kernel()
    assert backend.decode_kernel(torch.zeros(1, 4, 16, dtype=torch.bfloat16)) is None
    assert backend.decode_kernel(torch.zeros(1, 4, 16, device="meta")) is None
    monkeypatch.setattr(pa.PagedAttention, "use_cpu_kernel", False)
    assert backend.decode_kernel(torch.zeros(1, 4, 16)) is None


def test_build_folder_is_per_python_torch_and_cpu_under_the_minivllm_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    folder = cpu_kernel_build_dir()
    assert folder.parent == tmp_path / "kernels"
    assert torch.__version__ in folder.name and "-cpu" in folder.name
    folders = set()
    for flags in ("flags : fpu sse2 avx2\n", "flags : fpu sse2 avx2 avx512f\n", "Features : fp asimd sve\n"):
        (tmp_path / "cpuinfo").write_text("processor : 0\n" + flags)
        monkeypatch.setattr(pa, "CPUINFO", str(tmp_path / "cpuinfo"))
        folders.add(cpu_kernel_build_dir())
    assert len(folders) == 3  # another instruction set, another folder


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


def test_no_compiler_is_said_plainly(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.delenv("MINIVLLM_CPU_KERNEL", raising=False)
    cpu_decode_kernel.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler `/nonexistent/c\\+\\+` found"):
            assert cpu_decode_kernel() is None
    finally:
        cpu_decode_kernel.cache_clear()


def test_the_first_build_says_so_once(monkeypatch, tmp_path, capsys):
    """Without compiling for real: torch's builder is replaced by a stand-in that writes main.cpp."""
    from types import SimpleNamespace

    import torch.utils.cpp_extension as cpp

    def fake_load_inline(name, cpp_sources, build_directory, **kwargs):
        (tmp_path / "main.cpp").write_text("#include <torch/extension.h>\n" + cpp_sources)
        return SimpleNamespace(paged_decode_attention="the kernel")

    monkeypatch.setattr(cpp, "load_inline", fake_load_inline)
    monkeypatch.setattr(pa, "cpu_kernel_build_dir", lambda: tmp_path)
    monkeypatch.delenv("MINIVLLM_CPU_KERNEL", raising=False)
    said = []
    for _ in range(2):
        cpu_decode_kernel.cache_clear()
        try:
            assert cpu_decode_kernel() == "the kernel"
        finally:
            cpu_decode_kernel.cache_clear()
        said.append("compiling the C++ CPU decode kernel once" in capsys.readouterr().err)
    assert said == [True, False]
