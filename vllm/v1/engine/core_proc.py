"""The engine-core process: an EngineCore driven by a busy loop over ZMQ sockets.

It serves one or more frontends ("clients": API server processes with --api-server-count N; client i owns the
i-th input and output address). Frames from a frontend (its PUSH -> our PULL, fair-queued over all clients):
`[EngineCoreRequestType.value, payload]` with payload an encoded EngineCoreRequest (ADD), `(client index, list of
request ids)` (ABORT), or for UTILITY `(client index, call id)` and a third frame, the pickled `(method, args,
kwargs)` (one of EngineCore.UTILITY_METHODS, or "shutdown"). Frames to a frontend (our PUSH -> its PULL):
`[kind, payload, ...]` with kind one of:
- `READY`: sent once to every client after the model loaded and the KV cache was allocated; payload
  `{"num_gpu_blocks": n, "pid": pid, "engine_index": data-parallel rank}`;
- `OUTPUTS`: an encoded EngineCoreOutputs, its large arrays (sampling masks) in frames of their own after it
  (MsgpackEncoder.encode_frames);
- `ERROR`: a fatal error (at startup or in a step) as text, to every client; the process exits non-zero;
- `UTILITY_RESULT`: `(call id, ok, text)` and the pickled value, to the calling client only: the method's result,
  or (ok False) the exception it raised (a ValueError stays a ValueError); `text` describes it for a client that
  cannot unpickle it. A call's failure never stops the core (unless a step it drained failed: EngineStepError),
  and a call that cannot be unpickled here is answered with its error.

With data parallel (docs/parallelism.md) there is one such process per rank: each pulls from its own input
address of every client and pushes to every client's one output address, which all ranks share; every OUTPUTS
message carries the sender's rank (`EngineCoreOutputs.engine_index`).

Invariants:
- Every input that is waiting is handled before the next step, so an ABORT frees its KV blocks before the
  blocks are used again; after an abort that left the core idle, one stats-only output reports the new KV usage.
- A step's outputs are sent as soon as `step()` returns them, their deferred mask lists built first.
- With several clients, each request's outputs go to the client named by its `client_index` and only there;
  scheduler stats go to every client. An ADD whose request id is already running (two API servers given the
  same id) is refused with an ABORT-finished output to its own client; the running request is untouched, also
  by an ABORT of that id from the refused client (a client aborts only its own requests).
- A utility call runs between steps. Its result is sent after every output of the steps before it (the steps
  it drained, the aborts of a pause: EngineCore.pending_outputs); a result that is a `Deferred` (pause) once
  ready, checked after every step.
- The loop ends when the parent process is gone (a watcher thread turns its exit into SIGTERM at once, whatever
  the loop is doing; the core then removes the sockets' folder the parent left), on SIGTERM/SIGINT, or on
  SHUTDOWN.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from vllm.config import VllmConfig
from vllm.v1.engine import (Deferred, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType,
                             EngineStepError, FinishReason)
from vllm.v1.serving_gc import freeze_startup_heap
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

READY = b"R"
OUTPUTS = b"O"
ERROR = b"E"
UTILITY_RESULT = b"U"
# NOTE: how long an idle core waits for input before checking that its parent is still alive.
_IDLE_POLL_MS = 1000


class EngineCoreProc:
    """Owns the sockets and the loop; `engine_core` is anything with EngineCore's four methods (add_request,
    abort_requests, has_unfinished_requests, step)."""

    # Utility calls whose result is not ready yet: (client, call id, Deferred); replaced, never mutated in place.
    deferred_calls: tuple[tuple[int, int, Deferred], ...] = ()
    # This core's data-parallel rank, stamped on every OUTPUTS message.
    engine_index: int = 0

    def __init__(self, engine_core: Any, input_addresses: list[str], output_addresses: list[str],
                 parent_pid: int, engine_index: int = 0) -> None:
        self.engine_core = engine_core
        self.engine_index = engine_index
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PULL)
        for address in input_addresses:
            self.input_socket.connect(address)
        self.output_sockets = [_connect_push(self.ctx, address) for address in output_addresses]
        # Several clients only: request id -> the client its outputs go to (dropped when it finishes), and the
        # same for requests aborted but not yet reported finished.
        self.client_of: dict[str, int] = {}
        self.aborted_client: dict[str, int] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.input_socket, zmq.POLLIN)
        self.encoder = MsgpackEncoder()
        self.request_decoder = MsgpackDecoder(EngineCoreRequest)
        self.generic_decoder = MsgpackDecoder()
        self.should_stop = False

    def send(self, kind: bytes, payload: Any, client: int = 0) -> None:
        if kind == OUTPUTS:
            payload.engine_index = self.engine_index
        # NOTE: zero-copy frames; sending them copied measured no gain on the H200 (docs/benchmarks.md history).
        self.output_sockets[client].send_multipart((kind, *self.encoder.encode_frames(payload)), copy=False)

    def broadcast(self, kind: bytes, payload: Any) -> None:
        if kind == OUTPUTS:
            payload.engine_index = self.engine_index
        frames = (kind, *self.encoder.encode_frames(payload))
        for socket in self.output_sockets:
            socket.send_multipart(frames, copy=False)

    def send_outputs(self, outputs: EngineCoreOutputs) -> None:
        """One step's outputs: as they are with one client, else split by each request's client."""
        if len(self.output_sockets) == 1:
            self.send(OUTPUTS, outputs)
            return
        groups: list[list[EngineCoreOutput]] = [[] for _ in self.output_sockets]
        out_client = []  # per output: its client, and its index in that client's group
        out_slot = []
        for output in outputs.outputs:
            client = self._owner(output.request_id, output.finished)
            out_client.append(client)
            out_slot.append(len(groups[client]))
            groups[client].append(output)
        finished: list[set[str]] = [set() for _ in self.output_sockets]
        for req_id in outputs.finished_requests or ():
            finished[self._owner(req_id, True)].add(req_id)
        # Each client's share of the step-level rows, renumbered to its own outputs.
        out_client_np, out_slot_np = np.array(out_client, dtype=np.int64), np.array(out_slot, dtype=np.int64)
        shares: list[dict[str, Any]] = [{} for _ in self.output_sockets]
        split: tuple[Any, ...] | None = None
        for name in ("step_logprobs", "step_masks"):
            step_rows = getattr(outputs, name)
            if step_rows is None:
                continue
            # NOTE: the masks' rows are mostly the logprobs' (every output that wants either): split once then.
            if split is None or not np.array_equal(split[0], step_rows.out_index):
                split = (step_rows.out_index, *_split_by_client(out_client_np[step_rows.out_index],
                                                                len(shares)), out_slot_np[step_rows.out_index])
            _, order, bounds, row_slot = split
            # NOTE: the masks' texts of a decode step in one pass (StepMasks.text_shares), else per client.
            text_shares = step_rows.text_shares(order, bounds, row_slot) if name == "step_masks" else None
            for client, share in enumerate(shares):
                s, e = bounds[client], bounds[client + 1]
                if s < e:
                    share[name] = text_shares[client] if text_shares is not None else \
                        step_rows.select(order[s:e], row_slot[order[s:e]])
        for client, group in enumerate(groups):
            if group or finished[client] or outputs.scheduler_stats is not None or outputs.sleeping is not None:
                self.send(OUTPUTS, EngineCoreOutputs(outputs=group, scheduler_stats=outputs.scheduler_stats,
                                                     finished_requests=finished[client] or None,
                                                     weight_version=outputs.weight_version,
                                                     sleeping=outputs.sleeping, **shares[client]), client)

    def _owner(self, req_id: str, done: bool) -> int:
        """The client of `req_id`'s outputs; forgotten once `done`."""
        client = self.client_of.get(req_id)
        if client is None:
            client = self.aborted_client.get(req_id, 0)
        if done:
            self.client_of.pop(req_id, None)
            self.aborted_client.pop(req_id, None)
        return client

    def _handle_input(self, frames: list[bytes]) -> bool:
        """Apply one input message; True when it was an abort (KV usage may have changed)."""
        request_type, payload = EngineCoreRequestType(frames[0]), frames[1]
        if request_type == EngineCoreRequestType.ADD:
            request: EngineCoreRequest = self.request_decoder.decode(payload)
            if len(self.output_sockets) > 1:
                if request.request_id in self.client_of:
                    logger.warning("Request id %r is already running (another API server); the new request is "
                                   "aborted.", request.request_id)
                    refused = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT)
                    self.send(OUTPUTS, EngineCoreOutputs(outputs=[refused]), request.client_index)
                    return False
                self.client_of[request.request_id] = request.client_index
            self.engine_core.add_request(request)
            return False
        if request_type == EngineCoreRequestType.ABORT:
            sender, request_ids = self.generic_decoder.decode(payload)
            if len(self.output_sockets) > 1:
                # NOTE: only the sender's own requests: an id it was refused may be running for another client.
                request_ids = [r for r in request_ids if self.client_of.get(r) == sender]
                for req_id in request_ids:
                    self.aborted_client[req_id] = self.client_of.pop(req_id)
            self.engine_core.abort_requests(list(request_ids))
            return True
        try:
            client, call_id = self.generic_decoder.decode(payload)
        except Exception:
            logger.warning("A malformed engine-core utility call was dropped.")
            return False
        was_sleeping = self._sleeping()
        try:
            method, args, kwargs = pickle.loads(frames[2])
            if method == "shutdown":
                self.should_stop = True
                return False
            if method not in getattr(self.engine_core, "UTILITY_METHODS", ()):
                raise ValueError(f"Unknown engine-core utility call {method!r}.")
            result = getattr(self.engine_core, method)(*args, **kwargs)
        except EngineStepError:
            raise
        except Exception as e:  # NOTE: a failed call is its caller's error, never the core's
            logger.warning("Engine-core utility call failed: %s: %s", type(e).__name__, e)
            result = _failed(e)
        if len(self.output_sockets) > 1 and self._sleeping() != was_sleeping:
            # NOTE: sleep mode's news to every API server (sleep_mode.py), before the call's result.
            self.engine_core.pending_outputs.append(EngineCoreOutputs(sleeping=not was_sleeping))
        # NOTE: every result waits in deferred_calls (answered by the loop after the outputs before it).
        if not isinstance(result, Deferred):
            result = _done(result)
        self.deferred_calls = (*self.deferred_calls, (client, call_id, result))
        return True

    def _sleeping(self) -> bool:
        is_sleeping = getattr(self.engine_core, "is_sleeping", None)
        return bool(is_sleeping()) if is_sleeping is not None else False

    def _send_result(self, client: int, call_id: int, deferred: Deferred) -> None:
        # NOTE: the outputs the call produced go first, so the caller has them when its result arrives.
        self._send_pending()
        try:
            ok, value = True, deferred.result()
        except Exception as e:
            ok, value = False, e
        text = "" if ok else f"{type(value).__name__}: {value}"
        try:
            body = pickle.dumps(value)
        except Exception as e:  # an unpicklable result or exception: its text
            ok, body = False, pickle.dumps(RuntimeError(f"{type(value).__name__}: {value} (not picklable: {e})"))
        self.output_sockets[client].send_multipart((UTILITY_RESULT, self.encoder.encode((call_id, ok, text)), body),
                                                   copy=False)

    def _send_pending(self) -> None:
        pending = getattr(self.engine_core, "pending_outputs", None)
        while pending:
            outputs = pending.popleft()
            outputs.resolve_step_rows()
            self.send_outputs(outputs)

    def _poll_deferred(self) -> None:
        waiting = []
        for client, call_id, deferred in self.deferred_calls:
            if deferred.ready():
                self._send_result(client, call_id, deferred)
            else:
                waiting.append((client, call_id, deferred))
        self.deferred_calls = tuple(waiting)

    def _process_inputs(self, block: bool) -> bool:
        aborted = False
        if block:
            while not self.poller.poll(_IDLE_POLL_MS):
                if os.getppid() != self.parent_pid:
                    self.should_stop = True
                    return False
        while True:
            try:
                frames = self.input_socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return aborted
            aborted |= self._handle_input(frames)

    def run_busy_loop(self) -> None:
        while not self.should_stop:
            idle = not self.engine_core.has_unfinished_requests()
            aborted = self._process_inputs(block=idle)
            if self.should_stop:
                break
            if getattr(self.engine_core, "pending_outputs", None):
                # NOTE: a utility call drained steps or aborted requests: their outputs before the next step's.
                self._send_pending()
            if self.engine_core.has_unfinished_requests():
                self._send_step(self.engine_core.step())
            elif aborted:
                self.broadcast(OUTPUTS, EngineCoreOutputs(scheduler_stats=self._stats()))
            if self.deferred_calls and any(d.ready() for _, _, d in self.deferred_calls):
                self._poll_deferred()

    def _send_step(self, outputs: EngineCoreOutputs) -> None:
        # NOTE: sent at once, not kept through the next step: its masks may be views of a lending staging slot
        # (vllm/v1/worker/async_output.py) that the next step could otherwise take.
        outputs.resolve_step_rows()  # the step's deferred mask lists built now
        self.send_outputs(outputs)

    def _stats(self) -> Any:
        scheduler = getattr(self.engine_core, "scheduler", None)
        return scheduler.make_stats() if scheduler is not None else None

    def close(self) -> None:
        self.input_socket.close(linger=0)
        for socket in self.output_sockets:
            socket.close(linger=2000)
        self.ctx.term()


