"""Grading tests for chapter 08's rebuild exercises (`python -m minivllm.course.grade ch08_ex3`, or `pytest -m ch08_ex3`).

ch08_ex1 (`cudagraph_capture_sizes`), ch08_ex2 (`padded_batch_size`) and ch08_ex3
(`prepare_decode_inputs`) are graded in the package itself: in a student edition they are the
student's code, exported from the chapter (stubs until filled), and there is no reference to compare
with. Each is graded alone: where the engine runs, `_graded` puts the grader's own versions of the
other two pieces into `minivllm.worker.cuda_graph` (written here from the chapter's stated rules).

What is checked is the contract:
* ch08_ex1: the sizes are the rule the docstring states (the small sizes below the top, the multiples
  of the step below it, the top), for many limits (hypothesis);
* ch08_ex2: the smallest captured size that holds the batch, None when none does, for random
  ascending size lists (hypothesis);
* ch08_ex3: after each of a random sequence of decode batches of growing and shrinking size, the
  static tensors' first `num_rows` rows hold the batch (last token, position, slot, context length,
  block table then -1) and padding (token 0, position 0, the dummy slot, length 1, `[dummy, -1, ...]`),
  in the same tensors as before; and a padded step writes only its own tokens' KV-cache slots and the
  dummy slot;
* each piece in the engine on a CPU (`StandInGraph` replays the recorded steps): greedy tokens equal
  transformers' on a tiny float64 model, where no near-tie can flip a token.
"""
from __future__ import annotations

import random
from contextlib import ExitStack, contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minivllm.worker.cuda_graph as cg
from engine_helpers import hf_greedy, make_model, one_thread, random_prompts, run_engine
from minivllm.core.block_manager import BlockManager
from minivllm.worker.cuda_graph import CapturablePagedAttention, CUDAGraphModelRunner, DecodeBuffers
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model_executor.model_loader import load_model
from minivllm.worker.model_runner import ModelRunner, prepare_batch
from minivllm.attention.paged_attention import PagedAttention
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


# --- the grader's versions of the three pieces ---------------------------------------------------
def _rule_sizes(max_num_seqs: int, max_capture_size: int = cg.MAX_CAPTURE_SIZE) -> list[int]:
    """The capture sizes as the chapter states them."""
    top = min(max_num_seqs, max_capture_size)
    return sorted({s for s in cg.SMALL_CAPTURE_SIZES if s < top}
                  | set(range(cg.CAPTURE_SIZE_STEP, top, cg.CAPTURE_SIZE_STEP)) | {top})


def _grader_padded(num_seqs: int, capture_sizes: list[int]) -> int | None:
    return next((s for s in capture_sizes if s >= num_seqs), None)


def _grader_prepare(buffers: DecodeBuffers, seqs: list[Sequence], num_rows: int) -> None:
    """Writes the rows straight into the static tensors (no host copies)."""
    n = len(seqs)
    input_ids, positions, md, _ = prepare_batch(seqs, False, buffers.block_size, torch.device("cpu"))
    pads = {"input_ids": 0, "positions": 0, "slot_mapping": buffers.dummy_slot, "context_lens": 1}
    for name, value in zip(pads, (input_ids, positions, md.slot_mapping, md.context_lens)):
        getattr(buffers, name)[:n] = value
        getattr(buffers, name)[n:num_rows] = pads[name]
    buffers.block_tables[:num_rows] = -1
    buffers.block_tables[:n, :md.block_tables.shape[1]] = md.block_tables
    buffers.block_tables[n:num_rows, 0] = buffers.dummy_block


STAND_INS = {"ch08_ex1": ("cudagraph_capture_sizes", _rule_sizes),
             "ch08_ex2": ("padded_batch_size", _grader_padded),
             "ch08_ex3": ("prepare_decode_inputs", _grader_prepare)}


