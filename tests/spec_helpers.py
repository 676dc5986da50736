"""Helpers for chapter 14's tests (tests/test_spec_decode.py): invariants of an engine that verifies
drafts, a run loop that checks them after every step, chi-square p-values without scipy, and draft
models for tiny targets.

Plain functions, no fixtures (so nothing collides with conftest.py), as in engine_helpers.py.
"""
from __future__ import annotations

import torch

from engine_helpers import check_invariants, run_engine


def check_spec_invariants(engine) -> None:
    """`engine_helpers.check_invariants` for an engine with drafts.

    The one difference: a running sequence's block table may hold slots past its tokens, for its
    drafts and for the positions a draft model writes ahead (the scheduler's `num_lookahead_tokens`).
    Slots are taken when a step is scheduled (`num_tokens + k` for the verified row, `+ lookahead`
    past it) and kept, while `num_tokens` only grows, so at any time a table covers at most
    `num_tokens - 1 + k + lookahead` positions. Also: a sequence carries at most k drafts, waiting
    ones none; an idle engine holds no draft distributions (`model_runner.draft_probs`).
    """
    from minivllm.core.block_manager import BlockManager

    sched = engine.scheduler
    k, lookahead = sched.spec_decoding_stats.num_spec_tokens, sched.num_lookahead_tokens
    assert isinstance(sched.block_manager, BlockManager)
    check_invariants(engine, most_slots=lambda seq: min(seq.num_tokens - 1 + k + lookahead,
                                                        sched.max_seq_len + lookahead))
    for seq in sched.waiting:
        assert not seq.spec_token_ids, f"waiting {seq} keeps drafts {seq.spec_token_ids}"
    for seq in sched.running:
        assert len(seq.spec_token_ids) <= k, (seq, seq.spec_token_ids)
    if not sched.running and not sched.waiting:
        assert not engine.model_runner.draft_probs, "an idle engine keeps draft distributions"


def run_spec(engine, prompts, params, check=True) -> list:
    """`engine_helpers.run_engine` with `check_spec_invariants` after every step (`check=False`: after
    the last only, for the big statistical runs); the outputs in the prompts' order."""
    outputs = run_engine(engine, prompts, params, check=check_spec_invariants if check else lambda engine: None)
    check_spec_invariants(engine)
    return outputs


def chi_square_pvalue(observed, expected, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's chi-square goodness-of-fit test; returns `(p_value, degrees_of_freedom)`.

    `observed` (counts) and `expected` (counts with the same total) are sequences over the same cells.
    Cells whose expected count is below `min_expected` are pooled, smallest first, into one cell
    (with the next smallest too if the pool still falls short), the usual rule for the chi-square
    approximation. A cell expected never (0) but observed is an outright failure: p = 0.
    The p-value is the chi-square survival function, `Q(dof / 2, stat / 2)` (torch.special.gammaincc).
    """
    obs = torch.as_tensor(observed, dtype=torch.float64).flatten()
    exp = torch.as_tensor(expected, dtype=torch.float64).flatten()
    assert obs.shape == exp.shape and abs(float(obs.sum() - exp.sum())) < 1e-6 * float(exp.sum()) + 1e-9
    if bool(((exp == 0) & (obs > 0)).any()):
        return 0.0, -1
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    order = torch.argsort(exp)
    obs, exp = obs[order], exp[order]
    n_pool = int((exp < min_expected).sum())  # the cells expected too rarely, and more until the pool is not
    while 0 < n_pool < len(exp) and float(exp[:n_pool].sum()) < min_expected:
        n_pool += 1
    if n_pool > 1:
        obs = torch.cat([obs[:n_pool].sum()[None], obs[n_pool:]])
        exp = torch.cat([exp[:n_pool].sum()[None], exp[n_pool:]])
    dof = len(exp) - 1
    assert dof >= 1, "too few samples for a chi-square test"
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64))), dof


def perturbed_copy(model, folder, noise: float, seed: int):
    """Save in `folder` a copy of the transformers `model` with Gaussian noise of std `noise` added to
    every weight: a draft that mostly agrees with its target but not always (same vocabulary and
    config); returns the copy."""
    import copy

    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * noise)
    draft.save_pretrained(folder)
    return draft
