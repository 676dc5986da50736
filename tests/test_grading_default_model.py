"""Graders on the default model against a recorded snapshot (`python -m minivllm.course.grade ch02_ex3`, `pytest -m ch02_ex3`).

The other graders run transformers on tiny random float64 models. These run the package on the real
default model, SmolLM2-135M-Instruct in float32, and compare it with what transformers computed on
it once, recorded in tests/data/snapshots/default_model.json by scripts/record_snapshots.py (CS336's
snapshot fixtures; tests/test_snapshots.py checks in the book that the file is what transformers
computes now). No oracle runs at grading time, so a student edition needs nothing but the model.

* ch02_ex3 (the decoder layer built whole; its part "the decoder equals transformers' logits"):
  the package's decoder, every part of the build the package's (`graded("whole")` of
  test_grading_ch02_regions.py), fed each prompt followed by transformers' greedy completion in one
  causal pass: at every completion step the logits of transformers' top 5 ids within `LOGITS_ATOL`,
  no other id above the fifth by more than that, so the greedy token is transformers' (each recorded
  step's top-2 gap is over `min_gap` = 5e-3, more than twice `LOGITS_ATOL`: no near tie can flip).
* ch04_ex2 and ch04_ex4 (the slot mapping, the flat batch) and ch05_ex1 (the paged KV cache built
  whole: the block manager and the paged decode; its part "the engine equals transformers"): the
  engine with the exercise's code and the grader's stand-ins for the other pieces of chapters 01, 02
  and 04 (`stand_ins`, `graded_scheduler`, `_Scaffold`, `_ReferenceDecode`), blocks of 4 tokens on a
  cache small enough to preempt: every prompt's greedy tokens equal the recorded ones, every block
  free at the end (the first 6 recorded tokens of each prompt).

Skipped where the default model is not installed, or its weights are not the ones the snapshot was
recorded on (their fingerprint differs); the tiny-model graders still grade these exercises.
"""
from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch

from script_loader import load_script
import minivllm.engine.llm_engine as engine_module
from engine_helpers import one_thread, run_engine
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model_executor.model_loader import load_model
from minivllm.baselines.naive import CausalAttention
from minivllm.attention.paged_attention import PagedAttention
from minivllm.sampling_params import SamplingParams
from test_grading_ch01_regions import graded as ch01_stand_ins
from test_grading_ch02_regions import WHOLE as CH02_WHOLE
from test_grading_ch02_regions import graded as ch02_graded
from minivllm.core.block_manager import BlockManager
from test_grading_ch04_06 import ENGINE as CH05_ENGINE
from test_grading_ch04_06 import _ReferenceDecode, _Scaffold
from test_grading_ch04_regions import EXERCISES as CH04_EXERCISES
from test_grading_ch04_regions import _GraderScheduler, graded_scheduler, stand_ins

SNAPSHOT = Path(__file__).resolve().parent / "data" / "snapshots" / "default_model.json"
LOGITS_ATOL = 1e-3  # float32: the package and transformers sum in other orders; measured ~6e-5 on these logits
# The engine graders run the first ENGINE_TOKENS recorded tokens of each prompt, blocks of 4: the
# prompts need 12 blocks, with their completions 16: on 14 blocks preemptions happen.
ENGINE_TOKENS, BLOCK_SIZE, NUM_BLOCKS = 6, 4, 14

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)
pytestmark = pytest.mark.slow  # the project's marker for tests on the default model


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


@pytest.fixture(scope="module")
def snapshot():
    """The default model's folder and the recorded snapshot (skips where they cannot be used)."""
    from minivllm.transformers_utils.model_files import resolve_model

    try:
        folder = resolve_model(None)
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"the default model is not installed ({e}); the tiny-model graders still run")
    snap = json.loads(SNAPSHOT.read_text())
    recorder = load_script("record_snapshots")
    if recorder.weights_fingerprint(folder) != snap["weights_sha256"]:
        pytest.skip(f"the default model in {folder} has other weights than the snapshot was recorded on")
    return folder, snap


