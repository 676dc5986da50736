"""Helpers for the engine tests (chapters 04-06): tiny models, the transformers oracle, invariants.

Imported by tests/test_scheduler.py, test_block_manager.py, test_engine_oracle.py and
test_engine_bad_input.py (plain functions, no fixtures, so they do not collide with conftest.py).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from minivllm.course.testing import TINY_SIZES, make_tiny_model, random_prompts  # noqa: F401  (re-exported)

TINY_ENGINE = {**TINY_SIZES, "max_position_embeddings": 512}  # the engine tests' tiny models
MAX_STEPS = 20_000  # no test run needs more; reaching it means the engine is stuck


def make_model(folder: Path, kind: str, seed: int = 0, **overrides):
    """Save a tiny random float64 transformers model (`minivllm.course.testing`, with `TINY_ENGINE`'s sizes)
    in `folder`; return it."""
    fields = {"max_position_embeddings": TINY_ENGINE["max_position_embeddings"], **overrides}
    return make_tiny_model(folder, kind, seed=seed, **fields)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """transformers' `generate(do_sample=False)` completion token ids for one prompt (no padding)."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                         eos_token_id=eos_token_id, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run_engine(engine, prompts, params, check=None) -> list:
    """Add every prompt, step until idle (checking invariants after each step: `check(engine)`, by default
    `check_invariants`), return outputs in order."""
    from minivllm.sampling_params import SamplingParams

    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    done = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        (check or check_invariants)(engine)
    else:
        raise AssertionError("the engine did not finish within MAX_STEPS steps")
    (check or check_invariants)(engine)
    return [done[i] for i in ids]


def check_invariants(engine_or_scheduler, most_slots=None) -> None:
    """Block-manager and scheduler invariants (design doc, "Correctness"); `most_slots(seq)`: the most
    token slots a running sequence's block table may cover (default its `num_tokens`; chapter 14's
    drafts and look-ahead take more):

    * waiting sequences hold no blocks; no block appears twice in one block table;
    * a running sequence's block table covers its tokens whose KV is stored (all but the newest);
    * every block's ref_count equals the number of block tables holding it; used/free sets agree;
    * an idle engine holds no blocks (all free; some may still be cached);
    * prefix caching: every hash maps to a block carrying that hash and `block_size` tokens, and each
      hashed block of a running sequence holds exactly that sequence's tokens with the chained hash.
    """
    from minivllm.core.block_manager import BlockManager

    sched = getattr(engine_or_scheduler, "scheduler", engine_or_scheduler)
    bm = sched.block_manager
    running, waiting = list(sched.running), list(sched.waiting)
    assert not set(map(id, running)) & set(map(id, waiting))
    assert len(running) <= sched.max_num_seqs
    for seq in waiting:
        assert not seq.block_table, f"waiting {seq} holds blocks"
        assert not seq.is_finished
    for seq in running:
        assert not seq.is_finished
        assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} holds a block twice"
    if not isinstance(bm, BlockManager):
        assert len(bm.used_block_ids) == len(running)
        return
    bs = bm.block_size
    for seq in running:
        stored = seq.num_tokens - 1  # the newest token's KV is written by the next step
        computed = getattr(seq, "num_computed_tokens", None)  # chapter 11: a prefill may span steps
        if computed is None:
            assert len(seq.block_table) == -(-stored // bs), (
                f"running {seq} holds {len(seq.block_table)} blocks {seq.block_table}; its {stored} tokens with "
                f"stored KV (all but the newest) need {-(-stored // bs)} blocks of {bs}")
        else:  # admission takes blocks for all its tokens, the newest included
            assert computed <= stored, (seq, computed)
            most = seq.num_tokens if most_slots is None else most_slots(seq)
            assert -(-stored // bs) <= len(seq.block_table) <= -(-most // bs), (seq, seq.block_table, most)
    holders = Counter(b for seq in running for b in seq.block_table)
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id], (block, holders[block.block_id])
    assert bm.used_block_ids == set(holders)
    assert set(bm.free_block_ids) == set(range(bm.num_blocks)) - set(holders)
    if not running and not waiting:
        assert bm.num_free_blocks == bm.num_blocks, "an idle engine holds blocks"
        if hasattr(engine_or_scheduler, "requests"):
            assert not engine_or_scheduler.requests
            assert not engine_or_scheduler.model_runner.generators
    if hasattr(bm, "hash_to_block_id"):
        from minivllm.core.prefix_caching import NO_HASH, compute_hash

        for h, block_id in bm.hash_to_block_id.items():
            block = bm.blocks[block_id]
            assert block.hash == h and len(block.token_ids) == bs, (h, block)
        for seq in running:
            parent = NO_HASH
            computed = getattr(seq, "num_computed_tokens", None)
            for i, block_id in enumerate(seq.block_table):
                block = bm.blocks[block_id]
                if computed is not None and (i + 1) * bs > computed:  # ch11: cached only once computed
                    assert block.hash == NO_HASH, f"block {block_id} of {seq} is cached before its K/V is computed"
                    break
                if (i + 1) * bs > seq.num_tokens - 1 or block.hash == NO_HASH:
                    break
                assert block.token_ids == seq.block(i), f"block {block_id} of {seq} holds other tokens"
                parent = compute_hash(seq.block(i), parent)
                assert block.hash == parent, f"block {block_id} of {seq} has a broken hash chain"


