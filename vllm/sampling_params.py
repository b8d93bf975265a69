"""SamplingParams: the per-request sampling settings, with vLLM's names and validation.

Every invalid value raises `VLLMValidationError` (a ValueError) naming the field and its allowed range; a request
that fails validation never reaches the engine, so nothing already running is disturbed.

Invariants of a constructed SamplingParams (what the engine core and its msgspec wire may rely on):
- every float is finite (temperature in [0, 2]); every integer is an int (not a bool) within int64, so the request
  always encodes; `n` is in [1, VLLM_MAX_N_SEQUENCES] and `seed + n - 1` (the last sample's seed) fits int64;
- `stop` is a list of non-empty, valid Unicode strings (no lone surrogates), `stop_token_ids` a list of ints >= 0;
- `logit_bias` is None or a dict int token id -> finite float clamped to [-100, 100] (string keys of decimal ints,
  OpenAI's JSON form, are converted); `allowed_token_ids` is None or a non-empty list of ints >= 0; `bad_words` is
  None or a list of strings (tokenized by the input processor into `_bad_words_token_ids`). Token ids are checked
  against the vocabulary by the input processor (`vllm/v1/sample/logits_processors.py`).
- vLLM fields this engine does not implement (`best_of`, `logits_processors`, `structured_outputs`) are refused
  with a ValueError that names them unless they ask for nothing, never dropped: the sampling mask must describe
  the distribution the token was drawn from.
"""

from __future__ import annotations

import math
from enum import IntEnum
from typing import Any

import msgspec

from vllm import envs
from vllm.exceptions import VLLMValidationError

