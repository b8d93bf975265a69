"""Weight-loading helpers shared by layers and models.

Every parameter that a checkpoint fills carries a `weight_loader(param, loaded_weight[, shard_id])`; the plain
one here copies a whole tensor after checking its shape.
"""

from __future__ import annotations

from typing import Any

import torch


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
