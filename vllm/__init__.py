"""A vLLM-compatible LLM serving engine with exact sampling-distribution replay (--return-sampling-mask)."""

from vllm.inputs import PromptType, TextPrompt, TokensPrompt
from vllm.outputs import CompletionOutput, Logprob, RequestOutput, SamplingMask
from vllm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "Logprob", "PromptType", "RequestOutput", "RequestOutputKind", "SamplingMask",
           "SamplingParams", "TextPrompt", "TokensPrompt", "__version__"]


def __getattr__(name: str):  # LLM imports torch and the engine: load it on first use
    if name == "LLM":
        from vllm.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)
