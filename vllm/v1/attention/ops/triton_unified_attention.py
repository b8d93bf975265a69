"""Unified varlen paged attention (Triton): prefill chunks and decodes in one launch.

One program handles BLOCK_Q query tokens of one request and one KV head. The tile packs all
NUM_QUERIES_PER_KV query heads of that KV head's GQA group (row m is token m // G, head m % G), so a decode
with GQA still gives tl.dot an M of BLOCK_Q * G. The program walks its request's keys TILE_N at a time through
the block table with an online softmax in float32 (exp2 with log2(e) folded into the scale).

Invariants:
- Query j of request i sits at absolute position seq_lens[i] - query_len_i + j and sees keys at positions
  <= its own; key t lives in block block_table[i, t // block_size] at offset t % block_size.
- The grid is (num_actual_tokens // BLOCK_Q + num_reqs, num_kv_heads, num_splits). Request i owns query blocks
  starting at query_start_loc[i] // BLOCK_Q + i (strictly increasing in i), so a program finds its request by
  binary search with no host sync; surplus programs exit at once.
- Only rows < num_actual_tokens of the output are written.
- With num_splits > 1 (flash-decoding), split s covers a contiguous share of the program's key tiles and
  writes its unnormalised partial output, running max and sum to float32 scratch; _reduce_segments_kernel
  merges them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# Keys per inner-loop step; 64 measured best on an H200 for head_size 128 decode (bf16).
TILE_N = 64


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, q_block_idx, BLOCK_Q: tl.constexpr):
    """Largest i in [0, num_reqs) with query_start_loc[i] // BLOCK_Q + i <= q_block_idx."""
    lo = tl.full([], 0, dtype=tl.int32)
    hi = lo + num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(start <= q_block_idx, mid, lo)
        hi = tl.where(start <= q_block_idx, hi, mid - 1)
    return lo


