"""Grading tests for chapter 09's rebuild exercises (`python -m minivllm.course.grade ch09_ex1`, or `pytest -m ch09_ex1`).

ch09_ex1 (`model_cost`), ch09_ex2 (`step_cost`), ch09_ex3 (`roofline`) and ch09_ex4 (`workload_bound`)
are graded in the package itself: in a student edition they are the student's code, exported from the
chapter (stubs until filled), and there is no reference to compare with. Each is graded alone: `graded`
puts the grader's own `step_cost` into `minivllm.benchmarks.roofline` where `roofline` and `workload_bound` are graded,
and `step_cost` is graded on costs the grader counts itself, so a filled region passes whatever state the
others are in.

What is checked is the contract, never this chapter's code:
* ch09_ex1: the six counts against transformers' model built from the same config (on the meta device):
  its parameter count, its layers' `nn.Linear` weights, its LM head, its query and key projections' widths;
  tied and untied LM heads, grouped-query attention, Qwen2's q/k/v biases, Llama's attention and MLP
  biases, Qwen3's q/k norms and a `head_dim` that is not `hidden_size / num_heads`; float32, bfloat16,
  float64 byte sizes;
* ch09_ex2: the FLOPs of the linear maps against `torch.utils.flop_counter.FlopCounterMode` over real
  forwards of transformers' tiny models (each sequence's new tokens after its cached prefix, only the
  last token's logits); the (query, key) pairs counted one by one over a causal mask that starts after
  the cached prefix; the bytes by the docstring's rule; decode steps, prefills over a cached prefix,
  mixed steps; then random costs and steps (hypothesis), where a swapped field shows;
* ch09_ex3: random costs, steps and peaks (hypothesis): the bound summed step by step as written here,
  the totals, and the memory-bound steps counted (a step whose two times are equal may count either way);
* ch09_ex4: random workloads, costs and peaks (hypothesis) against a closed form written here: request i
  computes `T = len(prompt) + output_len - 1` tokens, `T (T + 1) / 2` (query, key) pairs, the LM head
  `output_len` times; the weights are read `max(output_lens)` times.
The tests at the end show that plausible wrong answers fail these graders.
"""
from __future__ import annotations

import math
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, fields, replace
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minivllm.benchmarks.roofline as roofline_module
from engine_helpers import one_thread
from minivllm.benchmarks.roofline import DevicePeaks, ModelCost
from minivllm.benchmarks.workload import Workload
from minivllm.course.testing import tiny_config

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)

COST_FIELDS = [f.name for f in fields(ModelCost)]


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


# --- the grader's counts, from transformers' model -----------------------------------------------
# (name, config overrides): every feature model_cost must see in a config
CONFIGS = [
    ("llama", dict(num_key_value_heads=4)),  # multi-head attention
    ("llama", dict(tie_word_embeddings=True)),  # grouped-query attention, tied LM head
    ("llama", dict(attention_bias=True, mlp_bias=True, num_hidden_layers=3)),
    ("qwen2", dict(num_key_value_heads=1)),  # q/k/v biases
    ("qwen2", dict(tie_word_embeddings=True, hidden_size=48, num_attention_heads=6, num_key_value_heads=3)),
    ("qwen3", dict()),  # q/k norms, head_dim 32 with hidden_size 64 and 4 heads
    ("qwen3", dict(tie_word_embeddings=True, head_dim=24, num_attention_heads=6, num_key_value_heads=3,
                   num_hidden_layers=1, vocab_size=200)),
]
CONFIG_IDS = [f"{kind}-" + "-".join(f"{k}={v}" for k, v in kw.items()) for kind, kw in CONFIGS]


def _transformers_model(config, meta: bool = True):
    from transformers import AutoModelForCausalLM

    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()


