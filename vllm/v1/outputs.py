"""What the model runner returns each step: ModelRunnerOutput with its host-side lists.

Per-step results are CSR-like: row p is one generated position; `cu_num_generated_tokens` (length num_reqs+1)
maps requests to positions, or is None when every request of the step owns exactly one position (row ==
req_idx). A request that sampled nothing in the step (a chunked-prefill piece) has an empty row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch


def _position_range(cu: list[int] | None, req_idx: int, num_positions: int) -> tuple[int, int]:
    start = cu[req_idx] if cu is not None else req_idx
    return start, start + num_positions


def _slice_csr(data: np.ndarray, offsets: np.ndarray | None, cu: list[int] | None, req_idx: int,
               num_positions: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(data, offsets) of request req_idx's positions in a step CSR; offsets None for a single position."""
    assert offsets is not None, "slice_request needs the step's offsets"
    start, end = _position_range(cu, req_idx, num_positions)
    lo, hi = int(offsets[start]), int(offsets[end])
    return data[lo:hi], None if num_positions == 1 else offsets[start:end + 1] - lo


def _csr_rows(data: np.ndarray, offsets: np.ndarray | None) -> list[np.ndarray]:
    """One array per position of a CSR (offsets None: the whole data is one position)."""
    return [data] if offsets is None else np.split(data, offsets[1:-1])


class LogprobsLists(NamedTuple):
    # [num_positions, num_logprobs + 1] int32: the sampled token first, then the top num_logprobs.
    logprob_token_ids: np.ndarray
    # [num_positions, num_logprobs + 1] float32
    logprobs: np.ndarray
    # [num_positions] int32: rank of the sampled token in the vocabulary (1 = most likely).
    sampled_token_ranks: np.ndarray
    cu_num_generated_tokens: list[int] | None = None


class LogprobsTensors(NamedTuple):
    # [num_reqs, num_logprobs + 1] int32
    logprob_token_ids: torch.Tensor
    # [num_reqs, num_logprobs + 1] float32
    logprobs: torch.Tensor
    # [num_reqs] int32
    selected_token_ranks: torch.Tensor

    def tolists(self, cu_num_generated_tokens: list[int] | None = None) -> LogprobsLists:
        return LogprobsLists(self.logprob_token_ids.cpu().numpy(), self.logprobs.cpu().numpy(),
                             self.selected_token_ranks.cpu().numpy(), cu_num_generated_tokens)


class SamplingMaskLists(NamedTuple):
    """The step's supports as a CSR over positions: position p owns token_ids[offsets[p]:offsets[p+1]].

    `offsets=None` means the whole `token_ids` is one position (what `slice_request` returns by default).
    `token_ids=None` (the engine core of an API server, whose masks leave as JSON text, SamplingMaskText): the
    ids stayed on the device; the offsets still give each position's support size. Such lists never leave the
    engine core (StepMasks).
    """

    # [total_support] int32, ascending within each position; None: sizes only (above).
    token_ids: np.ndarray | None
    # [num_positions + 1] int64, or None for a single position (the default, as upstream's).
    offsets: np.ndarray | None = None
    cu_num_generated_tokens: list[int] | None = None

    def slice_request(self, req_idx: int, num_positions: int = 1) -> SamplingMaskLists:
        return SamplingMaskLists(*_slice_csr(self.token_ids, self.offsets, self.cu_num_generated_tokens, req_idx,
                                             num_positions))

    def rows(self) -> list[np.ndarray]:
        """One int32 id array per position."""
        return _csr_rows(self.token_ids, self.offsets)

    @property
    def num_positions(self) -> int:
        return 1 if self.offsets is None else len(self.offsets) - 1

    def to_nested_list(self) -> list[list[int]]:
        if self.offsets is None:
            return [self.token_ids.tolist()]
        ids, offs = self.token_ids, self.offsets.tolist()
        return [ids[offs[i]:offs[i + 1]].tolist() for i in range(len(offs) - 1)]


class SamplingMaskText(NamedTuple):
    """The step's supports as JSON text, for the API server: position p's "[3,17,42]" is text[offsets[k]:
    offsets[k+1]] with k = rank[p], or k = p without `rank` (rows aligned with the step's SamplingMaskLists).
    `offsets=None`: one position.

    `rank` is the device's packing order: the rows of each API server together (json_rows_packed with a group),
    so that each server is sent one span of its own rows; a request's positions are consecutive rows of one
    group, so they are consecutive there too."""

    # [total_bytes] uint8
    text: np.ndarray
    # [num_rows + 1] int64, or None for a single position.
    offsets: np.ndarray | None
    cu_num_generated_tokens: list[int] | None = None
    # [num_positions] int64: each position's row in the packing; None: position p is row p.
    rank: np.ndarray | None = None

    def packed_rows(self, positions: np.ndarray | int) -> np.ndarray | int:
        """The packing's row of each of `positions`."""
        return positions if self.rank is None else self.rank[positions]

    def slice_request(self, req_idx: int, num_positions: int = 1) -> SamplingMaskText:
        start = _position_range(self.cu_num_generated_tokens, req_idx, num_positions)[0]
        return SamplingMaskText(*_slice_csr(self.text, self.offsets, None, int(self.packed_rows(start)),
                                            num_positions))

    def rows(self) -> list[np.ndarray]:
        """One uint8 array (the JSON text) per position."""
        rows = _csr_rows(self.text, self.offsets)
        return rows if self.rank is None else [rows[k] for k in self.rank.tolist()]


def _step_positions(first_pos: np.ndarray, num_pos: np.ndarray) -> np.ndarray:
    """[sum(num_pos)] int64: positions first_pos[r] .. first_pos[r] + num_pos[r] - 1 of every row r, in order."""
    if not len(num_pos) or (num_pos == 1).all():
        return first_pos
    starts = first_pos - (np.cumsum(num_pos) - num_pos)
    return np.repeat(starts, num_pos) + np.arange(int(num_pos.sum()))


class StepLogprobs(NamedTuple):
    """A step's logprobs kept whole in the engine core, with the positions each output carries: output
    `out_index[r]` owns positions first_pos[r] .. first_pos[r] + num_pos[r] - 1 (rows in output order).

    The scheduler builds it instead of slicing every request's rows; the wire packing gathers them once per step
    (`gather`, serial_utils.pack_step_arrays), in-process consumers get per-output slices from `materialize`."""

    lists: LogprobsLists
    # [R] int64 each
    out_index: np.ndarray
    first_pos: np.ndarray
    num_pos: np.ndarray

    def gather(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token ids, logprobs, ranks) of every carried position, row after row."""
        pos = _step_positions(self.first_pos, self.num_pos)
        return self.lists.logprob_token_ids[pos], self.lists.logprobs[pos], self.lists.sampled_token_ranks[pos]

    def select(self, rows: np.ndarray, out_index: np.ndarray) -> StepLogprobs:
        """The rows `rows`, renumbered to the outputs `out_index` (one client's share of the step)."""
        return self._replace(out_index=out_index, first_pos=self.first_pos[rows], num_pos=self.num_pos[rows])

    def materialize(self, outputs: list) -> None:
        """Give each output its own LogprobsLists slice (new_logprobs), as the scheduler did."""
        ids, values, ranks = self.lists[:3]
        for out, first, num in zip(self.out_index.tolist(), self.first_pos.tolist(), self.num_pos.tolist()):
            end = first + num
            outputs[out].new_logprobs = LogprobsLists(ids[first:end], values[first:end], ranks[first:end], None)


class StepMasks(NamedTuple):
    """A step's sampling masks (and their JSON text) kept whole in the engine core, with the positions each
    output carries, as in StepLogprobs.

    The wire packing gathers the rows once per step (`gather`) and in-process consumers get per-output slices
    from `materialize`."""

    masks: SamplingMaskLists
    texts: SamplingMaskText | None
    # [R] int64 each
    out_index: np.ndarray
    first_pos: np.ndarray
    num_pos: np.ndarray

    def sizes(self) -> np.ndarray:
        """Ids in each carried position's mask (int64)."""
        offsets = self.masks.offsets
        assert offsets is not None
        pos = _step_positions(self.first_pos, self.num_pos)
        return offsets[pos + 1] - offsets[pos]

    def gather(self, text: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start, size) of every carried position in `data`, and `data`: a view of the step's mask ids (or
        texts) from the first carried byte to the last, never a copy.

        NOTE: with several API servers, one server's positions: the span that covers them is sent as a
        zero-copy frame. The texts are packed by server on the device (SamplingMaskText.rank), so that span is
        the server's own rows only; the ids (sent only without texts) are in row order, so their span is ~the
        whole step for each server (the ZMQ I/O threads copy it per server; gathering the rows cost the core's
        main thread ~1.5 ms per 1024-row step instead)."""
        data, offsets = (self.texts.text, self.texts.offsets) if text and self.texts is not None else \
            (self.masks.token_ids, self.masks.offsets)
        assert offsets is not None and data is not None, "these masks carry no ids (SamplingMaskLists)"
        pos = _step_positions(self.first_pos, self.num_pos)
        if text and self.texts is not None:
            pos = self.texts.packed_rows(pos)
        lo, hi = offsets[pos], offsets[pos + 1]
        if not len(pos):
            return lo, hi - lo, data[:0]
        base, top = int(lo.min()), int(hi.max())
        return lo - base, hi - lo, data[base:top]

    select = StepLogprobs.select

    def text_shares(self, order: np.ndarray, bounds: list[int], slot: np.ndarray) -> list[StepTextShare] | None:
        """Every client's share of the step's JSON texts, cut in one pass over the step (what `select(...)
        .gather(text=True)` gives per client, without its dozen numpy calls per client), or None where the step
        is not of the shape this needs: one position per carried output, texts packed with each client's
        positions as one run in its output order (an API server engine's decode step: the device packs the
        rows by API server, SamplingMaskText.rank); the caller then selects and gathers per client.

        order: the carried outputs (indices into out_index) sorted by client, stably; client c's are
        order[bounds[c]:bounds[c + 1]]. slot: [len(out_index)] each carried output's index among its client's
        outputs."""
        texts, n = self.texts, len(self.out_index)
        if texts is None or texts.offsets is None or not n or not bool((self.num_pos == 1).all()):
            return None
        packed = texts.packed_rows(self.first_pos[order])  # the packed row of each position, by client
        if int(packed[0]) != 0 or not bool((np.diff(packed) == 1).all()):
            return None  # e.g. a row that carries no mask between two that do, or outputs out of row order
        offsets = texts.offsets
        sizes = np.diff(offsets[:n + 1])
        cut = offsets[bounds].tolist()
        return [StepTextShare(slot[order[s:e]], self.num_pos[order[s:e]], offsets[s:e] - cut[c], sizes[s:e],
                              texts.text[cut[c]:cut[c + 1]])
                for c, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))]

    def materialize(self, outputs: list) -> None:
        """Give each output its own slice (new_sampling_mask / new_sampling_mask_text), as the scheduler did; with
        ids-free lists (token_ids None) the text only, as the wire carries it."""
        masks, texts = self.masks, self.texts
        assert masks.token_ids is not None or texts is not None, "masks with neither ids nor text"
        ids, offsets = masks.token_ids, masks.offsets
        if ids is not None:
            assert offsets is not None
            # NOTE: each output's id range from two gathers for the whole step, not two numpy scalars per output
            # (the in-process engine materializes ~1000 outputs per step).
            lo, hi = offsets[self.first_pos].tolist(), offsets[self.first_pos + self.num_pos].tolist()
        for k, (out, first, num) in enumerate(zip(self.out_index.tolist(), self.first_pos.tolist(),
                                                  self.num_pos.tolist())):
            if ids is not None:
                a = lo[k]
                outputs[out].new_sampling_mask = SamplingMaskLists(
                    ids[a:hi[k]], None if num == 1 else offsets[first:first + num + 1] - a)
            if texts is not None:
                outputs[out].new_sampling_mask_text = SamplingMaskText(*_slice_csr(
                    texts.text, texts.offsets, None, int(texts.packed_rows(first)), num))


class StepTextShare(NamedTuple):
    """One client's share of a step's mask texts (StepMasks.text_shares), as pack_step_arrays sends it: the
    client's outputs that carry masks, positions per output, each position's start and size in `data`, and
    `data`, a view of the step's text from the share's first byte to its last."""

    out_index: np.ndarray
    num_pos: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray
    data: np.ndarray


def step_mask_stats(step_masks: StepMasks, top_k: np.ndarray) -> tuple[list[int], int]:
    """The sizes of the carried positions' masks, and how many exceed their request's top_k (top_k: [len(out_index)]
    int64, one per carried output; <= 0: no top-k)."""
    sizes = step_masks.sizes()
    top_k = np.repeat(top_k, step_masks.num_pos)
    return sizes.tolist(), int(np.count_nonzero((top_k > 0) & (sizes > top_k)))


class PendingStepMasks(NamedTuple):
    """A step's StepMasks whose lists are not built yet (deferred by the engine core): the positions each output
    carries are known at the step's update, the lists are built by `resolve()` on the engine's main thread when
    the step's outputs are sent or handed on, the next step already running (resolve_step_rows)."""

    # The runner's deferred masks (vllm/v1/worker/async_output.py: DeferredMasks): `build()` -> (lists, texts).
    masks: Any
    out_index: np.ndarray
    first_pos: np.ndarray
    num_pos: np.ndarray
    # [len(out_index)] int64: each carried output's request top_k.
    top_k: np.ndarray

    def resolve(self) -> tuple[StepMasks, list[int], int]:
        """The StepMasks, the carried positions' mask sizes and the count of those past their top_k."""
        lists, texts = self.masks.build()
        step_masks = StepMasks(lists, texts, self.out_index, self.first_pos, self.num_pos)
        return (step_masks, *step_mask_stats(step_masks, self.top_k))


