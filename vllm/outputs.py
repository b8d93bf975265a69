"""User-facing results: RequestOutput, CompletionOutput, Logprob and SamplingMask (vLLM's names and fields)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np


@dataclass(slots=True)
class Logprob:
    """The log-probability of one token, with its rank in the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob (the top N plus the sampled token).
SampleLogprobs = list[dict[int, Logprob]]


class MaskTextBlocks:
    """Tokens' sampling masks as JSON text, written back to back into a few large buffers: "[" and then each
    token's list followed by ",". The first buffer fits the first row, each next one is twice the last, up to
    BLOCK_BYTES, so that a long response's text is a handful of buffers, filled while the request ran, that a
    server sends as they are (no join at the end) once the last "," is made the closing "]" (`parts`).

    Invariant: bytes written are never changed or moved, except an owner's last "," -> "]" (the used part of
    a buffer is what a reader of the first `num` tokens reads, `snapshot`)."""

    BLOCK_BYTES = 1 << 18

    __slots__ = ("blocks", "pos", "num")

    def __init__(self) -> None:
        self.blocks: list[bytearray] = []
        self.pos = 0  # bytes used in the last block
        self.num = 0

    def append(self, row: Any) -> None:
        """One token's JSON list ("[3,17,42]", any buffer of bytes)."""
        n = len(row)
        blocks = self.blocks
        block = blocks[-1] if blocks else None
        pos = self.pos
        if block is None or pos + n + 1 > len(block):
            if block is not None:
                size = min(2 * len(block), self.BLOCK_BYTES)
                del block[pos:]  # the spare tail goes; the used part stays where it is
            else:
                size = 0
            block = bytearray(max(size, n + 2))
            if not blocks:
                block[0] = _OPEN
                pos = 1
            else:
                pos = 0
            blocks.append(block)
        # NOTE: a memoryview takes any buffer (a numpy row too) and copies it with one memcpy.
        memoryview(block)[pos:pos + n] = row
        block[pos + n] = _COMMA
        self.pos = pos + n + 1
        self.num += 1

    def snapshot(self) -> tuple[list[bytearray], int, int, int]:
        """(blocks, blocks used, bytes used in the last one, tokens): what `parts` reads."""
        return self.blocks, len(self.blocks), self.pos, self.num


def _text_parts(blocks: list[bytearray], num_blocks: int, last: int, num: int, owned: bool) -> list[Any]:
    """The JSON text of a MaskTextBlocks snapshot as buffers in order. owned (no one appends to these blocks any
    more): the blocks themselves, the last one closed in place and cut to its used part; else a copy of the last
    one's used part."""
    if num == 0:
        return [b"[]"]
    block = blocks[num_blocks - 1]
    if owned:
        if len(block) > last:
            del block[last:]
        block[last - 1] = _CLOSE
        return blocks[:num_blocks]
    return [*blocks[:num_blocks - 1], b"".join((memoryview(block)[:last - 1], b"]"))]


