"""Attention: the model-side layer; it reads the forward context and calls the step's backend."""

from __future__ import annotations

import torch
from torch import nn

from vllm.forward_context import get_forward_context
from vllm.v1.attention.backends.abstract import AttentionBackend


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_idx = layer_idx
        # Set by the model runner once it knows the device (see set_attn_backend).
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [num_tokens, num_heads * head_size]; k, v: [num_tokens, num_kv_heads * head_size]."""
        ctx = get_forward_context()
        assert self.backend is not None and ctx.attn_metadata is not None
        n = q.shape[0]
        out = self.backend.forward(
            q.view(n, self.num_heads, self.head_size),
            k.view(n, self.num_kv_heads, self.head_size),
            v.view(n, self.num_kv_heads, self.head_size),
            ctx.kv_caches[self.layer_idx], ctx.attn_metadata, self.scale)
        return out.view(n, self.num_heads * self.head_size)


def set_attn_backend(model: nn.Module, backend: AttentionBackend) -> None:
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend
