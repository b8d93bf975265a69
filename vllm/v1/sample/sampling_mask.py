"""The sampling mask: each row's support (ids whose processed logit is finite), compacted on the device.

Role: `SamplingMaskTensors.from_logits` makes one pass over the processed logits (the chunked Triton kernels of
ops/mask_compaction.py; their torch code for CPU tensors outside the Triton interpreter) and produces, per row,
the ascending support ids in a compact [num_reqs, K] buffer, the full support size, and a packed bitmask that
is the exact fallback for rows whose support is larger than K. `tolists()` turns that into the step's
`SamplingMaskLists` CSR on the host.

Invariants:
- support(row) = {i : processed_logits[row, i] is finite}, ascending; NaN, +inf and -inf are never in it.
- rows with num_sampled == 0 have count 0, an all-zero bitmask row and contribute an empty CSR row.
- K = min(max_num_kept, vocab_size, MAX_COMPACT_SUPPORT); token_ids[r, :min(counts[r], K)] are the first
  support ids of row r; slots past that are undefined. counts[r] is the full support size, even when > K.
- packed_mask bit j of byte b is token 8b+j (little bit order, np.packbits(bitorder="little")).

Host copy (`to_cpu_nonblocking`), which copies the bitmask only on steps where some row overflows K:
- On the model runner's thread, `to_cpu_nonblocking()` makes a side copy stream wait for the current stream
  (or is given the async output copier's stream, which already waits, and queues its copies there), packs each
  row's ids back to back there (`pack_rows`: the host's CSR, rows past K left out), copies them and
  `counts` (at most num_reqs x (K+1) int32) into pinned host memory and records a CUDA event. It never copies
  `packed_mask` and never blocks the host.
- The returned `SamplingMaskCopy` holds the host tensors, the event and a reference to the device
  `packed_mask`. Its `tolists()`, meant for the async output thread, waits on the event only, reads the
  counts, and when some row has count > K gathers *only those rows* of the device bitmask on a stream of their
  own and copies them (overflow_rows x ceil(V/8) bytes; without the ids, `text_lists()` does it). Steps without
  overflow (the common case, since top_k bounds the support except for boundary ties) copy no bitmask at all;
  the GPU's main stream is never stalled, only the output thread waits for that small gather.
- A mask that went through `prepack` (the sampler's CUDA graphs do it) already holds the packed ids and JSON
  text: the copy stream then only copies them, with no kernel launched from Python.
- `to_cpu_nonblocking(copy_packed_mask=True)` copies the whole bitmask eagerly (upstream's behaviour).
- `to_cpu_nonblocking(with_text=True, with_ids=False)` copies the JSON text and the counts only: its lists carry
  each row's size and no ids (SamplingMaskLists.token_ids None), and the text of a row past K is formatted from
  that row of the bitmask. An API server's engine core needs no more: the servers receive the text alone. Not
  for vocabularies with ids of more than MAX_DIGITS digits (`mask_ids_needed`): the device leaves rows with such
  ids to the host, which formats them from the ids.
- On CPU tensors everything is already on the host: the copy is a no-op holding the same tensors.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import triton

from vllm.v1.cuda_events import host_event
from vllm.v1.host_staging import HostStagingSlot, copy_stream, pinned_copy
from vllm.v1.outputs import SamplingMaskLists, SamplingMaskText
from vllm.v1.sample.ops.mask_compaction import compact_sampling_mask_chunked, compact_sampling_mask_torch
from vllm.v1.sample.ops.mask_json import MAX_DIGITS, json_rows_packed, pack_rows

MAX_COMPACT_SUPPORT = 2048

# NOTE: overflow-row gathers run on their own stream: the copy stream is made to wait for the *next* step's
# compute (the next step's copies), and a gather for step N queued behind it would stall the output thread for a
# whole step. The gather needs no wait: its step's `ready` event has already fired on the host.
_gather_streams: dict[torch.device, torch.cuda.Stream] = {}


def compact_sampling_mask(logits: torch.Tensor, num_sampled: torch.Tensor, max_num_kept: int) -> SamplingMaskTensors:
    """One pass over `logits` ([num_reqs, V]) -> SamplingMaskTensors on logits' device: the chunked kernels on CUDA
    (and under the Triton interpreter), their torch code on CPU tensors otherwise (ops/mask_compaction.py)."""
    num_reqs, vocab_size = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_kept = max(0, min(max_num_kept, vocab_size, MAX_COMPACT_SUPPORT))
    num_bytes = (vocab_size + 7) // 8
    device = logits.device
    num_sampled = num_sampled.to(device=device, dtype=torch.int32)
    token_ids = torch.empty((num_reqs, num_kept), dtype=torch.int32, device=device)  # [num_reqs, K]
    packed_mask = torch.empty((num_reqs, num_bytes), dtype=torch.uint8, device=device)  # [num_reqs, ceil(V/8)]
    counts = torch.empty((num_reqs,), dtype=torch.int32, device=device)  # [num_reqs]
    if num_reqs == 0:
        return SamplingMaskTensors(token_ids, packed_mask, counts, vocab_size)
    if logits.is_cuda or triton.knobs.runtime.interpret:
        compact_sampling_mask_chunked(logits, num_sampled, token_ids, packed_mask, counts)
    else:
        compact_sampling_mask_torch(logits, num_sampled, token_ids, packed_mask, counts)
    return SamplingMaskTensors(token_ids, packed_mask, counts, vocab_size)


def compact_sampling_mask_into(logits: torch.Tensor, mask_rows: torch.Tensor, dst: SamplingMaskTensors,
                               rows: torch.Tensor, hit: torch.Tensor) -> None:
    """Recompute the support of rows `rows` ([n] int64 batch rows) from their processed `logits` ([n, V]) into
    `dst` (the batch's mask, [num_reqs, K]) in place, only where `hit` ([n] bool); `mask_rows` ([num_reqs] int)
    is the batch's num_sampled. Rows of `dst` not written keep what they hold. On CUDA (and under the Triton
    interpreter) the two chunked launches write the rows directly (no gather, select and scatter per output)."""
    num_kept = dst.token_ids.shape[1]
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    device = logits.device
    if logits.is_cuda or triton.knobs.runtime.interpret:
        compact_sampling_mask_chunked(logits, mask_rows.to(device=device, dtype=torch.int32), dst.token_ids,
                                      dst.packed_mask, dst.counts, dst_rows=rows.to(torch.int64), hit=hit)
        return
    part = compact_sampling_mask(logits, mask_rows.to(device)[rows], num_kept)
    for out, new in ((dst.token_ids, part.token_ids), (dst.counts, part.counts), (dst.packed_mask, part.packed_mask)):
        merge_rows(out, new, rows, hit)


def merge_rows(dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor, hit: torch.Tensor) -> None:
    """dst[rows] = src (cast to dst's dtype) where `hit` ([n] bool), unchanged elsewhere; no host sync."""
    keep_new = hit.view(-1, *([1] * (src.dim() - 1)))
    dst[rows] = torch.where(keep_new, src.to(dst.dtype), dst[rows])


class SamplingMaskTensors(NamedTuple):
    # [num_reqs, K] int32: ascending support ids; slots >= counts[r] are undefined.
    token_ids: torch.Tensor
    # [num_reqs, ceil(V/8)] uint8: the support as a little-bit-order bitmask. from_logits fills every row;
    # the sampler's fast path writes only rows whose count exceeds K (the only rows tolists() reads).
    packed_mask: torch.Tensor
    # [num_reqs] int32: full support size of each row.
    counts: torch.Tensor
    vocab_size: int
    # Set by `prepack` (inside the sampler's CUDA graph): what to_cpu_nonblocking would otherwise compute on the
    # copy stream, i.e. [num_reqs * K] int32 ids packed row after row, and the rows' JSON text [num_reqs * W]
    # uint8 with its [num_reqs] int32 lengths (text only when the API server asked for it).
    packed_ids: torch.Tensor | None = None
    text: torch.Tensor | None = None
    text_lengths: torch.Tensor | None = None
    # [num_reqs] int32, set by `prepack` with a group: the text's row groups (a copy of the caller's, so that the
    # host copy reads this step's values), whose rows it packs together (json_rows_packed).
    text_group: torch.Tensor | None = None

    @classmethod
    def from_logits(cls, logits: torch.Tensor, num_sampled_tokens: torch.Tensor | None = None,
                    max_num_kept: int = MAX_COMPACT_SUPPORT, *,
                    num_sampled: torch.Tensor | None = None) -> SamplingMaskTensors:
        """Support of each row of the processed `logits`; rows whose num_sampled_tokens is 0 are empty.

        Upstream's signature (`from_logits(logits, num_sampled_tokens, max_num_kept)`); `num_sampled=` is this
        engine's older keyword for the same tensor. None means every row sampled. `max_num_kept` is the batch's
        largest top_k (K is capped at MAX_COMPACT_SUPPORT; wider rows are read from the bitmask).
        """
        if num_sampled is not None:
            if num_sampled_tokens is not None:
                raise TypeError("from_logits: pass num_sampled_tokens or num_sampled (its older name), not both.")
            num_sampled_tokens = num_sampled
        num_sampled = num_sampled_tokens
        if num_sampled is None:
            num_sampled = torch.ones(logits.shape[0], dtype=torch.int32, device=logits.device)
        return compact_sampling_mask(logits, num_sampled, max_num_kept)

    @property
    def max_num_kept(self) -> int:
        return self.token_ids.shape[1]

    def prepack(self, with_text: bool, group: torch.Tensor | None = None,
                with_ids: bool = True) -> SamplingMaskTensors:
        """The same mask with its host-copy layout (packed ids, and JSON text with `with_text`) computed now, on
        the current stream: the sampler's CUDA graphs call it so that these kernels replay with the graph
        instead of being launched from Python every step (~0.5 ms of the engine's host time at 1024 rows).

        with_ids=False (with_text only): no packed ids, for a copy that takes the text alone
        (`to_cpu_nonblocking(with_ids=False)`).

        group ([num_reqs] int, with_text only): the text packs each group's rows together (each API server's),
        groups ascending; `text_lists` cuts it back per row.

        Rows past the first n of a padded graph step must have count 0 (their padding rows do) and, with a group,
        a group after every real row's (MASK_GROUP_PAD): they then add nothing to the packed ids, and only
        trailing "[]" texts past the first n rows' texts."""
        if not (with_ids or with_text):
            raise ValueError("A prepacked mask needs its ids or its JSON text.")
        mask = self.with_text_group(group) if with_text and group is not None else self
        text, text_lengths = mask._json_text() if with_text else (None, None)
        packed_ids = pack_rows(self.token_ids, self.counts) if with_ids else None
        return mask._replace(packed_ids=packed_ids, text=text, text_lengths=text_lengths)

    def with_text_group(self, group: torch.Tensor) -> SamplingMaskTensors:
        """This mask with its text's row groups (`prepack`): a copy of `group` made now, on the current stream,
        since the copy stream reads it later and the caller's buffer is the next step's input."""
        return self._replace(text_group=group.to(dtype=torch.int32, copy=True))

    def narrow(self, n: int) -> SamplingMaskTensors:
        """The first n rows (views); the packed ids and text keep their whole buffers, whose first n rows come
        first (see `prepack`)."""
        return self._replace(token_ids=self.token_ids[:n], packed_mask=self.packed_mask[:n], counts=self.counts[:n],
                             text_lengths=None if self.text_lengths is None else self.text_lengths[:n],
                             text_group=None if self.text_group is None else self.text_group[:n])

    def _json_text(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(text, lengths) of the rows' JSON: the prepacked ones, or formatted now on the current stream."""
        if self.text is not None and self.text_lengths is not None:
            return self.text, self.text_lengths
        return json_rows_packed(self.token_ids, self.counts, self.text_group)

    def to_cpu_nonblocking(self, copy_packed_mask: bool = False, with_text: bool = False,
                           staging: HostStagingSlot | None = None, with_ids: bool = True,
                           stream: torch.cuda.Stream | None = None) -> SamplingMaskCopy:
        """Start the device-to-host copy without blocking; see the module docstring for the protocol.

        with_text: also format each row's ids as JSON text on the copy stream (ops/mask_json.py) and copy it,
        for the API server (`SamplingMaskCopy.text_lists`).
        with_ids=False (with_text only): copy the text and the counts, not the ids: the lists then carry each
        row's size only (SamplingMaskLists.token_ids None), what an engine whose masks leave as text needs.
        staging: reusable pinned buffers to copy into (the async output copier's) instead of fresh pinned memory
        each step; the host lists are then views of a lending slot, or copied out of any other
        (HostStagingSlot).
        stream: a side stream that is the current stream and already waits for the stream that computed the mask
        (the async output copier's): the copies are queued on it, with no second wait and no stream switch (~13 us
        of host time per step). Default: the device's mask copy stream, made to wait for the current stream."""
        if not with_ids and mask_ids_needed(with_text, self.vocab_size):
            raise ValueError(
                "A mask copy needs the ids or the JSON text (with_ids=False needs with_text=True)." if not with_text
                else f"A vocabulary of {self.vocab_size} ids has ids of more than {MAX_DIGITS} digits, whose rows' "
                "JSON text is formatted from the ids: copy them (with_ids=True).")
        if with_text and self.text is None and (self.packed_ids is not None):
            raise ValueError("This mask was prepacked without its JSON text.")
        if with_ids and self.packed_ids is None and self.text is not None:
            raise ValueError("This mask was prepacked without its ids.")
        if not self.counts.is_cuda:
            return SamplingMaskCopy(self, None, None, *(self._json_text() if with_text else (None, None)),
                                    text_group=self.text_group if with_text else None, with_ids=with_ids)
        device = self.counts.device
        if stream is None:
            stream = copy_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            on_stream: Any = torch.cuda.stream(stream)
        else:
            assert torch.cuda.current_stream(device) == stream, "the given copy stream must be the current one"
            on_stream = contextlib.nullcontext()
        copy = (lambda t, _name: pinned_copy(t)) if staging is None else staging.copy
        with on_stream:
            # NOTE: the ids leave the device packed row after row (what the host's CSR is), so the output thread
            # only cuts them; rows past K contribute nothing here and are filled from the bitmask.
            packed_ids = None
            if with_ids:
                ids = self.packed_ids if self.packed_ids is not None else pack_rows(self.token_ids, self.counts)
                packed_ids = copy(ids, "ids")
            counts = copy(self.counts, "counts")
            packed_mask = pinned_copy(self.packed_mask) if copy_packed_mask else self.packed_mask
            text, text_lengths, text_group = None, None, None
            if with_text:
                text, text_lengths = (copy(t, name) for t, name in zip(self._json_text(), ("text", "lengths")))
                if self.text_group is not None:
                    text_group = copy(self.text_group, "group")
            event = host_event()
            event.record(stream)
        # NOTE: the caller may drop the device tensors before the side-stream copies have run.
        self.token_ids.record_stream(stream)
        self.counts.record_stream(stream)
        self.packed_mask.record_stream(stream)
        if with_text and self.text_group is not None:
            self.text_group.record_stream(stream)
        return SamplingMaskCopy(SamplingMaskTensors(self.token_ids, packed_mask, counts, self.vocab_size), event,
                                stream, text, text_lengths, packed_ids, staging, text_group, with_ids)

    def tolists(self) -> SamplingMaskLists:
        """CSR of the step (one row per request, offsets [num_reqs+1] int64); synchronous on device tensors."""
        return _tolists(self, None)


@dataclass(slots=True)
class SamplingMaskCopy:
    """A SamplingMaskTensors on its way to the host: `tensors` holds host counts once `ready` fires, and
    `packed_ids` the ids (on CPU tensors: `tensors` is the mask itself, packed_ids None); its packed_mask stays
    on the device unless copied eagerly."""

    tensors: SamplingMaskTensors
    # Recorded on the copy stream after the host copies; None on CPU.
    ready: torch.cuda.Event | None
    stream: torch.cuda.Stream | None
    # With `with_text`: [R * W] uint8 row texts packed back to back, and [R] int32 lengths (-1: formatted here).
    text: torch.Tensor | None = None
    text_lengths: torch.Tensor | None = None
    # [R * K] int32 host: each row's first counts[r] ids back to back, rows with counts[r] > K contributing none.
    packed_ids: torch.Tensor | None = None
    # The HostStagingSlot the host tensors are views of, if any: the lists are views of a lending slot's arrays
    # (HostStagingSlot.array), and copies out of any other slot (a later step reuses it).
    staging: HostStagingSlot | None = None
    # [R] int32: the text's row groups (SamplingMaskTensors.prepack), or None for rows in row order.
    text_group: torch.Tensor | None = None
    # False: the ids were not copied (`to_cpu_nonblocking(with_ids=False)`): `tolists()` gives the offsets only.
    with_ids: bool = True

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def tolists(self) -> SamplingMaskLists:
        """Wait for the copy and build the CSR; gathers device bitmask rows only for overflow rows. Without the
        ids (`with_ids` False): token_ids None, the offsets (each row's size) only, and no bitmask read."""
        self.wait()
        if not self.with_ids:
            return SamplingMaskLists(None, _offsets(self.tensors.counts.numpy()), None)
        packed_ids = None if self.packed_ids is None else self._host_array("ids", self.packed_ids)
        return _tolists(self.tensors, self.stream, packed_ids, copy_out=self._copy_out)

    @property
    def _copy_out(self) -> bool:
        return self.staging is not None and not self.staging.lends

    def _host_array(self, name: str, host: torch.Tensor) -> np.ndarray:
        """A host tensor of this copy as numpy: through a lending slot, a view that keeps the slot in use."""
        if self.staging is not None and self.staging.lends:
            return self.staging.array(name, host)
        return host.numpy()

    def text_lists(self, lists: SamplingMaskLists) -> SamplingMaskText | None:
        """The rows of `lists` (this copy's `tolists()`) as JSON text; None without `with_text`. Rows the device
        left to the host (support past K, or an id of more than MAX_DIGITS digits) are formatted here from `lists`,
        or, for a copy without the ids, from their bitmask rows (only rows past K can be left then)."""
        if self.text is None or self.text_lengths is None:
            return None
        self.wait()
        lengths = self.text_lengths.numpy()  # [R] int32
        text = self._host_array("text", self.text)
        # Row r's text is row rank[r] of the device's packing (the rows of a group together, as json_rows_packed
        # packed them); rows left to the host (-1) took no room there.
        host_formatted = len(lengths) > 0 and int(lengths.min()) < 0
        packed_lengths = np.maximum(lengths, 0) if host_formatted else lengths
        rank = None
        if self.text_group is not None:
            order, rank = group_order(self.text_group.numpy())
            packed_lengths = packed_lengths[order]  # row r's length at its place in the packing
        offsets = _offsets(packed_lengths)
        if not host_formatted:
            # NOTE: a view of this step's own pinned buffer or of a lending slot (both kept alive by it), else a
            # copy out of the slot.
            data = text[:offsets[-1]]
            return SamplingMaskText(data.copy() if self._copy_out else data, offsets, None, rank)
        # Some rows' supports overflowed K on the device: all rows in row order, those formatted here (from the
        # lists' ids, or from their bitmask rows when the ids were not copied).
        assert lists.offsets is not None
        starts = (offsets[:-1] if rank is None else offsets[rank]).tolist()
        host_rows = np.flatnonzero(lengths < 0)
        if lists.token_ids is None:
            # NOTE: to_cpu_nonblocking refuses a copy without ids where an id can exceed MAX_DIGITS digits, so every
            # row left to the host is past K, the rows whose bitmask the sampler writes.
            assert (np.diff(lists.offsets)[host_rows] > self.tensors.token_ids.shape[1]).all()
            row_ids = dict(zip(host_rows.tolist(), _bitmask_row_ids(self.tensors, host_rows, self.stream)))
        else:
            row_ids = {r: lists.token_ids[lists.offsets[r]:lists.offsets[r + 1]] for r in host_rows.tolist()}
        pieces: list[bytes] = []
        for r, n in enumerate(lengths.tolist()):
            if n >= 0:
                pieces.append(text[starts[r]:starts[r] + n].tobytes())
            else:
                pieces.append(b"[" + b",".join(str(i).encode() for i in row_ids[r].tolist()) + b"]")
        return SamplingMaskText(np.frombuffer(b"".join(pieces), dtype=np.uint8),
                                _offsets(np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))))


