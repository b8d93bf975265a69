"""EngineCoreClient: how a frontend talks to its engine core, in-process or in child processes over ZMQ.

- `InprocClient`: calls an EngineCore directly; `get_output()` runs one step.
- `SyncMPClient` / `AsyncMPClient`: start the core with `launch_engine_cores` (core_launch.py) in a child
  process, send requests over an ipc:// PUSH socket and read outputs from an ipc:// PULL socket (both in a
  private temp dir).
- With `vllm serve --api-server-count N`, `launch_engine_core(s)` starts the cores for N clients and gives each
  API server process an `EngineCoreHandle`; an AsyncMPClient built with it binds that client's addresses and
  talks to the shared cores (which it neither starts nor stops), tagging its requests with its `client_index`.
- With `--data-parallel-size N` there is one core per rank, one input socket per core and one output socket
  they all push to; `DPLBAsyncMPClient` (dp_client.py) spreads requests and fans utility calls out over them.

Invariants:
- The constructor returns only after every child reported READY (model loaded, KV cache allocated); a child
  that fails or dies during startup raises `RuntimeError` in the parent with the child's error text.
- After startup, any core that dies or reports a fatal error makes every later `get_output*` raise
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
import pickle
import shutil
import weakref
from collections.abc import Callable
from collections import deque
from typing import Any

import zmq
import zmq.asyncio

from vllm.config import VllmConfig
from vllm.v1.engine import Deferred, EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
from vllm.v1.engine.core_launch import (EngineCoreHandle, data_parallel_size_of, launch_engine_core,
                                        launch_engine_cores, pid_alive)
from vllm.v1.engine.core_proc import ERROR, OUTPUTS, READY, UTILITY_RESULT
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

__all__ = ["AsyncMPClient", "EngineCoreClient", "EngineCoreHandle", "EngineDeadError", "InprocClient", "MPClient",
           "SyncMPClient", "launch_engine_core", "launch_engine_cores", "make_async_client",
           "refuse_offline_data_parallel"]

# NOTE: how often a waiting client checks that the core process is still alive.
_POLL_MS = 200
STARTUP_TIMEOUT_S = 600.0


class EngineDeadError(RuntimeError):
    """The engine-core process died or failed; the frontend cannot serve requests any more."""


class EngineCoreClient:
    """Base interface; `make_client` picks the implementation."""

    @staticmethod
    def make_client(multiprocess_mode: bool, asyncio_mode: bool, vllm_config: VllmConfig) -> EngineCoreClient:
        if asyncio_mode:
            if not multiprocess_mode:
                raise ValueError("The asyncio engine-core client needs multiprocess_mode=True.")
            return make_async_client(vllm_config)
        refuse_offline_data_parallel(vllm_config)
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


def _shutdown_resources(procs: list[multiprocessing.process.BaseProcess], sockets: list[zmq.Socket],
                        ctx: zmq.Context, tmp_dir: str | None) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
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
    """Starts the core processes (`launch_engine_cores`: one per data-parallel rank) or joins shared ones
    (`handle`), and owns the sockets: one input socket per engine core, one output socket that all of them push
    to; subclasses add sync or asyncio I/O. Without data parallel everything goes to engine 0."""

    def __init__(self, vllm_config: VllmConfig, asyncio_mode: bool,
                 engine_core_factory: Callable[[VllmConfig], Any] | None = None,
                 start_method: str = "spawn", handle: EngineCoreHandle | None = None) -> None:
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.tmp_dir: str | None = None
        if handle is None:
            self.procs, handles, self.tmp_dir = launch_engine_cores(vllm_config, 1, engine_core_factory,
                                                                    start_method)
            handle = handles[0]
        self.handle = handle
        self.client_index = handle.client_index
        self.ctx: zmq.Context = zmq.asyncio.Context() if asyncio_mode else zmq.Context()
        self.input_sockets: list[zmq.Socket] = []
        for address in handle.input_addresses:
            socket = self.ctx.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.bind(address)
            self.input_sockets.append(socket)
        self.input_socket = self.input_sockets[0]
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.bind(handle.output_address)
        self.encoder = MsgpackEncoder()
        self.outputs_decoder = MsgpackDecoder(EngineCoreOutputs)
        self.generic_decoder = MsgpackDecoder()
        self.dead_error: EngineDeadError | None = None
        self._call_ids = itertools.count()
        # Utility results that arrived: call id -> (ok, value); the async client resolves futures instead.
        self._results: dict[int, tuple[bool, Any]] = {}
        self._finalizer = weakref.finalize(self, _shutdown_resources, self.procs,
                                           [*self.input_sockets, self.output_socket], self.ctx, self.tmp_dir)
        try:
            # One READY payload per engine core, in rank order; ready_info is engine 0's.
            self.engines_ready_info = self._wait_for_ready()
        except BaseException:
            self.shutdown()
            raise
        self.ready_info = self.engines_ready_info[0]

    @property
    def proc(self) -> multiprocessing.process.BaseProcess | None:
        """Engine 0's process when this client started it."""
        return self.procs[0] if self.procs else None

    @property
    def data_parallel_size(self) -> int:
        return len(self.input_sockets)

    def engine_index_of(self, request_id: str) -> int:
        """The engine core (data-parallel rank) a request went to: 0 without data parallel."""
        return 0

    def _wait_for_ready(self) -> list[dict[str, Any]]:
        # NOTE: a plain (sync) socket is needed for the handshake even in asyncio mode.
        sync_socket = zmq.Socket.shadow(self.output_socket.underlying)
        poller = zmq.Poller()
        poller.register(sync_socket, zmq.POLLIN)
        ready: dict[int, dict[str, Any]] = {}
        waited_ms = 0
        while len(ready) < self.data_parallel_size:
            if not poller.poll(_POLL_MS):
                waited_ms += _POLL_MS
                if not self._core_alive():
                    raise RuntimeError(f"Engine core process exited with code {self._core_exitcode()} during "
                                       "startup; see its log above for the reason.")
                if waited_ms > STARTUP_TIMEOUT_S * 1000:
                    raise RuntimeError(f"Engine core did not start within {STARTUP_TIMEOUT_S:.0f} s.")
                continue
            kind, payload = sync_socket.recv_multipart()
            if kind == ERROR:
                raise RuntimeError(f"Engine core failed to start: {self.generic_decoder.decode(payload)}")
            if kind != READY:
                raise RuntimeError(f"Unexpected first message from the engine core: {kind!r}.")
            info = dict(self.generic_decoder.decode(payload))
            ready[int(info.get("engine_index", 0))] = info
        return [ready[e] for e in range(self.data_parallel_size)]

    def _dead_engine(self) -> int | None:
        """The rank of an engine core whose process is gone, or None."""
        for e, pid in enumerate(self.handle.core_pids):
            if self.procs:
                if not self.procs[e].is_alive():
                    return e
            elif not pid_alive(pid):
                return e
        return None

    def _core_alive(self) -> bool:
        return self._dead_engine() is None

    def _core_exitcode(self) -> int | str | None:
        e = self._dead_engine()
        if e is None:
            return None
        code = self.procs[e].exitcode if self.procs else "unknown (a shared core)"
        return code if self.data_parallel_size == 1 else f"{code}, data-parallel rank {e}"

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
        return await self.call_engine_async(0, method, args, kwargs)

    async def call_engine_async(self, engine: int, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """A utility call to one engine core (its data-parallel rank)."""
        self._check_alive()
        call_id = next(self._call_ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            await self.input_sockets[engine].send_multipart(self._utility_frames(call_id, method, args, kwargs))
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


def make_async_client(vllm_config: VllmConfig, handle: EngineCoreHandle | None = None) -> AsyncMPClient:
    """The asyncio client of AsyncLLM: over several engine cores (DPLBAsyncMPClient) with data parallel."""
    num_engines = handle.data_parallel_size if handle is not None else data_parallel_size_of(vllm_config)
    if num_engines > 1:
        from vllm.v1.engine.dp_client import DPLBAsyncMPClient
        return DPLBAsyncMPClient(vllm_config, handle=handle)
    return AsyncMPClient(vllm_config, handle=handle)


def refuse_offline_data_parallel(vllm_config: VllmConfig | None) -> None:
    """LLM / LLMEngine drive one engine core: data_parallel_size > 1 is refused by name (vLLM's offline data
    parallel is one process per rank, each with its own LLM on its share of the prompts: do that here too)."""
    num_engines = data_parallel_size_of(vllm_config)
    if num_engines > 1:
        raise ValueError(
            f"data_parallel_size={num_engines} is not supported by the offline engine (LLM, LLMEngine): it drives "
            "one engine core. Serve with `vllm serve --data-parallel-size N` (or AsyncLLM), or run one process per "
            "rank, each with its own LLM (data_parallel_size=1, CUDA_VISIBLE_DEVICES set to that rank's GPUs) on "
            "its share of the prompts, as vLLM's offline data-parallel example does.")
