"""Grading tests for chapter 13's rebuild exercises (`python -m minivllm.course.grade ch13_ex1`, or `pytest -m ch13_ex1`).

Graded in the package itself: in a student edition the regions are the student's code, exported from the
chapter (stubs until filled). The layers run on real gloo ranks (fresh processes, `run_on_ranks`); inside
each rank the grader's own stand-ins (`grading_ch13_ranks.STAND_INS`) replace the chapter's regions not
under grading, and the regions an edition released in other chapters. What is checked is the contract:
* ch13_ex1, "splits and refuses": each rank's weight shapes, a ValueError for a size that does not split;
  "equals nn.Linear": at 2 and 3 ranks, column-parallel slices (loaded from safetensors slices, replicated
  slices included) and the row-parallel output (partial sums all-reduced, the bias counted once) against
  the whole float64 layers.
* ch13_ex2, "looks up every id" and "gathers the logits": vocabularies that do not divide (padding rows
  zero), tied and untied heads, logits on rank 0 only (`[N, 0]` elsewhere).
* ch13_ex3, "heads per rank": `kv_head_replicas` and each rank's head counts for many shapes (on the meta
  device, no process needed); "equals transformers": the sharded tiny models' logits at 4 ranks with 2 KV
  heads (replicated) and 2 ranks with one KV head, against transformers' float64 logits.
"""
from __future__ import annotations

import re

import pytest
import torch

import grading_ch13_ranks as ranks
from minivllm.course.grade import EXERCISES as GRADED
from minivllm.distributed.parallel_state import run_on_ranks
from minivllm.model_executor import tensor_parallel as tpm
from minivllm.model_executor.layers import parallel_linear as pl
from minivllm.model_executor.layers.parallel_linear import TPGroup

STAND_INS = ranks.STAND_INS  # the format tests/stand_ins.py reads
SPLITS, EQUALS = (name for name, _ in GRADED["ch13_ex1"].groups)


@pytest.fixture
def others(request):
    """The exercises whose stand-ins a rank puts in place: this chapter's others, and what an edition
    released elsewhere (the rank processes do not inherit the parent's patches)."""
    from stand_ins import EXERCISE_ID, ROOT, released_elsewhere

    graded = {m.name for m in request.node.iter_markers() if EXERCISE_ID.fullmatch(m.name)}
    elsewhere = released_elsewhere(ROOT, request.config.getoption("markexpr", ""))
    return sorted((set(STAND_INS) - graded) | set(elsewhere))


def ranks_run(ex: str, fn, world_size: int, *args):
    """`run_on_ranks`, with a rank's failure reported as the student's: a stub's NotImplementedError raised
    again here with its own message (the task), anything else as the rank's traceback."""
    try:
        return run_on_ranks(fn, world_size, *args, timeout_s=180)
    except RuntimeError as e:
        stub = re.search(r"NotImplementedError: (ch\d\d_ex\d+: .+)", str(e))  # a course stub's, not torch's
        if stub:
            raise NotImplementedError(stub[1].strip()) from None
        raise AssertionError(f"{ex}: a rank failed:\n{e}") from None


def _with_patches(others):
    from stand_ins import stand_ins_for

    return stand_ins_for(others)


