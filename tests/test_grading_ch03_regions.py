"""Grading tests for chapter 03's build (`python -m minivllm.course.grade ch03_ex2`, or `pytest -m ch03_ex2`).

ch03_ex2 is the build of static batching: `pad_batch` (left padding and positions), `padded_attention`
(the mask over a left-padded batch) and the loop of `static_generate` (the prefill, the decode steps,
the finished rows). It is graded in the package itself: in a student edition these are the student's
code, exported from the chapter (stubs until filled), and there is no reference to compare with. It
scores by parts (`@pytest.mark.group`, the groups of `EXERCISES["ch03_ex2"]`), each on its own:
`graded` puts the grader's own pieces (`_PARTS`) in place of the parts a test is not about, so a
filled part passes whatever state the others are in. Random inputs are derandomized.

What is checked is the contract, never this chapter's code:
* the padded batch: shapes and dtypes, each row ending with its prompt, padding ids, real positions
  counting from 0 at each prompt's first token, padding positions valid, the tensors on the device
  asked for (`meta`: no GPU needed), the ValueErrors (no prompts: a message that names the prompts);
* the mask: every real row of `padded_attention` equals `attention_reference` on that row alone
  (float64, float32, bfloat16), and nothing is NaN (padding queries included);
* the loop: scripted models make each row's tokens known in advance; a row stops at `max_tokens` or
  at EOS (kept) unless `ignore_eos`, a finished row gains no token (whatever it is fed), the batch stops
  after its last row, and the result reports each row's prompt and padding lengths and one time per pass;
* end to end: the tiny model (float64) through a padded prefill and decode gives each prompt's own
  transformers logits; `static_generate` gives transformers' greedy tokens cut at EOS or `max_tokens`,
  and in a batch that mixes greedy rows with seeded rows of other temperatures, each row what it gives
  alone.
The tests at the end show that plausible wrong answers lose exactly their part's points.
"""
from __future__ import annotations

import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from functools import partial

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import minivllm.baselines.static_batching as sb
from engine_helpers import hf_greedy, one_thread
from minivllm.model_executor.models.llama import attention_reference
from minivllm.model_executor.model_loader import load_model
from minivllm.sampling_params import SamplingParams
from minivllm.sample.generator import make_generator, sample
from minivllm.course.grade import EXERCISES
from minivllm.course.testing import random_prompts

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)
PAD, MASK, LOOP = (name for name, _ in EXERCISES["ch03_ex2"].groups)
SETTINGS = dict(deadline=None, derandomize=True, database=None)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


