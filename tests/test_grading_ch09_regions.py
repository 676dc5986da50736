"""Grading tests for chapter 09's build assignment (`python -m minivllm.course.grade ch09_ex1`, or
`pytest -m ch09_ex1`).

ch09_ex1 builds the roofline from a model config whole: `model_cost`, `step_cost`, `roofline` and
`workload_bound`. It scores in four parts (`@pytest.mark.group`, the groups of `EXERCISES["ch09_ex1"]`),
one per function, and is graded in the package itself: in a student edition the functions are the
student's code, exported from the chapter (stubs until filled), and there is no reference to compare
with. Each part is graded alone: `graded(part)` puts the grader's own versions of the other three into
`minivllm.benchmarks.roofline` (so `roofline` and `workload_bound` run on the grader's `step_cost`, and
`step_cost` is graded on costs the grader counts itself), and a filled function scores whatever state the
others are in. Hypothesis draws are derandomized (the same answer always scores the same points).

The evidence is independent of this chapter's code:
* weights and KV bytes per token from the config (`model_cost`): the parameters of transformers' own model
  built from the same config on the meta device (the sum of its tensors' sizes, a tied matrix counted once;
  its layers' `nn.Linear` weights; its LM head; its query and key projections' widths), for Llama, Qwen2
  and Qwen3 configs with tied and untied LM heads, grouped-query attention, each architecture's biases,
  Qwen3's q/k norms and a `head_dim` other than `hidden_size / num_heads`, in float32, bfloat16 and
  float64; the configs of the default model (SmolLM2-135M) and of Qwen3-0.6B, tied and untied; a Qwen2
  config that says `attention_bias=False`, where transformers' Qwen2 biases q, k and v anyway and the
  engine does not: there the totals are those of chapter 02's model built on the meta device (the rule
  the book states); and the K/V cache tensors the engine itself allocates (`LLM`, float32 and bfloat16),
  per token. The counts must be Python ints, as `ModelCost` says;
* a step's FLOPs and bytes (`step_cost`): `torch.utils.flop_counter.FlopCounterMode` over transformers'
  real forwards of tiny models (each sequence's new tokens after its cached prefix, the logits of its last
  token only). The tolerance is zero: the counter counts the matrix products only (mm, addmm, bmm) and
  ignores the elementwise ops (norms, RoPE, softmax, SiLU), which the contract leaves out too, so both
  sides are the same integers. One correction, checked first: eager attention multiplies the whole
  rectangle of (query, key) pairs and masks afterwards, so its products are replaced by the causal pairs,
  counted one by one over the mask. Then invariants on random costs and steps (hypothesis): the rule term
  by term, additive over sequences, linear in the cost, growing with every context and every sequence;
  FLOPs and bytes Python ints, as the docstring says;
* the roofline of a run: random costs, steps and rates (hypothesis) against the sum written here, each step
  at the longer of its two times; the totals (ints) and the memory-bound steps; steps whose sides are known,
  one of them a tie (its FLOPs and bytes take exactly as long, at rates 1 and 2**33: it is memory-bound);
* the least time of a workload: random workloads, costs and rates (hypothesis) against a closed form written
  here (a request computing T = p + n - 1 tokens makes T (T + 1) / 2 pairs; the weights are read max(n) times,
  the fewest any schedule needs; FLOPs and bytes ints), on workloads without and with shared prompt prefixes
  (the bound is for an engine without prefix caching: every prompt computed whole, shared prefixes credited
  nothing), and never above the roofline of two real schedules' steps (one request at a time; all at once).
The tests at the end show that plausible wrong answers lose their own part's points, and only those.
"""
from __future__ import annotations

import math
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, fields, replace
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import minivllm.benchmarks.roofline as roofline_module
from engine_helpers import one_thread
from minivllm.benchmarks.roofline import DevicePeaks, ModelCost
from minivllm.benchmarks.workload import Workload
from minivllm.course.grade import EXERCISES as GRADED
from minivllm.course.testing import make_tiny_model, tiny_config

_one_thread = pytest.fixture(scope="module", autouse=True)(one_thread)

COST_FIELDS = [f.name for f in fields(ModelCost)]
COSTS, STEP, ROOF, WORKLOAD = (name for name, _ in GRADED["ch09_ex1"].groups)
HYPOTHESIS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])


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
    ("llama", dict(head_dim=8, num_key_value_heads=1, intermediate_size=96)),  # head_dim below hidden / heads
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