@pytest.fixture(scope="module")
def decoder(snapshot):
    """The package's decoder on the default model, float32, CPU (loaded once; the engine's is another)."""
    return load_model(snapshot[0], dtype=torch.float32, device="cpu")


def _describe(snap: dict, i: int) -> str:
    p = snap["prompts"][i]
    return f"prompt {i} ({p['text']!r}, {len(p['prompt_token_ids'])} tokens)"


def _check_step(ex: str, where: str, row: torch.Tensor, step: dict) -> None:
    """The logits of one step against the recorded top 5 (see the module docstring)."""
    ids, want = torch.tensor(step["top_ids"]), torch.tensor(step["top_logits"], dtype=torch.float64)
    got = row.double()
    diff = (got[ids] - want).abs()
    k = int(diff.argmax())
    _expect(bool((diff <= LOGITS_ATOL).all()), f"{ex}: {where}: logit of token {int(ids[k])} (transformers' "
            f"rank {k + 1}) is {got[ids[k]].item():.6g}, transformers' {want[k].item():.6g}: differs by "
            f"{diff[k].item():.3g}, beyond float32's {LOGITS_ATOL:g}")
    others = got.clone()
    others[ids] = -float("inf")
    j = int(others.argmax())
    _expect(others[j].item() <= want[-1].item() + LOGITS_ATOL, f"{ex}: {where}: token {j} gets logit "
            f"{others[j].item():.6g}, above transformers' fifth largest ({want[-1].item():.6g}, token "
            f"{int(ids[-1])}); transformers' top 5 are {step['top_ids']}")


# --- chapter 02: the decoder built whole, logits at every step -----------------------------------
@pytest.mark.ch02
@pytest.mark.ch02_ex3
@pytest.mark.group(CH02_WHOLE)
def test_ch02_default_model_logits_and_greedy_tokens(snapshot, decoder):
    """The decoder with every part of the build the package's, on each prompt followed by transformers'
    greedy completion (one causal pass, no cache): the greedy token at every step is transformers', and
    the top logits are within LOGITS_ATOL of the recorded ones."""
    ex, (_, snap) = "ch02_ex3", snapshot
    scale = decoder.model.layers[0].self_attn.scale
    for i, p in enumerate(snap["prompts"]):
        prompt, steps = p["prompt_token_ids"], p["steps"]
        tokens = [s["token"] for s in steps]
        ids = torch.tensor(prompt + tokens[:-1])
        with ch01_stand_ins(None), ch02_graded("whole"), torch.no_grad():
            hidden = decoder(ids, torch.arange(len(ids)), CausalAttention(scale))
            _expect(isinstance(hidden, torch.Tensor) and hidden.shape[0] == len(ids), f"{ex}: the decoder "
                    f"should return [{len(ids)}, hidden_size] hidden states, got {getattr(hidden, 'shape', hidden)}")
            logits = decoder.compute_logits(hidden[len(prompt) - 1:]).float()
        _expect(bool(torch.isfinite(logits).all()), f"{ex}: {_describe(snap, i)}: the logits hold NaN or inf")
        greedy = logits.argmax(-1).tolist()
        for j, step in enumerate(steps):  # the first step that differs, by its token or by its logits
            where = (f"on the default model (SmolLM2-135M, float32), {_describe(snap, i)} followed by transformers' "
                     f"greedy completion {tokens}: the logits at position {len(prompt) - 1 + j}, which choose "
                     f"completion token {j}")
            _expect(greedy[j] == tokens[j], f"{ex}: {where}: your model's greedy token is {greedy[j]} (logit "
                    f"{logits[j, greedy[j]].item():.6g}), transformers' {tokens[j]} (recorded logit "
                    f"{step['top_logits'][0]:.6g}, yours {logits[j, tokens[j]].item():.6g})")
            _check_step(ex, where, logits[j], step)