_SAMPLING_EPS = 1e-5
_MAX_TEMPERATURE = 2.0
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")
# vLLM's clamp of logit_bias values (its OpenAI request models and SamplingParams).
_MAX_LOGIT_BIAS = 100.0
# vLLM's SamplingParams fields with no implementation here yet (see _refuse_unsupported).
_UNSUPPORTED_FIELDS = ("logits_processors", "structured_outputs")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_unicode(text: str, parameter: str) -> None:
    """Refuse a string that is not valid Unicode (a lone surrogate, which JSON's "\\ud800" escape can carry):
    the tokenizer and the UTF-8 wire cannot take it."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise VLLMValidationError(f"{parameter} is not valid Unicode: a lone surrogate {text[e.start]!r} at "
                                  f"character {e.start}.", parameter=parameter) from None


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

    The sampler applies, in vLLM's order: allowed_token_ids, bad_words, logit_bias, min_tokens, then the
    repetition, frequency and presence penalties, then temperature, min_p, top_k, top_p (docs/sampling_mask.md).
    top_k keeps every token whose logit is >= the k-th largest (ties at the boundary kept); top_p keeps the
    smallest prefix of the top-k survivors, sorted by probability, whose mass reaches top_p.
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
    # token id -> bias added to its logit (before the penalties, as vLLM); values clamped to [-100, 100].
    logit_bias: Any = None
    # Words never generated: single-token words are banned always, multi-token ones when the output ends with
    # all but their last token (vLLM's rule; tokenized by the input processor).
    bad_words: Any = None
    # The only token ids the request may sample (every other logit -inf).
    allowed_token_ids: Any = None
    # vLLM's fields without an implementation here: refused unless they ask for nothing (_refuse_unsupported).
    best_of: int | None = None
    logits_processors: Any = None
    structured_outputs: Any = None

    # Derived in __post_init__.
    output_text_buffer_length: int = 0
    _all_stop_token_ids: set[int] = msgspec.field(default_factory=set)
    # bad_words as token id lists (set by the input processor, vLLM's update_from_tokenizer).
    _bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if self.logprobs is True:  # vLLM's spelling of 1
            self.logprobs = 1
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
        def bad(field: str, rule: str, value: Any) -> VLLMValidationError:
            return VLLMValidationError(f"{field} must be {rule}, got {value!r}.", parameter=field, value=value)

        _refuse_unsupported(self)
        # NOTE: the environment is read only for n > 1 (reading it costs more than the rest of these checks).
        if not _is_int(self.n) or self.n < 1 or (self.n > 1 and self.n > envs.VLLM_MAX_N_SEQUENCES):
            max_n = envs.VLLM_MAX_N_SEQUENCES
            raise bad("n", f"an integer in [1, {max_n}] (VLLM_MAX_N_SEQUENCES)", self.n)
        for field in _FLOAT_FIELDS:
            value = getattr(self, field)
            if not _is_number(value) or not math.isfinite(value):
                raise bad(field, "a finite number", value)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "in (0, 2]", self.repetition_penalty)
        _verify_token_fields(self)
        # NOTE: [0, 2] as OpenAI's API and vLLM (>= 0.24): a huge temperature flattens every logit to a tie,
        # and the sampling mask becomes the whole vocabulary whatever top_k says.
        if not 0.0 <= self.temperature <= _MAX_TEMPERATURE:
            raise bad("temperature", f"in [0, {_MAX_TEMPERATURE:g}]", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or not 0 <= self.top_k <= _INT64_MAX:
            raise bad("top_k", f"-1 or 0 (disable) or an integer in [1, {_INT64_MAX}]", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]", self.min_p)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= _INT64_MAX):
            raise bad("max_tokens", f"an integer in [1, {_INT64_MAX}]", self.max_tokens)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= _INT64_MAX:
            raise bad("min_tokens", f"an integer in [0, {_INT64_MAX}]", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise VLLMValidationError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                                      f"got {self.min_tokens}.", parameter="min_tokens", value=self.min_tokens)
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= _INT64_MAX):
            raise bad("logprobs", f"an integer in [0, {_INT64_MAX}]", self.logprobs)
        # NOTE: -1 is vLLM's "the whole vocabulary" (then bounded by max_logprobs in the input processor).
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not -1 <= self.prompt_logprobs <= _INT64_MAX):
            raise bad("prompt_logprobs", f"-1 (the whole vocabulary) or an integer in [0, {_INT64_MAX}]",
                      self.prompt_logprobs)
        if self.seed is not None:
            if not _is_int(self.seed) or not _INT64_MIN <= self.seed <= _INT64_MAX:
                raise bad("seed", f"an integer in [{_INT64_MIN}, {_INT64_MAX}]", self.seed)
            # NOTE: sample j of n runs with seed + j (vllm/v1/engine/parallel_sampling.py), which must fit too.
            if self.seed + self.n - 1 > _INT64_MAX:
                raise VLLMValidationError(
                    f"seed + n - 1 must be at most {_INT64_MAX} (sample j of n is seeded with seed + j), got "
                    f"seed={self.seed}, n={self.n}.", parameter="seed", value=self.seed)
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise VLLMValidationError("stop must be a string or a list of non-empty strings.", parameter="stop",
                                      value=self.stop)
        for s in self.stop:
            check_unicode(s, "stop")
        if (not isinstance(self.stop_token_ids, list)
                or any(not _is_int(t) or not 0 <= t <= _INT64_MAX for t in self.stop_token_ids)):
            raise VLLMValidationError(f"stop_token_ids must be a list of integers in [0, {_INT64_MAX}].",
                                      parameter="stop_token_ids", value=self.stop_token_ids)
        for field in ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                      "include_stop_str_in_output", "flat_logprobs"):
            if not isinstance(getattr(self, field), bool):
                raise bad(field, "a bool", getattr(self, field))
        if self.return_sampling_mask is not None and not isinstance(self.return_sampling_mask, bool):
            raise bad("return_sampling_mask", "a bool or None", self.return_sampling_mask)

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
        hidden_if_none = (*_UNSUPPORTED_FIELDS, "best_of", "logit_bias", "bad_words", "allowed_token_ids")
        fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__
                           if not f.startswith("_") and (f not in hidden_if_none or getattr(self, f) is not None))
        return f"SamplingParams({fields})"


def _refuse_unsupported(params: SamplingParams) -> None:
    """vLLM's fields this engine does not implement: an error naming the field, unless it asks for nothing (None,
    an empty list or dict; best_of equal to n, which returns the n samples as they are)."""
    if params.best_of is not None and params.best_of != params.n:
        raise VLLMValidationError(
            f"best_of={params.best_of!r} is not supported (as in vLLM v1): set n to the number of samples you want "
            "and rank them yourself; leave best_of unset.", parameter="best_of", value=params.best_of)
    for field in _UNSUPPORTED_FIELDS:
        value = getattr(params, field)
        if value is None or (isinstance(value, (list, tuple, dict)) and not value):
            continue
        raise VLLMValidationError(
            f"{field} is not supported yet: this engine does not apply it, and the sampling mask must describe the "
            f"distribution each token was drawn from, so it is refused rather than ignored; leave {field} unset.",
            parameter=field)


def _verify_token_fields(params: SamplingParams) -> None:
    """logit_bias, allowed_token_ids and bad_words: types and values (the vocabulary bound is the input
    processor's); normalises logit_bias to {int: clamped float} and allowed_token_ids to a list."""
    if params.logit_bias is not None:
        if not isinstance(params.logit_bias, dict):
            raise VLLMValidationError("logit_bias must be a dict of token id -> bias.", parameter="logit_bias",
                                      value=params.logit_bias)
        bias: dict[int, float] = {}
        for token, value in params.logit_bias.items():
            token_id = _token_key(token)
            if token_id is None or token_id < 0 or token_id > _INT64_MAX:
                raise VLLMValidationError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}.",
                                          parameter="logit_bias", value=token)
            if not _is_number(value) or not math.isfinite(value):
                raise VLLMValidationError(f"logit_bias values must be finite numbers, got {value!r} for token "
                                          f"{token_id}.", parameter="logit_bias", value=value)
            bias[token_id] = min(_MAX_LOGIT_BIAS, max(-_MAX_LOGIT_BIAS, float(value)))
        params.logit_bias = bias or None
    if params.allowed_token_ids is not None:
        ids = params.allowed_token_ids
        if not isinstance(ids, (list, tuple)) or any(not _is_int(t) or not 0 <= t <= _INT64_MAX for t in ids):
            raise VLLMValidationError("allowed_token_ids must be a list of token ids (integers >= 0).",
                                      parameter="allowed_token_ids", value=ids)
        if not ids:
            raise VLLMValidationError("allowed_token_ids must not be empty (it would leave nothing to sample).",
                                      parameter="allowed_token_ids", value=ids)
        params.allowed_token_ids = list(ids)
    if params.bad_words is not None:
        words = params.bad_words
        if isinstance(words, str) or not isinstance(words, (list, tuple)) or any(not isinstance(w, str)
                                                                                  for w in words):
            raise VLLMValidationError("bad_words must be a list of strings.", parameter="bad_words", value=words)
        for w in words:
            check_unicode(w, "bad_words")
        params.bad_words = list(words) or None


def _token_key(token: Any) -> int | None:
    """A logit_bias key as a token id: an int, or a string of a decimal int (OpenAI's JSON keys)."""
    if _is_int(token):
        return token
    if isinstance(token, str) and token.strip().lstrip("+-").isdigit():
        return int(token)
    return None