# --- the grader's stand-ins ----------------------------------------------------------------------
def _grader_pad_batch(prompts, pad_token_id: int = 0, device="cpu", mistake: str = "") -> sb.PaddedBatch:
    """Left padding written row by row (padding positions 0). `mistake`: a wrong answer for the tests at the
    end ("device ignored": tensors always on the CPU; "no prompts unchecked": max()'s own ValueError)."""
    if not prompts and mistake != "no prompts unchecked":
        raise ValueError("pad_batch needs at least one prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("pad_batch got an empty prompt")
    device = "cpu" if mistake == "device ignored" else device
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


def _grader_static_generate(model, prompts, sampling_params, eos_token_id=None, pad_token_id=0, mistake: str = ""):
    """The loop, with a set of live rows. `mistake`: a wrong answer for the tests at the end ("finished rows go
    on", "row 0's temperature", "padded prompt_lens", "no pad_lens", "no step_times")."""
    params = sb._per_request(sampling_params, len(prompts))
    device = model.lm_head.weight.device
    batch = sb.pad_batch(prompts, pad_token_id, device)
    width, longest = batch.input_ids.shape[1], max(p.max_tokens for p in params)
    if width + longest > model.config.max_position_embeddings:
        raise ValueError(f"{width} + {longest} columns exceed max_position_embeddings")
    cache = sb.StaticBatchKVCache(model.model.layers[0].self_attn.scale, batch.pad_lens, width + longest)
    gens = [make_generator(p.seed, device) if p.seed is not None else None for p in params]
    outs, live, times = [[] for _ in prompts], set(range(len(prompts))), []
    ids, pos = batch.input_ids, batch.positions
    while live:
        t0 = time.perf_counter()
        h = model(ids.reshape(-1), pos.reshape(-1), cache)
        last = model.compute_logits(h.view(len(prompts), -1, h.shape[-1])[:, -1])
        feed = []
        for b, p in enumerate(params):
            if b not in live and mistake != "finished rows go on":
                feed.append(pad_token_id)
                continue
            tok = sample(last[b], (params[0] if mistake == "row 0's temperature" else p).temperature, gens[b])
            outs[b].append(tok)
            feed.append(tok)
            if len(outs[b]) >= p.max_tokens or (tok == eos_token_id and not p.ignore_eos):
                live.discard(b)
        times.append(time.perf_counter() - t0)
        ids, pos = torch.tensor(feed, dtype=torch.int64, device=device)[:, None], pos[:, -1:] + 1
    pad_lens, prompt_lens = batch.pad_lens.tolist(), [len(p) for p in prompts]
    if mistake == "padded prompt_lens":
        prompt_lens = [width] * len(prompts)
    if mistake == "no pad_lens":
        pad_lens = [0] * len(prompts)
    return sb.StaticBatchResult(outs, pad_lens, prompt_lens, len(times), [] if mistake == "no step_times" else times)


# part -> (name in the module, the grader's piece). `graded` reads this table, never `STAND_INS`, which
# the tripwires rewire while the build's own tests run.
_PARTS = {PAD: ("pad_batch", _grader_pad_batch), MASK: ("padded_attention", _grader_padded_attention),
          LOOP: ("static_generate", _grader_static_generate)}
STAND_INS = {"ch03_ex2": [(sb, name, fn) for name, fn in _PARTS.values()]}


@contextmanager
def graded(part: str | None, wrong=None):
    """The package's (the student's) piece for `part` (None: none), the grader's for the other parts;
    `wrong`, if given, in place of the package's piece of `part`."""
    with ExitStack() as stack:
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        for other, (name, fn) in _PARTS.items():
            if other != part:
                mp.setattr(sb, name, fn)
            elif wrong is not None:
                mp.setattr(sb, name, wrong)
        yield


# --- ch03_ex2, left padding and positions ---------------------------------------------------------
def check_padding() -> None:
    """Random prompts: `[batch_size, width]` int64 tensors, each row padding then its prompt, its real
    positions 0..n-1, padding positions in [0, width); no prompts or an empty one: ValueError."""
    @settings(max_examples=60, **SETTINGS)
    @example(prompts=[[7, 8], [9]], pad_token_id=0)  # a fixed case first (the draws depend on the caller)
    @given(prompts=st.lists(st.lists(st.integers(1, 99), min_size=1, max_size=9), min_size=1, max_size=5),
           pad_token_id=st.integers(0, 5))
    def run(prompts, pad_token_id):
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
    run()
    try:  # the meta device: tensors with a device and no data, so the CPU can check that `device` is used
        batch = sb.pad_batch([[7, 8], [9]], 0, device="meta")
    except Exception as e:  # noqa: BLE001 - the message names what was raised
        raise AssertionError(f"ch03_ex2: pad_batch([[7, 8], [9]], 0, device='meta') raised {type(e).__name__}: {e} "
                             "(build the tensors on `device`, never reading their values back)") from e
    devices = [getattr(getattr(batch, n), "device", None) for n in ("input_ids", "positions", "pad_lens")]
    _expect(all(d is not None and d.type == "meta" for d in devices), f"ch03_ex2: pad_batch(..., device='meta') "
            f"should put input_ids, positions and pad_lens on the meta device, got {devices}")
    for bad, what in (([], "no prompts"), ([[1, 2], []], "an empty prompt")):
        try:
            sb.pad_batch(bad)
        except ValueError as e:
            _expect(what != "no prompts" or "prompt" in str(e).lower(), f"ch03_ex2: pad_batch([]) raised "
                    f"ValueError({str(e)!r}); say what is wrong: a message with the word 'prompt'")
            continue
        raise AssertionError(f"ch03_ex2: pad_batch({bad}) should raise ValueError ({what})")


@pytest.mark.ch03
@pytest.mark.ch03_ex2
@pytest.mark.group(PAD)
def test_ch03_ex2_pad_batch_layout():
    with graded(PAD):
        check_padding()


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    folder, hf = tiny_llama
    return load_model(folder, dtype=torch.float64), hf


@pytest.mark.ch03
@pytest.mark.ch03_ex2
@pytest.mark.parametrize("part", [pytest.param(p, marks=pytest.mark.group(p), id=n)
                                  for p, n in ((PAD, "padding"), (MASK, "mask"))])
def test_ch03_ex2_padded_prefill_and_decode_equal_transformers(part, tiny):
    """The tiny model (float64) on a left-padded batch, prefill then one decode column: each row's real
    columns give the logits transformers gives the prompt alone (1e-9: float64 rounding only)."""
    model, hf = tiny
    prompts = random_prompts(4, 1, 11, seed=3) + [[5]]
    with graded(part), torch.inference_mode():
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
            _expect(float(diff.max()) < 1e-9, f"ch03_ex2 ({part}): prefill of prompts of lengths "
                    f"{[len(q) for q in prompts]} padded to {width}: row {b} ({len(p)} tokens) differs from "
                    f"transformers on the prompt alone by {float(diff.max()):.3g} at its token {int(diff.amax(-1).argmax())}")
            d = float((dec[b] - want[-1]).abs().max())
            _expect(d < 1e-9, f"ch03_ex2 ({part}): the decode step after the padded prefill: row {b} ({len(p)} prompt "
                    f"tokens) differs from transformers by {d:.3g}")


# --- ch03_ex2, the mask hides padding and the future ------------------------------------------------
# float64: rounding only. float32: ~1e-7 relative per operation over a dozen keys. bfloat16 keeps 8
# significant bits: scores of size ~3 carry errors ~1e-2, which the softmax passes on to the weights.
TOL = {torch.float64: (1e-12, 0.0), torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-2, 2e-2)}