def mask_ids_needed(with_text: bool, vocab_size: int) -> bool:
    """Whether a mask's host copy must carry its ids: without the JSON text (the ids are the mask), or when the
    vocabulary has ids of more than MAX_DIGITS digits (the device leaves their rows to the host, which formats
    them from the ids)."""
    return not with_text or vocab_size > 10 ** MAX_DIGITS


def group_order(group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, rank), [R] int64 each: the rows of a packing by group (groups ascending, row order within one),
    the order json_rows_packed writes with a group, and each row's place in it (order's inverse)."""
    order = np.argsort(group, kind="stable")
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return order, rank


def _overflow_bitmask_rows(packed_mask: torch.Tensor, rows: np.ndarray,
                           stream: torch.cuda.Stream | None) -> np.ndarray:
    if not packed_mask.is_cuda:
        return packed_mask.numpy()[rows]
    device = packed_mask.device
    if stream is not None:  # the step's copy already went through; gather on an independent stream
        if device not in _gather_streams:
            _gather_streams[device] = torch.cuda.Stream(device=device)
        stream = _gather_streams[device]
    else:
        stream = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        index = torch.from_numpy(rows).to(device, non_blocking=True)
        part = packed_mask.index_select(0, index)  # [num_overflow, ceil(V/8)] uint8
        host = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)
        host.copy_(part, non_blocking=True)
        packed_mask.record_stream(stream)
    stream.synchronize()
    return host.numpy()


def _offsets(counts: np.ndarray) -> np.ndarray:
    """[len(counts) + 1] int64: the CSR offsets of rows of `counts` items (ids, or text bytes)."""
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets


def _bitmask_row_ids(mask: SamplingMaskTensors, rows: np.ndarray, stream: torch.cuda.Stream | None
                     ) -> list[np.ndarray]:
    """The support ids (ascending int64) of each of `rows`, read from the bitmask (device rows gathered and
    copied on their own stream, see `_overflow_bitmask_rows`)."""
    if not len(rows):
        return []
    packed = _overflow_bitmask_rows(mask.packed_mask, rows, stream)  # [len(rows), ceil(V/8)] uint8
    bits = np.unpackbits(packed, axis=1, count=mask.vocab_size, bitorder="little")
    return [np.flatnonzero(b) for b in bits]


def _tolists(mask: SamplingMaskTensors, stream: torch.cuda.Stream | None,
             packed_ids: np.ndarray | None = None, copy_out: bool = False) -> SamplingMaskLists:
    """The step's CSR. `packed_ids` (host, see SamplingMaskCopy) spares the [num_reqs, K] boolean gather, which
    holds the GIL ~1 ms per 1024-row step on the output thread while the engine's main thread waits for it.
    `copy_out`: packed_ids is a staging buffer that a later step reuses, so the ids must not be a view of it."""
    counts = mask.counts.cpu().numpy().astype(np.int64)  # [num_reqs]
    num_kept = mask.token_ids.shape[1]
    offsets = _offsets(counts)  # [num_reqs + 1]
    overflow = counts > num_kept  # [num_reqs] bool
    if packed_ids is not None:
        compact = packed_ids[:int(counts[~overflow].sum())]
    else:
        token_ids = mask.token_ids.cpu().numpy()  # [num_reqs, K]
        compact_cols = np.arange(num_kept)[None, :] < np.where(overflow, 0, counts)[:, None]  # [num_reqs, K]
        compact = token_ids[compact_cols]
    if not overflow.any():
        # NOTE: without copy_out, a view of this step's pinned buffer (allocated per step, kept alive by the view)
        # or of a lending staging slot.
        return SamplingMaskLists(compact.astype(np.int32, copy=copy_out), offsets, None)
    out = np.empty(int(offsets[-1]), dtype=np.int32)
    out[np.repeat(~overflow, counts)] = compact
    out[np.repeat(overflow, counts)] = np.concatenate(_bitmask_row_ids(mask, np.flatnonzero(overflow), stream))
    return SamplingMaskLists(out, offsets, None)
