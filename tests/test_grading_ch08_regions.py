"""Grading tests for chapter 08's build (`python -m minivllm.course.grade ch08_ex1`, or `pytest -m ch08_ex1`).

ch08_ex1, the capture-and-replay runner, is graded in the package itself: in a student edition its
regions are the student's code, exported from the chapter (stubs until filled), and there is no
reference to compare with. It scores by parts (`@pytest.mark.group`, the groups of
`EXERCISES["ch08_ex1"]`), each on its own: the grader's stand-ins (`STAND_INS`, written here from the
chapter's stated contracts) take the place of the pieces a part is not about (`graded`), so a
student sees which part works. Random cases are derandomized (the same answer always scores the same
points). The tests at the end check that plausible wrong answers lose exactly their own part.

What is checked is the contract, never this chapter's code:
* capture sizes and padding: the sizes are the rule the docstring states (ascending first), for
  many limits; a batch is padded up to the smallest captured size that holds it, None when none
  does (hypothesis);
* static buffers: after each of a random sequence of decode batches of growing and shrinking size,
  the static tensors' first `num_rows` rows hold the batch (last token, position, slot, context
  length, block table then -1) and padding (token 0, position 0, the dummy slot, length 1,
  `[dummy, -1, ...]`), in the same tensors as before; a padded step writes only its own tokens'
  KV-cache slots and the dummy slot;
* replay: one graph per capture size, largest first, each warmed up then captured into one shared
  pool under inference mode (built outside it), the backend's metadata None again afterwards; for
  random decode batches one after another (hypothesis), `run` replays the graph of the padded size
  once, every padding row rewritten, and returns the real rows' logits, a view of the static logits,
  bit for bit those of the eager model step on the same padded inputs, with the same KV cache
  afterwards; a batch larger than every captured size gets None, nothing replayed, the static
  buffers untouched;
* the runner: its KV cache on the `meta` device (on the model's device, one block more, the dummy
  block); in the engine on a CPU (`StandInGraph` replays the recorded steps): greedy tokens equal
  transformers' on a tiny float64 model (no near-tie can flip a token), every decode batch replayed
  from the graph of its padded size, a batch larger than every captured size run eagerly, prefill
  never through the graphs.
"""
from __future__ import annotations

import functools
import random
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import minivllm.worker.cuda_graph as cg
from engine_helpers import hf_greedy, make_model, one_thread, random_prompts, run_engine, speed_ratio
from minivllm.attention.paged_attention import PagedAttention
from minivllm.core.block_manager import BlockManager
from minivllm.course.grade import EXERCISES as GRADED, SPEED_RATIO, speed_points
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model_executor.model_loader import load_model
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence
from minivllm.worker.cuda_graph import CapturablePagedAttention, CUDAGraphModelRunner, DecodeBuffers, DecodeGraphs
from minivllm.worker.model_runner import ModelRunner, prepare_batch

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)
SIZES, BUFFERS, REPLAY, ENGINE, SPEED = (name for name, _ in GRADED["ch08_ex1"].groups)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


@contextmanager
def your_code(what: str):
    """Within: an error raised by the code under grading, other than a stub's NotImplementedError (its
    message names the exercise and the task) or a check's AssertionError, becomes an AssertionError
    naming ch08_ex1 and what was running (the traceback still shows where)."""
    try:
        yield
    except (NotImplementedError, AssertionError):
        raise
    except Exception as e:  # noqa: BLE001  (an error in the student's code: say whose and where)
        raise AssertionError(f"ch08_ex1: {what} raised {type(e).__name__}: {e} (the traceback shows where)") from e


# --- the grader's stand-ins for the build's pieces ------------------------------------------------
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


class _GraderGraphs(DecodeGraphs):
    """The grader's capture, step and replay (module functions looked up at call time, so that the part
    under grading is the one they use)."""

    def __init__(self, model, attn, buffers, capture_sizes, graph_cls):
        self.model, self.attn, self.buffers, self.capture_sizes = model, attn, buffers, capture_sizes
        self.graphs, pool = {}, cg.graph_pool(buffers.device)
        with torch.inference_mode():
            for size in sorted(capture_sizes, reverse=True):
                fn = self.step(size)
                fn()
                self.graphs[size] = graph_cls()
                self.graphs[size].capture(fn, pool)

    def step(self, num_rows):
        b = self.buffers
        views = (b.metadata(num_rows), b.input_ids[:num_rows], b.positions[:num_rows], b.logits[:num_rows])

        def fn():
            md, ids, pos, out = views
            self.attn.metadata = md
            out.copy_(self.model.compute_logits(self.model(ids, pos, self.attn)))
            self.attn.metadata = None
        return fn

    def run(self, seqs):
        rows = cg.padded_batch_size(len(seqs), self.capture_sizes)
        if rows is None:
            return None
        cg.prepare_decode_inputs(self.buffers, seqs, rows)
        self.graphs[rows].replay()
        return self.buffers.logits.narrow(0, 0, len(seqs))


class _GraderRunner(CUDAGraphModelRunner):
    """The grader's dummy block and decode dispatch."""

    def allocate_kv_cache(self, num_blocks, block_size):
        return ModelRunner.allocate_kv_cache(self, num_blocks + 1, block_size)

    def forward_logits(self, seqs, is_prefill):
        if not is_prefill and self.decode_graphs is not None:
            logits = self.decode_graphs.run(seqs)
            if logits is not None:
                return logits
        return ModelRunner.forward_logits(self, seqs, is_prefill)


PIECES = {  # part -> (owner, attribute, the grader's stand-in)
    "sizes": [(cg, "cudagraph_capture_sizes", _rule_sizes), (cg, "padded_batch_size", _grader_padded)],
    "buffers": [(cg, "prepare_decode_inputs", _grader_prepare)],
    "replay": [(DecodeGraphs, name, getattr(_GraderGraphs, name)) for name in ("__init__", "step", "run")],
    "runner": [(CUDAGraphModelRunner, name, getattr(_GraderRunner, name)) for name in ("allocate_kv_cache",
                                                                                       "forward_logits")],
}
PART_GROUP = {"sizes": SIZES, "buffers": BUFFERS, "replay": REPLAY, "runner": ENGINE}
STAND_INS = {"ch08_ex1": [patch for patches in PIECES.values() for patch in patches]}


