"""EngineCore: the scheduler and the worker in a loop; `step()` runs one schedule -> execute -> update cycle.

It speaks only the engine-core protocol (vllm.v1.engine): EngineCoreRequests in, EngineCoreOutputs out.

With async scheduling (SchedulerConfig.async_scheduling) `step()` is `step_with_batch_queue()`: up to two
scheduled steps are in flight. Each call schedules and launches steps until two are queued, then waits for the
oldest one's output and turns it into EngineCoreOutputs, so step N's host work (output copies, lists,
update_from_output, the next schedule) overlaps step N+1 on the device.

Invariants:
- A step's output is processed before the step after next is scheduled (the queue is two deep), which is what
  AsyncScheduler's placeholders and the runner's device-side token feed rely on.
- `has_unfinished_requests()` stays true while a step is in flight, so callers keep stepping until the queue
  has drained.

Launching ahead (`launch_ahead()`, VLLM_ENGINE_LAUNCH_AHEAD=1): the caller refills the queue right after `step()`
returned step N's outputs, before it sends or processes them; the queue order is unchanged (step N+2 is still
scheduled after step N's update), only the host work on step N's outputs moves from before the launch of step
N+2 to after it, off the path that keeps the device fed. With VLLM_ENGINE_DEFER_MASK_LISTS the step's
sampling-mask lists move there too: `step()` then returns them pending (a PendingStepMasks), and the caller
builds them with `EngineCoreOutputs.resolve_step_rows()` before it hands the outputs on.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from vllm import envs
from vllm.config import VllmConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
from vllm.v1.metrics.step_timing import StepTimer
from vllm.v1.request import Request, RequestStatus
from vllm.v1.worker.async_output import AsyncModelRunnerOutput
from vllm.v1.worker.worker import Worker

logger = logging.getLogger(__name__)

_BATCH_QUEUE_SIZE = 2


class EngineCore:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.worker = Worker(vllm_config)
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_kv_cache(num_blocks)
        self.worker.compile_or_warm_up_model()
        self.num_gpu_blocks = num_blocks
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        # VLLM_ENGINE_LAUNCH_AHEAD (an experiment, off by default), with async scheduling only: see `launch_ahead`.
        self.launches_ahead = self.async_scheduling and envs.VLLM_ENGINE_LAUNCH_AHEAD
        scheduler_cls = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler: Scheduler = scheduler_cls(vllm_config, num_blocks)
        self.batch_queue: deque[tuple[SchedulerOutput, AsyncModelRunnerOutput]] = deque()
        self.step_timer = StepTimer()
        copier = getattr(getattr(self.worker, "model_runner", None), "output_copier", None)
        if copier is not None:
            copier.timer = self.step_timer
            copier.device_timing = envs.VLLM_ENGINE_STEP_TIMING
            copier.defer_mask_lists = envs.VLLM_ENGINE_DEFER_MASK_LISTS

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"Request id {request.request_id!r} is already running.")
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def step(self) -> EngineCoreOutputs:
        if self.async_scheduling:
            return self.step_with_batch_queue()
        # NOTE: a step with only finished ids still runs, so the runner drops aborted requests' rows.
        if not self.scheduler.has_requests():
            return EngineCoreOutputs()
        timer = self.step_timer
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        t1 = time.perf_counter()
        model_output = self.worker.execute_model(scheduler_output)
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        timer.add("schedule", t1 - t0)
        timer.add("launch", t2 - t1)  # synchronous: the whole forward and the output lists
        timer.add("update", time.perf_counter() - t2)
        timer.count_step(len(scheduler_output.num_scheduled_tokens))
        return outputs

    def launch_ahead(self) -> None:
        """With async scheduling and VLLM_ENGINE_LAUNCH_AHEAD: schedule and launch steps until the batch queue is
        full, now rather than at the start of the next `step()`. A caller that holds a step's outputs calls it
        before handing them on (sending, detokenizing), so that the device gets the step after next while the
        host does that work; without the switch (or async scheduling) it does nothing."""
        if self.launches_ahead:
            self._fill_batch_queue()

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        queue, timer = self.batch_queue, self.step_timer
        self._fill_batch_queue()
        if not queue:
            return EngineCoreOutputs()
        scheduler_output, future = queue.popleft()
        t0 = time.perf_counter()
        model_output = future.get_output()
        t1, c1 = time.perf_counter(), time.thread_time()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        timer.add("wait", t1 - t0)
        timer.add("update", time.perf_counter() - t1, time.thread_time() - c1)
        timer.count_step(len(scheduler_output.num_scheduled_tokens))
        return outputs

    def _fill_batch_queue(self) -> None:
        queue, timer = self.batch_queue, self.step_timer
        while len(queue) < _BATCH_QUEUE_SIZE and self.scheduler.has_requests():
            t0, c0 = time.perf_counter(), time.thread_time()
            scheduler_output = self.scheduler.schedule()
            t1, c1 = time.perf_counter(), time.thread_time()
            has_tokens = scheduler_output.total_num_scheduled_tokens > 0
            if has_tokens or scheduler_output.finished_req_ids:
                queue.append((scheduler_output, self.worker.execute_model_async(scheduler_output)))
            timer.add("schedule", t1 - t0, c1 - c0)
            timer.add("launch", time.perf_counter() - t1, time.thread_time() - c1)
            if not has_tokens:
                break