# NOTE: an int argument equal to 1 would otherwise be specialised into a constexpr (and recompiled for).
@triton.jit(do_not_specialize=["num_reqs"])
def _unified_attention_kernel(
    output_ptr,  # [num_tokens, num_heads, head_size]
    query_ptr,  # [num_tokens, num_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table_ptr,  # [num_reqs, max_num_blocks_per_req] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD] float32 (split-KV only)
    partial_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32 (split-KV only)
    partial_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32 (split-KV only)
    qk_scale,  # softmax scale * log2(e)
    num_reqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req = _find_request(query_start_loc_ptr, num_reqs, q_block_idx, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block_local = q_block_idx - (q_start // BLOCK_Q + req)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_tok = q_block_local * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # [BLOCK_M] token index within the request
    q_head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV  # [BLOCK_M]
    row_valid = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_tok < q_len)  # [BLOCK_M]
    d_valid = offs_d < HEAD_SIZE  # [HEAD_PAD]
    q_row = (q_start + q_tok).to(tl.int64)  # [BLOCK_M]
    q_pos = context_len + q_tok  # [BLOCK_M] absolute position

    q_ptrs = query_ptr + q_row[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_M, HEAD_PAD]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    # Keys beyond the last query of this block are never visible to it.
    num_keys = context_len + tl.minimum((q_block_local + 1) * BLOCK_Q, q_len)
    num_tiles = tl.cdiv(num_keys, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    offs_n = tl.arange(0, TILE_N)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE_N + offs_n  # [TILE_N]
        k_valid = k_pos < num_keys
        phys = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)  # [TILE_N]
        slot_off = k_pos % BLOCK_SIZE
        kv_mask = k_valid[None, :] & d_valid[:, None]  # [HEAD_PAD, TILE_N]
        k_ptrs = (key_cache_ptr + phys[None, :] * stride_kb + slot_off[None, :] * stride_ks
                  + kv_head * stride_kh + offs_d[:, None])
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [HEAD_PAD, TILE_N]
        v_ptrs = (value_cache_ptr + phys[:, None] * stride_vb + slot_off[:, None] * stride_vs
                  + kv_head * stride_vh + offs_d[None, :])
        v = tl.load(v_ptrs, mask=k_valid[:, None] & d_valid[None, :], other=0.0)  # [TILE_N, HEAD_PAD]

        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # [BLOCK_M, TILE_N] float32
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # NOTE: a row can see no key of a split's tiles (m_new = -inf); subtracting 0 keeps exp2 at 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = row_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        o_ptrs = output_ptr + q_row[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(output_ptr.dtype.element_ty), mask=out_mask)
    else:
        part_row = (q_row * NUM_HEADS + q_head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(partial_out_ptr + part_row[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=out_mask)
        tl.store(partial_max_ptr + part_row, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + part_row, l_i, mask=row_valid)


@triton.jit
def _reduce_segments_kernel(
    output_ptr,  # [num_tokens, num_heads, head_size]
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD] float32
    partial_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32
    partial_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_PAD)
    base = (token * NUM_HEADS + head) * NUM_SPLITS
    m = tl.load(partial_max_ptr + base + offs_s)  # [NUM_SPLITS]
    l = tl.load(partial_sum_ptr + base + offs_s)  # [NUM_SPLITS]
    m_max = tl.max(m, axis=0)
    w = tl.math.exp2(m - m_max)  # [NUM_SPLITS]; splits that saw no key have m = -inf and weigh 0
    denom = tl.sum(l * w, axis=0)
    part = tl.load(partial_out_ptr + (base + offs_s)[:, None] * HEAD_PAD + offs_d[None, :])  # [NUM_SPLITS, HEAD_PAD]
    out = tl.sum(part * w[:, None], axis=0) / denom
    tl.store(output_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(output_ptr.dtype.element_ty),
             mask=offs_d < HEAD_SIZE)


def _choose_num_splits(max_query_len: int, max_seq_len: int, num_reqs: int, num_kv_heads: int,
                       tile_n: int, num_splits: int | None) -> int:
    if num_splits is not None:
        if num_splits < 1 or num_splits & (num_splits - 1):
            raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}.")
        return num_splits
    # NOTE: split only decode-only batches whose programs would not fill the GPU on their own (H200: 132 SMs,
    # two or more programs each); a split costs a float32 partial per (token, head) and a second launch, so
    # each split keeps at least two key tiles.
    if max_query_len != 1:
        return 1
    programs = num_reqs * num_kv_heads
    splits = 1
    while splits < 16 and programs * splits < 256 and max_seq_len // (2 * splits) >= 2 * tile_n:
        splits *= 2
    return splits


def num_splits_for_cudagraph(num_reqs: int, max_model_len: int, num_kv_heads: int) -> int:
    """The split-KV factor of a decode batch of num_reqs rows captured once for every context length: the one
    the heuristic picks at max_model_len (shorter contexts leave some splits without tiles, which exit)."""
    return _choose_num_splits(1, max_model_len, num_reqs, num_kv_heads, TILE_N, None)


def unified_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    output: torch.Tensor,  # [num_tokens, num_heads, head_size]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks_per_req] int32
    scale: float,
    num_actual_tokens: int,
    num_reqs: int,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal paged attention of query[:num_actual_tokens] into output[:num_actual_tokens]; returns output.

    num_splits forces the split-KV factor (a power of two); None picks one from the batch shape.
    """
    if num_actual_tokens == 0 or num_reqs == 0:
        return output
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
    if head_size > 256 or key_cache.shape[3] != head_size:
        raise ValueError(f"head_size {head_size} unsupported or mismatched with the KV cache ({key_cache.shape}).")
    if query.stride(-1) != 1 or output.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("query, output and the KV cache must be contiguous along head_size.")
    group = num_heads // num_kv_heads
    head_pad = max(triton.next_power_of_2(head_size), 16)
    # NOTE: tl.dot needs M >= 16; a decode-only batch uses the smallest tile that holds one token's group.
    block_m = max(16 if max_query_len == 1 else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    splits = _choose_num_splits(max_query_len, max_seq_len, num_reqs, num_kv_heads, TILE_N, num_splits)
    grid = (num_actual_tokens // block_q + num_reqs, num_kv_heads, splits)

    if splits > 1:
        n_rows = num_actual_tokens * num_heads * splits
        partial_out = torch.empty(n_rows * head_pad, dtype=torch.float32, device=query.device)
        partial_max = torch.empty(n_rows, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty(n_rows, dtype=torch.float32, device=query.device)
    else:
        partial_out = partial_max = partial_sum = output
    _unified_attention_kernel[grid](
        output, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        partial_out, partial_max, partial_sum,
        scale * _LOG2E, num_reqs,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        NUM_HEADS=num_heads,
        NUM_QUERIES_PER_KV=group,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=TILE_N,
        NUM_SPLITS=splits,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    if splits > 1:
        _reduce_segments_kernel[(num_actual_tokens, num_heads)](
            output, partial_out, partial_max, partial_sum,
            output.stride(0), output.stride(1),
            NUM_HEADS=num_heads,
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            NUM_SPLITS=splits,
        )
    return output
