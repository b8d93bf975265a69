"""vLLM's `vllm.engine.llm_engine.LLMEngine` path: the synchronous engine (vllm/v1/engine/llm_engine.py)."""

from __future__ import annotations

from vllm.v1.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]