@contextmanager
def graded(part: str):
    """The package's (the student's) pieces of `part`, the grader's stand-ins for the build's others."""
    with ExitStack() as stack:
        for other, patches in PIECES.items():
            if other != part:
                for owner, name, fn in patches:
                    stack.enter_context(mock.patch.object(owner, name, fn))
        yield


_FOLDERS: list[tempfile.TemporaryDirectory] = []  # _tiny's folder, removed when this process exits


@functools.lru_cache(maxsize=None)
def _tiny():
    """A tiny random float64 Llama saved in a temporary folder: (folder, the transformers model)."""
    _FOLDERS.append(tempfile.TemporaryDirectory(prefix="minivllm-grading-ch08-"))
    folder = Path(_FOLDERS[-1].name)
    return folder, make_model(folder, "llama")


@functools.lru_cache(maxsize=None)
def _tiny_ours(device: str = "cpu"):
    return load_model(_tiny()[0], dtype=torch.float64).to(device)


# --- capture sizes and padding --------------------------------------------------------------------
def _expect_ascending(got, call: str) -> None:
    """The first thing checked about a list of capture sizes (so that unsorted sizes are named as such)."""
    _expect(isinstance(got, list), f"ch08_ex1: {call} returned {got!r}; expected a list of ints")
    _expect(all(a < b for a, b in zip(got, got[1:])), f"ch08_ex1: {call} returned {got!r}: not ascending (each "
            "size once, smallest first; padded_batch_size and the buffers' rows rely on the order)")


@settings(max_examples=150, deadline=None, derandomize=True, database=None, report_multiple_bugs=False)
@given(max_num_seqs=st.integers(1, 600), max_capture_size=st.integers(1, 600))
def check_capture_sizes(max_num_seqs, max_capture_size):
    got = cg.cudagraph_capture_sizes(max_num_seqs, max_capture_size)
    want = _rule_sizes(max_num_seqs, max_capture_size)
    _expect_ascending(got, f"cudagraph_capture_sizes({max_num_seqs}, max_capture_size={max_capture_size})")
    _expect(got == want,
            f"ch08_ex1: cudagraph_capture_sizes({max_num_seqs}, max_capture_size={max_capture_size}): expected "
            f"{want} (sizes of {cg.SMALL_CAPTURE_SIZES} below top={min(max_num_seqs, max_capture_size)}, the "
            f"multiples of {cg.CAPTURE_SIZE_STEP} below it, then top; ascending), got {got!r}")
    got = cg.cudagraph_capture_sizes(1000)
    _expect_ascending(got, "cudagraph_capture_sizes(1000)")
    _expect(got == _rule_sizes(1000), f"ch08_ex1: cudagraph_capture_sizes(1000) must stop at MAX_CAPTURE_SIZE="
            f"{cg.MAX_CAPTURE_SIZE}: expected ...{_rule_sizes(1000)[-3:]}, got {got!r}")


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@example(sizes={1, 2, 4}, num_seqs=3)  # a fixed case first (the draws depend on where the check is called from)
@given(sizes=st.sets(st.integers(1, 100), min_size=1, max_size=12), num_seqs=st.integers(1, 120))
def check_padding(sizes, num_seqs):
    sizes = sorted(sizes)
    got = cg.padded_batch_size(num_seqs, sizes)
    want = _grader_padded(num_seqs, sizes)
    _expect(got == want and (got is None or isinstance(got, int)),
            f"ch08_ex1: padded_batch_size({num_seqs}, {sizes}): expected {want} (the smallest captured size >= "
            f"{num_seqs}, padding up; None when none holds it), got {got!r}")


@pytest.mark.ch08
@pytest.mark.ch08_ex1
@pytest.mark.group(SIZES)
def test_ch08_ex1_capture_sizes_follow_the_rule():
    check_capture_sizes()


@pytest.mark.ch08
@pytest.mark.ch08_ex1
@pytest.mark.group(SIZES)
def test_ch08_ex1_padding_takes_the_smallest_size_that_holds_the_batch():
    check_padding()


# --- static buffers -------------------------------------------------------------------------------
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
            _expect(g == w, f"ch08_ex1: after {step}: {name} row {r} ({'a sequence' if r < n else 'padding'}; "
                            f"{n} sequences in {num_rows} rows, dummy block {dummy}): expected {w}, got {g}")


def _pool_of_sequences(rng: random.Random, bm: BlockManager, count: int) -> list[Sequence]:
    pool = [Sequence([rng.randrange(1, 50) for _ in range(rng.randint(1, 16))], block_size=BS) for _ in range(count)]
    for s in pool:
        bm.allocate(s)
    return pool


