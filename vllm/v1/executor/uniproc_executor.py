"""UniProcExecutor: the one worker (rank 0 of 1) in the engine core's process, called directly.

Invariant: a step costs one Python call more than calling the worker: no copy, no pickling, no process group
(`torch.distributed` is left to whoever owns the process; see vllm/v1/engine/core_proc.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.executor.abstract import Executor
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.async_output import AsyncModelRunnerOutput
from vllm.v1.worker.worker import make_worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.driver_worker = make_worker(self.vllm_config)

    def run_workers(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args, **kwargs)]

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [self.driver_worker.call(method, args, kwargs or {})]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        return self.driver_worker.execute_model_async(scheduler_output)