# --- chapters 04 and 05: the engine, greedy tokens ----------------------------------------------
@pytest.fixture(scope="module")
def engine_model(snapshot):
    """A second decoder for the engines (the model runner packs its float32 linears for oneDNN in place)."""
    return load_model(snapshot[0], dtype=torch.float32, device="cpu")


def _pieces(ex: str):
    """(kv manager, attention backend, scheduler class, chapter 04's stand-ins) with `ex` the package's."""
    if ex in CH04_EXERCISES:
        return _Scaffold, PagedAttention, graded_scheduler(ex), ex
    return BlockManager, _ReferenceDecode, _GraderScheduler, None  # ch05_ex1: the block manager and the decode


@contextmanager
def _engine(ex: str, folder, model):
    kv, backend, scheduler_cls, ch04_ex = _pieces(ex)
    with ExitStack() as stack:
        stack.enter_context(ch01_stand_ins(None))
        stack.enter_context(ch02_graded(None))
        stack.enter_context(stand_ins(ch04_ex))
        stack.enter_context(mock.patch.object(engine_module, "load_model", lambda *a, **k: model))
        yield LLMEngine(model=folder, dtype="float32", device="cpu", max_model_len=BLOCK_SIZE * NUM_BLOCKS, block_size=BLOCK_SIZE,
                        num_kvcache_blocks=NUM_BLOCKS, max_num_seqs=4, max_num_batched_tokens=64, block_manager_cls=kv,
                        attention_backend=backend, scheduler_cls=scheduler_cls)


# the pieces on the data path (the scheduler's policy is graded on tiny models, under random workloads)
ENGINE_EXERCISES = ["ch04_ex2", "ch04_ex4", "ch05_ex1"]


@pytest.mark.parametrize("ex", [pytest.param(ex, marks=[getattr(pytest.mark, ex[:4]), getattr(pytest.mark, ex)] + (
    [pytest.mark.group(CH05_ENGINE)] if ex == "ch05_ex1" else []), id=ex) for ex in ENGINE_EXERCISES])
def test_engine_default_model_greedy_tokens(ex, snapshot, engine_model):
    """The engine with the exercise's code in place, blocks of 4 on a 14-block cache (preemptions):
    each prompt's greedy completion equals transformers' recorded one; every block free at the end."""
    folder, snap = snapshot
    prompts = [p["prompt_token_ids"] for p in snap["prompts"]]
    want = [[s["token"] for s in p["steps"][:ENGINE_TOKENS]] for p in snap["prompts"]]
    with _engine(ex, folder, engine_model) as engine:
        params = [SamplingParams(temperature=0, max_tokens=len(w), ignore_eos=True) for w in want]
        try:  # run_engine checks the engine's invariants after every step
            outs = run_engine(engine, prompts, params)
        except AssertionError as e:
            raise AssertionError(f"{ex}: on the default model, with your code the engine broke an invariant of its "
                                 f"KV cache (the traceback shows which): {e}") from e
        except NotImplementedError:
            raise  # a stub: its message names the exercise and the task
        except Exception as e:  # noqa: BLE001  (an error in the student's code: say whose and where)
            raise AssertionError(f"{ex}: on the default model, the engine with your code raised {type(e).__name__}: "
                                 f"{e} (the traceback shows where)") from e
    for i, (o, w) in enumerate(zip(outs, want)):
        got = o.outputs[0].token_ids
        j = next((j for j, (a, b) in enumerate(zip(got, w)) if a != b), min(len(got), len(w)))
        _expect(got == w, f"{ex}: on the default model (SmolLM2-135M, float32, blocks of {BLOCK_SIZE}), "
                f"{_describe(snap, i)}: the engine generated {got}, transformers {w} (recorded); first difference at "
                f"completion token {j} (position {len(prompts[i]) + j})")
    _expect(engine.block_manager.num_free_blocks == engine.block_manager.num_blocks,
            f"{ex}: {engine.block_manager.num_blocks - engine.block_manager.num_free_blocks} blocks still held after "
            "every request finished")
    assert engine.scheduler.num_preemptions > 0, "grader setup: the cache should have been tight enough to preempt"
