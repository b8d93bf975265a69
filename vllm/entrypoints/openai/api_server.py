"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an AsyncLLM.

Endpoints: GET /v1/models, /health, /version, /metrics; POST /v1/completions, /v1/chat/completions,
/inference/v1/generate, /tokenize, /detokenize; with VLLM_SERVER_DEV_MODE=1 or --enable-rl-endpoints the admin endpoints of RL training
loops (admin.py: pause/resume, weight updates, collective_rpc). Errors are OpenAI-style
`{"error": {message, type, param, code}}`: invalid input 400
(validation errors included, never 422), unknown model 404, missing or wrong key under --api-key 401, a dead
engine or any unexpected error 500 (still an OpenAI body); /health answers 503 once the engine died.

Invariants:
- A request is fully validated before it reaches the engine core, so a bad request never disturbs the others.
- Bounds come before work (request_limits.py): a body over --max-request-body-bytes is a 413 before it is read, a
  text longer in characters than the context can hold is a 400 before it is tokenized, and long texts and chat
  templates are processed in a thread pool under a time bound, never on the event loop.
- SIGTERM / SIGINT: no new requests, running ones get --shutdown-timeout seconds, then an OpenAI error (an error
  event and [DONE] when streamed), never a plain-text 500 (graceful_shutdown.py).
- The OpenAPI schema documents what the server does: 400 (never 422) with the OpenAI error body, the fields a
  request must send, and the bounds the server enforces (protocol.py).
- A client that disconnects before its response (streaming or not) has its requests aborted in the engine.
- When an engine-core process dies (any data-parallel rank), /health answers 503, in-flight requests get an
  error, the server shuts down and `run_server` returns 1 (the process exits non-zero).
- --data-parallel-size N: the frontend's AsyncLLM talks to N engine cores (dp_client.py); a generation request's
  X-data-parallel-rank header (vLLM's) picks its engine, else the least loaded one serves it.

--api-server-count N > 1 (`run_api_servers`): this process binds the port, starts the engine core(s) (one per
data-parallel rank, each reached by every API server) and N API server processes that share the listening
socket (the kernel spreads new connections over them), and watches them. Each API server is the single-server app above with its own AsyncLLM frontend (tokenizer, output
processing, metrics) joined to the shared core, so the per-token frontend work (output processing, JSON, HTTP)
runs on N cores. The whole group stops on SIGTERM/SIGINT (exit 0) or when any member exits (exit 1). /metrics
is per process: request counters and histograms count the requests that process served; the scheduler gauges
(running, waiting, KV usage) come from the shared cores and are the same in every process; every sample is
labelled with its engine core (`engine="i"`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import multiprocessing
import multiprocessing.connection
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import vllm
from vllm import envs
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.openai.admin import attach_admin_router
from vllm.entrypoints.openai.cli_args import default_sampling_params
from vllm.entrypoints.openai.graceful_shutdown import (DEFAULT_SHUTDOWN_TIMEOUT_S, FLUSH_S, GracefulServer,
                                                       ServerDrain)
from vllm.entrypoints.openai.openapi import documented_openapi, route_responses
from vllm.entrypoints.chat_utils import load_chat_template
from vllm.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                              CompletionResponse, DetokenizeRequest, DetokenizeResponse,
                                              GenerateRequest, GenerateResponse, TokenizeChatRequest,
                                              TokenizeCompletionRequest, TokenizeResponse)
from vllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from vllm.entrypoints.openai.tool_parsers import get_tool_parser
from vllm.entrypoints.openai.request_limits import DEFAULT_MAX_REQUEST_BODY_BYTES, PreprocessPool, RequestGuard
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_engine import (NotFoundError, ServerShuttingDownError, SSEStream,
                                                    error_body)
from vllm.entrypoints.openai.serving_generate import OpenAIServingGenerate
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.config import VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import EngineCoreHandle, EngineDeadError
from vllm.v1.engine.core_launch import launch_engine_cores
from vllm.v1.engine.dp_client import (DATA_PARALLEL_RANK_HEADER, current_data_parallel_rank,
                                      parse_data_parallel_rank_header)
from vllm.v1.engine.sleep_mode import EngineSleepingError
from vllm.v1.serving_gc import freeze_startup_heap

logger = logging.getLogger("vllm.entrypoints.openai.api_server")

_PROTECTED_PREFIXES = ("/v1", "/inference")


def _error(message: str, status_code: int, err_type: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, err_type, param), status_code=status_code)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, VLLMValidationError):  # a field refused by name (request_fields.py): its own message
        return str(cause), cause.parameter
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"The request body is not valid JSON: {first.get('msg', '')}", None
    details = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                        for e in errors[:5])
    return f"Invalid request: {details}", param