def _grow(rng: random.Random, bm: BlockManager, pool: list[Sequence], grow: int) -> None:
    for s in pool:
        for _ in range(grow if len(s.block_table) < bm.num_blocks // len(pool) else 0):  # never runs dry
            s.append_token(rng.randrange(1, 50))
            bm.may_append(s)


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(steps=st.lists(st.tuples(st.integers(1, MAX_ROWS), st.integers(0, 3)), min_size=1, max_size=8),
       seed=st.integers(0, 2**16))
def check_rows_hold_the_batch_then_padding(steps, seed):
    """Batches of random sizes one after another (rows of a larger batch must become padding again),
    sequences growing between steps (their tables widen): the static tensors' first `num_rows` rows
    hold exactly the batch and padding, and are the same tensors as before."""
    rng = random.Random(seed)
    bm = BlockManager(NUM_BLOCKS, BS)
    pool = _pool_of_sequences(rng, bm, MAX_ROWS)
    buffers = DecodeBuffers(MAX_ROWS, MAX_BLOCKS, BS, NUM_BLOCKS, 7, torch.float64, torch.device("cpu"))
    names = (*cg.DECODE_INPUTS, "block_tables")
    addresses = {name: getattr(buffers, name).data_ptr() for name in names}
    history = []
    for n, grow in steps:
        _grow(rng, bm, pool, grow)
        seqs = rng.sample(pool, n)
        num_rows = _grader_padded(n, _rule_sizes(MAX_ROWS))
        history.append(f"{n} sequences in {num_rows} rows")
        cg.prepare_decode_inputs(buffers, seqs, num_rows)
        _check_rows(buffers, seqs, num_rows, "; ".join(history))
    moved = [name for name in names if getattr(buffers, name).data_ptr() != addresses[name]]
    _expect(not moved, f"ch08_ex1: {moved} are new tensors: a captured graph reads the static ones; "
                       "write into them in place")


def _written_slots(cache: torch.Tensor, before: torch.Tensor) -> list[int]:
    """Flat slots (block * block_size + offset) where any layer's K or V changed."""
    return (cache != before).any(-1).any(-1).any(0).any(0).flatten().nonzero().flatten().tolist()


def check_padded_rows_write_only_the_dummy_slot():
    """5 sequences in the 8 rows of a captured size right after a step of 8 (rows 5-7 still hold other
    sequences' slots), on a cache of random values: only the 5 new slots and the dummy slot change,
    and the logits equal the eager runner's on a copy of the cache."""
    model, rng = _tiny_ours(), random.Random(13)
    with torch.inference_mode():
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
            f"ch08_ex1: a step of 5 sequences padded to 8 rows wrote KV-cache slots {written}; expected only the "
            f"sequences' new slots {new_slots} and the dummy slot {runner.dummy_block * 4}")
    # float64; a padded batch multiplies matrices of another shape, whose summation order may differ
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-10,
                               msg=lambda m: f"ch08_ex1: the padded step's logits against the eager runner's: {m}")


@pytest.mark.ch08
@pytest.mark.ch08_ex1
@pytest.mark.group(BUFFERS)
def test_ch08_ex1_rows_hold_the_batch_then_padding():
    with graded("buffers"):
        check_rows_hold_the_batch_then_padding()


@pytest.mark.ch08
@pytest.mark.ch08_ex1
@pytest.mark.group(BUFFERS)
def test_ch08_ex1_padded_rows_write_only_the_dummy_slot():
    with graded("buffers"):
        check_padded_rows_write_only_the_dummy_slot()


# --- replay ---------------------------------------------------------------------------------------
class _Log:
    """What the graphs under grading did: ("capture", graph, pool, in inference mode), ("captured", graph,
    None), ("replay", graph, None) and the model's calls ("call", rows, None), in order."""

    entries: list = []


def _recording(base: type) -> type:
    """A subclass of the graph class `base` that logs its captures (with their pool) and replays."""

    class Recorded(base):
        def capture(self, step, pool=None):
            _Log.entries.append(("capture", self, pool, torch.is_inference_mode_enabled()))
            super().capture(step, pool)
            _Log.entries.append(("captured", self, None))

        def replay(self):
            _Log.entries.append(("replay", self, None))
            super().replay()
    return Recorded


_Recorded = _recording(cg.StandInGraph)


def _graphs_on(model, sizes: list[int], max_rows: int, graph_cls: type = _Recorded):
    """A runner's KV cache and backend (eager), and a `DecodeGraphs` of the package over fresh buffers on the
    model's device, its graphs `graph_cls` (a `_recording` class); the model's calls are logged too."""
    runner = ModelRunner(model, BlockManager(NUM_BLOCKS + 1, BS), attention_backend=CapturablePagedAttention)
    buffers = DecodeBuffers(max_rows, MAX_BLOCKS, BS, NUM_BLOCKS, model.config.vocab_size, torch.float64,
                            runner.device)
    _Log.entries = []
    hook = model.register_forward_pre_hook(lambda m, args: _Log.entries.append(("call", args[0].shape[0], None)))
    try:
        graphs = DecodeGraphs(model, runner.attn, buffers, sizes, graph_cls)
    finally:
        hook.remove()
    return runner, graphs


def check_captures_one_graph_per_size():
    """Sizes [1, 2, 4, 8], `DecodeGraphs` built outside inference mode (as a caller may): one `graph_cls`
    graph per size in `graphs`, captured largest first and under `torch.inference_mode()`, each after a
    warm-up run of its own step (the model over that many rows, outside any capture), all into the pool
    `graph_pool` gave."""
    pool = object()
    sizes = _rule_sizes(MAX_ROWS)
    building = ("DecodeGraphs(...) built outside torch.inference_mode() (its constructor must warm up and capture "
                "under it)")
    with mock.patch.object(cg, "graph_pool", lambda device: pool), your_code(building):
        runner, graphs = _graphs_on(_tiny_ours(), sizes, MAX_ROWS)
    log = _Log.entries
    got = graphs.graphs if isinstance(graphs.graphs, dict) else {}
    _expect(sorted(got) == sizes and all(isinstance(g, _Recorded) for g in got.values())
            and len({id(g) for g in got.values()}) == len(sizes),
            f"ch08_ex1: DecodeGraphs(..., capture_sizes={sizes}, graph_cls).graphs should map each size to its own "
            f"graph_cls() graph, got {got!r}")
    captures = [i for i, e in enumerate(log) if e[0] == "capture"]
    _expect(len(captures) == len(sizes), f"ch08_ex1: {len(captures)} captures for capture sizes {sizes}; one per size")
    ends = [i for i, e in enumerate(log) if e[0] == "captured"]
    inside_any = {j for a, b in zip(captures, ends) for j in range(a, b + 1)}
    order = []
    for k, (i, end) in enumerate(zip(captures, ends)):
        inside = [e[1] for e in log[i + 1:end] if e[0] == "call"]
        size = inside[0] if inside else None
        order.append(size)
        _expect(size is not None and got.get(size) is log[i][1],
                f"ch08_ex1: capture {k + 1} ran the model over rows {inside}: a graph of size s records the step over "
                f"the static buffers' first s rows (and graphs[s] is that graph)")
        warm = [j for j in range(i) if j not in inside_any and log[j][0] == "call" and log[j][1] == size]
        _expect(bool(warm), f"ch08_ex1: the graph of size {size} was captured without a warm-up: run its step once, "
                f"eagerly, before capturing it (on a GPU lazy initialisation must not happen inside a capture)")
        _expect(log[i][2] is pool, f"ch08_ex1: the graph of size {size} was captured with pool {log[i][2]!r}; every "
                f"graph goes into the one pool graph_pool(buffers.device) returned")
        _expect(log[i][3], f"ch08_ex1: the graph of size {size} was captured outside torch.inference_mode() "
                "(DecodeGraphs was built outside it): capture under it, as the docstring says, or autograd records "
                "the step (the model's weights require grad), and a replay would keep its saved tensors alive")
    _expect(order == sorted(sizes, reverse=True), f"ch08_ex1: sizes captured in the order {order}; capture the "
            f"largest first (the smaller graphs then fit in the memory it leaves in the shared pool)")
    _expect(not any(e[0] == "replay" for e in log), "ch08_ex1: a graph was replayed while capturing")
    _expect(runner.attn.metadata is None, f"ch08_ex1: after the captures the backend's metadata is still "
            f"{runner.attn.metadata!r}: step sets attn.metadata for the model call and back to None afterwards "
            "(its docstring), so no later step reads a captured batch's views by mistake")


