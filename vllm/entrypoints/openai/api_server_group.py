"""--api-server-count N > 1 (`run_api_servers`): one port served by N API server processes over shared engine
cores.

This process binds the port, starts the engine core(s) (one per data-parallel rank, each reached by every API
server) and N API server processes that share the listening socket (the kernel spreads new connections over
them), and watches them. Each API server is the single server of server.py with its own AsyncLLM frontend
(tokenizer, output processing, metrics) joined to the shared cores, so the per-token frontend work (output
processing, JSON, HTTP) runs on N cores.

Invariants:
- The whole group stops on SIGTERM/SIGINT (exit 0) or when any member exits (exit 1); the API servers stop first
  (gracefully: they finish their responses within --shutdown-timeout), then the cores, and the cores' socket
  folder is removed.
- /metrics is per process: request counters and histograms count the requests that process served; the scheduler
  gauges (running, waiting, KV usage) come from the shared cores and are the same in every process; every sample
  is labelled with its engine core (`engine="i"`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import shutil
import signal
import socket
import sys
from typing import Any

from vllm.config import VllmConfig
from vllm.entrypoints.openai.graceful_shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S, FLUSH_S
from vllm.entrypoints.openai.server import loop_factory, make_vllm_config, run_server
from vllm.v1.engine.core_client import EngineCoreHandle
from vllm.v1.engine.core_launch import launch_engine_cores

# NOTE: the server's logger name from before the split (api_server.py), so log filters keep working.
logger = logging.getLogger("vllm.entrypoints.openai.api_server")


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
