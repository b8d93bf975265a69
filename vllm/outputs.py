"""User-facing results: RequestOutput, CompletionOutput, Logprob and SamplingMask (vLLM's names and fields)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    ids per token) never pays for hundreds of Python ints per token.
    """

    __slots__ = ("_arrays", "_token_ids", "_texts")

    def __init__(self, token_ids: list[list[int]] | None = None, *, arrays: Sequence[np.ndarray] | None = None,
                 texts: Sequence[np.ndarray] | None = None):
        if token_ids is not None and arrays is not None:
            raise ValueError("SamplingMask takes token_ids or arrays, not both.")
        self._arrays = list(arrays) if arrays is not None else None
        self._token_ids = None if arrays is not None else (token_ids if token_ids is not None else [])
        # The API server's JSON text of each token's ids ("[3,17,42]" as uint8), when the engine made it.
        self._texts = list(texts) if texts is not None else None
        if self._texts is not None and (self._arrays is None or len(self._texts) != len(self._arrays)):
            raise ValueError("SamplingMask texts need arrays, one text per token.")

    def json_text(self) -> bytes | None:
        """`token_ids` as JSON (a list of lists, no spaces) from the engine's text, or None without it."""
        if self._texts is None:
            return None
        return b"".join((b"[", b",".join(self._texts), b"]"))

    @property
    def token_ids(self) -> list[list[int]]:
        if self._token_ids is None:
            assert self._arrays is not None
            self._token_ids = [a.tolist() for a in self._arrays]
        return self._token_ids

    @property
    def counts(self) -> np.ndarray:
        """[num_tokens] int64: the support size of each token."""
        if self._arrays is not None:
            return np.fromiter((len(a) for a in self._arrays), dtype=np.int64, count=len(self._arrays))
        return np.array([len(m) for m in self.token_ids], dtype=np.int64)

    @property
    def ids(self) -> np.ndarray:
        """[sum(counts)] int32: every token's support, concatenated in token order."""
        if self._arrays is not None:
            return np.concatenate(self._arrays).astype(np.int32, copy=False) if self._arrays else \
                np.zeros(0, dtype=np.int32)
        return np.array([i for m in self.token_ids for i in m], dtype=np.int32)

    def concat(self, other: SamplingMask) -> SamplingMask:
        """The masks of this output's tokens followed by `other`'s (for merging streamed deltas)."""
        texts = self._texts + other._texts if self._texts is not None and other._texts is not None else None
        if self._arrays is not None and other._arrays is not None:
            return SamplingMask(arrays=self._arrays + other._arrays, texts=texts)
        return SamplingMask(self.token_ids + other.token_ids)

    def __len__(self) -> int:
        return len(self._arrays) if self._arrays is not None else len(self.token_ids)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SamplingMask) and self.token_ids == other.token_ids

    def __repr__(self) -> str:
        return f"SamplingMask(token_ids={self.token_ids!r})"


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

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None
    metrics: object | None = None
