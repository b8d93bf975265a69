"""The sampling mask's compact ids as JSON text, formatted on the device.

Role: the API server returns every token's support as a JSON list of ids (`"sampling_mask": [[3,17,42], ...]`).
Turning int32 arrays into Python ints and then into text costs the server's one Python process ~40 ns per id,
which at hundreds of ids per token is more than everything else it does per token. The text of each row of the
compact [num_reqs, K] ids is written on the device instead (on the mask's copy stream), so the host only cuts
bytes.

- `json_rows_packed` (what the engine uses): two Triton launches, one program per row: the row's text length,
  then its text at its offset (the sum of the lengths before it) in one flat buffer, rows back to back; with a
  row group (each row's API server) the rows of each group come together, so each server's rows are one span.
- `format_json_rows` / `pack_rows_torch`: the same with torch ops, one [R, W] text per row then packed; the
  reference of the tests and the fallback if the kernels cannot compile. `pack_rows` packs rows with one
  kernel (the mask's ids use it).

Invariants:
- Row r's text is the JSON array of token_ids[r, :counts[r]], exactly as `json.dumps(ids,
  separators=(",", ":"))` writes it ("[]" for an empty row).
- Rows with counts[r] > K (their support is only in the bitmask) or an id >= 10**MAX_DIGITS get length -1 and
  take no bytes: the host formats them.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)
MAX_DIGITS = 7
# Rows summed per block by `_row_start` (a constant, so the packing kernels compile once for every batch size).
_ROW_BLOCK = 1024
_COMMA, _OPEN, _CLOSE, _ZERO = ord(","), ord("["), ord("]"), ord("0")


def max_text_width(num_kept: int) -> int:
    """Bytes of the longest row text of K ids: brackets plus K ids of MAX_DIGITS digits and K - 1 commas."""
    return 2 + num_kept * (MAX_DIGITS + 1)


def format_json_rows(token_ids: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """token_ids: [R, K] int32 (ascending ids in the first counts[r] slots), counts: [R] int -> (text [R, W] uint8,
    lengths [R] int32), W = max_text_width(K)."""
    num_reqs, num_kept = token_ids.shape
    device = token_ids.device
    width = max_text_width(num_kept)
    # NOTE: one extra column is a sink for the writes of unused slots; it is cut off at the end.
    text = torch.empty((num_reqs, width + 1), dtype=torch.uint8, device=device)
    counts = counts.to(device=device, dtype=torch.int64)
    n = counts.clamp(max=num_kept)  # [R]
    valid = torch.arange(num_kept, device=device)[None, :] < n[:, None]  # [R, K]
    ids = torch.where(valid, token_ids.to(torch.int64), 0)  # [R, K]
    pow10 = 10 ** torch.arange(MAX_DIGITS, device=device, dtype=torch.int64)  # [MAX_DIGITS]
    ndig = (ids[..., None] >= pow10[1:]).sum(-1) + 1  # [R, K] digits of each id
    chars = torch.where(valid, ndig + 1, 0)  # [R, K] digits + the separator after them
    start = 1 + torch.cumsum(chars, dim=1) - chars  # [R, K] column of each id's first digit
    sink = torch.full_like(start, width)
    for d in range(MAX_DIGITS):
        live = valid & (ndig > d)
        place = pow10[(ndig - 1 - d).clamp(min=0)]
        digit = (ids // place % 10 + _ZERO).to(torch.uint8)
        text.scatter_(1, torch.where(live, start + d, sink), digit)
    # Separators: "," after every id, "]" after the last one; "[" first; "[]" for an empty row.
    last = valid & (torch.arange(num_kept, device=device)[None, :] == (n - 1)[:, None])
    separator = torch.where(last, _CLOSE, _COMMA).to(torch.uint8)
    text.scatter_(1, torch.where(valid, start + ndig, sink), separator)
    text[:, 0] = _OPEN
    empty = n == 0
    text[:, 1] = torch.where(empty, _CLOSE, text[:, 1])
    lengths = torch.where(empty, 2, 1 + chars.sum(1))
    too_long = (ids >= 10 ** MAX_DIGITS).any(dim=1)
    lengths = torch.where((counts > num_kept) | too_long, -1, lengths).to(torch.int32)
    return text[:, :width], lengths


def pack_rows(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[R, W] rows -> [R * W] (same dtype) with row r's first lengths[r] values at the exclusive prefix sum of the
    lengths before it (rows with length <= 0 or > W take no room), so the host needs only the lengths to cut it.
    Used for the mask's compact ids (SamplingMaskTensors.to_cpu_nonblocking: rows past K have counts > K). One
    Triton launch on CUDA (or under the interpreter), `pack_rows_torch` otherwise."""
    num_reqs, width = values.shape
    if not (values.is_cuda or triton.knobs.runtime.interpret) or num_reqs == 0 or width == 0:
        return pack_rows_torch(values, lengths)
    values = values.contiguous()
    flat = torch.empty(num_reqs * width, dtype=values.dtype, device=values.device)
    _pack_rows_kernel[(num_reqs,)](values, values.stride(0), lengths.contiguous(), flat, width, BLOCK_R=_ROW_BLOCK,
                                   BLOCK_W=1024)
    return flat


