"""The attention backend interface: one flat varlen batch over a paged KV cache.

A step's tokens are flattened: request i owns query rows query_start_loc[i]:query_start_loc[i+1], which are the
last (query_len) positions of its seq_lens[i] tokens. The KV cache of a layer is one tensor
[2, num_blocks, block_size, num_kv_heads, head_size]; token t of request i lives in slot
block_table[i, t // block_size] * block_size + t % block_size. A backend first writes the step's keys and
values at slot_mapping, then attends causally. Rows past num_actual_tokens are padding (CUDA graphs) and may
hold anything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    # [num_reqs + 1] int32, on the device
    query_start_loc: torch.Tensor
    # [num_reqs] int32, on the device: tokens in the KV cache after this step, per request
    seq_lens: torch.Tensor
    # [num_reqs, max_num_blocks_per_req] int32, on the device
    block_table: torch.Tensor
    # [num_actual_tokens] int64, on the device
    slot_mapping: torch.Tensor
    # Host copies, for backends that loop over requests.
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor


class AttentionBackend(ABC):
    name: str = ""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        """Write key/value at attn_metadata.slot_mapping, then return causal attention of the queries."""
