"""Linear layers split over the tensor-parallel group, whose parameters load their own shard of a checkpoint tensor.

vLLM's layouts (Megatron's): a column-parallel layer holds rows [r * out/tp, (r + 1) * out/tp) of the weight (its
output features), a row-parallel layer columns [r * in/tp, (r + 1) * in/tp) (its input features) and sums its
partial products over the group. Weights are [output_size, input_size], as F.linear wants. Fused layers stack
several checkpoint projections along the output dim, each split by rank: QKVParallelLinear holds this rank's
[q; k; v] heads and MergedColumnParallelLinear its [gate; up] rows; `weight_loader(param, loaded_weight, shard_id)`
takes the whole checkpoint projection and copies this rank's part of it.

Invariants:
- Every loader takes the full checkpoint (Hugging Face) tensor, never a pre-sliced one, so `load_weights` of a
  checkpoint and the weight updates (vllm/v1/worker/weight_update.py) give every rank its own shard.
- Every parameter carries `full_shape`, its shape at tensor_parallel_size 1; a fused one also
  `stacked_full_sizes` (shard id -> rows of that checkpoint projection, in stacking order). The weight-update
  checks and dummy weights read them (`vllm/model_executor/utils.py`).
- KV heads: with fewer KV heads than ranks each rank holds one KV head, replicated on tp // total_num_kv_heads
  consecutive ranks (vLLM's rule); with more, total_num_kv_heads // tp each.
- At one rank (the default before `initialize_model_parallel`) every layer is a plain F.linear over its whole
  weight: no collective, no copy, the bias inside the matmul.
- RowParallelLinear with reduce_results adds its bias once, after the all-reduce; without, on rank 0 only, so
  that the caller's later reduce counts it once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                                             tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce)
from vllm.model_executor.utils import default_weight_loader, divide, set_weight_attrs


def _load_rows(param: torch.Tensor, loaded_weight: torch.Tensor, full_rows: int, start: int) -> None:
    """Copy rows [start, start + param rows) of a checkpoint tensor of full_rows rows into param."""
    expected = (full_rows, *param.shape[1:])
    if tuple(loaded_weight.shape) != expected:
        raise ValueError(f"checkpoint weight of shape {tuple(loaded_weight.shape)} does not fit a parameter of "
                         f"shape {expected}")
    param.data.copy_(loaded_weight.narrow(0, start, param.shape[0]))


class LinearBase(nn.Module):
    """input_size / output_size are the whole layer's; the parameters hold this rank's part."""

    def __init__(self, input_size: int, output_size: int, bias: bool, input_size_per_partition: int,
                 output_size_per_partition: int, bias_is_split: bool) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = input_size_per_partition
        self.output_size_per_partition = output_size_per_partition
        self.weight = nn.Parameter(torch.empty(output_size_per_partition, input_size_per_partition),
                                   requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader, "full_shape": (output_size, input_size)})
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size_per_partition if bias_is_split else output_size),
                                     requires_grad=False)
            loader = self.weight_loader if bias_is_split else default_weight_loader
            set_weight_attrs(self.bias, {"weight_loader": loader, "full_shape": (output_size,)})
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, input_size] -> [n, output_size]
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, bias={self.bias is not None}, "
                f"tp_size={self.tp_size}")


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, input_size, output_size, bias_is_split=False)


class ColumnParallelLinear(LinearBase):
    """Split along the output dim: rank r computes output features [r * out/tp, (r + 1) * out/tp).

    gather_output: all-gather the parts so every rank returns all output_size features; otherwise each rank
    returns its own part (what a following RowParallelLinear with input_is_parallel takes).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False,
                 output_size_per_partition: int | None = None) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        if output_size_per_partition is None:
            output_size_per_partition = divide(output_size, tp_size, "output_size")
        super().__init__(input_size, output_size, bias, input_size, output_size_per_partition, bias_is_split=True)
        self.gather_output = gather_output

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        _load_rows(param, loaded_weight, self.output_size, self.tp_rank * self.output_size_per_partition)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, input_size] -> [n, output_size (per partition)]
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output and self.tp_size > 1:
            y = tensor_model_parallel_all_gather(y, dim=-1)
        return y


