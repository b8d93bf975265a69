"""The /v1/chat/completions models: the request, tools and tool calls, messages and deltas, logprobs, the whole
response and the streamed chunk.

Invariants:
- The JSON schema marks `messages` required and non-empty and documents a message's role and content
  (`MESSAGE_SCHEMA`); like every schema keyword here, it changes nothing the model accepts (protocol_base.py).
- `max_completion_tokens` wins over `max_tokens` when both are set; `top_logprobs` needs `logprobs=true`.
- A message or delta without tool calls has no `tool_calls` key at all (vLLM's: clients test for the key).
- A choice's `sampling_mask` holds one ascending id list per generated token of the choice (of the chunk, when
  streaming).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, model_serializer

from vllm.entrypoints.openai.protocol_base import (INT64_MAX, Int, OpenAIBaseModel, StreamOptions, Text, UsageInfo,
                                                   WeightVersionSpan, bounds, created_timestamp)
from vllm.entrypoints.openai.protocol_sampling import SamplingFields
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.utils import random_uuid

MESSAGE_SCHEMA = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "user", "assistant", "tool", "developer"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}}]}}}


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIBaseModel):
    name: Text


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    function: ChatCompletionNamedFunction
    type: Literal["function"] = "function"


def _without_tool_calls(data: dict[str, Any]) -> dict[str, Any]:
    # NOTE: vLLM leaves `tool_calls` out of a message or delta without calls (clients test for the key).
    if data.get("tool_calls") is None:
        data.pop("tool_calls", None)
    return data


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        return _without_tool_calls(handler(self))


class ChatCompletionRequest(SamplingFields):
    model: Text | None = None
    messages: list[dict[str, Any]] = Field(**bounds(minItems=1, items=MESSAGE_SCHEMA))
    max_tokens: Int | None = Field(None, **bounds(minimum=1, maximum=INT64_MAX))
    max_completion_tokens: Int | None = Field(None, **bounds(minimum=1, maximum=INT64_MAX))
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(None, **bounds(minimum=0, maximum=INT64_MAX))
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    add_generation_prompt: StrictBool = True
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Tools (serving_chat.py, tool_parsers/): passed to the chat template; "auto" parses the output's tool calls.
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = None
    parallel_tool_calls: StrictBool | None = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    documents: list[dict[str, Any]] | None = None
    request_id: Text | None = None
    # Prefix caching: only requests with the same salt share cached KV blocks (a non-empty string).
    cache_salt: Text | None = None

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise VLLMValidationError("top_logprobs needs logprobs=true.", parameter="top_logprobs")
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
    created: int = Field(default_factory=created_timestamp)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        return _without_tool_calls(handler(self))


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
    created: int = Field(default_factory=created_timestamp)
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
