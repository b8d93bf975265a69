"""VllmConfig: every config of one engine, with the checks that span several of them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.config.cache import CacheConfig
from vllm.config.model import ModelConfig
from vllm.config.parallel import ParallelConfig, check_tensor_parallel
from vllm.config.scheduler import SchedulerConfig
from vllm.config.weight_transfer import WeightTransferConfig

__all__ = ["CacheConfig", "DeviceConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig", "VllmConfig",
           "WeightTransferConfig", "get_current_vllm_config", "set_current_vllm_config"]


@dataclass
class DeviceConfig:
    device: str = "auto"
    """cuda, cpu, or auto (cuda when available)."""

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cuda", "cpu") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cuda or cpu, got {self.device!r}.")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device=cuda was asked for but no CUDA device is available; use device=cpu.")

    @property
    def torch_device(self) -> torch.device:
        device = torch.device(self.device)
        if device.type == "cuda" and device.index is None:
            # NOTE: torch.cuda.set_device and CUDA graphs need an explicit index.
            device = torch.device("cuda", torch.cuda.current_device())
        return device


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    # vllm.config.weight_transfer.WeightTransferConfig, or None: the default backend (nccl) when one is needed.
    weight_transfer_config: Any = None

    def __post_init__(self) -> None:
        self.model_config.dtype = self.dtype  # NOTE: resolved, as vLLM's worker extensions read it
        assert self.model_config.max_model_len is not None
        self.scheduler_config.max_model_len = self.model_config.max_model_len
        self.model_config.verify_with_parallel_config(self.parallel_config)
        check_tensor_parallel(self.parallel_config, self.device_config.device)
        if self.scheduler_config.async_scheduling is None:
            self.scheduler_config.async_scheduling = self.device_config.torch_device.type == "cuda"
        if self.model_config.return_sampling_mask:
            if self.model_config.logprobs_mode != "processed_logprobs":
                raise ValueError(
                    "return_sampling_mask requires logprobs_mode='processed_logprobs' (got "
                    f"{self.model_config.logprobs_mode!r}), so that returned logprobs are normalised over the "
                    "same support as the mask: pass --logprobs-mode processed_logprobs.")
            if self.parallel_config.enable_batch_sharded_sampling:
                raise ValueError(
                    "return_sampling_mask cannot be combined with enable_batch_sharded_sampling: the batch-sharded "
                    "gather would drop the masks. Pass --no-enable-batch-sharded-sampling or drop "
                    "--return-sampling-mask.")

    @property
    def dtype(self) -> torch.dtype:
        return self.model_config.resolve_dtype(self.device_config.torch_device)


_current_vllm_config: VllmConfig | None = None


@contextlib.contextmanager
def set_current_vllm_config(vllm_config: VllmConfig, check_compile: bool = False, prefix: str | None = None
                            ) -> Iterator[None]:
    """vLLM's context in which model code sees `vllm_config` (get_current_vllm_config); RL worker extensions wrap
    their own weight loading in it. check_compile and prefix have no effect (no torch.compile here)."""
    global _current_vllm_config
    previous, _current_vllm_config = _current_vllm_config, vllm_config
    try:
        yield
    finally:
        _current_vllm_config = previous


def get_current_vllm_config() -> VllmConfig:
    """The config of the innermost set_current_vllm_config, else a default VllmConfig (as vLLM)."""
    return _current_vllm_config if _current_vllm_config is not None else VllmConfig()
