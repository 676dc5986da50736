"""Grading tests for chapter 02's rebuild exercises (`python -m minivllm.course.grade ch02_ex3`, or `pytest -m ch02_ex3`).

ch02_ex3 (`RMSNorm.forward`), ch02_ex4 (`RotaryEmbedding.forward`) and ch02_ex5 (`MLP.forward`) are
graded in the package itself: in a student edition they are the student's code, exported from the
chapter (stubs until filled), and there is no reference to compare with. The oracle is transformers:
`LlamaRMSNorm`, `apply_rotary_pos_emb` and `LlamaMLP` on the same inputs and weights, then a tiny
float64 Llama and Qwen3 whose logits must equal transformers'. Each exercise is graded alone: in the
model tests the other two pieces are the grader's stand-ins (`graded`), so a filled region passes
whatever state the others are in.

Dtypes: float64 and float32 (tolerances of float32 statistics), bfloat16 and float16 (where the
order of RMSNorm's cast shows: Llama casts the normalised vector back to the input dtype *before*
the weight multiplies it, which changes about a quarter of the 16-bit results).
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.model_executor.models.llama import MLP, RMSNorm, RotaryEmbedding
from minivllm.model_executor.model_loader import load_model
from minivllm.baselines.naive import CausalAttention


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _where_largest(got: torch.Tensor, want: torch.Tensor) -> str:
    """The largest difference, where it is, and the two values there."""
    diff = (got.double() - want.double()).abs()
    i = tuple(int(j) for j in torch.unravel_index(diff.argmax(), diff.shape))
    return (f"largest difference {diff.max().item():.3g} at index {list(i)} (got {got[i].item():.6g}, "
            f"expected {want[i].item():.6g})")


def _close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> bool:
    return bool(((got.double() - want.double()).abs() <= atol + rtol * want.double().abs()).all())


# --- the grader's stand-ins (transformers' arithmetic), for the pieces an exercise is not about ----
def _rms_norm_stand_in(self, x: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight * h.to(x.dtype)


def _rope_stand_in(self, positions, q, k):
    half = self.head_dim // 2
    cos, sin = (t[positions, :half].to(q.dtype)[:, None, :] for t in (self.cos, self.sin))

    def rotate(x):
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return rotate(q), rotate(k)


def _mlp_stand_in(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


STAND_INS = {"ch02_ex3": (RMSNorm, _rms_norm_stand_in), "ch02_ex4": (RotaryEmbedding, _rope_stand_in),
             "ch02_ex5": (MLP, _mlp_stand_in)}


@contextmanager
def graded(ex: str | None):
    """The package's (the student's) piece for `ex`, the grader's stand-ins for the other pieces of
    chapter 02 (None: stand-ins for all three; other chapters' graders use that to run the model)."""
    with ExitStack() as stack:
        for other, (cls, fn) in STAND_INS.items():
            if other != ex:
                stack.enter_context(pytest.MonkeyPatch.context()).setattr(cls, "forward", fn)
        yield


def _params(exercises):
    return [pytest.param(ex, marks=getattr(pytest.mark, ex), id=ex) for ex in exercises]


# --- ch02_ex3: RMSNorm -----------------------------------------------------------------------------
SIXTEEN_BIT = (torch.bfloat16, torch.float16)
MAX_DIFFERING = 0.02  # 16-bit: at most this share of elements may differ from transformers by one unit


@pytest.mark.ch02
@pytest.mark.ch02_ex3
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 12), hidden=st.sampled_from([16, 64, 96]), eps=st.sampled_from([1e-6, 1e-5]),
       scale=st.sampled_from([0.01, 1.0, 30.0]), seed=st.integers(0, 2**16))
