"""The OpenAI-compatible HTTP protocol (pydantic models): requests, responses and stream chunks, under the module
path vLLM users import them from (`from vllm.entrypoints.openai.protocol import ChatCompletionRequest, ...`).

The models live by endpoint, each module with its invariants:
- protocol_base.py: strict field types, JSON-schema helpers, the base models, errors, usage, model cards;
- protocol_sampling.py: the sampling fields completions and chat share, and their SamplingParams;
- protocol_completion.py, protocol_chat.py (tools and tool calls too), protocol_generate.py, protocol_tokenize.py.

Requests take OpenAI's fields plus vLLM's extra sampling fields. vLLM's request fields this engine does not
implement are refused with a 400 naming them, unless they ask for nothing; fields no vLLM request has are ignored
with vLLM's warning listing them (request_fields.py, RequestModel). `to_sampling_params()` builds SamplingParams,
whose validation (VLLMValidationError, a ValueError naming the field) becomes HTTP 400. Types are strict where lax
parsing would change a request's meaning, and the JSON schema (OpenAPI, openapi.py) marks what the server enforces
without changing what it accepts (protocol_base.py).

Choices carry `sampling_mask: list[list[int]] | None`, one ascending id list per generated token of the choice
(of the chunk, when streaming).

Invariant: every name this module had before the split stays importable from it (tests/entrypoints/
test_import_paths.py); code in this package imports from the modules above.
"""

from __future__ import annotations

from vllm.entrypoints.openai.protocol_base import (INT64_MAX, INT64_MIN, ErrorInfo, ErrorResponse, Float, Int,
                                                   ModelCard, ModelList, OpenAIBaseModel, PromptTokenUsageInfo,
                                                   RequestModel, StreamOptions, Text, TokenId, UsageInfo,
                                                   WeightVersionSpan)
from vllm.entrypoints.openai.protocol_chat import (ChatCompletionLogProb, ChatCompletionLogProbs,
                                                   ChatCompletionLogProbsContent, ChatCompletionNamedFunction,
                                                   ChatCompletionNamedToolChoiceParam, ChatCompletionRequest,
                                                   ChatCompletionResponse, ChatCompletionResponseChoice,
                                                   ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse,
                                                   ChatCompletionToolsParam, ChatMessage, DeltaFunctionCall,
                                                   DeltaMessage, DeltaToolCall, FunctionCall, FunctionDefinition,
                                                   ToolCall)
from vllm.entrypoints.openai.protocol_completion import (CompletionLogProbs, CompletionPrompt, CompletionRequest,
                                                         CompletionResponse, CompletionResponseChoice,
                                                         CompletionStreamResponse)
from vllm.entrypoints.openai.protocol_generate import (GenerateRequest, GenerateResponse, GenerateResponseChoice,
                                                       GenerateStreamResponse)
from vllm.entrypoints.openai.protocol_sampling import SamplingFields
from vllm.entrypoints.openai.protocol_tokenize import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                                       TokenizeCompletionRequest, TokenizeRequest, TokenizeResponse)
from vllm.entrypoints.openai.request_fields import check_request_fields
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind, SamplingParams, check_unicode
from vllm.utils import random_uuid

__all__ = [
    # protocol_base.py
    "INT64_MAX", "INT64_MIN", "ErrorInfo", "ErrorResponse", "Float", "Int", "ModelCard", "ModelList",
    "OpenAIBaseModel", "PromptTokenUsageInfo", "RequestModel", "StreamOptions", "Text", "TokenId", "UsageInfo",
    "WeightVersionSpan",
    # protocol_sampling.py
    "SamplingFields",
    # protocol_completion.py
    "CompletionLogProbs", "CompletionPrompt", "CompletionRequest", "CompletionResponse", "CompletionResponseChoice",
    "CompletionStreamResponse",
    # protocol_chat.py
    "ChatCompletionLogProb", "ChatCompletionLogProbs", "ChatCompletionLogProbsContent", "ChatCompletionNamedFunction",
    "ChatCompletionNamedToolChoiceParam", "ChatCompletionRequest", "ChatCompletionResponse",
    "ChatCompletionResponseChoice", "ChatCompletionResponseStreamChoice", "ChatCompletionStreamResponse",
    "ChatCompletionToolsParam", "ChatMessage", "DeltaFunctionCall", "DeltaMessage", "DeltaToolCall", "FunctionCall",
    "FunctionDefinition", "ToolCall",
    # protocol_generate.py
    "GenerateRequest", "GenerateResponse", "GenerateResponseChoice", "GenerateStreamResponse",
    # protocol_tokenize.py
    "DetokenizeRequest", "DetokenizeResponse", "TokenizeChatRequest", "TokenizeCompletionRequest", "TokenizeRequest",
    "TokenizeResponse",
    # the vLLM names the module imported before the split
    "RequestOutputKind", "SamplingParams", "VLLMValidationError", "check_request_fields", "check_unicode",
    "random_uuid",
]