def check_replay_equals_the_eager_step(device: str = "cpu"):
    """Decode batches of random sizes one after another on a cache of random values (hypothesis; the
    graphs are captured once and replayed across the examples): each `run` replays the graph of the
    padded size once, and returns the real rows' logits (a view of the static logits), bit for bit the
    eager model step's on the same padded inputs; the KV cache afterwards is the same."""
    model, sizes = _tiny_ours(device), _rule_sizes(MAX_ROWS)
    graph_cls = _Recorded if device == "cpu" else _recording(cg.CUDAGraph)
    with torch.inference_mode():
        runner, graphs = _graphs_on(model, sizes, MAX_ROWS, graph_cls)
        ref = DecodeBuffers(MAX_ROWS, MAX_BLOCKS, BS, NUM_BLOCKS, model.config.vocab_size, torch.float64,
                            runner.device)

    @settings(max_examples=25, deadline=None, derandomize=True, database=None)
    @example(steps=[(3, 0)], seed=0)  # a fixed case first: 3 sequences in the graph of 4 (one padding row)
    @given(steps=st.lists(st.tuples(st.integers(1, MAX_ROWS), st.integers(0, 2)), min_size=1, max_size=6),
           seed=st.integers(0, 2**16))
    def replays(steps, seed):
        rng = random.Random(seed)
        with torch.inference_mode():
            bm = BlockManager(NUM_BLOCKS, BS)
            pool = _pool_of_sequences(rng, bm, MAX_ROWS)
            runner.kv_cache.normal_(generator=torch.Generator(runner.kv_cache.device).manual_seed(seed))
            ref_kv = runner.kv_cache.clone()
            ref_attn = CapturablePagedAttention(ref_kv, runner.attn.scale)
            history = []
            for n, grow in steps:
                _grow(rng, bm, pool, grow)
                seqs = rng.sample(pool, n)
                rows = _grader_padded(n, sizes)
                history.append(f"{n} sequences (graph of {rows})")
                check_one_replay(graphs, seqs, rows, ref, ref_attn, runner.kv_cache, ref_kv, "; ".join(history))

    replays()


def check_one_replay(graphs, seqs, rows, ref, ref_attn, kv, ref_kv, at):
    model, n = graphs.model, len(seqs)
    _Log.entries = []
    logits = graphs.run(seqs)
    replays = [e[1] for e in _Log.entries if e[0] == "replay"]
    which = [next((s for s, g in graphs.graphs.items() if g is r), None) for r in replays]
    _expect(which == [rows], f"ch08_ex1: after {at}: run replayed the graphs of sizes {which}; expected the "
            f"graph of {rows} once ({n} sequences padded up to the next captured size)")
    _expect(isinstance(logits, torch.Tensor) and tuple(logits.shape) == (n, model.config.vocab_size),
            f"ch08_ex1: after {at}: run returned {getattr(logits, 'shape', logits)!r}; expected the real "
            f"rows' logits, [{n}, {model.config.vocab_size}] (padded rows' logits are not returned)")
    _expect(logits.untyped_storage().data_ptr() == graphs.buffers.logits.untyped_storage().data_ptr(),
            f"ch08_ex1: after {at}: run's logits are not a view of buffers.logits, which the graph writes")
    _grader_prepare(ref, seqs, rows)
    inputs = (*cg.DECODE_INPUTS, "block_tables")
    bad_rows = sorted({r for name in inputs for r in range(rows)
                       if not torch.equal(getattr(graphs.buffers, name)[r], getattr(ref, name)[r])})
    _expect(not [r for r in bad_rows if r < n], f"ch08_ex1: after {at}: run left rows {bad_rows} of the static "
            f"inputs different from the batch's ({n} sequences): run fills the buffers with prepare_decode_inputs")
    _expect(not bad_rows, f"ch08_ex1: after {at}: the padding rows {bad_rows} of the static inputs were not "
            f"rewritten (they hold what an earlier step left): run must fill all {rows} rows of the padded size, "
            f"prepare_decode_inputs(buffers, seqs, {rows}), not only the {n} sequences' rows")
    ref_attn.metadata = ref.metadata(rows)
    want = model.compute_logits(model(ref.input_ids[:rows], ref.positions[:rows], ref_attn))[:n]
    ref_attn.metadata = None
    diff = (logits - want).abs().max().item()
    _expect(torch.equal(logits, want), f"ch08_ex1: after {at}: the replayed logits differ from the eager "
            f"step's on the same padded inputs (largest difference {diff:.3g}); a replay must compute "
            f"exactly the captured step over the buffers' current rows")
    bad = _written_slots(kv, ref_kv)
    _expect(not bad, f"ch08_ex1: after {at}: the replay left KV-cache slots {bad[:8]} different from the eager "
            f"step's (rows the step did not rewrite, or the rows of a graph of the wrong size, write K/V where an "
            f"earlier step's rows pointed)")


