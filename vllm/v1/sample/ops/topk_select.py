"""Top-k candidate selection without sorting the vocabulary.

Role: for every row, `select_top_k_candidates` finds the k-th largest of z = logits / temperature (k = the
row's top_k) and writes the ids of every z >= that threshold, in ascending id order, with their z values, into
a [num_reqs, C] buffer. The fast sampler (vllm/v1/sample/fast_path.py) does everything else on that buffer.

On CUDA tensors the select is the prefilter (`_select_prefilter`, topk_prefilter.py): the maximum z of every 32
consecutive ids bounds kth from below; one program per row gathers the few z above that bound, in id order, into
a per-row buffer and selects on it; a row whose buffer overflows is selected from its ~k listed chunks by
bisection, and the rare row with over 2C chunks listed (ties) by the radix kernel (`_topk_select_kernel`, one
program per row: z mapped to an int32 key whose signed order is the float order, -0.0 first turned into +0.0, NaN
keys above +inf or below -inf; three histogram passes over 11, 11 and 10 key bits give the exact key of the k-th
largest value, a fourth pass writes every key >= it). One read of the logits and a re-read of ~k * 32 ids per
row, no host sync. On the H200 at 1024 x 151936 bf16: ~0.42 ms, against ~1.48 for torch.topk over C columns plus
a counting read and ~17.6 for the radix kernel on every row (the alternatives measured and retired,
docs/benchmarks.md); one overflow row adds ~0.1 ms, a radix row ~3 ms. On CPU tensors (the CPU engine, and the
tests' reference) `_select_torch` gives the same outputs bit for bit.

Invariants:
- z is computed as an IEEE round-to-nearest division, so it is bitwise the `logits / temperature` of the
  general path and top-k ties are the same ties.
- counts[r] = |{i : z_i >= kth_r}| (ties at the threshold included, so it can exceed k); ids[r, :counts[r]]
  ascending, values[r, :counts[r]] their z, kth[r] the threshold.
- counts[r] == -1 marks a row the buffer cannot represent exactly (more than C values >= kth, or a NaN or
  +inf anywhere in z, or a threshold of -inf); its ids/values are not written. The caller runs the general
  full-vocabulary path for those rows.
- Prefilter rows are never -1 for lack of room in its buffer: overflow rows are selected again exactly.
"""

from __future__ import annotations

import logging

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vllm.v1.sample.ops.float_keys import float_to_key
from vllm.v1.sample.ops.topk_prefilter import PrefilterScratch, prefilter_select

_BLOCK_SIZE = 1024
_PREFILTER_CHUNK = 32
_PREFILTER_CAP = 2048
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
    return z, float_to_key(z)


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
    row_flag_ptr,  # [num_reqs] int32 (HAS_FLAG): a row whose flag is 0 is left as it is
    vocab_size,
    num_cand,
    BLOCK_SIZE: tl.constexpr,
    HAS_FLAG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if HAS_FLAG:
        if tl.load(row_flag_ptr + row) == 0:
            return
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


_kernel_failed = False


def _disable_kernel() -> None:
    # NOTE: a Triton build that cannot compile the select kernel falls back, loudly and once, to the torch
    # version (same outputs, torch.topk speed) instead of taking the engine down.
    global _kernel_failed
    _kernel_failed = True
    logger.exception("The top-k select kernel failed to compile; using the torch select from now on.")


def select_top_k_candidates(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                            num_cand: int, use_triton: bool | None = None, block_size: int = _BLOCK_SIZE,
                            prefilter_chunk: int = _PREFILTER_CHUNK,
                            prefilter_cap: int | None = None) -> TopKCandidates:
    """logits: [num_reqs, V] float (unit stride on V); temperature: [num_reqs] float32 (> 0); top_k:
    [num_reqs] int; num_cand: the buffer width C. use_triton (default: logits.is_cuda) runs the prefilter's
    kernels, which on CPU tensors need TRITON_INTERPRET; otherwise the equivalent torch version runs.

    block_size: the radix kernel's block, and the values a prefilter row program handles at a time (a
    chunk-maximum program reads 4 blocks); prefilter_chunk: S, the ids behind one chunk maximum; prefilter_cap:
    the prefilter's per-row buffer (default max(2048, 2 * C), at least C)."""
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    if not 2 <= prefilter_chunk <= block_size or prefilter_chunk & (prefilter_chunk - 1):
        raise ValueError(f"prefilter_chunk must be a power of two in [2, block_size], got {prefilter_chunk}")
    cap = max(_PREFILTER_CAP, 2 * num_cand) if prefilter_cap is None else prefilter_cap
    if cap < num_cand:
        raise ValueError(f"prefilter_cap must be at least num_cand ({num_cand}), got {cap}")
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
    out = (ids, values, counts, kth)
    if num_reqs == 0:
        pass
    elif (use_triton if use_triton is not None else logits.is_cuda) and not _kernel_failed:
        try:
            _select_prefilter(logits, temperature, top_k, *out, block_size, prefilter_chunk, cap)
        except triton.CompilationError:
            _disable_kernel()
            _select_torch(logits, temperature, top_k, *out)
    else:
        _select_torch(logits, temperature, top_k, *out)
    return TopKCandidates(*out)


def _run_row_kernel(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, ids: torch.Tensor,
                    values: torch.Tensor, counts: torch.Tensor, kth: torch.Tensor, block_size: int,
                    row_flag: torch.Tensor | None = None) -> None:
    """The radix select, one program per row; with row_flag ([num_reqs] int32) only the rows flagged nonzero."""
    num_reqs, vocab_size = logits.shape
    # NOTE: without a flag, counts stands in for its pointer; HAS_FLAG=False compiles the read away.
    _topk_select_kernel[(num_reqs,)](
        logits, logits.stride(0), temperature, top_k, ids, values, ids.stride(0), counts, kth,
        counts if row_flag is None else row_flag, vocab_size, ids.shape[1], BLOCK_SIZE=block_size,
        HAS_FLAG=row_flag is not None)


def _select_prefilter(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, ids: torch.Tensor,
                      values: torch.Tensor, counts: torch.Tensor, kth: torch.Tensor, block_size: int, chunk: int,
                      cap: int) -> PrefilterScratch:
    """The prefilter (topk_prefilter.py), then the radix kernel on the rows it flags (overflow, long chunk list)."""
    scratch = prefilter_select(logits, temperature, top_k, ids, values, counts, kth, block_size, chunk, cap)
    _run_row_kernel(logits, temperature, top_k, ids, values, counts, kth, block_size, row_flag=scratch.row_flag)
    return scratch


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
    sink_ids = torch.empty((num_reqs, num_cand + 1), dtype=torch.int32, device=logits.device)
    sink_values = torch.empty((num_reqs, num_cand + 1), dtype=torch.float32, device=logits.device)
    all_ids = torch.arange(vocab_size, dtype=torch.int32, device=logits.device).expand(num_reqs, -1)
    sink_ids.scatter_(1, slots, all_ids)
    sink_values.scatter_(1, slots, z)
    ids.copy_(sink_ids[:, :num_cand])
    values.copy_(sink_values[:, :num_cand])
    counts.copy_(torch.where(ok, count, -1))
    kth.copy_(threshold[:, 0])
