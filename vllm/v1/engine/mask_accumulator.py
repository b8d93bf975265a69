"""MaskAccumulator: one request's sampling masks in the frontend, appended step by step until handed over.

Role: each engine step brings a request its new tokens' masks, as int32 id rows (SamplingMaskLists) and/or as
their JSON text (SamplingMaskText, formatted on the device for an API server). The accumulator writes the texts
into the request's MaskTextBlocks (the response's JSON, "[[...],[...]]", in a few buffers) and keeps the id rows
as the views the steps brought, each K of them compacted into one array of the request's own, and hands them over
as a `SamplingMask` (vllm/outputs.py) without building anything: a server sends the text blocks as they are
(SplicedJSONResponse), an offline caller reads `ids` / `offsets` (one concatenation of the pieces), and Python
lists per token are built only if it reads `token_ids`.

NOTE (why this shape, tools/profiling/frontend_final.py on the development machine): a non-streamed response
finishes with its whole batch, and every copy of its ~870 KB of mask text done then (a join of per-token rows,
then the JSON encoder's copy into the body) was done by the API server for all its requests at once, while the
next requests waited; written into the blocks as the steps come, the text is ready when the request finishes.
The ids (an in-process engine's, or an engine core's of its own process: no text) are kept as the views of the
step's array that the step brings, not copied one by one: copying each row out of its step (~2 KB into fresh
memory) cost ~2.5 ms per 1024-row step of the offline engine's host time on the development machine, more than
everything else the masks cost it. But a view keeps its whole step array alive (~1024 rows, ~2 MB), so every K
(`COMPACT_PIECES`, 64) pieces are joined by one np.concatenate into an array of the request's own and the views
dropped (tools/profiling/mask_retention.py: see docs/benchmarks.md, issue 30, for the cost per step).

Invariants:
- `num` tokens; `id_rows` holds their ids as pieces whose concatenation is the tokens' ids in order (with
  `ends`, each token's end in it): `num_compacted` arrays of the request's own first, then fewer than K views
  (one per token, each a view of its step's array, or an array parsed from a step's text) after each append.
  So a request keeps alive at most K - 1 step arrays (or messages) beyond its own ids, whatever its length (a
  32k-token rollout next to short ones: not the ~32k step arrays of ~1024 rows each that its views would hold).
- The lists only grow until a hand-over (a cumulative output's SamplingMask shares them and reads its first
  `num` tokens; the compaction replaces the views in place by an array of the same ids, so a shared reader sees
  the same ids and drops the views too), then start empty (new lists; the handed-over ones are not touched again).
- The text is copied out of each step's message. Reused buffers are safe: a staging slot is reused only once no
  view of it is left (vllm/v1/host_staging.py), which a compaction's dropped views no longer are.
- A form is kept while every step brings it, from the step after the last hand-over; a step that brings only
  the form no longer kept is converted (text parsed, ids formatted), so each kept form covers all `num` tokens.
- Only the first `num_kept` positions of a step are appended (a stop string cut the rest).
"""

from __future__ import annotations

import itertools

import numpy as np

from vllm.outputs import MaskTextBlocks, SamplingMask, ids_from_json_text, json_text_of
from vllm.v1.outputs import SamplingMaskLists, SamplingMaskText


_phases = itertools.count()


def _first_compaction() -> int:
    """The pieces before a request's first compaction (after each hand-over): K/2 to K - 1, spread over
    requests (round robin).

    NOTE: a batch's requests start together; with K each they would all compact in the same step, 1024 copies
    into fresh memory at once (~0.1 s of page faults on the development machine) every K steps, and the step
    arrays the copies free would come back only after them. Spread, each step compacts ~1/K of the requests. At
    least K/2: a streamed (DELTA) request hands its pieces over every step and is never copied."""
    half = MaskAccumulator.COMPACT_PIECES // 2
    return half + next(_phases) % half


