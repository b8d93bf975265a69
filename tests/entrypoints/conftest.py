"""A real `vllm serve` subprocess on 127.0.0.1 (free port, bundled tiny model, CPU), shared per test module."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from vllm.config.model import default_model_path

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# NOTE: VLLM_TEST_MODEL lets a developer point the tests at another local checkpoint folder.
MODEL = os.environ.get("VLLM_TEST_MODEL") or default_model_path()
API_KEY = "test-key"
# `python -m vllm.entrypoints.cli.main` with the cyclic garbage collector off (explicit gc.collect() still runs).
NO_CYCLIC_GC_MAIN = ("import gc, runpy, sys; gc.disable(); sys.argv[0] = 'vllm'; "
                     "runpy.run_module('vllm.entrypoints.cli.main', run_name='__main__', alter_sys=True)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RemoteServer:
    proc: subprocess.Popen
    port: int
    model: str
    api_key: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def engine_core_pid(self) -> int:
        """The engine-core child (the multiprocessing spawn child that is not the resource tracker)."""
        children: list[int] = []
        for task in os.listdir(f"/proc/{self.proc.pid}/task"):
            with open(f"/proc/{self.proc.pid}/task/{task}/children") as f:
                children += [int(p) for p in f.read().split()]
        for pid in children:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    return pid
        raise RuntimeError(f"No engine-core child among {children}.")


def start_server(extra_args: list[str], extra_env: dict[str, str] | None = None) -> RemoteServer:
    if not os.path.isfile(os.path.join(MODEL, "config.json")):
        pytest.skip(f"model folder {MODEL} is missing")
    port = free_port()
    # NOTE: the API server runs with the cyclic garbage collector off (with --api-server-count > 1 only the parent
    # does; its API-server children start fresh), so that no test passes because a collection happened to run: a
    # dropped stream, for one, must be aborted by the code path that sees the disconnect, not by a collector
    # finalising its objects (the serving thresholds make such collections rare and late).
    args = [sys.executable, "-c", NO_CYCLIC_GC_MAIN, "serve", MODEL, "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--uvicorn-log-level", "warning", *extra_args]
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra_env or {})
    proc = subprocess.Popen(args, cwd=REPO_ROOT, env=env)
    server = RemoteServer(proc, port, MODEL, API_KEY)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with code {proc.returncode} during startup")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        # NOTE: every server test waits here (about twenty servers a run); a poll costs one refused connection.
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("vllm serve did not become healthy in time")


def drop_stream(server: RemoteServer, body: dict[str, Any], num_chunks: int = 3,
                while_open: Callable[[], None] | None = None, path: str = "/v1/completions") -> None:
    """POST a streamed request (a completion unless `path` says otherwise), read its first `num_chunks` events,
    run `while_open` (if any) with the connection still open, then close it mid-stream."""
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        with http.stream("POST", path, json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            # NOTE: the line iterator is kept until here: a dropped one is closed, and with it the response.
            lines = resp.iter_lines()
            seen = 0
            for line in lines:
                seen += line.startswith("data: ")
                if seen == num_chunks:
                    break
            if while_open is not None:
                while_open()
            del lines


def concurrent_streams(server: RemoteServer, requests: list[dict[str, Any]]
                       ) -> list[tuple[list[int], list[list[int]]]]:
    """Stream the completions `requests` (keyword arguments of openai's completions.create, without model and
    stream) all at once; each one's token ids and sampling masks, concatenated over its chunks."""
    import asyncio

    import openai

    async def one(aclient: openai.AsyncOpenAI, kwargs: dict[str, Any]) -> tuple[list[int], list[list[int]]]:
        token_ids: list[int] = []
        masks: list[list[int]] = []
        stream = await aclient.completions.create(model=server.model, stream=True, **kwargs)
        async for chunk in stream:
            c = chunk.choices[0].model_dump()
            token_ids += c["token_ids"]
            masks += c["sampling_mask"]
        return token_ids, masks

    async def run() -> list[tuple[list[int], list[list[int]]]]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0,
                                     timeout=120)
        try:
            return await asyncio.gather(*(one(aclient, kwargs) for kwargs in requests))
        finally:
            await aclient.close()

    return asyncio.run(run())


def stop_server(srv: RemoteServer) -> None:
    if srv.proc.poll() is None:
        srv.proc.terminate()
        try:
            srv.proc.wait(20)
        except subprocess.TimeoutExpired:
            srv.proc.kill()
            srv.proc.wait()


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    srv = start_server(["--return-sampling-mask", "--logprobs-mode", "processed_logprobs", "--max-model-len", "2048",
                        "--max-num-seqs", "16", "--api-key", API_KEY, "--seed", "0"])
    yield srv
    stop_server(srv)


def spawn_children(srv: RemoteServer) -> list[int]:
    """The launcher's multiprocessing children, oldest first: the engine cores, then the API servers."""
    pids: list[int] = []
    for task in os.listdir(f"/proc/{srv.proc.pid}/task"):
        with open(f"/proc/{srv.proc.pid}/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    found.append(pid)
        except OSError:
            pass
    return sorted(found)