def _split_by_client(row_client: np.ndarray, num_clients: int) -> tuple[np.ndarray, list[int]]:
    """(order, bounds): the rows sorted by client, stably, and client c's rows order[bounds[c]:bounds[c + 1]]
    (ascending), in a few numpy calls per step rather than two per client."""
    order = np.argsort(row_client, kind="stable")
    return order, [0, *np.cumsum(np.bincount(row_client, minlength=num_clients)).tolist()]


def _connect_push(ctx: zmq.Context, address: str) -> zmq.Socket:
    socket = ctx.socket(zmq.PUSH)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.connect(address)
    return socket


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def run_engine_core(vllm_config: VllmConfig, input_address: str | list[str], output_address: str | list[str],
                    parent_pid: int, engine_core_factory: Callable[[VllmConfig], Any] | None = None,
                    engine_index: int = 0) -> None:
    """Entry point of the engine-core process (multiprocessing target); a list of addresses per side (same
    length) serves several clients, client i on the i-th pair. engine_index: this core's data-parallel rank."""
    input_addresses = [input_address] if isinstance(input_address, str) else list(input_address)
    output_addresses = [output_address] if isinstance(output_address, str) else list(output_address)
    signal.signal(signal.SIGTERM, _raise_system_exit)
    signal.signal(signal.SIGINT, _raise_system_exit)
    _watch_parent(parent_pid)
    # NOTE: a spawned process starts without the parent's logging set-up (a no-op when it has one).
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    proc: EngineCoreProc | None = None
    ctx = zmq.Context()
    exit_code = 0
    try:
        try:
            # NOTE: with several ranks the driver worker joins the engine's own world instead (vllm/v1/executor/).
            if getattr(getattr(vllm_config, "parallel_config", None), "world_size", 1) == 1:
                _init_default_process_group()
            if engine_core_factory is None:
                from vllm.v1.engine.core import EngineCore
                engine_core_factory = EngineCore
            engine_core = engine_core_factory(vllm_config)
        except Exception as e:
            _report_startup_error(ctx, output_addresses, e)
            exit_code = 1
            return
        proc = EngineCoreProc(engine_core, input_addresses, output_addresses, parent_pid, engine_index)
        # NOTE: the start-up objects (model, graphs, buffers) move to a permanent generation, so the cyclic GC's
        # full collections during serving do not walk them again (each one would stall a step); then the serving
        # thresholds: on Python's defaults a full collection ran every ~0.5 s at ~1000 rows (vllm/v1/serving_gc.py).
        freeze_startup_heap()
        proc.broadcast(READY, {"num_gpu_blocks": int(getattr(engine_core, "num_gpu_blocks", 0) or 0),
                               "pid": os.getpid(), "engine_index": engine_index})
        proc.run_busy_loop()
    except SystemExit:
        pass
    except Exception:
        exit_code = 1
        logger.exception("Engine core failed.")
        if proc is not None:
            proc.broadcast(ERROR, f"Engine core failed:\n{traceback.format_exc()}")
    finally:
        if proc is not None:
            proc.close()
            _shutdown_engine_core(proc.engine_core)
        ctx.term()
        if os.getppid() != parent_pid:
            # NOTE: the parent died (killed) without removing the sockets' folder: this process does.
            _remove_socket_dirs(input_addresses + output_addresses)
        if exit_code:
            os._exit(exit_code)