class MaskAccumulator:
    # NOTE: K, the id pieces kept as views before they are compacted into one array of the request's own: the
    # bound on the step arrays a request keeps alive (each ~2 MB at 1024 rows of ~500 ids). Every id is copied
    # once whatever K; K sets the number of copies (1024 / K per 1024-row step) and the bound. 64: one ~128 KB
    # copy per request per 64 tokens; 4 (few enough that the lending staging slots come back) cost no less on the
    # development machine (tools/profiling/mask_retention.py: 256 small copies per step).
    COMPACT_PIECES = 64

    __slots__ = ("request_id", "started", "num", "id_rows", "ends", "num_ids", "num_compacted", "compact_len",
                 "first_compact_len", "text")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        # Masks came (the engine returns them for this request); before that the lists are None.
        self.started = False
        self.num = 0
        # The ids (None: form not kept) as int32 pieces whose concatenation is every token's ids in order: the
        # first `num_compacted` are arrays of their own (each the pieces of one compaction), the rest one per
        # token, views of the steps' arrays; and each token's end in the ids.
        self.id_rows: list[np.ndarray] | None = None
        self.ends: list[int] | None = None
        self.num_ids = 0
        self.num_compacted = 0
        # The length of `id_rows` at which it is compacted next, and after a hand-over (see _first_compaction).
        self.first_compact_len = self.compact_len = _first_compaction()
        # The tokens' JSON text (None: form not kept).
        self.text: MaskTextBlocks | None = None

    def append(self, new_mask: SamplingMaskLists | None, new_text: SamplingMaskText | None, num_new: int,
               num_kept: int, num_before: int) -> None:
        """A step's masks (ids, JSON texts, or both, as the engine sent them) for `num_new` new tokens, of which
        the first `num_kept` are kept; `num_before`: the request's output tokens before them."""
        if num_kept == 1 and num_new == 1 and self.num:
            # NOTE: the common step (one token, in the form the request keeps), without the general path's checks:
            # this runs for every running request in every step.
            if new_text is None and new_mask is not None and self.text is None and new_mask.offsets is None:
                row = new_mask.token_ids
                rows = self.id_rows
                rows.append(row)  # type: ignore[union-attr]
                self.num_ids += len(row)
                self.ends.append(self.num_ids)  # type: ignore[union-attr]
                self.num += 1
                if len(rows) >= self.compact_len:  # type: ignore[arg-type]
                    self._compact()
                return
            if new_mask is None and new_text is not None and self.id_rows is None and new_text.offsets is None:
                self.text.append(new_text.text)  # type: ignore[union-attr]
                self.num += 1
                return
        if num_new == 0:
            return
        if new_mask is None and new_text is None:
            if self.started:
                raise RuntimeError(f"Request {self.request_id}: the engine core sent {num_new} tokens without "
                                   "their sampling masks after sending masks before.")
            return
        for rows in (new_mask, new_text):
            num_rows = num_new if rows is None else 1 if rows.offsets is None else len(rows.offsets) - 1
            if num_rows != num_new:
                raise RuntimeError(f"Request {self.request_id}: the engine core sent {num_new} tokens with "
                                   f"{num_rows} sampling masks.")
        if not self.started:
            if num_before:
                raise RuntimeError(f"Request {self.request_id}: sampling masks started after {num_before} tokens.")
            self.started = True
        if self.num == 0:  # nothing held (the first step, or all handed over): keep the forms this step brings
            self.id_rows, self.ends = ([], []) if new_mask is not None else (None, None)
            self.num_compacted, self.compact_len = 0, self.first_compact_len
            self.text = MaskTextBlocks() if new_text is not None else None
        id_rows = text_rows = None
        if new_mask is None and self.id_rows is not None:
            if self.text is None:  # ids kept, this step has text only: parse it
                id_rows = [ids_from_json_text(t) for t in new_text.rows()[:num_kept]]  # type: ignore[union-attr]
            else:
                self.id_rows = self.ends = None
        if new_text is None and self.text is not None:
            if self.id_rows is None:  # text kept, this step has ids only: format them
                text_rows = [json_text_of(a) for a in new_mask.rows()[:num_kept]]  # type: ignore[union-attr]
            else:
                self.text = None
        if self.id_rows is not None:
            if id_rows is None:
                assert new_mask is not None
                id_rows = [new_mask.token_ids] if new_mask.offsets is None else new_mask.rows()
            ends, n = self.ends, self.num_ids
            for row in id_rows[:num_kept]:
                self.id_rows.append(row)
                n += len(row)
                ends.append(n)  # type: ignore[union-attr]
            self.num_ids = n
            if len(self.id_rows) >= self.compact_len:
                self._compact()
        if self.text is not None:
            if text_rows is None:
                assert new_text is not None
                text_rows = [new_text.text] if new_text.offsets is None else new_text.rows()
            for row in text_rows[:num_kept]:
                self.text.append(row)
        self.num += num_kept

    def _compact(self) -> None:
        """The pieces since the last compaction (views of up to K steps' arrays) become one array of their own,
        in place: a cumulative output sharing the list reads the same ids, and drops the views with it."""
        rows, first = self.id_rows, self.num_compacted
        # NOTE: one slice assignment, atomic under the GIL: a reader's snapshot of the list (SamplingMask._pieces)
        # is either side of it, and both concatenate to the same ids.
        rows[first:] = [np.concatenate(rows[first:])]  # type: ignore[index]
        self.num_compacted = first + 1
        self.compact_len = first + 1 + self.COMPACT_PIECES

    def take(self, keep: bool) -> SamplingMask:
        """The masks so far. keep=False (a DELTA output, or a request's last): handed over as they are, and the
        accumulator starts empty; keep=True (a cumulative output of a request that goes on): a mask that shares
        the buffers and reads their first `num` tokens."""
        text = self.text.snapshot() if self.text is not None else None
        mask = SamplingMask._handed_over(self.num, self.id_rows, self.ends, text, not keep)
        if not keep:
            self.num = self.num_ids = 0
            self.id_rows = [] if self.id_rows is not None else None
            self.ends = [] if self.ends is not None else None
            self.num_compacted, self.compact_len = 0, self.first_compact_len
            self.text = MaskTextBlocks() if self.text is not None else None
        return mask