@contextmanager
def _graded(ex: str, **replace):
    """`minivllm.worker.cuda_graph` with the package's (the student's) piece for `ex` and the grader's for the
    other two (`replace` overrides a stand-in by name)."""
    with ExitStack() as stack:
        for other, (name, fn) in STAND_INS.items():
            if other != ex:
                stack.enter_context(mock.patch.object(cg, name, replace.get(name, fn)))
        yield


# --- ch08_ex1 ------------------------------------------------------------------------------------
@pytest.mark.ch08
@pytest.mark.ch08_ex1
@settings(max_examples=150, deadline=None)
@given(max_num_seqs=st.integers(1, 600), max_capture_size=st.integers(1, 600))
def test_ch08_ex1_capture_sizes_follow_the_rule(max_num_seqs, max_capture_size):
    got = cg.cudagraph_capture_sizes(max_num_seqs, max_capture_size)
    want = _rule_sizes(max_num_seqs, max_capture_size)
    _expect(isinstance(got, list) and got == want,
            f"ch08_ex1: cudagraph_capture_sizes({max_num_seqs}, max_capture_size={max_capture_size}): expected "
            f"{want} (sizes of {cg.SMALL_CAPTURE_SIZES} below top={min(max_num_seqs, max_capture_size)}, the "
            f"multiples of {cg.CAPTURE_SIZE_STEP} below it, then top; ascending), got {got!r}")


@pytest.mark.ch08
@pytest.mark.ch08_ex1
def test_ch08_ex1_capture_sizes_default_cap():
    got = cg.cudagraph_capture_sizes(1000)
    _expect(got == _rule_sizes(1000, cg.MAX_CAPTURE_SIZE),
            f"ch08_ex1: cudagraph_capture_sizes(1000) must stop at MAX_CAPTURE_SIZE={cg.MAX_CAPTURE_SIZE}: "
            f"expected ...{_rule_sizes(1000)[-3:]}, got {got!r}")


# --- ch08_ex2 ------------------------------------------------------------------------------------
@pytest.mark.ch08
@pytest.mark.ch08_ex2
@settings(max_examples=200, deadline=None)
@given(sizes=st.sets(st.integers(1, 100), min_size=1, max_size=12), num_seqs=st.integers(1, 120))
def test_ch08_ex2_padding_takes_the_smallest_size_that_holds_the_batch(sizes, num_seqs):
    sizes = sorted(sizes)
    got = cg.padded_batch_size(num_seqs, sizes)
    want = _grader_padded(num_seqs, sizes)
    _expect(got == want and (got is None or isinstance(got, int)),
            f"ch08_ex2: padded_batch_size({num_seqs}, {sizes}): expected {want} (the smallest captured size >= "
            f"{num_seqs}; None when none holds it), got {got!r}")


# --- ch08_ex3 ------------------------------------------------------------------------------------
BS, NUM_BLOCKS, MAX_ROWS, MAX_BLOCKS = 4, 64, 8, 12  # block size, cache blocks, buffer rows, table width


def _check_rows(buffers: DecodeBuffers, seqs: list[Sequence], num_rows: int, step: str) -> None:
    n, dummy = len(seqs), buffers.dummy_block
    want = {"input_ids": [], "positions": [], "slot_mapping": [], "context_lens": [], "block_tables": []}
    for s in seqs:
        pos = s.num_tokens - 1
        want["input_ids"].append(s.token_ids[-1])
        want["positions"].append(pos)
        want["slot_mapping"].append(s.block_table[pos // BS] * BS + pos % BS)
        want["context_lens"].append(s.num_tokens)
        want["block_tables"].append(s.block_table + [-1] * (MAX_BLOCKS - len(s.block_table)))
    for _ in range(n, num_rows):
        for name, value in zip(cg.DECODE_INPUTS, (0, 0, dummy * BS, 1)):
            want[name].append(value)
        want["block_tables"].append([dummy] + [-1] * (MAX_BLOCKS - 1))
    for name, rows in want.items():
        got = getattr(buffers, name)[:num_rows].tolist()
        for r, (g, w) in enumerate(zip(got, rows)):
            _expect(g == w, f"ch08_ex3: after {step}: {name} row {r} ({'a sequence' if r < n else 'padding'}; "
                            f"{n} sequences in {num_rows} rows, dummy block {dummy}): expected {w}, got {g}")


@pytest.mark.ch08
@pytest.mark.ch08_ex3
@settings(max_examples=25, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(1, MAX_ROWS), st.integers(0, 3)), min_size=1, max_size=8),
       seed=st.integers(0, 2**16))
