"""vLLM's module paths for the OpenAI server keep every name they had before they were split by idea: RL frameworks
and vLLM users import the request models from `vllm.entrypoints.openai.protocol` and the server's entry points from
`vllm.entrypoints.openai.api_server`. The reference lists are the names those two modules held at c7b8f47 (before
the split), written out by hand: the models, field types and constants, and the vLLM names they imported."""

from __future__ import annotations

import importlib

import pytest
from pydantic import BaseModel

PROTOCOL_NAMES = [
    "ChatCompletionLogProb", "ChatCompletionLogProbs", "ChatCompletionLogProbsContent", "ChatCompletionNamedFunction",
    "ChatCompletionNamedToolChoiceParam", "ChatCompletionRequest", "ChatCompletionResponse",
    "ChatCompletionResponseChoice", "ChatCompletionResponseStreamChoice", "ChatCompletionStreamResponse",
    "ChatCompletionToolsParam", "ChatMessage", "CompletionLogProbs", "CompletionPrompt", "CompletionRequest",
    "CompletionResponse", "CompletionResponseChoice", "CompletionStreamResponse", "DeltaFunctionCall",
    "DeltaMessage", "DeltaToolCall", "DetokenizeRequest", "DetokenizeResponse", "ErrorInfo", "ErrorResponse",
    "Float", "FunctionCall", "FunctionDefinition", "GenerateRequest", "GenerateResponse", "GenerateResponseChoice",
    "GenerateStreamResponse", "INT64_MAX", "INT64_MIN", "Int", "ModelCard", "ModelList", "OpenAIBaseModel",
    "PromptTokenUsageInfo", "RequestModel", "RequestOutputKind", "SamplingFields", "SamplingParams",
    "StreamOptions", "Text", "TokenId", "TokenizeChatRequest", "TokenizeCompletionRequest", "TokenizeRequest",
    "TokenizeResponse", "ToolCall", "UsageInfo", "VLLMValidationError", "WeightVersionSpan",
    "check_request_fields", "check_unicode", "random_uuid",
]


@pytest.mark.parametrize("name", PROTOCOL_NAMES)
def test_protocol_keeps_its_names(name: str) -> None:
    protocol = importlib.import_module("vllm.entrypoints.openai.protocol")
    assert hasattr(protocol, name), f"vllm.entrypoints.openai.protocol.{name} is gone"
    assert name in protocol.__all__


def test_protocol_models_are_the_classes_the_server_uses() -> None:
    """A model imported from vLLM's path is the very class the serving code validates and answers with, so
    isinstance checks and subclasses (a client's own request model) behave as before."""
    from vllm.entrypoints.openai import protocol
    from vllm.entrypoints.openai import serving_chat, serving_completion, serving_generate, serving_tokenization
    assert protocol.ChatCompletionRequest is serving_chat.ChatCompletionRequest
    assert protocol.ChatCompletionResponse is serving_chat.ChatCompletionResponse
    assert protocol.CompletionRequest is serving_completion.CompletionRequest
    assert protocol.GenerateRequest is serving_generate.GenerateRequest
    assert protocol.TokenizeChatRequest is serving_tokenization.TokenizeChatRequest
    models = [getattr(protocol, n) for n in PROTOCOL_NAMES]
    models = [m for m in models if isinstance(m, type) and issubclass(m, BaseModel)]
    assert len(models) == 43
    assert all(issubclass(m, protocol.OpenAIBaseModel) for m in models)
    assert all(getattr(protocol, m.__name__) is m for m in models)  # exported under its own name, not an alias
    assert protocol.TokenizeRequest.__args__ == (protocol.TokenizeCompletionRequest, protocol.TokenizeChatRequest)
