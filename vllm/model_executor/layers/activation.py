"""Activations of the MLP blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:], the gated activation of a merged gate-up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
