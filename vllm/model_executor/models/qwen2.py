"""Qwen2 causal LM: the Llama decoder with q/k/v biases (always) and no o_proj bias."""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config: Any) -> None:
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError("Qwen2 with use_sliding_window=true is not supported")
        super().__init__(hf_config)

    @staticmethod
    def _attention_switches(hf_config: Any) -> tuple[bool, bool, bool]:
        return True, False, False
