"""`vllm serve --api-server-count 2`: one engine core behind two API server processes sharing the port.

Checked against the single-server behaviour: concurrent seeded streams equal the same requests sent one at a
time without streaming (so every response came back whole, to the connection that asked, whichever process
served it), masks hold their tokens, a request id given to both processes at once never disturbs the engine,
SIGTERM stops the whole group (and a single server) with exit 0 and no socket folder left, and a killed engine core takes the group down with a non-zero exit.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tests.entrypoints.conftest import RemoteServer, spawn_children, start_server, stop_server

BODY = {"max_tokens": 6, "temperature": 1.0, "top_k": 8, "top_p": 0.9, "ignore_eos": True, "logprobs": 1,
        "return_token_ids": True}


@pytest.fixture(scope="module")
def group() -> Iterator[RemoteServer]:
    srv = start_server(["--api-server-count", "2", "--return-sampling-mask", "--logprobs-mode",
                        "processed_logprobs", "--max-model-len", "256", "--max-num-seqs", "16", "--seed", "0"])
    yield srv
    stop_server(srv)


def _stream_tokens(text: str) -> tuple[list[int], list[list[int]]]:
    token_ids: list[int] = []
    masks: list[list[int]] = []
    for event in text.split("\n\n"):
        if event.startswith("data: ") and event != "data: [DONE]":
            choice = json.loads(event[len("data: "):])["choices"][0]
            token_ids += choice["token_ids"]
            masks += choice["sampling_mask"]
    return token_ids, masks


def test_group_has_one_core_and_two_api_servers(group: RemoteServer) -> None:
    assert len(spawn_children(group)) == 3


def test_concurrent_streams_equal_sequential_requests(group: RemoteServer) -> None:
    url = f"{group.url}/v1/completions"
    bodies = [{**BODY, "prompt": f"Request {i} says", "seed": 100 + i} for i in range(24)]
    expected = []
    for body in bodies:
        resp = httpx.post(url, json=body, timeout=120)
        assert resp.status_code == 200
        choice = resp.json()["choices"][0]
        expected.append((choice["token_ids"], choice["sampling_mask"]))

    async def run() -> list[tuple[list[int], list[list[int]]]]:
        # NOTE: one connection per request, so the kernel spreads them over both API servers.
        async def one(body: dict[str, Any]) -> tuple[list[int], list[list[int]]]:
            async with httpx.AsyncClient(timeout=120) as client:
                resp = await client.post(url, json={**body, "stream": True})
                assert resp.status_code == 200
                return _stream_tokens(resp.text)
        return await asyncio.gather(*(one(b) for b in bodies))

    streamed = asyncio.run(run())
    assert streamed == expected
    for token_ids, masks in streamed:
        assert len(token_ids) == 6
        for token, mask in zip(token_ids, masks):
            assert token in mask and mask == sorted(set(mask)) and len(mask) <= 8


def test_same_request_id_on_both_servers_leaves_the_engine_serving(group: RemoteServer) -> None:
    """Two generate requests with one request_id at once: if both reach one process the second is a 400; if
    they reach different processes the engine core refuses the second (finish_reason "abort"). Either way the
    first completes and the engine keeps serving."""
    url = f"{group.url}/inference/v1/generate"
    body = {"token_ids": [1, 2, 3], "request_id": "same-id",
            "sampling_params": {"max_tokens": 40, "top_k": 8, "ignore_eos": True, "temperature": 1.0}}

    async def run() -> list[httpx.Response]:
        async def one() -> httpx.Response:
            async with httpx.AsyncClient(timeout=120) as client:
                return await client.post(url, json=body)
        return list(await asyncio.gather(*(one() for _ in range(6))))

    responses = asyncio.run(run())
    done = [r for r in responses if r.status_code == 200
            and r.json()["choices"][0]["finish_reason"] == "length"]
    assert len(done) >= 1 and len(done[0].json()["choices"][0]["token_ids"]) == 40
    for r in responses:
        if r not in done:
            assert r.status_code == 400 or r.json()["choices"][0]["finish_reason"] == "abort", r.text
    after = httpx.post(f"{group.url}/v1/completions", json={**BODY, "prompt": "after"}, timeout=120)
    assert after.status_code == 200 and len(after.json()["choices"][0]["token_ids"]) == 6


@pytest.mark.parametrize("count", [1, 2])
def test_sigterm_stops_the_whole_group(count: int, tmp_path: Any) -> None:
    """Exit 0, no process left, and the engine core's socket folder (under TMPDIR) removed; one server as well
    (uvicorn raises the signal again after its graceful shutdown, which under the default handler killed the
    process before its cleanup)."""
    srv = start_server(["--api-server-count", str(count), "--max-model-len", "128", "--max-num-seqs", "4"],
                       extra_env={"TMPDIR": str(tmp_path)})
    children = spawn_children(srv)
    assert len(children) == 1 + (count if count > 1 else 0)
    assert [p.name for p in tmp_path.glob("vllm-core-*")] != []
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(60) == 0
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}")
    assert [p.name for p in tmp_path.glob("vllm-core-*")] == []


def _alive(pid: int) -> bool:
    """Running (an exited orphan may stay a zombie until some reaper gets to it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("count", [1, 2])
def test_sigkill_of_the_server_stops_the_engine_core_and_removes_its_sockets(count: int, tmp_path: Any) -> None:
    """A SIGKILLed API server (or launcher) runs no cleanup: the engine core sees its parent exit (a pidfd it
    waits on), stops at once whatever it is doing, and removes the socket folder itself; with several API servers
    they then see the core gone and exit too."""
    srv = start_server(["--api-server-count", str(count), "--max-model-len", "128", "--max-num-seqs", "4"],
                       extra_env={"TMPDIR": str(tmp_path)})
    children = spawn_children(srv)
    core = children[0]
    # A request in flight: the core is busy stepping, not waiting for input, when its parent dies.
    streaming = subprocess.Popen([sys.executable, "-c", (
        "import httpx, sys; httpx.post(sys.argv[1] + '/v1/completions', timeout=60, json={'prompt': 'x', "
        "'max_tokens': 120, 'ignore_eos': True})"), srv.url])
    time.sleep(1.0)
    srv.proc.kill()
    srv.proc.wait(30)
    killed_at = time.monotonic()
    while _alive(core) and time.monotonic() - killed_at < 30:
        time.sleep(0.05)
    # NOTE: a bound with room for a loaded CI machine; the pidfd wakes the core at once (well under 2 s).
    assert time.monotonic() - killed_at < 5, "the engine core outlived its parent"
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in children)
    assert [p.name for p in tmp_path.glob("vllm-core-*")] == []
    streaming.kill()
    streaming.wait()


def test_killing_the_engine_core_exits_the_group_nonzero(group: RemoteServer) -> None:
    children = spawn_children(group)
    os.kill(children[0], signal.SIGKILL)
    try:
        returncode = group.proc.wait(60)
    except Exception:
        group.proc.kill()
        raise
    assert returncode == 1
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}")