def _counted(hf, dtype: torch.dtype) -> ModelCost:
    """The six counts read off transformers' model `hf`, in `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    layers = hf.model.layers
    embedding = hf.model.embed_tokens.weight
    tied = hf.lm_head.weight is embedding
    total = sum(p.numel() for p in hf.parameters())  # a shared (tied) parameter once
    q_width = layers[0].self_attn.q_proj.out_features  # num_heads * head_dim
    kv_width = layers[0].self_attn.k_proj.out_features  # num_kv_heads * head_dim
    return ModelCost(num_params=total,
                     weight_bytes=size * (total if tied else total - embedding.numel()),
                     matmul_params=sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear)),
                     lm_head_params=hf.lm_head.weight.numel(),
                     attention_flops_per_pair=4 * len(layers) * q_width,
                     kv_bytes_per_token=2 * len(layers) * kv_width * size)


def _grader_model_cost(config, dtype: torch.dtype) -> ModelCost:
    return _counted(_transformers_model(config), dtype)


def _pairs(q: int, c: int) -> int:
    """(query, key) pairs of one sequence, one by one: its `q` new tokens are the last of `c`, and new
    token i (at position c - q + i) sees the keys at positions 0 .. c - q + i."""
    mask = torch.ones(q, c, dtype=torch.bool).tril(diagonal=c - q)
    return int(mask.sum())


def _grader_step_cost(cost: ModelCost, query_lens: list[int], context_lens: list[int]) -> tuple[int, int]:
    flops = num_bytes = 0
    for q, c in zip(query_lens, context_lens):
        pairs = sum(c - q + i + 1 for i in range(q))
        flops += 2 * cost.matmul_params * q + 2 * cost.lm_head_params + cost.attention_flops_per_pair * pairs
        num_bytes += cost.kv_bytes_per_token * (c + q)
    return flops, cost.weight_bytes + num_bytes


def _grader_roofline(cost: ModelCost, steps, peaks: DevicePeaks) -> dict:
    out = dict(seconds=0.0, flops=0, bytes=0, steps=len(steps), memory_bound_steps=0)
    for q, c in steps:
        f, b = _grader_step_cost(cost, q, c)
        compute, memory = f / peaks.matmul_flops_per_s, b / peaks.copy_bytes_per_s
        out.update(seconds=out["seconds"] + max(compute, memory), flops=out["flops"] + f, bytes=out["bytes"] + b,
                   memory_bound_steps=out["memory_bound_steps"] + (memory >= compute))
    return out


def _grader_workload_bound(cost: ModelCost, workload: Workload, peaks: DevicePeaks) -> dict:
    """The closed form: request i computes T = p + n - 1 tokens (its prompt, then n - 1 decodes; the
    prefill gives the first output token), T(T+1)/2 pairs, the LM head n times; it reads the K/V of
    p + (p+1) + ... + (p+n-1) context tokens and writes T tokens' K/V; weights max(n) times."""
    flops = kv_tokens = 0
    for prompt, n in zip(workload.prompts, workload.output_lens):
        p = len(prompt)
        t = p + n - 1
        pairs = t * (t + 1) // 2
        flops += 2 * cost.matmul_params * t + 2 * cost.lm_head_params * n + cost.attention_flops_per_pair * pairs
        kv_tokens += n * p + n * (n - 1) // 2 + t
    num_bytes = cost.kv_bytes_per_token * kv_tokens + cost.weight_bytes * max(workload.output_lens)
    seconds = max(flops / peaks.matmul_flops_per_s, num_bytes / peaks.copy_bytes_per_s)
    return dict(seconds=seconds, flops=flops, bytes=num_bytes, tok_s=sum(workload.output_lens) / seconds)


# exercise -> [(owner, attribute, stand-in)] (the format tests/stand_ins.py reads for editions of several chapters)
STAND_INS = {"ch09_ex1": [(roofline_module, "model_cost", _grader_model_cost)],
             "ch09_ex2": [(roofline_module, "step_cost", _grader_step_cost)],
             "ch09_ex3": [(roofline_module, "roofline", _grader_roofline)],
             "ch09_ex4": [(roofline_module, "workload_bound", _grader_workload_bound)]}


@contextmanager
def graded(ex: str | None):
    """`minivllm.benchmarks.roofline` with the package's (the student's) piece for `ex` and the grader's for the
    other three (None: stand-ins for all)."""
    with ExitStack() as stack:
        for other, patches in STAND_INS.items():
            for owner, name, fn in patches if other != ex else ():
                stack.enter_context(mock.patch.object(owner, name, fn))
        yield


