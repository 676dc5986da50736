"""Functions the tensor-parallel tests run on each rank (spawned processes find them by name)."""
from __future__ import annotations

import torch


def sharded_logits(tp, folder, token_ids: list[int]) -> torch.Tensor | None:
    """Rank `tp.rank`'s shard of the model in `folder` (float64), run over `token_ids` with causal
    attention and no cache; rank 0 returns the logits `[len, vocab]`, the others None."""
    from minivllm.model_executor.models.llama import attention_reference
    from minivllm.model_executor.tensor_parallel import load_sharded_model

    model = load_sharded_model(folder, torch.float64, "cpu", tp)
    ids = torch.tensor(token_ids)
    scale = model.model.layers[0].self_attn.scale
    attn = lambda i, q, k, v: attention_reference(q, k, v, scale)  # noqa: E731
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, torch.arange(len(ids)), attn))
    return logits if tp.rank == 0 else None


def linear_layers(tp, seed: int, in_features: int, out_features: int) -> dict:
    """Column- then row-parallel layers loaded from whole random weights (biases included), against
    `nn.Linear` on the same weights: returns the max abs differences seen on this rank."""
    from minivllm.model_executor.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear

    g = torch.Generator().manual_seed(seed)
    w1, b1 = torch.randn(out_features, in_features, generator=g, dtype=torch.float64), torch.randn(out_features, generator=g, dtype=torch.float64)
    w2, b2 = torch.randn(in_features, out_features, generator=g, dtype=torch.float64), torch.randn(in_features, generator=g, dtype=torch.float64)
    x = torch.randn(5, in_features, generator=g, dtype=torch.float64)
    col = ColumnParallelLinear(in_features, out_features, True, tp).double()
    row = RowParallelLinear(out_features, in_features, True, tp).double()
    for layer, w, b in ((col, w1, b1), (row, w2, b2)):
        layer.load_shard("weight", w)
        layer.load_shard("bias", b)
    ref_hidden = x @ w1.T + b1
    start = tp.rank * out_features // tp.size
    with torch.no_grad():
        hidden = col(x)
        out = row(hidden)
    return {"column": (hidden - ref_hidden[:, start:start + hidden.shape[1]]).abs().max().item(),
            "row": (out - (ref_hidden @ w2.T + b2)).abs().max().item(),
            "column_shape": tuple(hidden.shape)}


def vocab_layers(tp, seed: int, vocab_size: int, hidden_size: int, tied: bool) -> dict:
    """Vocab-parallel embedding and LM head from whole random matrices against `nn.Embedding` and
    `x @ W.T`: every id of the vocabulary looked up, logits on rank 0."""
    from minivllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    g = torch.Generator().manual_seed(seed)
    emb_w = torch.randn(vocab_size, hidden_size, generator=g, dtype=torch.float64)
    head_w = emb_w if tied else torch.randn(vocab_size, hidden_size, generator=g, dtype=torch.float64)
    emb = VocabParallelEmbedding(vocab_size, hidden_size, tp).double()
    emb.load_shard("weight", emb_w)
    head = ParallelLMHead(vocab_size, hidden_size, tp, emb if tied else None).double()
    if not tied:
        head.load_shard("weight", head_w)
    ids = torch.randperm(vocab_size, generator=g)
    with torch.no_grad():
        rows, logits = emb(ids), head(emb_w[ids])
    result = {"embedding": (rows - emb_w[ids]).abs().max().item(), "shares": head.weight is emb.weight,
              "logits_shape": tuple(logits.shape), "shard_rows": emb.weight.shape[0]}
    if tp.rank == 0:
        result["logits"] = (logits - emb_w[ids] @ head_w.T).abs().max().item()
    return result


def parameter_bytes(tp, folder) -> int:
    """Bytes of this rank's parameters (float32) for the model in `folder`."""
    from minivllm.model_executor.tensor_parallel import load_sharded_model

    model = load_sharded_model(folder, torch.float32, "cpu", tp)
    return sum(p.numel() * p.element_size() for p in model.parameters())
