"""Upstream's module path of `apply_top_k_top_p` (`vllm.v1.sample.ops.topk_topp_sampler`), with upstream's
signature `apply_top_k_top_p(logits, k, p) -> logits`, over this engine's filter (ops/topk_topp.py).

Semantics are this engine's (the ones the sampling mask describes): top-k keeps every logit >= the k-th largest
(boundary ties kept), top-p keeps the whole tie group at its boundary. `k` is [num_reqs] integer, with
vocab_size (or any value <= 0 or >= vocab_size) where a row has no top-k; `p` is [num_reqs] float, 1.0 where a
row has no top-p. Removed entries are set to -inf in `logits` (float32, [num_reqs, V]), in place, and
`logits` is returned.
"""

from __future__ import annotations

import torch

from vllm.v1.sample.ops.topk_topp import apply_top_k_top_p as _apply_top_k_top_p


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Top-k then top-p on `logits` in place; returns `logits` (module docstring)."""
    if k is None and p is None:
        return logits
    vocab_size = logits.shape[-1]
    max_top_k = vocab_size
    if k is not None:
        k = torch.where((k <= 0) | (k >= vocab_size), vocab_size, k.to(torch.long))  # [num_reqs]
        max_top_k = int(k.max().item()) if k.numel() else vocab_size
    _apply_top_k_top_p(logits, k, p, max_top_k)
    return logits


__all__ = ["apply_top_k_top_p"]
