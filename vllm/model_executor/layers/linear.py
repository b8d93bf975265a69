"""Linear layers whose parameters load themselves from checkpoint tensors.

Names follow vLLM so that a tensor-parallel split can slot in later; today every layer holds its full weight
(one rank). Fused layers stack several checkpoint projections along the output dim: QKVParallelLinear holds
[q; k; v] and MergedColumnParallelLinear holds [gate; up]; their `weight_loader(param, loaded_weight, shard_id)`
copies one projection into its rows. Weights are [output_size, input_size], as F.linear wants.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.utils import default_weight_loader, set_weight_attrs


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            set_weight_attrs(self.bias, {"weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, input_size] -> [n, output_size]
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.input_size}, out_features={self.output_size}, bias={self.bias is not None}"


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole."""


class ColumnParallelLinear(LinearBase):
    """A linear layer split along its output dim under tensor parallelism."""


class RowParallelLinear(LinearBase):
    """A linear layer split along its input dim under tensor parallelism."""


class _StackedLinear(ColumnParallelLinear):
    """Column-stacked projections; `shard_offsets` maps a shard id to its (row offset, row count)."""

    shard_offsets: dict[str | int, tuple[int, int]]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,  # type: ignore[override]
                      shard_id: str | int | None = None) -> None:
        if shard_id is None:
            default_weight_loader(param, loaded_weight)
            return
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard id {shard_id!r}; expected one of {list(self.shard_offsets)}")
        offset, size = self.shard_offsets[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), loaded_weight)


class MergedColumnParallelLinear(_StackedLinear):
    """Several projections of the same input stacked (gate and up); shard ids are 0, 1, ..."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes
        offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self.shard_offsets = {i: (offsets[i], output_sizes[i]) for i in range(len(output_sizes))}


class QKVParallelLinear(_StackedLinear):
    """The fused query/key/value projection; shard ids are "q", "k", "v"."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False) -> None:
        num_kv_heads = total_num_kv_heads or total_num_heads
        q_size, kv_size = total_num_heads * head_size, num_kv_heads * head_size
        super().__init__(hidden_size, q_size + 2 * kv_size, bias)
        self.head_size = head_size
        self.num_heads = total_num_heads
        self.num_kv_heads = num_kv_heads
        self.q_size = q_size
        self.kv_size = kv_size
        self.shard_offsets = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
