"""Tensor-parallel linear layers: each rank holds a slice of the weight and the ranks combine their
partial results with one collective (exported from notebooks/13_scaling_out.ipynb). After Megatron-LM
(Shoeybi et al., 2019) and vLLM's `model_executor/layers/linear.py`."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class TPGroup:
    """The ranks that share one model's layers (vLLM's tensor-parallel group coordinator).

    Attributes:
        rank: this process's index in `[0, size)`; rank 0 samples and drives the others.
        size: the tensor-parallel size (1: one process, no collective is called).
        group: the `torch.distributed` process group of the collectives (gloo on CPU, NCCL on CUDA).
        control: the process group that carries each step's plan from rank 0 (always gloo), or None.
    """

    rank: int = 0
    size: int = 1
    group: object | None = None
    control: object | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (every rank gets the sum); returns `x`."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` `[N, k]` along the last dimension on rank 0 (`[N, size * k]`);
        the other ranks get an empty `[N, 0]` tensor (they never sample)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                    group=self.group)
        return torch.cat(parts, dim=-1) if self.rank == 0 else x.new_empty(*x.shape[:-1], 0)


def divide(numerator: int, denominator: int, what: str) -> int:
    """`numerator / denominator` when it divides evenly. Raises ValueError naming `what` and both numbers."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def shard_range(size: int, num_shards: int, shard: int) -> tuple[int, int]:
    """The `[start, end)` of shard `shard` when `size` rows split evenly into `num_shards`."""
    per = size // num_shards
    return shard * per, (shard + 1) * per


class ColumnParallelLinear(nn.Linear):
    """`y = x W^T + b` with `W`'s output rows split: each rank computes its slice of `y` and keeps it
    (no collective). `num_replicas` ranks in a row share one slice: the key and value projections when
    there are fewer KV heads than ranks (vLLM's `num_kv_head_replicas`).

    Args: in_features, out_features (whole layer), bias, tp (`TPGroup`), num_replicas (divides tp.size).
    Shapes: `[..., in_features]` -> `[..., out_features / (tp.size / num_replicas)]`.
    Raises: ValueError if `out_features` does not split evenly into `tp.size / num_replicas` slices.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, num_replicas: int = 1):
        self.num_shards, self.shard = tp.size // num_replicas, tp.rank // num_replicas
        self.full_out_features = out_features
        super().__init__(in_features, divide(out_features, self.num_shards, "out_features"), bias=bias)

    @property
    def shard_names(self) -> tuple[str, ...]:
        """The checkpoint tensors `load_shard` takes: "weight", and "bias" if the layer has one."""
        return ("weight",) if self.bias is None else ("weight", "bias")

    def load_shard(self, name: str, loaded) -> list[nn.Parameter]:
        """Copy this rank's rows of the whole tensor `loaded` (a tensor, or a safetensors slice, which
        reads only those rows from disk) into parameter `name` ("weight" or "bias"); returns it."""
        start, end = shard_range(self.full_out_features, self.num_shards, self.shard)
        param = getattr(self, name)
        with torch.no_grad():
            param.copy_(loaded[start:end])
        return [param]


class RowParallelLinear(nn.Module):
    """`y = x W^T + b` with `W`'s input columns split: each rank multiplies its slice of `x` (what a
    column-parallel layer left it) by its columns, then one all-reduce sums the partial products. The
    bias is added once, after the sum (adding it on every rank before would count it `tp.size` times).

    Args: in_features (whole layer), out_features, bias, tp. Attributes: local (the rank's `nn.Linear`,
        without bias, so chapter 02's oneDNN packing applies to it), bias (whole, or None).
    Shapes: `[..., in_features / tp.size]` -> `[..., out_features]` on every rank.
    Raises: ValueError if `in_features` does not split evenly.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__()
        self.tp, self.full_in_features = tp, in_features
        self.local = nn.Linear(divide(in_features, tp.size, "in_features"), out_features, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.local(x))
        return y if self.bias is None else y + self.bias

    shard_names = ColumnParallelLinear.shard_names

    def load_shard(self, name: str, loaded) -> list[nn.Parameter]:
        """"weight": this rank's columns of the whole weight; "bias": the whole bias. Returns the parameter."""
        if name == "bias":
            param, part = self.bias, loaded[:]
        else:
            start, end = shard_range(self.full_in_features, self.tp.size, self.tp.rank)
            param, part = self.local.weight, loaded[:, start:end]
        with torch.no_grad():
            param.copy_(part)
        return [param]
