"""The OpenAI-compatible HTTP protocol (pydantic models): requests, responses and stream chunks.

Requests take OpenAI's fields plus vLLM's extra sampling fields. vLLM's request fields this engine does not
implement are refused with a 400 naming them, unless they ask for nothing; fields no vLLM request has are ignored
with vLLM's warning listing them (request_fields.py, RequestModel). `to_sampling_params()` builds SamplingParams, whose validation (VLLMValidationError, a ValueError
naming the field) becomes HTTP 400.

Types are strict where lax parsing would change a request's meaning: booleans take only true/false ("stream":
"yes" or 1 is a 400), token ids only JSON integers ("prompt": [true, false] is a 400, not [1, 0]), and integer and
float fields refuse booleans. Valid input parses exactly as before. Strings the engine or the wire would choke on
(a lone surrogate) are refused here or in SamplingParams / the input processor, never after a request is added.

The JSON schema (OpenAPI, openapi.py) marks what the server enforces, without changing what it accepts or its
messages: the fields a request must send (`prompt`, `messages`, `token_ids`) as required and non-empty, and the
bounds SamplingParams checks (`_bounds`); the checks themselves stay where they are.

Choices carry `sampling_mask: list[list[int]] | None`, one ascending id list per generated token of the choice
(of the chunk, when streaming).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt,
                      ValidatorFunctionWrapHandler, WithJsonSchema, WrapValidator, model_serializer,
                      model_validator)

from vllm.entrypoints.openai.request_fields import check_request_fields
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind, SamplingParams, check_unicode
from vllm.utils import random_uuid


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


def _valid_unicode(value: str) -> str:
    try:
        check_unicode(value, "the string")
    except VLLMValidationError as e:
        raise ValueError(e.args[0]) from None
    return value


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


# An integer or float field that refuses booleans (pydantic's lax mode reads true as 1).
Int = Annotated[int, BeforeValidator(_no_bool)]
Float = Annotated[float, BeforeValidator(_no_bool)]
# A token id: a JSON integer only.
TokenId = StrictInt
# A string the tokenizer and the UTF-8 wire can take (no lone surrogates).
Text = Annotated[str, AfterValidator(_valid_unicode)]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_TOKEN_ID_SCHEMA = {"type": "integer", "minimum": 0, "maximum": INT64_MAX}
CompletionPrompt = Annotated[
    str | list[str] | list[int] | list[list[int]] | None, WrapValidator(_strict_prompt),
    WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        {"type": "array", "items": _TOKEN_ID_SCHEMA, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": _TOKEN_ID_SCHEMA, "minItems": 1}, "minItems": 1},
    ]})]
_MESSAGE_SCHEMA = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "user", "assistant", "tool", "developer"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}}]}}}


def _bounds(**schema: Any) -> Any:
    """A field whose JSON schema carries these keywords (the bounds SamplingParams enforces); validation is
    unchanged (module docstring)."""
    return {"json_schema_extra": schema}


def _requires(*names: str) -> Any:
    """A model-level json_schema_extra marking fields required that have a default only so that the server can
    refuse them missing with its own message."""
    def extra(schema: dict[str, Any]) -> None:
        schema["required"] = sorted(set(schema.get("required", [])) | set(names))
    return extra


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestModel(OpenAIBaseModel):
    """A request body: vLLM fields not implemented here are refused, unknown ones logged (request_fields.py)."""

    @model_validator(mode="wrap")
    @classmethod
    def _check_fields(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        check_request_fields(cls.model_fields, data, cls.__name__)
        return handler(data)


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


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # With --enable-prompt-tokens-details (vLLM's flag): the prompt tokens found in the prefix cache.
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool | None = False


class SamplingFields(RequestModel):
    """OpenAI's sampling fields and vLLM's extras, shared by completions and chat."""

    temperature: Float | None = Field(None, **_bounds(minimum=0, maximum=2))
    top_p: Float | None = Field(None, **_bounds(exclusiveMinimum=0, maximum=1))
    n: Int = Field(1, **_bounds(minimum=1))
    seed: Int | None = Field(None, **_bounds(minimum=INT64_MIN, maximum=INT64_MAX))
    stop: str | list[str] | None = None
    presence_penalty: Float | None = Field(None, **_bounds(minimum=-2, maximum=2))
    frequency_penalty: Float | None = Field(None, **_bounds(minimum=-2, maximum=2))
    top_k: Int | None = Field(None, **_bounds(minimum=-1, maximum=INT64_MAX))
    min_p: Float | None = Field(None, **_bounds(minimum=0, maximum=1))
    repetition_penalty: Float | None = Field(None, **_bounds(exclusiveMinimum=0, maximum=2))
    ignore_eos: StrictBool = False
    min_tokens: Int = Field(0, **_bounds(minimum=0, maximum=INT64_MAX))
    stop_token_ids: list[TokenId] | None = Field(None, **_bounds(items=_TOKEN_ID_SCHEMA))
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    return_sampling_mask: StrictBool | None = None
    return_token_ids: StrictBool = False
    # vLLM's: the prompt tokens' logprobs (-1: the whole vocabulary), and logprob tokens as "token_id:{id}"
    # (None: the server's --return-tokens-as-token-ids).
    prompt_logprobs: Int | None = Field(None, **_bounds(minimum=-1, maximum=INT64_MAX))
    return_tokens_as_token_ids: StrictBool | None = None
    # OpenAI's JSON keys are strings of token ids; SamplingParams converts them, clamps the values to [-100, 100].
    logit_bias: dict[str, Float] | None = None
    bad_words: list[Text] | None = None
    allowed_token_ids: list[TokenId] | None = Field(None, **_bounds(items=_TOKEN_ID_SCHEMA))

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, stream: bool,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        if stream and self.prompt_logprobs is not None and (self.prompt_logprobs > 0 or self.prompt_logprobs == -1):
            raise VLLMValidationError("`prompt_logprobs` are not available when `stream=True`.",
                                      parameter="prompt_logprobs", value=self.prompt_logprobs)
        return SamplingParams.from_optional(
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            return_sampling_mask=self.return_sampling_mask, logprobs=logprobs, max_tokens=max_tokens,
            logit_bias=self.logit_bias, bad_words=self.bad_words, allowed_token_ids=self.allowed_token_ids,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="ignore", json_schema_extra=_requires("prompt"))

    model: Text | None = None
    prompt: CompletionPrompt = None
    max_tokens: Int | None = Field(16, **_bounds(minimum=1, maximum=INT64_MAX))
    logprobs: Int | None = Field(None, **_bounds(minimum=0, maximum=INT64_MAX))
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
    # vLLM's: None for the first prompt token, then {str(token id): {logprob, rank, decoded_token}} per token.
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(CompletionResponse):
    pass


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
    messages: list[dict[str, Any]] = Field(**_bounds(minItems=1, items=_MESSAGE_SCHEMA))
    max_tokens: Int | None = Field(None, **_bounds(minimum=1, maximum=INT64_MAX))
    max_completion_tokens: Int | None = Field(None, **_bounds(minimum=1, maximum=INT64_MAX))
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(None, **_bounds(minimum=0, maximum=INT64_MAX))
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
    created: int = Field(default_factory=lambda: int(time.time()))
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
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class GenerateRequest(RequestModel):
    """vLLM's token-ids-in / token-ids-out request (`/inference/v1/generate`)."""

    request_id: Text = Field(default_factory=random_uuid, min_length=1)
    token_ids: list[TokenId] = Field(**_bounds(minItems=1, items=_TOKEN_ID_SCHEMA))
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: Text | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # Prefix caching: only requests with the same salt share cached KV blocks (a non-empty string).
    cache_salt: Text | None = None

    def to_sampling_params(self) -> SamplingParams:
        fields = dict(self.sampling_params)
        for key in ("output_kind", "output_text_buffer_length", "_all_stop_token_ids"):
            if key in fields:
                raise VLLMValidationError(f"sampling_params.{key} cannot be set by a request.",
                                          parameter=f"sampling_params.{key}")
        fields["output_kind"] = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        known = set(SamplingParams.__struct_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise VLLMValidationError(f"Unknown sampling_params field(s): {', '.join(map(repr, unknown))}.",
                                      parameter=f"sampling_params.{unknown[0]}")
        try:
            # NOTE: msgspec.convert checks the field types (a Struct's __init__ does not; a bool is not an int
            # there) and runs validation.
            return msgspec.convert({k: v for k, v in fields.items() if v is not None}, SamplingParams)
        except msgspec.ValidationError as e:
            cause = e.__cause__
            if isinstance(cause, VLLMValidationError):  # SamplingParams' own check, raised in __post_init__
                raise VLLMValidationError(cause.args[0], parameter=f"sampling_params.{cause.parameter}"
                                          if cause.parameter else "sampling_params", value=cause.value) from e
            # A type error: msgspec names the field as a path, "Expected `int`, got `bool` - at `$.top_k[1]`".
            path = str(e).rpartition("`$.")[2].rstrip("`").split("[")[0] if "`$." in str(e) else ""
            raise VLLMValidationError(f"Invalid sampling_params: {e}",
                                      parameter=f"sampling_params.{path}" if path else "sampling_params") from e


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
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    usage: UsageInfo | None = None


class GenerateStreamResponse(GenerateResponse):
    pass


class TokenizeCompletionRequest(RequestModel):
    """POST /tokenize with a prompt."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(RequestModel):
    """POST /tokenize with messages: the prompt the chat endpoint would build from them."""

    model: Text | None = None
    messages: list[dict[str, Any]] = Field(**_bounds(minItems=1, items=_MESSAGE_SCHEMA))
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool | None = False
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolsParam] | None = None


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
