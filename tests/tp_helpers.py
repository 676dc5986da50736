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
