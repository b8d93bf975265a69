"""One API server process's life (`run_server`): its AsyncLLM (its own engine core, or a shared one), the app,
uvicorn until shutdown, and the exit code.

Invariants:
- SIGTERM / SIGINT: no new requests, running ones get --shutdown-timeout seconds, then an OpenAI error (an error
  event and [DONE] when streamed), never a plain-text 500 (graceful_shutdown.py); the re-raised signal uvicorn
  sends itself after shutting down is absorbed, so the cleanup below always runs.
- When an engine-core process dies (any data-parallel rank), /health answers 503, in-flight requests get an error,
  the server shuts down and `run_server` returns 1 (the process exits non-zero).
- Whatever happens, the engine and the preprocessing pool are shut down before `run_server` returns.
- Everything built before serving lives as long as the process and is frozen out of the garbage collector
  (vllm/v1/serving_gc.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.openai.app import build_app
from vllm.entrypoints.openai.graceful_shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S, FLUSH_S, GracefulServer
from vllm.entrypoints.openai.request_limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import EngineCoreHandle, EngineDeadError
from vllm.v1.serving_gc import freeze_startup_heap

# NOTE: the server's logger name from before the split (api_server.py), so log filters keep working.
logger = logging.getLogger("vllm.entrypoints.openai.api_server")


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
