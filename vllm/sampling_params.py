"""SamplingParams: the per-request sampling settings, with vLLM's names and validation.

Every invalid value raises `ValueError` naming the field and its allowed range; a request that fails validation
never reaches the engine, so nothing already running is disturbed.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import msgspec

_SAMPLING_EPS = 1e-5


class RequestOutputKind(IntEnum):
    # Return the entire output so far in every RequestOutput.
    CUMULATIVE = 0
    # Return only the deltas in each RequestOutput.
    DELTA = 1
    # Do not return intermediate RequestOutputs.
    FINAL_ONLY = 2


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class SamplingParams(msgspec.Struct, omit_defaults=True, dict=True):  # type: ignore[call-arg]
    """Sampling parameters for text generation (vLLM's names and defaults).

    The sampler applies, in this order: temperature, min_p, top_k, top_p. top_k keeps every token whose logit
    is >= the k-th largest (ties at the boundary kept); top_p keeps the smallest prefix of the top-k survivors,
    sorted by probability, whose mass reaches top_p.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Per-request opt-out of the sampling mask when the engine returns masks (beyond upstream). None means
    # "follow the engine flag".
    return_sampling_mask: bool | None = None
    # vLLM's: the sample logprobs as one FlatLogprobs (vllm/logprobs.py) instead of a list of dicts, a constant
    # number of objects per request for the garbage collector (offline and AsyncLLM callers; the HTTP server
    # always builds its responses from dicts).
    flat_logprobs: bool = False

    # Derived in __post_init__.
    output_text_buffer_length: int = 0
    _all_stop_token_ids: set[int] = msgspec.field(default_factory=set)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        # NOTE: top_k -1 is vLLM's old spelling of "disabled"; normalise to 0.
        if self.top_k == -1:
            self.top_k = 0
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other filters cannot change the argmax.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        self._all_stop_token_ids = set(self.stop_token_ids)
        if self.stop and not self.include_stop_str_in_output:
            # Hold back enough characters that a stop string split across steps is never emitted.
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """Build from keyword arguments, dropping the ones that are None (HTTP request fields)."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    def _verify_args(self) -> None:
        def bad(field: str, rule: str, value: Any) -> ValueError:
            return ValueError(f"{field} must be {rule}, got {value!r}.")

        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1", self.n)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "in (0, 2]", self.repetition_penalty)
        if self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0:
            raise ValueError("presence_penalty, frequency_penalty and repetition_penalty are not supported yet; "
                             "leave them at 0, 0 and 1.")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise bad("temperature", "non-negative", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "-1 or 0 (disable) or at least 1", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]", self.min_p)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "at least 1", self.max_tokens)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "non-negative", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}.")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "non-negative", self.logprobs)
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported yet; leave it unset.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer", self.seed)
        assert isinstance(self.stop, list)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a string or a list of non-empty strings.")
        assert isinstance(self.stop_token_ids, list)
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers.")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    def clone(self) -> SamplingParams:
        return msgspec.structs.replace(self)

    def __repr__(self) -> str:
        fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__ if not f.startswith("_"))
        return f"SamplingParams({fields})"
