"""The server's streamed response closes the engine streams behind it however it ends: each request not finished
is aborted at once, with no help from the garbage collector. In process, on a hand-driven ASGI exchange (no
engine: a recorder stands in for AsyncLLM's abort)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncGenerator
from typing import Any

from vllm.entrypoints.openai.api_server import _cancel_on_disconnect, _SSEResponse
from vllm.entrypoints.openai.serving_engine import SSEStream
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import OutputStream
from vllm.v1.engine.output_collector import RequestOutputCollector

# uvicorn's HTTP protocols declare ASGI spec 2.3: Starlette then watches receive() for the disconnect.
SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "path": "/v1/x",
         "headers": []}


class AbortRecorder:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def _abort_now(self, request_ids: list[str]) -> None:
        self.aborted += request_ids


def make_stream(engine: AbortRecorder, request_id: str) -> OutputStream:
    return OutputStream(engine, request_id, RequestOutputCollector(RequestOutputKind.DELTA))


def run_without_gc(coro: Any) -> None:
    enabled = gc.isenabled()
    gc.disable()
    try:
        asyncio.run(coro)
    finally:
        if enabled:
            gc.enable()


def output(request_id: str, token_id: int, finished: bool) -> RequestOutput:
    return RequestOutput(request_id, None, [1, 2], None, [CompletionOutput(
        0, "", [token_id], None, None, "length" if finished else None)], finished)


def test_client_gone_before_the_first_event_aborts_every_request() -> None:
    """The disconnect arrives while the response head is being sent: the chunk generator never starts (an async
    generator closed before its first step runs no cleanup), yet both requests are aborted."""
    engine = AbortRecorder()
    streams = [make_stream(engine, "a"), make_stream(engine, "b")]
    started = False

    async def chunks() -> AsyncGenerator[bytes, None]:
        nonlocal started
        started = True
        async for _ in streams[0]:
            yield b"data: x\n\n"

    async def main() -> None:
        head_sending = asyncio.Event()

        async def send(message: dict[str, Any]) -> None:
            head_sending.set()
            await asyncio.Event().wait()  # the head never goes out

        async def receive() -> dict[str, Any]:
            await head_sending.wait()
            return {"type": "http.disconnect"}

        await asyncio.wait_for(_SSEResponse(SSEStream(chunks(), streams))(SCOPE, receive, send), timeout=10)
        # NOTE: checked here, in the loop: asyncio.run's shutdown would finalise suspended generators anyway.
        assert not started
        assert sorted(engine.aborted) == ["a", "b"]
        # A closed stream ends at once and aborts nothing twice.
        assert [o async for o in streams[0]] == []
        streams[0].close()
        assert sorted(engine.aborted) == ["a", "b"]

    run_without_gc(main())


def test_client_gone_while_an_event_is_being_sent_aborts_and_closes_the_chunks() -> None:
    """The case a relaying middleware or a full socket buffer makes common: the response's task is cancelled while
    it waits inside send(), so the chunk generator is suspended at its yield, not at the engine's queue."""
    engine = AbortRecorder()
    stream = make_stream(engine, "r")
    closed: list[str] = []

    async def chunks() -> AsyncGenerator[bytes, None]:
        try:
            async for out in stream:
                yield f"data: {out.outputs[0].token_ids}\n\n".encode()
        finally:
            closed.append("chunks")

    async def main() -> None:
        stream._queue.put_nowait(output("r", 7, finished=False))
        sending = asyncio.Event()

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                assert message["body"] == b"data: [7]\n\n"
                sending.set()
                await asyncio.Event().wait()  # the peer stopped reading

        async def receive() -> dict[str, Any]:
            await sending.wait()
            return {"type": "http.disconnect"}

        await asyncio.wait_for(_SSEResponse(SSEStream(chunks(), [stream]))(SCOPE, receive, send), timeout=10)
        # NOTE: checked here, in the loop: asyncio.run's shutdown would finalise suspended generators anyway.
        assert engine.aborted == ["r"]
        assert closed == ["chunks"]

    run_without_gc(main())