class StepRowSettings(NamedTuple):
    """Settings of each runner row of a step (aligned with ModelRunnerOutput.req_ids) that the scheduler needs to
    route the step's logprobs and masks (Scheduler._step_rows), taken from the runner's per-row arrays so that it
    does not read them from every request in Python."""

    # [num_reqs] bool: the row's request asked for logprobs.
    wants_logprobs: np.ndarray
    # [num_reqs] bool: the row's request gets sampling masks (the engine returns them and it did not opt out).
    wants_mask: np.ndarray
    # [num_reqs] int: the row's top_k; the vocabulary size for none.
    top_k: np.ndarray


@dataclass(slots=True)
class ModelRunnerOutput:
    # [num_reqs]
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request: the tokens sampled this step (empty for a partial prefill).
    sampled_token_ids: list[list[int]]
    logprobs: LogprobsLists | None = None
    sampling_masks: SamplingMaskLists | None = None
    # The same supports as JSON text, when the API server asked for it (ModelConfig.sampling_mask_text).
    sampling_mask_text: SamplingMaskText | None = None
    # Deferred by the engine core: the masks not yet built into sampling_masks / sampling_mask_text (both None
    # then), an object with `build()` -> (lists, texts) and `release()` (async_output.DeferredMasks).
    pending_masks: Any = None
    # The model runner's per-row settings; None (hand-built outputs): the scheduler reads the requests'.
    row_settings: StepRowSettings | None = None
    # Requests whose prompt logprobs were completed this step (vllm.v1.engine.PromptLogprobs), by request id.
    prompt_logprobs_dict: dict[str, Any] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