def _engine_counted(config, dtype: torch.dtype) -> ModelCost:
    """`_counted` on transformers' model, with the totals (`num_params`, `weight_bytes`) read off chapter 02's
    model built from the same config on the meta device. They differ where transformers and the engine read
    a config differently: a Qwen2 config that says `attention_bias=False` (transformers' Qwen2 biases q, k
    and v always; the engine, and the book's rule, follow the config). The other four counts do not depend
    on biases."""
    from minivllm.model_executor.models.llama import MODEL_REGISTRY

    size = torch.empty((), dtype=dtype).element_size()
    with torch.device("meta"):
        engine = MODEL_REGISTRY[config.model_type](config)
    total = sum(p.numel() for p in engine.parameters())  # a shared (tied) parameter once
    embedding = engine.model.embed_tokens.weight
    tied = engine.lm_head.weight is embedding
    return replace(_counted(_transformers_model(config), dtype), num_params=total,
                   weight_bytes=size * (total if tied else total - embedding.numel()))


def _grader_model_cost(config, dtype: torch.dtype) -> ModelCost:
    return _engine_counted(config, dtype)


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


# the build's parts: part -> [(owner, attribute, stand-in)]
PIECES = {"model_cost": [(roofline_module, "model_cost", _grader_model_cost)],
          "step_cost": [(roofline_module, "step_cost", _grader_step_cost)],
          "roofline": [(roofline_module, "roofline", _grader_roofline)],
          "workload_bound": [(roofline_module, "workload_bound", _grader_workload_bound)]}
PART_GROUP = dict(zip(PIECES, (COSTS, STEP, ROOF, WORKLOAD)))
# exercise -> [(owner, attribute, stand-in)] (the format tests/stand_ins.py reads for editions of several chapters)
STAND_INS = {"ch09_ex1": [patch for patches in PIECES.values() for patch in patches]}


@contextmanager
def graded(part: str | None):
    """`minivllm.benchmarks.roofline` with the package's (the student's) function for `part` (a key of
    `PIECES`) and the grader's for the other three (None: stand-ins for all)."""
    with ExitStack() as stack:
        for other, patches in PIECES.items():
            for owner, name, fn in patches if other != part else ():
                stack.enter_context(mock.patch.object(owner, name, fn))
        yield


def _first_wrong(got: dict, want: dict, exact: set[str]) -> str | None:
    """The first field of `want` that `got` lacks or holds another value for (floats to 1e-9 relative; the
    fields in `exact` must be Python ints, not bools, equal to the value wanted)."""
    for name, w in want.items():
        if name not in got:
            return f"no field {name!r} (expected {w!r})"
        g = got[name]
        if name in exact and not (isinstance(g, int) and not isinstance(g, bool)):
            return f"{name}: expected the int {w!r}, got {g!r} of type {type(g).__name__} (the contract: integers)"
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


# --- weights and KV bytes per token from the config: model_cost -------------------------------------
def _check_model_cost(model_cost, kind: str | None, overrides: dict, config=None) -> None:
    config = config if config is not None else tiny_config(kind, **overrides)
    hf = _transformers_model(config)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        at = (f"in model_cost({config.model_type} config with {overrides or 'the tiny sizes'}, {dtype})"
              if kind else f"in model_cost(the config of {overrides['name']}, {dtype})")
        got = model_cost(config, dtype)
        _expect(isinstance(got, ModelCost), f"ch09_ex1 ({COSTS}): expected a ModelCost, got {type(got).__name__}, {at}")
        wrong = _first_wrong(asdict(got), asdict(_counted(hf, dtype)), exact=set(COST_FIELDS))
        _expect(wrong is None, f"ch09_ex1 ({COSTS}): {wrong}, {at} (counted on transformers' model from the same "
                               f"config: tied LM head {config.tie_word_embeddings}, {config.num_attention_heads} "
                               f"heads, {config.num_key_value_heads} K/V heads)")


@pytest.mark.ch09
@pytest.mark.ch09_ex1
@pytest.mark.group(COSTS)
@pytest.mark.parametrize("kind, overrides", CONFIGS, ids=CONFIG_IDS)
def test_ch09_ex1_model_cost_counts_transformers_model(kind, overrides):
    with graded("model_cost"):
        _check_model_cost(roofline_module.model_cost, kind, overrides)


def _shipped_config(name: str, tie: bool):
    """The default model's config (the embedded SmolLM2-135M) or Qwen3-0.6B's (shipped with the package),
    with its LM head tied or untied."""
    from minivllm.benchmarks.dummy import model_config
    from minivllm.model_executor.model_loader import load_config
    from minivllm.transformers_utils.model_files import resolve_model

    config = load_config(resolve_model(None)) if name == "SmolLM2-135M" else model_config("qwen3-0.6b")
    config.tie_word_embeddings = tie
    return config


