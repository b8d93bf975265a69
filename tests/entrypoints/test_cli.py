"""The command line as a user meets it, each in a subprocess: `vllm --version`, `vllm serve --help`, and
`python -m vllm.entrypoints.openai.api_server` serving the bundled model under its short name, with one start-up
line saying what runs and no nanobind leak report at exit."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

import vllm
from vllm.config.model import DEFAULT_MODEL_NAME, ModelConfig, default_model_path

from conftest import REPO_ROOT, free_port

CLI = [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=_env())


def test_version() -> None:
    for flag in ("--version", "-v"):
        proc = _run([*CLI, flag])
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == vllm.__version__


def _option_blocks(help_text: str) -> dict[str, str]:
    """Each option of an argparse help (its flags' line and its help, whitespace folded), by its first flag."""
    blocks: dict[str, str] = {}
    current: list[str] = []
    for line in help_text.splitlines():
        if re.match(r"  -", line):
            current = [line]
            blocks[line.split()[0].rstrip(",")] = ""
        elif current and line.startswith("   "):
            current.append(line)
        else:
            current = []
        if current:
            blocks[current[0].split()[0].rstrip(",")] = " ".join(" ".join(current).split())
    return blocks


@pytest.mark.parametrize("command", [["serve", "--help"], None], ids=["vllm-serve", "api-server-module"])
def test_help_shows_every_default(command: list[str] | None) -> None:
    args = [*CLI, *command] if command else [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--help"]
    proc = _run(args)
    assert proc.returncode == 0, proc.stderr
    blocks = _option_blocks(proc.stdout)
    blocks.pop("-h")
    assert len(blocks) > 30 and "--port" in blocks and "--max-num-seqs" in blocks
    assert [flag for flag, text in blocks.items() if "(default: " not in text] == []
    assert blocks["--port"].endswith("(default: 8000)")
    assert blocks["--gpu-memory-utilization"].endswith("(default: 0.9)")
    assert blocks["--return-sampling-mask"].endswith("(default: False)")
    assert blocks["--max-model-len"].endswith("(default: None)")


def test_served_name_is_the_model_as_given() -> None:
    assert ModelConfig().served_model_name == DEFAULT_MODEL_NAME == os.path.basename(default_model_path())
    assert ModelConfig().model == default_model_path()
    relative = os.path.relpath(default_model_path())
    config = ModelConfig(model=relative)
    assert (config.served_model_name, config.model) == (relative, relative)
    assert ModelConfig(model=relative, served_model_name="mine").name == "mine"


def test_api_server_module_serves_like_vllm_serve() -> None:
    """No model given: the bundled one under its folder's name; a request naming it is served; SIGTERM stops the
    server with status 0, with the start-up line in its log and no nanobind leak report (frozen start-up heaps
    used to keep triton's objects alive past its teardown)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
                             "--port", str(port), "--device", "cpu", "--max-model-len", "64",
                             "--uvicorn-log-level", "warning"],
                            cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == [DEFAULT_MODEL_NAME]
        assert models[0]["root"] == default_model_path()
        body = {"model": DEFAULT_MODEL_NAME, "prompt": [5, 17, 42], "max_tokens": 3, "temperature": 0.0}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["model"] == DEFAULT_MODEL_NAME
        assert resp.json()["usage"]["completion_tokens"] == 3
        resp = httpx.post(f"{url}/v1/completions", json={**body, "model": "other"}, timeout=60)
        assert resp.status_code == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, stderr
    started = [line for line in stderr.splitlines() if "Loading model" in line]
    assert len(started) == 1, stderr
    assert started[0].startswith("INFO ")
    assert (f"model {DEFAULT_MODEL_NAME} (LlamaForCausalLM from {default_model_path()}) on cpu, dtype float32, "
            "sampling mask off, logprobs mode raw_logprobs") in started[0]
    assert "nanobind: leaked" not in stderr


@pytest.mark.parametrize("flags,message", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"], "this engine implements: hermes"),
    (["--chat-template", "no/such/template.jinja"], "looks like a file path"),
    (["--generation-config", "no/such/folder"], "is not a folder"),
    (["--override-generation-config", '{"temperature": 9}'], "--generation-config vllm"),
])
def test_bad_frontend_flags_exit_2_before_the_engine_starts(flags: list[str], message: str) -> None:
    result = _run([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--device", "cpu", *flags])
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
