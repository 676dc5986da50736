"""Grading tests for chapter 03's rebuild exercises (`python -m minivllm.course.grade ch03_ex2`, or `pytest -m ch03_ex2`).

ch03_ex2 (`pad_batch`'s layout), ch03_ex3 (`padded_attention`'s mask) and ch03_ex4 (the finished-row
rule of `static_generate`) are graded in the package itself: in a student edition they are the
student's code, exported from the chapter (stubs until filled), and there is no reference to compare
with. Each is graded alone: `_stand_ins` puts the grader's own `pad_batch` and `padded_attention` in
place of the ones the exercise is not about, so a filled region passes whatever state the others are in.

What is checked is the contract, never this chapter's code:
* the padded batch: shapes and dtypes, each row ending with its prompt, padding ids, real positions
  counting from 0 at each prompt's first token, padding positions valid;
* the mask: every real row of `padded_attention` equals `attention_reference` on that row alone
  (float64, float32, bfloat16), and nothing is NaN (padding queries included);
* the finished-row rule: scripted models make each row's tokens known in advance; a row stops at
  `max_tokens` or at EOS (kept) unless `ignore_eos`, and the batch stops after its last row;
* end to end: the tiny model (float64) through a padded prefill and decode gives each prompt's own
  transformers logits; `static_generate` gives transformers' greedy tokens cut at EOS or `max_tokens`.
"""
from __future__ import annotations

from collections import Counter
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minivllm.baselines.static_batching as sb
from engine_helpers import hf_greedy, one_thread
from minivllm.model_executor.models.llama import attention_reference
from minivllm.model_executor.model_loader import load_model
from minivllm.sampling_params import SamplingParams
from minivllm.course.testing import random_prompts

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


# --- the grader's stand-ins ----------------------------------------------------------------------
def _grader_pad_batch(prompts, pad_token_id: int = 0, device="cpu") -> sb.PaddedBatch:
    """Left padding written row by row (padding positions 0)."""
    width = max(len(p) for p in prompts)
    rows, pos = [], []
    for p in prompts:
        pad = width - len(p)
        rows.append([pad_token_id] * pad + list(p))
        pos.append([0] * pad + list(range(len(p))))
    as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return sb.PaddedBatch(as_t(rows), as_t(pos), as_t([width - len(p) for p in prompts]))


def _grader_padded_attention(q, k, v, pad_lens, scale):
    """Each row on its own with `attention_reference`; a padding query reads its own column only."""
    out = torch.empty_like(q)
    tq, tk = q.shape[1], k.shape[1]
    for b in range(q.shape[0]):
        pad = int(pad_lens[b])
        for i in range(tq):
            col = tk - tq + i
            first = pad if col >= pad else col  # a padding query: its own column, finite garbage
            out[b, i] = attention_reference(q[b, i:i + 1], k[b, first:col + 1], v[b, first:col + 1], scale)[0]
    return out


STAND_INS = {"ch03_ex2": "pad_batch", "ch03_ex3": "padded_attention", "ch03_ex4": None}


@contextmanager
def _stand_ins(ex: str):
    """The package's (the student's) piece for `ex`, the grader's for the other regions."""
    mine = {"pad_batch": _grader_pad_batch, "padded_attention": _grader_padded_attention}
    with ExitStack() as stack:
        for name, fn in mine.items():
            if name != STAND_INS[ex]:
                stack.enter_context(mock.patch.object(sb, name, fn))
        yield


# --- ch03_ex2: pad_batch -------------------------------------------------------------------------
@pytest.mark.ch03
@pytest.mark.ch03_ex2
@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(1, 99), min_size=1, max_size=9), min_size=1, max_size=5),
       pad_token_id=st.integers(0, 5))
