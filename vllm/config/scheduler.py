"""SchedulerConfig: the batch limits of one engine step."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")
