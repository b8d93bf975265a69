"""Sampling-mask compaction: one read of the logits, spread over (row, chunk) programs, and its torch code.

This is the engine's one compaction path (`compact_sampling_mask` in vllm/v1/sample/sampling_mask.py calls it on
CUDA and under the Triton interpreter). A single program per row would carry the running count through 151k ids
sequentially, so at 512 rows only 512 programs would stream the logits, at a fraction of the memory bandwidth.
Here the work is split in two launches whose only large read is the first:

1. `_pack_count_kernel`, grid (num_reqs, num_chunks): reads CHUNK logits, writes their keep flags as the packed
   little-bit-order bitmask (CHUNK / 8 bytes) and the chunk's keep count.
2. `_compact_kernel`, grid (num_reqs, num_chunks): a chunk's first slot is the sum of the counts of the chunks
   before it (at most a few dozen ints); chunks that start at or past K exit at once. The others unpack their
   bitmask bytes (1/32 of the logits' bytes), take an exclusive prefix sum of the flags and write ids < K
   ascending. Chunk 0 also writes the row's full count.

Bytes moved: the logits once, plus ~1/32 of that for the bitmask written and re-read by the surviving chunks
(~1.9x the one-read floor at 512 rows on the H200, docs/benchmarks.md).

`compact_sampling_mask_torch` computes the same outputs with torch ops: the path of CPU tensors outside the
Triton interpreter (the CPU engine) and the reference of the kernel's tests. Both leave token_ids slots at or past
a row's count undefined.

`compact_candidates` (the fast path's support from its top-k candidates) has the same kernel / torch split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096
NUM_WARPS = 8


@triton.jit
def _pack_count_kernel(
    logits_ptr,  # [num_reqs, V] float
    logits_stride,
    num_sampled_ptr,  # [num_reqs] int32
    packed_mask_ptr,  # [num_reqs, ceil(V/8)] uint8
    packed_mask_stride,
    chunk_counts_ptr,  # [num_reqs, num_chunks] int32
    num_chunks,
    vocab_size,
    dst_rows_ptr,  # HAS_DST: [num_reqs] int64, the output row of each logits row
    hit_ptr,  # HAS_DST: [num_reqs] bool, whether that row is written at all
    CHUNK: tl.constexpr,
    HAS_DST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    dst, write = row, row >= 0  # write: a scalar bool tensor (True) unless HAS_DST
    if HAS_DST:
        dst = tl.load(dst_rows_ptr + row).to(tl.int64)
        write = tl.load(hit_ptr + row) != 0
    # A row that sampled nothing keeps nothing: its loads are all masked off (so are a row not to be written's).
    limit = tl.where(write, tl.where(tl.load(num_sampled_ptr + dst) > 0, vocab_size, 0), 0)
    shifts = tl.arange(0, 8)[None, :]
    byte_ids = chunk * (CHUNK // 8) + tl.arange(0, CHUNK // 8)
    # The chunk loaded as [CHUNK/8, 8]: each output byte's 8 flags sit in one tile row, so the packing is a sum
    # along the tile's contiguous axis.
    ids = byte_ids[:, None] * 8 + shifts
    live = ids < limit
    x = tl.load(logits_ptr + row * logits_stride + ids, mask=live, other=float("-inf")).to(tl.float32)
    # NOTE: |x| < inf is false for +inf, -inf and NaN alike.
    flags = ((tl.abs(x) < float("inf")) & live).to(tl.int32)
    count = tl.sum(tl.sum(flags, axis=1), axis=0)
    packed = tl.sum(flags << shifts, axis=1)  # [CHUNK // 8]
    tl.store(packed_mask_ptr + dst * packed_mask_stride + byte_ids, packed.to(tl.uint8),
             mask=byte_ids < tl.where(write, (vocab_size + 7) // 8, 0))
    tl.store(chunk_counts_ptr + row * num_chunks + chunk, count)


@triton.jit
def _compact_kernel(
    packed_mask_ptr,  # [num_reqs, ceil(V/8)] uint8
    packed_mask_stride,
    chunk_counts_ptr,  # [num_reqs, num_chunks] int32
    num_chunks,
    token_ids_ptr,  # [num_reqs, K] int32
    token_ids_stride,
    counts_ptr,  # [num_reqs] int32
    vocab_size,
    K,
    dst_rows_ptr,  # HAS_DST: [num_reqs] int64, the output row of each row
    hit_ptr,  # HAS_DST: [num_reqs] bool, whether that row is written at all
    CHUNK: tl.constexpr,
    MAX_CHUNKS: tl.constexpr,
    HAS_DST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    dst, write = row, row >= 0  # write: a scalar bool tensor (True) unless HAS_DST
    if HAS_DST:
        dst = tl.load(dst_rows_ptr + row).to(tl.int64)
        write = tl.load(hit_ptr + row) != 0
    c = tl.arange(0, MAX_CHUNKS)
    counts = tl.load(chunk_counts_ptr + row * num_chunks + c, mask=c < num_chunks, other=0)
    start = tl.sum(tl.where(c < chunk, counts, 0), axis=0)
    if chunk == 0:
        tl.store(counts_ptr + dst, tl.sum(counts, axis=0), mask=write)
    # NOTE: a row not to be written has no slots.
    num_slots = tl.where(write, K, 0)
    if start < num_slots:
        # NOTE: the chunk stays a [CHUNK/8, 8] tile (byte, bit): the exclusive prefix sum runs over the bytes'
        # popcounts and, inside each byte, over 8 bits, so no [CHUNK] scan or reshape is needed.
        byte_ids = chunk * (CHUNK // 8) + tl.arange(0, CHUNK // 8)
        packed = tl.load(packed_mask_ptr + dst * packed_mask_stride + byte_ids,
                         mask=byte_ids < (vocab_size + 7) // 8, other=0).to(tl.int32)
        shifts = tl.arange(0, 8)[None, :]
        flags = (packed[:, None] >> shifts) & 1  # [CHUNK // 8, 8]
        per_byte = tl.sum(flags, axis=1)  # [CHUNK // 8]
        byte_start = start + tl.cumsum(per_byte, axis=0) - per_byte
        slots = byte_start[:, None] + tl.cumsum(flags, axis=1) - flags  # [CHUNK // 8, 8]
        ids = byte_ids[:, None] * 8 + shifts
        tl.store(token_ids_ptr + dst * token_ids_stride + slots, ids.to(tl.int32), mask=(flags > 0) & (slots < num_slots))


def compact_sampling_mask_chunked(logits: torch.Tensor, num_sampled: torch.Tensor, token_ids: torch.Tensor,
                                  packed_mask: torch.Tensor, counts: torch.Tensor, chunk: int = CHUNK,
                                  num_warps: int = NUM_WARPS, dst_rows: torch.Tensor | None = None,
                                  hit: torch.Tensor | None = None) -> None:
    """Fill token_ids [R, K] int32, packed_mask [R, ceil(V/8)] uint8 and counts [R] int32 from logits [R, V].

    `chunk` and `num_warps` select the first launch's tiling (the defaults are the measured best, which the
    product uses; the kernel benchmark's --tilings compares the others, and the tests check them).
    With `dst_rows` ([n] int64) and `hit` ([n] bool), logits is [n, V] and its row i goes to row dst_rows[i] of
    the outputs (and reads num_sampled there), only where hit[i]; the outputs' other rows are left as they are
    (the sampler's general path writes its recomputed rows into the fast path's mask this way)."""
    if (dst_rows is None) != (hit is None):
        raise ValueError("dst_rows and hit go together")
    if logits.shape[0] == 0:
        return
    chunk_counts = launch_pack_count(logits, num_sampled, packed_mask, chunk, num_warps, dst_rows, hit)
    launch_compact(packed_mask, chunk_counts, token_ids, counts, logits.shape[1], chunk, dst_rows=dst_rows,
                   hit=hit)


def compact_sampling_mask_torch(logits: torch.Tensor, num_sampled: torch.Tensor, token_ids: torch.Tensor,
                                packed_mask: torch.Tensor, counts: torch.Tensor) -> None:
    """`compact_sampling_mask_chunked`'s outputs (without `dst_rows`) with torch ops, on any device."""
    keep = torch.isfinite(logits) & (num_sampled.to(logits.device) > 0)[:, None]  # [R, V] bool
    counts.copy_(keep.sum(-1))
    rows, cols = keep.nonzero(as_tuple=True)
    slots = (keep.cumsum(-1, dtype=torch.int32) - 1)[rows, cols]
    inside = slots < token_ids.shape[1]
    token_ids[rows[inside], slots[inside]] = cols[inside].to(torch.int32)
    packed_mask.copy_(pack_bool_mask(keep))


