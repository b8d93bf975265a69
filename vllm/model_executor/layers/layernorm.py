"""RMSNorm, optionally fused with the residual add that precedes it.

Invariant: the statistics are computed in float32 and the result is cast back before the weight multiply,
exactly as Hugging Face's LlamaRMSNorm does, so float32 runs match it bit for bit and bf16 runs round the same.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.utils import default_weight_loader, set_weight_attrs


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(input_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.variance_epsilon}"