@pytest.mark.ch13
@pytest.mark.ch13_ex1
@pytest.mark.group(SPLITS)
def test_ex1_splits_and_refuses(others):
    with _with_patches(others):
        for size, rank, replicas in ((2, 1, 1), (3, 2, 1), (4, 3, 2)):
            col = pl.ColumnParallelLinear(6, 12, True, TPGroup(rank, size), replicas)
            assert tuple(col.weight.shape) == (12 // (size // replicas), 6), \
                f"ch13_ex1: ColumnParallelLinear(6, 12) at rank {rank} of {size}, {replicas} replicas: weight {tuple(col.weight.shape)}"
            row = pl.RowParallelLinear(12, 5, True, TPGroup(rank, 2 if size == 3 else size))
            assert tuple(row.bias.shape) == (5,), "ch13_ex1: the row-parallel bias is whole on every rank"
        for bad in (lambda: pl.ColumnParallelLinear(4, 6, False, TPGroup(0, 4)),
                    lambda: pl.RowParallelLinear(6, 4, False, TPGroup(0, 4))):
            with pytest.raises(ValueError):
                bad()


@pytest.mark.ch13
@pytest.mark.ch13_ex1
@pytest.mark.group(EQUALS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ex1_equals_nn_linear(world_size, others, tmp_path):
    shapes = [(6, 12, True, 1), (5, 6 * world_size, False, 1), (4, 6, True, world_size)]
    for rank, results in enumerate(ranks_run("ch13_ex1", ranks.ex1_linear, world_size, 7, shapes, str(tmp_path), others)):
        for shape, r in zip(shapes, results):
            assert r["shape"] == r["want_shape"], f"ch13_ex1: rank {rank}, layer {shape}: column output {r['shape']}, want {r['want_shape']}"
            assert r["column"] <= 1e-12, f"ch13_ex1: rank {rank}, layer {shape}: column slice off by {r['column']:.2e}"
            assert r["row"] is not None and r["row"] <= 1e-12, \
                f"ch13_ex1: rank {rank}, layer {shape}: row-parallel output off by {r['row']} (bias once, partials summed)"


@pytest.mark.ch13
@pytest.mark.ch13_ex2
@pytest.mark.parametrize("world_size", [2, 3])
def test_ex2_looks_up_every_id_and_gathers_the_logits(world_size, others):
    cases = [(100, 8, True), (77, 6, False), (200, 4, True)]
    results = ranks_run("ch13_ex2", ranks.ex2_vocab, world_size, 11, cases, others)
    for rank, per_case in enumerate(results):
        for (vocab, hidden, tied), r in zip(cases, per_case):
            what = f"ch13_ex2: vocabulary {vocab} over {world_size} ranks ({'tied' if tied else 'untied'}), rank {rank}"
            assert r["embedding"] <= 1e-12, f"{what}: embedding rows off by {r['embedding']:.2e}"
            assert r["padding_zero"], f"{what}: padding rows past the vocabulary must stay zero"
            assert r["shares"] == tied, f"{what}: a tied head shares the embedding's shard (and only then)"
            if rank == 0:
                assert r["logits_shape"] == (4, vocab) and r.get("logits", 1.0) <= 1e-12, \
                    f"{what}: logits {r['logits_shape']}, error {r.get('logits')}"
            else:
                assert r["logits_shape"] == (4, 0), f"{what}: only rank 0 holds logits, got {r['logits_shape']}"


@pytest.mark.ch13
@pytest.mark.ch13_ex3
def test_ex3_heads_per_rank(others):
    from minivllm.course.testing import tiny_config
    from minivllm.model_executor.models.llama import LlamaForCausalLM

    with _with_patches(others):
        for kv, tp, want in ((8, 2, 1), (8, 8, 1), (8, 16, 2), (2, 4, 2), (1, 4, 4), (3, 9, 3)):
            got = tpm.kv_head_replicas(kv, tp)
            assert got == want, f"ch13_ex3: kv_head_replicas({kv}, {tp}) = {got}, want {want}"
        for heads, kv, tp in ((4, 2, 2), (4, 2, 4), (8, 1, 2), (6, 3, 3)):
            config = tiny_config("llama", num_attention_heads=heads, num_key_value_heads=kv, hidden_size=8 * heads,
                                 intermediate_size=96)
            for rank in range(tp):
                with torch.device("meta"):
                    model = tpm.parallelize(LlamaForCausalLM(config), TPGroup(rank, tp))
                attn = model.model.layers[0].self_attn
                want = (heads // tp, max(1, kv // tp))
                assert (attn.num_heads, attn.num_kv_heads) == want, \
                    f"ch13_ex3: {heads} heads, {kv} KV heads, rank {rank} of {tp}: {(attn.num_heads, attn.num_kv_heads)}, want {want}"
                assert attn.k_proj.weight.shape[0] == want[1] * attn.head_dim, "ch13_ex3: k_proj holds the rank's KV heads"
        with pytest.raises(ValueError):
            tpm.parallelize(LlamaForCausalLM(tiny_config("llama")), TPGroup(0, 3))


@pytest.mark.ch13
@pytest.mark.ch13_ex3
@pytest.mark.parametrize("kind,world_size,overrides", [("llama", 4, {}), ("qwen2", 2, {"num_key_value_heads": 1})])
def test_ex3_equals_transformers(kind, world_size, overrides, others, tmp_path):
    from minivllm.course import testing

    hf = testing.make_tiny_model(tmp_path, kind, **overrides)
    ids = [5, 3, 9, 1, 7, 7, 2]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    logits, heads = ranks_run("ch13_ex3", ranks.ex3_logits, world_size, str(tmp_path), ids, others)[0]
    err = (logits - want).abs().max().item()
    assert err <= 1e-10, f"ch13_ex3: {kind} at {world_size} ranks ({heads[0]} heads per rank): logits off transformers' by {err:.2e}"
