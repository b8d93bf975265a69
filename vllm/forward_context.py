"""The per-step forward context: the flat attention metadata and KV caches that attention layers read.

The model runner sets it around each forward; layers only read it (nano-vllm's pattern), so model code needs
no attention arguments.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from vllm.v1.attention.backends.abstract import AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    # One tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_size].
    kv_caches: list[torch.Tensor]


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None, "attention ran outside set_forward_context()"
    return _forward_context


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None, kv_caches: list[torch.Tensor]) -> Iterator[None]:
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata, kv_caches)
    try:
        yield
    finally:
        _forward_context = prev
