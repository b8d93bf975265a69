"""Qwen3 causal LM: the Llama decoder with per-head q/k RMSNorm before rope and head_dim from the config."""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config: Any) -> None:
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError("Qwen3 with use_sliding_window=true is not supported")
        super().__init__(hf_config)

    @staticmethod
    def _attention_switches(hf_config: Any) -> tuple[bool, bool, bool]:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return bias, bias, True
