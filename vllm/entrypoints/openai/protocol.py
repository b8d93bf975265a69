"""The OpenAI-compatible HTTP protocol (pydantic models): requests, responses and stream chunks.

Requests take OpenAI's fields plus vLLM's extra sampling fields; unknown fields are ignored (as OpenAI clients
send new ones). `to_sampling_params()` builds SamplingParams, whose validation (ValueError) becomes HTTP 400.
Choices carry `sampling_mask: list[list[int]] | None`, one ascending id list per generated token of the choice
(of the chunk, when streaming).
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.utils import random_uuid


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


class SamplingFields(OpenAIBaseModel):
    """OpenAI's sampling fields and vLLM's extras, shared by completions and chat."""

    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_sampling_mask: bool | None = None
    return_token_ids: bool = False

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, stream: bool) -> SamplingParams:
        return SamplingParams.from_optional(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            return_sampling_mask=self.return_sampling_mask, logprobs=logprobs, max_tokens=max_tokens,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def to_sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs, self.stream)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class WeightVersionSpan(OpenAIBaseModel):
    """Tokens [start, end) of a choice (counted from its first token, also in a streamed chunk) were computed by
    the weights named `weight_version` (the name given to finish_weight_update / update_weight_version)."""
    weight_version: str | None = None
    start: int
    end: int


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


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(CompletionResponse):
    pass


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true.")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, self.stream)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    sampling_mask: list[list[int]] | None = None
    # Only once the engine's weights were named (RL weight updates, docs/rl.md): None until then.
    weight_versions: list[WeightVersionSpan] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    sampling_mask: list[list[int]] | None = None
    # Only once the engine's weights were named (RL weight updates, docs/rl.md): None until then.
    weight_versions: list[WeightVersionSpan] | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class GenerateRequest(OpenAIBaseModel):
    """vLLM's token-ids-in / token-ids-out request (`/inference/v1/generate`)."""

    request_id: str = Field(default_factory=random_uuid)
    token_ids: list[int]
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def to_sampling_params(self) -> SamplingParams:
        fields = dict(self.sampling_params)
        for key in ("output_kind", "output_text_buffer_length", "_all_stop_token_ids"):
            if key in fields:
                raise ValueError(f"sampling_params.{key} cannot be set by a request.")
        fields["output_kind"] = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        known = set(SamplingParams.__struct_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"Unknown sampling_params field(s): {', '.join(unknown)}.")
        try:
            # NOTE: msgspec.convert checks the field types (a Struct's __init__ does not) and runs validation.
            return msgspec.convert({k: v for k, v in fields.items() if v is not None}, SamplingParams)
        except msgspec.ValidationError as e:
            raise ValueError(f"Invalid sampling_params: {e}") from e


class GenerateResponseChoice(OpenAIBaseModel):
    index: int
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    sampling_mask: list[list[int]] | None = None
    # Only once the engine's weights were named (RL weight updates, docs/rl.md): None until then.
    weight_versions: list[WeightVersionSpan] | None = None


class GenerateResponse(OpenAIBaseModel):
    request_id: str
    choices: list[GenerateResponseChoice]
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    usage: UsageInfo | None = None


class GenerateStreamResponse(GenerateResponse):
    pass
