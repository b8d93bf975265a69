"""User-facing results: RequestOutput, CompletionOutput, Logprob and SamplingMask (vLLM's names and fields)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """The log-probability of one token, with its rank in the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob (the top N plus the sampled token).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class SamplingMask:
    """The support of each generated token: the ids the sampler could have drawn, ascending, one list per
    token and aligned 1:1 with `CompletionOutput.token_ids`."""

    token_ids: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)


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