def pack_bool_mask(keep: torch.Tensor) -> torch.Tensor:
    """[R, V] bool -> [R, ceil(V/8)] uint8, bit j of byte b is token 8b+j (little bit order)."""
    num_reqs, vocab_size = keep.shape
    pad = (-vocab_size) % 8
    if pad:
        keep = torch.nn.functional.pad(keep, (0, pad))
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=keep.device)
    return (keep.reshape(num_reqs, -1, 8).to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)


def launch_pack_count(logits: torch.Tensor, num_sampled: torch.Tensor, packed_mask: torch.Tensor,
                      chunk: int = CHUNK, num_warps: int = NUM_WARPS, dst_rows: torch.Tensor | None = None,
                      hit: torch.Tensor | None = None) -> torch.Tensor:
    """First launch: the bitmask and [R, num_chunks] int32 keep counts per chunk (returned)."""
    num_reqs, vocab_size = logits.shape
    num_chunks = triton.cdiv(vocab_size, chunk)
    chunk_counts = torch.empty(num_reqs, num_chunks, dtype=torch.int32, device=logits.device)
    has_dst = dst_rows is not None and hit is not None
    _pack_count_kernel[(num_reqs, num_chunks)](
        logits, logits.stride(0), num_sampled, packed_mask, packed_mask.stride(0), chunk_counts, num_chunks,
        vocab_size, dst_rows if has_dst else num_sampled, hit if has_dst else num_sampled, CHUNK=chunk,
        HAS_DST=has_dst, num_warps=num_warps)
    return chunk_counts


