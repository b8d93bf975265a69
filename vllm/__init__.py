"""A vLLM-compatible LLM serving engine with exact sampling-distribution replay (--return-sampling-mask)."""

from vllm.inputs import PromptType, TextPrompt, TokensPrompt
from vllm.outputs import CompletionOutput, Logprob, RequestOutput, SamplingMask
from vllm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncEngineArgs", "AsyncLLMEngine", "CompletionOutput", "EngineArgs", "LLMEngine", "Logprob",
           "PromptType", "RequestOutput", "RequestOutputKind", "SamplingMask", "SamplingParams", "TextPrompt",
           "TokensPrompt", "__version__"]


def __getattr__(name: str):  # these import torch and the engine: load them on first use
    if name == "LLM":
        from vllm.entrypoints.llm import LLM
        return LLM
    if name in ("EngineArgs", "AsyncEngineArgs"):
        from vllm.engine import arg_utils
        return getattr(arg_utils, name)
    if name == "AsyncLLMEngine":
        from vllm.engine.async_llm_engine import AsyncLLMEngine
        return AsyncLLMEngine
    if name == "LLMEngine":
        from vllm.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
