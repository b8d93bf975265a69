"""ParallelConfig: how the model and the sampler are spread over devices."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# NOTE: vLLM's names for a single worker (uni) and for worker processes (mp); both run the one executor here.
EXECUTOR_BACKENDS = (None, "uni", "mp")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Number of tensor-parallel ranks (only 1 is supported yet)."""
    enable_batch_sharded_sampling: bool = False
    """Accepted for vLLM compatibility at tensor_parallel_size 1 (no effect there); refused with more ranks: the
    logits are gathered to every rank and one sampler step runs on the whole batch (docs/parallelism.md)."""
    pipeline_parallel_size: int = 1
    """Number of pipeline stages; only 1 (no pipeline parallelism)."""
    distributed_executor_backend: str | None = None
    """None, uni or mp: all mean the one executor there is, the model in the engine core's own process; ray and
    external_launcher are refused."""
    enable_expert_parallel: bool = False
    """Only False: there is no expert parallelism (nor a mixture-of-experts model)."""
    worker_extension_cls: str = ""
    """Import path of a class whose methods are added to the worker ("package.module.ClassName"), for
    collective_rpc (RL frameworks' weight-sync code). It is imported in the engine process: trusted code only."""

    def __post_init__(self) -> None:
        if self.worker_extension_cls:
            resolve_worker_extension(self.worker_extension_cls)  # NOTE: here, so that a bad path fails early
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
        if self.enable_batch_sharded_sampling and self.tensor_parallel_size > 1:
            raise ValueError("enable_batch_sharded_sampling=True is not supported with tensor_parallel_size > 1: the "
                             "logits are gathered to every rank and sampled once for the whole batch "
                             "(docs/parallelism.md); drop --enable-batch-sharded-sampling.")


def resolve_worker_extension(qualname: str | type) -> type:
    """The class named by an import path ("pkg.module.Class"); ValueError when it cannot be imported."""
    if isinstance(qualname, type):
        return qualname
    module_name, _, class_name = str(qualname).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name, None) if module_name else None
    except ImportError as e:
        raise ValueError(f"worker_extension_cls {qualname!r} cannot be imported: {e}") from e
    if not isinstance(cls, type):
        raise ValueError(f"worker_extension_cls {qualname!r} is not a class (expected 'package.module.ClassName').")
    return cls