class _StackedLinear(ColumnParallelLinear):
    """Column-parallel projections stacked by rank. `shards[shard_id]` = (row offset in this rank's parameter,
    rows on this rank, index of this rank's slice of the checkpoint projection, rows of the whole projection)."""

    shards: dict[str | int, tuple[int, int, int, int]]

    def _set_shards(self, shards: dict[str | int, tuple[int, int, int, int]]) -> None:
        self.shards = shards
        full_sizes = {shard_id: full for shard_id, (_, _, _, full) in shards.items()}
        set_weight_attrs(self.weight, {"stacked_full_sizes": full_sizes})
        if self.bias is not None:
            set_weight_attrs(self.bias, {"stacked_full_sizes": full_sizes})

    @property
    def shard_offsets(self) -> dict[str | int, tuple[int, int]]:
        """shard id -> (row offset, rows) in this rank's parameter."""
        return {shard_id: (offset, size) for shard_id, (offset, size, _, _) in self.shards.items()}

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,  # type: ignore[override]
                      shard_id: str | int | None = None) -> None:
        if shard_id is None:
            # The whole fused tensor as one rank would hold it: its projections one after the other.
            full_shape = (sum(full for *_, full in self.shards.values()), *param.shape[1:])
            if tuple(loaded_weight.shape) != full_shape:
                raise ValueError(f"checkpoint weight of shape {tuple(loaded_weight.shape)} does not fit a "
                                 f"parameter of shape {full_shape}")
            start = 0
            for sid, (*_, full) in self.shards.items():
                self.weight_loader(param, loaded_weight.narrow(0, start, full), sid)
                start += full
            return
        if shard_id not in self.shards:
            raise ValueError(f"unknown shard id {shard_id!r}; expected one of {list(self.shards)}")
        offset, size, shard_rank, full = self.shards[shard_id]
        _load_rows(param.data.narrow(0, offset, size), loaded_weight, full, shard_rank * size)


class MergedColumnParallelLinear(_StackedLinear):
    """Several projections of the same input stacked (gate and up), each split by rank; shard ids 0, 1, ..."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 gather_output: bool = False) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        local = [divide(size, tp_size, "each merged output size") for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, gather_output, output_size_per_partition=sum(local))
        self.output_sizes = output_sizes
        offsets = [sum(local[:i]) for i in range(len(local))]
        self._set_shards({i: (offsets[i], local[i], self.tp_rank, output_sizes[i]) for i in range(len(local))})


class QKVParallelLinear(_StackedLinear):
    """The fused query/key/value projection, split by heads; shard ids "q", "k", "v".

    Rank r holds query heads [r * H/tp, (r + 1) * H/tp) and, when tp <= total KV heads K, KV heads
    [r * K/tp, (r + 1) * K/tp); when tp > K, KV head r // (tp / K) (each KV head on tp / K consecutive ranks,
    which are exactly the ranks whose query heads use it).
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        tp_rank = get_tensor_model_parallel_rank()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            if tp_size % total_num_kv_heads != 0:
                raise ValueError(f"tensor_parallel_size={tp_size} is not a multiple of num_key_value_heads="
                                 f"{total_num_kv_heads}: with fewer KV heads than ranks each KV head is replicated "
                                 "on the same number of ranks.")
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        full_q, full_kv = total_num_heads * head_size, total_num_kv_heads * head_size
        super().__init__(hidden_size, full_q + 2 * full_kv, bias,
                         output_size_per_partition=self.q_size + 2 * self.kv_size)
        kv_rank = tp_rank // self.num_kv_head_replicas
        self._set_shards({
            "q": (0, self.q_size, tp_rank, full_q),
            "k": (self.q_size, self.kv_size, kv_rank, full_kv),
            "v": (self.q_size + self.kv_size, self.kv_size, kv_rank, full_kv),
        })


class RowParallelLinear(LinearBase):
    """Split along the input dim: rank r multiplies input features [r * in/tp, (r + 1) * in/tp).

    input_is_parallel: x is already this rank's part of the input (a column-parallel layer's output); otherwise
    x is the whole input and the layer takes its part. reduce_results: sum the partial outputs over the group
    (every rank returns the whole result); otherwise each rank returns its partial sum.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, input_is_parallel: bool = True,
                 reduce_results: bool = True) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        super().__init__(input_size, output_size, bias, divide(input_size, tp_size, "input_size"), output_size,
                         bias_is_split=False)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        expected = (self.output_size, self.input_size)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"checkpoint weight of shape {tuple(loaded_weight.shape)} does not fit a parameter of "
                             f"shape {expected}")
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * self.input_size_per_partition,
                                              self.input_size_per_partition))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, input_size (per partition)] -> [n, output_size]
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        if not self.input_is_parallel:
            x = x.narrow(-1, self.tp_rank * self.input_size_per_partition, self.input_size_per_partition)
        if not self.reduce_results:
            return F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        y = tensor_model_parallel_all_reduce(F.linear(x, self.weight))
        if self.bias is not None:
            y.add_(self.bias)
        return y