def check_larger_batch_is_not_replayed():
    """Graphs of sizes [1, 2, 4] over buffers of 8 rows, after a step of 3 sequences: `run` of 5 to 8
    sequences (more than the largest captured size) returns None, replays nothing and leaves every
    static tensor (inputs, block tables, logits) as it was; the caller then runs the step eagerly."""
    model, sizes, rng = _tiny_ours(), _rule_sizes(4), random.Random(17)
    names = (*cg.DECODE_INPUTS, "block_tables", "logits")
    with torch.inference_mode():
        _, graphs = _graphs_on(model, sizes, MAX_ROWS)
        pool = _pool_of_sequences(rng, BlockManager(NUM_BLOCKS, BS), MAX_ROWS)
        with your_code(f"DecodeGraphs.run of 3 sequences (graphs of sizes {sizes})"):
            graphs.run(pool[:3])
        for n in range(sizes[-1] + 1, MAX_ROWS + 1):
            before = {name: getattr(graphs.buffers, name).clone() for name in names}
            _Log.entries = []
            with your_code(f"DecodeGraphs.run of {n} sequences, more than the largest captured size {sizes[-1]} "
                           "(padded_batch_size gives None: run must return None at once)"):
                got = graphs.run(pool[:n])
            _expect(got is None, f"ch08_ex1: DecodeGraphs.run of {n} sequences (graphs of sizes {sizes}) returned "
                    f"{getattr(got, 'shape', got)!r}; expected None (no captured size holds the batch: the caller "
                    "runs it eagerly)")
            replays = [e for e in _Log.entries if e[0] == "replay"]
            _expect(not replays, f"ch08_ex1: DecodeGraphs.run of {n} sequences (graphs of sizes {sizes}) replayed "
                    f"{len(replays)} graph(s); with no captured size that holds the batch, replay nothing")
            changed = [name for name in names if not torch.equal(getattr(graphs.buffers, name), before[name])]
            _expect(not changed, f"ch08_ex1: DecodeGraphs.run of {n} sequences (graphs of sizes {sizes}) returned "
                    f"None but left the static buffers {changed} changed: check padded_batch_size's None before "
                    "filling anything (prepare_decode_inputs), and return")


@pytest.mark.ch08
@pytest.mark.ch08_ex1
@pytest.mark.group(REPLAY)
def test_ch08_ex1_captures_one_graph_per_size():
    with graded("replay"):
        check_captures_one_graph_per_size()


@pytest.mark.ch08
@pytest.mark.ch08_ex1
@pytest.mark.group(REPLAY)
def test_ch08_ex1_replay_equals_the_eager_step():
    with graded("replay"):
        check_replay_equals_the_eager_step()


@pytest.mark.ch08
@pytest.mark.ch08_ex1
@pytest.mark.group(REPLAY)
def test_ch08_ex1_a_batch_larger_than_every_size_is_not_replayed():
    with graded("replay"):
        check_larger_batch_is_not_replayed()


@pytest.mark.gpu
@pytest.mark.ch08
@pytest.mark.ch08_ex1
@pytest.mark.group(REPLAY)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: real CUDA graphs (on a CPU the stand-in "
                    "graph grades the same replay)")
def test_ch08_ex1_cuda_graph_replay_equals_the_eager_step():
    """The same check with `CUDAGraph`: captured kernels replayed on the GPU, float64. Besides what the CPU
    checks see, it catches what only a GPU shows: a step that synchronises with the host (`.cpu()`,
    `.tolist()`, `.item()` of a CUDA tensor inside `step`: the capture raises; on a CPU `.cpu()` is a no-op
    the stand-in graph cannot see), a capture outside a warm-up (lazy cuBLAS or Triton initialisation
    inside a capture), and static tensors or a KV cache left on the host (`torch.zeros(...)` without
    `device=`: the CPU-side meta-device check of the runner part catches the cache too)."""
    with graded("replay"):
        check_replay_equals_the_eager_step("cuda")


# --- the engine -----------------------------------------------------------------------------------
def _record_replays(runner) -> list[list]:
    """[batch size, size of the graph replayed or None] for each decode step; also checks that
    `forward_logits` returns a tensor and that a prefill step never reaches `decode_graphs.run` (so those
    mistakes are named rather than crashing later)."""
    steps, prefill = [], [False]
    real_forward, real_run = runner.forward_logits, runner.decode_graphs.run

    def forward_logits(seqs, is_prefill):
        if not is_prefill:
            steps.append([len(seqs), None])
        prefill[0] = is_prefill
        out = real_forward(seqs, is_prefill)
        _expect(isinstance(out, torch.Tensor), f"ch08_ex1: forward_logits({len(seqs)} sequences, is_prefill="
                f"{is_prefill}) returned {out!r}, not logits: when decode_graphs.run gives None (no captured size "
                "holds the batch), run the step eagerly (ModelRunner.forward_logits)")
        return out

    def run(seqs):
        _expect(not prefill[0], f"ch08_ex1: forward_logits({len(seqs)} sequences, is_prefill=True) called "
                "decode_graphs.run: a prefill step (many tokens per sequence) runs eagerly; graphs replay decode "
                "steps only")
        return real_run(seqs)

    for size, graph in runner.decode_graphs.graphs.items():
        def replay(real=graph.replay, size=size):
            steps[-1][1] = size
            real()
        graph.replay = replay
    runner.forward_logits, runner.decode_graphs.run = forward_logits, run
    return steps


ENGINE_CASES = {"all sizes": (10, cg.MAX_CAPTURE_SIZE), "sizes up to 6": (10, 6)}  # max_num_seqs, largest size