def one_thread():
    """Generator body of an autouse fixture: run a test module's tiny-model work on one torch thread.

    Tiny models gain nothing from intra-op threads, and on a shared 2-core machine two threads
    competing with another process slow every small op down by an order of magnitude.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def require_cpu_kernel():
    """Return chapter 05's C++ CPU decode kernel, or skip the calling test where it cannot be built
    (it warns why). CI sets `MINIVLLM_REQUIRE_CPU_KERNEL=1` (`.ci/run`): there a missing kernel fails."""
    from minivllm.attention.backends.cpu_attn import cpu_decode_kernel

    return require_built(cpu_decode_kernel(), "the C++ CPU decode kernel")


def float32_cpu_linear() -> type:
    """The class the engine's model runner gives float32 linear layers on this CPU: chapter 02's
    `PanelLinear` where its C++ GEMM runs (AVX-512, or AVX2 with FMA), else oneDNN's `PackedLinear`."""
    from minivllm.model_executor.layers.cpu_gemm import PanelLinear, cpu_gemm
    from minivllm.model_executor.layers.linear import PackedLinear

    return PanelLinear if cpu_gemm() is not None else PackedLinear


def runner_switch_ab(folder, switch: str, inspect) -> tuple[dict, dict]:
    """Three engines over the tiny model saved in `folder`: "on" (float32, `ModelRunner` as it is),
    "off" (float32, a `ModelRunner` subclass with the class switch `switch` set to False) and "float64"
    (as it is). Returns their greedy token ids on three prompts (5, 17 and 40 tokens, 12 tokens out)
    and `inspect(model)` of each runner's model, both keyed by those names."""
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sampling_params import SamplingParams
    from minivllm.worker.model_runner import ModelRunner

    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    switched_off = type("SwitchedOffRunner", (ModelRunner,), {switch: False})
    outs, seen = {}, {}
    for name, dtype, runner in (("on", "float32", ModelRunner), ("off", "float32", switched_off),
                                ("float64", "float64", ModelRunner)):
        engine = LLMEngine(model=str(folder), dtype=dtype, model_runner_cls=runner, num_kvcache_blocks=32)
        seen[name] = inspect(engine.model_runner.model)
        outs[name] = [o.outputs[0].token_ids for o in run_engine(engine, prompts, params)]
    return outs, seen


def swap_with_kernels_off(monkeypatch, loader, swap, model) -> int:
    """`swap(model)` with the C++ kernels switched off (`MINIVLLM_CPU_KERNEL=0`) and `loader`'s cache
    cleared before and after; any warning fails (switched off on purpose: nothing to warn about).
    Returns what `swap` returns: the number of layers replaced."""
    import warnings

    monkeypatch.setenv("MINIVLLM_CPU_KERNEL", "0")
    loader.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return swap(model)
    finally:
        loader.cache_clear()


def cpu_has_amx() -> bool:
    """Whether this CPU says it has AMX's bfloat16 tiles and AVX512-BF16 (/proc/cpuinfo's flags)."""
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    return all(flag in flags.split() for flag in ("amx_tile", "amx_bf16", "avx512_bf16"))


def require_built(kernel, what: str):
    """`kernel` (a C++ library's function or module) if it is not None; else skip the calling test,
    or fail it under `MINIVLLM_REQUIRE_CPU_KERNEL=1` (CI, where every C++ kernel must build)."""
    import os

    import pytest

    if kernel is None:
        if os.environ.get("MINIVLLM_REQUIRE_CPU_KERNEL") == "1":
            pytest.fail(f"{what} did not build, and MINIVLLM_REQUIRE_CPU_KERNEL=1")
        pytest.skip(f"{what} cannot be built here (see its warning); plain torch is tested")
    return kernel


def speed_ratio(student, reference, *, rounds: int = 9, calls: int = 3, warmup: int = 2) -> float:
    """How many times the reference's time `student()` takes, measured side by side: `rounds` rounds,
    each timing both (the best of `calls` calls each, the order alternating from round to round), and
    the median of the rounds' ratios. A shared machine slows both in the same round, so the ratio
    holds where the times do not (the grading's speed parts use it; `Exercise.speed` has the bands).

    Args:
        student, reference: callables without arguments (a CUDA caller synchronizes inside).
        rounds, calls, warmup: rounds measured, calls per timing, untimed calls of each first.
    Returns:
        The student's time over the reference's (> 1: slower).
    """
    import statistics
    import time

    def best(fn) -> float:
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    for _ in range(warmup):
        student(), reference()
    ratios = []
    for r in range(rounds):
        if r % 2:
            ref = best(reference)
            mine = best(student)
        else:
            mine = best(student)
            ref = best(reference)
        ratios.append(mine / ref)
    return statistics.median(ratios)
