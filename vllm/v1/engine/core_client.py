"""EngineCoreClient: how a frontend talks to its engine core, in-process or in a child process over ZMQ.

- `InprocClient`: calls an EngineCore directly; `get_output()` runs one step.
- `SyncMPClient` / `AsyncMPClient`: start the core with `run_engine_core` in a child process, send requests
  over an ipc:// PUSH socket and read outputs from an ipc:// PULL socket (both in a private temp dir).
- With `vllm serve --api-server-count N`, `launch_engine_core` starts one core for N clients and gives each API
  server process an `EngineCoreHandle`; an AsyncMPClient built with it binds that client's two addresses and
  talks to the shared core (which it neither starts nor stops), tagging its requests with its `client_index`.

Invariants:
- The constructor returns only after the child reported READY (model loaded, KV cache allocated); a child that
  fails or dies during startup raises `RuntimeError` in the parent with the child's error text.
- After startup, a core that dies or reports a fatal error makes every later `get_output*` raise
  `EngineDeadError`; `is_dead` tells without blocking (the process sentinel, or for a shared core its pid, is
  checked at every poll timeout; the launcher reaps a dead core at once, so the pid disappears).
- Utility calls (`call_utility`, `call_utility_async`: EngineCore.UTILITY_METHODS by name) return the method's
  result or raise its exception. Their results arrive on the output socket among the outputs; outputs that come
  before a result are handed out before it (the sync client keeps them for the next `get_output`). In process,
  a Deferred result (pause) is waited for by stepping the core; the outputs of those steps come next.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import pickle
import shutil
import tempfile
import weakref
from collections.abc import Callable
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from vllm.config import VllmConfig
from vllm.v1.engine import Deferred, EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
from vllm.v1.engine.core_proc import ERROR, OUTPUTS, READY, UTILITY_RESULT, run_engine_core
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

# NOTE: how often a waiting client checks that the core process is still alive.
_POLL_MS = 200
STARTUP_TIMEOUT_S = 600.0


class EngineDeadError(RuntimeError):
    """The engine-core process died or failed; the frontend cannot serve requests any more."""


@dataclass(frozen=True)
class EngineCoreHandle:
    """How one frontend reaches a core started by `launch_engine_core` (picklable, for spawned API servers)."""
    input_address: str
    output_address: str
    core_pid: int
    client_index: int


def launch_engine_core(vllm_config: VllmConfig, num_clients: int,
                       engine_core_factory: Callable[[VllmConfig], Any] | None = None,
                       start_method: str = "spawn") -> tuple[multiprocessing.process.BaseProcess, list[EngineCoreHandle], str]:
    """Start one engine-core process for `num_clients` frontends -> (process, one handle per client, the temp
    dir of the ipc addresses, to remove after the core exited). The caller owns the process: it must reap it
    when it dies (`join`) and stop it at the end."""
    tmp_dir = tempfile.mkdtemp(prefix="vllm-core-")
    inputs = [f"ipc://{os.path.join(tmp_dir, f'input{i}')}" for i in range(num_clients)]
    outputs = [f"ipc://{os.path.join(tmp_dir, f'output{i}')}" for i in range(num_clients)]
    proc = multiprocessing.get_context(start_method).Process(
        target=run_engine_core, name="EngineCore", daemon=True,
        args=(vllm_config, inputs, outputs, os.getpid(), engine_core_factory))
    proc.start()
    assert proc.pid is not None
    return proc, [EngineCoreHandle(inputs[i], outputs[i], proc.pid, i) for i in range(num_clients)], tmp_dir


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # NOTE: a dead child its parent has not reaped yet is a zombie, still signalable.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class EngineCoreClient:
    """Base interface; `make_client` picks the implementation."""

    @staticmethod
    def make_client(multiprocess_mode: bool, asyncio_mode: bool, vllm_config: VllmConfig) -> EngineCoreClient:
        if asyncio_mode:
            if not multiprocess_mode:
                raise ValueError("The asyncio engine-core client needs multiprocess_mode=True.")
            return AsyncMPClient(vllm_config)
        return SyncMPClient(vllm_config) if multiprocess_mode else InprocClient(vllm_config)

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def has_unfinished_requests(self) -> bool:
        """Only the in-process client knows; over a process boundary the frontend's own state decides."""
        return False

    def call_utility(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class InprocClient(EngineCoreClient):
    def __init__(self, vllm_config: VllmConfig) -> None:
        from vllm.v1.engine.core import EngineCore
        self.engine_core = EngineCore(vllm_config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        pending = self.engine_core.pending_outputs
        if pending:  # made by a utility call: before any later step's
            outputs = pending.popleft()
        else:
            outputs = self.engine_core.step()
        outputs.materialize_step_rows()
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests() or bool(self.engine_core.pending_outputs)

    def shutdown(self) -> None:
        self.engine_core.shutdown()

    def call_utility(self, method: str, *args: Any, **kwargs: Any) -> Any:
        core = self.engine_core
        if method not in core.UTILITY_METHODS:
            raise ValueError(f"Unknown engine-core utility call {method!r}.")
        result = getattr(core, method)(*args, **kwargs)
        if isinstance(result, Deferred):
            while not result.ready():
                if not core.has_unfinished_requests():
                    # NOTE: in process, only this loop steps the engine: with no work left (a weight update in
                    # progress halts it) the call would never be ready.
                    raise ValueError(f"{method} cannot finish: {core.generation_halted() or 'nothing runs'}.")
                outputs = core.step()
                outputs.materialize_step_rows()  # NOTE: kept past later steps: nothing left on a staging slot
                core.pending_outputs.append(outputs)
            result = result.result()
        return result


def _shutdown_resources(proc: multiprocessing.process.BaseProcess | None, sockets: list[zmq.Socket],
                        ctx: zmq.Context, tmp_dir: str | None) -> None:
    if proc is not None and proc.is_alive():
        proc.terminate()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    for socket in sockets:
        socket.close(linger=0)
    ctx.term()
    if tmp_dir is not None:
        shutil.rmtree(tmp_dir, ignore_errors=True)


class MPClient(EngineCoreClient):
    """Starts the core process (or joins a shared one: `handle`) and owns the sockets; subclasses add sync or
    asyncio I/O."""

    def __init__(self, vllm_config: VllmConfig, asyncio_mode: bool,
                 engine_core_factory: Callable[[VllmConfig], Any] | None = None,
                 start_method: str = "spawn", handle: EngineCoreHandle | None = None) -> None:
        self.handle = handle
        self.client_index = handle.client_index if handle is not None else 0
        self.tmp_dir = tempfile.mkdtemp(prefix="vllm-core-") if handle is None else None
        if handle is None:
            assert self.tmp_dir is not None
            input_address = f"ipc://{os.path.join(self.tmp_dir, 'input')}"
            output_address = f"ipc://{os.path.join(self.tmp_dir, 'output')}"
        else:
            input_address, output_address = handle.input_address, handle.output_address
        self.ctx: zmq.Context = zmq.asyncio.Context() if asyncio_mode else zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.bind(input_address)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.bind(output_address)
        self.encoder = MsgpackEncoder()
        self.outputs_decoder = MsgpackDecoder(EngineCoreOutputs)
        self.generic_decoder = MsgpackDecoder()
        self.dead_error: EngineDeadError | None = None
        self._call_ids = itertools.count()
        # Utility results that arrived: call id -> (ok, value); the async client resolves futures instead.
        self._results: dict[int, tuple[bool, Any]] = {}

        self.proc: multiprocessing.process.BaseProcess | None = None
        if handle is None:
            self.proc = multiprocessing.get_context(start_method).Process(
                target=run_engine_core, name="EngineCore", daemon=True,
                args=(vllm_config, input_address, output_address, os.getpid(), engine_core_factory))
            self.proc.start()
        self._finalizer = weakref.finalize(self, _shutdown_resources, self.proc,
                                           [self.input_socket, self.output_socket], self.ctx, self.tmp_dir)
        try:
            self.ready_info = self._wait_for_ready()
        except BaseException:
            self.shutdown()
            raise

    def _wait_for_ready(self) -> dict[str, Any]:
        # NOTE: a plain (sync) socket is needed for the handshake even in asyncio mode.
        sync_socket = zmq.Socket.shadow(self.output_socket.underlying)
        poller = zmq.Poller()
        poller.register(sync_socket, zmq.POLLIN)
        waited_ms = 0
        while not poller.poll(_POLL_MS):
            waited_ms += _POLL_MS
            if not self._core_alive():
                raise RuntimeError(f"Engine core process exited with code {self._core_exitcode()} during startup; "
                                   "see its log above for the reason.")
            if waited_ms > STARTUP_TIMEOUT_S * 1000:
                raise RuntimeError(f"Engine core did not start within {STARTUP_TIMEOUT_S:.0f} s.")
        kind, payload = sync_socket.recv_multipart()
        if kind == ERROR:
            raise RuntimeError(f"Engine core failed to start: {self.generic_decoder.decode(payload)}")
        if kind != READY:
            raise RuntimeError(f"Unexpected first message from the engine core: {kind!r}.")
        return dict(self.generic_decoder.decode(payload))

    def _core_alive(self) -> bool:
        if self.proc is not None:
            return self.proc.is_alive()
        assert self.handle is not None
        return _pid_alive(self.handle.core_pid)

    def _core_exitcode(self) -> int | str | None:
        return self.proc.exitcode if self.proc is not None else "unknown (a shared core)"

    @property
    def is_dead(self) -> bool:
        if self.dead_error is None and not self._core_alive():
            self.dead_error = EngineDeadError(f"Engine core process died (exit code {self._core_exitcode()}).")
        return self.dead_error is not None

    def _check_alive(self) -> None:
        if self.is_dead:
            assert self.dead_error is not None
            raise self.dead_error

    def _decode_output(self, frames: list[zmq.Frame]) -> EngineCoreOutputs | None:
        """An OUTPUTS message (received with copy=False: its array frames are decoded without a copy); None for a
        utility result, which is recorded (`_on_result`)."""
        kind = frames[0].bytes
        if kind == OUTPUTS:
            return self.outputs_decoder.decode(frames[1].buffer, [f.buffer for f in frames[2:]])
        if kind == UTILITY_RESULT:
            call_id, ok, text = self.generic_decoder.decode(frames[1].buffer)
            try:
                value = pickle.loads(frames[2].buffer)
            except Exception as e:  # NOTE: e.g. an extension's exception class this process cannot rebuild
                ok, value = False, RuntimeError(f"The result of an engine-core call could not be read here "
                                                f"({type(e).__name__}: {e}): {text or 'a result'}")
            self._on_result(call_id, ok, value)
            return None
        if kind == ERROR:
            self.dead_error = EngineDeadError(str(self.generic_decoder.decode(frames[1].buffer)))
            raise self.dead_error
        raise RuntimeError(f"Unexpected message from the engine core: {kind!r}.")

    def _on_result(self, call_id: int, ok: bool, value: Any) -> None:
        self._results[call_id] = (ok, value)

    def _utility_frames(self, call_id: int, method: str, args: tuple, kwargs: dict[str, Any]
                        ) -> tuple[bytes, bytes, bytes]:
        try:
            payload = pickle.dumps((method, args, kwargs))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise ValueError(f"{method}: the arguments cannot be sent to the engine core process ({e}); a callable "
                             "for collective_rpc must be importable by name there (a module-level function, not a "
                             "lambda or a closure).") from None
        return (EngineCoreRequestType.UTILITY.value, self.encoder.encode((self.client_index, call_id)), payload)

    @staticmethod
    def _result_value(ok: bool, value: Any) -> Any:
        if not ok:
            raise value
        return value

    def _abort_frames(self, request_ids: list[str]) -> tuple[bytes, bytes]:
        return EngineCoreRequestType.ABORT.value, self.encoder.encode((self.client_index, list(request_ids)))

    def _add_frames(self, request: EngineCoreRequest) -> tuple[bytes, bytes]:
        request.client_index = self.client_index
        return EngineCoreRequestType.ADD.value, self.encoder.encode(request)

    def shutdown(self) -> None:
        self._finalizer()


class SyncMPClient(MPClient):
    def __init__(self, vllm_config: VllmConfig, engine_core_factory: Callable[[VllmConfig], Any] | None = None,
                 start_method: str = "spawn", handle: EngineCoreHandle | None = None) -> None:
        super().__init__(vllm_config, False, engine_core_factory, start_method, handle)
        self.poller = zmq.Poller()
        self.poller.register(self.output_socket, zmq.POLLIN)
        # Outputs that arrived while a utility call waited for its result.
        self._outputs: deque[EngineCoreOutputs] = deque()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self.input_socket.send_multipart(self._add_frames(request), copy=False)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead:
            self.input_socket.send_multipart(self._abort_frames(request_ids), copy=False)

    def get_output(self, timeout_s: float | None = None) -> EngineCoreOutputs:
        if self._outputs:
            return self._outputs.popleft()
        while True:
            outputs = self._receive(timeout_s)
            if outputs is not None:
                return outputs

    def _receive(self, timeout_s: float | None) -> EngineCoreOutputs | None:
        waited_ms = 0
        while not self.poller.poll(_POLL_MS):
            self._check_alive()
            waited_ms += _POLL_MS
            if timeout_s is not None and waited_ms >= timeout_s * 1000:
                raise TimeoutError("No engine-core output within the timeout.")
        return self._decode_output(self.output_socket.recv_multipart(copy=False))

    def call_utility(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self._check_alive()
        call_id = next(self._call_ids)
        self.input_socket.send_multipart(self._utility_frames(call_id, method, args, kwargs))
        while call_id not in self._results:
            outputs = self._receive(None)
            if outputs is not None:
                self._outputs.append(outputs)
        return self._result_value(*self._results.pop(call_id))


class AsyncMPClient(MPClient):
    def __init__(self, vllm_config: VllmConfig, engine_core_factory: Callable[[VllmConfig], Any] | None = None,
                 start_method: str = "spawn", handle: EngineCoreHandle | None = None) -> None:
        super().__init__(vllm_config, True, engine_core_factory, start_method, handle)
        # NOTE: a plain view of the output socket for non-blocking reads of what is already queued.
        self._sync_output = zmq.Socket.shadow(self.output_socket.underlying)
        # Utility calls waiting for their result (resolved by whoever reads the output socket: the output loop).
        self._calls: dict[int, asyncio.Future] = {}

    def get_output_nowait(self) -> EngineCoreOutputs | None:
        """The next queued engine-core output, or None when none has arrived yet (never waits)."""
        while True:
            try:
                frames = self._sync_output.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            outputs = self._decode_output(frames)
            if outputs is not None:
                return outputs

    def _on_result(self, call_id: int, ok: bool, value: Any) -> None:
        future = self._calls.pop(call_id, None)
        if future is not None and not future.done():
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

    async def call_utility_async(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call an engine-core utility and await its result. Someone must be reading the output socket
        (AsyncLLM's output loop, which its callers start first)."""
        self._check_alive()
        call_id = next(self._call_ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            await self.input_socket.send_multipart(self._utility_frames(call_id, method, args, kwargs))
            return await future
        finally:
            self._calls.pop(call_id, None)

    def fail_calls(self, error: BaseException) -> None:
        """The core is gone: every utility call waiting gets `error`."""
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        await self.input_socket.send_multipart(self._add_frames(request), copy=False)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead:
            await self.input_socket.send_multipart(self._abort_frames(request_ids), copy=False)

    async def get_output_async(self) -> EngineCoreOutputs:
        while True:
            while not await self.output_socket.poll(_POLL_MS):
                self._check_alive()
            outputs = self._decode_output(await self.output_socket.recv_multipart(copy=False))
            if outputs is not None:
                return outputs

    async def wait_dead(self) -> None:
        """Return once the core process has exited (for the server's watchdog)."""
        while not self.is_dead:
            await asyncio.sleep(_POLL_MS / 1000)
