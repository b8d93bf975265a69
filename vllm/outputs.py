"""User-facing results: RequestOutput, CompletionOutput, Logprob and SamplingMask (vLLM's names and fields)."""

from __future__ import annotations

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


class SamplingMask:
    """The support of each generated token: the ids the sampler could have drawn, ascending, one list per
    token and aligned 1:1 with `CompletionOutput.token_ids`.

    `token_ids` (upstream's name) is a `list[list[int]]`, built on first access: the engine hands over one int32
    array per token, so a caller that wants the compact form (`ids`, all supports concatenated, and `counts`,
    ids per token) never pays for hundreds of Python ints per token. In an API server the engine may hand over
    only each token's JSON text ("[3,17,42]" as uint8, formatted on the device): the server splices it into the
    response as is (`json_text`), and the ids are parsed from it only if something asks for them.
    """

    __slots__ = ("_arrays", "_token_ids", "_texts")

    def __init__(self, token_ids: list[list[int]] | None = None, *, arrays: Sequence[np.ndarray] | None = None,
                 texts: Sequence[np.ndarray] | None = None):
        if token_ids is not None and (arrays is not None or texts is not None):
            raise ValueError("SamplingMask takes token_ids, or arrays and/or texts, not both.")
        self._arrays = list(arrays) if arrays is not None else None
        self._texts = list(texts) if texts is not None else None
        self._token_ids = token_ids if token_ids is not None else (
            [] if arrays is None and texts is None else None)
        if self._texts is not None and self._arrays is not None and len(self._texts) != len(self._arrays):
            raise ValueError("SamplingMask texts and arrays must have one entry per token each.")

    @classmethod
    def of_lists(cls, arrays: list[np.ndarray] | None, texts: list[np.ndarray] | None) -> SamplingMask:
        """`SamplingMask(arrays=arrays, texts=texts)` that takes the lists as they are, without copying or checking
        them (once per streamed chunk): the caller gives them up; one at least is given, of one entry per token."""
        mask = cls.__new__(cls)
        mask._arrays, mask._texts, mask._token_ids = arrays, texts, None
        return mask

    def json_text(self) -> bytes | None:
        """`token_ids` as JSON (a list of lists, no spaces) from the engine's text, or None without it."""
        if self._texts is None:
            return None
        if len(self._texts) == 1:  # a streamed token's: one copy of its text, not two
            return b"".join((b"[", self._texts[0], b"]"))
        return b"".join((b"[", b",".join(self._texts), b"]"))

    def _id_arrays(self) -> list[np.ndarray] | None:
        """One int32 array per token, parsed from the texts if the engine sent only those (kept)."""
        if self._arrays is None and self._texts is not None:
            self._arrays = [ids_from_json_text(t) for t in self._texts]
        return self._arrays

    @property
    def token_ids(self) -> list[list[int]]:
        if self._token_ids is None:
            arrays = self._id_arrays()
            assert arrays is not None
            self._token_ids = [a.tolist() for a in arrays]
        return self._token_ids

    @property
    def counts(self) -> np.ndarray:
        """[num_tokens] int64: the support size of each token."""
        arrays = self._id_arrays()
        if arrays is not None:
            return np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
        return np.array([len(m) for m in self.token_ids], dtype=np.int64)

    @property
    def ids(self) -> np.ndarray:
        """[sum(counts)] int32: every token's support, concatenated in token order."""
        arrays = self._id_arrays()
        if arrays is not None:
            return np.concatenate(arrays).astype(np.int32, copy=False) if arrays else np.zeros(0, dtype=np.int32)
        return np.array([i for m in self.token_ids for i in m], dtype=np.int32)

    def concat(self, other: SamplingMask) -> SamplingMask:
        """The masks of this output's tokens followed by `other`'s (for merging streamed deltas)."""
        if self._token_ids is not None and self._arrays is None and self._texts is None or \
                other._token_ids is not None and other._arrays is None and other._texts is None:
            return SamplingMask(self.token_ids + other.token_ids)
        texts = self._texts + other._texts if self._texts is not None and other._texts is not None else None
        arrays = self._arrays + other._arrays if self._arrays is not None and other._arrays is not None else None
        if texts is None and arrays is None:  # one side has only texts, the other only arrays
            arrays = self._id_arrays() + other._id_arrays()  # type: ignore[operator]
        return SamplingMask(arrays=arrays, texts=texts)

    def __len__(self) -> int:
        if self._arrays is not None:
            return len(self._arrays)
        return len(self._texts) if self._texts is not None else len(self.token_ids)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SamplingMask) and self.token_ids == other.token_ids

    def __repr__(self) -> str:
        return f"SamplingMask(token_ids={self.token_ids!r})"


def ids_from_json_text(text: np.ndarray | bytes) -> np.ndarray:
    """int32 ids of one token's mask text ("[3,17,42]", uint8 or bytes), as the engine formats it."""
    raw = text.tobytes() if isinstance(text, np.ndarray) else bytes(text)
    return np.array(_ids_decoder.decode(raw), dtype=np.int32)


def json_text_of(ids: np.ndarray) -> bytes:
    """One token's mask ids as the engine's JSON text ("[3,17,42]", no spaces)."""
    return _ids_encoder.encode(ids.tolist())


_ids_decoder = msgspec.json.Decoder(list[int])
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