def check_mask(dtype) -> None:
    """Rows of random lengths left-padded, queries the last Tq columns (all of them at a prefill, 1
    or 2 at decode steps): each real query equals `attention_reference` over its row's real keys,
    computed in float64 from the same rounded inputs; no output is NaN, padding rows included."""
    @settings(max_examples=40, **SETTINGS)
    @example(lens=[1, 3], groups=1, decode=0, seed=0)  # a fixed case first: a row with padding, at prefill
    @given(lens=st.lists(st.integers(1, 10), min_size=1, max_size=4), groups=st.sampled_from([1, 2, 3]),
           decode=st.integers(0, 2), seed=st.integers(0, 2**16))
    def run(lens, groups, decode, seed):
        g = torch.Generator().manual_seed(seed)
        kvh, d = 2, 8
        width = max(lens) + (decode > 0) * decode
        real = [n + (decode > 0) * decode for n in lens]  # real columns per row
        pad_lens = torch.tensor([width - n for n in real])
        tq = width if decode == 0 else decode
        q = torch.randn(len(lens), tq, kvh * groups, d, generator=g, dtype=torch.float64).to(dtype)
        k, v = torch.randn(2, len(lens), width, kvh, d, generator=g, dtype=torch.float64).to(dtype)
        got = sb.padded_attention(q, k, v, pad_lens, 0.35)
        at = f"ch03_ex2 ({dtype}): rows of {real} real columns padded to {width}, {tq} query column(s), " \
             f"{kvh * groups} query heads over {kvh} K/V heads"
        _expect(isinstance(got, torch.Tensor) and got.shape == q.shape and got.dtype == q.dtype,
                f"{at}: expected shape {tuple(q.shape)} and dtype {q.dtype}, got "
                f"{(tuple(got.shape), got.dtype) if isinstance(got, torch.Tensor) else type(got).__name__}")
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
    run()


@pytest.mark.ch03
@pytest.mark.ch03_ex2
@pytest.mark.group(MASK)
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
def test_ch03_ex2_padded_attention_equals_each_row_alone(dtype):
    with graded(MASK):
        check_mask(dtype)


# --- ch03_ex2, the loop runs each row to its own end ------------------------------------------------
VOCAB = 16


class _ScriptedModel(torch.nn.Module):
    """A stand-in for the decoder whose greedy next token is `NEXT[last token]`, whatever the batch:
    each row's tokens are known in advance. It is shaped like our `LlamaForCausalLM` (a transformers
    `LlamaConfig`, `lm_head`, `model.embed_tokens`, `model.layers[i].self_attn` with its `scale`, heads
    and `head_dim`, float64 parameters on the CPU), its hidden states `[N, hidden_size]` one-hot rows of
    the ids fed, and counts the columns it is fed (`fed`: per pass, the ids of the last column)."""

    def __init__(self, seed: int):
        from transformers import LlamaConfig

        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.next = torch.randint(0, VOCAB, (VOCAB,), generator=g)
        self.config = LlamaConfig(vocab_size=VOCAB, hidden_size=VOCAB, intermediate_size=2 * VOCAB,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=VOCAB // 2,
                                  max_position_embeddings=4096)
        c = self.config
        self.lm_head = torch.nn.Linear(c.hidden_size, c.vocab_size, bias=False, dtype=torch.float64)
        attn = torch.nn.Module()
        attn.num_heads, attn.num_kv_heads, attn.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        attn.scale = c.head_dim ** -0.5
        layer = torch.nn.Module()
        layer.self_attn = attn
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(c.vocab_size, c.hidden_size, dtype=torch.float64)
        self.model.layers = torch.nn.ModuleList([layer])
        self.fed: list[list[int]] = []

    def forward(self, ids, positions, cache):
        self.fed.append(ids.tolist())
        return torch.nn.functional.one_hot(ids, VOCAB).double()  # [N, hidden_size] as the "hidden states"

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


