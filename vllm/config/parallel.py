"""ParallelConfig: how the model and the sampler are spread over devices, and how many engines serve.

Data parallel (docs/parallelism.md): `data_parallel_size` engine cores, each with its own copy of the model and its
own (future) tensor-parallel group; the launcher gives engine i a copy of the config with `data_parallel_rank = i`.
Engines of a dense model share nothing at run time (no process group spans them)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# NOTE: vLLM's names for a single worker (uni) and for worker processes (mp); both run the one executor here.
EXECUTOR_BACKENDS = (None, "uni", "mp")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Number of tensor-parallel ranks (only 1 is supported yet)."""
    data_parallel_size: int = 1
    """Number of engine cores serving the model, each its own process with a whole copy of the model (and its own
    tensor-parallel group); the API servers spread requests over them by load. Served by `vllm serve` / AsyncLLM;
    the offline LLM refuses it."""
    data_parallel_rank: int = 0
    """This engine core's index among the data-parallel engines (set by the launcher; 0 in the frontend)."""
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
        for name in ("data_parallel_size", "data_parallel_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}.")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1 (the number of engine cores), got "
                             f"{self.data_parallel_size}.")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank={self.data_parallel_rank} is out of range [0, "
                             f"{self.data_parallel_size}).")
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