@pytest.mark.ch09
@pytest.mark.ch09_ex1
@pytest.mark.group(COSTS)
@pytest.mark.parametrize("name", ["SmolLM2-135M", "Qwen3-0.6B"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_ch09_ex1_model_cost_of_the_shipped_models(name, tie):
    """The default model and the GPU workload's model, as shipped (tied) and untied: transformers' model built
    from the config on the meta device, nothing allocated."""
    with graded("model_cost"):
        _check_model_cost(roofline_module.model_cost, None, dict(name=f"{name}, {'tied' if tie else 'untied'}"),
                          _shipped_config(name, tie))


@pytest.mark.ch09
@pytest.mark.ch09_ex1
@pytest.mark.group(COSTS)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_ch09_ex1_model_cost_of_qwen2_without_attention_bias(tie):
    """A Qwen2 config that says `attention_bias=False`: chapter 02's engine builds q, k and v without biases
    (the rule the chapter states: an explicit `attention_bias` wins over the class's `qkv_bias_default`), so
    the totals are counted on the engine's model; transformers' Qwen2 would bias them anyway."""
    config = tiny_config("qwen2", attention_bias=False, tie_word_embeddings=tie)
    want = _engine_counted(config, torch.float32)
    assert want.num_params < _counted(_transformers_model(config), torch.float32).num_params, \
        "grader: chapter 02's Qwen2 no longer differs from transformers' on attention_bias=False"
    with graded("model_cost"):
        for dtype in (torch.float32, torch.bfloat16):
            got = roofline_module.model_cost(config, dtype)
            at = f"in model_cost(qwen2 config with attention_bias=False, tie_word_embeddings={tie}, {dtype})"
            _expect(isinstance(got, ModelCost), f"ch09_ex1 ({COSTS}): expected a ModelCost, got "
                                                f"{type(got).__name__}, {at}")
            wrong = _first_wrong(asdict(got), asdict(_engine_counted(config, dtype)), exact=set(COST_FIELDS))
            _expect(wrong is None, f"ch09_ex1 ({COSTS}): {wrong}, {at} (an explicit attention_bias=False: no q, k, v "
                                   f"biases, as chapter 02's model builds it)")


@pytest.fixture(scope="module")
def engine_folders(tmp_path_factory):
    """Tiny models saved as folders, for the engine: grouped-query Llama (untied) and Qwen3 (tied, head_dim 32)."""
    folders = {}
    for kind, tie, overrides in [("llama", False, dict(num_key_value_heads=1)), ("qwen3", True, dict())]:
        folders[kind] = tmp_path_factory.mktemp(f"ch09-{kind}")
        make_tiny_model(folders[kind], kind, tie=tie, **overrides)
    return folders


def _check_engine_kv_cache(model_cost, folder, dtype_name: str) -> None:
    from minivllm.llm import LLM
    from minivllm.model_executor.model_loader import load_config

    got = model_cost(load_config(folder), getattr(torch, dtype_name)).kv_bytes_per_token  # yours first
    llm = LLM(str(folder), dtype=dtype_name, device="cpu", num_kvcache_blocks=5, block_size=4,
              max_model_len=16)
    cache = llm.llm_engine.model_runner.kv_cache  # [2, layers, blocks, block_size, kv_heads, head_dim]
    assert cache.dtype == getattr(torch, dtype_name), f"grader: the engine's cache is in {cache.dtype}"
    slot = cache[:, :, 0, 0]  # one token's K and V in every layer
    allocated = slot.numel() * cache.element_size()
    assert cache.numel() == slot.numel() * cache.shape[2] * cache.shape[3], "grader: an unexpected cache layout"
    _expect(got == allocated, f"ch09_ex1 ({COSTS}): kv_bytes_per_token: expected {allocated} (one token's K and V "
                              f"in the cache the engine allocates for {folder.name}, {tuple(cache.shape)} in "
                              f"{cache.dtype}), got {got!r}")


@pytest.mark.ch09
@pytest.mark.ch09_ex1
@pytest.mark.group(COSTS)
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ch09_ex1_kv_bytes_are_what_the_engine_allocates(engine_folders, kind, dtype):
    with graded("model_cost"):
        _check_engine_kv_cache(roofline_module.model_cost, engine_folders[kind], dtype)


# --- a step's FLOPs and bytes: step_cost -----------------------------------------------------------
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
    _expect(isinstance(got, tuple) and len(got) == 2,
            f"ch09_ex1 ({STEP}): expected a tuple (FLOPs, bytes), got {got!r}, {at}")
    pairs = [_pairs(q, c) for q, c in zip(query_lens, context_lens)]
    _expect(got[0] == want_flops, f"ch09_ex1 ({STEP}): FLOPs: expected {want_flops}, got {got[0]!r}, {at}; expected: "
                                  f"2 per weight of the linear maps for {sum(query_lens)} tokens, the LM head for "
                                  f"{len(query_lens)} sequences, causal (query, key) pairs {pairs}")
    _expect(got[1] == want_bytes, f"ch09_ex1 ({STEP}): bytes: expected {want_bytes}, got {got[1]!r}, {at}; expected: "
                                  f"the weights, then K/V of {sum(context_lens)} context tokens read and "
                                  f"{sum(query_lens)} new tokens written")
    types = [type(v).__name__ for v in got]
    _expect(all(isinstance(v, int) and not isinstance(v, bool) for v in got),
            f"ch09_ex1 ({STEP}): expected FLOPs and bytes as ints (the docstring: integers), got {got!r} of types "
            f"{types}, {at}")


@pytest.mark.ch09
@pytest.mark.ch09_ex1
@pytest.mark.group(STEP)
@pytest.mark.parametrize("kind, overrides", [CONFIGS[i] for i in (1, 3, 5)], ids=[CONFIG_IDS[i] for i in (1, 3, 5)])
def test_ch09_ex1_step_cost_counts_a_real_forward(kind, overrides):
    """FLOPs of the linear maps counted by FlopCounterMode in transformers' forward (exactly: the counter and
    the contract both count matrix products only); attention pairs by brute force over the causal mask after
    the cached prefix (eager attention computes every pair of the rectangle, which the grader checks against
    `attention_flops_per_pair`, then keeps the triangle)."""
    config = tiny_config(kind, **overrides)
    hf = _transformers_model(config, meta=False)
    cost = _counted(hf, torch.float32)
    for name, (query_lens, context_lens) in STEPS.items():
        linear, rectangle = _measured_step(hf, config, query_lens, context_lens)
        assert rectangle == cost.attention_flops_per_pair * sum(q * c for q, c in zip(query_lens, context_lens)), \
            "grader: eager attention's matmuls disagree with attention_flops_per_pair"
        want = linear + cost.attention_flops_per_pair * sum(map(_pairs, query_lens, context_lens))
        with graded("step_cost"):
            _check_step_cost(roofline_module.step_cost, cost, query_lens, context_lens, want,
                             f"{name} step of transformers' {kind} model: linear FLOPs {linear} by FlopCounterMode")


@pytest.mark.ch09
@pytest.mark.ch09_ex1
@pytest.mark.group(STEP)
@settings(max_examples=150, **HYPOTHESIS)
@given(cost=_costs, step=_steps())
def test_ch09_ex1_step_cost_by_the_rule(cost, step):
    query_lens, context_lens = step
    want = (2 * cost.matmul_params * sum(query_lens) + 2 * cost.lm_head_params * len(query_lens)
            + cost.attention_flops_per_pair * sum(map(_pairs, query_lens, context_lens)))
    with graded("step_cost"):
        _check_step_cost(roofline_module.step_cost, cost, query_lens, context_lens, want, "random cost and step")


@pytest.mark.ch09
@pytest.mark.ch09_ex1
@pytest.mark.group(STEP)
@settings(max_examples=100, **HYPOTHESIS)
@given(cost=_costs, first=_steps(max_seqs=3), second=_steps(max_seqs=3), k=st.integers(2, 7))
def test_ch09_ex1_step_cost_invariants(cost, first, second, k):
    """Additive over sequences (the weights read once per step), linear in the cost, growing with every
    context token."""
    at = f"in step_cost({cost}, ...) on the steps {first} and {second}"

    def cost_of(c: ModelCost, step) -> tuple[int, int]:
        got = roofline_module.step_cost(c, list(step[0]), list(step[1]))
        _expect(isinstance(got, tuple) and len(got) == 2,
                f"ch09_ex1 ({STEP}): expected (FLOPs, bytes), got {got!r}, {at}")
        return got

    with graded("step_cost"):
        (f1, b1), (f2, b2) = cost_of(cost, first), cost_of(cost, second)
        f12, b12 = cost_of(cost, (first[0] + second[0], first[1] + second[1]))
        _expect((f12, b12) == (f1 + f2, b1 + b2 - cost.weight_bytes),
                f"ch09_ex1 ({STEP}): the two steps' sequences in one step: expected FLOPs {f1 + f2} and bytes "
                f"{b1 + b2 - cost.weight_bytes} (the weights read once), got {(f12, b12)}, {at}")
        longer = (first[0], [c + 1 for c in first[1]])  # every context one token longer, the same new tokens
        fl, bl = cost_of(cost, longer)
        _expect(fl > f1 and bl > b1, f"ch09_ex1 ({STEP}): one more context token per sequence must cost more FLOPs "
                                     f"and bytes: {(f1, b1)} at {first}, {(fl, bl)} at {longer}, {at}")
        scaled = ModelCost(**{name: k * value for name, value in asdict(cost).items()})
        fk, bk = cost_of(scaled, first)
        _expect((fk, bk) == (k * f1, k * b1), f"ch09_ex1 ({STEP}): every count of the cost times {k} must multiply "
                                              f"FLOPs and bytes by {k}: {(f1, b1)} became {(fk, bk)}, {at}")


# --- the roofline of a run: roofline ----------------------------------------------------------------
def _check_roofline(cost: ModelCost, steps, peaks: DevicePeaks, exact_ties: bool = False) -> None:
    """`roofline` against the sum written here. With `exact_ties` (rates and counts whose two times are
    exact floats), a step whose two times are equal must count as memory-bound; otherwise such a step may
    count either way (two ways of computing the times may round apart)."""
    at = (f"in roofline({cost}, {len(steps)} steps {steps}, peaks {peaks.matmul_flops_per_s:.6g} FLOP/s, "
          f"{peaks.copy_bytes_per_s:.6g} B/s)")
    want = dict(flops=0, bytes=0, steps=len(steps), seconds=0.0)  # the counters first: seconds follow from them
    strict = loose = 0
    for q, c in steps:
        f, b = _grader_step_cost(cost, q, c)
        compute, memory = f / peaks.matmul_flops_per_s, b / peaks.copy_bytes_per_s
        want.update(seconds=want["seconds"] + max(compute, memory), flops=want["flops"] + f, bytes=want["bytes"] + b)
        strict, loose = strict + (memory > compute), loose + (memory >= compute)
    with graded("roofline"):
        got = roofline_module.roofline(cost, steps, peaks)
    _expect(isinstance(got, dict), f"ch09_ex1 ({ROOF}): expected a dict, got {type(got).__name__}, {at}")
    wrong = _first_wrong(got, want, exact={"flops", "bytes", "steps"})
    _expect(wrong is None, f"ch09_ex1 ({ROOF}): {wrong}, {at} (each step at the longer of FLOPs / matmul rate and "
                           f"bytes / copy rate, summed; FLOPs and bytes from step_cost, summed)")
    m = got.get("memory_bound_steps")
    strict = loose if exact_ties else strict
    _expect(isinstance(m, int) and not isinstance(m, bool) and strict <= m <= loose,
            f"ch09_ex1 ({ROOF}): memory_bound_steps: expected {strict}" + (f" to {loose} (steps whose two times are "
            "equal may count either way)" if loose > strict else "") + f", got {m!r}, {at} (steps whose bytes take "
            "longer than their FLOPs)")


@pytest.mark.ch09
@pytest.mark.ch09_ex1
@pytest.mark.group(ROOF)
@settings(max_examples=120, **HYPOTHESIS)
@given(cost=_costs, steps=st.lists(_steps(max_seqs=4, max_context=60), max_size=8), peaks=_peaks)
def test_ch09_ex1_roofline_sums_the_slower_side(cost, steps, peaks):
    _check_roofline(cost, steps, peaks)


@pytest.mark.ch09
@pytest.mark.ch09_ex1
@pytest.mark.group(ROOF)
def test_ch09_ex1_roofline_of_known_steps():
    """1 FLOP/s and 1 B/s: a step costs max(FLOPs, bytes) seconds. Two decodes are memory-bound, the prefill
    compute-bound, an empty run is 0. Then a tie: a decode at context 97 needs 198 FLOPs and 198 bytes, and at
    equal rates that are powers of two (1 and 2**33 per second) its two times are exactly equal: its bytes
    take *at least as long* as its arithmetic, so it is memory-bound."""
    cost = ModelCost(num_params=10, weight_bytes=100, matmul_params=1, lm_head_params=1,
                     attention_flops_per_pair=2, kv_bytes_per_token=1)
    steps = [([1], [3]), ([20], [20]), ([1, 1], [5, 2])]
    _check_roofline(cost, steps, DevicePeaks(1.0, 1.0), exact_ties=True)
    _check_roofline(cost, [], DevicePeaks(1.0, 1.0), exact_ties=True)
    tie = ([1], [97])
    assert _grader_step_cost(cost, *tie) == (198, 198), "grader: the tie step is not a tie"
    for rate in (1.0, 2.0 ** 33):
        _check_roofline(cost, [tie], DevicePeaks(rate, rate), exact_ties=True)
        _check_roofline(cost, [steps[1], tie, steps[0]], DevicePeaks(rate, rate), exact_ties=True)


# --- the least time of a workload: workload_bound ----------------------------------------------------
def _workload(prompt_lens: list[int], output_lens: list[int], shared_prefix_lens: list[int] | None = None) -> Workload:
    """Prompts of `prompt_lens` tokens, request i's first `shared_prefix_lens[i]` tokens the start of one common
    sequence (0, 1, 2, ...), the rest its own."""
    shared = list(shared_prefix_lens or [0] * len(prompt_lens))
    prompts = [list(range(s)) + [1000 + 100 * i + t for t in range(p - s)]
               for i, (p, s) in enumerate(zip(prompt_lens, shared))]
    return Workload(prompts, list(output_lens), shared)


def _check_workload_bound(cost: ModelCost, prompt_lens: list[int], output_lens: list[int], peaks: DevicePeaks,
                          shared_prefix_lens: list[int] | None = None) -> dict:
    workload = _workload(prompt_lens, output_lens, shared_prefix_lens)
    at = (f"in workload_bound({cost}, prompts of {prompt_lens} tokens, output_lens {output_lens}, "
          f"shared_prefix_lens {workload.shared_prefix_lens}, peaks "
          f"{peaks.matmul_flops_per_s:.6g} FLOP/s, {peaks.copy_bytes_per_s:.6g} B/s)")
    with graded("workload_bound"):
        got = roofline_module.workload_bound(cost, workload, peaks)
    _expect(isinstance(got, dict), f"ch09_ex1 ({WORKLOAD}): expected a dict, got {type(got).__name__}, {at}")
    want = _grader_workload_bound(cost, workload, peaks)
    want = {k: want[k] for k in ("flops", "bytes", "seconds", "tok_s")}  # the counters first
    wrong = _first_wrong(got, want, exact={"flops", "bytes"})
    _expect(wrong is None, f"ch09_ex1 ({WORKLOAD}): {wrong}, {at} (each request: one prefill of its prompt, then "
                           "output_len - 1 decodes, each once; the weights read max(output_lens) times; "
                           "max(FLOPs / rate, bytes / rate) over the whole run; every prompt computed whole, "
                           "shared prefixes included: the bound is for an engine without prefix caching)")
    return got


@pytest.mark.ch09
@pytest.mark.ch09_ex1
@pytest.mark.group(WORKLOAD)
@settings(max_examples=120, **HYPOTHESIS)
# a fixed case first (the draws depend on where the test is called from): two requests of different output
# lengths share the weights' reads of their decode steps
@example(cost=ModelCost(1000, 10**6, 100, 100, 1, 1), lens=[(4, 3), (4, 2)],
         peaks=DevicePeaks(matmul_flops_per_s=1e9, copy_bytes_per_s=1e9))
@given(cost=_costs, lens=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12)), min_size=1, max_size=5),
       peaks=_peaks)
