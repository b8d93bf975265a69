"""Request limits of the API server: the body size, the prompt size before tokenizing, and the CPU work a request
controls (tokenizing, chat templating) kept off the event loop.

Invariants:
- A body over `--max-request-body-bytes` is refused (413, an OpenAI error body naming the limit) before the app
  reads any of it when it has a Content-Length, and as soon as its chunks pass the limit otherwise. Nothing is
  parsed or buffered past the limit.
- While the server drains (SIGTERM, graceful_shutdown.py) every new request is refused with a 503.
- A text longer than `max_model_len * max_token_chars` characters is refused without tokenizing (it cannot fit:
  no token stands for more than `max_token_chars` characters, see Tokenizer.max_token_chars).
- Tokenizing a text longer than INLINE_CHARS, and rendering a chat template a request sent or fed a large
  conversation, run in `PreprocessPool`'s threads (tokenizers releases the GIL; a template is stopped by its
  step budget), and a request waits at most PREPROCESS_TIMEOUT_S for it (then a 400); the event loop, /health and
  the other streams go on meanwhile. Short inputs stay on the loop: the same result without a thread hop.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi.responses import JSONResponse

from vllm.exceptions import VLLMValidationError

T = TypeVar("T")

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
# Texts up to this many characters are tokenized on the event loop (well under a millisecond).
INLINE_CHARS = 8192
# The longest a request waits for its tokenization or chat template in the pool.
PREPROCESS_TIMEOUT_S = 30.0


class RequestGuard:
    """ASGI middleware: the body size limit, and 503 for new requests while the server drains (`drain()` true).
    Plain ASGI (like _APIKeyMiddleware): the app's receive and send pass through, wrapped only to count."""

    def __init__(self, app: Any, max_body_bytes: int, draining: Callable[[], bool],
                 error: Callable[[str, int, str], JSONResponse]) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.draining = draining
        self.error = error  # (message, status, type) -> an OpenAI error response

    def _too_large(self, size: str) -> JSONResponse:
        response = self.error(f"The request body ({size} bytes) is larger than this server's limit of "
                              f"{self.max_body_bytes} bytes (--max-request-body-bytes).", 413,
                              "RequestEntityTooLargeError")
        # NOTE: the connection closes after the answer: kept alive, the server would read (and drop) the rest of
        # the body on its event loop before the next request (a 6 MB body: ~50 ms of /health latency each).
        response.headers["connection"] = "close"
        return response

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining():
            response = self.error("The server is shutting down and accepts no new requests.", 503,
                                  "ServiceUnavailableError")
            await response(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None:
            if not length.isdigit():
                await self.error("The Content-Length header is not a number of bytes.", 400,
                                 "BadRequestError")(scope, receive, send)
                return
            if int(length) > self.max_body_bytes:
                await self._too_large(length.decode("latin-1")[:32])(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        # NOTE: no Content-Length (chunked): the body is read here up to the limit, then handed on as one message.
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([], [message], receive), send)
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await self._too_large(f"more than {self.max_body_bytes}")(scope, receive, send)
                return
            chunks.append(body)
            more = message.get("more_body", False)
        await self.app(scope, _replay(chunks, [], receive), send)


def _replay(chunks: list[bytes], messages: list[dict[str, Any]], receive: Any) -> Any:
    pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}] if chunks else []
    pending += messages

    async def replay() -> Any:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


def prompt_char_limit(max_model_len: int, max_token_chars: int | None) -> int | None:
    """The most characters a prompt that fits the context can have (None: no such bound)."""
    if max_token_chars is None or max_model_len <= 0:
        return None
    return max_model_len * max_token_chars


def check_prompt_chars(num_chars: int, max_model_len: int, max_token_chars: int | None,
                       parameter: str = "prompt") -> None:
    """Refuse a text that cannot fit the context whatever its tokens (module docstring), before tokenizing it."""
    limit = prompt_char_limit(max_model_len, max_token_chars)
    if limit is not None and num_chars > limit:
        raise VLLMValidationError(
            f"The {parameter} has {num_chars} characters, more than fit this model's maximum context length of "
            f"{max_model_len} tokens (no token stands for more than {max_token_chars} characters, so at most "
            f"{limit} characters). Make it shorter.", parameter=parameter, value=num_chars)


class PreprocessPool:
    """A few threads for tokenizing and chat templating large inputs, with a time bound (module docstring)."""

    def __init__(self, max_workers: int | None = None, timeout_s: float = PREPROCESS_TIMEOUT_S) -> None:
        # NOTE: one core fewer than the machine has (at most 4): the pool's threads run the tokenizer's native code
        # without the GIL, so as many of them as cores starve the event loop of CPU (on 2 cores, /health under
        # three clients sending 180k-character prompts: p50 90 ms with 2 threads; tools/health_under_attack.py).
        self.max_workers = max_workers or max(1, min(4, (os.cpu_count() or 2) - 1))
        self.timeout_s = timeout_s
        self._executor: ThreadPoolExecutor | None = None

    async def run(self, what: str, parameter: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) in a pool thread; a VLLMValidationError (400) naming `parameter` if it takes longer
        than the time bound (the thread finishes on its own; its result is dropped)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.max_workers, thread_name_prefix="vllm-preprocess")
        future = asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            raise VLLMValidationError(f"{what} took longer than {self.timeout_s:g} s; send a shorter input.",
                                      parameter=parameter) from None

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
