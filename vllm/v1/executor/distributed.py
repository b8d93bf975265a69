"""The step broadcast: how the driver (rank 0, in the engine core's process) drives ranks 1..N-1.

Each remote rank runs `run_worker_loop`: it waits for the driver's next message on the step group, a gloo group
of every rank made for this channel alone (torch.distributed's `broadcast_object`; no transport of our own), and
runs it. Messages, pickled once by the driver:
- `("step", scheduler_output, launch_async)`: every rank runs the step (the forward's collectives need them all);
  every rank samples the same gathered logits with the same random state, so each keeps the sampled ids its next
  step feeds back on its device, and only the driver's output goes to the scheduler (the other ranks copy only
  the sampled ids to the host: ModelRunner.is_driver_worker). With launch_async a rank
  keeps up to two steps in flight and reads the older one's output after launching the newer, as the engine
  core's batch queue does on the driver.
- `("call", method, args, kwargs, checked)`: every rank finishes its steps in flight, then runs the worker method
  (checked: a user's collective_rpc, through Worker.call); the replies `(ok, value)` come back to the driver by
  `gather_object`, in rank order; a reply that does not survive a pickle round trip is replaced by a
  RuntimeError naming the rank and carrying the original's text.
- `("shutdown",)`: the loop ends.
Start-up calls (`START_UP_METHODS`: profiling, KV-cache allocation, warm-up) are different: a rank that fails in
one may leave the others in a collective that never completes, so its error is not sent back but ends its
process (the driver, in a collective with it, then fails at once on gloo; on NCCL the executor's monitor ends the
engine core), and a driver that fails in one fails the executor (`shutdown` then kills the ranks): the engine's
start fails with the failing rank's error, no rank is left behind.

Invariants:
- The driver sends a message before it runs its own part, so the ranks work at the same time; every rank sees
  the same messages in the same order, so their collectives match.
- The step group never times out (an idle engine waits for its next step as long as it likes); a rank that dies
  closes its connections, so a collective with it fails at once (gloo), and the executor turns that into
  EngineDeadError, naming the dead worker when it can (`_worker_failure`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vllm.config import VllmConfig
from vllm.distributed.parallel_state import GroupCoordinator
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine.core_client import EngineDeadError
from vllm.v1.executor.abstract import Executor
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.async_output import AsyncModelRunnerOutput
from vllm.v1.worker.worker import Worker, make_worker

logger = logging.getLogger(__name__)

_STEP, _CALL, _SHUTDOWN = "step", "call", "shutdown"
# The engine's start-up calls: their forwards (profiling, warm-up, graph capture) hold collectives, so a rank that
# fails in one leaves the others waiting in a collective for good; such a failure ends the executor instead.
START_UP_METHODS = frozenset({"determine_num_blocks", "initialize_kv_cache", "compile_or_warm_up_model"})
# NOTE: how long the driver waits for a failed rank's exit to be seen, to name its error in the start-up failure.
_FAILURE_REPORT_WAIT_S = 2.0
# How long a backend's monitor lets the engine core report a dead worker itself before ending the process.
_DEATH_GRACE_S = 2.0
# NOTE: gloo applies a group's timeout to every wait, also a rank's wait for the next step of an idle engine.
_NO_TIMEOUT = timedelta(days=3650)
_step_group: GroupCoordinator | None = None


def init_worker_distributed_environment(vllm_config: VllmConfig, rank: int, local_rank: int,
                                        distributed_init_method: str | None) -> None:
    """Join this engine's torch.distributed world (NCCL on CUDA, gloo on CPU), its tensor-parallel group and the
    step group, on the rank's device, before the model is built (vllm/distributed/parallel_state.py)."""
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    global _step_group
    pc = vllm_config.parallel_config
    on_cuda = vllm_config.device_config.device.startswith("cuda")
    if on_cuda:
        torch.cuda.set_device(local_rank)
    init_distributed_environment(pc.world_size, rank, distributed_init_method or "env://", local_rank,
                                 "nccl" if on_cuda else "gloo")
    initialize_model_parallel(pc.tensor_parallel_size)
    ranks = list(range(pc.world_size))
    _step_group = GroupCoordinator(ranks=ranks, rank=rank, local_rank=local_rank,
                                   cpu_group=dist.new_group(ranks, backend="gloo", timeout=_NO_TIMEOUT))


