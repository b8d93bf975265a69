"""Maps a config's `architectures` names to model classes, importing a model module only when asked for."""

from __future__ import annotations

import importlib

from torch import nn

# architecture name -> (module under vllm.model_executor.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    """The class of the first supported name in `architectures`; ValueError when none is supported."""
    for arch in architectures:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            module = importlib.import_module(f"vllm.model_executor.models.{module_name}")
            return getattr(module, class_name)
    raise ValueError(f"Model architectures {list(architectures)} are not supported. "
                     f"Supported architectures: {', '.join(_MODELS)}.")