def _first_wrong(got: dict, want: dict, exact: set[str]) -> str | None:
    """The first field of `want` that `got` lacks or holds another value for (floats to 1e-9 relative)."""
    for name, w in want.items():
        if name not in got:
            return f"no field {name!r} (expected {w!r})"
        g = got[name]
        ok = (isinstance(g, (int, float)) and not isinstance(g, bool) and
              (g == w if name in exact else math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-300)))
        if not ok:
            return f"{name}: expected {w!r}, got {g!r}"
    return None


# --- strategies -----------------------------------------------------------------------------------
_costs = st.builds(ModelCost, num_params=st.integers(1, 10**9), weight_bytes=st.integers(1, 10**9),
                   matmul_params=st.integers(1, 10**8), lm_head_params=st.integers(1, 10**8),
                   attention_flops_per_pair=st.integers(1, 10**5), kv_bytes_per_token=st.integers(1, 10**5))


@st.composite
def _steps(draw, max_seqs: int = 5, max_context: int = 80):
    """One step: `(query_lens, context_lens)` with `1 <= q <= c` for each sequence."""
    n = draw(st.integers(1, max_seqs), label="sequences")
    contexts = [draw(st.integers(1, max_context)) for _ in range(n)]
    queries = [draw(st.one_of(st.just(1), st.just(c), st.integers(1, c))) for c in contexts]
    return queries, contexts


_peaks = st.builds(DevicePeaks, matmul_flops_per_s=st.floats(1e3, 1e13), copy_bytes_per_s=st.floats(1e3, 1e12))


# --- ch09_ex1: model_cost -------------------------------------------------------------------------
def _check_model_cost(model_cost, kind: str, overrides: dict) -> None:
    config = tiny_config(kind, **overrides)
    hf = _transformers_model(config)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        at = f"in model_cost({kind} config with {overrides or 'the tiny sizes'}, {dtype})"
        got = model_cost(config, dtype)
        _expect(isinstance(got, ModelCost), f"ch09_ex1: expected a ModelCost, got {type(got).__name__}, {at}")
        wrong = _first_wrong(asdict(got), asdict(_counted(hf, dtype)), exact=set(COST_FIELDS))
        _expect(wrong is None, f"ch09_ex1: {wrong}, {at} (counted on transformers' model from the same config: "
                               f"tied LM head {config.tie_word_embeddings}, {config.num_attention_heads} heads, "
                               f"{config.num_key_value_heads} K/V heads)")


@pytest.mark.ch09
@pytest.mark.ch09_ex1
@pytest.mark.parametrize("kind, overrides", CONFIGS, ids=CONFIG_IDS)
def test_ch09_ex1_model_cost_counts_transformers_model(kind, overrides):
    with graded("ch09_ex1"):
        _check_model_cost(roofline_module.model_cost, kind, overrides)


# --- ch09_ex2: step_cost --------------------------------------------------------------------------
STEPS = {"decode": ([1, 1, 1], [1, 6, 11]), "prefill over a cached prefix": ([4, 3], [9, 3]),
         "mixed": ([1, 5, 2], [8, 5, 2])}