def check_loop() -> None:
    """A scripted model (each row's tokens known in advance): a row stops after `max_tokens` tokens or
    at EOS (kept) unless `ignore_eos`; the batch runs until its last row is done, not longer; a row
    still generating is fed its newest token."""
    @settings(max_examples=80, **SETTINGS)
    @example(rows=[([1], 1, False), ([2], 3, False)], eos=None, seed=0)  # a fixed case first: a row done early
    @given(rows=st.lists(st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4), st.integers(1, 8),
                                   st.booleans()), min_size=1, max_size=5),
           eos=st.one_of(st.none(), st.integers(1, VOCAB - 1)), seed=st.integers(0, 50))
    def run(rows, eos, seed):
        model = _ScriptedModel(seed)
        prompts = [p for p, _, _ in rows]
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=ig) for _, m, ig in rows]
        want = [model.expected(p, sp, eos) for p, sp in zip(prompts, params)]
        res = sb.static_generate(model, prompts, params, eos_token_id=eos, pad_token_id=0)
        for b, (got, w) in enumerate(zip(res.outputs, want)):
            chain = model.expected(prompts[b], SamplingParams(max_tokens=params[b].max_tokens, ignore_eos=True), eos)
            _expect(got == w, f"ch03_ex2: row {b} (max_tokens={params[b].max_tokens}, ignore_eos={params[b].ignore_eos}, "
                    f"eos_token_id={eos}): the model's tokens are {chain}; cut after max_tokens, or after the EOS token "
                    f"unless ignore_eos, that is {w}; got {got}")
        steps = max(map(len, want))
        _expect(res.num_steps == steps and len(model.fed) == steps, f"ch03_ex2: the batch should run {steps} forward "
                f"passes (until its last row is done), ran {len(model.fed)} (num_steps {res.num_steps})")
        lens = [len(p) for p in prompts]
        pads = [max(lens) - n for n in lens]
        _expect(list(res.prompt_lens) == lens and [int(x) for x in res.pad_lens] == pads, f"ch03_ex2: prompts of "
                f"lengths {lens}: the result should report prompt_lens {lens} and pad_lens {pads}, got "
                f"{list(res.prompt_lens)} and {list(res.pad_lens)}")
        times = list(res.step_times)
        _expect(len(times) == steps and all(isinstance(t, float) and t > 0 for t in times), f"ch03_ex2: step_times "
                f"should hold the seconds of each of the {steps} forward passes (positive floats, prefill first), "
                f"got {times}")
        for step, fed in enumerate(model.fed[1:], start=1):
            for b, w in enumerate(want):
                if step < len(w):  # a finished row may be fed anything: its output is thrown away
                    _expect(fed[b] == w[step - 1], f"ch03_ex2: decode step {step}, row {b} (its tokens {w}) should be "
                            f"fed its newest token {w[step - 1]}, got {fed[b]}")
    run()


@pytest.mark.ch03
@pytest.mark.ch03_ex2
@pytest.mark.group(LOOP)
def test_ch03_ex2_rows_finish_by_the_rule():
    with graded(LOOP):
        check_loop()


