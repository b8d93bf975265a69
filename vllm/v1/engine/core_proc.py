"""The engine-core process: an EngineCore driven by a busy loop over ZMQ sockets.

Frames from the frontend (PUSH -> our PULL): `[EngineCoreRequestType.value, payload]` with payload an encoded
EngineCoreRequest (ADD), a list of request ids (ABORT) or `(method, args)` (UTILITY). Frames to the frontend
(our PUSH -> its PULL): `[kind, payload]` with kind one of:
- `READY`: sent once after the model loaded and the KV cache was allocated; payload `{"num_gpu_blocks": n}`;
- `OUTPUTS`: an encoded EngineCoreOutputs;
- `ERROR`: a fatal error (at startup or in a step) as text; the process exits non-zero right after.

Invariants:
- Every input that is waiting is handled before the next step, so an ABORT frees its KV blocks before the
  blocks are used again; after an abort that left the core idle, one stats-only output reports the new KV usage.
- The loop ends when the parent process is gone (checked while idle), on SIGTERM/SIGINT, or on SHUTDOWN.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from vllm.config import VllmConfig
from vllm.profiling import maybe_cprofile
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

READY = b"R"
OUTPUTS = b"O"
ERROR = b"E"
# NOTE: how long an idle core waits for input before checking that its parent is still alive.
_IDLE_POLL_MS = 1000


class EngineCoreProc:
    """Owns the sockets and the loop; `engine_core` is anything with EngineCore's four methods."""

    def __init__(self, engine_core: Any, input_address: str, output_address: str, parent_pid: int) -> None:
        self.engine_core = engine_core
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PULL)
        self.input_socket.connect(input_address)
        self.output_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket.setsockopt(zmq.SNDHWM, 0)
        self.output_socket.connect(output_address)
        self.poller = zmq.Poller()
        self.poller.register(self.input_socket, zmq.POLLIN)
        self.encoder = MsgpackEncoder()
        self.request_decoder = MsgpackDecoder(EngineCoreRequest)
        self.generic_decoder = MsgpackDecoder()
        self.should_stop = False

    def send(self, kind: bytes, payload: Any) -> None:
        self.output_socket.send_multipart((kind, self.encoder.encode(payload)), copy=False)

    def _handle_input(self, frames: list[bytes]) -> bool:
        """Apply one input message; True when it was an abort (KV usage may have changed)."""
        request_type, payload = EngineCoreRequestType(frames[0]), frames[1]
        if request_type == EngineCoreRequestType.ADD:
            request: EngineCoreRequest = self.request_decoder.decode(payload)
            self.engine_core.add_request(request)
            return False
        if request_type == EngineCoreRequestType.ABORT:
            self.engine_core.abort_requests(list(self.generic_decoder.decode(payload)))
            return True
        method, _args = self.generic_decoder.decode(payload)
        if method == "shutdown":
            self.should_stop = True
        else:
            logger.warning("Unknown engine-core utility call %r ignored.", method)
        return False

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
            if self.engine_core.has_unfinished_requests():
                self.send(OUTPUTS, self.engine_core.step())
            elif aborted:
                self.send(OUTPUTS, EngineCoreOutputs(scheduler_stats=self._stats()))

    def _stats(self) -> Any:
        scheduler = getattr(self.engine_core, "scheduler", None)
        return scheduler.make_stats() if scheduler is not None else None

    def close(self) -> None:
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=2000)
        self.ctx.term()


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def run_engine_core(vllm_config: VllmConfig, input_address: str, output_address: str, parent_pid: int,
                    engine_core_factory: Callable[[VllmConfig], Any] | None = None) -> None:
    """Entry point of the engine-core process (multiprocessing target)."""
    signal.signal(signal.SIGTERM, _raise_system_exit)
    signal.signal(signal.SIGINT, _raise_system_exit)
    proc: EngineCoreProc | None = None
    ctx = zmq.Context()
    exit_code = 0
    try:
        try:
            if engine_core_factory is None:
                from vllm.v1.engine.core import EngineCore
                engine_core_factory = EngineCore
            engine_core = engine_core_factory(vllm_config)
        except Exception as e:
            _report_startup_error(ctx, output_address, e)
            exit_code = 1
            return
        proc = EngineCoreProc(engine_core, input_address, output_address, parent_pid)
        proc.send(READY, {"num_gpu_blocks": int(getattr(engine_core, "num_gpu_blocks", 0) or 0),
                          "pid": os.getpid()})
        with maybe_cprofile(f"engine_core_{os.getpid()}"):
            proc.run_busy_loop()
    except SystemExit:
        pass
    except Exception:
        exit_code = 1
        logger.exception("Engine core failed.")
        if proc is not None:
            proc.send(ERROR, f"Engine core failed:\n{traceback.format_exc()}")
    finally:
        if proc is not None:
            proc.close()
        ctx.term()
        if exit_code:
            os._exit(exit_code)


def _report_startup_error(ctx: zmq.Context, output_address: str, error: Exception) -> None:
    socket = ctx.socket(zmq.PUSH)
    socket.connect(output_address)
    message = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
    socket.send_multipart((ERROR, MsgpackEncoder().encode(message)))
    socket.close(linger=5000)
