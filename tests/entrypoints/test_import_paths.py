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


API_SERVER_NAMES = ["build_app", "loop_factory", "make_vllm_config", "run_api_servers", "run_server"]
# Private helpers that tests and tools imported from api_server.py before the split: kept under their old names.
API_SERVER_PRIVATE_NAMES = [
    "_APIKeyMiddleware", "_PROTECTED_PREFIXES", "_SSEResponse", "_api_server_proc", "_cancel_on_disconnect",
    "_close_unsent_stream", "_data_parallel_rank", "_error", "_listen", "_respond", "_stop",
    "_stop_signals_absorbed", "_validation_message", "_wait_for_disconnect", "_watch_engine",
]


@pytest.mark.parametrize("name", API_SERVER_NAMES + API_SERVER_PRIVATE_NAMES)
def test_api_server_keeps_its_names(name: str) -> None:
    api_server = importlib.import_module("vllm.entrypoints.openai.api_server")
    assert callable(getattr(api_server, name, None)) or name == "_PROTECTED_PREFIXES", \
        f"vllm.entrypoints.openai.api_server.{name} is gone"
    assert (name in api_server.__all__) == (name in API_SERVER_NAMES)


def test_api_server_entry_points_are_the_ones_the_cli_runs() -> None:
    """`vllm serve` and `python -m vllm.entrypoints.openai.api_server` run the functions vLLM's path exports, and the
    spawned API server processes of --api-server-count run the same `run_server`."""
    from vllm.entrypoints.openai import api_server, api_server_group, app, server
    assert api_server.run_server is server.run_server is api_server_group.run_server
    assert api_server.build_app is app.build_app is server.build_app
    assert api_server.run_api_servers is api_server_group.run_api_servers
    assert api_server._PROTECTED_PREFIXES == ("/v1", "/inference")
