"""Weight-loading helpers shared by layers, models, the loader and the weight updates.

Every parameter that a checkpoint fills carries a `weight_loader(param, loaded_weight[, shard_id])` that takes the
whole checkpoint tensor and keeps this rank's part; the plain one here copies a whole tensor after checking its
shape. A parameter split over tensor-parallel ranks also carries `full_shape` (its shape at one rank) and, when it
stacks several checkpoint projections, `stacked_full_sizes` (shard id -> rows, in stacking order).
"""

from __future__ import annotations

from typing import Any

import torch


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator (a tensor-parallel split of `what`), or ValueError when it does not divide."""
    if numerator % denominator != 0:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}.")
    return numerator // denominator


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    for key, value in attrs.items():
        if hasattr(param, key):
            raise ValueError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"checkpoint weight of shape {tuple(loaded_weight.shape)} does not fit a parameter of "
                         f"shape {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The parameter's shape at tensor_parallel_size 1 (its own shape when it is not split)."""
    return tuple(getattr(param, "full_shape", param.shape))


def checkpoint_shard_shape(param: torch.Tensor, shard_id: str | int | None) -> tuple[int, ...]:
    """The shape of the checkpoint tensor that the parameter's loader takes for shard_id (None: the whole one)."""
    shape = full_shape(param)
    if shard_id is None:
        return shape
    return (param.stacked_full_sizes[shard_id], *shape[1:])  # type: ignore[attr-defined]


def load_full_parameter(param: torch.Tensor, full: torch.Tensor) -> None:
    """Load a tensor of the parameter's full (one-rank) shape: this rank keeps its part, through the loader."""
    loader = getattr(param, "weight_loader", default_weight_loader)
    loader(param, full)