def pack_rows_torch(values: torch.Tensor, lengths: torch.Tensor, group: torch.Tensor | None = None) -> torch.Tensor:
    """`pack_rows` with torch ops (CPU tensors, the JSON texts' fallback; the reference of the tests). With
    `group` ([R] int), the rows of each group come together, groups in ascending order, rows in row order."""
    num_reqs, width = values.shape
    n = lengths.to(torch.int64)
    n = torch.where((n < 0) | (n > width), 0, n)  # [R]
    if group is None:
        row_start = torch.cumsum(n, dim=0) - n  # [R]
    else:
        order = torch.sort(group.to(device=values.device, dtype=torch.int64), stable=True).indices  # [R]
        row_start = torch.empty_like(n)
        row_start[order] = torch.cumsum(n[order], dim=0) - n[order]
    cols = torch.arange(width, device=values.device)[None, :]
    dest = torch.where(cols < n[:, None], row_start[:, None] + cols, num_reqs * width)  # [R, W]
    flat = torch.empty(num_reqs * width + 1, dtype=values.dtype, device=values.device)
    flat.scatter_(0, dest.flatten(), values.flatten())
    return flat[:num_reqs * width]


@triton.jit
def _row_start(lengths_ptr, row, max_length, BLOCK_R: tl.constexpr):
    """(offset, length) of `row` in a packing of rows back to back: lengths < 0 or > max_length take no room.

    NOTE: each program sums the lengths before its row itself (R <= a few thousand ints, from L2), so a packing
    needs no separate prefix-sum launch. BLOCK_R is fixed (not the batch's power of two): one compiled variant
    for every batch size, so a batch size seen for the first time never stops a serving step for a compile."""
    start = tl.zeros((), dtype=tl.int64)
    n = tl.zeros((), dtype=tl.int64)
    for r0 in range(0, row + 1, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        lengths = tl.load(lengths_ptr + r, mask=r <= row, other=0).to(tl.int64)
        lengths = tl.where((lengths < 0) | (lengths > max_length), 0, lengths)
        start += tl.sum(tl.where(r < row, lengths, 0), axis=0)
        n += tl.sum(tl.where(r == row, lengths, 0), axis=0)
    return start, n


@triton.jit
def _grouped_row_start(lengths_ptr, group_ptr, row, num_rows, BLOCK_R: tl.constexpr):
    """The offset of `row` in a packing where the rows of each group come together (groups ascending, rows in
    row order within a group): the sum of the lengths of the rows before it in (group, row) order, lengths < 0
    taking no room. Like `_row_start`, one loop over the rows per program, no separate launch."""
    my_group = tl.load(group_ptr + row)
    start = tl.zeros((), dtype=tl.int64)
    for r0 in range(0, num_rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        live = r < num_rows
        lengths = tl.load(lengths_ptr + r, mask=live, other=0).to(tl.int64)
        groups = tl.load(group_ptr + r, mask=live, other=0)
        before = live & ((groups < my_group) | ((groups == my_group) & (r < row))) & (lengths >= 0)
        start += tl.sum(tl.where(before, lengths, 0), axis=0)
    return start


@triton.jit
def _pack_rows_kernel(
    values_ptr,  # [R, W]
    values_stride,
    lengths_ptr,  # [R] int
    out_ptr,  # [R * W]
    width,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0)
    start, n = _row_start(lengths_ptr, row, width, BLOCK_R)
    src = values_ptr + row.to(tl.int64) * values_stride
    for w0 in range(0, n, BLOCK_W):
        offs = w0 + tl.arange(0, BLOCK_W)
        keep = offs < n
        tl.store(out_ptr + start + offs, tl.load(src + offs, mask=keep), mask=keep)


@triton.jit
def _num_digits(ids):
    # NOTE: up to MAX_DIGITS = 7 digits; longer ids are left to the host (_json_lengths_kernel).
    return (1 + (ids >= 10).to(tl.int32) + (ids >= 100).to(tl.int32) + (ids >= 1000).to(tl.int32)
            + (ids >= 10000).to(tl.int32) + (ids >= 100000).to(tl.int32) + (ids >= 1000000).to(tl.int32))


@triton.jit
def _json_lengths_kernel(
    token_ids_ptr,  # [R, K] int32
    token_ids_stride,
    counts_ptr,  # [R] int32
    lengths_ptr,  # [R] int32 out
    num_kept,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    count = tl.load(counts_ptr + row)
    n = tl.minimum(count, num_kept)
    offs = tl.arange(0, BLOCK_K)
    valid = offs < n
    ids = tl.load(token_ids_ptr + row * token_ids_stride + offs, mask=valid, other=0)
    chars = tl.where(valid, _num_digits(ids) + 1, 0)
    length = 1 + tl.sum(chars, axis=0) + (n == 0).to(tl.int32)
    bad = (count > num_kept) | (tl.sum((valid & (ids >= 10_000_000)).to(tl.int32), axis=0) > 0)
    tl.store(lengths_ptr + row, tl.where(bad, -1, length))


@triton.jit
def _json_write_kernel(
    token_ids_ptr,  # [R, K] int32
    token_ids_stride,
    counts_ptr,  # [R] int32
    lengths_ptr,  # [R] int32
    text_ptr,  # [R * W] uint8 out
    group_ptr,  # [R] int32 (GROUPED only)
    num_rows,
    num_kept,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUPED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if tl.load(lengths_ptr + row) >= 0:
        # NOTE: a text length never exceeds its row's width (no upper cut); -1 (left to the host) takes no room.
        if GROUPED:
            base = _grouped_row_start(lengths_ptr, group_ptr, row, num_rows, BLOCK_R)
        else:
            base, _ = _row_start(lengths_ptr, row, 0x7FFFFFFF, BLOCK_R)
        n = tl.minimum(tl.load(counts_ptr + row), num_kept)
        offs = tl.arange(0, BLOCK_K)
        valid = offs < n
        ids = tl.load(token_ids_ptr + row * token_ids_stride + offs, mask=valid, other=0)
        ndig = _num_digits(ids)
        chars = tl.where(valid, ndig + 1, 0)
        start = base + 1 + tl.cumsum(chars, axis=0) - chars
        rest = ids
        # Digits from the last one backwards: digit ndig-1-d is rest % 10 after d divisions.
        for d in tl.static_range(7):  # MAX_DIGITS
            pos = start + ndig - 1 - d
            tl.store(text_ptr + pos, (rest % 10 + 48).to(tl.uint8), mask=valid & (ndig > d))
            rest = rest // 10
        sep = tl.where(offs == n - 1, 93, 44).to(tl.uint8)  # "]" after the last id, "," otherwise
        tl.store(text_ptr + start + ndig, sep, mask=valid)
        tl.store(text_ptr + base, tl.full((), 91, tl.uint8))  # "["
        if n == 0:
            tl.store(text_ptr + base + 1, tl.full((), 93, tl.uint8))


_kernels_failed = False


def json_rows_packed(token_ids: torch.Tensor, counts: torch.Tensor,
                     group: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """token_ids: [R, K] int32, counts: [R] int -> (text [R * W] uint8 with the row texts back to back from byte 0,
    lengths [R] int32, -1 for rows left to the host). No host sync: the buffer has the worst-case size.

    group: [R] int (optional): the rows of each group back to back, groups in ascending order, rows in row order
    within a group (pack_rows_torch's order), instead of all rows in row order."""
    global _kernels_failed
    num_reqs, num_kept = token_ids.shape
    use_kernels = (token_ids.is_cuda or triton.knobs.runtime.interpret) and not _kernels_failed and num_kept > 0
    if use_kernels and num_reqs > 0:
        try:
            token_ids = token_ids.contiguous()
            counts = counts.to(device=token_ids.device, dtype=torch.int32).contiguous()
            lengths = torch.empty(num_reqs, dtype=torch.int32, device=token_ids.device)
            block = triton.next_power_of_2(num_kept)
            _json_lengths_kernel[(num_reqs,)](token_ids, token_ids.stride(0), counts, lengths, num_kept,
                                              BLOCK_K=block)
            text = torch.empty(num_reqs * max_text_width(num_kept), dtype=torch.uint8, device=token_ids.device)
            grouped = group is not None
            group_arg = group.to(device=token_ids.device, dtype=torch.int32).contiguous() if grouped else lengths
            _json_write_kernel[(num_reqs,)](token_ids, token_ids.stride(0), counts, lengths, text, group_arg,
                                            num_reqs, num_kept, BLOCK_K=block, BLOCK_R=_ROW_BLOCK, GROUPED=grouped)
            return text, lengths
        except triton.CompilationError:
            _kernels_failed = True
            logger.exception("The mask JSON kernels failed to compile; formatting with torch ops from now on.")
    text, lengths = format_json_rows(token_ids, counts)
    return pack_rows_torch(text, lengths, group), lengths
