"""The torch reference attention backend: any device, one request at a time, float32 softmax.

It is the correctness reference for the Triton backend and the backend of CPU runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.v1.attention.backends.abstract import AttentionBackend, AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    n = slot_mapping.shape[0]
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, key[:n])
    kv_cache[1].view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, value[:n])


class TorchAttentionBackend(AttentionBackend):
    name = "TORCH"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping)
        output = torch.zeros_like(query)
        num_heads, head_size = query.shape[1], query.shape[2]
        num_kv_heads = key.shape[1]
        block_size = kv_cache.shape[2]
        qsl = attn_metadata.query_start_loc_cpu.tolist()
        seq_lens = attn_metadata.seq_lens_cpu.tolist()
        for i in range(attn_metadata.num_reqs):
            q = query[qsl[i]:qsl[i + 1]]  # [q_len, H, D]
            q_len, seq_len = q.shape[0], seq_lens[i]
            if q_len == 0:
                continue
            num_blocks = (seq_len + block_size - 1) // block_size
            blocks = attn_metadata.block_table[i, :num_blocks].long()
            k = kv_cache[0][blocks].reshape(-1, num_kv_heads, head_size)[:seq_len]
            v = kv_cache[1][blocks].reshape(-1, num_kv_heads, head_size)[:seq_len]
            if num_kv_heads != num_heads:
                k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
                v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
            # Query j sits at position seq_len - q_len + j and sees keys at positions <= its own.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
                attn_mask=mask, scale=scale)
            output[qsl[i]:qsl[i + 1]] = out.transpose(0, 1).to(query.dtype)
        return output
