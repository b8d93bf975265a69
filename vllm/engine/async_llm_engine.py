"""vLLM's `AsyncLLMEngine` name: the asyncio engine, AsyncLLM (vllm/v1/engine/async_llm.py)."""

from __future__ import annotations

from vllm.v1.engine.async_llm import AsyncLLM

AsyncLLMEngine = AsyncLLM

__all__ = ["AsyncLLMEngine"]