def test_ch02_ex3_rms_norm_equals_transformers(dtype, n, hidden, eps, scale, seed):
    """`RMSNorm(hidden, eps)` with a random weight against transformers' `LlamaRMSNorm`. float64 and
    float32: to 1e-6 relative (the statistics are taken in float32, whose rounding is 6e-8; any order
    of float32 or float64 arithmetic fits). bfloat16 and float16: each element within one unit of the
    last place, and at most 2% of them off by that unit (another valid float32 formula moves about
    0.01%; the weight multiplied before the cast back moves about 25%)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(seed)
    rows = max(n, 1024 // hidden) if dtype in SIXTEEN_BIT else n  # enough elements to count the share
    x = (torch.randn(rows, hidden, generator=g, dtype=torch.float64) * scale).to(dtype)
    weight = (torch.randn(hidden, generator=g, dtype=torch.float64) * 0.5 + 1).to(dtype)
    ref, ours = LlamaRMSNorm(hidden, eps=eps).to(dtype), RMSNorm(hidden, eps=eps).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(weight)
        ours.weight.copy_(weight)
        want, got = ref(x), ours(x)
    at = f"ch02_ex3 ({dtype}): RMSNorm({hidden}, eps={eps}) on x of shape {tuple(x.shape)} (seed {seed})"
    _expect(isinstance(got, torch.Tensor) and got.shape == x.shape and got.dtype == dtype,
            f"{at}: expected a tensor of shape {tuple(x.shape)} and dtype {dtype} (x's), got "
            f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}"
            f"{' ' + str(got.dtype) if isinstance(got, torch.Tensor) else ''}")
    if dtype not in SIXTEEN_BIT:
        _expect(_close(got, want, 1e-6 * scale, 1e-6), f"{at}: differs from transformers' LlamaRMSNorm beyond "
                f"float32 rounding; {_where_largest(got, want)}")
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
            f"{at}: RMSNorm's cast is in the wrong place: your result is weight * normalised x rounded once to "
            f"{dtype} (the weight multiplied before casting back). Llama, and transformers, cast the normalised x "
            f"back to x's dtype first, then multiply by the weight (two roundings); {int(differ.sum())} of "
            f"{differ.numel()} elements differ from LlamaRMSNorm, {_where_largest(got, want)}")
    raise AssertionError(f"{at}: {int(differ.sum())} of {differ.numel()} elements differ from transformers' "
                         f"LlamaRMSNorm ({'all' if within else 'some by more than'} one unit in the last place; "
                         f"at most {MAX_DIFFERING:.0%} may differ by one unit); {_where_largest(got, want)}. "
                         "Take the statistics in float32 (STATS_DTYPE) and mind the order of the cast")


# --- ch02_ex4: RoPE --------------------------------------------------------------------------------
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


@pytest.mark.ch02
@pytest.mark.ch02_ex4
@pytest.mark.parametrize("dtype", list(ROPE_TOL), ids=str)
@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 10), num_kv_heads=st.sampled_from([1, 2]), groups=st.sampled_from([1, 3]),
       head_dim=st.sampled_from([2, 8, 32]), base=st.sampled_from([10000.0, 1e6]), seed=st.integers(0, 2**16))
def test_ch02_ex4_rope_equals_transformers(dtype, n, num_kv_heads, groups, head_dim, base, seed):
    """`RotaryEmbedding.forward(positions, q, k)` at random positions against transformers'
    `apply_rotary_pos_emb` with the same cos/sin rows (the table is given): float64 to 1e-12 (the
    same products), float32 to 1e-5, bfloat16 to 3e-2 + 2% (transformers rounds each product in
    bfloat16; float32 arithmetic cast once is as good)."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(1, MAX_POSITION, (n,), generator=g)
    q = (torch.randn(n, num_kv_heads * groups, head_dim, generator=g, dtype=torch.float64)).to(dtype)
    k = (torch.randn(n, num_kv_heads, head_dim, generator=g, dtype=torch.float64)).to(dtype)
    rope = RotaryEmbedding(head_dim, MAX_POSITION, base)
    (want_q, want_k), mistakes = _rope_candidates(rope, positions, q, k)
    with torch.no_grad():
        got = rope(positions, q.clone(), k.clone())
    at = (f"ch02_ex4 ({dtype}): RotaryEmbedding(head_dim={head_dim}, base={base:g}) at positions "
          f"{positions.tolist()}, q {tuple(q.shape)}, k {tuple(k.shape)} (seed {seed})")
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