class SamplingMask:
    """The support of each generated token: the ids the sampler could have drawn, ascending, one list per
    token and aligned 1:1 with `CompletionOutput.token_ids`.

    `token_ids` (upstream's name) is a `list[list[int]]`, built on first access only, so that a caller who never
    reads it never pays for hundreds of Python ints per token. The other forms:

    - `ids` (int32, every token's support concatenated in token order) and `offsets` (int64, token t owns
      `ids[offsets[t]:offsets[t + 1]]`), or `counts` (ids per token): the compact form, numpy arrays with no
      Python object per id (`SamplingMask.from_flat(ids, offsets)` builds a mask from them);
    - `json_parts()` / `json_text()`: in an API server the engine may hand over only each token's JSON text
      ("[3,17,42]", formatted on the device): the masks' JSON ("[[3,17,42],[5]]") is then spliced into the
      response as is (as a few buffers, or one), and the ids are parsed from it only if something asks for them.

    Held as the engine handed it over (vllm/v1/engine/mask_accumulator.py): the int32 ids as pieces whose
    concatenation is every token's ids in order (`_id_rows`: a view per token as a step brought it, or an array of
    the request's own per K of them), with each token's end in the ids (`_ends`), and/or the text in
    MaskTextBlocks (`_text`: a snapshot); a cumulative output shares its request's buffers, which only grow (the
    pieces are compacted in place: their concatenation only grows), and reads the first `_num` tokens (`_owned`
    False: it copies what it would otherwise close in place, and cuts the pieces at its tokens' end; an owned
    mask's pieces are its tokens' ids exactly). Each form is built once, when first asked for (`_ids`,
    `_token_ids`).
    """

    __slots__ = ("_num", "_id_rows", "_ids", "_ends", "_text", "_owned", "_token_ids")

    def __init__(self, token_ids: list[list[int]] | None = None, *, arrays: Sequence[np.ndarray] | None = None,
                 texts: Sequence[np.ndarray | bytes] | None = None):
        if token_ids is not None and (arrays is not None or texts is not None):
            raise ValueError("SamplingMask takes token_ids, or arrays and/or texts, not both.")
        if texts is not None and arrays is not None and len(texts) != len(arrays):
            raise ValueError("SamplingMask texts and arrays must have one entry per token each.")
        self._token_ids = token_ids if token_ids is not None else ([] if arrays is None and texts is None else None)
        self._num = len(token_ids if token_ids is not None else arrays if arrays is not None else texts or [])
        self._ids = self._text = None
        self._owned = True
        self._id_rows = [np.ascontiguousarray(a, dtype=np.int32) for a in arrays] if arrays is not None else None
        self._ends = np.cumsum([len(a) for a in arrays], dtype=np.int64) if arrays is not None else None
        if texts is not None:
            text = MaskTextBlocks()
            for t in texts:
                text.append(t)
            self._text = text.snapshot()

    @classmethod
    def from_flat(cls, ids: np.ndarray, offsets: np.ndarray) -> SamplingMask:
        """The masks of len(offsets) - 1 tokens in the compact form: token t's support is
        ids[offsets[t]:offsets[t + 1]] (offsets start at 0, never decrease, and end at len(ids))."""
        offsets = np.asarray(offsets, dtype=np.int64)
        if offsets.ndim != 1 or not len(offsets) or offsets[0] != 0 or offsets[-1] != len(ids) \
                or (np.diff(offsets) < 0).any():
            raise ValueError("SamplingMask offsets must start at 0, never decrease and end at len(ids).")
        mask = cls._handed_over(len(offsets) - 1, None, offsets[1:], None, True)
        mask._ids = np.asarray(ids, dtype=np.int32)
        return mask

    @classmethod
    def _handed_over(cls, num: int, id_rows: list | None, ends: Any, text: tuple | None,
                     owned: bool) -> SamplingMask:
        """A mask of the first `num` tokens of these buffers (int32 id rows with their `ends`, a MaskTextBlocks
        snapshot), as they are: no copy, no check (the output processor's hand-over)."""
        mask = cls.__new__(cls)
        mask._num, mask._id_rows, mask._ends, mask._text, mask._owned = num, id_rows, ends, text, owned
        mask._ids = mask._token_ids = None
        return mask

    def json_parts(self) -> list[Any] | None:
        """`token_ids` as JSON (a list of lists, no spaces) from the engine's text, as buffers to send in order
        (no join: an owned mask's own blocks), or None without the text. Do not change them."""
        if self._text is None:
            return None
        return _text_parts(*self._text, self._owned)

    def json_text(self) -> bytes | bytearray | None:
        """`json_parts()` as one buffer (joined if need be)."""
        parts = self.json_parts()
        if parts is None:
            return None
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @property
    def ids(self) -> np.ndarray:
        """[sum(counts)] int32: every token's support, concatenated in token order."""
        if self._ids is None:
            if self._id_rows is not None:
                pieces = self._pieces()
                self._ids = np.concatenate(pieces).astype(np.int32, copy=False) if pieces else np.zeros(0, np.int32)
                self._id_rows = None  # NOTE: the views go, and with them what they kept alive of the steps
            elif self._text is not None:
                self._from_text()
            else:  # built from lists
                self._ids = np.fromiter(itertools.chain.from_iterable(self.token_ids), dtype=np.int32)
        return self._ids  # type: ignore[return-value]

    @property
    def offsets(self) -> np.ndarray:
        """[num_tokens + 1] int64: token t's support is ids[offsets[t]:offsets[t + 1]]."""
        if self._ends is None:
            if self._text is not None:
                self._from_text()
            else:
                return np.cumsum([0] + [len(m) for m in self.token_ids], dtype=np.int64)
        offsets = np.zeros(self._num + 1, dtype=np.int64)
        offsets[1:] = self._ends[:self._num]
        return offsets

    @property
    def counts(self) -> np.ndarray:
        """[num_tokens] int64: the support size of each token."""
        return np.diff(self.offsets)

    def _from_text(self) -> None:
        """The ids, their ends and the lists parsed from the JSON text (a mask the engine sent as text only)."""
        rows = _lists_decoder.decode(self.json_text())
        ends = np.cumsum([len(r) for r in rows], dtype=np.int64)
        self._ends = ends
        self._ids = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32,
                                count=int(ends[-1]) if len(rows) else 0)
        if self._token_ids is None:
            self._token_ids = rows

    @property
    def token_ids(self) -> list[list[int]]:
        if self._token_ids is None:
            if not self._has_ids():
                self._from_text()  # NOTE: parsed straight into the lists
            else:
                flat, ends = self.ids.tolist(), self.offsets.tolist()
                self._token_ids = [flat[a:b] for a, b in zip(ends, ends[1:])]
        return self._token_ids  # type: ignore[return-value]

    def _has_ids(self) -> bool:
        return self._id_rows is not None or self._ids is not None

    def concat(self, other: SamplingMask) -> SamplingMask:
        """The masks of this output's tokens followed by `other`'s (for merging streamed deltas): the texts when
        both have them, the ids (parsed from a text if need be) when both have them or only one side has texts.

        Linear in `other` (a consumer that falls behind merges many deltas into one): an owned text's blocks are
        taken over and appended to (this mask then reads them as a shared snapshot: a copy, never a close in
        place), and the ids are kept as the two sides' per-token rows, not concatenated."""
        sides = (self, other)
        if any(not s._has_ids() and s._text is None for s in sides):  # a side built from lists
            return SamplingMask(self.token_ids + other.token_ids)
        text = None
        if self._text is not None and other._text is not None:
            text = self._text_followed_by(other)
        rows = ends = None
        if all(s._has_ids() for s in sides) or text is None:
            rows = self._pieces() + other._pieces()
            ends = np.concatenate((self.offsets[1:], other.offsets[1:] + int(self.offsets[-1])))
        return SamplingMask._handed_over(self._num + other._num, rows, ends, text, True)

    def _pieces(self) -> list[np.ndarray]:
        """int32 arrays (views: no copy) whose concatenation is this mask's ids."""
        if self._id_rows is None:
            return [self.ids]
        # NOTE: one snapshot of the list: a cumulative output's is its request's, which may be compacted meanwhile
        # (vllm/v1/engine/mask_accumulator.py); either side of that, the pieces concatenate to the same ids.
        pieces = self._id_rows[:]
        if self._owned:
            return pieces
        total = int(self._ends[self._num - 1]) if self._num else 0
        cut: list[np.ndarray] = []
        n = 0
        for piece in pieces:
            if n >= total:
                break
            cut.append(piece if n + len(piece) <= total else piece[:total - n])
            n += len(piece)
        return cut

    def _text_followed_by(self, other: SamplingMask) -> tuple:
        """A MaskTextBlocks snapshot of this mask's text followed by other's: this one's blocks continued when it
        owns them (it stops owning them), else a copy."""
        blocks = MaskTextBlocks()
        if self._owned and self._num:
            old, num_blocks, last, num = self._text  # type: ignore[misc]
            blocks.blocks, blocks.pos, blocks.num = old[:num_blocks], last, num
            old[num_blocks - 1][last - 1] = _COMMA  # NOTE: reopened if a read closed it; readers of self copy now
            self._owned = False
        elif self._num:
            blocks.append(memoryview(self.json_text())[1:-1])  # type: ignore[index]
            blocks.num = self._num
        if other._num:
            num = blocks.num
            blocks.append(memoryview(other.json_text())[1:-1])  # type: ignore[index]  # its rows, "," between
            blocks.num = num + other._num
        return blocks.snapshot()

    def __reduce__(self) -> tuple[Any, tuple]:
        """Pickled flat (Ray actors return rollouts pickled): the ids with their ends and/or the JSON text, a few
        buffers whatever the token count, not one per token (nor the request's whole shared text blocks)."""
        text = None if self._text is None else bytes(self.json_text())  # type: ignore[arg-type]
        ids = ends = None
        if self._has_ids() or text is None:
            ids, ends = self.ids, self.offsets[1:]
        return _unpickle_mask, (self._num, ids, ends, text)

    def __len__(self) -> int:
        return self._num

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SamplingMask) and self.token_ids == other.token_ids

    def __repr__(self) -> str:
        return f"SamplingMask(token_ids={self.token_ids!r})"


