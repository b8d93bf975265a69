"""The /v1/completions models: the request, its choices, the whole response and the streamed chunk.

Invariants:
- `prompt` is a string, a list of strings, a list of token ids or a list of lists of token ids, where a token id is
  a JSON integer (never a boolean or a float); anything else is one error naming `prompt`. The JSON schema marks
  it required and non-empty; a missing one is refused by the server with its own message.
- `echo` with logprobs asks for the prompt tokens' logprobs (vLLM: prompt_logprobs defaults to logprobs), and
  `echo` with max_tokens 0 answers with the prompt alone (one token is generated and dropped, as vLLM does).
- A choice's `sampling_mask` holds one ascending id list per generated token of the choice (of the chunk, when
  streaming).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, StrictBool, ValidatorFunctionWrapHandler, WithJsonSchema, WrapValidator

from vllm.entrypoints.openai.protocol_base import (INT64_MAX, TOKEN_ID_SCHEMA, Int, OpenAIBaseModel, StreamOptions,
                                                   Text, UsageInfo, WeightVersionSpan, bounds, created_timestamp,
                                                   requires)
from vllm.entrypoints.openai.protocol_sampling import SamplingFields
from vllm.sampling_params import SamplingParams
from vllm.utils import random_uuid


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _strict_prompt(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A completion prompt: a string, a list of strings, a list of token ids or a list of lists of token ids, where
    a token id is a JSON integer (never a boolean or a float). One error naming `prompt` otherwise."""
    if value is None or isinstance(value, str):
        return handler(value)
    if isinstance(value, list) and (all(isinstance(p, str) for p in value) or all(_is_token_id(t) for t in value)
                                    or all(isinstance(p, list) and all(_is_token_id(t) for t in p)
                                           for p in value)):
        return handler(value)
    raise ValueError("prompt must be a string, a list of strings, a list of token ids (integers) or a list of "
                     "lists of token ids")


CompletionPrompt = Annotated[
    str | list[str] | list[int] | list[list[int]] | None, WrapValidator(_strict_prompt),
    WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        {"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1}, "minItems": 1},
    ]})]


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="ignore", json_schema_extra=requires("prompt"))

    model: Text | None = None
    prompt: CompletionPrompt = None
    # NOTE: 0 is valid with `echo` (the prompt alone), so the schema's minimum is 0; without echo 0 gets a 400.
    max_tokens: Int | None = Field(16, **bounds(minimum=0, maximum=INT64_MAX))
    logprobs: Int | None = Field(None, **bounds(minimum=0, maximum=INT64_MAX))
    echo: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # Prefix caching: only requests with the same salt share cached KV blocks (a non-empty string).
    cache_salt: Text | None = None
    request_id: Text | None = None

    @property
    def echo_without_generation(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt alone (OpenAI's API; one token is generated and
        dropped, as vLLM does)."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        # NOTE: echo with logprobs needs the prompt tokens' logprobs (vLLM: prompt_logprobs defaults to logprobs).
        prompt_logprobs = self.logprobs if self.prompt_logprobs is None and self.echo else None
        max_tokens = 1 if self.echo_without_generation else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs, self.stream, prompt_logprobs)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    sampling_mask: list[list[int]] | None = None
    # Only once the engine's weights were named (RL weight updates, docs/rl.md): None until then.
    weight_versions: list[WeightVersionSpan] | None = None
    # vLLM's: None for the first prompt token, then {str(token id): {logprob, rank, decoded_token}} per token.
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: str = "text_completion"
    created: int = Field(default_factory=created_timestamp)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(CompletionResponse):
    pass
