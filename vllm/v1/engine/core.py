"""EngineCore: the scheduler and the worker in a loop; `step()` runs one schedule -> execute -> update cycle.

It speaks only the engine-core protocol (vllm.v1.engine): EngineCoreRequests in, EngineCoreOutputs out.
"""

from __future__ import annotations

import logging

from vllm.config import VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
from vllm.v1.request import Request, RequestStatus
from vllm.v1.worker.worker import Worker

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.worker = Worker(vllm_config)
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_kv_cache(num_blocks)
        self.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(vllm_config, num_blocks)

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"Request id {request.request_id!r} is already running.")
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        # NOTE: a step with only finished ids still runs, so the runner drops aborted requests' rows.
        if not self.scheduler.has_requests():
            return EngineCoreOutputs()
        scheduler_output = self.scheduler.schedule()
        model_output = self.worker.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, model_output)