def test_ch09_ex1_workload_bound_by_the_closed_form(cost, lens, peaks):
    _check_workload_bound(cost, [p for p, _ in lens], [n for _, n in lens], peaks)


@pytest.mark.ch09
@pytest.mark.ch09_ex1
@pytest.mark.group(WORKLOAD)
@settings(max_examples=60, **HYPOTHESIS)
# a fixed case first: three requests sharing 4, 4 and 2 leading tokens of prompts of 6, 9 and 5 tokens
@example(cost=ModelCost(1000, 10**6, 100, 100, 1, 1), lens=[(6, 3, 4), (9, 2, 4), (5, 4, 2)],
         peaks=DevicePeaks(matmul_flops_per_s=1e9, copy_bytes_per_s=1e9))
@given(cost=_costs, lens=st.lists(st.tuples(st.integers(2, 60), st.integers(1, 12), st.integers(1, 60)),
                                  min_size=1, max_size=5), peaks=_peaks)
def test_ch09_ex1_workload_bound_computes_shared_prefixes_whole(cost, lens, peaks):
    """Prompts that share a prefix (`workload.shared_prefix_lens`, 1 up to the prompt's length): the bound is
    the one without prefix caching (the docstring), every prompt token computed, so it equals the closed form of
    the same prompts sharing nothing."""
    prompt_lens, output_lens = [p for p, _, _ in lens], [n for _, n, _ in lens]
    shared = [min(s, p - 1) for p, _, s in lens]  # at least one token of each prompt its own
    _check_workload_bound(cost, prompt_lens, output_lens, peaks, shared)