def launch_compact(packed_mask: torch.Tensor, chunk_counts: torch.Tensor, token_ids: torch.Tensor,
                   counts: torch.Tensor, vocab_size: int, chunk: int = CHUNK, num_warps: int = 4,
                   dst_rows: torch.Tensor | None = None, hit: torch.Tensor | None = None) -> None:
    """Second launch: ascending ids into token_ids[:, :K] and the full counts, from the bitmask."""
    num_reqs, num_chunks = chunk_counts.shape
    has_dst = dst_rows is not None and hit is not None
    _compact_kernel[(num_reqs, num_chunks)](
        packed_mask, packed_mask.stride(0), chunk_counts, num_chunks, token_ids, max(token_ids.stride(0), 1),
        counts, vocab_size, token_ids.shape[1], dst_rows if has_dst else counts, hit if has_dst else counts,
        CHUNK=chunk, MAX_CHUNKS=triton.next_power_of_2(num_chunks), HAS_DST=has_dst, num_warps=num_warps)


@triton.jit
def _compact_candidates_kernel(
    values_ptr,  # [num_reqs, C] float32: -inf where the candidate was removed
    values_stride,
    ids_ptr,  # [num_reqs, C] int32, ascending where kept
    ids_stride,
    mask_rows_ptr,  # [num_reqs] int32: 0 for rows whose mask is not wanted
    token_ids_ptr,  # [num_reqs, K] int32 out
    token_ids_stride,
    counts_ptr,  # [num_reqs] int32 out
    num_cand,
    num_kept,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    # NOTE: rows whose mask is not wanted read nothing: their valid range is empty.
    valid = offs < tl.where(tl.load(mask_rows_ptr + row) > 0, num_cand, 0)
    values = tl.load(values_ptr + row * values_stride + offs, mask=valid, other=float("-inf"))
    ids = tl.load(ids_ptr + row * ids_stride + offs, mask=valid, other=0)
    # NOTE: NaN > -inf is false, as in torch: a NaN value is not kept.
    kept = valid & (values > float("-inf"))
    flags = kept.to(tl.int32)
    slots = tl.cumsum(flags, 0) - flags
    tl.store(token_ids_ptr + row * token_ids_stride + slots, ids, mask=kept & (slots < num_kept))
    tl.store(counts_ptr + row, tl.sum(flags, 0))


def compact_candidates(values: torch.Tensor, ids: torch.Tensor, mask_rows: torch.Tensor, num_kept: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler fast path's support from its candidates, in one launch: values [R, C] float32 (-inf where
    removed), ids [R, C] int32 (ascending), mask_rows [R] -> (token_ids [R, K] int32 with each row's kept ids in
    its first min(count, K) slots, counts [R] int32). Rows whose mask_rows is 0 count 0.

    Reads R x C x 8 bytes (~5 MB at 1024 rows, C = 640): a few us, against ~6 torch launches (cumsum, where,
    scatter, sum, slice copy) it replaces on CUDA. CPU tensors outside the Triton interpreter use torch ops."""
    num_reqs, num_cand = ids.shape
    device = ids.device
    token_ids = torch.empty((num_reqs, num_kept), dtype=torch.int32, device=device)
    counts = torch.empty((num_reqs,), dtype=torch.int32, device=device)
    mask_rows = mask_rows.to(device=device, dtype=torch.int32)
    if num_reqs == 0:
        return token_ids, counts
    if ids.is_cuda or triton.knobs.runtime.interpret:
        _compact_candidates_kernel[(num_reqs,)](
            values, values.stride(0), ids, ids.stride(0), mask_rows, token_ids, max(token_ids.stride(0), 1), counts,
            num_cand, num_kept, BLOCK=triton.next_power_of_2(num_cand))
        return token_ids, counts
    kept = (values > float("-inf")) & (mask_rows > 0)[:, None]  # [R, C] bool
    slots = kept.cumsum(dim=-1) - 1  # [R, C]
    # NOTE: column K is a sink for everything not stored; it is cut off below.
    slots = torch.where(kept & (slots < num_kept), slots, num_kept)
    sink = torch.empty((num_reqs, num_kept + 1), dtype=torch.int32, device=device)
    sink.scatter_(1, slots, ids)
    token_ids.copy_(sink[:, :num_kept])
    counts.copy_(kept.sum(dim=-1))
    return token_ids, counts
