"""Writes a step's keys and values into the paged KV cache (Triton).

Token t (t < num_actual_tokens) goes to slot slot_mapping[t], i.e. block slot // block_size, offset
slot % block_size of key_cache / value_cache ([num_blocks, block_size, num_kv_heads, head_size]). A negative
slot means "do not write" (padding). Rows past num_actual_tokens are never read. Values are cast to the cache's
dtype on store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    token_idx = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token_idx).to(tl.int64)
    if slot < 0:
        return
    block_idx = slot // BLOCK_SIZE
    block_off = slot % BLOCK_SIZE

    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_SIZE)  # [HEADS_PAD, HEAD_PAD]

    k = tl.load(key_ptr + token_idx * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token_idx * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = key_cache_ptr + block_idx * stride_kcb + block_off * stride_kcs + offs_h[:, None] * stride_kch
    v_dst = value_cache_ptr + block_idx * stride_vcb + block_off * stride_vcs + offs_h[:, None] * stride_vch
    tl.store(k_dst + offs_d[None, :], k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + offs_d[None, :], v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [>= num_actual_tokens] int64 (or int32)
    num_actual_tokens: int | None = None,
) -> None:
    """Write key[:n], value[:n] into the caches at slot_mapping[:n] (n = num_actual_tokens, default all)."""
    n = slot_mapping.shape[0] if num_actual_tokens is None else num_actual_tokens
    if n == 0:
        return
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    if key_cache.shape[2:] != (num_kv_heads, head_size) or value_cache.shape != key_cache.shape:
        raise ValueError(f"KV cache shape {tuple(key_cache.shape)} does not match key shape {tuple(key.shape)}.")
    if slot_mapping.shape[0] < n or key.shape[0] < n:
        raise ValueError(f"num_actual_tokens={n} exceeds slot_mapping ({slot_mapping.shape[0]}) or key rows.")
    # NOTE: the kernel assumes a unit stride along head_size; q/k/v split out of a fused projection keep it.
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("The KV cache must be contiguous along head_size.")
    _reshape_and_cache_kernel[(n,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_SIZE=key_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size),
    )
