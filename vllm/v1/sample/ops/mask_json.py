"""The sampling mask's compact ids as JSON text, formatted on the device.

Role: the API server returns every token's support as a JSON list of ids (`"sampling_mask": [[3,17,42], ...]`).
Turning int32 arrays into Python ints and then into text costs the server's one Python process ~40 ns per id,
which at hundreds of ids per token is more than everything else it does per token. `format_json_rows` writes the
text of each row of the compact [num_reqs, K] ids on the device instead (a few vectorised torch ops, run on the
mask's copy stream), so the host only slices bytes.

Invariants:
- text[r, :lengths[r]] is the JSON array of token_ids[r, :counts[r]], exactly as `json.dumps(ids,
  separators=(",", ":"))` writes it ("[]" for an empty row); bytes past lengths[r] are undefined.
- Rows with counts[r] > K (their support is only in the bitmask) get lengths[r] = -1: the host formats them.
- Ids are non-negative and below 10**MAX_DIGITS.
"""

from __future__ import annotations

import torch

MAX_DIGITS = 7
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
    lengths = torch.where(counts > num_kept, -1, lengths).to(torch.int32)
    return text[:, :width], lengths


def pack_json_rows(text: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[R, W] row texts -> [R * W] uint8 with row r's text at the exclusive prefix sum of the lengths before it
    (rows with length -1 take no bytes), so the host needs only the lengths to cut it."""
    num_reqs, width = text.shape
    n = lengths.to(torch.int64).clamp(min=0)  # [R]
    row_start = torch.cumsum(n, dim=0) - n  # [R]
    cols = torch.arange(width, device=text.device)[None, :]
    dest = torch.where(cols < n[:, None], row_start[:, None] + cols, num_reqs * width)  # [R, W]
    flat = torch.empty(num_reqs * width + 1, dtype=torch.uint8, device=text.device)
    flat.scatter_(0, dest.flatten(), text.flatten())
    return flat[:num_reqs * width]