def _unpickle_mask(num: int, ids: np.ndarray | None, ends: np.ndarray | None, text: bytes | None) -> SamplingMask:
    """SamplingMask.__reduce__'s other half: the mask of `num` tokens from its flat ids and ends and/or its text."""
    snapshot = None
    if text is not None:
        blocks = MaskTextBlocks()
        if num:
            blocks.append(memoryview(text)[1:-1])  # its rows, "," between them: one append of them all
        snapshot = blocks.snapshot()[:3] + (num,)
    mask = SamplingMask._handed_over(num, None, ends, snapshot, True)
    mask._ids = ids
    return mask


def ids_from_json_text(text: np.ndarray | bytes) -> np.ndarray:
    """int32 ids of one token's mask text ("[3,17,42]", uint8 or bytes), as the engine formats it."""
    raw = text.tobytes() if isinstance(text, np.ndarray) else bytes(text)
    return np.array(_ids_decoder.decode(raw), dtype=np.int32)


def json_text_of(ids: np.ndarray) -> bytes:
    """One token's mask ids as the engine's JSON text ("[3,17,42]", no spaces)."""
    return _ids_encoder.encode(ids.tolist())


_ids_decoder = msgspec.json.Decoder(list[int])
_lists_decoder = msgspec.json.Decoder(list[list[int]])
_OPEN, _COMMA, _CLOSE = ord("["), ord(","), ord("]")
_ids_encoder = msgspec.json.Encoder()


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sampling_mask: SamplingMask | None = None
    # Which weights computed which tokens: [weight version, first token, end] spans over this completion's tokens
    # (positions count from its first token, also in a streamed delta), in order; a request that ran across a
    # weight update has two spans. The version is the one given to finish_weight_update / update_weight_version
    # (None: weights never named). None until the engine's weights have a name.
    weight_versions: list[list[Any]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True, init=False)
