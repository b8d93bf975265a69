"""The Triton attention backend: paged KV-cache write plus one unified varlen attention launch per layer.

Serves prefill chunks and decodes in the same batch with no host syncs (grid sizes come from the metadata's
ints), so it can be captured in CUDA graphs. Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 for
tests. Output rows past num_actual_tokens are left unwritten.

A CUDA graph is captured once per decode batch size and replayed for any context length, so its metadata
(TritonAttentionMetadata) fixes num_splits; the kernel bounds its key loop by each request's seq_lens at run
time, so one split count serves every length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.v1.attention.backends.abstract import AttentionBackend, AttentionMetadata
from vllm.v1.attention.ops.triton_reshape_and_cache import reshape_and_cache
from vllm.v1.attention.ops.triton_unified_attention import unified_attention


@dataclass(slots=True)
class TritonAttentionMetadata(AttentionMetadata):
    # Split-KV factor for decode (a power of two); None lets the kernel wrapper choose from the batch shape.
    num_splits: int | None = None


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON"

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        reshape_and_cache(key, value, key_cache, value_cache, attn_metadata.slot_mapping, n)
        output = torch.empty_like(query)
        return unified_attention(
            query, key_cache, value_cache, output,
            attn_metadata.query_start_loc, attn_metadata.seq_lens, attn_metadata.block_table,
            scale, n, attn_metadata.num_reqs, attn_metadata.max_query_len, attn_metadata.max_seq_len,
            num_splits=getattr(attn_metadata, "num_splits", None))
