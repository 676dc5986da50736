"""Chapter 13's grader, the part that runs inside the rank processes (a module, so that fresh rank
interpreters can import it by name): the checks each rank makes, and the grader's own stand-ins for the
chapter's regions (used for the exercises not under grading, also inside the ranks)."""
from __future__ import annotations

from contextlib import ExitStack

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model_executor import tensor_parallel as tpm
from minivllm.model_executor.layers import parallel_linear as pl
from minivllm.model_executor.layers import vocab_parallel_embedding as vpe


# --- the grader's stand-ins ----------------------------------------------------------------------
def _col_init(self, in_features, out_features, bias, tp, num_replicas=1):
    groups = tp.size // num_replicas
    if out_features % groups:
        raise ValueError(f"out_features={out_features} is not divisible by tensor_parallel_size={groups}")
    nn.Linear.__init__(self, in_features, out_features // groups, bias=bias)
    self.num_shards, self.shard, self.full_out_features = groups, tp.rank // num_replicas, out_features


def _col_load(self, name, loaded):
    n = self.weight.shape[0]
    target = self.weight if name == "weight" else self.bias
    with torch.no_grad():
        target.copy_(loaded[self.shard * n:(self.shard + 1) * n])
    return [target]


def _row_init(self, in_features, out_features, bias, tp):
    if in_features % tp.size:
        raise ValueError(f"in_features={in_features} is not divisible by tensor_parallel_size={tp.size}")
    nn.Module.__init__(self)
    self.tp, self.full_in_features = tp, in_features
    self.local = nn.Linear(in_features // tp.size, out_features, bias=False)
    self.bias = None if not bias else nn.Parameter(torch.zeros(out_features))


def _row_forward(self, x):
    partial = F.linear(x, self.local.weight) if isinstance(self.local, nn.Linear) else self.local(x)
    if self.tp.rank == 0 and self.bias is not None:
        partial = partial + self.bias  # added on one rank before the sum: counted once
    return self.tp.all_reduce(partial)


def _row_load(self, name, loaded):
    if name == "bias":
        with torch.no_grad():
            self.bias.copy_(loaded[:])
        return [self.bias]
    n = self.local.weight.shape[1]
    with torch.no_grad():
        self.local.weight.copy_(loaded[:, self.tp.rank * n:(self.tp.rank + 1) * n])
    return [self.local.weight]


def _emb_forward(self, ids):
    mine = (ids >= self.start) & (ids < self.end)
    out = torch.zeros(*ids.shape, self.weight.shape[1], dtype=self.weight.dtype, device=self.weight.device)
    out[mine] = self.weight[ids[mine] - self.start]
    return self.tp.all_reduce(out)


def _emb_load(self, name, loaded):
    rows = max(0, min(self.end, self.vocab_size) - self.start)
    with torch.no_grad():
        self.weight.fill_(0)
        if rows:
            self.weight[:rows] = loaded[self.start:self.start + rows]
    return [self.weight]


def _head_forward(self, hidden):
    local = hidden @ self.weight.T
    if self.tp.size == 1:
        return local[..., :self.vocab_size]
    gathered = self.tp.gather(local)
    return gathered[..., :self.vocab_size] if self.tp.rank == 0 else gathered


def _kv_head_replicas(num_kv_heads, tp_size):
    return max(1, tp_size // num_kv_heads)


def _parallelize_attention(model, tp):
    """The grader's split of the attention projections (the rest as the book's `parallelize` does)."""
    h = model.config.hidden_size
    for layer in model.model.layers:
        a = layer.self_attn
        rep = tpm.kv_head_replicas(a.num_kv_heads, tp.size)
        has_bias = a.q_proj.bias is not None
        kv_out = a.num_kv_heads * a.head_dim
        a.q_proj = tpm.ColumnParallelLinear(h, a.num_heads * a.head_dim, has_bias, tp)
        a.k_proj, a.v_proj = (tpm.ColumnParallelLinear(h, kv_out, has_bias, tp, rep) for _ in range(2))
        a.o_proj = tpm.RowParallelLinear(a.num_heads * a.head_dim, h, a.o_proj.bias is not None, tp)
        a.num_heads, a.num_kv_heads = a.num_heads // tp.size, max(1, a.num_kv_heads // tp.size)
    return model


def _grader_parallelize(model, tp):
    tpm.check_tensor_parallel(model.config, tp.size)
    _parallelize_attention(model, tp)
    c, h = model.config, model.config.hidden_size
    for layer in model.model.layers:
        m, has_bias = layer.mlp, layer.mlp.gate_proj.bias is not None
        m.gate_proj = tpm.ColumnParallelLinear(h, c.intermediate_size, has_bias, tp)
        m.up_proj = tpm.ColumnParallelLinear(h, c.intermediate_size, has_bias, tp)
        m.down_proj = tpm.RowParallelLinear(c.intermediate_size, h, has_bias, tp)
    emb = model.model.embed_tokens = tpm.VocabParallelEmbedding(c.vocab_size, h, tp)
    model.lm_head = tpm.ParallelLMHead(c.vocab_size, h, tp, emb if getattr(c, "tie_word_embeddings", False) else None)
    model.tp_group = tp
    return model


STAND_INS = {
    "ch13_ex1": [(pl.ColumnParallelLinear, "__init__", _col_init), (pl.ColumnParallelLinear, "load_shard", _col_load),
                 (pl.RowParallelLinear, "__init__", _row_init), (pl.RowParallelLinear, "forward", _row_forward),
                 (pl.RowParallelLinear, "load_shard", _row_load)],
    "ch13_ex2": [(vpe.VocabParallelEmbedding, "forward", _emb_forward), (vpe.VocabParallelEmbedding, "load_shard", _emb_load),
                 (vpe.ParallelLMHead, "forward", _head_forward), (vpe.ParallelLMHead, "load_shard", _emb_load)],
    "ch13_ex3": [(tpm, "kv_head_replicas", _kv_head_replicas), (tpm, "parallelize", _grader_parallelize)],
}


def with_stand_ins(others: list[str]) -> ExitStack:
    """Inside a rank: the grader's stand-ins for `others` (this chapter's exercises not under grading, and
    the regions an edition released in other chapters, through `stand_ins.stand_ins_for`)."""
    from stand_ins import stand_ins_for

    stack = ExitStack()
    stack.enter_context(stand_ins_for(others))
    return stack


# --- what each rank checks -----------------------------------------------------------------------
def _safetensors_slice(folder, name: str, tensor: torch.Tensor):
    """`tensor` saved to a file and opened again as a lazy safetensors slice (what the loader hands a layer)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = f"{folder}/{name}.safetensors"
    save_file({name: tensor.contiguous()}, path)
    with safe_open(path, framework="pt") as f:
        return f.get_slice(name)


def ex1_linear(tp, seed: int, shapes: list[tuple[int, int, bool, int]], folder: str, others: list[str]) -> list[dict]:
    """For each `(in, out, bias, replicas)`: a column-parallel layer (loaded from a safetensors slice) and a
    row-parallel layer after it (loaded from tensors), against the whole float64 layers."""
    results = []
    with with_stand_ins(others):
        for i, (n_in, n_out, bias, replicas) in enumerate(shapes):
            g = torch.Generator().manual_seed(seed + i)
            rand = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
            w1, b1, w2, b2, x = rand(n_out, n_in), rand(n_out), rand(n_in, n_out), rand(n_in), rand(3, n_in)
            col = pl.ColumnParallelLinear(n_in, n_out, bias, tp, replicas).double()
            row = pl.RowParallelLinear(n_out, n_in, bias, tp).double()
            col.load_shard("weight", _safetensors_slice(folder, f"w1_{tp.rank}_{i}", w1))
            row.load_shard("weight", w2)
            if bias:
                col.load_shard("bias", _safetensors_slice(folder, f"b1_{tp.rank}_{i}", b1))
                row.load_shard("bias", b2)
            full = x @ w1.T + (b1 if bias else 0)
            shards, shard = tp.size // replicas, tp.rank // replicas
            per = n_out // shards
            mine = full[:, shard * per:(shard + 1) * per]
            per_row = n_out // tp.size
            with torch.no_grad():
                got_col = col(x)
                got_row = row(full[:, tp.rank * per_row:(tp.rank + 1) * per_row])
            want_row = full @ w2.T + (b2 if bias else 0)
            results.append({"shape": tuple(got_col.shape), "want_shape": tuple(mine.shape),
                            "column": (got_col - mine).abs().max().item() if got_col.shape == mine.shape else None,
                            "row": (got_row - want_row).abs().max().item() if got_row.shape == want_row.shape else None})
    return results


def ex2_vocab(tp, seed: int, cases: list[tuple[int, int, bool]], others: list[str]) -> list[dict]:
    """For each `(vocab_size, hidden_size, tied)`: every id looked up, the logits of random hidden states."""
    results = []
    with with_stand_ins(others):
        for i, (vocab, hidden, tied) in enumerate(cases):
            g = torch.Generator().manual_seed(seed + i)
            emb_w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
            head_w = emb_w if tied else torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
            emb = vpe.VocabParallelEmbedding(vocab, hidden, tp).double()
            emb.load_shard("weight", emb_w)
            head = vpe.ParallelLMHead(vocab, hidden, tp, emb if tied else None).double()
            if not tied:
                head.load_shard("weight", head_w)
            ids, x = torch.randperm(vocab, generator=g), torch.randn(4, hidden, generator=g, dtype=torch.float64)
            with torch.no_grad():
                rows, logits = emb(ids), head(x)
            r = {"embedding": (rows - emb_w[ids]).abs().max().item(), "logits_shape": tuple(logits.shape),
                 "rows": emb.weight.shape[0], "shares": head.weight is emb.weight,
                 "padding_zero": bool((emb.weight[max(0, min(emb.end, vocab) - emb.start):] == 0).all())}
            if tp.rank == 0 and logits.shape == (4, vocab):
                r["logits"] = (logits - x @ head_w.T).abs().max().item()
            results.append(r)
    return results


def ex3_logits(tp, folder: str, token_ids: list[int], others: list[str]):
    """Rank 0's float64 logits of the sharded model in `folder` over `token_ids` (no cache)."""
    from minivllm.model_executor.models.llama import attention_reference

    with with_stand_ins(others):
        model = tpm.load_sharded_model(folder, torch.float64, "cpu", tp)
        ids, scale = torch.tensor(token_ids), model.model.layers[0].self_attn.scale
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, torch.arange(len(ids)),
                                                lambda i, q, k, v: attention_reference(q, k, v, scale)))
        heads = [(layer.self_attn.num_heads, layer.self_attn.num_kv_heads) for layer in model.model.layers]
    return (logits if tp.rank == 0 else None), heads