def test_ch08_ex3_rows_hold_the_batch_then_padding(steps, seed):
    """Batches of random sizes one after another (rows of a larger batch must become padding again),
    sequences growing between steps (their tables widen): the static tensors' first `num_rows` rows
    hold exactly the batch and padding, and are the same tensors as before."""
    rng = random.Random(seed)
    bm = BlockManager(NUM_BLOCKS, BS)
    pool = [Sequence([rng.randrange(1, 50) for _ in range(rng.randint(1, 16))], block_size=BS) for _ in range(MAX_ROWS)]
    for s in pool:
        bm.allocate(s)
    buffers = DecodeBuffers(MAX_ROWS, MAX_BLOCKS, BS, NUM_BLOCKS, 7, torch.float64, torch.device("cpu"))
    names = (*cg.DECODE_INPUTS, "block_tables")
    addresses = {name: getattr(buffers, name).data_ptr() for name in names}
    sizes = _rule_sizes(MAX_ROWS)
    history = []
    for n, grow in steps:
        for s in pool:
            for _ in range(grow if len(s.block_table) < NUM_BLOCKS // MAX_ROWS else 0):  # the pool never runs dry
                s.append_token(rng.randrange(1, 50))
                bm.may_append(s)
        seqs = rng.sample(pool, n)
        num_rows = _grader_padded(n, sizes)
        history.append(f"{n} sequences in {num_rows} rows")
        cg.prepare_decode_inputs(buffers, seqs, num_rows)
        _check_rows(buffers, seqs, num_rows, "; ".join(history))
    moved = [name for name in names if getattr(buffers, name).data_ptr() != addresses[name]]
    _expect(not moved, f"ch08_ex3: {moved} are new tensors: a captured graph reads the static ones; "
                       "write into them in place")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-ch08-grading")
    return folder, make_model(folder, "llama")


def _written_slots(cache: torch.Tensor, before: torch.Tensor) -> list[int]:
    """Flat slots (block * block_size + offset) where any layer's K or V changed."""
    return (cache != before).any(-1).any(-1).any(0).any(0).flatten().nonzero().flatten().tolist()


@pytest.mark.ch08
@pytest.mark.ch08_ex3
def test_ch08_ex3_padded_rows_write_only_the_dummy_slot(tiny):
    """5 sequences in the 8 rows of a captured size right after a step of 8 (rows 5-7 still hold other
    sequences' slots), on a cache of random values: only the 5 new slots and the dummy slot change,
    and the logits equal the eager runner's on a copy of the cache."""
    folder, _ = tiny
    model = load_model(folder, dtype=torch.float64)
    rng = random.Random(13)
    with _graded("ch08_ex3"), torch.inference_mode():
        bm = BlockManager(64, 4)
        runner = CUDAGraphModelRunner(model, bm, attention_backend=CapturablePagedAttention, max_num_seqs=8,
                                      max_model_len=128)
        eager = ModelRunner(model, BlockManager(64, 4), attention_backend=PagedAttention)
        batch = [Sequence([rng.randrange(1, 50) for _ in range(rng.randint(5, 20))], block_size=4) for _ in range(8)]
        for s in batch:
            bm.allocate(s)
        runner.forward_logits(batch, False)
        for s in batch:
            s.append_token(5)
            bm.may_append(s)
        runner.kv_cache.normal_(generator=torch.Generator().manual_seed(0))
        eager.kv_cache.copy_(runner.kv_cache[:, :, :bm.num_blocks])
        before = runner.kv_cache.clone()
        logits = runner.forward_logits(batch[:5], False).clone()
        expected = eager.forward_logits(batch[:5], False)
    new_slots = sorted(s.block_table[(s.num_tokens - 1) // 4] * 4 + (s.num_tokens - 1) % 4 for s in batch[:5])
    written = _written_slots(runner.kv_cache, before)
    _expect(written == sorted(new_slots + [runner.dummy_block * 4]),
            f"ch08_ex3: a step of 5 sequences padded to 8 rows wrote KV-cache slots {written}; expected only the "
            f"sequences' new slots {new_slots} and the dummy slot {runner.dummy_block * 4}")
    # float64; a padded batch multiplies matrices of another shape, whose summation order may differ
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-10,
                               msg=lambda m: f"ch08_ex3: the padded step's logits against the eager runner's: {m}")


# --- each piece in the engine ---------------------------------------------------------------------
def _graph_engine(folder, max_num_seqs: int) -> LLMEngine:
    return LLMEngine(model=folder, dtype="float64", device="cpu", block_manager_cls=BlockManager, block_size=4,
                     max_model_len=128, num_kvcache_blocks=400, max_num_seqs=max_num_seqs,
                     attention_backend=CapturablePagedAttention, model_runner_cls=CUDAGraphModelRunner)


def _record_replays(runner) -> list[list]:
    """[batch size, size of the graph replayed or None] for each decode step."""
    steps = []
    real_forward = runner.forward_logits

    def forward_logits(seqs, is_prefill):
        if not is_prefill:
            steps.append([len(seqs), None])
        return real_forward(seqs, is_prefill)

    for size, graph in runner.decode_graphs.graphs.items():
        def replay(real=graph.replay, size=size):
            steps[-1][1] = size
            real()
        graph.replay = replay
    runner.forward_logits = forward_logits
    return steps


ENGINE_CASES = {  # exercise: (max_num_seqs, the grader's stand-ins to override)
    "ch08_ex1": (20, {}),
    "ch08_ex2": (10, {"cudagraph_capture_sizes": lambda m, c=cg.MAX_CAPTURE_SIZE: _rule_sizes(m, min(c, 6))}),
    "ch08_ex3": (10, {}),
}


@pytest.mark.ch08
@pytest.mark.parametrize("ex", [pytest.param(ex, marks=getattr(pytest.mark, ex)) for ex in ENGINE_CASES])
def test_ch08_engine_with_the_piece_equals_transformers(ex, tiny):
    """Prompts generating different lengths: decode batches of every size from max_num_seqs down to 1,
    padded to captured sizes (for ch08_ex2 sizes 1, 2, 4, 6 only: larger batches run eagerly)."""
    folder, hf = tiny
    max_num_seqs, replace = ENGINE_CASES[ex]
    with _graded(ex, **replace):
        eng = _graph_engine(folder, max_num_seqs)
        sizes = _rule_sizes(max_num_seqs) if ex != "ch08_ex2" else _rule_sizes(max_num_seqs, 6)
        captured = sorted(eng.model_runner.decode_graphs.graphs)
        _expect(captured == sizes, f"{ex}: the engine captured sizes {captured}, expected {sizes}")
        steps = _record_replays(eng.model_runner)
        prompts = random_prompts(max_num_seqs, 3, 30, seed=21)
        params = [SamplingParams(temperature=0, max_tokens=2 + k, ignore_eos=True) for k in range(max_num_seqs)]
        out = [o.outputs[0].token_ids for o in run_engine(eng, prompts, params)]
    want_steps = [[n, _grader_padded(n, sizes)] for n, _ in steps]
    _expect(steps == want_steps, f"{ex}: decode steps ran [batch size, graph replayed] {steps}, expected {want_steps}")
    for i, (p, sp) in enumerate(zip(prompts, params)):
        want = hf_greedy(hf, p, sp.max_tokens)
        _expect(out[i] == want, f"{ex}: prompt {i} ({len(p)} tokens, {sp.max_tokens} new, decode batches padded to "
                                f"captured sizes {sizes}): the engine gave {out[i]}, transformers {want}")
