"""Chapter 02's decoder made tensor-parallel: each rank's model holds its share of the heads, of the
MLP and of the vocabulary, loaded straight from the safetensors files (exported from
notebooks/13_scaling_out.ipynb). After vLLM's parallel layers and weight loaders and nano-vllm's
`layers/linear.py`."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, TPGroup, divide
from .layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from .model_loader import load_config
from .models.llama import MODEL_REGISTRY, SUPPORTED_DTYPES, LlamaForCausalLM


def check_tensor_parallel(config, tp_size: int) -> None:
    """Refuse a tensor-parallel size the model cannot be split by, before any process starts.

    Raises:
        ValueError: naming both numbers, when `tp_size` does not divide the attention heads or the MLP's
            intermediate size, or when the KV heads neither divide into `tp_size` parts nor divide
            `tp_size` (then no rank could hold whole KV heads). vLLM checks the same in its model config.
    """
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp_size:
        raise ValueError(f"num_attention_heads={heads} is not divisible by tensor_parallel_size={tp_size}")
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(f"num_key_value_heads={kv_heads} neither is divisible by nor divides "
                         f"tensor_parallel_size={tp_size}")
    divide(config.intermediate_size, tp_size, "intermediate_size")


def kv_head_replicas(num_kv_heads: int, tp_size: int) -> int:
    """How many ranks hold a copy of each KV head: 1 when the KV heads split over the ranks, else
    `tp_size / num_kv_heads` (each rank then keeps one KV head; vLLM's `num_kv_head_replicas`)."""
    # EXERCISE ch13_ex3 (5 points): the number of ranks that share one KV head
    ### BEGIN SOLUTION
    return 1 if num_kv_heads >= tp_size else tp_size // num_kv_heads
    ### END SOLUTION


def parallelize(model: LlamaForCausalLM, tp: TPGroup) -> LlamaForCausalLM:
    """Swap, in place, each layer of `model` for its tensor-parallel form on rank `tp.rank` (build the
    model on the meta device first: the swapped layers are created where the old ones were, empty).

    Attention: q split by heads, k and v by KV heads (each replicated on `kv_head_replicas` ranks), o by
    rows; MLP: gate and up by columns, down by rows; embedding and LM head by vocabulary (a tied head
    shares the embedding's shard). Each attention layer's `num_heads`, `num_kv_heads` become the rank's.
    Returns `model`, with `model.tp_group = tp`. Raises ValueError (see `check_tensor_parallel`).
    """
    config, h = model.config, model.config.hidden_size
    check_tensor_parallel(config, tp.size)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        # EXERCISE ch13_ex3 (5 points): split q, k, v (k and v replicated when ranks outnumber KV heads) and o; per-rank head counts
        ### BEGIN SOLUTION
        replicas, bias = kv_head_replicas(attn.num_kv_heads, tp.size), attn.q_proj.bias is not None
        attn.q_proj = ColumnParallelLinear(h, attn.num_heads * attn.head_dim, bias, tp)
        attn.k_proj = ColumnParallelLinear(h, attn.num_kv_heads * attn.head_dim, bias, tp, replicas)
        attn.v_proj = ColumnParallelLinear(h, attn.num_kv_heads * attn.head_dim, bias, tp, replicas)
        attn.o_proj = RowParallelLinear(attn.num_heads * attn.head_dim, h, attn.o_proj.bias is not None, tp)
        attn.num_heads //= tp.size
        attn.num_kv_heads = attn.num_kv_heads * replicas // tp.size
        ### END SOLUTION
        bias = mlp.gate_proj.bias is not None
        mlp.gate_proj = ColumnParallelLinear(h, config.intermediate_size, bias, tp)
        mlp.up_proj = ColumnParallelLinear(h, config.intermediate_size, bias, tp)
        mlp.down_proj = RowParallelLinear(config.intermediate_size, h, bias, tp)
    embed = model.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, tp)
    tied = getattr(config, "tie_word_embeddings", False)
    model.lm_head = ParallelLMHead(config.vocab_size, h, tp, embed if tied else None)
    model.tp_group = tp
    return model


def load_sharded_weights(model: nn.Module, path: str | Path) -> None:
    """Fill a parallelized model from `path/*.safetensors`, reading only this rank's share of each
    tensor (a layer with `load_shard(name, slice)` picks its rows or columns from a safetensors slice;
    any other parameter is copied whole). A tied `lm_head.weight` is the embedding and is skipped.

    Raises:
        ValueError: a tensor with no place in the model, a misshapen tensor, an unreadable file, or
            parameters no tensor filled (as chapter 02's `load_weights`).
    """
    from safetensors import SafetensorError, safe_open

    names = {id(p): n for n, p in model.named_parameters()}  # a tied head's weight appears once
    tied, loaded = getattr(model.config, "tie_word_embeddings", False), set()
    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except SafetensorError as e:
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
        with handle as f:
            for name in f.keys():
                if (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq"):
                    continue
                prefix, _, attr = name.rpartition(".")
                try:
                    module = model.get_submodule(prefix)
                except AttributeError:
                    module = None
                shards = hasattr(module, "load_shard") and attr in module.shard_names
                if not (shards or isinstance(getattr(module, attr, None), nn.Parameter)):
                    raise ValueError(f"{file.name}: tensor {name} has no matching parameter in our "
                                     f"{type(model).__name__}")
                try:
                    if shards:
                        filled = module.load_shard(attr, f.get_slice(name))
                    else:
                        with torch.no_grad():
                            filled = [getattr(module, attr).copy_(f.get_tensor(name))]
                except RuntimeError as e:  # copy_ of mismatched shapes
                    raise ValueError(f"{file.name}: {name} does not fit the model ({e})") from None
                loaded.update(id(p) for p in filled)
    missing = sorted(n for i, n in names.items() if i not in loaded)
    if missing:
        raise ValueError(f"weights missing from {path}: {missing[:5]}")


def load_sharded_model(path: str | Path, dtype: torch.dtype, device: str | torch.device, tp: TPGroup
                       ) -> LlamaForCausalLM:
    """Rank `tp.rank`'s shard of the model in local folder `path` (chapter 02's `load_model`, parallelized
    before any weight exists, so a rank never holds more than its share). Raises ValueError."""
    config = load_config(path)
    if dtype not in SUPPORTED_DTYPES.values():
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(SUPPORTED_DTYPES)}")
    with torch.device("meta"):
        net = parallelize(MODEL_REGISTRY[config.model_type](config), tp)
    net = net.to_empty(device=device).to(dtype)
    net.tie_weights()
    net.model.rotary_emb.reset_buffers()
    load_sharded_weights(net, path)
    return net.eval()
