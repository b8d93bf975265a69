"""The /tokenize and /detokenize models (vLLM's): a prompt or chat messages in, token ids (and optionally their
strings) out; token ids in, text out.

Invariants:
- POST /tokenize takes either form; the body's own form picks the model (`messages` present: TokenizeChatRequest,
  else TokenizeCompletionRequest), so the other form's fields are never reported as unknown (routes.py's
  route does the pick; `TokenizeRequest` is the union for type hints).
- A chat tokenize request takes the chat request's template fields with the same defaults, so it counts the
  prompt the chat endpoint would build from the same messages.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictBool

from vllm.entrypoints.openai.protocol_base import OpenAIBaseModel, RequestModel, Text, TokenId, bounds
from vllm.entrypoints.openai.protocol_chat import MESSAGE_SCHEMA, ChatCompletionToolsParam


class TokenizeCompletionRequest(RequestModel):
    """POST /tokenize with a prompt."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(RequestModel):
    """POST /tokenize with messages: the prompt the chat endpoint would build from them."""

    model: Text | None = None
    messages: list[dict[str, Any]] = Field(**bounds(minItems=1, items=MESSAGE_SCHEMA))
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
