"""Grading tests for chapter 02's build (`python -m minivllm.course.grade ch02_ex3`, or `pytest -m ch02_ex3`).

ch02_ex3 is the decoder layer written whole behind the interface the engine uses: `RMSNorm.forward`,
`RotaryEmbedding.forward`, `Attention.forward` and `Attention.qkv` (projections, Qwen3's q/k norms,
rotary, the attention backend, o_proj), `MLP.forward` and `DecoderLayer.forward` (residuals and
norms). It is graded in the package itself: in a student edition those are the student's code,
exported from the chapter (stubs until filled), and there is no reference to compare with. The
oracle is transformers: `LlamaRMSNorm`, `apply_rotary_pos_emb`, the attention modules of Llama,
Qwen2 and Qwen3, `LlamaMLP`, then tiny float64 models whose logits must equal transformers'.

It scores by parts (`@pytest.mark.group`, the groups of `EXERCISES["ch02_ex3"]`): each part is
graded with the grader's own stand-ins in place of the other parts (`graded(part)`), so a filled
part scores whatever state the others are in; the last part is the whole decoder, the student's
every piece together (tiny models here, the default model in test_grading_default_model.py).
Hypothesis runs derandomized (the same answer always scores the same points). The tests at the end
(not graded) check that plausible wrong answers lose their own part's points.

Dtypes: float64 and float32 (tolerances of float32 statistics), bfloat16 and float16 (where the
order of RMSNorm's cast shows: Llama casts the normalised vector back to the input dtype *before*
the weight multiplies it, which changes about a quarter of the 16-bit results).
"""
from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from adapters import failed_checks
from minivllm.baselines.naive import CausalAttention
from minivllm.course.grade import EXERCISES as GRADED
from minivllm.model_executor.model_loader import load_model
from minivllm.model_executor.models.llama import MLP, Attention, DecoderLayer, RMSNorm, RotaryEmbedding

EX = "ch02_ex3"
NORM, ROPE, ATTENTION, FFN, LAYER, WHOLE = (name for name, _ in GRADED[EX].groups)


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


@contextmanager
def your_code(what: str):
    """Within: an error raised by the code under grading, other than a stub's NotImplementedError (its
    message names the exercise and the task) or a check's AssertionError, is re-raised as an
    AssertionError naming the exercise and `what` was running (the traceback still shows where)."""
    try:
        yield
    except (NotImplementedError, AssertionError):
        raise
    except Exception as e:  # noqa: BLE001  (an error in the student's code: say whose and where)
        named = what if what.startswith(EX) else f"{EX}: {what}"  # say the exercise once
        raise AssertionError(f"{named} raised {type(e).__name__}: {e} (the traceback shows where)") from e


def _where_largest(got: torch.Tensor, want: torch.Tensor) -> str:
    """The largest difference, where it is, and the two values there."""
    diff = (got.double() - want.double()).abs()
    i = tuple(int(j) for j in torch.unravel_index(diff.argmax(), diff.shape))
    return (f"largest difference {diff.max().item():.3g} at index {list(i)} (got {got[i].item():.6g}, "
            f"expected {want[i].item():.6g})")


def _close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> bool:
    return bool(((got.double() - want.double()).abs() <= atol + rtol * want.double().abs()).all())


def _shape_and_dtype(at: str, got, shape, dtype) -> None:
    _expect(isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(shape) and got.dtype == dtype,
            f"{at}: expected a tensor of shape {tuple(shape)} and dtype {dtype}, got "
            f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}"
            f"{' ' + str(got.dtype) if isinstance(got, torch.Tensor) else ''}")


