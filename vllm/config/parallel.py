"""ParallelConfig: how the model and the sampler are spread over devices."""

from __future__ import annotations

from dataclasses import dataclass

# NOTE: vLLM's names for a single worker (uni) and for worker processes (mp); both run the one executor here.
EXECUTOR_BACKENDS = (None, "uni", "mp")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Number of tensor-parallel ranks (only 1 is supported yet)."""
    enable_batch_sharded_sampling: bool = False
    """Shard the sampler's batch over tensor-parallel ranks and gather the sampled tokens."""
    pipeline_parallel_size: int = 1
    """Number of pipeline stages; only 1 (no pipeline parallelism)."""
    distributed_executor_backend: str | None = None
    """None, uni or mp: all mean the one executor there is, the model in the engine core's own process; ray and
    external_launcher are refused."""
    enable_expert_parallel: bool = False
    """Only False: there is no expert parallelism (nor a mixture-of-experts model)."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} is not supported yet: this engine "
                             "runs on one device; use --tensor-parallel-size 1.")
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size} is not supported: this engine "
                             "runs on one device; use --pipeline-parallel-size 1.")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r} is not supported: "
                             "this engine has a single-process executor only; use None, 'uni' or 'mp'.")
        if self.enable_expert_parallel:
            raise ValueError("enable_expert_parallel=True is not supported: this engine has no expert parallelism; "
                             "use enable_expert_parallel=False (--no-enable-expert-parallel).")