def check_generate(tiny) -> None:
    """The tiny model (float64, no near-tie can flip) with an EOS token it produces: each request's
    tokens are transformers' greedy tokens cut at EOS (kept) or `max_tokens`; `ignore_eos` runs past EOS;
    in a batch that mixes greedy rows with seeded rows of other temperatures, max_tokens and ignore_eos,
    each row gives what it gives alone (transformers', or chapter 02's `naive_generate` for a seeded row)."""
    from minivllm.baselines.naive import naive_generate

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
    # greedy rows 0, 2, 3, 5 as above; rows 1 and 4 seeded, at temperatures 0.8 and 1.5
    mixed = list(params)
    mixed[1] = SamplingParams(temperature=0.8, max_tokens=5, seed=1)
    mixed[4] = SamplingParams(temperature=1.5, max_tokens=7, seed=4, ignore_eos=True)
    with graded(LOOP):
        res = sb.static_generate(model, prompts, params, eos_token_id=eos)
        drawn = sb.static_generate(model, prompts, mixed, eos_token_id=eos).outputs
    for i, (got, w) in enumerate(zip(res.outputs, want)):
        _expect(got == w, f"ch03_ex2: request {i} (max_tokens={params[i].max_tokens}, ignore_eos="
                f"{params[i].ignore_eos}, eos {eos}): static_generate gave {got}, transformers' greedy tokens cut "
                f"by the rule are {w}")
    alone = [naive_generate(model, p, sp, eos) if sp.seed is not None else w for p, sp, w in zip(prompts, mixed, want)]
    greedy = [naive_generate(model, prompts[i], SamplingParams(max_tokens=mixed[i].max_tokens,
                                                               ignore_eos=mixed[i].ignore_eos), eos) for i in (1, 4)]
    assert greedy != [alone[1], alone[4]], "grader setup: the seeded rows draw their greedy tokens"
    for i, (got, w) in enumerate(zip(drawn, alone)):
        sp = mixed[i]
        _expect(got == w, f"ch03_ex2: a batch of greedy and seeded rows, row {i} (temperature {sp.temperature}, seed "
                f"{sp.seed}, max_tokens={sp.max_tokens}, ignore_eos={sp.ignore_eos}, eos {eos}) should give what it "
                f"gives alone, {w}; got {got} (each row samples with its own temperature and generator)")


@pytest.mark.ch03
@pytest.mark.ch03_ex2
@pytest.mark.group(LOOP)
def test_ch03_ex2_static_generate_equals_transformers(tiny):
    check_generate(tiny)


# --- ch03_ex2: wrong answers lose exactly their part ------------------------------------------------
def _right_padding(prompts, pad_token_id=0, device="cpu"):
    """Prompts at column 0, padding after them, positions 0..width-1 for every row."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([list(p) + [pad_token_id] * (width - len(p)) for p in prompts], dtype=torch.int64)
    pos = torch.arange(width).repeat(len(prompts), 1)
    return sb.PaddedBatch(ids, pos, torch.tensor([width - len(p) for p in prompts]))


def _mask_sees_padding(q, k, v, pad_lens, scale):
    """Causal attention that forgets the padding: every key up to the query's column is attended."""
    tq, tk = q.shape[1], k.shape[1]
    groups = q.shape[2] // k.shape[2]
    allowed = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).double(), k.repeat_interleave(groups, 2).transpose(1, 2).double(),
        v.repeat_interleave(groups, 2).transpose(1, 2).double(), attn_mask=allowed, scale=scale).transpose(1, 2).to(q.dtype)


WRONG = {"right padding without shifted positions": (PAD, _right_padding),
         "tensors on the CPU whatever the device": (PAD, partial(_grader_pad_batch, mistake="device ignored")),
         "no prompts: max()'s ValueError": (PAD, partial(_grader_pad_batch, mistake="no prompts unchecked")),
         "a mask that lets padding be attended": (MASK, _mask_sees_padding),
         "a finished row that keeps generating": (LOOP, partial(_grader_static_generate, mistake="finished rows go on")),
         "every row sampled at row 0's temperature": (LOOP, partial(_grader_static_generate,
                                                                    mistake="row 0's temperature")),
         "prompt_lens of the padded width": (LOOP, partial(_grader_static_generate, mistake="padded prompt_lens")),
         "pad_lens not reported": (LOOP, partial(_grader_static_generate, mistake="no pad_lens")),
         "step_times never filled": (LOOP, partial(_grader_static_generate, mistake="no step_times"))}


@pytest.mark.parametrize("name", list(WRONG))
def test_ch03_ex2_wrong_answers_lose_their_part(name, tiny):
    """Each wrong answer, in place of the package's piece, fails the checks of its own part (one of them
    at least: the scripted loop or the tiny model's tokens); the checks of the other parts (which run the
    grader's pieces in place of that part) still pass."""
    part, wrong = WRONG[name]
    checks_of = {PAD: [check_padding], MASK: [partial(check_mask, torch.float64)],
              LOOP: [check_loop, partial(check_generate, tiny)]}
    failed = []
    for check in checks_of[part]:
        with graded(part, wrong):
            try:
                check()
            except AssertionError as e:
                _expect("ch03_ex2" in str(e), str(e))
                failed.append(check)
    _expect(bool(failed), f"{name}: a wrong answer passed the checks of its part ({part})")
    for other, checks in checks_of.items():
        if other != part:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(sb, _PARTS[part][0], wrong)
                for check in checks:
                    with graded(other):
                        check()