async def _wait_for_disconnect(raw: Request) -> None:
    # NOTE: the body has been read already, so the next message is the disconnect (or nothing, until then).
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(raw: Request, handler: Awaitable[Any], drain: ServerDrain | None = None) -> Any:
    """Await `handler`; if the client goes away first, cancel it, which aborts its requests in the engine (their
    output streams abort when cancelled or closed) and frees their KV blocks. Streams return at once; a dropped
    stream is handled by the streaming response itself (_SSEResponse)."""
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


class _SSEResponse(StreamingResponse):
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


class _APIKeyMiddleware:
    """--api-key: a request to /v1 or /inference without `Authorization: Bearer <key>` gets a 401 (OPTIONS
    excepted). A plain ASGI middleware: the app's own send and receive pass through untouched (Starlette's
    BaseHTTPMiddleware would run each response in another task and relay every streamed event through a queue)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()  # ASGI header values are bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (scope["type"] == "http" and scope["method"] != "OPTIONS"
                and scope["path"].startswith(_PROTECTED_PREFIXES)
                and not hmac.compare_digest(
                    next((v for k, v in scope["headers"] if k == b"authorization"), b""), self.expected)):
            response = _error("Unauthorized: a valid API key is required.", 401, "AuthenticationError")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _respond(result: Any) -> Response:
    if result is None:  # the client is gone (see _cancel_on_disconnect): nobody reads this
        return Response(status_code=499)
    if isinstance(result, SSEStream):
        return _SSEResponse(result)
    if isinstance(result, Response):  # a response with the engine's mask texts spliced in (with_mask_texts)
        return result
    return JSONResponse(result.model_dump())


def build_app(engine: AsyncLLM, api_key: str | None = None, enable_rl_endpoints: bool = False, *,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              trust_request_chat_template: bool = False, chat_template: str | None = None,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              return_tokens_as_token_ids: bool = False,
              enable_prompt_tokens_details: bool = False) -> FastAPI:
    """The app; the admin endpoints of RL training loops (admin.py) only with enable_rl_endpoints or
    VLLM_SERVER_DEV_MODE=1. chat_template: --chat-template (a file or the template itself)."""
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser (this engine implements: hermes).")
    tool_parser = get_tool_parser(tool_call_parser) if enable_auto_tool_choice and tool_call_parser else None
    app = FastAPI(title="vllm", version=vllm.__version__)
    mc = engine.model_config
    names = [mc.served_model_name or str(mc.model)]
    app.state.engine = engine
    app.state.drain = ServerDrain()
    app.state.preprocess = preprocess = PreprocessPool()
    app.state.models = OpenAIServingModels(names, str(mc.model), int(mc.max_model_len or 0))
    app.state.completion = OpenAIServingCompletion(engine, names, preprocess)
    app.state.chat = OpenAIServingChat(engine, names, preprocess, trust_request_chat_template,
                                       load_chat_template(chat_template), tool_parser)
    app.state.generate = OpenAIServingGenerate(engine, names, preprocess)
    app.state.tokenization = OpenAIServingTokenization(app.state.chat)
    app.state.completion.default_sampling_params = app.state.chat.default_sampling_params = \
        default_sampling_params(mc)
    for serving in (app.state.completion, app.state.chat, app.state.generate):
        serving.return_tokens_as_token_ids = return_tokens_as_token_ids
        serving.enable_prompt_tokens_details = enable_prompt_tokens_details

    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    # NOTE: added last, so outermost: sizes and draining are checked before anything else runs.
    app.add_middleware(RequestGuard, max_body_bytes=max_request_body_bytes,
                       draining=lambda: app.state.drain.draining, error=_error)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error(message, 400, "BadRequestError", param)

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError) -> JSONResponse:
        return _error(str(exc), 400, "BadRequestError", getattr(exc, "parameter", None))

    @app.exception_handler(NotFoundError)
    async def on_not_found(request: Request, exc: NotFoundError) -> JSONResponse:
        return _error(str(exc), 404, "NotFoundError", "model")

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return _error(f"The engine died: {exc}", 500, "InternalServerError")

    @app.exception_handler(ServerShuttingDownError)
    async def on_shutting_down(request: Request, exc: ServerShuttingDownError) -> JSONResponse:
        return _error(str(exc), 503, "ServiceUnavailableError")

    @app.exception_handler(EngineSleepingError)
    async def on_sleeping(request: Request, exc: EngineSleepingError) -> JSONResponse:
        return _error(str(exc), 503, "ServiceUnavailableError")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(str(exc.detail), exc.status_code, "NotFoundError" if exc.status_code == 404 else "HTTPError")

    @app.exception_handler(RecursionError)
    async def on_recursion_error(request: Request, exc: RecursionError) -> JSONResponse:
        # NOTE: json.loads raises it for a body nested deeper than the interpreter's recursion limit (the admin
        # endpoints parse their bodies themselves); that is the client's input, not a server fault.
        if "JSON" in str(exc):
            return _error("The request body is nested too deeply to parse.", 400, "BadRequestError")
        return await on_unexpected_error(request, exc)

    @app.exception_handler(Exception)
    async def on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        # NOTE: an OpenAI error body, never Starlette's text/plain 500.
        logger.exception("Unexpected error while handling %s %s", request.method, request.url.path)
        return _error(f"Internal server error: {type(exc).__name__}: {exc}", 500, "InternalServerError")

    if enable_rl_endpoints or envs.VLLM_SERVER_DEV_MODE:
        attach_admin_router(app, engine)

    @app.get("/health")
    async def health() -> Response:
        # NOTE: 503 as vLLM's /health answers a dead engine (EngineDeadError), with the reason in an OpenAI body.
        if engine.errored:
            return _error(f"The engine died: {engine.dead_error}", 503, "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": vllm.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.stat_logger.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(app.state.models.show_available_models().model_dump())

    @app.post("/v1/completions", responses=route_responses(CompletionResponse))
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        with _data_parallel_rank(raw_request, engine):
            handler = app.state.completion.create_completion(request)
            return _respond(await _cancel_on_disconnect(raw_request, handler, app.state.drain))

    @app.post("/v1/chat/completions", responses=route_responses(ChatCompletionResponse))
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        with _data_parallel_rank(raw_request, engine):
            handler = app.state.chat.create_chat_completion(request)
            return _respond(await _cancel_on_disconnect(raw_request, handler, app.state.drain))

    @app.post("/inference/v1/generate", responses=route_responses(GenerateResponse))
    async def generate(request: GenerateRequest, raw_request: Request) -> Response:
        with _data_parallel_rank(raw_request, engine):
            handler = app.state.generate.generate(request)
            return _respond(await _cancel_on_disconnect(raw_request, handler, app.state.drain))

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(raw_request: Request) -> Response:
        # NOTE: the body's form (messages or prompt) picks the model, so that the other one never reports the
        # first one's fields as unknown.
        try:
            body = await raw_request.json()
        except ValueError as e:
            return _error(f"The request body is not valid JSON: {e}", 400, "BadRequestError")
        model = TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest
        try:
            request = model.model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from e
        return _respond(await app.state.tokenization.tokenize(request))

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(request: DetokenizeRequest) -> Response:
        return _respond(await app.state.tokenization.detokenize(request))

    app.openapi = lambda: documented_openapi(app)  # type: ignore[method-assign]
    return app


@contextlib.contextmanager
def _data_parallel_rank(raw: Request, engine: AsyncLLM) -> Iterator[None]:
    """While a generation route runs: the rank of its X-data-parallel-rank header (vLLM's) for the requests it adds
    (AsyncLLM.add_request reads it; the handler's task copies it). A bad value is a 400."""
    rank = parse_data_parallel_rank_header(raw.headers.get(DATA_PARALLEL_RANK_HEADER),
                                           engine.engine_core.data_parallel_size)
    token = current_data_parallel_rank.set(rank)
    try:
        yield
    finally:
        current_data_parallel_rank.reset(token)


async def _watch_engine(engine: AsyncLLM, server: uvicorn.Server) -> None:
    await engine.engine_core.wait_dead()
    logger.error("The engine core process died (%s); shutting the server down.", engine.dead_error)
    engine._fail_all(engine.dead_error or EngineDeadError("The engine core process died."))
    server.should_exit = True


def make_vllm_config(args: argparse.Namespace) -> VllmConfig:
    vllm_config = EngineArgs.from_cli_args(args).create_engine_config()
    # NOTE: the server sends masks as JSON text formatted on the device (vllm/v1/sample/ops/mask_json.py).
    vllm_config.model_config.sampling_mask_text = True
    return vllm_config


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    # NOTE: an API server is one event loop serving every stream; uvloop (with uvicorn's httptools parser,
    # picked automatically when installed) roughly halves its per-chunk overhead.
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def run_server(args: argparse.Namespace, vllm_config: VllmConfig | None = None,
                     core_handle: EngineCoreHandle | None = None, sock: socket.socket | None = None) -> int:
    """Start the engine (or join a shared core: core_handle) and serve on args.host/port (or the listening
    `sock`) until shutdown; returns the process exit code (1 when the engine died)."""
    engine = AsyncLLM(vllm_config or make_vllm_config(args), log_stats=not args.disable_log_stats,
                      core_handle=core_handle, log_requests=args.enable_log_requests)
    app: FastAPI | None = None
    try:
        app = build_app(engine, args.api_key, getattr(args, "enable_rl_endpoints", False),
                        max_request_body_bytes=getattr(args, "max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES),
                        trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
                        chat_template=getattr(args, "chat_template", None),
                        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
                        tool_call_parser=getattr(args, "tool_call_parser", None),
                        return_tokens_as_token_ids=getattr(args, "return_tokens_as_token_ids", False),
                        enable_prompt_tokens_details=getattr(args, "enable_prompt_tokens_details", False))
        # NOTE: everything built so far (imports, torch among them, the app, the engine client) lives as long as
        # the process: frozen, it is left out of every later collection (each full one would walk ~200k objects,
        # ~0.1 s without serving any stream); then the serving thresholds (vllm/v1/serving_gc.py).
        freeze_startup_heap()
        grace_s = getattr(args, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT_S)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                timeout_graceful_shutdown=int(grace_s + FLUSH_S) + 1, timeout_keep_alive=5)
        server = GracefulServer(config, engine, app.state.drain, grace_s)
        watchdog = asyncio.create_task(_watch_engine(engine, server))
        with _stop_signals_absorbed():
            await server.serve(sockets=[sock] if sock is not None else None)
        watchdog.cancel()
        if engine.errored:
            return 1
        return 0 if server.started else 1
    finally:
        engine.shutdown()
        if app is not None:
            app.state.preprocess.shutdown()


@contextlib.contextmanager
def _stop_signals_absorbed() -> Any:
    """Around uvicorn's `serve`: once it has shut down on SIGTERM/SIGINT it raises the signal again under the
    handler found at its start. Under the default ones the process would die there, before `run_server`'s
    cleanup (the engine core stopped, its socket folder removed); here the re-raised signal is absorbed and the
    server returns as after any graceful shutdown. Only the main thread can set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _api_server_proc(args: argparse.Namespace, vllm_config: VllmConfig, core_handle: EngineCoreHandle,
                     sock: socket.socket) -> None:
    """Entry point of one API server process of run_api_servers."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            code = runner.run(run_server(args, vllm_config, core_handle, sock))
    except RuntimeError as e:
        logger.error("%s", e)
        code = 1
    sys.exit(code)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in (host or "") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"Cannot listen on {host}:{port}: {e}") from e
    sock.listen(2048)
    return sock


def _stop(procs: list[multiprocessing.process.BaseProcess], timeout_s: float) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def run_api_servers(args: argparse.Namespace) -> int:
    """--api-server-count N > 1: the engine cores, N API server processes on one listening socket (module
    docstring); returns the exit code: 0 after SIGTERM/SIGINT, 1 when a member exited on its own."""
    num_servers = args.api_server_count
    vllm_config = make_vllm_config(args)
    sock = _listen(args.host, args.port)
    stop_requested = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop_requested
        stop_requested = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    cores, handles, tmp_dir = launch_engine_cores(vllm_config, num_servers)
    spawn = multiprocessing.get_context("spawn")
    servers = [spawn.Process(target=_api_server_proc, name=f"APIServer_{h.client_index}", daemon=True,
                             args=(args, vllm_config, h, sock)) for h in handles]
    try:
        for proc in servers:
            proc.start()
        sock.close()
        logger.info("Started %d API server processes and %d engine core(s) (pids %s) on %s:%d.", num_servers,
                    len(cores), ", ".join(str(c.pid) for c in cores), args.host, args.port)
        members = [*cores, *servers]
        exited: list[multiprocessing.process.BaseProcess] = []
        while not stop_requested and not exited:
            multiprocessing.connection.wait([p.sentinel for p in members], timeout=0.5)
            exited = [p for p in members if not p.is_alive()]
        for proc in exited:
            proc.join()  # NOTE: reaped at once, so the API servers see a dead core's pid gone.
            if not stop_requested:
                logger.error("%s (pid %d) exited with code %s; stopping the others.", proc.name, proc.pid,
                             proc.exitcode)
        # NOTE: the API servers first (graceful: they finish their responses), then the core.
        _stop(servers, getattr(args, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT_S) + FLUSH_S + 5)
        _stop(cores, 10)
        # NOTE: a signal to the whole process group (Ctrl-C) may end a member before this loop saw the signal.
        return 0 if stop_requested else 1
    finally:
        _stop([*servers, *cores], 1)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    # NOTE: vLLM's older entry point; the same flags and server as `vllm serve` (vllm/entrypoints/cli/main.py).
    from vllm.entrypoints.cli.main import api_server_main
    api_server_main()
