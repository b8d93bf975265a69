"""From a generation route's handler to its HTTP response: the handler runs while the client is there, and a
streamed answer is an SSE response that owns its stream.

Invariants:
- A client that disconnects before its response (streaming or not) has its requests aborted in the engine: its
  handler is cancelled (`cancel_on_disconnect`), which aborts the requests behind it and frees their KV blocks.
- A stream is closed however it ends (`SSEResponse`: finished, the client gone mid-stream or before the first
  event, the server shutting down), which aborts every request of it not finished, at once.
- A handler still running when the shutdown grace is over ends as a 503 (ServerShuttingDownError,
  graceful_shutdown.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm.entrypoints.openai.graceful_shutdown import ServerDrain
from vllm.entrypoints.openai.serving_engine import ServerShuttingDownError, SSEStream

# NOTE: the server's logger name from before the split (api_server.py), so log filters keep working.
logger = logging.getLogger("vllm.entrypoints.openai.api_server")


async def _wait_for_disconnect(raw: Request) -> None:
    # NOTE: the body has been read already, so the next message is the disconnect (or nothing, until then).
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(raw: Request, handler: Awaitable[Any], drain: ServerDrain | None = None) -> Any:
    """Await `handler`; if the client goes away first, cancel it, which aborts its requests in the engine (their
    output streams abort when cancelled or closed) and frees their KV blocks. Streams return at once; a dropped
    stream is handled by the streaming response itself (SSEResponse)."""
    task = asyncio.ensure_future(handler)
    if drain is not None:  # the handler ends with a 503 if it still runs when the shutdown grace is over
        drain.track(task)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        # Cancelled ourselves (e.g. the server shutting down): the handler goes with us, and a stream it already
        # returned, which no response will close, is closed here.
        task.cancel()
        task.add_done_callback(_close_unsent_stream)
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        logger.info("Client disconnected before the response; its request was aborted.")
        return None
    if task.cancelled() and drain is not None and drain.aborted:  # the shutdown grace is over (graceful_shutdown.py)
        raise ServerShuttingDownError("The server shut down before the request finished (--shutdown-timeout).")
    return task.result()


def _close_unsent_stream(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is None and isinstance(task.result(), SSEStream):
        task.result().close_streams()


class SSEResponse(StreamingResponse):
    """A streamed response that closes its SSEStream when it ends, however it ends: a client gone mid-stream
    (the response's task is cancelled, perhaps while it waits on a send) or before the first event. That aborts
    the requests behind it at once (see SSEStream)."""

    def __init__(self, stream: SSEStream) -> None:
        super().__init__(stream.body, media_type="text/event-stream")
        self.stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # NOTE: closing suspends nowhere (OutputStream.close is synchronous), so a cancelled scope cannot
            # interrupt it.
            await self.stream.aclose()


def respond(result: Any) -> Response:
    """The response to a handler's result: a stream as SSE, a ready response as is, a model as JSON."""
    if result is None:  # the client is gone (see cancel_on_disconnect): nobody reads this
        return Response(status_code=499)
    if isinstance(result, SSEStream):
        return SSEResponse(result)
    if isinstance(result, Response):  # a response with the engine's mask texts spliced in (with_mask_texts)
        return result
    return JSONResponse(result.model_dump())
