"""Chapter 08's CUDA graphs for decode (`minivllm.worker.cuda_graph`).

On a CPU the runner captures with `StandInGraph`, which records a step's ATen operations and replays
them on the same tensors (what a CUDA graph does with its kernels): the bookkeeping (capture sizes,
padding, static buffers, the dummy block) is checked there against chapter 05's eager runner and
against transformers, on tiny float64 models where no near-tie can flip a greedy token. The tests
marked `gpu` capture real CUDA graphs and are skipped without CUDA.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from engine_helpers import check_invariants, hf_greedy, make_model, one_thread, random_prompts, run_engine
from minivllm import defaults
from minivllm.attention.backend import ContiguousAttention
from minivllm.core.block_manager import BlockManager
from minivllm.config import EngineArgs
from minivllm.benchmarks.decode_step import CompiledOpsGraphRunner, decode_step_seconds
from minivllm.worker.cuda_graph import (COMPILE_OPTIONS, CUDAGRAPH_BACKENDS, CapturablePagedAttention, CUDAGraph, CUDAGraphModelRunner, DecodeBuffers, StandInGraph, compile_small_ops, cudagraph_capture_sizes, padded_batch_size, prepare_decode_inputs, supports_cudagraph)
from minivllm.engine.llm_engine import LLMEngine
from minivllm.attention.backends.flash_attn import FlashAttnPagedAttention
from minivllm.attention.backends.triton_attn import TritonPagedAttention
from minivllm.worker.model_runner import ModelRunner
from minivllm.model_executor.models.llama import RMSNorm, RotaryEmbedding
from minivllm.model_executor.model_loader import load_model
from minivllm.attention.paged_attention import PagedAttention
from minivllm.core.prefix_caching import PrefixCachingBlockManager
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA: only a GPU captures real CUDA graphs "
                                                 "(the CPU tests check the same bookkeeping with StandInGraph)")
MAX_NUM_SEQS = 20  # captured sizes 1, 2, 4, 8, 16, 20: most batch sizes are padded


@pytest.fixture(autouse=True)
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}-ch08")
    return folder, make_model(folder, request.param)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """One tiny model for the GPU tests (they share the GPU check's time)."""
    folder = tmp_path_factory.mktemp("tiny-llama-ch08-gpu")
    return folder, make_model(folder, "llama")


def engine(folder, device="cpu", dtype="float64", **kwargs) -> LLMEngine:
    settings = dict(model=folder, dtype=dtype, device=device, block_manager_cls=BlockManager, block_size=4,
                    max_model_len=128, num_kvcache_blocks=400, max_num_seqs=MAX_NUM_SEQS)
    return LLMEngine(**{**settings, **kwargs})


def graph_engine(folder, **kwargs) -> LLMEngine:
    return engine(folder, attention_backend=CapturablePagedAttention, model_runner_cls=CUDAGraphModelRunner, **kwargs)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def count_replays(runner) -> list[tuple[int, int]]:
    """Record (sequences, rows) for each decode step `runner` replays from a graph."""
    graphs, seen = runner.decode_graphs, []
    real_run = graphs.run

    def run(seqs):
        seen.append((len(seqs), padded_batch_size(len(seqs), graphs.capture_sizes)))
        return real_run(seqs)

    graphs.run = run
    return seen


# ---- capture sizes and padding ----

def test_capture_sizes():
    assert cudagraph_capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert cudagraph_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert cudagraph_capture_sizes(16) == [1, 2, 4, 8, 16]
    assert cudagraph_capture_sizes(3) == [1, 2, 3]
    assert cudagraph_capture_sizes(1) == [1]
    big = cudagraph_capture_sizes(1000)
    assert big[-1] == 512 and big == sorted(set(big)) and all(s <= 512 for s in big)
    assert cudagraph_capture_sizes(100, max_capture_size=40) == [1, 2, 4, 8, 16, 32, 40]
    for bad in (0, -1, 2.5, "8"):
        with pytest.raises(ValueError, match="max_num_seqs"):
            cudagraph_capture_sizes(bad)
    with pytest.raises(ValueError, match="max_capture_size"):
        cudagraph_capture_sizes(8, max_capture_size=0)


@pytest.mark.parametrize("max_num_seqs", [1, 7, 20, 256])
def test_padding_takes_the_smallest_captured_size_that_holds_the_batch(max_num_seqs):
    sizes = cudagraph_capture_sizes(max_num_seqs)
    for n in range(1, max_num_seqs + 1):
        rows = padded_batch_size(n, sizes)
        assert rows in sizes and rows >= n and not any(n <= s < rows for s in sizes)
    assert padded_batch_size(max_num_seqs + 1, sizes) is None
    with pytest.raises(AssertionError):  # an internal invariant: the engine never asks for 0 rows
        padded_batch_size(0, sizes)


# ---- the engine with graphs equals the eager engine and transformers ----

def test_graphs_equal_eager_and_transformers_for_every_batch_size(tiny):
    """20 prompts generating 2..21 tokens: decode batches of every size from 20 down to 1, most of
    them padded, rows of finished sequences turned back into padding."""
    folder, hf = tiny
    prompts = random_prompts(MAX_NUM_SEQS, 3, 40, seed=11)
    params = [SamplingParams(temperature=0, max_tokens=2 + k, ignore_eos=True) for k in range(MAX_NUM_SEQS)]
    eager = token_ids(run_engine(engine(folder, attention_backend=PagedAttention), prompts, params))
    graphs = graph_engine(folder)
    assert sorted(graphs.model_runner.decode_graphs.graphs) == [1, 2, 4, 8, 16, 20]
    replays = count_replays(graphs.model_runner)
    out = token_ids(run_engine(graphs, prompts, params))
    assert {n for n, _ in replays} == set(range(1, MAX_NUM_SEQS + 1))
    assert out == eager
    assert out == [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(prompts, params)]


def test_block_tables_grow_past_anything_seen_at_capture(tiny):
    """2-token blocks: tables of 30 to 52 blocks, in static tables of ceil(128 / 2) = 64 columns
    (at capture every table was `[dummy_block]`)."""
    folder, hf = tiny
    prompts = random_prompts(4, 60, 80, seed=12)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eng = graph_engine(folder, block_size=2, max_num_seqs=4)
    out = token_ids(run_engine(eng, prompts, params))
    buffers = eng.model_runner.decode_graphs.buffers
    assert buffers.block_tables.shape == (4, 64) and buffers.table_width > 40
    assert out == token_ids(run_engine(engine(folder, attention_backend=PagedAttention, block_size=2, max_num_seqs=4),
                                       prompts, params))
    assert out == [hf_greedy(hf, p, 24) for p in prompts]


def run_with_abort(eng, prompts, params, abort_index: int, abort_step: int) -> dict:
    """Step until idle, aborting request `abort_index` after `abort_step` steps; the outputs of the
    requests that finished, by index; invariants checked after every step."""
    ids = [eng.add_request(None, p, params) for p in prompts]
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        done.update({out.request_id: out for out in eng.step() if out.finished})
        steps += 1
        if steps == abort_step:
            eng.abort_request(ids[abort_index])
        check_invariants(eng)
        assert steps < 2000
    return {i: (done[r].outputs[0].token_ids, done[r].num_cached_tokens) for i, r in enumerate(ids)
            if r in done and i != abort_index}


def test_preemption_abort_and_prefix_hits_between_replays(tiny):
    """Six prompts sharing a 16-token prefix in a cache of 24 blocks of 4 (96 tokens; they need ~150):
    sequences are preempted and recomputed, one request is aborted in mid-decode, and prompts that
    come back hit the cached prefix. Every step's batch differs from the last; the graphs' tokens
    equal the eager engine's and transformers', and the dummy block stays outside the manager's count."""
    folder, hf = tiny
    shared = random_prompts(1, 16, 16, seed=30)[0]
    prompts = [shared + p for p in random_prompts(6, 2, 8, seed=31)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    settings = dict(block_manager_cls=PrefixCachingBlockManager, num_kvcache_blocks=24, max_model_len=96)
    graphs = graph_engine(folder, **settings)
    replays = count_replays(graphs.model_runner)
    out = run_with_abort(graphs, prompts, params, abort_index=2, abort_step=4)
    eager = run_with_abort(engine(folder, attention_backend=PagedAttention, **settings), prompts, params, 2, 4)
    assert graphs.scheduler.num_preemptions > 0 and len(replays) > 10
    assert graphs.scheduler.block_manager.num_blocks == 24 and graphs.model_runner.kv_cache.shape[2] == 25
    assert sorted(out) == [0, 1, 3, 4, 5] and out == eager
    assert all(tokens == hf_greedy(hf, prompts[i], 20) for i, (tokens, _) in out.items())
    assert any(cached >= 16 for _, cached in out.values())


def test_seeded_sampling_with_graphs_equals_eager(tiny):
    """Sampling runs on the replayed logits, outside the graph: seeded requests draw from their own
    generators and unseeded ones from the engine's, as in the eager engine (capture draws nothing)."""
    folder, _ = tiny
    prompts = random_prompts(5, 3, 20, seed=32)
    params = [SamplingParams(temperature=1.0, max_tokens=8, seed=seed, ignore_eos=True)
              for seed in (1, 2, None, 3, None)]
    eager = token_ids(run_engine(engine(folder, attention_backend=PagedAttention), prompts, params))
    graphs = graph_engine(folder)
    replays = count_replays(graphs.model_runner)
    assert token_ids(run_engine(graphs, prompts, params)) == eager and replays


def test_a_batch_larger_than_every_captured_size_runs_eagerly(tiny):
    """Captured sizes 1 and 2; a decode batch of 3 (possible when max_num_seqs exceeds
    MAX_CAPTURE_SIZE) takes chapter 04's eager path and gives its logits."""
    folder, _ = tiny
    model = load_model(folder, dtype=torch.float64)
    bm = BlockManager(64, 4)
    runner = CUDAGraphModelRunner(model, bm, attention_backend=CapturablePagedAttention, max_num_seqs=2,
                                  max_model_len=64)
    replays = count_replays(runner)
    eager = ModelRunner(model, BlockManager(64, 4), attention_backend=PagedAttention)
    batch = decode_ready(bm, 3, seed=33)
    with torch.inference_mode():
        runner.kv_cache.normal_(generator=torch.Generator().manual_seed(1))
        eager.kv_cache.copy_(runner.kv_cache[:, :, :bm.num_blocks])
        logits = runner.forward_logits(batch, False).clone()
        torch.testing.assert_close(logits, eager.forward_logits(batch, False), rtol=0, atol=1e-10)
        runner.forward_logits(batch[:2], False)
    assert replays == [(3, None), (2, 2)]


def decode_ready(bm: BlockManager, n: int, seed: int) -> list[Sequence]:
    seqs = [Sequence(p, block_size=bm.block_size) for p in random_prompts(n, 5, 20, seed=seed)]
    for s in seqs:
        bm.allocate(s)
    return seqs


def written_slots(cache: torch.Tensor, before: torch.Tensor) -> list[int]:
    """Flat slots (block * block_size + offset) where any layer's K or V changed."""
    return (cache != before).any(-1).any(-1).any(0).any(0).flatten().nonzero().flatten().tolist()


def test_padded_rows_write_only_the_dummy_slot(tiny):
    """5 sequences in the 8 rows of a captured size, just after a step of 8 sequences (rows 5-7 still
    hold other sequences' slots), on a cache of random values: only the 5 new slots and the dummy
    slot change, and the logits equal chapter 05's eager runner on a copy of the cache."""
    folder, _ = tiny
    model = load_model(folder, dtype=torch.float64)
    bm = BlockManager(64, 4)
    runner = CUDAGraphModelRunner(model, bm, attention_backend=CapturablePagedAttention, max_num_seqs=8,
                                  max_model_len=128)
    eager = ModelRunner(model, BlockManager(64, 4), attention_backend=PagedAttention)
    assert runner.dummy_block == bm.num_blocks and runner.kv_cache.shape[2] == bm.num_blocks + 1
    batch = decode_ready(bm, 8, seed=13)
    with torch.inference_mode():
        runner.forward_logits(batch, False)
        for s in batch:
            s.append_token(5)
            bm.may_append(s)
        runner.kv_cache.normal_(generator=torch.Generator().manual_seed(0))
        eager.kv_cache.copy_(runner.kv_cache[:, :, :bm.num_blocks])
        before = runner.kv_cache.clone()
        logits = runner.forward_logits(batch[:5], False).clone()
        expected = eager.forward_logits(batch[:5], False)
    new_slots = [s.block_table[(s.num_tokens - 1) // 4] * 4 + (s.num_tokens - 1) % 4 for s in batch[:5]]
    assert written_slots(runner.kv_cache, before) == sorted(new_slots + [runner.dummy_block * 4])
    # float64; a padded batch multiplies matrices of another shape, whose summation order may differ
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-10)


def test_static_buffers_are_reused(tiny):
    """Every step copies into the same tensors and replays the same graphs: nothing is reallocated."""
    folder, _ = tiny
    eng = graph_engine(folder)
    runner = eng.model_runner
    graphs, buffers = runner.decode_graphs, runner.decode_graphs.buffers
    names = ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables", "logits")
    addresses = {n: getattr(buffers, n).data_ptr() for n in names}
    host = {n: t.data_ptr() for n, t in buffers.host.items()}
    recorded = {size: [id(op) for op in g.ops] for size, g in graphs.graphs.items()}
    returned = []
    real_forward = runner.forward_logits
    runner.forward_logits = lambda seqs, is_prefill: returned.append(real_forward(seqs, is_prefill)) or returned[-1]
    prompts = random_prompts(6, 3, 20, seed=14)
    run_engine(eng, prompts, [SamplingParams(temperature=0, max_tokens=3 + k, ignore_eos=True) for k in range(6)])
    decode = returned[1:]  # the first call is the prefill
    assert decode and all(t.data_ptr() == addresses["logits"] for t in decode)
    assert {n: getattr(buffers, n).data_ptr() for n in names} == addresses
    assert {n: t.data_ptr() for n, t in buffers.host.items()} == host
    assert runner.decode_graphs is graphs and {s: [id(op) for op in g.ops] for s, g in graphs.graphs.items()} == recorded


def test_enforce_eager_captures_nothing(tiny):
    folder, hf = tiny
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eng = graph_engine(folder, enforce_eager=True)
    assert eng.model_runner.decode_graphs is None
    prompts = random_prompts(3, 3, 20, seed=15)
    assert token_ids(run_engine(eng, prompts, SamplingParams(temperature=0, max_tokens=6))) == \
        [hf_greedy(hf, p, 6) for p in prompts]


def test_a_backend_without_a_capturable_decode_runs_eagerly(tiny):
    folder, hf = tiny
    with pytest.warns(RuntimeWarning, match="PagedAttention has no capturable decode path"):
        eng = engine(folder, attention_backend=PagedAttention, model_runner_cls=CUDAGraphModelRunner)
    assert eng.model_runner.decode_graphs is None
    prompts = random_prompts(3, 3, 20, seed=16)
    assert token_ids(run_engine(eng, prompts, SamplingParams(temperature=0, max_tokens=6))) == \
        [hf_greedy(hf, p, 6) for p in prompts]


class ItemInDecode(CapturablePagedAttention):
    """Declares support but reads a value on the host in decode (what a CUDA capture refuses)."""

    def decode(self, q, k_cache, v_cache, md):
        assert md.context_lens.max().item() >= 1
        return super().decode(q, k_cache, v_cache, md)


def test_a_capture_that_fails_falls_back_to_eager(tiny):
    folder, hf = tiny
    with pytest.warns(RuntimeWarning, match="capturing decode steps failed"):
        eng = engine(folder, attention_backend=ItemInDecode, model_runner_cls=CUDAGraphModelRunner)
    assert eng.model_runner.decode_graphs is None
    prompts = random_prompts(2, 3, 20, seed=17)
    assert token_ids(run_engine(eng, prompts, SamplingParams(temperature=0, max_tokens=5))) == \
        [hf_greedy(hf, p, 5) for p in prompts]


def test_the_stand_in_freezes_host_decisions_like_a_graph(tiny):
    """Chapter 05's planned decode, falsely declared capturable: its plan (made on the host from the
    lengths at capture) is replayed for every batch, so the tokens go wrong. The stand-in catches
    what a real graph would get wrong."""
    folder, hf = tiny

    class Forced(PagedAttention):
        cudagraph_support = True

    prompts = random_prompts(6, 3, 40, seed=18)
    out = token_ids(run_engine(engine(folder, attention_backend=Forced, model_runner_cls=CUDAGraphModelRunner),
                               prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    assert out != [hf_greedy(hf, p, 8) for p in prompts]


def test_stand_in_graph_semantics():
    x, y = torch.zeros(4), torch.zeros(4)
    g = StandInGraph()
    g.capture(lambda: y.copy_(torch.sin(x).mul_(2) + x.to(torch.float64).sum().to(torch.float32)))
    assert g.ops and torch.equal(y, torch.zeros(4))
    x.copy_(torch.arange(4.0))
    g.replay()
    torch.testing.assert_close(y, torch.sin(x) * 2 + x.sum(), rtol=0, atol=1e-6)
    for read in (lambda: x.max().item(), lambda: int(x[0]), lambda: bool(x[0] > 0)):
        for mode in (False, True):
            with torch.inference_mode(mode), pytest.raises(RuntimeError, match="read on the host"):
                StandInGraph().capture(lambda: y.fill_(read()))


def test_which_backends_are_capturable():
    assert supports_cudagraph(CapturablePagedAttention) and supports_cudagraph(TritonPagedAttention)
    assert TritonPagedAttention in CUDAGRAPH_BACKENDS
    for cls in (PagedAttention, ContiguousAttention, FlashAttnPagedAttention):
        assert not supports_cudagraph(cls), cls
    assert not supports_cudagraph(type("TritonSubclass", (TritonPagedAttention,), {}))  # must declare itself
    assert supports_cudagraph(type("Declared", (PagedAttention,), {"cudagraph_support": True}))
    assert not supports_cudagraph(type("Undeclared", (CapturablePagedAttention,), {"cudagraph_support": False}))


def test_decode_buffers_refuse_what_they_cannot_hold():
    bm = BlockManager(16, 4)
    buffers = DecodeBuffers(4, 3, 4, bm.num_blocks, 8, torch.float32, torch.device("cpu"))
    seqs = decode_ready(bm, 2, seed=19)
    long = Sequence(list(range(13)), block_size=4)  # 4 blocks > 3
    bm.allocate(long)
    for batch, rows, match in ((seqs, 1, "2 sequences in 1 rows"), (seqs * 3, 8, "rows"), ([], 1, "0 sequences"),
                               ([long], 1, "block table of 4 blocks")):
        with pytest.raises(ValueError, match=match):
            prepare_decode_inputs(buffers, batch, rows)


def test_default_assembly_picks_graphs_only_on_cuda_without_enforce_eager(tiny):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert defaults.model_runner_for(EngineArgs(), cuda) is CUDAGraphModelRunner
    assert defaults.model_runner_for(EngineArgs(enforce_eager=True), cuda) is None
    assert defaults.model_runner_for(EngineArgs(), cpu) is None
    from minivllm.core.sched.chunked_prefill import ChunkedPrefillScheduler
    from minivllm.core.sched.scheduler import Scheduler
    from minivllm.llm import LLM
    from minivllm.worker.mixed_batch import MixedBatchCUDAGraphModelRunner, MixedBatchModelRunner

    chunked = EngineArgs(scheduler_cls=ChunkedPrefillScheduler)  # chapter 11's scheduler: its mixed steps
    assert defaults.model_runner_for(chunked, cuda) is MixedBatchCUDAGraphModelRunner
    assert defaults.model_runner_for(EngineArgs(scheduler_cls=ChunkedPrefillScheduler, enforce_eager=True),
                                     cuda) is MixedBatchModelRunner
    assert defaults.model_runner_for(chunked, cpu) is MixedBatchModelRunner
    llm = LLM(tiny[0], dtype="float64", device="cpu", num_kvcache_blocks=64, attention_backend=PagedAttention,
              scheduler_cls=Scheduler)
    assert type(llm.llm_engine.model_runner) is ModelRunner
    llm = LLM(tiny[0], dtype="float64", device="cpu", num_kvcache_blocks=64, attention_backend=PagedAttention)
    assert type(llm.llm_engine.model_runner) is MixedBatchModelRunner


def test_compile_small_ops_compiles_the_norms_and_the_rotary_embedding(tiny, monkeypatch):
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled.append((type(self), kw)))
    model = load_model(tiny[0], dtype=torch.float64)
    compile_small_ops(model)
    norms = sum(isinstance(m, RMSNorm) for m in model.modules())
    assert [c for c, _ in compiled].count(RMSNorm) == norms == 2 * model.config.num_hidden_layers + 1
    assert [c for c, _ in compiled].count(RotaryEmbedding) == 1
    assert all(kw == {"dynamic": True, "options": COMPILE_OPTIONS} for _, kw in compiled)
    compiled.clear()
    CompiledOpsGraphRunner(model, BlockManager(16, 4), attention_backend=CapturablePagedAttention, max_num_seqs=2,
                           max_model_len=32)
    assert len(compiled) == norms + 1
    assert not CUDAGraphModelRunner.compile_small_ops  # off: no GPU measurement shows a gain yet


def test_decode_step_seconds_times_a_runner(tiny):
    model = load_model(tiny[0], dtype=torch.float64)
    bm = BlockManager(16, 4)
    runner = CUDAGraphModelRunner(model, bm, attention_backend=CapturablePagedAttention, max_num_seqs=2,
                                  max_model_len=32)
    seconds = decode_step_seconds(runner, decode_ready(bm, 2, seed=20), num_steps=2, warmup=1)
    assert 0 < seconds < 60


# ---- on a GPU: real CUDA graphs ----

@pytest.mark.gpu
@needs_cuda
def test_gpu_graphs_equal_eager_and_transformers_for_every_batch_size(llama):
    """Real CUDA graphs (float64, the plain-torch capturable backend): every batch size 1..20."""
    folder, hf = llama
    prompts = random_prompts(MAX_NUM_SEQS, 3, 40, seed=21)
    params = [SamplingParams(temperature=0, max_tokens=2 + k, ignore_eos=True) for k in range(MAX_NUM_SEQS)]
    graphs = graph_engine(folder, device="cuda")
    assert all(isinstance(g, CUDAGraph) for g in graphs.model_runner.decode_graphs.graphs.values())
    replays = count_replays(graphs.model_runner)
    out = token_ids(run_engine(graphs, prompts, params))
    assert {n for n, _ in replays} == set(range(1, MAX_NUM_SEQS + 1))
    assert out == token_ids(run_engine(engine(folder, device="cuda", attention_backend=PagedAttention), prompts, params))
    assert out == [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(prompts, params)]


@pytest.mark.gpu
@needs_cuda
def test_gpu_block_tables_grow_past_anything_seen_at_capture(llama):
    folder, hf = llama
    prompts = random_prompts(4, 60, 80, seed=22)
    eng = graph_engine(folder, device="cuda", block_size=2, max_num_seqs=4)
    out = token_ids(run_engine(eng, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)))
    assert eng.model_runner.decode_graphs.buffers.table_width > 40
    assert out == [hf_greedy(hf, p, 24) for p in prompts]


@pytest.mark.gpu
@needs_cuda
def test_gpu_replay_runs_no_python(llama):
    """After capture the model's Python never runs again in decode: the graph replays its kernels."""
    folder, _ = llama
    model = load_model(folder, dtype=torch.float64, device="cuda")
    bm = BlockManager(64, 4)
    runner = CUDAGraphModelRunner(model, bm, attention_backend=CapturablePagedAttention, max_num_seqs=4,
                                  max_model_len=64)
    batch = decode_ready(bm, 3, seed=23)
    with torch.inference_mode():
        expected = ModelRunner.forward_logits(runner, batch, False).clone()  # eager, same cache
        model.model.forward = None  # any Python call of the decoder would now fail
        logits = runner.forward_logits(batch, False)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-10)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not CUDA or not TritonPagedAttention.is_available("cuda", torch.float32),
                    reason="needs CUDA and triton")
def test_gpu_triton_backend_is_captured_and_matches_eager(llama):
    """Chapter 07's Triton backend under graphs (float32): captured without a warning from the runner,
    and each decode batch size's logits match the eager runner on the same cache. The static tables
    are 128 blocks wide (max_model_len 512), so the graphs' decode takes the split-K path with splits
    counted for 512 keys, while eager decode over the real tables (5 blocks at most) runs one split.
    Tolerance 1e-4: float32 logits of order 1, computed by kernels of another batch shape and split
    count (IEEE float32 throughout, no TF32)."""
    folder, _ = llama
    model = load_model(folder, dtype=torch.float32, device="cuda")
    bm = BlockManager(256, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # (a library's own warnings, e.g. Triton's about its defaults, are not ours)
        runner = CUDAGraphModelRunner(model, bm, attention_backend=TritonPagedAttention, max_num_seqs=MAX_NUM_SEQS,
                                      max_model_len=512)
    assert runner.decode_graphs is not None and not [w for w in caught if "minivllm" in str(w.message)]
    assert runner.decode_graphs.buffers.block_tables.shape == (MAX_NUM_SEQS, 128)
    eager = ModelRunner(model, BlockManager(256, 4), attention_backend=TritonPagedAttention)
    seqs = decode_ready(bm, MAX_NUM_SEQS, seed=24)
    with torch.inference_mode():
        runner.kv_cache.normal_()
        eager.kv_cache.copy_(runner.kv_cache[:, :, :bm.num_blocks])
        for n in range(1, MAX_NUM_SEQS + 1):
            got = runner.forward_logits(seqs[:n], False).clone()
            torch.testing.assert_close(got, eager.forward_logits(seqs[:n], False), rtol=0, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_gpu_default_assembly_runs_with_graphs(tmp_path):
    """`LLM()` on CUDA: the graph runner with the default backend, tokens for every request."""
    from minivllm.llm import LLM

    make_model(tmp_path, "qwen3")
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", max_model_len=128, num_kvcache_blocks=256,
              max_num_seqs=8)
    runner = llm.llm_engine.model_runner
    assert isinstance(runner, CUDAGraphModelRunner)
    assert runner.decode_graphs is not None or not supports_cudagraph(type(runner.attn))
    outs = llm.generate(random_prompts(11, 3, 30, seed=25), SamplingParams(temperature=0, max_tokens=10,
                                                                         ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)


@pytest.mark.gpu
@needs_cuda
def test_gpu_compiled_small_ops_equal_eager():
    """`compile_small_ops` may only change rounding: in float32, the compiled decode step's logits equal
    the eager runner's (a model of SmolLM2-135M's shape, random weights, logits of order 1). Chapter 08
    keeps the switch off while this fails (on an H200 in bfloat16 the difference was 1.25)."""
    from minivllm.benchmarks.decode_step import decode_step_benchmark

    result = decode_step_benchmark(batch_sizes=(1, 3, 8), context_len=40, dtype=torch.float32, num_steps=2)
    diff = result["max_abs_logit_diff"]
    assert diff["CUDA graphs"] < 1e-4, diff  # the same kernels replayed
    assert diff["CUDA graphs + compiled small ops"] < 1e-3, diff  # float32 reassociation, not a different function


def test_compiled_small_ops_round_like_eager_on_cpu():
    """`compile_small_ops` fuses each RMSNorm and the rotary embedding, and its default options make the
    fused kernels round to bfloat16 wherever the eager code casts: on a CPU the compiled modules'
    bfloat16 outputs equal eager's bit for bit (with inductor's defaults about a quarter of RMSNorm's
    outputs differ by one bfloat16 step: it skips the rounding before the weight)."""
    from minivllm.worker.cuda_graph import compile_small_ops
    from minivllm.model_executor.models.llama import RMSNorm, RotaryEmbedding

    g = torch.Generator().manual_seed(0)
    model = torch.nn.ModuleList([RMSNorm(96, 1e-5), RotaryEmbedding(32, 512, 10000.0)]).to(torch.bfloat16)
    with torch.no_grad():
        model[0].weight.copy_(1 + 0.5 * torch.randn(96, generator=g))
    x = (3 * torch.randn(40, 96, generator=g)).bfloat16()
    pos = torch.randint(0, 500, (40,), generator=g)
    q, k = torch.randn(40, 4, 32, generator=g).bfloat16(), torch.randn(40, 2, 32, generator=g).bfloat16()
    with torch.inference_mode():
        want = (model[0](x), *model[1](pos, q.clone(), k.clone()))
        compile_small_ops(model)
        got = (model[0](x), *model[1](pos, q.clone(), k.clone()))
    for name, a, b in zip(("RMSNorm", "RoPE q", "RoPE k"), got, want):
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} of {a.numel()} outputs differ from eager"