def get_step_group() -> GroupCoordinator:
    if _step_group is None:
        raise RuntimeError("init_worker_distributed_environment() was not called in this process.")
    return _step_group


def _run_call(worker: Worker, method: str | Callable[..., Any], args: tuple, kwargs: dict[str, Any],
              checked: bool) -> Any:
    if checked:
        return worker.call(method, args, kwargs)
    assert isinstance(method, str)
    return getattr(worker, method)(*args, **kwargs)


def _reply(worker: Worker, method: str | Callable[..., Any], args: tuple, kwargs: dict[str, Any],
           checked: bool) -> tuple[bool, Any]:
    try:
        reply: tuple[bool, Any] = (True, _run_call(worker, method, args, kwargs, checked))
    except Exception as e:  # NOTE: the caller's error, raised on the driver; this rank goes on
        reply = (False, e)
    try:
        # NOTE: the round trip, not only dumps: an exception whose __init__ takes other arguments than its args
        # pickles but fails to unpickle on the driver, inside gather_object, which would end the engine.
        pickle.loads(pickle.dumps(reply))
    except Exception as e:
        ok, value = reply
        reply = (False, RuntimeError(f"rank {worker.rank}: the {'result' if ok else 'error'} of {method!r} cannot "
                                     f"be sent to the driver ({type(e).__name__}: {e}): {value!r:.300}"))
    return reply


def run_worker_loop(worker: Worker) -> None:
    """A remote rank's life after start-up: run the driver's messages until it says shutdown."""
    group = get_step_group()
    in_flight: deque[AsyncModelRunnerOutput] = deque()

    def finish_steps() -> None:
        while in_flight:
            in_flight.popleft().get_output()

    while True:
        message = group.broadcast_object(None, src=0)
        kind = message[0]
        if kind == _STEP:
            _, scheduler_output, launch_async = message
            if launch_async:
                in_flight.append(worker.execute_model_async(scheduler_output))
                if len(in_flight) > 1:
                    in_flight.popleft().get_output()
            else:
                finish_steps()
                worker.execute_model(scheduler_output)
        elif kind == _CALL:
            finish_steps()
            _, method, args, kwargs, checked = message
            if method in START_UP_METHODS and not checked:
                # NOTE: a failure raises out of the loop and ends this rank's process (the executor's start-up
                # failure, module docstring); the driver, maybe waiting in a collective with it, fails at once.
                result = _run_call(worker, method, args, kwargs, checked)
                dist.gather_object((True, result), None, dst=0, group=group.cpu_group)
                continue
            dist.gather_object(_reply(worker, method, args, kwargs, checked), None, dst=0, group=group.cpu_group)
        else:
            finish_steps()
            return