# --- the grader's stand-ins (transformers' arithmetic), for the parts a test is not about ----------
def _grader_rms_norm(self, x: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight * h.to(x.dtype)


def _grader_rope(self, positions, q, k):
    half = self.head_dim // 2
    cos, sin = (t[positions, :half].to(q.dtype)[:, None, :] for t in (self.cos, self.sin))

    def rotate(x):
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return rotate(q), rotate(k)


def _grader_qkv(self, hidden):
    heads = [(self.q_proj, self.num_heads), (self.k_proj, self.num_kv_heads), (self.v_proj, self.num_kv_heads)]
    return tuple(proj(hidden).unflatten(-1, (count, self.head_dim)) for proj, count in heads)


def _grader_attention(self, positions, hidden, attn):
    q, k, v = self.qkv(hidden)
    if self.qk_norm:
        q = self.q_norm(q)
        k = self.k_norm(k)
    q, k = self.rotary[0](positions, q, k)
    return self.o_proj(attn(self.layer_idx, q, k, v).flatten(-2))


def _grader_mlp(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _grader_layer(self, positions, hidden, attn):
    after_attention = self.self_attn(positions, self.input_layernorm(hidden), attn) + hidden
    return self.mlp(self.post_attention_layernorm(after_attention)) + after_attention


STAND_INS = {EX: [(RMSNorm, "forward", _grader_rms_norm), (RotaryEmbedding, "forward", _grader_rope),
                  (Attention, "forward", _grader_attention), (Attention, "qkv", _grader_qkv),
                  (MLP, "forward", _grader_mlp), (DecoderLayer, "forward", _grader_layer)]}
# the parts of the build: the methods each part is, and its group
PARTS = {"norm": [(RMSNorm, "forward")], "rope": [(RotaryEmbedding, "forward")],
         "attention": [(Attention, "forward"), (Attention, "qkv")], "mlp": [(MLP, "forward")],
         "layer": [(DecoderLayer, "forward")]}
PART_GROUP = {"norm": NORM, "rope": ROPE, "attention": ATTENTION, "mlp": FFN, "layer": LAYER, "whole": WHOLE}


def _through_the_grader(fn):
    """`fn` as a method the model calls: while the build is graded, the stand-ins are tripwires for
    the code under grading, and this wrapper (the graders' own code) is how the graders call them."""
    def method(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    return method


@contextmanager
def graded(part: str | None):
    """The package's (the student's) code for `part` ("norm", "rope", "attention", "mlp", "layer"),
    the grader's stand-ins for the other parts; "whole" (or "ch02_ex3"): the package's every part;
    None: stand-ins for all (other chapters' graders use that to run the model)."""
    mine = {(cls, name) for cls, name in PARTS.get(part, [])}
    if part in ("whole", EX):
        mine = {(cls, name) for cls, name, _ in STAND_INS[EX]}
    with ExitStack() as stack:
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        for cls, name, fn in STAND_INS[EX]:  # read now: the tripwires' entries while the build is graded
            if (cls, name) not in mine:
                mp.setattr(cls, name, _through_the_grader(fn))
        yield


def _group(part: str):
    return pytest.mark.group(PART_GROUP[part])


def _derandomized(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    report_multiple_bugs=False)


# --- RMSNorm ---------------------------------------------------------------------------------------
SIXTEEN_BIT = (torch.bfloat16, torch.float16)
MAX_DIFFERING = 0.02  # 16-bit: at most this share of elements may differ from transformers by one unit


def check_rms_norm(dtype: torch.dtype, max_examples: int = 12) -> None:
    """`RMSNorm(hidden, eps)` with a random weight against transformers' `LlamaRMSNorm`. float64 and
    float32: to 1e-6 relative (the statistics are taken in float32, whose rounding is 6e-8; any order
    of float32 or float64 arithmetic fits). bfloat16 and float16: each element within one unit of the
    last place, and at most 2% of them off by that unit (another valid float32 formula moves about
    0.01%; the weight multiplied before the cast back moves about 25%)."""
    @_derandomized(max_examples)
    @given(n=st.integers(1, 12), hidden=st.sampled_from([16, 64, 96]), eps=st.sampled_from([1e-6, 1e-5]),
           scale=st.sampled_from([0.01, 1.0, 30.0]), seed=st.integers(0, 2**16))
    def run(n, hidden, eps, scale, seed):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        g = torch.Generator().manual_seed(seed)
        rows = max(n, 1024 // hidden) if dtype in SIXTEEN_BIT else n  # enough elements to count the share
        x = (torch.randn(rows, hidden, generator=g, dtype=torch.float64) * scale).to(dtype)
        weight = (torch.randn(hidden, generator=g, dtype=torch.float64) * 0.5 + 1).to(dtype)
        ref, ours = LlamaRMSNorm(hidden, eps=eps).to(dtype), RMSNorm(hidden, eps=eps).to(dtype)
        at = f"{EX} (RMSNorm, {dtype}): RMSNorm({hidden}, eps={eps}) on x of shape {tuple(x.shape)} (seed {seed})"
        with torch.no_grad(), graded("norm"), your_code(at):
            ref.weight.copy_(weight)
            ours.weight.copy_(weight)
            want, got = ref(x), ours(x.clone())
        _shape_and_dtype(at, got, x.shape, dtype)
        if dtype not in SIXTEEN_BIT:
            _expect(_close(got, want, 1e-6 * scale, 1e-6), f"{at}: differs from transformers' LlamaRMSNorm "
                    f"beyond float32 rounding; {_where_largest(got, want)}")
            return
        differ = got != want
        ulp = torch.finfo(dtype).eps * want.double().abs() + torch.finfo(dtype).tiny  # one unit at |want|
        within = bool(((got.double() - want.double()).abs() <= ulp).all())
        share = differ.double().mean().item()
        if within and share <= MAX_DIFFERING:
            return
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        cast_last = (weight * h).to(dtype)  # the weight multiplied in float32, one rounding at the end
        if (got == cast_last).double().mean().item() > 0.99:
            raise AssertionError(
                f"{at}: RMSNorm's cast is in the wrong place: your result is weight * normalised x rounded once "
                f"to {dtype} (the weight multiplied before casting back). Llama, and transformers, cast the "
                f"normalised x back to x's dtype first, then multiply by the weight (two roundings); "
                f"{int(differ.sum())} of {differ.numel()} elements differ from LlamaRMSNorm, "
                f"{_where_largest(got, want)}")
        raise AssertionError(f"{at}: {int(differ.sum())} of {differ.numel()} elements differ from transformers' "
                             f"LlamaRMSNorm ({'all' if within else 'some by more than'} one unit in the last place; "
                             f"at most {MAX_DIFFERING:.0%} may differ by one unit); {_where_largest(got, want)}. " + (
                                 "Take the statistics in float32 (STATS_DTYPE) and mind the order of the cast" if within
                                 else "More than rounding: check the formula itself (the mean of x**2 over the last "
                                      "dimension, + eps inside the square root, the weight)"))
    run()


@pytest.mark.ch02
@pytest.mark.ch02_ex3
@_group("norm")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_ch02_ex3_rms_norm_equals_transformers(dtype):
    check_rms_norm(dtype)


# --- RoPE ------------------------------------------------------------------------------------------
ROPE_TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 2e-2)}  # atol, rtol
MAX_POSITION = 256


def _rope_candidates(rope: RotaryEmbedding, positions, q, k):
    """transformers' rotation of q and k, and what three usual mistakes give (for the failure message)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    def hf(rows, sign=1):  # transformers wants [batch, heads, tokens, head_dim]
        cos, sin = rope.cos[rows].to(q.dtype), sign * rope.sin[rows].to(q.dtype)
        rq, rk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
        return rq[0].transpose(0, 1), rk[0].transpose(0, 1)

    def adjacent(x):  # pairs (2i, 2i+1) rotated by angle i (RoFormer's and GPT-J's layout)
        half = x.shape[-1] // 2
        c, s = (t[positions, :half].to(x.dtype)[:, None, :] for t in (rope.cos, rope.sin))
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)

    return hf(positions), {
        "RoPE rotated the wrong way (by minus each position's angle: the sign of the sin term is flipped)":
            hf(positions, -1),
        "the adjacent dimensions (2i, 2i+1) were rotated as pairs; Llama pairs dimension i with i + head_dim/2":
            (adjacent(q), adjacent(k)),
        "the tokens were rotated by their index in the call (0, 1, 2, ...) instead of by `positions`":
            hf(torch.arange(len(positions))),
    }


def check_rope(dtype: torch.dtype, max_examples: int = 15) -> None:
    """`RotaryEmbedding.forward(positions, q, k)` at random positions against transformers'
    `apply_rotary_pos_emb` with the same cos/sin rows (the table is given): float64 to 1e-12 (the
    same products), float32 to 1e-5, bfloat16 to 3e-2 + 2% (transformers rounds each product in
    bfloat16; float32 arithmetic cast once is as good)."""
    @_derandomized(max_examples)
    @given(n=st.integers(1, 10), num_kv_heads=st.sampled_from([1, 2]), groups=st.sampled_from([1, 3]),
           head_dim=st.sampled_from([2, 8, 32]), base=st.sampled_from([10000.0, 1e6]), seed=st.integers(0, 2**16))
    def run(n, num_kv_heads, groups, head_dim, base, seed):
        g = torch.Generator().manual_seed(seed)
        positions = torch.randint(1, MAX_POSITION, (n,), generator=g)
        q = (torch.randn(n, num_kv_heads * groups, head_dim, generator=g, dtype=torch.float64)).to(dtype)
        k = (torch.randn(n, num_kv_heads, head_dim, generator=g, dtype=torch.float64)).to(dtype)
        rope = RotaryEmbedding(head_dim, MAX_POSITION, base)
        (want_q, want_k), mistakes = _rope_candidates(rope, positions, q, k)
        at = (f"{EX} (rotary embedding, {dtype}): RotaryEmbedding(head_dim={head_dim}, base={base:g}) at positions "
              f"{positions.tolist()}, q {tuple(q.shape)}, k {tuple(k.shape)} (seed {seed})")
        with torch.no_grad(), graded("rope"), your_code(at):
            got = rope(positions, q.clone(), k.clone())
        _expect(isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got),
                f"{at}: forward must return the pair (rotated q, rotated k), got {type(got).__name__}")
        got_q, got_k = got
        _expect(got_q.shape == q.shape and got_k.shape == k.shape and got_q.dtype == got_k.dtype == dtype,
                f"{at}: expected q {tuple(q.shape)} and k {tuple(k.shape)} in {dtype}, got {tuple(got_q.shape)} "
                f"{got_q.dtype} and {tuple(got_k.shape)} {got_k.dtype}")
        atol, rtol = ROPE_TOL[dtype]
        if _close(got_q, want_q, atol, rtol) and _close(got_k, want_k, atol, rtol):
            return
        for mistake, pair in mistakes.items():
            if _close(got_q, pair[0], atol, rtol) and _close(got_k, pair[1], atol, rtol):
                raise AssertionError(f"{at}: {mistake}. Against transformers: q's {_where_largest(got_q, want_q)}")
        name, got_t, want_t = ("q", got_q, want_q) if not _close(got_q, want_q, atol, rtol) else ("k", got_k, want_k)
        raise AssertionError(f"{at}: rotated {name} differs from transformers' apply_rotary_pos_emb beyond "
                             f"atol {atol:g} + rtol {rtol:g}; {_where_largest(got_t, want_t)}")
    run()


@pytest.mark.ch02
@pytest.mark.ch02_ex3
@_group("rope")
@pytest.mark.parametrize("dtype", list(ROPE_TOL), ids=str)
def test_ch02_ex3_rope_equals_transformers(dtype):
    check_rope(dtype)


# --- the MLP ---------------------------------------------------------------------------------------
MLP_TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def check_mlp(dtype: torch.dtype, max_examples: int = 10) -> None:
    """`MLP(hidden, intermediate, bias)` against transformers' `LlamaMLP` with the same weights:
    float64 to 1e-12, float32 to 1e-5, bfloat16 to 2e-2 + 2% (SiLU in float32, or not, is within it)."""
    @_derandomized(max_examples)
    @given(n=st.integers(1, 8), hidden=st.sampled_from([8, 32]), intermediate=st.sampled_from([16, 48]),
           bias=st.booleans(), seed=st.integers(0, 2**16))
    def run(n, hidden, intermediate, bias, seed):
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP

        g = torch.Generator().manual_seed(seed)
        config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, mlp_bias=bias, hidden_act="silu",
                             num_attention_heads=1, num_key_value_heads=1)
        ref, ours = LlamaMLP(config).to(torch.float64), MLP(hidden, intermediate, bias=bias).to(torch.float64)
        at = f"{EX} (MLP, {dtype}): MLP({hidden}, {intermediate}, bias={bias}) on x ({n}, {hidden}) (seed {seed})"
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
            ours.load_state_dict(ref.state_dict())
            ref, ours = ref.to(dtype), ours.to(dtype)
            x = (torch.randn(n, hidden, generator=g, dtype=torch.float64)).to(dtype)
            want = ref(x.clone())
            with graded("mlp"), your_code(at):
                got = ours(x.clone())
        _shape_and_dtype(at, got, x.shape, dtype)
        atol, rtol = MLP_TOL[dtype]
        if _close(got, want, atol, rtol):
            return
        with torch.no_grad():
            swapped = ref.down_proj(F.silu(ref.up_proj(x)) * ref.gate_proj(x))
        hint = (" SiLU was applied to up_proj(x): it belongs on gate_proj(x), which then multiplies up_proj(x)."
                if _close(got, swapped, atol, rtol) else "")
        raise AssertionError(f"{at}: differs from transformers' LlamaMLP, down(silu(gate(x)) * up(x)), beyond atol "
                             f"{atol:g} + rtol {rtol:g}; {_where_largest(got, want)}.{hint}")
    run()


@pytest.mark.ch02
@pytest.mark.ch02_ex3
@_group("mlp")
@pytest.mark.parametrize("dtype", list(MLP_TOL), ids=str)
def test_ch02_ex3_mlp_equals_transformers(dtype):
    check_mlp(dtype)


# --- attention with grouped-query heads ------------------------------------------------------------
KINDS = ("llama", "qwen2", "qwen3")  # Qwen2: q/k/v biases; Qwen3: q/k norms
HIDDEN = 48  # a multiple of every head count drawn (transformers checks)
ATOL = 1e-10  # float64, with transformers' arithmetic in the other parts: rounding is ~1e-15


class _GraderBackend:
    """The attention backend the layer calls, as the engine's do (`attn(layer_idx, q, k, v)`): checks
    the interface (the layer's own index; q `[N, num_heads, head_dim]`, k and v `[N, num_kv_heads,
    head_dim]`, the model's dtype), then causal grouped-query attention over the call's tokens with
    torch's `scaled_dot_product_attention` (K/V head j serves query heads `j * groups .. + groups - 1`)."""

    def __init__(self, at: str, layer: Attention):
        self.at, self.layer, self.calls = at, layer, 0

    def __call__(self, layer_idx, q, k, v):
        self.calls += 1
        at, layer = self.at, self.layer
        _expect(layer_idx == layer.layer_idx, f"{at}: attn was called with layer_idx {layer_idx!r}: pass "
                f"self.layer_idx ({layer.layer_idx}), which the backend uses to keep each layer's K/V apart")
        n = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() else None
        groups = layer.num_heads // layer.num_kv_heads
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (q, k, v)]
        want_q, want_kv = (n, layer.num_heads, layer.head_dim), (n, layer.num_kv_heads, layer.head_dim)
        _expect(shapes[0] == want_q, f"{at}: attn takes q as [N, num_heads, head_dim] = {list(want_q)}, got "
                f"{shapes[0]}")
        _expect(shapes[1] == shapes[2] == want_kv, f"{at}: attn takes k and v as [N, num_kv_heads, head_dim] = "
                f"{list(want_kv)}, got k {shapes[1]} and v {shapes[2]}. Grouped-query attention: the KV cache "
                f"stores num_kv_heads heads, and the backend lets query head h read K/V head h // {groups}; do not "
                "repeat the K/V heads yourself")
        dtype = layer.o_proj.weight.dtype
        _expect(q.dtype == k.dtype == v.dtype == dtype, f"{at}: q, k, v should be in the model's dtype {dtype}, got "
                f"{q.dtype}, {k.dtype}, {v.dtype}")
        heads = [t.repeat_interleave(r, dim=1).transpose(0, 1) for t, r in ((q, 1), (k, groups), (v, groups))]
        out = F.scaled_dot_product_attention(*heads, is_causal=True, scale=layer.head_dim ** -0.5)
        return out.transpose(0, 1)


def _tiny_pair(kind: str, seed: int, **overrides):
    """transformers' tiny `kind` model (float64, SDPA attention, every weight random: biases and norm
    weights too) and ours, built from the same config, with the same weights."""
    from transformers import AutoModelForCausalLM

    from minivllm.course.testing import tiny_config
    from minivllm.model_executor.models.llama import MODEL_REGISTRY

    config = tiny_config(kind, **overrides)
    config._attn_implementation = "sdpa"  # in float64 throughout (eager takes its softmax in float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    ours = MODEL_REGISTRY[kind](config).to(torch.float64)
    ours.load_state_dict(hf.state_dict(), strict=False)
    return hf, ours


def _causal_mask(n: int) -> torch.Tensor:
    return torch.full((n, n), -math.inf, dtype=torch.float64).triu(1)[None, None]


def check_attention(kind: str, max_examples: int = 12) -> None:
    """One attention layer against transformers' (Llama's, Qwen2's or Qwen3's attention module, SDPA,
    with a causal mask) on the same weights and input, at random head counts (grouped-query: 1 or 2
    K/V heads, 1 to 3 query heads each), head sizes and starting positions (some ending at the
    model's last position: a layer that shifts every position by a constant computes the same scores,
    but runs off the rotary table there), float64 to 1e-10; the backend checks what the layer hands
    it (see `_GraderBackend`). Then again with the q, k and v
    projections fused into one (`fuse_qkv_projections`, as the engine does on a CPU): the heads must
    come from `self.qkv`."""
    from minivllm.model_executor.models.fused_qkv import fuse_qkv_projections

    @_derandomized(max_examples)
    @given(n=st.integers(1, 9), num_kv_heads=st.sampled_from([1, 2]), groups=st.integers(1, 3),
           head_dim=st.sampled_from([8, 16]), start=st.integers(0, 40), at_the_end=st.booleans(), bias=st.booleans(),
           seed=st.integers(0, 2**16))
    @example(n=3, num_kv_heads=1, groups=2, head_dim=8, start=0, at_the_end=True, bias=False, seed=0)
    def run(n, num_kv_heads, groups, head_dim, start, at_the_end, bias, seed):
        heads = num_kv_heads * groups
        hf, ours = _tiny_pair(kind, seed, num_hidden_layers=1, hidden_size=HIDDEN, num_attention_heads=heads,
                              num_key_value_heads=num_kv_heads, head_dim=head_dim,
                              **({"attention_bias": bias} if kind == "llama" else {}))
        if at_the_end:  # the last n positions the model has
            start = hf.config.max_position_embeddings - n
        ref, layer = hf.model.layers[0].self_attn, ours.model.layers[0].self_attn
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, HIDDEN, generator=g, dtype=torch.float64)
        positions = torch.arange(start, start + n)
        at = (f"{EX} (attention, {kind}): {heads} query heads, {num_kv_heads} K/V heads of {head_dim}, "
              f"{'with' if bias and kind == 'llama' else 'no'} bias, {n} tokens at positions {start}..{start + n - 1} "
              f"(seed {seed})")
        with torch.no_grad():
            want = ref(x[None], position_embeddings=hf.model.rotary_emb(x[None], positions[None]),
                       attention_mask=_causal_mask(n))[0][0]
            for fused in (False, True):
                where = at + (" with q, k, v fused into one projection (fuse_qkv_projections)" if fused else "")
                if fused:
                    fuse_qkv_projections(ours)
                    layer = ours.model.layers[0].self_attn
                backend = _GraderBackend(where, layer)
                with graded("attention"), your_code(where):
                    try:
                        got = layer(positions, x.clone(), backend)
                    except AttributeError as e:
                        if not fused:
                            raise
                        raise AssertionError(f"{where}: your forward raised AttributeError: {e}. The engine fuses "
                                             "q_proj, k_proj and v_proj into one (chapter 02's appendix): take the "
                                             "heads from self.qkv(hidden), which the fused layer overrides") from e
                _expect(backend.calls == 1, f"{where}: the layer called attn {backend.calls} times; it calls the "
                        "backend once, with all its heads")
                _shape_and_dtype(where, got, x.shape, torch.float64)
                _expect(_close(got, want, ATOL, ATOL), f"{where}: differs from transformers' attention beyond "
                        f"{ATOL:g}; {_where_largest(got, want)} (index [token, hidden])")
    run()


@pytest.mark.ch02
@pytest.mark.ch02_ex3
@_group("attention")
@pytest.mark.parametrize("kind", KINDS)
def test_ch02_ex3_attention_equals_transformers(kind):
    check_attention(kind)


# --- each part inside the decoder, and the whole, against transformers' logits ---------------------
@pytest.fixture(scope="module")
def ch02_models(tmp_path_factory):
    """A tiny float64 Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms), saved."""
    from minivllm.course.testing import make_tiny_model

    out = {}
    for kind in KINDS:
        folder = tmp_path_factory.mktemp(f"grading-ch02-{kind}")
        out[kind] = (folder, make_tiny_model(folder, kind, seed=2))
    return out


NORM_LOGITS_ATOL = 1e-6  # float64 model, float32 norm statistics: another valid float32 formula moves logits ~1e-7


def check_decoder(part: str, kind: str, folder, hf) -> None:
    """The decoder loaded from `folder` with `part` the package's (the grader's stand-ins for the
    others; "whole": every part the package's) gives transformers' logits on 24 tokens at positions
    0..23, and again at the model's last 24 positions (float64): to 1e-10, or 1e-6 where the package's
    RMSNorm runs (float32 statistics). The whole runs again with q, k and v fused, as the engine runs
    it on a CPU. (Rotary embedding depends only on the distance between positions, so a layer that
    shifts every position by a constant gives the same logits at 0..23; at the last positions it runs
    off the rotary table.)"""
    from minivllm.model_executor.models.fused_qkv import fuse_qkv_projections

    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(4))
    atol = NORM_LOGITS_ATOL if part in ("norm", "whole") else ATOL
    last = hf.config.max_position_embeddings
    for positions in (torch.arange(24), torch.arange(last - 24, last)):
        with torch.no_grad():
            want = hf(ids[None], position_ids=positions[None]).logits[0]
        for fused in ((False, True) if part == "whole" else (False,)):
            at = (f"{EX} ({'the whole decoder' if part == 'whole' else part + ' in the decoder'}): a tiny float64 "
                  f"{kind}{' with q, k, v fused' if fused else ''}, 24 tokens at positions {positions[0]}..{positions[-1]}"
                  f" (the model has {last})")
            with graded(part), torch.no_grad(), your_code(at):
                model = load_model(folder, dtype=torch.float64)
                if fused:
                    fuse_qkv_projections(model)
                scale = model.model.layers[0].self_attn.scale
                got = model.compute_logits(model(ids, positions, CausalAttention(scale)))
            _shape_and_dtype(at, got, want.shape, torch.float64)
            _expect(_close(got, want, atol, 0), f"{at}: the logits differ from transformers' beyond {atol:g}; "
                    f"{_where_largest(got, want)} (index [token, vocab])")


@pytest.mark.ch02
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("part", [pytest.param(part, marks=[pytest.mark.ch02_ex3, _group(part)], id=part)
                                  for part in PART_GROUP])
def test_ch02_ex3_decoder_logits_equal_transformers(part, kind, ch02_models):
    check_decoder(part, kind, *ch02_models[kind])


# --- plausible wrong answers lose their part's points (not graded: they check the graders) ---------
def _norm_without_eps(self, x):
    h = x.to(torch.float32)
    return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))).to(x.dtype)


def _norm_of_the_mean(self, x):  # divides by sqrt(mean(x) + eps): the mean, not the mean of squares
    h = x.to(torch.float32)
    return self.weight * (h * torch.rsqrt(h.mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _rope_adjacent_pairs(self, positions, q, k):
    half = self.head_dim // 2
    cos, sin = (t[positions, :half].to(q.dtype)[:, None, :] for t in (self.cos, self.sin))

    def rotate(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)

    return rotate(q), rotate(k)


def _kv_heads_tiled(self, positions, hidden, attn):  # K/V heads repeated 0, 1, 0, 1 (not 0, 0, 1, 1)
    q, k, v = self.qkv(hidden)
    if self.qk_norm:
        q, k = self.q_norm(q), self.k_norm(k)
    q, k = self.rotary[0](positions, q, k)
    groups = self.num_heads // self.num_kv_heads
    o = attn(self.layer_idx, q, k.repeat(1, groups, 1), v.repeat(1, groups, 1))
    return self.o_proj(o.reshape(hidden.shape[0], -1))


def _qk_norm_after_rope(self, positions, hidden, attn):
    q, k, v = self.qkv(hidden)
    q, k = self.rotary[0](positions, q, k)
    if self.qk_norm:
        q, k = self.q_norm(q), self.k_norm(k)
    return self.o_proj(attn(self.layer_idx, q, k, v).reshape(hidden.shape[0], -1))


def _silu_on_up(self, x):
    return self.down_proj(F.silu(self.up_proj(x)) * self.gate_proj(x))


def _attention_positions_shifted(self, positions, hidden, attn):  # every position one further: same scores
    return _grader_attention(self, positions + 1, hidden, attn)


def _layer_positions_shifted(self, positions, hidden, attn):  # the layer hands its attention positions + 1
    return _grader_layer(self, positions + 1, hidden, attn)


def _residual_after_the_norm(self, positions, hidden, attn):  # the residual stream is the normalised one
    hidden = self.input_layernorm(hidden)
    hidden = hidden + self.self_attn(positions, hidden, attn)
    hidden = self.post_attention_layernorm(hidden)
    return hidden + self.mlp(hidden)


WRONG_ANSWERS = [("norm", RMSNorm, "forward", _norm_without_eps), ("norm", RMSNorm, "forward", _norm_of_the_mean),
                 ("rope", RotaryEmbedding, "forward", _rope_adjacent_pairs),
                 ("attention", Attention, "forward", _kv_heads_tiled),
                 ("attention", Attention, "forward", _qk_norm_after_rope),
                 ("attention", Attention, "forward", _attention_positions_shifted), ("mlp", MLP, "forward", _silu_on_up),
                 ("layer", DecoderLayer, "forward", _residual_after_the_norm),
                 ("layer", DecoderLayer, "forward", _layer_positions_shifted)]


@pytest.mark.parametrize("part, cls, name, wrong",
                         [pytest.param(*w, id=w[3].__name__.strip("_")) for w in WRONG_ANSWERS])
def test_ch02_ex3_wrong_answers_lose_their_part(part, cls, name, wrong, ch02_models, monkeypatch):
    """Each wrong answer, put in place of the package's method, fails a check of the part it gets
    wrong (its unit check against transformers, or its part inside the tiny decoders), so it loses that
    part's points; the grader's stand-ins run the other parts."""
    monkeypatch.setattr(cls, name, wrong)
    unit = {"norm": lambda: check_rms_norm(torch.float64, 6), "rope": lambda: check_rope(torch.float64, 6),
            "attention": lambda: [check_attention(kind, 6) for kind in KINDS],
            "mlp": lambda: check_mlp(torch.float64, 6), "layer": lambda: None}[part]
    checks = [unit] + [lambda kind=kind: check_decoder(part, kind, *ch02_models[kind]) for kind in KINDS]
    failures = failed_checks(checks)
    assert failures, f"{wrong.__name__}: a wrong {part} passed every check of its part"
    assert all(f.startswith(EX) for f in failures), failures
