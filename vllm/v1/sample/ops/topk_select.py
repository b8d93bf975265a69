"""Top-k candidate selection without sorting the vocabulary: a radix select over the float bits of each row.

Role: for every row, `select_top_k_candidates` finds the k-th largest of z = logits / temperature (k = the
row's top_k) and writes the ids of every z >= that threshold, in ascending id order, with their z values, into
a [num_reqs, C] buffer. The fast sampler (vllm/v1/sample/fast_path.py) does everything else on that buffer.

Algorithm (four reads of the row, no sort):
- z is mapped to an int32 key whose signed order is the float order (-0.0 is first turned into +0.0 so that
  equal floats get equal keys; NaN keys lie above +inf or below -inf).
- Three histogram passes over 11, 11 and 10 bits of the key, each restricted to the prefix chosen by the
  previous one, give the exact key of the k-th largest value, the number of values strictly above it and the
  number equal to it.
- A fourth pass writes ids and values of every key >= the threshold key, slots from an exclusive prefix sum.

Two implementations of that algorithm (`impl`):
- "row" (`_topk_select_kernel`): one program per row does all four passes.
- "split" (the default on CUDA tensors): each row is cut into segments of `segment_size` ids and every pass
  is a launch over a (num_reqs, num_segments) grid. Histogram passes add their segment's histogram into a
  global [3, num_reqs, 2048] int32 histogram with atomics; the write pass takes staging slots for each
  BLOCK_SIZE block of ids from a per-row atomic counter, and a last per-row launch moves every staged block
  to its place in id order (the exclusive prefix of the block counts). Launch sizes depend only on shapes,
  so nothing waits for the GPU. The outputs are the same as "row" and the torch version, bit for bit.
- "topk" (not a radix select): torch.topk over C columns of the logits gives the threshold, one counting read
  of the row (`_count_at_least_kernel`) the exact count and the NaN/+inf check, and the kept columns sorted by
  id are the candidates. Same outputs as the others.

Invariants:
- z is computed as an IEEE round-to-nearest division, so it is bitwise the `logits / temperature` of the
  general path and top-k ties are the same ties.
- counts[r] = |{i : z_i >= kth_r}| (ties at the threshold included, so it can exceed k); ids[r, :counts[r]]
  ascending, values[r, :counts[r]] their z, kth[r] the threshold.
- counts[r] == -1 marks a row the buffer cannot represent exactly (more than C values >= kth, or a NaN or
  +inf anywhere in z, or a threshold of -inf); its ids/values are not written. The caller runs the general
  full-vocabulary path for those rows.
"""

from __future__ import annotations

import logging

from typing import NamedTuple

import torch
import triton
import triton.language as tl

_BLOCK_SIZE = 1024
# NOTE: "split" spreads each row over many programs; "row" (one program per row) is kept for comparison.
DEFAULT_CUDA_IMPL = "topk"
_IMPLS = ("split", "row", "topk")
_COUNT_CHUNK = 4096
# Split: segments between these sizes, the largest that still gives at least _TARGET_PROGRAMS programs.
_MIN_SEGMENT_SIZE = 4096
_MAX_SEGMENT_SIZE = 16384
_TARGET_PROGRAMS = 4096
_ORDER_BLOCK_SIZE = 512
logger = logging.getLogger(__name__)


class TopKCandidates(NamedTuple):
    # [num_reqs, C] int32: ascending ids of z >= kth; slots >= counts[r] are undefined.
    token_ids: torch.Tensor
    # [num_reqs, C] float32: z = logits / temperature of those ids.
    values: torch.Tensor
    # [num_reqs] int32: |{z >= kth}|, or -1 for rows that need the general path.
    counts: torch.Tensor
    # [num_reqs] float32: the row's k-th largest z.
    kth: torch.Tensor