def test_ch03_ex2_pad_batch_layout(prompts, pad_token_id):
    """Random prompts: `[batch_size, width]` int64 tensors, each row padding then its prompt, its real
    positions 0..n-1, padding positions in [0, width)."""
    batch = sb.pad_batch(prompts, pad_token_id)
    width, bsz = max(map(len, prompts)), len(prompts)
    at = f"ch03_ex2: prompts {prompts}, pad_token_id {pad_token_id}: "
    for name in ("input_ids", "positions", "pad_lens"):
        t = getattr(batch, name)
        _expect(isinstance(t, torch.Tensor) and t.dtype == torch.int64, f"{at}{name} must be an int64 tensor, got "
                f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    _expect(tuple(batch.input_ids.shape) == (bsz, width) and tuple(batch.positions.shape) == (bsz, width),
            f"{at}input_ids and positions must be [{bsz}, {width}], got {tuple(batch.input_ids.shape)} and "
            f"{tuple(batch.positions.shape)}")
    want_pad = [width - len(p) for p in prompts]
    _expect(batch.pad_lens.tolist() == want_pad, f"{at}pad_lens should be {want_pad}, got {batch.pad_lens.tolist()}")
    for b, p in enumerate(prompts):
        pad, row, pos = want_pad[b], batch.input_ids[b].tolist(), batch.positions[b].tolist()
        _expect(row == [pad_token_id] * pad + p, f"{at}row {b} should be {pad} padding ids then the prompt "
                f"(left padding: every row's newest token in the last column), got {row}")
        _expect(pos[pad:] == list(range(len(p))), f"{at}row {b}'s real tokens should sit at positions "
                f"{list(range(len(p)))} (RoPE sees position 0 at a prompt's first token, whatever its padding), "
                f"got {pos[pad:]}")
        _expect(all(0 <= x < width for x in pos[:pad]), f"{at}row {b}'s padding positions {pos[:pad]} should be "
                f"valid positions in [0, {width})")


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    folder, hf = tiny_llama
    return load_model(folder, dtype=torch.float64), hf


@pytest.mark.ch03
@pytest.mark.parametrize("ex", [pytest.param(ex, marks=getattr(pytest.mark, ex), id=ex)
                                for ex in ("ch03_ex2", "ch03_ex3")])
def test_ch03_padded_prefill_and_decode_equal_transformers(ex, tiny):
    """The tiny model (float64) on a left-padded batch, prefill then one decode column: each row's real
    columns give the logits transformers gives the prompt alone (1e-9: float64 rounding only)."""
    model, hf = tiny
    prompts = random_prompts(4, 1, 11, seed=3) + [[5]]
    with _stand_ins(ex), torch.inference_mode():
        batch = sb.pad_batch(prompts, 0)
        width = batch.input_ids.shape[1]
        cache = sb.StaticBatchKVCache(model.model.layers[0].self_attn.scale, batch.pad_lens, width + 1)
        hidden = model(batch.input_ids.reshape(-1), batch.positions.reshape(-1), cache)
        logits = model.compute_logits(hidden).view(len(prompts), width, -1)
        nxt = logits[:, -1].argmax(-1)
        dec = model.compute_logits(model(nxt, batch.positions[:, -1] + 1, cache))
        for b, p in enumerate(prompts):
            want = hf(torch.tensor([p + [int(nxt[b])]])).logits[0]
            diff = (logits[b, width - len(p):] - want[:-1]).abs()
            _expect(float(diff.max()) < 1e-9, f"{ex}: prefill of prompts of lengths {[len(q) for q in prompts]} "
                    f"padded to {width}: row {b} ({len(p)} tokens) differs from transformers on the prompt alone by "
                    f"{float(diff.max()):.3g} at its token {int(diff.amax(-1).argmax())}")
            d = float((dec[b] - want[-1]).abs().max())
            _expect(d < 1e-9, f"{ex}: the decode step after the padded prefill: row {b} ({len(p)} prompt tokens) "
                    f"differs from transformers by {d:.3g}")


# --- ch03_ex3: padded_attention ------------------------------------------------------------------
# float64: rounding only. float32: ~1e-7 relative per operation over a dozen keys. bfloat16 keeps 8
# significant bits: scores of size ~3 carry errors ~1e-2, which the softmax passes on to the weights.
TOL = {torch.float64: (1e-12, 0.0), torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-2, 2e-2)}