def test_finished_stream_is_not_aborted() -> None:
    """A response that ran to its end (the finished output taken) aborts nothing when it closes its streams."""
    engine = AbortRecorder()
    stream = make_stream(engine, "done")

    async def chunks() -> AsyncGenerator[bytes, None]:
        async for out in stream:
            yield f"data: {out.outputs[0].token_ids}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def main() -> None:
        stream._queue.put_nowait(output("done", 3, finished=False))
        stream._queue.put_nowait(output("done", 4, finished=True))  # merged into one DELTA output
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()  # the client stays
            return {"type": "http.disconnect"}

        await asyncio.wait_for(_SSEResponse(SSEStream(chunks(), [stream]))(SCOPE, receive, send), timeout=10)
        assert [m.get("body") for m in sent[1:]] == [b"data: [3, 4]\n\n", b"data: [DONE]\n\n", b""]

    run_without_gc(main())
    assert engine.aborted == []


def test_stream_dropped_without_close_aborts_when_freed() -> None:
    """A caller that leaves `async for` early and drops the stream unclosed still aborts its request (in the loop,
    once the stream is freed), as a dropped async generator would; a finished stream dropped aborts nothing."""
    engine = AbortRecorder()

    async def main() -> None:
        left = make_stream(engine, "left")
        done = make_stream(engine, "done")
        left._queue.put_nowait(output("left", 5, finished=False))
        done._queue.put_nowait(output("done", 6, finished=True))
        async for _ in left:
            break
        assert [o.finished async for o in done] == [True]
        del left, done
        await asyncio.sleep(0)
        assert engine.aborted == ["left"]

    run_without_gc(main())


def test_handler_is_cancelled_with_the_request_task() -> None:
    """The request's own task cancelled (the server shutting down) while a non-streamed handler waits for its
    output: the handler is cancelled too, which aborts its request; a stream that a handler had already returned
    is closed, since no response will."""
    engine = AbortRecorder()

    class Raw:  # the client never disconnects
        async def receive(self) -> dict[str, Any]:
            await asyncio.Event().wait()
            return {"type": "http.disconnect"}

    async def main() -> None:
        waiting = make_stream(engine, "waiting")
        returned = make_stream(engine, "returned")

        async def non_streamed() -> list[object]:
            return [o async for o in waiting]

        task = asyncio.create_task(_cancel_on_disconnect(Raw(), non_streamed()))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
        assert engine.aborted == ["waiting"]

        async def streamed() -> SSEStream:
            return SSEStream(_never(), [returned])

        task = asyncio.create_task(_cancel_on_disconnect(Raw(), streamed()))  # type: ignore[arg-type]
        # One loop pass: the request task starts the handler and waits; another: the handler returns its stream,
        # which wakes the request task, cancelled before it runs again.
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.01)
        assert engine.aborted == ["waiting", "returned"]

    run_without_gc(main())


async def _never() -> AsyncGenerator[bytes, None]:
    await asyncio.Event().wait()
    yield b""


def test_a_second_reader_of_a_stream_is_refused_without_aborting_it() -> None:
    """One task reads a stream at a time: a second one that asks while the first waits gets a RuntimeError, and
    the first still gets every output; nothing is aborted."""
    engine = AbortRecorder()
    stream = make_stream(engine, "a")
    queue = stream._queue

    async def main() -> None:
        first = asyncio.create_task(anext(stream))
        await asyncio.sleep(0)  # the first reader waits
        try:
            await anext(stream)
        except RuntimeError as e:
            assert "already waiting" in str(e)
        else:
            raise AssertionError("a second reader was not refused")
        assert engine.aborted == []
        queue.put_nowait(output("a", 7, False))
        assert (await first).outputs[0].token_ids == [7]
        queue.put_nowait(output("a", 8, True))
        assert [o.outputs[0].token_ids for o in [o async for o in stream]] == [[8]]
        assert engine.aborted == []

    run_without_gc(main())
