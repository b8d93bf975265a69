"""Picks the attention backend: Triton paged attention on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import torch

from vllm import envs
from vllm.v1.attention.backends.abstract import AttentionBackend


def get_attn_backend(device: torch.device) -> AttentionBackend:
    name = envs.VLLM_ATTENTION_BACKEND or ("TRITON" if device.type == "cuda" else "TORCH")
    if name == "TORCH":
        from vllm.v1.attention.backends.torch_ref import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "TRITON":
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
        return TritonAttentionBackend()
    raise ValueError(f"VLLM_ATTENTION_BACKEND must be TORCH or TRITON, got {name!r}.")