@triton.jit
def _load_keys(row_ptr, offs, valid, temperature):
    x = tl.load(row_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    z = tl.math.div_rn(x, temperature)
    # NOTE: -0.0 == +0.0 as floats, so both must get the same key.
    z = tl.where(z == 0.0, 0.0, z)
    bits = z.to(tl.int32, bitcast=True)
    keys = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return z, keys


@triton.jit
def _pick_bin(hist, k_rem, NUM_BINS: tl.constexpr):
    """Largest bin b with |{values in bins >= b}| >= k_rem -> (b, count above b, count in b)."""
    bins = tl.arange(0, NUM_BINS)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    chosen = tl.max(tl.where(at_or_above >= k_rem, bins, -1), axis=0)
    above = tl.sum(tl.where(bins > chosen, hist, 0), axis=0)
    inside = tl.sum(tl.where(bins == chosen, hist, 0), axis=0)
    return chosen, above, inside


@triton.jit
def _topk_select_kernel(
    logits_ptr,  # [num_reqs, V] float
    logits_stride,
    temperature_ptr,  # [num_reqs] float32, already 1.0 for greedy rows
    top_k_ptr,  # [num_reqs] int32
    ids_ptr,  # [num_reqs, C] int32
    values_ptr,  # [num_reqs, C] float32
    cand_stride,
    counts_ptr,  # [num_reqs] int32
    kth_ptr,  # [num_reqs] float32
    vocab_size,
    num_cand,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_stride
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    k = tl.minimum(tl.maximum(tl.load(top_k_ptr + row), 1), vocab_size)
    arange = tl.arange(0, BLOCK_SIZE)

    # Pass 1: key bits 31..21 (signed, shifted to 0..2047); also counts NaN and +inf.
    hist1 = tl.zeros((2048,), dtype=tl.int32)
    num_bad = tl.zeros((), dtype=tl.int32)
    for start in range(0, vocab_size, BLOCK_SIZE):
        offs = start + arange
        valid = offs < vocab_size
        z, keys = _load_keys(row_ptr, offs, valid, temperature)
        hist1 += tl.histogram((keys >> 21) + 1024, 2048, mask=valid)
        bad = valid & ((z != z) | (z == float("inf")))
        num_bad += tl.sum(bad.to(tl.int32), axis=0)
    bin1, above1, inside1 = _pick_bin(hist1, k, 2048)
    prefix1 = bin1 - 1024
    k_rem = k - above1

    # Pass 2: key bits 20..10 among keys whose bits 31..21 equal prefix1.
    hist2 = tl.zeros((2048,), dtype=tl.int32)
    for start in range(0, vocab_size, BLOCK_SIZE):
        offs = start + arange
        valid = offs < vocab_size
        z2, keys2 = _load_keys(row_ptr, offs, valid, temperature)
        hist2 += tl.histogram((keys2 >> 10) & 2047, 2048, mask=valid & ((keys2 >> 21) == prefix1))
    bin2, above2, inside2 = _pick_bin(hist2, k_rem, 2048)
    prefix2 = (prefix1 << 11) | bin2
    k_rem = k_rem - above2

    # Pass 3: key bits 9..0 among keys whose bits 31..10 equal prefix2.
    hist3 = tl.zeros((1024,), dtype=tl.int32)
    for start in range(0, vocab_size, BLOCK_SIZE):
        offs = start + arange
        valid = offs < vocab_size
        z3, keys3 = _load_keys(row_ptr, offs, valid, temperature)
        hist3 += tl.histogram(keys3 & 1023, 1024, mask=valid & ((keys3 >> 10) == prefix2))
    bin3, above3, inside3 = _pick_bin(hist3, k_rem, 1024)
    kth_key = (prefix2 << 10) | bin3
    count = above1 + above2 + above3 + inside3
    kth_bits = tl.where(kth_key < 0, kth_key ^ 0x7FFFFFFF, kth_key)
    kth = kth_bits.to(tl.float32, bitcast=True)
    ok = (num_bad == 0) & (count <= num_cand) & (kth > float("-inf"))
    tl.store(kth_ptr + row, kth)
    tl.store(counts_ptr + row, tl.where(ok, count, -1))

    # Pass 4: ids and values of every key >= kth_key, ascending.
    num_write = tl.where(ok, vocab_size, 0)
    slot_base = tl.zeros((), dtype=tl.int32)
    for start in range(0, num_write, BLOCK_SIZE):
        offs = start + arange
        valid = offs < vocab_size
        z, keys = _load_keys(row_ptr, offs, valid, temperature)
        keep = valid & (keys >= kth_key)
        flags = keep.to(tl.int32)
        slots = slot_base + tl.cumsum(flags, axis=0) - flags
        tl.store(ids_ptr + row * cand_stride + slots, offs.to(tl.int32), mask=keep)
        tl.store(values_ptr + row * cand_stride + slots, z, mask=keep)
        slot_base += tl.sum(flags, axis=0)


@triton.jit
def _resolve_prefix(hist_ptr, num_reqs, row, k, NUM_DONE: tl.constexpr):
    """Replays `_pick_bin` over the global histograms of the first NUM_DONE passes of the split select.

    -> (key prefix so far, k left inside it, values strictly above the prefix, values inside the last bin).
    """
    # NOTE: every program of a pass recomputes the previous bin choices from the global histograms (at most
    # 5120 L2-resident ints and three cumsums) instead of a per-row pick kernel between passes: that kernel
    # would add three serialized launches of only num_reqs programs each, which cost more than the re-reads.
    bins = tl.arange(0, 2048)
    hist1 = tl.load(hist_ptr + row * 2048 + bins)
    bin1, above, inside = _pick_bin(hist1, k, 2048)
    prefix = bin1 - 1024
    k_rem = k - above
    if NUM_DONE >= 2:
        hist2 = tl.load(hist_ptr + (num_reqs + row) * 2048 + bins)
        bin2, above2, inside = _pick_bin(hist2, k_rem, 2048)
        prefix = (prefix << 11) | bin2
        k_rem = k_rem - above2
        above = above + above2
    if NUM_DONE >= 3:
        bins3 = tl.arange(0, 1024)
        hist3 = tl.load(hist_ptr + (2 * num_reqs + row) * 2048 + bins3)
        bin3, above3, inside = _pick_bin(hist3, k_rem, 1024)
        prefix = (prefix << 10) | bin3
        k_rem = k_rem - above3
        above = above + above3
    return prefix, k_rem, above, inside


@triton.jit
def _split_hist_kernel(
    logits_ptr,  # [num_reqs, V] float
    logits_stride,
    temperature_ptr,  # [num_reqs] float32
    top_k_ptr,  # [num_reqs] int32
    hist_ptr,  # [3, num_reqs, 2048] int32, zeroed before pass 1
    bad_ptr,  # [num_reqs] int32, zeroed before pass 1
    num_reqs,
    vocab_size,
    segment_size,
    PASS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seg_start = tl.program_id(1) * segment_size
    seg_stop = tl.minimum(seg_start + segment_size, vocab_size)
    row_ptr = logits_ptr + row * logits_stride
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    k = tl.minimum(tl.maximum(tl.load(top_k_ptr + row), 1), vocab_size)
    arange = tl.arange(0, BLOCK_SIZE)
    if PASS == 1:
        bins1 = tl.arange(0, 2048)
        hist1 = tl.zeros((2048,), dtype=tl.int32)
        num_bad = tl.zeros((), dtype=tl.int32)
        for start1 in range(seg_start, seg_stop, BLOCK_SIZE):
            offs1 = start1 + arange
            valid1 = offs1 < seg_stop
            z1, keys1 = _load_keys(row_ptr, offs1, valid1, temperature)
            hist1 += tl.histogram((keys1 >> 21) + 1024, 2048, mask=valid1)
            bad = valid1 & ((z1 != z1) | (z1 == float("inf")))
            num_bad += tl.sum(bad.to(tl.int32), axis=0)
        tl.atomic_add(bad_ptr + row, num_bad, mask=num_bad > 0, sem="relaxed")
        tl.atomic_add(hist_ptr + row * 2048 + bins1, hist1, mask=hist1 > 0, sem="relaxed")
    elif PASS == 2:
        prefix1, k_rem1, above1, inside1 = _resolve_prefix(hist_ptr, num_reqs, row, k, 1)
        bins2 = tl.arange(0, 2048)
        hist2 = tl.zeros((2048,), dtype=tl.int32)
        for start2 in range(seg_start, seg_stop, BLOCK_SIZE):
            offs2 = start2 + arange
            valid2 = offs2 < seg_stop
            z2, keys2 = _load_keys(row_ptr, offs2, valid2, temperature)
            match2 = valid2 & ((keys2 >> 21) == prefix1)
            # NOTE: blocks without a key in the prefix skip the histogram's shared-memory round trip.
            if tl.sum(match2.to(tl.int32), axis=0) > 0:
                hist2 += tl.histogram((keys2 >> 10) & 2047, 2048, mask=match2)
        tl.atomic_add(hist_ptr + (num_reqs + row) * 2048 + bins2, hist2, mask=hist2 > 0, sem="relaxed")
    else:
        prefix2, k_rem2, above2, inside2 = _resolve_prefix(hist_ptr, num_reqs, row, k, 2)
        bins3 = tl.arange(0, 1024)
        hist3 = tl.zeros((1024,), dtype=tl.int32)
        for start3 in range(seg_start, seg_stop, BLOCK_SIZE):
            offs3 = start3 + arange
            valid3 = offs3 < seg_stop
            z3, keys3 = _load_keys(row_ptr, offs3, valid3, temperature)
            match3 = valid3 & ((keys3 >> 10) == prefix2)
            if tl.sum(match3.to(tl.int32), axis=0) > 0:
                hist3 += tl.histogram(keys3 & 1023, 1024, mask=match3)
        tl.atomic_add(hist_ptr + (2 * num_reqs + row) * 2048 + bins3, hist3, mask=hist3 > 0, sem="relaxed")


@triton.jit
def _split_write_kernel(
    logits_ptr,  # [num_reqs, V] float
    logits_stride,
    temperature_ptr,  # [num_reqs] float32
    top_k_ptr,  # [num_reqs] int32
    hist_ptr,  # [3, num_reqs, 2048] int32, filled by the three histogram passes
    bad_ptr,  # [num_reqs] int32
    slot_ptr,  # [num_reqs] int32, zeroed: staging slots taken so far
    block_count_ptr,  # [num_reqs, num_blocks] int32, zeroed
    block_base_ptr,  # [num_reqs, num_blocks] int32: first staging slot of each block
    num_blocks,
    stage_ids_ptr,  # [num_reqs, C] int32
    stage_values_ptr,  # [num_reqs, C] float32
    cand_stride,
    counts_ptr,  # [num_reqs] int32
    kth_ptr,  # [num_reqs] float32
    num_reqs,
    vocab_size,
    num_cand,
    segment_size,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    seg_start = seg * segment_size
    seg_stop = tl.minimum(seg_start + segment_size, vocab_size)
    row_ptr = logits_ptr + row * logits_stride
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    k = tl.minimum(tl.maximum(tl.load(top_k_ptr + row), 1), vocab_size)
    kth_key, k_rem, above, inside = _resolve_prefix(hist_ptr, num_reqs, row, k, 3)
    count = above + inside
    kth_bits = tl.where(kth_key < 0, kth_key ^ 0x7FFFFFFF, kth_key)
    kth = kth_bits.to(tl.float32, bitcast=True)
    num_bad = tl.load(bad_ptr + row)
    ok = (num_bad == 0) & (count <= num_cand) & (kth > float("-inf"))
    tl.store(kth_ptr + row, kth, mask=seg == 0)
    tl.store(counts_ptr + row, tl.where(ok, count, -1), mask=seg == 0)

    arange = tl.arange(0, BLOCK_SIZE)
    write_stop = tl.where(ok, seg_stop, seg_start)
    for start in range(seg_start, write_stop, BLOCK_SIZE):
        offs = start + arange
        valid = offs < seg_stop
        z, keys = _load_keys(row_ptr, offs, valid, temperature)
        keep = valid & (keys >= kth_key)
        flags = keep.to(tl.int32)
        num_keep = tl.sum(flags, axis=0)
        base = tl.atomic_add(slot_ptr + row, num_keep, mask=num_keep > 0, sem="relaxed")
        slots = base + tl.cumsum(flags, axis=0) - flags
        tl.store(stage_ids_ptr + row * cand_stride + slots, offs.to(tl.int32), mask=keep)
        tl.store(stage_values_ptr + row * cand_stride + slots, z, mask=keep)
        block = row * num_blocks + start // BLOCK_SIZE
        tl.store(block_count_ptr + block, num_keep)
        tl.store(block_base_ptr + block, base, mask=num_keep > 0)


@triton.jit
def _split_order_kernel(
    stage_ids_ptr,  # [num_reqs, C] int32
    stage_values_ptr,  # [num_reqs, C] float32
    block_start_ptr,  # [num_reqs, num_blocks] int32: exclusive prefix of the block counts
    block_base_ptr,  # [num_reqs, num_blocks] int32
    num_blocks,
    ids_ptr,  # [num_reqs, C] int32
    values_ptr,  # [num_reqs, C] float32
    cand_stride,
    counts_ptr,  # [num_reqs] int32
    BLOCK_SIZE: tl.constexpr,
    ORDER_BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    count = tl.load(counts_ptr + row)
    arange = tl.arange(0, ORDER_BLOCK_SIZE)
    for start in range(0, count, ORDER_BLOCK_SIZE):
        slots = start + arange
        live = slots < count
        ids = tl.load(stage_ids_ptr + row * cand_stride + slots, mask=live, other=0)
        values = tl.load(stage_values_ptr + row * cand_stride + slots, mask=live, other=0.0)
        block = row * num_blocks + ids // BLOCK_SIZE
        dest = (tl.load(block_start_ptr + block, mask=live, other=0) + slots
                - tl.load(block_base_ptr + block, mask=live, other=0))
        tl.store(ids_ptr + row * cand_stride + dest, ids, mask=live)
        tl.store(values_ptr + row * cand_stride + dest, values, mask=live)


_kernel_failed = False


def _disable_kernel() -> None:
    # NOTE: a Triton build that cannot compile the select kernel falls back, loudly and once, to the torch
    # version (same outputs, torch.topk speed) instead of taking the engine down.
    global _kernel_failed
    _kernel_failed = True
    logger.exception("The top-k select kernel failed to compile; using the torch select from now on.")


def select_top_k_candidates(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                            num_cand: int, use_triton: bool | None = None, impl: str | None = None,
                            segment_size: int | None = None, block_size: int = _BLOCK_SIZE) -> TopKCandidates:
    """logits: [num_reqs, V] float (unit stride on V); temperature: [num_reqs] float32 (> 0); top_k:
    [num_reqs] int; num_cand: the buffer width C. use_triton (default: logits.is_cuda) runs a kernel,
    which on CPU tensors needs TRITON_INTERPRET; otherwise an equivalent torch version runs.

    impl: "split" or "row" (default: DEFAULT_CUDA_IMPL on CUDA tensors, "row" elsewhere). segment_size (split
    only; default from `split_segment_size`) must be a multiple of block_size, a power of two."""
    if impl is not None and impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    if segment_size is not None and (segment_size <= 0 or segment_size % block_size):
        raise ValueError(f"segment_size must be a positive multiple of block_size={block_size}, got {segment_size}")
    num_reqs, vocab_size = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    device = logits.device
    ids = torch.empty((num_reqs, num_cand), dtype=torch.int32, device=device)  # [num_reqs, C]
    values = torch.empty((num_reqs, num_cand), dtype=torch.float32, device=device)  # [num_reqs, C]
    counts = torch.empty((num_reqs,), dtype=torch.int32, device=device)  # [num_reqs]
    kth = torch.empty((num_reqs,), dtype=torch.float32, device=device)  # [num_reqs]
    temperature = temperature.to(device=device, dtype=torch.float32).contiguous()
    top_k = top_k.to(device=device, dtype=torch.int32).contiguous()
    if impl is None:
        impl = DEFAULT_CUDA_IMPL if logits.is_cuda else "row"
    if num_reqs == 0:
        pass
    elif (use_triton if use_triton is not None else logits.is_cuda) and not _kernel_failed:
        try:
            if impl == "topk":
                _select_topk(logits, temperature, top_k, ids, values, counts, kth)
            elif impl == "row":
                _topk_select_kernel[(num_reqs,)](
                    logits, logits.stride(0), temperature, top_k, ids, values, num_cand, counts, kth, vocab_size,
                    num_cand, BLOCK_SIZE=block_size)
            else:
                if segment_size is None:
                    segment_size = split_segment_size(num_reqs, vocab_size, block_size)
                _select_split(logits, temperature, top_k, ids, values, counts, kth, segment_size, block_size)
        except triton.CompilationError:
            _disable_kernel()
            _select_torch(logits, temperature, top_k, ids, values, counts, kth)
    else:
        _select_torch(logits, temperature, top_k, ids, values, counts, kth)
    return TopKCandidates(ids, values, counts, kth)


def split_segment_size(num_reqs: int, vocab_size: int, block_size: int = _BLOCK_SIZE) -> int:
    """The largest power-of-two segment in [_MIN_SEGMENT_SIZE, _MAX_SEGMENT_SIZE] (and a multiple of
    block_size) that still gives num_reqs * num_segments >= _TARGET_PROGRAMS programs per launch."""
    # NOTE: few rows need short segments to fill the GPU; many rows want long ones, since every program
    # replays the bin choice over up to 5120 histogram bins and adds its histogram with atomics.
    segment = max(_MAX_SEGMENT_SIZE, block_size)
    smallest = max(_MIN_SEGMENT_SIZE, block_size)
    while segment > smallest and num_reqs * triton.cdiv(vocab_size, segment) < _TARGET_PROGRAMS:
        segment //= 2
    return segment


def _select_split(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, ids: torch.Tensor,
                  values: torch.Tensor, counts: torch.Tensor, kth: torch.Tensor, segment_size: int,
                  block_size: int) -> None:
    num_reqs, vocab_size = logits.shape
    num_cand = ids.shape[1]
    device = logits.device
    num_segments = triton.cdiv(vocab_size, segment_size)
    num_blocks = triton.cdiv(vocab_size, block_size)
    # NOTE: one memset for everything that is accumulated with atomics.
    scratch = torch.zeros(num_reqs * (3 * 2048 + 2 + num_blocks), dtype=torch.int32, device=device)
    hist = scratch[:3 * 2048 * num_reqs]  # [3, num_reqs, 2048] int32
    bad = scratch[3 * 2048 * num_reqs:(3 * 2048 + 1) * num_reqs]  # [num_reqs] int32
    slot = scratch[(3 * 2048 + 1) * num_reqs:(3 * 2048 + 2) * num_reqs]  # [num_reqs] int32
    block_count = scratch[(3 * 2048 + 2) * num_reqs:].view(num_reqs, num_blocks)  # [num_reqs, num_blocks] int32
    block_base = torch.empty((num_reqs, num_blocks), dtype=torch.int32, device=device)
    stage_ids = torch.empty_like(ids)  # [num_reqs, C] int32
    stage_values = torch.empty_like(values)  # [num_reqs, C] float32
    grid = (num_reqs, num_segments)
    for pass_id in (1, 2, 3):
        _split_hist_kernel[grid](logits, logits.stride(0), temperature, top_k, hist, bad, num_reqs, vocab_size,
                                 segment_size, PASS=pass_id, BLOCK_SIZE=block_size)
    _split_write_kernel[grid](logits, logits.stride(0), temperature, top_k, hist, bad, slot, block_count,
                              block_base, num_blocks, stage_ids, stage_values, num_cand, counts, kth, num_reqs,
                              vocab_size, num_cand, segment_size, BLOCK_SIZE=block_size)
    block_start = torch.cumsum(block_count, dim=1, dtype=torch.int32).sub_(block_count)  # [num_reqs, num_blocks]
    _split_order_kernel[(num_reqs,)](stage_ids, stage_values, block_start, block_base, num_blocks, ids, values,
                                     num_cand, counts, BLOCK_SIZE=block_size, ORDER_BLOCK_SIZE=_ORDER_BLOCK_SIZE)


@triton.jit
def _count_at_least_kernel(
    logits_ptr,  # [num_reqs, V] float
    logits_stride,
    temperature_ptr,  # [num_reqs] float32
    kth_ptr,  # [num_reqs] float32
    count_ptr,  # [num_reqs] int32, zeroed
    bad_ptr,  # [num_reqs] int32, zeroed
    vocab_size,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    valid = offs < vocab_size
    x = tl.load(logits_ptr + row * logits_stride + offs, mask=valid, other=float("-inf")).to(tl.float32)
    z = tl.math.div_rn(x, tl.load(temperature_ptr + row))
    kept = valid & (z >= tl.load(kth_ptr + row))
    bad = valid & ((z != z) | (z == float("inf")))
    tl.atomic_add(count_ptr + row, tl.sum(kept.to(tl.int32), axis=0), sem="relaxed")
    tl.atomic_add(bad_ptr + row, tl.sum(bad.to(tl.int32), axis=0), sem="relaxed")


def _select_topk(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, ids: torch.Tensor,
                 values: torch.Tensor, counts: torch.Tensor, kth: torch.Tensor) -> None:
    """The threshold from torch.topk over C = num_cand columns, the exact count from one counting read.

    z = logits / temperature is monotone in the logits, so the C largest logits hold every z >= kth whenever
    there are at most C of them; the counting pass over the whole row (`_count_at_least_kernel`) tells the rows
    where there are more (ties past C: -1), or a NaN/+inf anywhere (-1), exactly as the radix select does."""
    num_reqs, vocab_size = logits.shape
    width = min(ids.shape[1], vocab_size)
    top_logits, top_ids = logits.topk(width, dim=-1)  # [num_reqs, W] descending
    z = top_logits.to(torch.float32) / temperature[:, None]  # [num_reqs, W]
    k = top_k.to(torch.long).clamp(1, vocab_size)[:, None]  # [num_reqs, 1]
    kth_z = z.gather(1, (k - 1).clamp(max=width - 1))  # [num_reqs, 1]
    in_top = z >= kth_z  # [num_reqs, W] bool
    scratch = torch.zeros(2, num_reqs, dtype=torch.int32, device=logits.device)
    _count_at_least_kernel[(num_reqs, triton.cdiv(vocab_size, _COUNT_CHUNK))](
        logits, logits.stride(0), temperature, kth_z, scratch[0], scratch[1], vocab_size, CHUNK=_COUNT_CHUNK,
        num_warps=8)
    full, bad = scratch[0], scratch[1]
    ok = (bad == 0) & (full == in_top.sum(dim=-1)) & (kth_z[:, 0] > float("-inf"))
    # NOTE: ascending ids: the kept columns sorted by id; the others get id V and sort last.
    order_key, order = torch.where(in_top, top_ids, vocab_size).sort(dim=-1)  # [num_reqs, W]
    ids[:, :width] = order_key.to(torch.int32)
    values[:, :width] = z.gather(1, order)
    counts.copy_(torch.where(ok, full, -1))
    kth.copy_(kth_z[:, 0])


def _select_torch(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, ids: torch.Tensor,
                  values: torch.Tensor, counts: torch.Tensor, kth: torch.Tensor) -> None:
    # NOTE: for CPU tensors (the CPU engine, tests); the same outputs as the kernel.
    num_reqs, vocab_size = logits.shape
    num_cand = ids.shape[1]
    z = logits.to(torch.float32) / temperature[:, None]  # [num_reqs, V]
    k = top_k.to(torch.long).clamp(1, vocab_size)[:, None]  # [num_reqs, 1]
    bad = (torch.isnan(z) | (z == float("inf"))).any(dim=-1)  # [num_reqs]
    threshold = z.topk(int(k.max()), dim=-1).values.gather(1, k - 1)  # [num_reqs, 1]
    kept = z >= threshold  # [num_reqs, V] bool
    count = kept.sum(dim=-1)  # [num_reqs]
    ok = ~bad & (count <= num_cand) & (threshold[:, 0] > float("-inf"))
    kept &= ok[:, None]
    slots = torch.where(kept, kept.cumsum(dim=-1) - 1, num_cand)  # [num_reqs, V], column C is a sink
    sink_ids = torch.empty((num_reqs, num_cand + 1), dtype=torch.int32)
    sink_values = torch.empty((num_reqs, num_cand + 1), dtype=torch.float32)
    sink_ids.scatter_(1, slots, torch.arange(vocab_size, dtype=torch.int32).expand(num_reqs, -1))
    sink_values.scatter_(1, slots, z)
    ids.copy_(sink_ids[:, :num_cand])
    values.copy_(sink_values[:, :num_cand])
    counts.copy_(torch.where(ok, count, -1))
    kth.copy_(threshold[:, 0])