def check_kv_cache():
    """A runner on the `meta` device (no memory, and not the CPU, so a cache made without `device=` shows),
    `enforce_eager`: its KV cache is `ModelRunner`'s with one block more, the dummy block, on the model's
    device in its dtype. Checked before any capture, which writes the dummy block."""
    model, bm = _tiny_ours("meta"), BlockManager(NUM_BLOCKS, BS)
    with your_code("CUDAGraphModelRunner.allocate_kv_cache (a runner on the meta device, enforce_eager=True)"):
        runner = CUDAGraphModelRunner(model, bm, attention_backend=CapturablePagedAttention, enforce_eager=True)
    kv, want = runner.kv_cache, ModelRunner.allocate_kv_cache(runner, NUM_BLOCKS + 1, BS)
    _expect(isinstance(kv, torch.Tensor) and kv.device == want.device and kv.dtype == want.dtype,
            f"ch08_ex1: the KV cache of a runner whose model is on the {want.device} device is "
            f"{getattr(kv, 'device', kv)!r}, {getattr(kv, 'dtype', '')}: allocate it on the model's device in its "
            "dtype (device=self.device, dtype=self.dtype; ModelRunner.allocate_kv_cache does both)")
    _expect(kv.shape == want.shape, f"ch08_ex1: the KV cache has shape {tuple(kv.shape)} for a block manager of "
            f"{NUM_BLOCKS} blocks; expected {tuple(want.shape)}: one more block, the dummy block (id {NUM_BLOCKS}), "
            "is for padded rows (dimension 2 counts blocks)")


def check_engine_equals_transformers(case: str):
    """The KV cache first (`check_kv_cache`), then prompts generating different lengths: decode batches of
    every size from max_num_seqs down to 1, each replayed from the graph of its padded size (with sizes up
    to 6, larger batches run eagerly)."""
    check_kv_cache()
    folder, hf = _tiny()
    max_num_seqs, largest = ENGINE_CASES[case]
    sizes = _rule_sizes(max_num_seqs, largest)
    with mock.patch.object(cg, "cudagraph_capture_sizes", lambda m, c=cg.MAX_CAPTURE_SIZE: _rule_sizes(m, min(c, largest))), \
            your_code("building the engine with your CUDAGraphModelRunner (its KV cache, then the capture)"):
        eng = LLMEngine(model=folder, dtype="float64", device="cpu", block_manager_cls=BlockManager, block_size=4,
                        max_model_len=128, num_kvcache_blocks=400, max_num_seqs=max_num_seqs,
                        attention_backend=CapturablePagedAttention, model_runner_cls=CUDAGraphModelRunner)
        runner = eng.model_runner
        _expect(runner.decode_graphs is not None and sorted(runner.decode_graphs.graphs) == sizes,
                f"ch08_ex1: the engine's runner captured {runner.decode_graphs and sorted(runner.decode_graphs.graphs)}"
                f", expected graphs of sizes {sizes}")
        _expect(runner.kv_cache.shape[2] == eng.block_manager.num_blocks + 1,
                f"ch08_ex1: the KV cache has {runner.kv_cache.shape[2]} blocks for a block manager of "
                f"{eng.block_manager.num_blocks}: one more, the dummy block (id {eng.block_manager.num_blocks}), is "
                "for padded rows")
        steps = _record_replays(runner)
        prompts = random_prompts(max_num_seqs, 3, 30, seed=21)
        params = [SamplingParams(temperature=0, max_tokens=2 + k, ignore_eos=True) for k in range(max_num_seqs)]
        with your_code("the engine's steps with your CUDAGraphModelRunner"):
            out = [o.outputs[0].token_ids for o in run_engine(eng, prompts, params)]
    want_steps = [[n, _grader_padded(n, sizes)] for n, _ in steps]
    _expect(steps == want_steps, f"ch08_ex1: decode steps ran [batch size, graph replayed (None: eager)] {steps}, "
            f"expected {want_steps}")
    for i, (p, sp) in enumerate(zip(prompts, params)):
        want = hf_greedy(hf, p, sp.max_tokens)
        _expect(out[i] == want, f"ch08_ex1: prompt {i} ({len(p)} tokens, {sp.max_tokens} new, decode batches padded "
                                f"to captured sizes {sizes}): the engine gave {out[i]}, transformers {want}")


@pytest.mark.ch08
@pytest.mark.ch08_ex1
@pytest.mark.group(ENGINE)
@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_ch08_ex1_engine_equals_transformers_with_graphs(case):
    with graded("runner"):
        check_engine_equals_transformers(case)


# --- the speed part (a GPU only) -------------------------------------------------------------------
@contextmanager
def graders_runner():
    """Every piece of the build the grader's (the speed part's reference)."""
    with ExitStack() as stack:
        for patches in PIECES.values():
            for owner, name, fn in patches:
                stack.enter_context(mock.patch.object(owner, name, fn))
        yield


