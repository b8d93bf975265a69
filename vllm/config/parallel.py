"""ParallelConfig: how the model and the sampler are spread over devices."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Number of tensor-parallel ranks (only 1 is supported yet)."""
    enable_batch_sharded_sampling: bool = False
    """Shard the sampler's batch over tensor-parallel ranks and gather the sampled tokens."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} is not supported yet: this engine "
                             "runs on one device; use --tensor-parallel-size 1.")