def _schedules(prompt_lens: list[int], output_lens: list[int]) -> dict[str, list]:
    """Two real schedules' steps `(query_lens, context_lens)`: one request at a time (its prefill, then its
    decodes), and all at once (every prefill in one step, then one decode step of every unfinished request)."""
    serial = [step for p, n in zip(prompt_lens, output_lens)
              for step in [([p], [p])] + [([1], [p + k]) for k in range(1, n)]]
    together = [(list(prompt_lens), list(prompt_lens))]
    for k in range(1, max(output_lens)):
        live = [p + k for p, n in zip(prompt_lens, output_lens) if k < n]
        together.append(([1] * len(live), live))
    return dict(serial=serial, together=together)


@pytest.mark.ch09
@pytest.mark.ch09_ex1
@pytest.mark.group(WORKLOAD)
@settings(max_examples=80, **HYPOTHESIS)
@given(cost=_costs, lens=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 10)), min_size=1, max_size=5),
       peaks=_peaks)
def test_ch09_ex1_workload_bound_is_below_every_schedule(cost, lens, peaks):
    """The same FLOPs as any schedule, and never more time than the roofline of a real schedule's steps."""
    prompt_lens, output_lens = [p for p, _ in lens], [n for _, n in lens]
    with graded("workload_bound"):
        got = roofline_module.workload_bound(cost, _workload(prompt_lens, output_lens), peaks)
    at = f"in workload_bound({cost}, prompts of {prompt_lens} tokens, output_lens {output_lens}, {peaks})"
    _expect(isinstance(got, dict) and "seconds" in got and "flops" in got,
            f"ch09_ex1 ({WORKLOAD}): expected a dict with seconds and flops, got {got!r}, {at}")
    for name, steps in _schedules(prompt_lens, output_lens).items():
        bound = _grader_roofline(cost, steps, peaks)
        _expect(got["flops"] == bound["flops"], f"ch09_ex1 ({WORKLOAD}): flops: expected {bound['flops']} (the FLOPs "
                                                f"of the {name} schedule's steps: every schedule computes the same), "
                                                f"got {got['flops']!r}, {at}")
        _expect(got["seconds"] <= bound["seconds"] * (1 + 1e-9), f"ch09_ex1 ({WORKLOAD}): seconds {got['seconds']!r} "
                f"above the roofline of the {name} schedule's steps, {bound['seconds']!r}: no bound for any "
                f"schedule, {at}")