def _measured_step(hf, config, query_lens, context_lens) -> tuple[int, int]:
    """(FLOPs of the linear maps, FLOPs of eager attention's two matmuls) of transformers' forwards: each
    sequence's `q` new tokens after its `c - q` cached ones, the logits of its last token only."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import DynamicCache

    linear = attention = 0
    for i, (q, c) in enumerate(zip(query_lens, context_lens)):
        ids = torch.arange(c)[None, :] * (i + 3) % config.vocab_size
        cache = DynamicCache(config=config)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers renames past_key_values in later versions
            if c > q:
                hf(ids[:, :c - q], past_key_values=cache, use_cache=True)
            with FlopCounterMode(display=False) as counter:
                hf(ids[:, c - q:], past_key_values=cache, use_cache=True, logits_to_keep=1)
        counts = {str(op).split(".")[1]: n for op, n in counter.get_flop_counts()["Global"].items()}
        assert set(counts) <= {"mm", "addmm", "bmm"}, f"grader: unexpected operations counted {counts}"
        linear += counts.get("mm", 0) + counts.get("addmm", 0)
        attention += counts.get("bmm", 0)
    return linear, attention


def _check_step_cost(step_cost, cost: ModelCost, query_lens, context_lens, want_flops: int, at: str) -> None:
    want_bytes = cost.weight_bytes + cost.kv_bytes_per_token * (sum(context_lens) + sum(query_lens))
    at = f"in step_cost({cost}, query_lens={query_lens}, context_lens={context_lens}) ({at})"
    got = step_cost(cost, list(query_lens), list(context_lens))
    _expect(isinstance(got, tuple) and len(got) == 2, f"ch09_ex2: expected a tuple (FLOPs, bytes), got {got!r}, {at}")
    pairs = [_pairs(q, c) for q, c in zip(query_lens, context_lens)]
    _expect(got[0] == want_flops, f"ch09_ex2: FLOPs: expected {want_flops}, got {got[0]!r}, {at}; expected: "
                                  f"linear maps for {sum(query_lens)} tokens, "
                                  f"the LM head for {len(query_lens)} sequences, causal (query, key) pairs {pairs}")
    _expect(got[1] == want_bytes, f"ch09_ex2: bytes: expected {want_bytes}, got {got[1]!r}, {at}; expected: the "
                                  f"weights, then K/V of "
                                  f"{sum(context_lens)} context tokens read and {sum(query_lens)} new tokens "
                                  f"written")


@pytest.mark.ch09
@pytest.mark.ch09_ex2
@pytest.mark.parametrize("kind, overrides", [CONFIGS[i] for i in (1, 3, 5)], ids=[CONFIG_IDS[i] for i in (1, 3, 5)])
def test_ch09_ex2_step_cost_counts_a_real_forward(kind, overrides):
    """FLOPs of the linear maps counted by FlopCounterMode in transformers' forward; attention pairs by
    brute force over the causal mask after the cached prefix (eager attention computes every pair of
    the rectangle, which the grader checks against `attention_flops_per_pair`, then keeps the triangle)."""
    config = tiny_config(kind, **overrides)
    hf = _transformers_model(config, meta=False)
    cost = _counted(hf, torch.float32)
    for name, (query_lens, context_lens) in STEPS.items():
        linear, rectangle = _measured_step(hf, config, query_lens, context_lens)
        assert rectangle == cost.attention_flops_per_pair * sum(q * c for q, c in zip(query_lens, context_lens)), \
            "grader: eager attention's matmuls disagree with attention_flops_per_pair"
        want = linear + cost.attention_flops_per_pair * sum(map(_pairs, query_lens, context_lens))
        with graded("ch09_ex2"):
            _check_step_cost(roofline_module.step_cost, cost, query_lens, context_lens, want,
                             f"{name} step of transformers' {kind} model: linear FLOPs {linear} by FlopCounterMode")


@pytest.mark.ch09
@pytest.mark.ch09_ex2
@settings(max_examples=150, deadline=None)
@given(cost=_costs, step=_steps())
def test_ch09_ex2_step_cost_by_the_rule(cost, step):
    query_lens, context_lens = step
    want = (2 * cost.matmul_params * sum(query_lens) + 2 * cost.lm_head_params * len(query_lens)
            + cost.attention_flops_per_pair * sum(map(_pairs, query_lens, context_lens)))
    with graded("ch09_ex2"):
        _check_step_cost(roofline_module.step_cost, cost, query_lens, context_lens, want, "random cost and step")


# --- ch09_ex3: roofline ---------------------------------------------------------------------------
def _check_roofline(cost: ModelCost, steps, peaks: DevicePeaks) -> None:
    at = (f"in roofline({cost}, {len(steps)} steps {steps}, peaks {peaks.matmul_flops_per_s:.6g} FLOP/s, "
          f"{peaks.copy_bytes_per_s:.6g} B/s)")
    want = dict(flops=0, bytes=0, steps=len(steps), seconds=0.0)  # the counters first: seconds follow from them
    strict = loose = 0
    for q, c in steps:
        f, b = _grader_step_cost(cost, q, c)
        compute, memory = f / peaks.matmul_flops_per_s, b / peaks.copy_bytes_per_s
        want.update(seconds=want["seconds"] + max(compute, memory), flops=want["flops"] + f, bytes=want["bytes"] + b)
        strict, loose = strict + (memory > compute), loose + (memory >= compute)
    with graded("ch09_ex3"):
        got = roofline_module.roofline(cost, steps, peaks)
    _expect(isinstance(got, dict), f"ch09_ex3: expected a dict, got {type(got).__name__}, {at}")
    wrong = _first_wrong(got, want, exact={"flops", "bytes", "steps"})
    _expect(wrong is None, f"ch09_ex3: {wrong}, {at} (per step max(FLOPs / matmul rate, bytes / copy rate), summed; "
                           f"FLOPs and bytes from step_cost, summed)")
    m = got.get("memory_bound_steps")
    _expect(isinstance(m, int) and strict <= m <= loose,
            f"ch09_ex3: memory_bound_steps: expected {strict}" + (f" to {loose} (steps whose two times are equal "
            "may count either way)" if loose > strict else "") + f", got {m!r}, {at} (steps whose bytes take longer "
            "than their FLOPs)")


@pytest.mark.ch09
@pytest.mark.ch09_ex3
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cost=_costs, steps=st.lists(_steps(max_seqs=4, max_context=60), max_size=8), peaks=_peaks)
def test_ch09_ex3_roofline_sums_the_slower_side(cost, steps, peaks):
    _check_roofline(cost, steps, peaks)


@pytest.mark.ch09
@pytest.mark.ch09_ex3
def test_ch09_ex3_roofline_of_known_steps():
    """1 FLOP/s and 1 B/s: a step costs max(FLOPs, bytes) seconds. Two decodes are memory-bound, the prefill
    compute-bound, an empty run is 0."""
    cost = ModelCost(num_params=10, weight_bytes=100, matmul_params=1, lm_head_params=1,
                     attention_flops_per_pair=2, kv_bytes_per_token=1)
    steps = [([1], [3]), ([20], [20]), ([1, 1], [5, 2])]
    _check_roofline(cost, steps, DevicePeaks(1.0, 1.0))
    _check_roofline(cost, [], DevicePeaks(1.0, 1.0))


# --- ch09_ex4: workload_bound ---------------------------------------------------------------------
def _check_workload_bound(cost: ModelCost, prompt_lens: list[int], output_lens: list[int], peaks: DevicePeaks) -> None:
    workload = Workload([[7] * p for p in prompt_lens], list(output_lens), [0] * len(prompt_lens))
    at = (f"in workload_bound({cost}, prompts of {prompt_lens} tokens, output_lens {output_lens}, peaks "
          f"{peaks.matmul_flops_per_s:.6g} FLOP/s, {peaks.copy_bytes_per_s:.6g} B/s)")
    with graded("ch09_ex4"):
        got = roofline_module.workload_bound(cost, workload, peaks)
    _expect(isinstance(got, dict), f"ch09_ex4: expected a dict, got {type(got).__name__}, {at}")
    want = _grader_workload_bound(cost, workload, peaks)
    want = {k: want[k] for k in ("flops", "bytes", "seconds", "tok_s")}  # the counters first
    wrong = _first_wrong(got, want, exact={"flops", "bytes"})
    _expect(wrong is None, f"ch09_ex4: {wrong}, {at} (each request: one prefill of its prompt, then output_len - 1 "
                           "decodes, each once; the weights read max(output_lens) times; max(FLOPs / rate, "
                           "bytes / rate) over the whole run)")


@pytest.mark.ch09
@pytest.mark.ch09_ex4
@settings(max_examples=120, deadline=None)
@given(cost=_costs, lens=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12)), min_size=1, max_size=5),
       peaks=_peaks)
def test_ch09_ex4_workload_bound_by_the_closed_form(cost, lens, peaks):
    _check_workload_bound(cost, [p for p, _ in lens], [n for _, n in lens], peaks)


# --- the graders catch plausible wrong answers (not graded; the wrong answers are written here) ------
def _fails(ex: str, check, *args) -> str:
    with pytest.raises(AssertionError, match=ex) as info:
        check(*args)
    return str(info.value)


@pytest.mark.ch09
@pytest.mark.parametrize("wrong, field", [
    (lambda cfg, dt: replace(_grader_model_cost(cfg, dt), weight_bytes=_grader_model_cost(cfg, dt).weight_bytes
                             + dt.itemsize * cfg.vocab_size * cfg.hidden_size * (not cfg.tie_word_embeddings)),
     "weight_bytes"),  # the embedding counted as read
    # num_heads * head_dim taken as hidden_size
    (lambda cfg, dt: replace(_grader_model_cost(cfg, dt), attention_flops_per_pair=4 * cfg.num_hidden_layers
                             * cfg.hidden_size), "attention_flops_per_pair"),
    (lambda cfg, dt: replace(_grader_model_cost(cfg, dt), kv_bytes_per_token=2 * cfg.num_hidden_layers
                             * cfg.num_attention_heads * cfg.head_dim * dt.itemsize), "kv_bytes_per_token"),  # no GQA
    (lambda cfg, dt: replace(_grader_model_cost(cfg, dt), matmul_params=_grader_model_cost(cfg, dt).matmul_params
                             + cfg.vocab_size * cfg.hidden_size), "matmul_params"),  # the LM head among the layers
], ids=["embedding read", "hidden size as heads", "no GQA", "LM head in matmul_params"])
def test_ch09_ex1_grader_catches(wrong, field):
    message = _fails("ch09_ex1", _check_model_cost, wrong, *CONFIGS[5])
    assert f"{field}: expected" in message, message


def _wrong_step_costs():
    def lm_head_per_token(cost, q, c):
        f, b = _grader_step_cost(cost, q, c)
        return f + 2 * cost.lm_head_params * (sum(q) - len(q)), b

    def rectangle(cost, q, c):
        f, b = _grader_step_cost(cost, q, c)
        return f + cost.attention_flops_per_pair * sum(x * y - _pairs(x, y) for x, y in zip(q, c)), b

    def no_kv_written(cost, q, c):
        f, b = _grader_step_cost(cost, q, c)
        return f, b - cost.kv_bytes_per_token * sum(q)

    return [(lm_head_per_token, "FLOPs"), (rectangle, "FLOPs"), (no_kv_written, "bytes")]


SMALL_COST = ModelCost(num_params=1, weight_bytes=1000, matmul_params=100, lm_head_params=50,
                       attention_flops_per_pair=8, kv_bytes_per_token=4)  # round numbers for the catch tests


@pytest.mark.ch09
@pytest.mark.parametrize("wrong, what", _wrong_step_costs(), ids=["LM head per token", "no causal triangle",
                                                                  "new K/V not written"])
def test_ch09_ex2_grader_catches(wrong, what):
    cost = SMALL_COST
    q, c = STEPS["prefill over a cached prefix"]
    message = _fails("ch09_ex2", _check_step_cost, wrong, cost, q, c, _grader_step_cost(cost, q, c)[0], "catch")
    assert f"{what}: expected" in message, message
    with mock.patch.object(roofline_module, "step_cost", wrong), pytest.raises(AssertionError, match="ch09_ex2"):
        test_ch09_ex2_step_cost_by_the_rule()


def _wrong_rooflines():
    def with_min(cost, steps, peaks):
        out = _grader_roofline(cost, steps, peaks)
        out["seconds"] = sum(min(f / peaks.matmul_flops_per_s, b / peaks.copy_bytes_per_s)
                             for f, b in (_grader_step_cost(cost, q, c) for q, c in steps))
        return out

    def max_of_totals(cost, steps, peaks):  # the bound of the run's totals, not of each step
        out = _grader_roofline(cost, steps, peaks)
        out["seconds"] = max(out["flops"] / peaks.matmul_flops_per_s, out["bytes"] / peaks.copy_bytes_per_s)
        return out

    def compute_bound_counted(cost, steps, peaks):
        out = _grader_roofline(cost, steps, peaks)
        out["memory_bound_steps"] = len(steps) - out["memory_bound_steps"]
        return out

    return [(with_min, "seconds"), (max_of_totals, "seconds"), (compute_bound_counted, "memory_bound_steps")]


@pytest.mark.ch09
@pytest.mark.parametrize("wrong, what", _wrong_rooflines(), ids=["min", "max of the totals", "compute-bound counted"])
def test_ch09_ex3_grader_catches(wrong, what):
    with mock.patch.object(roofline_module, "roofline", wrong):
        message = _fails("ch09_ex3", test_ch09_ex3_roofline_of_known_steps)
        assert f"{what}: expected" in message, message


def _wrong_workload_bounds():
    def n_decodes(cost, workload, peaks):  # a decode for every output token, the prefill's included
        longer = Workload(workload.prompts, [n + 1 for n in workload.output_lens], workload.shared_prefix_lens)
        out = _grader_workload_bound(cost, longer, peaks)
        return dict(out, tok_s=sum(workload.output_lens) / out["seconds"])

    def weights_per_token(cost, workload, peaks):  # the weights read for every output token
        out = _grader_workload_bound(cost, workload, peaks)
        extra = cost.weight_bytes * (sum(workload.output_lens) - max(workload.output_lens))
        seconds = max(out["flops"] / peaks.matmul_flops_per_s, (out["bytes"] + extra) / peaks.copy_bytes_per_s)
        return dict(out, bytes=out["bytes"] + extra, seconds=seconds, tok_s=sum(workload.output_lens) / seconds)

    def summed_requests(cost, workload, peaks):  # each request's bound, added up
        parts = [_grader_workload_bound(cost, Workload([p], [n], [0]), peaks)
                 for p, n in zip(workload.prompts, workload.output_lens)]
        seconds = sum(p["seconds"] for p in parts)
        return dict(seconds=seconds, flops=sum(p["flops"] for p in parts), bytes=sum(p["bytes"] for p in parts),
                    tok_s=sum(workload.output_lens) / seconds)

    return [(n_decodes, "flops"), (weights_per_token, "bytes"), (summed_requests, "bytes")]


@pytest.mark.ch09
@pytest.mark.parametrize("wrong, what", _wrong_workload_bounds(), ids=["n decodes", "weights per token",
                                                                      "requests summed"])
def test_ch09_ex4_grader_catches(wrong, what):
    cost = SMALL_COST
    with mock.patch.object(roofline_module, "workload_bound", wrong):
        message = _fails("ch09_ex4", _check_workload_bound, cost, [5, 9], [3, 4], DevicePeaks(1.0, 1.0))
        assert f"{what}: expected" in message, message


@pytest.mark.ch09
def test_ch09_grader_stand_ins_agree_with_the_rules():
    """The stand-ins the graders put in place are right: the model cost is the loaded model's parameter
    count; the step cost, the roofline and the workload bound pass their own graders."""
    config = tiny_config("qwen3", tie_word_embeddings=True)
    hf = _transformers_model(config, meta=False)
    assert _grader_model_cost(config, torch.float32).num_params == sum(p.numel() for p in hf.parameters())
    with mock.patch.object(roofline_module, "step_cost", _grader_step_cost):
        test_ch09_ex2_step_cost_by_the_rule()
    with mock.patch.object(roofline_module, "roofline", _grader_roofline):
        test_ch09_ex3_roofline_sums_the_slower_side()
    brute = mock.patch.object(roofline_module, "workload_bound", _workload_bound_step_by_step)
    with brute:
        test_ch09_ex4_workload_bound_by_the_closed_form()


def _workload_bound_step_by_step(cost, workload, peaks):
    """The bound from the steps a request needs, through the grader's step cost (checks the closed form)."""
    flops = kv = 0
    for prompt, n in zip(workload.prompts, workload.output_lens):
        p = len(prompt)
        for q, c in [(p, p)] + [(1, p + k) for k in range(1, n)]:
            f, b = _grader_step_cost(cost, [q], [c])
            flops, kv = flops + f, kv + b - cost.weight_bytes
    num_bytes = kv + cost.weight_bytes * max(workload.output_lens)
    seconds = max(flops / peaks.matmul_flops_per_s, num_bytes / peaks.copy_bytes_per_s)
    return dict(seconds=seconds, flops=flops, bytes=num_bytes, tok_s=sum(workload.output_lens) / seconds)
