"""RMSNorm, optionally fused with the residual add that precedes it.

Invariant: the statistics are computed in float32 and the result is cast back before the weight multiply,
exactly as Hugging Face's LlamaRMSNorm does, so float32 runs match it bit for bit and bf16 runs round the same.
On CUDA tensors one fused kernel (fused_ops.rms_norm) does the same steps with the same roundings; only the
variance's reduction order differs.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.fused_ops import MAX_NORM_HIDDEN, rms_norm, use_fused_ops
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
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual).

        x: [..., hidden_size]; its leading dims may be strided (Qwen3 normalises the heads of a qkv slice)."""
        if (use_fused_ops(x) and self.hidden_size <= MAX_NORM_HIDDEN
                and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape))):
            return rms_norm(x, self.weight, self.variance_epsilon, residual)
        return self.forward_native(x, residual)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The torch code: CPU runs, and the reference of the fused kernel."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.variance_epsilon}"
