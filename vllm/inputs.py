"""Prompt types of the engine's entry points (vLLM's names).

At run time a prompt is a plain `str` or `dict`: `TextPrompt` and `TokensPrompt` are TypedDicts, so
`TokensPrompt(prompt_token_ids=[...])` is the same dict as `{"prompt_token_ids": [...]}`. Only the keys below
are honoured; the input processor rejects any other key (vLLM's `multi_modal_data`, `mm_processor_kwargs`,
...) with a ValueError rather than ignoring it, unless its value is None (which asks for nothing). `cache_salt`
(a non-empty string) keeps the request's prefix-cache blocks apart from those of requests with another salt.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

__all__ = ["PROMPT_KEYS", "PromptType", "SingletonPrompt", "TextPrompt", "TokensPrompt"]


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine (with the tokenizer's special tokens)."""

    prompt: str
    cache_salt: NotRequired[str]
    """Prefix caching: only requests with the same salt share cached KV blocks (vLLM's field)."""


class TokensPrompt(TypedDict):
    """A tokenized prompt, sent to the model as is."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    """The text of the tokens, when the caller has it: only copied into RequestOutput.prompt, never tokenized."""
    cache_salt: NotRequired[str]
    """Prefix caching: only requests with the same salt share cached KV blocks (vLLM's field)."""


SingletonPrompt = str | TextPrompt | TokensPrompt
# NOTE: this engine has no encoder-decoder models, so a prompt is always a single one.
PromptType = SingletonPrompt

# The dict keys the input processor honours; any other key is refused.
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})
