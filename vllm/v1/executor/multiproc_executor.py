"""MultiprocExecutor ("mp"): rank 0 in the engine core's process, ranks 1..N-1 spawned processes on this node.

Each spawned worker builds its worker (cuda:rank, or the CPU over gloo), joins the world at tcp://127.0.0.1:port
and runs the step loop (vllm/v1/executor/distributed.py) until the driver says shutdown.

Invariants:
- A worker that fails sends its error text on its pipe before it exits: the EngineDeadError of the driver's next
  call names it, and so does the monitor's log line when it ends the process first.
- A monitor thread waits on every worker's sentinel. A worker that dies (not at shutdown) makes the executor fail:
  the next call raises EngineDeadError, and a collective in progress fails at once on gloo. In an engine core's
  own process the monitor also ends the process after a short grace (a collective on NCCL could wait for the
  dead rank for good), which the frontend sees as EngineDeadError.
- A worker ends when its driver's process ends (it watches the parent's pid), so no worker outlives its engine;
  `shutdown` joins them and kills those that do not stop.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import select
import threading
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

from vllm.config import VllmConfig
from vllm.utils import get_open_port
from vllm.v1.executor.distributed import DistributedExecutorBase, run_worker_loop

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 10.0


class MultiprocExecutor(DistributedExecutorBase):
    def _start_workers(self) -> str:
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        ctx = multiprocessing.get_context("spawn")
        self.workers: list[multiprocessing.process.BaseProcess] = []
        self._error_pipes: list[Connection] = []
        self._errors: dict[int, str] = {}
        for rank in range(1, self.world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker_main, name=f"VllmWorker-{rank}", daemon=True,
                               args=(self.vllm_config, rank, init_method, os.getpid(), writer))
            with _children_allowed():
                proc.start()
            writer.close()
            self.workers.append(proc)
            self._error_pipes.append(reader)
        self._monitor = threading.Thread(target=self._monitor_workers, name="VllmWorkerMonitor", daemon=True)
        self._monitor.start()
        return init_method

    def _worker_failure(self) -> str | None:
        for rank, proc in enumerate(self.workers, start=1):
            if proc.exitcode is not None:
                error = self._read_error(rank)
                return (f"worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
                        + (f": {error}" if error else ""))
        return None

    def _read_error(self, rank: int) -> str | None:
        pipe = self._error_pipes[rank - 1]
        try:
            if rank not in self._errors and pipe.poll():
                self._errors[rank] = str(pipe.recv())
        except (EOFError, OSError):
            pass
        return self._errors.get(rank)

    def _monitor_workers(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.workers, start=1)}
        ready = wait(list(sentinels))
        self._worker_lost(f"worker rank {sentinels[ready[0]]} died")  # type: ignore[index]

    def _stop_workers(self, graceful: bool) -> None:
        deadline = time.monotonic() + (_JOIN_TIMEOUT_S if graceful else 0.0)
        for proc in self.workers:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.workers:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for pipe in self._error_pipes:
            pipe.close()


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """Let a daemonic process (the engine core is one) start the workers.
    NOTE: multiprocessing refuses children to daemons because a daemon is killed without reaping them; these
    workers end by themselves when their parent is gone (`_watch_parent`), so none is left behind."""
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    daemon = config.pop("daemon", None)
    try:
        yield
    finally:
        if daemon is not None:
            config["daemon"] = daemon


def _watch_parent(parent_pid: int) -> None:
    """End this worker as soon as the driver's process is gone (a pidfd where there is one, else polling)."""
    def wait_then_exit() -> None:
        try:
            fd = os.pidfd_open(parent_pid)
        except (AttributeError, OSError):
            fd = None
        if fd is not None and os.getppid() == parent_pid:
            select.select([fd], [], [])
        else:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=wait_then_exit, name="VllmWorkerParentWatch", daemon=True).start()


def _worker_main(vllm_config: VllmConfig, rank: int, init_method: str, parent_pid: int, errors: Any) -> None:
    """A spawned worker process: build the worker of `rank`, then run the driver's messages."""
    _watch_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s [rank {rank}] %(name)s: %(message)s")
    from vllm.v1.worker.worker import make_worker
    try:
        worker = make_worker(vllm_config, rank, rank, init_method)
        run_worker_loop(worker)
    except BaseException as e:
        logger.error("Tensor-parallel worker rank %d failed:\n%s", rank, traceback.format_exc())
        try:
            errors.send(f"{type(e).__name__}: {e}")
        except OSError:
            pass
        os._exit(1)
    from vllm.distributed.parallel_state import destroy_distributed_environment
    destroy_distributed_environment()
