"""The prefilter top-k select ("prefilter" in topk_select.py): the candidates of every row from one read of the
logits and a re-read of ~k * S of its ids, without a host sync, atomics or a sort.

Role: `prefilter_select` writes topk_select.py's outputs (k-th largest z = logits / temperature, the ids of every
z >= it in ascending order, their z, the count) for every row except the overflow rows with a long chunk list,
which it flags in `row_flag`; topk_select.py runs the radix kernel on those.
- `_chunk_max_kernel`: the maximum z of every S = 32 consecutive ids ([num_reqs, NCH], NCH = cdiv(V, S)), many
  programs per row, each reading 4 blocks.
- `_prefilter_select_kernel`, one program per row: t0 = the k-th largest of the row's maxima, exactly (32
  counting steps fix its int32 key one bit at a time); the chunks whose maximum is >= t0 and > -inf, the only
  ones that can hold a z >= t0, are listed in id order (~k of them); their z >= t0 (and > -inf) are appended in
  id order to a [num_reqs, cap] buffer (cap = max(2048, 2C)), stopping once there are more than cap (overflow);
  kth = the k-th largest of the buffer (32 more counting steps), and the buffer's values >= kth, already in id
  order, are the candidates. An overflow row whose list has at most 2C chunks is selected from them instead:
  kth = the k-th largest z of the listed chunks (re-read through the list; bisection on int32 keys between t0's
  and the largest maximum's, one counting pass over the L * S listed ids a step, <= 32 steps), then the z >= kth
  of the listed chunks are gathered again into the buffer (at most C of them unless the row is -1).
For iid values t0 sits where P(chunk max >= t0) = k / NCH, i.e. P(z >= t0) = 1 - (1 - k/NCH)^(1/S): at
V = 151936, k = 512 about 540 values are gathered (well under cap) from ~512 listed chunks (16k ids, 11% of the
row). Values packed in consecutive ids (a cluster above the rest) push t0 down and can overflow (real models'
logits cluster more than iid values). An overflow row costs ~30 counting passes over its L * S listed ids (L ~ k:
16k ids, 16 blocks, at k = 512) and one more gather: ~500 block steps in series, about 5x the ~90 of a plain row
program, i.e. an estimated ~0.5-0.7 ms on the H200 at ~1-1.5 us a latency-bound block step (not measured yet);
the rest of the batch runs beside it. A row sent to the radix kernel costs ~2.9 ms (the radix kernel's time at
64 rows).
The list limit, 2C chunks: L >= k always (k chunks have a maximum >= t0) and k <= C, so L > 2C needs more than C
chunk maxima equal to t0 (over C equal values: a pathological row of ties); it caps an overflow row's counting
passes at 2C * S ids (40960 at C = 640, ~27% of V = 151936: up to ~1280 block steps, ~1.5-2 ms, still under
the radix kernel's 2.9 ms).
Cost at [1024, 151936] bf16: the chunk maxima read 311 MB and write 19 MB; the row programs read the maxima
(19 MB) and ~34 MB of listed ids: ~0.09 ms of traffic at ~4 TB/s. The row programs are latency-bound instead
(~70 block reductions and ~17 gather blocks in series at V = 151936; 64 registers at 1024-value blocks and 4
warps let ~8 rows share an SM, so 1024 rows run in about one wave).

Invariants (besides topk_select.py's on the outputs):
- t0 <= kth, because k distinct chunks have a maximum >= t0, i.e. k values of z are >= t0; so every z >= kth is
  in the buffer unless it overflowed, and the buffer's k-th largest is the row's kth (when kth = -inf, fewer
  than k values are > -inf, the buffer holds fewer than k and kth is -inf too). A row with k > NCH has no such
  bound: t0 = -inf (it gathers every z > -inf); a row with k > C is -1 whatever its kth (k values >= it):
  t0 = +inf. Overflow rows are those not bad (no NaN/+inf), with k <= C and more than cap values gathered.
- The listed chunks hold every z >= t0, so the k-th largest of their z is the row's kth (t0 <= kth), and at least
  k of their z have a key >= t0's (with k > NCH: all of them > -inf, more than cap >= k), which starts the
  bisection. An overflow row is selected in the row program (`refined`) or flagged for the radix kernel
  (`row_flag`), never both; its count is |{z >= kth}|, all in the listed chunks, gathered again (past cap: -1).
- The buffer is in ascending id order (chunks listed in order, slots from a running exclusive cumsum), so the
  candidates are its values >= kth in slot order. kth is decoded from its key: a zero threshold is +0.0, as in
  the radix kernel.
- A row program reads its own global stores (the chunk list, the buffer) back from other threads only after a
  barrier.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vllm.v1.sample.ops.float_keys import float_to_key, key_to_float

_CHUNK_MAX_BLOCKS = 4
# NOTE: the list limit, in chunks per candidate slot (module docstring).
_MAX_LISTED_PER_CAND = 2


@triton.jit
def _chunk_max_kernel(
    logits_ptr,  # [num_reqs, V] float
    logits_stride,
    temperature_ptr,  # [num_reqs] float32
    chunk_max_ptr,  # [num_reqs, NCH] float32
    vocab_size,
    num_chunks,
    BLOCK_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.program_id(1) * (BLOCK_SIZE // CHUNK) + tl.arange(0, BLOCK_SIZE // CHUNK)  # [BLOCK / S]
    offs = chunks[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]  # [BLOCK / S, S]
    valid = offs < vocab_size
    x = tl.load(logits_ptr + row * logits_stride + offs, mask=valid, other=float("-inf")).to(tl.float32)
    z = tl.math.div_rn(x, tl.load(temperature_ptr + row))
    # NOTE: NaN -> +inf before the max: a NaN can neither hide a chunk's maximum (NaN in a max reduction
    # differs between compiled code and the interpreter) nor go unseen (+inf maxima mark the row bad).
    z = tl.where(z != z, float("inf"), z)
    tl.store(chunk_max_ptr + row * num_chunks + chunks, tl.max(z, axis=1), mask=chunks < num_chunks)


@triton.jit
def _keys_at_least(values_ptr, num, key, BLOCK: tl.constexpr):
    """[BLOCK] int32 partial counts of |{i < num : key(values[i]) >= key}| (float32 values without NaN, read in
    blocks); their sum is the count."""
    partial = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, num, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < num
        keys = float_to_key(tl.load(values_ptr + offs, mask=valid, other=0.0))
        partial += (valid & (keys >= key)).to(tl.int32)
    return partial


@triton.jit
def _kth_largest_key(values_ptr, num, k, BLOCK: tl.constexpr):
    """The key of the k-th largest of values[:num] (float32 without NaN, 1 <= k <= num): the largest key K with
    at least k keys >= K, decided one bit at a time from the sign bit down (32 counting steps)."""
    offs = tl.arange(0, BLOCK)
    first = offs < num
    # NOTE: the first BLOCK values stay in registers over the 32 steps; only values past BLOCK are read again.
    keys = float_to_key(tl.load(values_ptr + offs, mask=first, other=0.0))  # [BLOCK] int32
    rest_ptr = values_ptr + BLOCK
    num_rest = num - BLOCK
    partial = (first & (keys >= 0)).to(tl.int32) + _keys_at_least(rest_ptr, num_rest, 0, BLOCK)
    # NOTE: with the sign bit fixed, setting a lower bit raises a signed int32, so the greedy choice from bit 30
    # down gives the largest K.
    kth_key = tl.where(tl.sum(partial, axis=0) >= k, 0, -2147483648)
    for bit in range(30, -1, -1):
        cand = kth_key | (1 << bit)
        partial = (first & (keys >= cand)).to(tl.int32) + _keys_at_least(rest_ptr, num_rest, cand, BLOCK)
        kth_key = tl.where(tl.sum(partial, axis=0) >= k, cand, kth_key)
    return kth_key


@triton.jit
def _list_chunks_at_least(chunk_max_ptr, sel_ptr, num_chunks, t0, BLOCK: tl.constexpr):
    """Writes the indices of the chunks whose maximum is >= t0 and > -inf (the only chunks that hold a value to
    gather), ascending, to sel -> their number."""
    num_sel = tl.zeros((), dtype=tl.int32)
    for start in range(0, num_chunks, BLOCK):
        chunks = start + tl.arange(0, BLOCK)
        valid = chunks < num_chunks
        m = tl.load(chunk_max_ptr + chunks, mask=valid, other=float("-inf"))
        flags = (valid & (m >= t0) & (m > float("-inf"))).to(tl.int32)
        slots = num_sel + tl.cumsum(flags, axis=0) - flags
        tl.store(sel_ptr + slots, chunks, mask=flags != 0)
        num_sel += tl.sum(flags, axis=0)
    return num_sel


@triton.jit
def _gather_listed_chunks(row_ptr, temperature, t0, sel_ptr, num_sel, buf_ids_ptr, buf_values_ptr, vocab_size,
                          cap, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Appends every z >= t0 (and > -inf) of the listed chunks, in id order, to the buffer's first cap slots ->
    how many there are, or a number > cap as soon as they cannot all be held (the loop stops there)."""
    num_above = tl.zeros((), dtype=tl.int32)
    start = tl.zeros((), dtype=tl.int32)
    end = num_sel * CHUNK
    while (start < end) & (num_above <= cap):
        pos = start + tl.arange(0, BLOCK)  # [BLOCK] positions in the listed chunks' ids
        listed = pos < end
        chunk = tl.load(sel_ptr + pos // CHUNK, mask=listed, other=0)
        offs = chunk * CHUNK + pos % CHUNK  # [BLOCK] ascending ids
        valid = listed & (offs < vocab_size)
        x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
        z = tl.math.div_rn(x, temperature)
        keep = valid & (z >= t0) & (z > float("-inf"))
        flags = keep.to(tl.int32)
        slots = num_above + tl.cumsum(flags, axis=0) - flags
        held = keep & (slots < cap)
        tl.store(buf_ids_ptr + slots, offs, mask=held)
        tl.store(buf_values_ptr + slots, z, mask=held)
        num_above += tl.sum(flags, axis=0)
        start += BLOCK
    return num_above


@triton.jit
def _listed_keys_at_least(row_ptr, temperature, sel_ptr, num_sel, vocab_size, key, BLOCK: tl.constexpr,
                          CHUNK: tl.constexpr):
    """[BLOCK] int32 partial counts of the z of the listed chunks (re-read from the logits, ids < V) whose key is
    >= key; their sum is the count."""
    partial = tl.zeros((BLOCK,), dtype=tl.int32)
    end = num_sel * CHUNK
    for start in range(0, end, BLOCK):
        pos = start + tl.arange(0, BLOCK)  # [BLOCK] positions in the listed chunks' ids
        listed = pos < end
        chunk = tl.load(sel_ptr + pos // CHUNK, mask=listed, other=0)
        offs = chunk * CHUNK + pos % CHUNK
        valid = listed & (offs < vocab_size)
        x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
        keys = float_to_key(tl.math.div_rn(x, temperature))
        partial += (valid & (keys >= key)).to(tl.int32)
    return partial


@triton.jit
def _kth_largest_listed_key(row_ptr, temperature, chunk_max_ptr, sel_ptr, num_sel, vocab_size, k, low_key,
                            BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """The key of the k-th largest z of the listed chunks (no NaN; at least k of them with a key >= low_key):
    the largest key K in [low_key, the listed chunks' largest maximum] with at least k keys >= K, by bisection
    (one counting pass over the listed chunks' ids a step, at most 32 steps). With num_sel = 0: low_key, no step."""
    high = low_key.to(tl.int64)
    for start in range(0, num_sel, BLOCK):
        slots = start + tl.arange(0, BLOCK)
        listed = slots < num_sel
        chunk = tl.load(sel_ptr + slots, mask=listed, other=0)
        m = tl.load(chunk_max_ptr + chunk, mask=listed, other=float("-inf"))
        high = tl.maximum(high, tl.max(float_to_key(m), axis=0).to(tl.int64))
    low = low_key.to(tl.int64)
    # NOTE: int64 bounds: high - low can exceed the int32 range (keys of opposite signs).
    while low < high:
        mid = low + ((high - low + 1) >> 1)
        num = tl.sum(_listed_keys_at_least(row_ptr, temperature, sel_ptr, num_sel, vocab_size, mid.to(tl.int32),
                                           BLOCK, CHUNK), axis=0)
        low = tl.where(num >= k, mid, low)
        high = tl.where(num >= k, high, mid - 1)
    return low.to(tl.int32)


@triton.jit
def _write_at_least(buf_ids_ptr, buf_values_ptr, num, kth, ids_ptr, values_ptr, BLOCK: tl.constexpr):
    """Copies the slots of buf[:num] whose value is >= kth, in slot order, to the front of ids and values."""
    base = tl.zeros((), dtype=tl.int32)
    for start in range(0, num, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        keep = offs < num
        z = tl.load(buf_values_ptr + offs, mask=keep, other=float("-inf"))
        keep = keep & (z >= kth)
        flags = keep.to(tl.int32)
        slots = base + tl.cumsum(flags, axis=0) - flags
        tl.store(ids_ptr + slots, tl.load(buf_ids_ptr + offs, mask=keep, other=0), mask=keep)
        tl.store(values_ptr + slots, z, mask=keep)
        base += tl.sum(flags, axis=0)


@triton.jit
def _prefilter_select_kernel(
    logits_ptr,  # [num_reqs, V] float
    logits_stride,
    temperature_ptr,  # [num_reqs] float32
    top_k_ptr,  # [num_reqs] int32
    chunk_max_ptr,  # [num_reqs, NCH] float32
    sel_ptr,  # [num_reqs, NCH] int32 scratch: the chunks to gather from
    buf_ids_ptr,  # [num_reqs, cap] int32 scratch
    buf_values_ptr,  # [num_reqs, cap] float32 scratch
    ids_ptr,  # [num_reqs, C] int32
    values_ptr,  # [num_reqs, C] float32
    cand_stride,
    counts_ptr,  # [num_reqs] int32
    kth_ptr,  # [num_reqs] float32
    t0_ptr,  # [num_reqs] float32: the bound
    num_listed_ptr,  # [num_reqs] int32: the chunks gathered from
    num_above_ptr,  # [num_reqs] int32: |{z >= t0, z > -inf}|, or a number > cap on overflow
    refined_ptr,  # [num_reqs] int32: 1 for the overflow rows selected from their listed chunks
    row_flag_ptr,  # [num_reqs] int32: 1 for the rows the radix kernel must select
    vocab_size,
    num_chunks,
    num_cand,
    cap,
    max_listed,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    k = tl.minimum(tl.maximum(tl.load(top_k_ptr + row), 1), vocab_size)
    chunk_max_row = chunk_max_ptr + row * num_chunks
    sel_row = sel_ptr + row * num_chunks
    buf_ids_row = buf_ids_ptr + row * cap
    buf_values_row = buf_values_ptr + row * cap

    # NOTE: +inf maxima: a NaN or +inf in z.
    num_inf = tl.sum(_keys_at_least(chunk_max_row, num_chunks, 0x7F800000, BLOCK), axis=0)
    t0 = key_to_float(_kth_largest_key(chunk_max_row, num_chunks, k, BLOCK))
    # NOTE: k > C: the row is -1 whatever its kth, so +inf gathers (next to) nothing; NCH < k <= C: no k chunks
    # to bound kth with, so -inf gathers every z > -inf (and the buffer may overflow).
    t0 = tl.where(k > num_cand, float("inf"), tl.where(k > num_chunks, float("-inf"), t0))
    num_sel = _list_chunks_at_least(chunk_max_row, sel_row, num_chunks, t0, BLOCK)
    # NOTE: the barriers make one thread's global stores (sel, then the buffer) visible to the others of the
    # program before they read them back.
    tl.debug_barrier()
    row_ptr = logits_ptr + row * logits_stride
    temperature = tl.load(temperature_ptr + row)
    num_above = _gather_listed_chunks(row_ptr, temperature, t0, sel_row, num_sel, buf_ids_row, buf_values_row,
                                      vocab_size, cap, BLOCK, CHUNK)
    tl.debug_barrier()

    could_hold = (num_inf == 0) & (k <= num_cand)
    overflow = could_hold & (num_above > cap)
    # NOTE: an overflow row with a short chunk list is selected from its listed chunks (they hold every z >= kth):
    # kth by bisection over their z, then only the z >= kth gathered again. A longer list (ties at t0 among more
    # than max_listed - k chunk maxima) goes to the radix kernel, which bounds the row program's time.
    refine = overflow & (num_sel <= max_listed)
    listed_kth = key_to_float(_kth_largest_listed_key(row_ptr, temperature, chunk_max_row, sel_row,
                                                      tl.where(refine, num_sel, 0), vocab_size, k, float_to_key(t0),
                                                      BLOCK, CHUNK))
    num_gathered = _gather_listed_chunks(row_ptr, temperature, listed_kth, sel_row, tl.where(refine, num_sel, 0),
                                         buf_ids_row, buf_values_row, vocab_size, cap, BLOCK, CHUNK)
    num_gathered = tl.where(refine, num_gathered, num_above)
    tl.debug_barrier()

    # NOTE: no select on an overflowed buffer (the radix kernel selects the row, or it is -1 anyway), nor on a
    # refined one (its kth is known and it holds exactly the z >= kth).
    num_held = tl.where(num_gathered <= cap, num_gathered, 0)
    kth = key_to_float(_kth_largest_key(buf_values_row, tl.where(refine, 0, num_held), k, BLOCK))
    # NOTE: fewer than k held values and no overflow means fewer than k values > -inf (t0 <= kth): kth = -inf.
    kth = tl.where(refine, listed_kth, tl.where(num_held >= k, kth, float("-inf")))
    count = tl.sum(_keys_at_least(buf_values_row, tl.where(refine, 0, num_held), float_to_key(kth), BLOCK), axis=0)
    count = tl.where(refine, num_gathered, count)
    radix = overflow & ~refine
    ok = could_hold & ~radix & (num_gathered <= cap) & (count <= num_cand) & (kth > float("-inf"))
    tl.store(kth_ptr + row, kth)
    tl.store(counts_ptr + row, tl.where(ok, count, -1))
    tl.store(t0_ptr + row, t0)
    tl.store(num_listed_ptr + row, num_sel)
    tl.store(num_above_ptr + row, num_above)
    tl.store(refined_ptr + row, refine.to(tl.int32))
    tl.store(row_flag_ptr + row, radix.to(tl.int32))
    _write_at_least(buf_ids_row, buf_values_row, tl.where(ok, num_held, 0), kth, ids_ptr + row * cand_stride,
                    values_ptr + row * cand_stride, BLOCK)


class PrefilterScratch(NamedTuple):
    """What `prefilter_select` leaves besides its outputs (for tests and benchmarks)."""

    # [num_reqs] float32: the bound t0.
    t0: torch.Tensor
    # [num_reqs] int32: the chunks gathered from (maximum >= t0 and > -inf).
    num_listed: torch.Tensor
    # [num_reqs] int32: |{z >= t0, z > -inf}|, or any number > cap where the buffer overflowed.
    num_above: torch.Tensor
    # [num_reqs, cap] int32 / float32: the gathered ids (ascending) and z in their first min(num_above, cap) slots.
    buf_ids: torch.Tensor
    buf_values: torch.Tensor
    # [num_reqs] int32: 1 for the overflow rows selected from their listed chunks (the buffer then holds the
    # row's z >= kth, in its first min(count, cap) slots).
    refined: torch.Tensor
    # [num_reqs] int32: 1 for the overflow rows with more than max_listed chunks listed (the radix kernel must
    # select them).
    row_flag: torch.Tensor


def prefilter_select(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, ids: torch.Tensor,
                     values: torch.Tensor, counts: torch.Tensor, kth: torch.Tensor, block_size: int, chunk: int,
                     cap: int) -> PrefilterScratch:
    """logits: [num_reqs, V] float (unit stride on V); temperature: [num_reqs] float32; top_k: [num_reqs] int32
    (both contiguous); ids, values, counts, kth: topk_select.py's outputs, written for every row but those flagged
    in the returned row_flag (overflow). Chunk maxima (`_chunk_max_kernel`), then one program per row
    (`_prefilter_select_kernel`): the bound, the gather and the exact select."""
    num_reqs, vocab_size = logits.shape
    num_cand = ids.shape[1]
    device = logits.device
    num_chunks = triton.cdiv(vocab_size, chunk)
    chunk_max = torch.empty((num_reqs, num_chunks), dtype=torch.float32, device=device)  # [num_reqs, NCH]
    max_block = _CHUNK_MAX_BLOCKS * block_size
    _chunk_max_kernel[(num_reqs, triton.cdiv(vocab_size, max_block))](
        logits, logits.stride(0), temperature, chunk_max, vocab_size, num_chunks, BLOCK_SIZE=max_block, CHUNK=chunk)
    sel = torch.empty((num_reqs, num_chunks), dtype=torch.int32, device=device)  # [num_reqs, NCH]
    scratch = PrefilterScratch(
        t0=torch.empty((num_reqs,), dtype=torch.float32, device=device),
        num_listed=torch.empty((num_reqs,), dtype=torch.int32, device=device),
        num_above=torch.empty((num_reqs,), dtype=torch.int32, device=device),
        buf_ids=torch.empty((num_reqs, cap), dtype=torch.int32, device=device),
        buf_values=torch.empty((num_reqs, cap), dtype=torch.float32, device=device),
        refined=torch.empty((num_reqs,), dtype=torch.int32, device=device),
        row_flag=torch.empty((num_reqs,), dtype=torch.int32, device=device))
    # NOTE: 4 warps: 64 registers a thread at 1024-value blocks (8 row programs an SM); 2048-value blocks or 8
    # warps hold fewer rows an SM, and the row program is latency-bound.
    _prefilter_select_kernel[(num_reqs,)](
        logits, logits.stride(0), temperature, top_k, chunk_max, sel, scratch.buf_ids, scratch.buf_values, ids,
        values, ids.stride(0), counts, kth, scratch.t0, scratch.num_listed, scratch.num_above, scratch.refined,
        scratch.row_flag, vocab_size, num_chunks, num_cand, cap, _MAX_LISTED_PER_CAND * num_cand, BLOCK=block_size,
        CHUNK=chunk, num_warps=4)
    return scratch