def _init_default_process_group() -> None:
    """A default torch.distributed group of one rank (gloo, an in-memory store), as vLLM's workers have one: RL
    worker extensions check it and read their rank from it. Only here, in the engine's own process: an engine in
    the caller's process leaves the caller's torch.distributed alone."""
    import torch.distributed as dist
    if dist.is_available() and not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _shutdown_engine_core(engine_core: Any) -> None:
    """Stop the engine core's workers (their processes with tensor parallelism); a failure is only logged."""
    try:
        shutdown = getattr(engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()
    except Exception:
        logger.exception("The engine core's shutdown failed.")


def _done(value: Any) -> Deferred:
    return Deferred(lambda: True, lambda: value)


def _failed(error: Exception) -> Deferred:
    def fail() -> Any:
        raise error
    return Deferred(lambda: True, fail)


# NOTE: long enough for a clean stop (the loop's cleanup, the workers' shutdown), short enough that a core stuck
# in a collective does not hold its devices long after its parent is gone.
_PARENT_EXIT_GRACE_S = 10.0


def _watch_parent(parent_pid: int) -> None:
    """SIGTERM to this process (SystemExit in its main thread, then its cleanup) as soon as the parent process
    dies, whatever the loop is doing (a step, a weight transfer): a daemon thread waits on a pidfd of the parent
    (on Linux; elsewhere it checks the parent pid twice a second). Not PR_SET_PDEATHSIG: that fires when the
    parent's *thread* that started this process ends, which an engine built in a short-lived thread would hit.
    SIGTERM acts only between the main thread's bytecodes: a main thread stuck in a collective (a tensor-parallel
    rank that will not answer) never sees it, so the process ends by os._exit(1) after `_PARENT_EXIT_GRACE_S`
    (its workers watch this process and end with it)."""
    def wait_then_stop() -> None:
        try:
            fd = os.pidfd_open(parent_pid)
        except (AttributeError, OSError):
            fd = None
        if fd is not None and os.getppid() == parent_pid:
            select.select([fd], [], [])  # readable once the parent has exited
        else:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
        logger.warning("The parent process (pid %d) is gone: the engine core stops.", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(_PARENT_EXIT_GRACE_S)
        logger.error("The engine core did not stop within %.0f s of its parent's exit: ending it.",
                     _PARENT_EXIT_GRACE_S)
        os._exit(1)

    threading.Thread(target=wait_then_stop, name="EngineCoreParentWatch", daemon=True).start()


def _remove_socket_dirs(addresses: list[str]) -> None:
    """The temp folders of the ipc:// addresses (the launcher's vllm-core-*), when the launcher could not."""
    for folder in {os.path.dirname(a.removeprefix("ipc://")) for a in addresses if a.startswith("ipc://")}:
        if os.path.basename(folder).startswith("vllm-core-"):
            shutil.rmtree(folder, ignore_errors=True)


def _report_startup_error(ctx: zmq.Context, output_addresses: list[str], error: Exception) -> None:
    message = MsgpackEncoder().encode(f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
    for address in output_addresses:
        socket = _connect_push(ctx, address)
        socket.send_multipart((ERROR, message))
        socket.close(linger=5000)