def check_decode_speed(device: str = "cuda", launches: int = 20, timer=speed_ratio) -> float:
    """The package's (the student's) `CUDAGraphModelRunner` and one built and run with the grader's pieces,
    on the tiny float64 Llama on `device`, graphs up to 8 rows: a decode step of 5 sequences (padded to
    8), first the same logits (1e-12), then timed side by side (`timer`: `speed_ratio`, `launches` steps
    per timing, each timing ending in a synchronisation). Returns the student's time over the grader's."""
    model, rng = _tiny_ours(device), random.Random(31)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.inference_mode():
        with your_code("building your CUDAGraphModelRunner (its KV cache, then the capture)"):
            yours = CUDAGraphModelRunner(model, BlockManager(NUM_BLOCKS, BS), attention_backend=CapturablePagedAttention,
                                         max_num_seqs=MAX_ROWS)
        with graders_runner():
            theirs = CUDAGraphModelRunner(model, BlockManager(NUM_BLOCKS, BS),
                                          attention_backend=CapturablePagedAttention, max_num_seqs=MAX_ROWS)
        seqs = _pool_of_sequences(rng, BlockManager(NUM_BLOCKS, BS), 5)  # block ids valid in both caches
        kv = torch.randn(yours.kv_cache.shape, generator=torch.Generator().manual_seed(5), dtype=yours.kv_cache.dtype)
        yours.kv_cache.copy_(kv)
        theirs.kv_cache.copy_(kv)

        def steps(runner, graders: bool):
            with graders_runner() if graders else ExitStack():
                for _ in range(launches):
                    out = runner.forward_logits(seqs, False)
                sync()
            return out

        with your_code("a decode step of 5 sequences with your CUDAGraphModelRunner"):
            got = steps(yours, False).clone()
        want = steps(theirs, True)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0, msg=lambda m: (
            f"ch08_ex1: the speed part's decode step (5 sequences, graphs up to {MAX_ROWS}) differs from the "
            f"grader's runner's (so it is not timed): {m}"))
        return timer(lambda: steps(yours, False), lambda: steps(theirs, True))


@pytest.mark.gpu
@pytest.mark.ch08
@pytest.mark.ch08_ex1
@pytest.mark.group(SPEED)
def test_ch08_ex1_decode_step_speed_on_a_gpu(record_property):
    """The speed part: on a CUDA GPU only (on a CPU the stand-in graph runs the step eagerly, so there is no
    launch cost to save), `check_decode_speed`'s ratio, scored by `EXERCISES["ch08_ex1"].speed`'s bands."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the speed part times real CUDA graphs")
    record_property(SPEED_RATIO, check_decode_speed("cuda"))


@pytest.mark.gpu
def test_ch08_ex1_speed_bands_tell_an_eager_runner_from_graphs(record_property):
    """The bands can fail a slow answer (not graded: it checks the grader): a runner whose graphs never
    replay (`DecodeGraphs.run` answers None, so every decode step runs eagerly, with the same logits)
    loses points against the grader's runner on a CUDA GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the speed part times real CUDA graphs")
    with mock.patch.object(DecodeGraphs, "run", lambda self, seqs: None):  # the grader's runner re-patches it
        ratio = check_decode_speed("cuda")
    record_property("eager_" + SPEED_RATIO, ratio)
    (_, bands), = GRADED["ch08_ex1"].speed
    assert speed_points(bands, ratio) < bands[0][1], (
        f"an eager decode step took {ratio:.2f}x the graphs' time and kept full points (bands {bands})")


def test_ch08_ex1_speed_check_runs_on_a_cpu():
    """The speed part's check, on a CPU with the stand-in graph and one round (not graded: it shows the
    check itself runs, and that the book's runner matches the grader's logits there)."""
    ratio = check_decode_speed("cpu", launches=2, timer=lambda a, b: speed_ratio(a, b, rounds=1, calls=1, warmup=0))
    assert ratio > 0


# --- plausible wrong answers lose exactly their part (not graded: they check the graders) ------------
CHECKS = {"sizes": [check_capture_sizes, check_padding],
          "buffers": [check_rows_hold_the_batch_then_padding, check_padded_rows_write_only_the_dummy_slot],
          "replay": [check_captures_one_graph_per_size, check_replay_equals_the_eager_step,
                     check_larger_batch_is_not_replayed],
          "runner": [functools.partial(check_engine_equals_transformers, case) for case in ENGINE_CASES]}


def _pads_down(num_seqs, capture_sizes):
    """The largest captured size <= the batch (padding down: the graph drops sequences)."""
    return max((s for s in capture_sizes if s <= num_seqs), default=None)


def _largest_first(max_num_seqs, max_capture_size=cg.MAX_CAPTURE_SIZE):
    """The right sizes, the largest put first."""
    sizes = _rule_sizes(max_num_seqs, max_capture_size)
    return sizes[-1:] + sizes[:-1]


def _leaves_stale_rows(buffers, seqs, num_rows):
    """Writes the batch's rows but leaves rows [len(seqs):num_rows] as an earlier step left them."""
    n = len(seqs)
    input_ids, positions, md, _ = prepare_batch(seqs, False, buffers.block_size, torch.device("cpu"))
    for name, value in zip(cg.DECODE_INPUTS, (input_ids, positions, md.slot_mapping, md.context_lens)):
        getattr(buffers, name)[:n] = value
    buffers.block_tables[:n] = -1
    buffers.block_tables[:n, :md.block_tables.shape[1]] = md.block_tables


def _replays_the_largest(self, seqs):
    """Fills the padded rows, then replays the largest graph (rows past the padded size: stale)."""
    rows = cg.padded_batch_size(len(seqs), self.capture_sizes)
    if rows is None:
        return None
    cg.prepare_decode_inputs(self.buffers, seqs, rows)
    self.graphs[max(self.graphs)].replay()
    return self.buffers.logits[:len(seqs)]


def _returns_padding_rows(self, seqs):
    """Returns the logits of every replayed row, padding included."""
    rows = cg.padded_batch_size(len(seqs), self.capture_sizes)
    if rows is None:
        return None
    cg.prepare_decode_inputs(self.buffers, seqs, rows)
    self.graphs[rows].replay()
    return self.buffers.logits[:rows]


def _no_none_check(self, seqs):
    """Replays whatever padded_batch_size gives, None included (no eager fallback for large batches)."""
    rows = cg.padded_batch_size(len(seqs), self.capture_sizes)
    cg.prepare_decode_inputs(self.buffers, seqs, rows)
    self.graphs[rows].replay()
    return self.buffers.logits[:len(seqs)]


def _none_check_after_filling(self, seqs):
    """Fills the largest size's rows before checking for None (a batch that runs eagerly has changed the
    static buffers)."""
    rows = cg.padded_batch_size(len(seqs), self.capture_sizes)
    cg.prepare_decode_inputs(self.buffers, seqs[:self.capture_sizes[-1]], rows or self.capture_sizes[-1])
    if rows is None:
        return None
    self.graphs[rows].replay()
    return self.buffers.logits[:len(seqs)]