# --- plausible wrong answers lose their own part's points, and only those (not graded: they check the graders)
def _kv_of_query_heads(config, dtype):
    """K/V bytes counted with a K/V head per query head (num_attention_heads, not num_key_value_heads)."""
    right = _grader_model_cost(config, dtype)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return replace(right, kv_bytes_per_token=2 * config.num_hidden_layers * config.num_attention_heads * head_dim
                   * dtype.itemsize)


def _tied_head_counted_twice(config, dtype):
    """The embedding and the LM head counted as two matrices even when the config ties them."""
    right = _grader_model_cost(config, dtype)
    tied = config.tie_word_embeddings
    return replace(right, num_params=right.num_params + right.lm_head_params * tied)


def _one_flop_per_weight(cost, query_lens, context_lens):
    """A multiply-add counted as one FLOP in the linear maps and the LM head."""
    flops, num_bytes = _grader_step_cost(cost, query_lens, context_lens)
    return flops - cost.matmul_params * sum(query_lens) - cost.lm_head_params * len(query_lens), num_bytes


def _roofline_summing(cost, steps, peaks):
    """Each step's arithmetic and traffic added, as if the device could not overlap them."""
    out = _grader_roofline(cost, steps, peaks)
    out["seconds"] = sum(f / peaks.matmul_flops_per_s + b / peaks.copy_bytes_per_s
                         for f, b in (_grader_step_cost(cost, q, c) for q, c in steps))
    return out


