"""Activations of the MLP blocks. On CUDA tensors SiluAndMul is one fused kernel (fused_ops.silu_and_mul) with
the torch code's roundings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.fused_ops import silu_and_mul, use_fused_ops


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:], the gated activation of a merged gate-up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., 2 * d] -> [..., d]
        if use_fused_ops(x):
            return silu_and_mul(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The torch code: CPU runs, and the reference of the fused kernel."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