# --- ch02_ex5: the MLP -----------------------------------------------------------------------------
MLP_TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.ch02
@pytest.mark.ch02_ex5
@pytest.mark.parametrize("dtype", list(MLP_TOL), ids=str)
@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 8), hidden=st.sampled_from([8, 32]), intermediate=st.sampled_from([16, 48]),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_ch02_ex5_mlp_equals_transformers(dtype, n, hidden, intermediate, bias, seed):
    """`MLP(hidden, intermediate, bias)` against transformers' `LlamaMLP` with the same weights:
    float64 to 1e-12, float32 to 1e-5, bfloat16 to 2e-2 + 2% (SiLU in float32, or not, is within it)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    g = torch.Generator().manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, mlp_bias=bias, hidden_act="silu",
                         num_attention_heads=1, num_key_value_heads=1)
    ref, ours = LlamaMLP(config).to(torch.float64), MLP(hidden, intermediate, bias=bias).to(torch.float64)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
        ours.load_state_dict(ref.state_dict())
        ref, ours = ref.to(dtype), ours.to(dtype)
        x = (torch.randn(n, hidden, generator=g, dtype=torch.float64)).to(dtype)
        want, got = ref(x.clone()), ours(x.clone())
    at = f"ch02_ex5 ({dtype}): MLP({hidden}, {intermediate}, bias={bias}) on x {tuple(x.shape)} (seed {seed})"
    _expect(isinstance(got, torch.Tensor) and got.shape == x.shape and got.dtype == dtype,
            f"{at}: expected a tensor of shape {tuple(x.shape)} and dtype {dtype}, got "
            f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}"
            f"{' ' + str(got.dtype) if isinstance(got, torch.Tensor) else ''}")
    atol, rtol = MLP_TOL[dtype]
    if _close(got, want, atol, rtol):
        return
    with torch.no_grad():
        swapped = ref.down_proj(F.silu(ref.up_proj(x)) * ref.gate_proj(x))
    hint = (" SiLU was applied to up_proj(x): it belongs on gate_proj(x), which then multiplies up_proj(x)."
            if _close(got, swapped, atol, rtol) else "")
    raise AssertionError(f"{at}: differs from transformers' LlamaMLP, down(silu(gate(x)) * up(x)), beyond atol "
                         f"{atol:g} + rtol {rtol:g}; {_where_largest(got, want)}.{hint}")


# --- each piece inside the decoder, against transformers' logits -----------------------------------
@pytest.fixture(scope="module")
def ch02_models(tmp_path_factory):
    """A tiny float64 Llama and Qwen3 (Qwen3 normalises each q/k head with RMSNorm too), saved."""
    from minivllm.course.testing import make_tiny_model

    out = {}
    for kind in ("llama", "qwen3"):
        folder = tmp_path_factory.mktemp(f"grading-ch02-{kind}")
        out[kind] = (folder, make_tiny_model(folder, kind, seed=2))
    return out


LOGITS_ATOL = 1e-6  # float64 model, float32 norm statistics: another valid float32 formula moves logits ~1e-7


@pytest.mark.ch02
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("ex", _params(STAND_INS))
def test_ch02_decoder_logits_equal_transformers(ex, kind, ch02_models):
    """The decoder with the exercise's piece (the grader's stand-ins for the others) gives transformers'
    logits on 24 tokens at positions 0..23 (float64)."""
    folder, hf = ch02_models[kind]
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    with graded(ex), torch.no_grad():
        model = load_model(folder, dtype=torch.float64)
        scale = model.model.layers[0].self_attn.scale
        got = model.compute_logits(model(ids, torch.arange(len(ids)), CausalAttention(scale)))
    _expect(_close(got, want, LOGITS_ATOL, 0), f"{ex}: a tiny {kind} decoder with your code gives logits that "
            f"differ from transformers' beyond {LOGITS_ATOL:g}; {_where_largest(got, want)} (index [token, vocab])")