def _weights_per_output_token(cost, workload, peaks):
    """The weights read once per output token of every request, as if no step were shared."""
    out = _grader_workload_bound(cost, workload, peaks)
    num_bytes = out["bytes"] + cost.weight_bytes * (sum(workload.output_lens) - max(workload.output_lens))
    seconds = max(out["flops"] / peaks.matmul_flops_per_s, num_bytes / peaks.copy_bytes_per_s)
    return dict(out, bytes=num_bytes, seconds=seconds, tok_s=sum(workload.output_lens) / seconds)


def _qwen2_biased_whatever_the_config(config, dtype):
    """Qwen2's q, k and v biased even when the config says attention_bias=False (transformers' Qwen2; the
    chapter's prose before it was corrected)."""
    return _counted(_transformers_model(config), dtype)


def _step_cost_in_floats(cost, query_lens, context_lens):
    """The causal pairs counted with `/` (q c - q (q - 1) / 2): the right values, as floats."""
    flops, num_bytes = _grader_step_cost(cost, query_lens, context_lens)
    pairs = sum(q * c - q * (q - 1) / 2 for q, c in zip(query_lens, context_lens))
    return (2 * cost.matmul_params * sum(query_lens) + 2 * cost.lm_head_params * len(query_lens)
            + cost.attention_flops_per_pair * pairs), num_bytes


def _roofline_float_totals(cost, steps, peaks):
    """The totals added up as floats."""
    out = _grader_roofline(cost, steps, peaks)
    return dict(out, flops=float(out["flops"]), bytes=float(out["bytes"]))


def _roofline_tie_compute_bound(cost, steps, peaks):
    """A step memory-bound only when its bytes take strictly longer than its arithmetic (`>`, not `>=`)."""
    out = _grader_roofline(cost, steps, peaks)
    times = [(f / peaks.matmul_flops_per_s, b / peaks.copy_bytes_per_s)
             for f, b in (_grader_step_cost(cost, q, c) for q, c in steps)]
    return dict(out, memory_bound_steps=sum(memory > compute for compute, memory in times))


