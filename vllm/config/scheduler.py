"""SchedulerConfig: the batch limits of one engine step."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vllm.utils import warning_once

logger = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests running in one step."""
    max_num_batched_tokens: int = 8192
    """Most tokens computed in one step (prompt chunks plus decode tokens); longer prompts are chunked."""
    max_model_len: int = 2048
    """Copied from ModelConfig by VllmConfig."""
    async_scheduling: bool | None = None
    """Schedule step N+1 while step N runs on the device (its sampled tokens feed N+1 on the device, its outputs
    are copied to the host behind it). Default: on for CUDA, off for CPU."""
    enable_chunked_prefill: bool | None = None
    """Accepted for vLLM compatibility; no effect: the scheduler always gives a prompt what is left of the
    step's max_num_batched_tokens and computes the rest in later steps, whatever this says. False logs a
    warning."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")
        if self.enable_chunked_prefill is False:
            warning_once(logger, "enable_chunked_prefill=False: this engine always chunks prefills (a prompt "
                                 "longer than what is left of max_num_batched_tokens in a step is computed over "
                                 "several steps); the setting is ignored.")
