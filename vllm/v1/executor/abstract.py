"""Executor: what the engine core calls to run its workers, one per rank, whatever process each one lives in.

vLLM's names: `Executor.get_class(vllm_config)` picks the backend of `parallel_config.distributed_executor_backend`:
`UniProcExecutor` ("uni": the one worker in the engine core's process), `MultiprocExecutor` ("mp": rank 0 there,
ranks 1..N-1 in processes of their own) or `RayDistributedExecutor` ("ray": ranks 1..N-1 as Ray actors). An engine
of one rank uses UniProcExecutor whatever the backend ("mp" and "ray" are accepted at world_size 1, as in vLLM:
there is no other rank to place).

Invariants:
- Rank 0, the driver worker (`driver_worker`), always runs in the engine core's process; its `execute_model`
  output is the engine's. The other ranks run every step too (their outputs are dropped).
- `collective_rpc` returns one result per rank, in rank order; a failure on any rank raises (the first failing
  rank's error) after every rank has finished the call, so the ranks stay in step.
- The engine's own worker calls (start-up, weight updates, sleep) go through `run_workers`, which skips the
  checks `collective_rpc` applies to user calls (Worker.call) but otherwise behaves the same.
- The KV cache has the same number of blocks on every rank: the smallest any rank can hold.
- A worker that dies makes the executor fail: `check_health` and every later call raise EngineDeadError, never
  hang on the dead rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.async_output import AsyncModelRunnerOutput
from vllm.v1.worker.worker import Worker


class Executor(ABC):
    """The workers of one engine, seen from the engine core."""

    uses_ray: bool = False

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.world_size = self.parallel_config.world_size
        self.driver_worker: Worker
        self._init_executor()

    @staticmethod
    def get_class(vllm_config: VllmConfig) -> type[Executor]:
        backend = vllm_config.parallel_config.distributed_executor_backend
        if vllm_config.parallel_config.world_size == 1:
            backend = "uni"  # NOTE: the worker joins no process group at one rank; "mp" and "ray" need one
        if backend == "ray":
            from vllm.v1.executor.ray_distributed_executor import RayDistributedExecutor
            return RayDistributedExecutor
        if backend == "mp":
            from vllm.v1.executor.multiproc_executor import MultiprocExecutor
            return MultiprocExecutor
        from vllm.v1.executor.uniproc_executor import UniProcExecutor
        return UniProcExecutor

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers and set `driver_worker` (each worker builds its model)."""

    @abstractmethod
    def run_workers(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """The engine's own call of a worker method on every rank -> one result per rank, in rank order."""

    def run_workers_outcomes(self, method: str, *args: Any, **kwargs: Any) -> list[tuple[bool, Any]]:
        """run_workers without raising: `(True, result)` or `(False, exception)` per rank, in rank order (the
        engine's weight updates judge every rank's outcome: vllm/v1/engine/weight_sync.py)."""
        try:
            return [(True, value) for value in self.run_workers(method, *args, **kwargs)]
        except Exception as e:
            return [(False, e)]

    @abstractmethod
    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """A user's call (Worker.call's checks: a public method of the worker or its extension, or a callable given
        the worker first) on every rank -> one result per rank, in rank order. timeout is the caller's to
        enforce (a call running on a rank cannot be stopped)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every rank; the driver's output."""

    @abstractmethod
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """One step launched on every rank; the driver's output, maybe still on its way to the host."""

    def determine_num_blocks(self) -> int:
        """The KV-cache blocks every rank can hold: the minimum over ranks."""
        return min(self.run_workers("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.run_workers("initialize_kv_cache", num_blocks)

    def compile_or_warm_up_model(self) -> None:
        self.run_workers("compile_or_warm_up_model")

    def check_health(self) -> None:
        """Raise EngineDeadError when a worker has died."""

    def shutdown(self) -> None:
        """Stop every worker (the driver's resources too); a second call does nothing."""
