"""EngineCore: the scheduler and the workers in a loop; `step()` runs one schedule -> execute -> update cycle.

The workers are reached through `model_executor` (vllm/v1/executor/): one worker in this process, or one per
tensor-parallel rank with rank 0 (`worker`) here; a step's output is rank 0's.

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

Deferred mask lists: a step's sampling-mask lists are built when its outputs are handed on, not by the output
thread: `step()` returns them pending (a PendingStepMasks) and the caller builds them with
`EngineCoreOutputs.resolve_step_rows()` (the engine-core process when it sends them, the in-process client when
the frontend takes them).

The RL lifecycle (docs/rl.md) runs here, between steps, as utility calls (`UTILITY_METHODS`; the engine-core
process and the in-process client call them by name):
- Pause: `pause_generation(mode)` holds every request added while paused (Scheduler.held) until
  `resume_generation()`. Mode "abort" finishes every request now (an ABORT output each, with no new token);
  "wait" lets the requests already there finish; "keep" schedules nothing (Scheduler.halted), the requests keep
  their KV blocks and places. The call's result is a `Deferred`, ready once the batch queue has drained (and,
  for "wait", the requests finished): the caller keeps stepping until then.
- Weight updates: `start_weight_update` halts scheduling and drains the batch queue (its steps' outputs go to
  `pending_outputs`), so no step is in flight and none starts while weights are copied; `update_weights` moves
  weights into the existing parameters (the worker: vllm/v1/worker/weight_update.py; with several ranks, every
  rank checks before any receives, then all of them or none: vllm/v1/engine/weight_sync.py, else the engine
  stops); `finish_weight_update`
  sets the new `weight_version` and lifts the halt (unless paused in keep mode). Every step's outputs carry the
  weight version that computed them. Finishing an update (also a failed one) invalidates the prefix cache
  (KVCacheManager.invalidate_prefix_cache): no KV computed with the old weights is found again.
- Prefix cache: `reset_prefix_cache(reset_running_requests)` (vLLM's semantics); a pause with `clear_cache`
  resets it once paused, preempting the requests kept in keep mode (they recompute their KV after resume).
- `collective_rpc` runs a worker method (or a worker extension's, `worker_extension_cls`) after draining.
- Sleep mode (`sleep`, `wake_up`, `is_sleeping`; vllm/v1/engine/sleep_mode.py): halts scheduling like a pause
  and has the worker release the weights' and the KV cache's memory.
Outputs made outside a step (the drained steps', the aborts of a pause) wait in `pending_outputs`; the caller
sends them before anything else, and before the call's result.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import (Deferred, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineStepError,
                             FinishReason)
from vllm.v1.engine.sleep_mode import SLEEP_UTILITY_METHODS, EngineSleepMixin
from vllm.v1.engine.weight_sync import (NO_UPDATE, WeightDrainError, WeightsOutOfStepError, check_transfer_init,
                                        check_weight_update, discard_weight_update, init_transfer_all_or_none,
                                        no_update_in_progress, run_weight_change, update_weights_all_or_none)
from vllm.v1.request import Request, RequestStatus
from vllm.v1.executor.abstract import Executor
from vllm.v1.worker.async_output import AsyncModelRunnerOutput
from vllm.v1.worker.worker import Worker

logger = logging.getLogger(__name__)

_BATCH_QUEUE_SIZE = 2
PAUSE_MODES = ("abort", "wait", "keep")


class EngineCore(EngineSleepMixin):
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        # The workers, one per rank (vllm/v1/executor/); `worker` is rank 0's, in this process.
        self.model_executor = Executor.get_class(vllm_config)(vllm_config)
        self.worker: Worker = self.model_executor.driver_worker
        try:
            num_blocks = self.model_executor.determine_num_blocks()
            self.model_executor.initialize_kv_cache(num_blocks)
            self.model_executor.compile_or_warm_up_model()
        except BaseException:
            self.model_executor.shutdown()
            raise
        self.num_gpu_blocks = num_blocks
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        scheduler_cls = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler: Scheduler = scheduler_cls(vllm_config, num_blocks)
        self.batch_queue: deque[tuple[SchedulerOutput, AsyncModelRunnerOutput]] = deque()
        copier = getattr(getattr(self.worker, "model_runner", None), "output_copier", None)
        if copier is not None:
            copier.defer_mask_lists = True  # module docstring: "Deferred mask lists"
        self._init_lifecycle()

    def _init_lifecycle(self) -> None:
        """The RL lifecycle's state (module docstring): not paused, no update, weights not named."""
        self.pause_mode: str | None = None
        self.updating_weights = False
        self.weight_version: str | None = None
        self.pending_outputs: deque[EngineCoreOutputs] = deque()
        self._init_sleep()

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"Request id {request.request_id!r} is already running.")
        if self._refuse_while_sleeping(request):
            return
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Whether stepping has work: steps in flight, or requests to schedule (none while halted; requests held
        while paused do not count)."""
        return self.scheduler.has_work() or bool(self.batch_queue)

    def step(self) -> EngineCoreOutputs:
        if self.async_scheduling:
            return self.step_with_batch_queue()
        # NOTE: a step with only finished ids still runs, so the runner drops aborted requests' rows.
        if not self.scheduler.has_requests():
            return EngineCoreOutputs()
        scheduler_output = self.scheduler.schedule()
        model_output = self.model_executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        outputs.weight_version = self.weight_version
        return outputs

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        queue = self.batch_queue
        self._fill_batch_queue()
        if not queue:
            return EngineCoreOutputs()
        scheduler_output, future = queue.popleft()
        outputs = self.scheduler.update_from_output(scheduler_output, future.get_output())
        outputs.weight_version = self.weight_version
        return outputs

    def _fill_batch_queue(self) -> None:
        queue = self.batch_queue
        while len(queue) < _BATCH_QUEUE_SIZE and self.scheduler.has_requests():
            scheduler_output = self.scheduler.schedule()
            has_tokens = scheduler_output.total_num_scheduled_tokens > 0
            if has_tokens or scheduler_output.finished_req_ids:
                queue.append((scheduler_output, self.model_executor.execute_model_async(scheduler_output)))
            if not has_tokens:
                break

    # ------------------------------------------------------------------ the RL lifecycle (module docstring)

    UTILITY_METHODS = frozenset({
        "pause_generation", "resume_generation", "is_paused", "abort_all_requests", "generation_halted",
        "collective_rpc", "reset_prefix_cache", "init_weight_transfer_engine", "start_weight_update",
        "update_weights", "finish_weight_update", "get_weight_version", "update_weight_version", "weight_info",
        "load_weights_from_disk", "init_broadcaster", "load_weights_from_broadcast", "check_weight_update",
        "discard_weight_update", "check_weight_transfer_init"}) | SLEEP_UTILITY_METHODS

    def _drain(self) -> None:
        """Finish every step in flight now (no new one is launched); their outputs go to `pending_outputs`."""
        while self.batch_queue:
            scheduler_output, future = self.batch_queue.popleft()
            try:
                outputs = self.scheduler.update_from_output(scheduler_output, future.get_output())
                outputs.resolve_step_rows()  # NOTE: kept past later steps: nothing left pending on a staging slot
            except Exception as e:
                raise EngineStepError(f"A step failed while a utility call drained the steps in flight: {e!r}") from e
            outputs.weight_version = self.weight_version
            self.pending_outputs.append(outputs)

    def _set_halt(self) -> None:
        self.scheduler.halted = self.pause_mode == "keep" or self.updating_weights or self.sleep_halted

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> Deferred:
        """Pause (module docstring); ready once nothing of the mode's is left running. Pausing again changes the
        mode. clear_cache: once paused, reset the prefix cache, preempting the requests a keep-mode pause kept
        (vLLM's pause_scheduler does the same)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"Unknown pause mode {mode!r}; expected one of {', '.join(PAUSE_MODES)}.")
        self.pause_mode = mode
        self.scheduler.hold_new = True
        self._set_halt()
        if mode == "abort":
            self.abort_all_requests()

        def done() -> None:
            if clear_cache:
                self.scheduler.reset_prefix_cache(reset_running_requests=True)

        if mode == "wait":
            return Deferred(lambda: not self.batch_queue and not self.scheduler.has_unfinished_requests(), done)
        return Deferred(lambda: not self.batch_queue, done)

    def abort_all_requests(self) -> int:
        """Abort every request (running, waiting, held); each gets an ABORT output of its own now, not only a
        finished id, so its frontend ends it with its partial output, whichever API server it came from."""
        scheduler = self.scheduler
        request_ids = [r.request_id for r in (*scheduler.running, *scheduler.waiting, *scheduler.held)]
        scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        scheduler._aborted_req_ids.difference_update(request_ids)
        if request_ids:
            # NOTE: no scheduler stats here: they would count the last step's preemptions again.
            self.pending_outputs.append(EngineCoreOutputs(
                outputs=[EngineCoreOutput(r, [], finish_reason=FinishReason.ABORT) for r in request_ids]))
        return len(request_ids)

    def generation_halted(self) -> str | None:
        """Why nothing is scheduled now (sleep, a pause, a weight update in progress), or None."""
        if self.sleep_level is not None:
            return "the engine is asleep (sleep mode; call wake_up)"
        if self.updating_weights:
            return "a weight update is in progress (call finish_weight_update)"
        if self.pause_mode is not None:
            return f"generation is paused (mode {self.pause_mode!r}; call resume_generation)"
        return None

    def resume_generation(self) -> None:
        if self.pause_mode is None:
            raise ValueError("The engine is not paused: call pause_generation first (resume without pause).")
        self.pause_mode = None
        self._set_halt()
        self.scheduler.release_held()

    def is_paused(self) -> bool:
        return self.pause_mode is not None

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached KV block; False (nothing changes) while requests hold blocks, unless
        `reset_running_requests`, which drains the steps in flight and preempts every running request first
        (vLLM's semantics). reset_connector: there is no KV connector."""
        if reset_running_requests:
            self._drain()
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run `method` on every worker (one per rank) after the steps in flight finished; one result per worker,
        in rank order.
        A name is a method of the worker or of its worker extension (not one starting with "_"); a callable is
        called with the worker first. timeout is the caller's to enforce (a running call cannot be stopped).
        "sleep" and "wake_up" are the engine's own (sleep_mode.py), which reach every rank: one result per rank
        too."""
        if method in ("sleep", "wake_up"):
            return [self._sleep_rpc(method, args, kwargs or {})] * self.model_executor.world_size
        self._drain()
        return self.model_executor.collective_rpc(method, timeout, args, kwargs or {})

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        init_transfer_all_or_none(self.model_executor, init_info)  # NOTE: every rank checks before any joins

    def check_weight_transfer_init(self, init_info: dict[str, Any]) -> str | None:
        """init_weight_transfer_engine's checks alone (the data-parallel client's agreement): the refusal or None."""
        return check_transfer_init(self.model_executor, init_info)

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        if self.updating_weights:
            raise ValueError("A weight update is already in progress: call finish_weight_update first.")
        self.updating_weights = True
        self._set_halt()
        self._drain()
        try:
            self.model_executor.run_workers("start_weight_update", is_checkpoint_format)
        except BaseException:
            self.updating_weights = False
            self._set_halt()
            raise

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if not self.updating_weights:
            raise no_update_in_progress(self.model_executor)  # NOTE: a refusal, as the DP client's check gives it
        # NOTE: every rank accepts before any receives (weight_sync.py): a refusal leaves no rank in the trainer's
        # collective.
        update_weights_all_or_none(self.model_executor, update_info)

    def check_weight_update(self, update_info: dict[str, Any]) -> tuple[str | None, bool]:
        """update_weights' checks alone (the data-parallel client's agreement, dp_client.py): (the refusal's text
        or None, whether every rank can receive the update and drop it)."""
        if not self.updating_weights:
            return NO_UPDATE, False
        return check_weight_update(self.model_executor, update_info)

    def discard_weight_update(self, update_info: dict[str, Any]) -> None:
        """Receive a refused update from the trainer's group on every rank and drop it (no weight changes);
        WeightDrainError when that fails here (another caller ended the update since the check, say)."""
        if not self.updating_weights:
            raise WeightDrainError("No weight update is in progress on this engine: nothing was received.")
        discard_weight_update(self.model_executor, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if not self.updating_weights:
            raise ValueError(NO_UPDATE)
        _check_version(weight_version, "weight_version")
        try:
            self.model_executor.run_workers("finish_weight_update")
        finally:
            self.updating_weights = False
            self._set_halt()
            self.scheduler.kv_cache_manager.invalidate_prefix_cache()
        if weight_version is not None:
            self.weight_version = weight_version

    def load_weights_from_disk(self, path: str, weight_version: str | None = None) -> None:
        """A whole update from a folder of safetensors, whatever the backend (prime-rl's /update_weights
        {"weight_dir"}): start, check on every rank, load, finish."""
        def load() -> None:
            # NOTE: every rank checks before any rank loads, so a checkpoint one rank refuses changes no rank
            # (weight_sync.py: a load that fails on some ranks only ends the engine).
            self.model_executor.run_workers("check_weights_from_disk", path)
            run_weight_change(self.model_executor, "load_weights_from_disk", path)

        self._whole_update(load, weight_version)

    def _whole_update(self, load: Callable[[], None], weight_version: str | None) -> None:
        """start_weight_update, `load`, finish_weight_update(weight_version) as one call; a failed load names no
        new version (and lifts the halt)."""
        _check_version(weight_version, "weight_version")
        self.start_weight_update(True)
        try:
            load()
        except WeightsOutOfStepError:
            raise  # NOTE: fatal (weight_sync.py): the halt stays, no step runs with the ranks' weights
        except BaseException:
            self.finish_weight_update(None)
            raise
        self.finish_weight_update(weight_version)

    def init_broadcaster(self, host: str, port: int, rank_offset: int, inference_world_size: int,
                         timeout: float) -> None:
        """Join prime-rl's NCCL weight broadcast as its rank rank_offset + 1 (blocks until the trainer is there)."""
        self.model_executor.run_workers("init_broadcaster", host, port, rank_offset, inference_world_size, timeout)

    def load_weights_from_broadcast(self, weight_version: str | None = None) -> None:
        """A whole update from prime-rl's broadcaster (its /update_weights {"weight_dir": null})."""
        self._whole_update(lambda: run_weight_change(self.model_executor, "receive_broadcast_weights"),
                           weight_version)

    def get_weight_version(self) -> str | None:
        return self.weight_version

    def update_weight_version(self, new_version: str | None) -> None:
        """Name the current weights (the tokens of later steps carry it) without changing them."""
        _check_version(new_version, "new_version")
        self._drain()
        self.weight_version = new_version

    def weight_info(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "is_updating": self.updating_weights,
                "parameters": self.worker.weight_info()}

    def shutdown(self) -> None:
        """Stop the workers (their processes with tensor_parallel_size > 1)."""
        self.model_executor.shutdown()


def _check_version(version: object, name: str) -> None:
    if version is not None and not isinstance(version, str):
        raise ValueError(f"{name} must be a string or null, got {version!r}.")