def _fills_only_the_real_rows(self, seqs):
    """Fills rows [:len(seqs)] only: the padding rows keep what an earlier step left."""
    rows = cg.padded_batch_size(len(seqs), self.capture_sizes)
    if rows is None:
        return None
    cg.prepare_decode_inputs(self.buffers, seqs, len(seqs))
    self.graphs[rows].replay()
    return self.buffers.logits[:len(seqs)]


def _captures_outside_inference_mode(self, model, attn, buffers, capture_sizes, graph_cls):
    """Warms up and captures each size, largest first, in whatever grad mode the caller is in."""
    self.model, self.attn, self.buffers, self.capture_sizes = model, attn, buffers, capture_sizes
    self.graphs, pool = {}, cg.graph_pool(buffers.device)
    for size in reversed(capture_sizes):
        step = self.step(size)
        step()
        self.graphs[size] = graph_cls()
        self.graphs[size].capture(step, pool)


def _keeps_the_metadata(self, num_rows):
    """The right step, except that attn.metadata stays set to the captured views afterwards."""
    b = self.buffers
    md, ids, pos, out = b.metadata(num_rows), b.input_ids[:num_rows], b.positions[:num_rows], b.logits[:num_rows]

    def fn():
        self.attn.metadata = md
        out.copy_(self.model.compute_logits(self.model(ids, pos, self.attn)))
    return fn


def _no_warm_up(self, model, attn, buffers, capture_sizes, graph_cls):
    """Captures each step without running it first."""
    self.model, self.attn, self.buffers, self.capture_sizes = model, attn, buffers, capture_sizes
    self.graphs, pool = {}, cg.graph_pool(buffers.device)
    with torch.inference_mode():
        for size in reversed(capture_sizes):
            self.graphs[size] = graph_cls()
            self.graphs[size].capture(self.step(size), pool)


def _always_eager(self, seqs, is_prefill):
    """Never replays: every step eager (the tokens are right, the graphs unused)."""
    return ModelRunner.forward_logits(self, seqs, is_prefill)


def _no_eager_fallback(self, seqs, is_prefill):
    """Returns decode_graphs.run's result, None included (a batch larger than every size gets no logits)."""
    if not is_prefill and self.decode_graphs is not None:
        return self.decode_graphs.run(seqs)
    return ModelRunner.forward_logits(self, seqs, is_prefill)


def _graphs_for_prefill(self, seqs, is_prefill):
    """Tries the graphs for prefill steps too."""
    logits = None if self.decode_graphs is None else self.decode_graphs.run(seqs)
    return ModelRunner.forward_logits(self, seqs, is_prefill) if logits is None else logits


def _no_dummy_block(self, num_blocks, block_size):
    """The KV cache without the dummy block."""
    return ModelRunner.allocate_kv_cache(self, num_blocks, block_size)


def _cache_on_the_default_device(self, num_blocks, block_size):
    """The KV cache with the dummy block, written out without `device=` (on the CPU, whatever the model's)."""
    attn0 = self.model.model.layers[0].self_attn
    return torch.zeros(2, len(self.model.model.layers), num_blocks + 1, block_size, attn0.num_kv_heads,
                       attn0.head_dim, dtype=self.dtype)


WRONG = [  # part, owner, name, the wrong piece, words its part's failure message must contain
    ("sizes", cg, "cudagraph_capture_sizes", _largest_first, "not ascending"),
    ("sizes", cg, "padded_batch_size", _pads_down, "padding up"),
    ("buffers", cg, "prepare_decode_inputs", _leaves_stale_rows, "padding"),
    ("replay", DecodeGraphs, "run", _replays_the_largest, "replayed the graphs of sizes"),
    ("replay", DecodeGraphs, "run", _returns_padding_rows, "padded rows' logits are not returned"),
    ("replay", DecodeGraphs, "run", _no_none_check, "must return None"),
    ("replay", DecodeGraphs, "run", _none_check_after_filling, "left the static buffers"),
    ("replay", DecodeGraphs, "run", _fills_only_the_real_rows, "padding rows"),
    ("replay", DecodeGraphs, "__init__", _no_warm_up, "without a warm-up"),
    ("replay", DecodeGraphs, "step", _keeps_the_metadata, "back to None"),
    ("replay", DecodeGraphs, "__init__", _captures_outside_inference_mode, "outside torch.inference_mode()"),
    ("runner", CUDAGraphModelRunner, "forward_logits", _always_eager, "expected [["),
    ("runner", CUDAGraphModelRunner, "forward_logits", _no_eager_fallback, "run the step eagerly"),
    ("runner", CUDAGraphModelRunner, "forward_logits", _graphs_for_prefill, "a prefill step"),
    ("runner", CUDAGraphModelRunner, "allocate_kv_cache", _no_dummy_block, "the dummy block"),
    ("runner", CUDAGraphModelRunner, "allocate_kv_cache", _cache_on_the_default_device, "on the model's device")]


@pytest.mark.parametrize("part, owner, name, wrong, words", WRONG, ids=[w[3].__name__ for w in WRONG])
def test_ch08_ex1_wrong_answers_lose_their_part(part, owner, name, wrong, words):
    """Each wrong piece, put in the package's place, fails its own part's checks, with a message that names
    the mistake (`words`), and passes every other part's (which run the grader's stand-in in its place): it
    loses exactly its part's points."""
    failed = {}
    with mock.patch.object(owner, name, wrong):
        for other, checks in CHECKS.items():
            with graded(other):
                for check in checks:
                    try:
                        check()
                    except Exception as e:  # noqa: BLE001  (a failure of any kind loses the part)
                        failed.setdefault(other, f"{type(e).__name__}: {e}" if not isinstance(e, AssertionError) else str(e))
    assert list(failed) == [part], f"{wrong.__name__}: parts failed {failed}; expected only {part!r}"
    assert failed[part].startswith("ch08_ex1: ") and words in failed[part], failed[part]
