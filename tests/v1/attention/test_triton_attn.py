"""TritonAttentionBackend and its kernels against the torch reference backend (float32 SDPA per request).

On CPU the kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py), so shapes stay small.
"""

from __future__ import annotations

import pytest
import torch

from vllm.v1.attention.backends.abstract import AttentionMetadata
from vllm.v1.attention.backends.torch_ref import TorchAttentionBackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.ops.triton_reshape_and_cache import reshape_and_cache
from vllm.v1.attention.ops.triton_unified_attention import unified_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_batch(
    lens: list[tuple[int, int]],  # (query_len, seq_len) per request
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    num_padding: int = 0,
    seed: int = 0,
    device: str = DEVICE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q/k/v, a KV cache holding random context, shuffled block tables, and padding rows of garbage."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(lens)
    blocks_per_req = [(s + block_size - 1) // block_size for _, s in lens]
    max_blocks = max(max(blocks_per_req), 1)
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_req):
        block_table[i, :nb] = perm[used:used + nb].int()
        used += nb
    q_lens = [q for q, _ in lens]
    seq_lens = torch.tensor([s for _, s in lens], dtype=torch.int32)
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    n = int(query_start_loc[-1])
    slots = []
    for i, (q_len, seq_len) in enumerate(lens):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(block_table[i, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)

    total = n + num_padding
    query = torch.randn(total, num_heads, head_size, generator=gen).to(dtype)
    key = torch.randn(total, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(total, num_kv_heads, head_size, generator=gen).to(dtype)
    if num_padding:
        query[n:] = float("nan")
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    meta = AttentionMetadata(
        num_actual_tokens=n,
        num_reqs=num_reqs,
        max_query_len=max(q_lens),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device),
        block_table=block_table.to(device),
        slot_mapping=slot_mapping.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    return query.to(device), key.to(device), value.to(device), kv_cache.to(device), meta


def run_both(lens: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
             dtype: torch.dtype = torch.float32, num_padding: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    query, key, value, kv_cache, meta = make_batch(lens, num_heads, num_kv_heads, head_size, block_size, dtype,
                                                   num_padding)
    scale = head_size ** -0.5
    cache_ref = kv_cache.clone()
    ref = TorchAttentionBackend().forward(query, key, value, cache_ref, meta, scale)
    out = TritonAttentionBackend().forward(query, key, value, kv_cache, meta, scale)
    n = meta.num_actual_tokens
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(kv_cache, cache_ref, atol=0, rtol=0)
    return out[:n], ref[:n]


DECODE = [(1, 1), (1, 7), (1, 33), (1, 20), (1, 16)]
PREFILL = [(5, 5), (17, 17), (1, 1), (9, 9)]
MIXED = [(1, 30), (7, 7), (5, 23), (0, 6), (1, 1), (12, 40)]


@pytest.mark.parametrize("lens", [DECODE, PREFILL, MIXED], ids=["decode", "prefill", "mixed"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_torch_reference(lens: list[tuple[int, int]], num_heads: int, num_kv_heads: int,
                                 block_size: int) -> None:
    out, ref = run_both(lens, num_heads, num_kv_heads, 32, block_size, num_padding=3)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head_size", [16, 24, 80])
def test_head_sizes(head_size: int) -> None:
    out, ref = run_both(MIXED, 6, 2, head_size, 16)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_mqa_large_group() -> None:
    out, ref = run_both([(1, 19), (3, 10)], 32, 1, 16, 4)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_long_prefill_spans_several_query_blocks() -> None:
    # 4 q heads / 1 kv head -> 16 tokens per 64-row query block, so 70 tokens span 5 blocks.
    out, ref = run_both([(70, 75), (1, 3)], 4, 1, 16, 16)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_float16() -> None:
    out, ref = run_both(MIXED, 4, 2, 32, 16, dtype=torch.float16)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("num_splits", [2, 4])
def test_split_kv_decode(num_splits: int) -> None:
    query, key, value, kv_cache, meta = make_batch([(1, 150), (1, 3), (1, 64), (1, 65)], 4, 2, 16, 8,
                                                   torch.float32)
    scale = 16 ** -0.5
    ref = TorchAttentionBackend().forward(query, key, value, kv_cache, meta, scale)
    out = torch.full_like(query, float("nan"))
    unified_attention(query, kv_cache[0], kv_cache[1], out, meta.query_start_loc, meta.seq_lens, meta.block_table,
                      scale, meta.num_actual_tokens, meta.num_reqs, meta.max_query_len, meta.max_seq_len,
                      num_splits=num_splits)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_attention_hand_worked() -> None:
    # One request, one head, head_size 16, seq_len 2, both queries new: q0 sees k0 only, q1 sees k0 and k1
    # with equal scores, so the outputs are v0 and (v0 + v1) / 2.
    query, key, value, kv_cache, meta = make_batch([(2, 2)], 1, 1, 16, 4, torch.float32)
    query.zero_()
    out = TritonAttentionBackend().forward(query, key, value, kv_cache, meta, 1.0)
    torch.testing.assert_close(out[0], value[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[1], (value[0] + value[1]) / 2, atol=1e-6, rtol=1e-6)


def test_reshape_and_cache_matches_index_copy() -> None:
    num_kv_heads, head_size, block_size, num_blocks, n = 3, 24, 4, 9, 11
    gen = torch.Generator().manual_seed(1)
    # A fused projection's k and v: strided views along the token dim, plus 2 padding rows.
    kv = torch.randn(n + 2, 2 * num_kv_heads * head_size, generator=gen).to(DEVICE)
    key = kv[:, :num_kv_heads * head_size].view(n + 2, num_kv_heads, head_size)
    value = kv[:, num_kv_heads * head_size:].view(n + 2, num_kv_heads, head_size)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:n].to(DEVICE)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(DEVICE)
    expected = kv_cache.clone()
    expected[0].view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, key[:n])
    expected[1].view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, value[:n])
    reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping, n)
    torch.testing.assert_close(kv_cache, expected, atol=0, rtol=0)


def test_reshape_and_cache_skips_negative_slots() -> None:
    key = torch.ones(2, 1, 16, device=DEVICE)
    value = torch.ones(2, 1, 16, device=DEVICE)
    kv_cache = torch.zeros(2, 2, 4, 1, 16, device=DEVICE)
    reshape_and_cache(key, value, kv_cache[0], kv_cache[1], torch.tensor([5, -1], device=DEVICE))
    assert kv_cache[:, 1, 1].eq(1).all() and kv_cache.sum() == 2 * 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("decode_only", [False, True])
def test_cuda_bf16_large(decode_only: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    seq_lens = torch.randint(1, 1001, (64,), generator=gen).tolist()
    if decode_only:
        lens = [(1, s) for s in seq_lens]
    else:
        q_lens = torch.randint(1, 65, (64,), generator=gen).tolist()
        lens = [(1 if i % 2 else min(q, s), s) for i, (q, s) in enumerate(zip(q_lens, seq_lens))]
    out, ref = run_both(lens, 12, 2, 128, 16, dtype=torch.bfloat16, num_padding=5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def _pad_like_a_mixed_graph(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                            meta: AttentionMetadata, num_pad: int, num_zero: int, zero_at: int,
                            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                           torch.Tensor, AttentionMetadata]:
    """The batch of `meta` padded as input_prep pads a mixed step: a scratch block (appended to the cache), one
    padding request of num_pad tokens whose block-table row is all scratch, and num_zero zero-token requests
    (seq_len 0) whose block-table rows hold ids far outside the cache (they must never be read); the zero-token
    rows go after the padding request, or, with zero_at < num_reqs, before real request zero_at (the kernel
    allows them anywhere)."""
    n, num_reqs = meta.num_actual_tokens, meta.num_reqs
    block_size = kv_cache.shape[2]
    scratch = kv_cache.shape[1]
    kv_cache = torch.cat([kv_cache, torch.randn(kv_cache[:, :1].shape, generator=gen).to(kv_cache)], dim=1)
    width = max(meta.block_table.shape[1], -(-num_pad // block_size))
    real_bt = torch.zeros(num_reqs, width, dtype=torch.int32)
    real_bt[:, :meta.block_table.shape[1]] = meta.block_table.cpu()
    qsl, seq_lens = meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist()
    # (query_start, seq_len, block-table row) per request, in order.
    rows = [(qsl[i], seq_lens[i], real_bt[i]) for i in range(num_reqs)]
    rows.append((n, num_pad, torch.full((width,), scratch, dtype=torch.int32)))
    zero = [(None, 0, torch.full((width,), 2 ** 30, dtype=torch.int32))] * num_zero
    rows = rows[:zero_at] + zero + rows[zero_at:] if zero_at < num_reqs else rows + zero
    total = n + num_pad
    starts = [total] * len(rows)
    for j in reversed(range(len(rows))):  # a zero-token row starts where the next request starts
        starts[j] = rows[j][0] if rows[j][0] is not None else (starts[j + 1] if j + 1 < len(rows) else total)
    query_start_loc = torch.tensor(starts + [total], dtype=torch.int32)
    seq = torch.tensor([r[1] for r in rows], dtype=torch.int32)
    block_table = torch.stack([r[2] for r in rows])
    pad_slots = scratch * block_size + torch.arange(num_pad) % block_size
    slot_mapping = torch.cat([meta.slot_mapping.cpu(), pad_slots])
    extra = lambda t: torch.cat([t.cpu(), torch.randn((num_pad, *t.shape[1:]), generator=gen).to(t.dtype)])  # noqa: E731
    padded = AttentionMetadata(
        num_actual_tokens=total, num_reqs=len(rows), max_query_len=max(total, 2), max_seq_len=int(seq.max()),
        query_start_loc=query_start_loc.to(DEVICE), seq_lens=seq.to(DEVICE), block_table=block_table.to(DEVICE),
        slot_mapping=slot_mapping.to(DEVICE), query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq)
    return (extra(query).to(DEVICE), extra(key).to(DEVICE), extra(value).to(DEVICE), kv_cache.to(DEVICE),
            padded)


@pytest.mark.parametrize("lens", [MIXED, [(9, 9), (1, 5), (1, 12)]], ids=["mixed", "prefill+decodes"])
@pytest.mark.parametrize("num_pad,num_zero,zero_at", [(0, 1, 99), (5, 0, 99), (37, 3, 99), (3, 2, 1), (70, 1, 0)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_zero_token_and_padding_requests_leave_real_rows_unchanged(lens: list[tuple[int, int]], num_pad: int,
                                                                   num_zero: int, zero_at: int,
                                                                   block_size: int) -> None:
    """A batch padded as input_prep pads a mixed step (one padding request on a scratch block, zero-token rows)
    gives the real tokens the unpadded batch's outputs bit for bit, writes the same KV cache outside the scratch
    block, and finite outputs for the padding tokens; the torch reference agrees on the padded batch."""
    num_heads, num_kv_heads, head_size = 4, 2, 32
    query, key, value, kv_cache, meta = make_batch(lens, num_heads, num_kv_heads, head_size, block_size,
                                                   torch.float32)
    # Rows past num_actual_tokens may hold anything: make_batch's inputs have none.
    n = meta.num_actual_tokens
    gen = torch.Generator().manual_seed(7)
    q_p, k_p, v_p, cache_p, meta_p = _pad_like_a_mixed_graph(query, key, value, kv_cache, meta, num_pad, num_zero,
                                                             zero_at, gen)
    scale = head_size ** -0.5
    # Same kernel variant for both (max_query_len > 1): MIXED has prefills, the other list too.
    out = TritonAttentionBackend().forward(query, key, value, kv_cache, meta, scale)
    out_p = TritonAttentionBackend().forward(q_p, k_p, v_p, cache_p, meta_p, scale)
    torch.testing.assert_close(out_p[:n], out[:n], atol=0, rtol=0)
    torch.testing.assert_close(cache_p[:, :-1], kv_cache, atol=0, rtol=0)
    assert torch.isfinite(out_p[n:]).all()
    # NOTE: real rows only: padding tokens more than a block apart share a scratch slot, and which write wins
    # is up to each backend (on a GPU, up to the schedule).
    ref_p = TorchAttentionBackend().forward(q_p, k_p, v_p, cache_p.clone(), meta_p, scale)
    torch.testing.assert_close(out_p[:n], ref_p[:n], atol=1e-4, rtol=1e-4)
