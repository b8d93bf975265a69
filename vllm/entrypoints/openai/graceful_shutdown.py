"""Graceful shutdown of one API server: on SIGTERM / SIGINT it stops accepting, lets the running requests finish
for `--shutdown-timeout` seconds, then ends the rest with an OpenAI error.

Invariants:
- From the signal on, the listening socket is closed (uvicorn) and a new request on a kept-alive connection gets a
  503 (RequestGuard, request_limits.py).
- After the grace, every request still running ends with an error and its engine requests are aborted: a
  non-streamed one gets a 503 OpenAI error body, a streamed one an error event then `data: [DONE]`. uvicorn's own
  cancel (its timeout_graceful_shutdown, which would give a plain-text 500 and cut streams) comes FLUSH_S later,
  once those errors are written.
- With nothing running the server exits at once, without waiting for the grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

import uvicorn

from vllm.entrypoints.openai.serving_engine import ServerShuttingDownError
from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger("vllm.entrypoints.openai.api_server")

DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
# Time left after the grace for the error responses and events to be written.
FLUSH_S = 5.0


class ServerDrain:
    """The server's shutdown state, shared by the guard middleware, the handlers and GracefulServer."""

    __slots__ = ("draining", "aborted", "handlers")

    def __init__(self) -> None:
        self.draining = False  # the signal came: new requests get 503
        self.aborted = False  # the grace is over: running requests end with ServerShuttingDownError
        self.handlers: set[asyncio.Task[Any]] = set()  # non-streamed handlers not done yet

    def track(self, task: asyncio.Task[Any]) -> None:
        self.handlers.add(task)
        task.add_done_callback(self.handlers.discard)


class GracefulServer(uvicorn.Server):
    """uvicorn's server whose shutdown ends the requests still running after `grace_s` (module docstring)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, drain: ServerDrain, grace_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain = drain
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.drain.draining = True
        ender = asyncio.create_task(self._end_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()

    async def _end_after_grace(self) -> None:
        await asyncio.sleep(self.grace_s)
        self.drain.aborted = True
        error = ServerShuttingDownError(f"The server shut down before the request finished (it had "
                                        f"{self.grace_s:g} s after the signal, --shutdown-timeout).")
        logger.warning("Shutdown grace of %g s over: ending %d running request(s) with an error.", self.grace_s,
                       len(self.engine.output_processor.request_states) + len(self.drain.handlers))
        for task in list(self.drain.handlers):
            task.cancel()
        # NOTE: the streams (and handlers waiting on outputs) get the error through their output queues.
        self.engine._fail_all(error)
        if not self.engine.errored:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.engine.abort_requests(), FLUSH_S / 2)