class DistributedExecutorBase(Executor):
    """The driver's side (module docstring); subclasses start and watch ranks 1..N-1."""

    def _init_executor(self) -> None:
        self._failure: str | None = None
        self._is_shutdown = False
        # The driver's device index (cuda:local_rank); a backend may set another one in _start_workers.
        self.driver_local_rank = 0
        distributed_init_method = self._start_workers()
        try:
            self.driver_worker = make_worker(self.vllm_config, 0, self.driver_local_rank, distributed_init_method)
        except Exception as e:
            failure = self._worker_failure()
            self._failure = failure or f"the driver failed to start ({type(e).__name__}: {e})"
            self.shutdown()  # NOTE: not graceful: the other ranks wait for a start-up that will not come
            if failure is not None:
                raise RuntimeError(f"Tensor-parallel start-up failed: {failure}") from e
            raise
        self._group = get_step_group()

    def _start_workers(self) -> str:
        """Start ranks 1..N-1, each joining the world at the returned init method (tcp://host:port)."""
        raise NotImplementedError

    def _worker_failure(self) -> str | None:
        """A description of the first dead worker (its rank, process, error), or None when all are alive."""
        raise NotImplementedError

    def _worker_lost(self, fallback: str) -> None:
        """A backend's monitor saw a worker go (fallback: what to say when the worker left no report): the failure
        is recorded for the next call, and an engine-core process ends after _DEATH_GRACE_S unless it shut down
        (a rank stuck in a collective with the dead one would otherwise never return)."""
        if self._is_shutdown:
            return
        self._failure = self._worker_failure() or fallback
        logger.error("A tensor-parallel worker died: %s", self._failure)
        if multiprocessing.current_process().name.startswith("EngineCore"):
            time.sleep(_DEATH_GRACE_S)
            if not self._is_shutdown:
                logger.error("Ending the engine core: its tensor-parallel group lost a rank.")
                os._exit(1)

    def _stop_workers(self, graceful: bool) -> None:
        """Reap every worker: after the shutdown message (graceful), or at once (a rank failed: the others wait
        for a message that will not come)."""
        raise NotImplementedError

    # ---- the channel

    def _send(self, message: tuple[Any, ...]) -> None:
        if self._failure is not None:  # NOTE: set by a subclass's monitor; check_health asks the workers
            raise EngineDeadError(f"A tensor-parallel worker failed: {self._failure}")
        try:
            self._group.broadcast_object(message, src=0)
        except Exception as e:
            raise self._dead(e) from e

    def _dead(self, cause: BaseException) -> EngineDeadError:
        self._failure = self._failure or self._worker_failure() or \
            f"a collective with the tensor-parallel workers failed ({type(cause).__name__}: {cause})"
        return EngineDeadError(f"A tensor-parallel worker failed: {self._failure}")

    def check_health(self) -> None:
        if self._failure is None:
            self._failure = self._worker_failure()
        if self._failure is not None:
            raise EngineDeadError(f"A tensor-parallel worker failed: {self._failure}")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._send((_STEP, scheduler_output, False))
        return self.driver_worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        self._send((_STEP, scheduler_output, True))
        return self.driver_worker.execute_model_async(scheduler_output)

    def _call_all(self, method: str | Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                  checked: bool) -> list[Any]:
        replies = self._call_all_outcomes(method, args, kwargs, checked)
        for ok, value in replies:
            if not ok:
                raise value
        return [value for _, value in replies]

    def _call_all_outcomes(self, method: str | Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                           checked: bool) -> list[tuple[bool, Any]]:
        self._send((_CALL, method, args, kwargs, checked))
        try:
            own: tuple[bool, Any] = (True, _run_call(self.driver_worker, method, args, kwargs, checked))
        except Exception as e:
            if method in START_UP_METHODS and not checked:
                raise self._start_up_failed(method, e) from e
            own = (False, e)
        replies: list[Any] = [None] * self.world_size
        try:
            dist.gather_object(None, replies, dst=0, group=self._group.cpu_group)
        except Exception as e:
            if method in START_UP_METHODS and not checked:
                raise self._start_up_failed(method, e) from e
            raise self._dead(e) from e
        replies[0] = own
        return replies

    def _start_up_failed(self, method: str, error: Exception) -> RuntimeError:
        """The driver's start-up call failed (on its own, or because a rank that failed closed the collective
        it was in): the executor fails, and `shutdown` then kills the ranks instead of messaging them."""
        deadline = time.monotonic() + _FAILURE_REPORT_WAIT_S
        failure = self._worker_failure()
        while failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
            failure = self._worker_failure()
        self._failure = failure or f"rank 0 failed in {method} ({type(error).__name__}: {error})"
        return RuntimeError(f"Tensor-parallel start-up failed in {method}: {self._failure}")

    def run_workers(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._call_all(method, args, kwargs, False)

    def run_workers_outcomes(self, method: str, *args: Any, **kwargs: Any) -> list[tuple[bool, Any]]:
        return self._call_all_outcomes(method, args, kwargs, False)

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return self._call_all(method, tuple(args), kwargs or {}, True)

    def shutdown(self) -> None:
        if self._is_shutdown:
            return
        self._is_shutdown = True
        group = getattr(self, "_group", None)
        if group is not None and self._failure is None and self._worker_failure() is None:
            try:
                group.broadcast_object((_SHUTDOWN,), src=0)
            except Exception as e:  # NOTE: reaped below either way
                logger.warning("The shutdown message did not reach every worker: %s", e)
        self._stop_workers(graceful=self._failure is None)
        from vllm.distributed.parallel_state import destroy_distributed_environment
        global _step_group
        _step_group = None
        destroy_distributed_environment()
