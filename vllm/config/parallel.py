"""ParallelConfig: how the model and the sampler are spread over devices, and how many engines serve.

Data parallel (docs/parallelism.md): `data_parallel_size` engine cores, each with its own copy of the model and its
own tensor-parallel group (vllm/v1/executor/); the launcher gives engine i a copy of the config with
`data_parallel_rank = i`. Engines of a dense model share nothing at run time (no process group spans them)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

# vLLM's names: one worker in the engine core's process (uni), one process per rank on this node (mp), Ray actors
# placed by a placement group (ray); vllm/v1/executor/.
EXECUTOR_BACKENDS = (None, "uni", "mp", "ray")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Number of tensor-parallel ranks: one worker per rank (docs/parallelism.md); it must divide the model's
    attention heads."""
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
    """uni (one worker, in the engine core's process), mp (rank 0 there, ranks 1..N-1 in processes of their own on
    this node) or ray (ranks 1..N-1 as Ray actors of a placement group); None: uni for one rank, else mp.
    external_launcher is refused."""
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
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}.")
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size} is not supported: this engine "
                             "runs on one device; use --pipeline-parallel-size 1.")
        self._resolve_executor_backend()
        if self.enable_expert_parallel:
            raise ValueError("enable_expert_parallel=True is not supported: this engine has no expert parallelism; "
                             "use enable_expert_parallel=False (--no-enable-expert-parallel).")
        if self.enable_batch_sharded_sampling and self.tensor_parallel_size > 1:
            raise ValueError("enable_batch_sharded_sampling=True is not supported with tensor_parallel_size > 1: the "
                             "logits are gathered to every rank and sampled once for the whole batch "
                             "(docs/parallelism.md); drop --enable-batch-sharded-sampling.")

    @property
    def world_size(self) -> int:
        """Workers of one engine: tensor_parallel_size (no pipeline stages)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _resolve_executor_backend(self) -> None:
        backend = self.distributed_executor_backend
        if backend == "external_launcher":
            raise ValueError("distributed_executor_backend='external_launcher' is not supported: this engine starts "
                             "its own workers; use 'mp' (one node) or 'ray'.")
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={backend!r} is not supported; use 'uni', 'mp' or 'ray'.")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one worker, but tensor_parallel_size="
                             f"{self.tensor_parallel_size} needs {self.world_size}; use 'mp' or 'ray'.")
        if backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"


def check_tensor_parallel(parallel_config: ParallelConfig, device: str) -> None:
    """tensor_parallel_size against the devices (one CUDA device per rank on this node, unless Ray places the
    ranks; rank r runs on cuda:r, so no index is given). The model's side: ModelConfig.verify_with_parallel_config."""
    tp = parallel_config.tensor_parallel_size
    if tp == 1:
        return
    if device.startswith("cuda:"):
        raise ValueError(f"device={device!r} names one device, but tensor_parallel_size={tp} puts rank r on cuda:r; "
                         "use device=cuda (and CUDA_VISIBLE_DEVICES to choose the devices).")
    if device == "cuda" and parallel_config.distributed_executor_backend != "ray":
        num_devices = torch.cuda.device_count()
        if tp > num_devices:
            raise ValueError(f"tensor_parallel_size={tp} needs {tp} CUDA devices, but {num_devices} are visible; "
                             "lower it, or use --distributed-executor-backend ray to place ranks on other nodes.")


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