class RequestOutput:
    """One request's output so far. The constructor takes vLLM's keyword arguments: the ones this engine has no use
    for (`lora_request`, `encoder_prompt`, `multi_modal_placeholders`, `kv_transfer_params`, ...) are accepted and
    ignored, as vLLM ignores unknown ones, so code that builds RequestOutputs (tests, mocks) runs unchanged."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    # None for the first prompt token, then one {token id: Logprob} per prompt token (SamplingParams.prompt_logprobs;
    # a FlatLogprobs with flat_logprobs), or None when not requested.
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None
    metrics: object | None

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                 prompt_logprobs: Any, outputs: list[CompletionOutput], finished: bool,
                 num_cached_tokens: int | None = None, metrics: object | None = None, **kwargs: object) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.num_cached_tokens = num_cached_tokens
        self.metrics = metrics
        if kwargs:
            _warn_ignored(kwargs)


# vLLM's RequestOutput arguments with no counterpart here, ignored without a warning.
_KNOWN_IGNORED = frozenset({"lora_request", "encoder_prompt", "encoder_prompt_token_ids",
                            "multi_modal_placeholders", "kv_transfer_params"})
_warned: set[str] = set()


def _warn_ignored(kwargs: dict[str, object]) -> None:
    new = sorted(set(kwargs) - _KNOWN_IGNORED - _warned)
    if new:
        _warned.update(new)
        logging.getLogger(__name__).warning("RequestOutput: ignoring unknown argument(s) %s.", ", ".join(new))