@pytest.mark.ch03
@pytest.mark.ch03_ex3
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 10), min_size=1, max_size=4), groups=st.sampled_from([1, 2, 3]),
       decode=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_ch03_ex3_padded_attention_equals_each_row_alone(dtype, lens, groups, decode, seed):
    """Rows of random lengths left-padded, queries the last Tq columns (all of them at a prefill, 1
    or 2 at decode steps): each real query equals `attention_reference` over its row's real keys,
    computed in float64 from the same rounded inputs; no output is NaN, padding rows included."""
    g = torch.Generator().manual_seed(seed)
    kvh, d = 2, 8
    width = max(lens) + (decode > 0) * decode
    real = [n + (decode > 0) * decode for n in lens]  # real columns per row
    pad_lens = torch.tensor([width - n for n in real])
    tq = width if decode == 0 else decode
    q = torch.randn(len(lens), tq, kvh * groups, d, generator=g, dtype=torch.float64).to(dtype)
    k, v = torch.randn(2, len(lens), width, kvh, d, generator=g, dtype=torch.float64).to(dtype)
    got = sb.padded_attention(q, k, v, pad_lens, 0.35)
    at = f"ch03_ex3 ({dtype}): rows of {real} real columns padded to {width}, {tq} query column(s), " \
         f"{kvh * groups} query heads over {kvh} K/V heads"
    _expect(isinstance(got, torch.Tensor) and got.shape == q.shape and got.dtype == q.dtype,
            f"{at}: expected shape {tuple(q.shape)} and dtype {q.dtype}, got "
            f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
    bad = (~torch.isfinite(got)).nonzero()
    _expect(len(bad) == 0, f"{at}: NaN or inf at [row, query, head, dim] {bad[0].tolist() if len(bad) else ''} — a "
            "padding query that sees no key at all gives a softmax over nothing; let each query see its own column")
    atol, rtol = TOL[dtype]
    for b, n in enumerate(real):
        nq = min(tq, n)  # the real queries of row b: its last nq columns
        want = attention_reference(q[b, tq - nq:].double(), k[b, width - n:].double(), v[b, width - n:].double(), 0.35)
        torch.testing.assert_close(got[b, tq - nq:].double(), want, atol=atol, rtol=rtol, msg=lambda m: (
            f"{at}: row {b} (padding {width - n}) against attention_reference on the row alone "
            f"(causal over its real keys; index = [query, head, dim] of its real queries): {m}"))


# --- ch03_ex4: the finished-row rule -------------------------------------------------------------
VOCAB = 16


class _ScriptedModel:
    """A stand-in for the decoder whose greedy next token is `NEXT[last token]`, whatever the batch:
    each row's tokens are known in advance. It has what `static_generate` reads of a model."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.next = torch.randint(0, VOCAB, (VOCAB,), generator=g)
        self.lm_head = SimpleNamespace(weight=torch.zeros(1))
        self.config = SimpleNamespace(max_position_embeddings=4096)
        self.model = SimpleNamespace(layers=[SimpleNamespace(self_attn=SimpleNamespace(scale=1.0))])

    def __call__(self, ids, positions, cache):
        return torch.nn.functional.one_hot(ids, VOCAB).double()  # [N, VOCAB] as the "hidden states"

    def compute_logits(self, hidden):
        return torch.nn.functional.one_hot(self.next[hidden.argmax(-1)], VOCAB).double()

    def expected(self, prompt, params: SamplingParams, eos: int) -> list[int]:
        out, t = [], prompt[-1]
        while len(out) < params.max_tokens:
            t = int(self.next[t])
            out.append(t)
            if t == eos and not params.ignore_eos:
                break
        return out


@pytest.mark.ch03
@pytest.mark.ch03_ex4
@settings(max_examples=80, deadline=None)
@given(rows=st.lists(st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4), st.integers(1, 8),
                               st.booleans()), min_size=1, max_size=5),
       eos=st.one_of(st.none(), st.integers(0, VOCAB - 1)), seed=st.integers(0, 50))
def test_ch03_ex4_rows_finish_by_the_rule(rows, eos, seed):
    """A scripted model (each row's tokens known in advance): a row stops after `max_tokens` tokens or
    at EOS (kept) unless `ignore_eos`; the batch runs until its last row is done, not longer."""
    model = _ScriptedModel(seed)
    prompts = [p for p, _, _ in rows]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=ig) for _, m, ig in rows]
    want = [model.expected(p, sp, eos) for p, sp in zip(prompts, params)]
    with _stand_ins("ch03_ex4"):
        res = sb.static_generate(model, prompts, params, eos_token_id=eos)
    for b, (got, w) in enumerate(zip(res.outputs, want)):
        chain = model.expected(prompts[b], SamplingParams(max_tokens=params[b].max_tokens, ignore_eos=True), eos)
        _expect(got == w, f"ch03_ex4: row {b} (max_tokens={params[b].max_tokens}, ignore_eos={params[b].ignore_eos}, "
                f"eos_token_id={eos}): the model's tokens are {chain}; cut after max_tokens, or after the EOS token "
                f"unless ignore_eos, that is {w}; got {got}")
    _expect(res.num_steps == max(map(len, want)), f"ch03_ex4: the batch should run {max(map(len, want))} forward "
            f"passes (until its last row is done), ran {res.num_steps}")


@pytest.mark.ch03
@pytest.mark.ch03_ex4
def test_ch03_ex4_static_generate_equals_transformers(tiny):
    """The tiny model (float64, no near-tie can flip) with an EOS token it produces: each request's
    tokens are transformers' greedy tokens cut at EOS (kept) or `max_tokens`; `ignore_eos` runs past EOS."""
    model, hf = tiny
    prompts = random_prompts(6, 1, 12, seed=11)
    full = [hf_greedy(hf, p, 8) for p in prompts]
    eos = Counter(t for out in full for t in set(out[:6])).most_common(1)[0][0]  # a token the model produces
    ignore = next(i for i, out in enumerate(full) if eos in out[:6])
    params = [SamplingParams(temperature=0, max_tokens=8 if i % 2 else 6, ignore_eos=i == ignore)
              for i in range(len(prompts))]
    want = []
    for out, sp in zip(full, params):
        out = out[:sp.max_tokens]
        want.append(out if sp.ignore_eos or eos not in out else out[:out.index(eos) + 1])
    assert any(len(w) < sp.max_tokens for w, sp in zip(want, params)), "grader setup: no request stops at EOS"
    with _stand_ins("ch03_ex4"):
        res = sb.static_generate(model, prompts, params, eos_token_id=eos)
    for i, (got, w) in enumerate(zip(res.outputs, want)):
        _expect(got == w, f"ch03_ex4: request {i} (max_tokens={params[i].max_tokens}, ignore_eos="
                f"{params[i].ignore_eos}, eos {eos}): static_generate gave {got}, transformers' greedy tokens cut "
                f"by the rule are {w}")