def _shared_prefixes_credited(cost, workload, peaks):
    """Shared prompt prefixes computed once, as a prefix cache would (T = p + n - 1 - s): not the contract's
    bound, which is for an engine without prefix caching."""
    flops = kv_tokens = 0
    for prompt, n, s in zip(workload.prompts, workload.output_lens, workload.shared_prefix_lens):
        p = len(prompt)
        t = p + n - 1 - (s if s < p else 0)
        flops += (2 * cost.matmul_params * t + 2 * cost.lm_head_params * n
                  + cost.attention_flops_per_pair * (t * (t + 1) // 2))
        kv_tokens += n * p + n * (n - 1) // 2 + t
    num_bytes = cost.kv_bytes_per_token * kv_tokens + cost.weight_bytes * max(workload.output_lens)
    seconds = max(flops / peaks.matmul_flops_per_s, num_bytes / peaks.copy_bytes_per_s)
    return dict(seconds=seconds, flops=flops, bytes=num_bytes, tok_s=sum(workload.output_lens) / seconds)


def _group_checks(engine_folders) -> dict[str, list]:
    """Each part's checks, the grading tests themselves on a few of their cases."""
    return {COSTS: [lambda: test_ch09_ex1_model_cost_counts_transformers_model(*CONFIGS[1]),
                    lambda: test_ch09_ex1_model_cost_counts_transformers_model(*CONFIGS[5]),
                    lambda: test_ch09_ex1_model_cost_of_the_shipped_models("SmolLM2-135M", True),
                    lambda: test_ch09_ex1_model_cost_of_qwen2_without_attention_bias(False),
                    lambda: test_ch09_ex1_kv_bytes_are_what_the_engine_allocates(engine_folders, "llama", "float32")],
            STEP: [lambda: test_ch09_ex1_step_cost_counts_a_real_forward(*CONFIGS[5]),
                   test_ch09_ex1_step_cost_by_the_rule, test_ch09_ex1_step_cost_invariants],
            ROOF: [test_ch09_ex1_roofline_sums_the_slower_side, test_ch09_ex1_roofline_of_known_steps],
            WORKLOAD: [test_ch09_ex1_workload_bound_by_the_closed_form,
                       test_ch09_ex1_workload_bound_computes_shared_prefixes_whole,
                       test_ch09_ex1_workload_bound_is_below_every_schedule]}


@pytest.mark.ch09
@pytest.mark.parametrize("name, wrong", [
    ("model_cost", _kv_of_query_heads), ("model_cost", _tied_head_counted_twice),
    ("model_cost", _qwen2_biased_whatever_the_config), ("step_cost", _one_flop_per_weight),
    ("step_cost", _step_cost_in_floats), ("roofline", _roofline_summing), ("roofline", _roofline_float_totals),
    ("roofline", _roofline_tie_compute_bound), ("workload_bound", _weights_per_output_token),
    ("workload_bound", _shared_prefixes_credited)],
    ids=lambda v: v.__name__.strip("_") if callable(v) else v)
def test_ch09_ex1_wrong_answers_lose_their_part(name, wrong, engine_folders, monkeypatch):
    """Each wrong function, put in the package's place, fails its own part's checks and passes every other
    part's (which run the grader's version of it): it loses exactly its part's points."""
    monkeypatch.setattr(roofline_module, name, wrong)
    failed = {}
    for group, checks in _group_checks(engine_folders).items():
        for check in checks:
            try:
                check()
            except AssertionError as e:
                failed.setdefault(group, str(e))
    assert list(failed) == [PART_GROUP[name]], f"{wrong.__name__}: the parts that fail are {failed}"
    assert failed[PART_GROUP[name]].startswith(f"ch09_ex1 ({PART_GROUP[name]})"), failed


@pytest.mark.ch09
def test_ch09_grader_stand_ins_pass_every_part(engine_folders):
    """The stand-ins the graders put in place are right: with all four in the package's place, every part's
    checks pass (and the model cost is the loaded model's parameter count)."""
    config = tiny_config("qwen3", tie_word_embeddings=True)
    hf = _transformers_model(config, meta=False)
    assert _grader_model_cost(config, torch.float32).num_params == sum(p.numel() for p in hf.parameters())
    with ExitStack() as stack:
        for owner, name, fn in STAND_INS["ch09_ex1"]:
            stack.enter_context(mock.patch.object(owner, name, fn))
        for checks in _group_checks(engine_folders).values():
            for check in checks:
                check()
    with mock.patch.object(roofline_module, "workload_bound", _workload_bound_step_by_step):
        test_ch09_ex1_workload_bound_by_the_closed_form()


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
