"""Sleep mode with several API servers (`--api-server-count 2`): each server answers a request sent while the
engine sleeps as a single server does (HTTP 503 with an OpenAI error body, "ServiceUnavailableError", streamed
or not; tests/entrypoints/test_sleep_endpoints.py checks the single server), whichever server was called to
sleep, and serves again once the engine is awake, whichever server woke it.

Two levels: two AsyncLLM frontends joined to one engine core in this process (deterministic: one frontend is
made to miss the news, so the core's own refusal is what it meets), and a real `vllm serve --api-server-count 2`
on CPU, whose connections the kernel spreads over both servers (each request on a new connection)."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tests.entrypoints.conftest import MODEL, RemoteServer, start_server, stop_server

from vllm import SamplingParams

PROMPT = [5, 17, 42, 9, 300, 12]
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
# Requests per check, each on its own connection: all of them land on one server with probability 2^-(N-1).
NUM_REQUESTS = 12


def test_a_frontend_that_missed_the_sleep_refuses_with_the_same_error() -> None:
    """Frontend A puts the engine to sleep; frontend B learns it from the core's news and refuses on its own; a B
    that missed the news (its flag reset by hand) gets the core's refusal, which it turns into the same
    EngineSleepingError (n = 1 and n = 2). A wakes the engine; B hears it and serves the same tokens as before.
    Then the other way round: B sleeps, A wakes."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import launch_engine_core
    from vllm.v1.engine.sleep_mode import EngineSleepingError

    config = AsyncEngineArgs(max_model_len=128, max_num_seqs=4, enable_sleep_mode=True).create_engine_config()
    proc, handles, tmp_dir = launch_engine_core(config, 2)
    params = SamplingParams(**GREEDY)

    async def tokens(engine: AsyncLLM, request_id: str, params: SamplingParams = params) -> list[list[int]]:
        outs = [o async for o in engine.generate({"prompt_token_ids": PROMPT}, params, request_id)]
        return [c.token_ids for c in outs[-1].outputs]

    async def until(predicate: Any) -> None:
        deadline = time.monotonic() + 10
        while not predicate():
            assert time.monotonic() < deadline, "the frontend never heard the core's news"
            await asyncio.sleep(0.01)

    async def run() -> None:
        a, b = (AsyncLLM(config, core_handle=h) for h in handles)
        try:
            before = await tokens(a, "a0")
            assert await tokens(b, "b0") == before
            for sleeper, waker in ((a, b), (b, a)):
                other = b if sleeper is a else a
                await sleeper.sleep(level=1)
                await until(lambda: other.sleeping)  # noqa: B023
                with pytest.raises(EngineSleepingError):  # refused by the frontend itself
                    await tokens(other, f"x-{id(sleeper)}")
                other.sleeping = False  # as if the news had not arrived yet: the core refuses
                with pytest.raises(EngineSleepingError, match="asleep"):
                    await tokens(other, f"y-{id(sleeper)}")
                assert other.sleeping  # the refusal was news too
                other.sleeping = False
                with pytest.raises(EngineSleepingError):
                    await tokens(other, f"z-{id(sleeper)}", SamplingParams(temperature=1.0, max_tokens=8, n=2))
                assert not other.output_processor.request_states and not other.output_processor.parent_requests
                await waker.wake_up(tags=["weights"])  # one tag: still asleep everywhere
                assert await sleeper.is_sleeping() and sleeper.sleeping
                await waker.wake_up(tags=["kv_cache"])
                await until(lambda: not sleeper.sleeping and not waker.sleeping)  # noqa: B023
                assert await tokens(sleeper, f"s-{id(sleeper)}") == before
                assert await tokens(waker, f"w-{id(sleeper)}") == before
        finally:
            a.shutdown()
            b.shutdown()

    try:
        asyncio.run(run())
    finally:
        proc.terminate()
        proc.join(10)
        shutil.rmtree(tmp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def group() -> Iterator[RemoteServer]:
    srv = start_server(["--api-server-count", "2", "--enable-sleep-mode", "--max-model-len", "256",
                        "--max-num-seqs", "8", "--seed", "0"], {"VLLM_SERVER_DEV_MODE": "1"})
    yield srv
    stop_server(srv)


def _post(srv: RemoteServer, path: str, **kwargs: Any) -> httpx.Response:
    """One request on a connection of its own (so the kernel picks either server)."""
    return httpx.post(f"{srv.url}{path}", timeout=120, **kwargs)


def _completion(srv: RemoteServer, stream: bool) -> httpx.Response:
    return _post(srv, "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "stream": stream, **GREEDY})


def _assert_refused(resp: httpx.Response) -> None:
    """The single server's answer while asleep (test_sleep_endpoints.py): 503 and an OpenAI error body."""
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert "asleep" in error["message"] and error["type"] == "ServiceUnavailableError" and error["code"] == 503


def _stream_token_ids(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    ids: list[int] = []
    for event in resp.text.split("\n\n"):
        if event.startswith("data: ") and event != "data: [DONE]":
            body = json.loads(event[len("data: "):])
            assert "error" not in body, body
            ids += body["choices"][0]["token_ids"]
    return ids


def test_every_api_server_refuses_while_asleep_and_serves_after_the_wake(group: RemoteServer) -> None:
    def serves() -> list[int]:
        resp = _post(group, "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "return_token_ids": True,
                                                     **GREEDY})
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]

    reference = serves()
    # Both servers have served before the first sleep, as in a training loop (each has heard the core since).
    assert all(serves() == reference for _ in range(NUM_REQUESTS))
    # NOTE: several rounds, so that the sleep and the wake land on different servers in some of them (each call
    # is on a connection of its own too).
    for _ in range(3):
        assert _post(group, "/sleep", params={"level": "1"}).status_code == 200
        for _ in range(NUM_REQUESTS):
            _assert_refused(_completion(group, stream=False))
            _assert_refused(_completion(group, stream=True))
        assert httpx.get(f"{group.url}/is_sleeping", timeout=30).json() == {"is_sleeping": True}
        assert _post(group, "/wake_up", params={"tags": ["weights"]}).status_code == 200
        for _ in range(NUM_REQUESTS // 2):
            _assert_refused(_completion(group, stream=False))
        assert _post(group, "/wake_up", params={"tags": ["kv_cache"]}).status_code == 200
        assert httpx.get(f"{group.url}/is_sleeping", timeout=30).json() == {"is_sleeping": False}
        for _ in range(NUM_REQUESTS):
            assert serves() == reference
            streamed = _post(group, "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "stream": True,
                                                            "return_token_ids": True, **GREEDY})
            assert _stream_token_ids(streamed) == reference
