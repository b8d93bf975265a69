"""A real `vllm serve` subprocess on 127.0.0.1 (free port, bundled tiny model, CPU), shared per test module."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from vllm.config.model import default_model_path

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# NOTE: VLLM_TEST_MODEL lets a developer point the tests at another local checkpoint folder.
MODEL = os.environ.get("VLLM_TEST_MODEL") or default_model_path()
API_KEY = "test-key"


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
    args = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", MODEL, "--host", "127.0.0.1",
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
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("vllm serve did not become healthy in time")


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
