"""End to end through a real `vllm serve` process (see conftest.py): completions, chat, streaming and
/inference/v1/generate return one sampling mask per generated token with the token inside it; 64 concurrent
streams; invalid requests get OpenAI-style 4xx bodies; a dropped stream frees its KV blocks; killing the
engine-core process makes the server exit non-zero. The tests run in file order; the last one kills the server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.conftest import RemoteServer, concurrent_streams, drop_stream

TOP_K = 5
MASK_ARGS: dict[str, Any] = {"top_k": TOP_K, "return_token_ids": True}


def check_masks(token_ids: list[int], masks: list[list[int]] | None, top_k: int = TOP_K) -> None:
    assert masks is not None
    assert len(masks) == len(token_ids) > 0
    for token_id, mask in zip(token_ids, masks):
        assert token_id in mask
        assert mask == sorted(set(mask))
        assert 1 <= len(mask)
        # NOTE: a top-k boundary tie may keep more than k ids; the tiny model's float32 logits rarely tie.
        assert len(mask) <= top_k or len(mask) < 4 * top_k


def sse_events(text: str) -> list[Any]:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


def test_info_endpoints(server: RemoteServer, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [server.model]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "version" in httpx.get(f"{server.url}/version").json()
    text = httpx.get(f"{server.url}/metrics").text
    assert metric(text, "vllm:num_gpu_blocks") > 0
    assert metric(text, "vllm:kv_cache_used_blocks") == 0


def test_completion_masks_and_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=client.models.list().data[0].id, prompt="The meaning of", max_tokens=6,
                                     temperature=1.0, logprobs=2, extra_body=MASK_ARGS)
    choice = resp.choices[0]
    data = choice.model_dump()
    check_masks(data["token_ids"], data["sampling_mask"])
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens) == len(data["token_ids"])
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(lp.tokens)
    assert all(x is not None and x <= 0.0 for x in lp.token_logprobs)
    assert "".join(lp.tokens) == choice.text or choice.finish_reason == "stop"
    assert resp.usage is not None and resp.usage.completion_tokens == len(data["token_ids"])


def test_completion_opt_out_returns_no_mask(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=client.models.list().data[0].id, prompt="Hello", max_tokens=3,
                                     temperature=0.0, extra_body={"return_sampling_mask": False})
    assert resp.choices[0].model_dump().get("sampling_mask") is None


def test_chat_masks_and_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Say something."}],
        max_tokens=6, logprobs=True, top_logprobs=2, extra_body=MASK_ARGS)
    data = resp.choices[0].model_dump()
    check_masks(data["token_ids"], data["sampling_mask"])
    content = resp.choices[0].logprobs.content
    assert content is not None and len(content) == len(data["token_ids"])
    for entry in content:
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) <= 2
        assert entry.bytes == list(entry.token.encode())


def test_streaming_completion_and_chat(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    token_ids: list[int] = []
    masks: list[list[int]] = []
    text = ""
    for chunk in client.completions.create(model=model, prompt="Once upon", max_tokens=8, stream=True,
                                           extra_body={**MASK_ARGS, "ignore_eos": True}):
        c = chunk.choices[0].model_dump()
        assert len(c["token_ids"]) == len(c["sampling_mask"])
        token_ids += c["token_ids"]
        masks += c["sampling_mask"]
        text += c["text"]
    assert len(token_ids) == 8
    check_masks(token_ids, masks)

    token_ids, masks = [], []
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5, stream=True, extra_body=MASK_ARGS):
        c = chunk.choices[0].model_dump()
        if c["token_ids"] is not None:
            assert len(c["token_ids"]) == len(c["sampling_mask"])
            token_ids += c["token_ids"]
            masks += c["sampling_mask"]
    check_masks(token_ids, masks)


def test_generate_endpoint(server: RemoteServer) -> None:
    body = {"token_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 6, "top_k": 3, "logprobs": 1,
                                                           "ignore_eos": True}}
    resp = httpx.post(f"{server.url}/inference/v1/generate", json=body, headers=server.headers, timeout=60)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    choice = data["choices"][0]
    assert isinstance(data["request_id"], str) and choice["finish_reason"] == "length"
    check_masks(choice["token_ids"], choice["sampling_mask"], top_k=3)
    assert len(choice["logprobs"]["content"]) == 6

    body = {**body, "stream": True, "request_id": "gen-stream-1"}
    resp = httpx.post(f"{server.url}/inference/v1/generate", json=body, headers=server.headers, timeout=60)
    assert resp.status_code == 200
    token_ids: list[int] = []
    masks: list[list[int]] = []
    for event in sse_events(resp.text):
        assert event["request_id"] == "gen-stream-1"
        c = event["choices"][0]
        assert len(c["token_ids"]) == len(c["sampling_mask"])
        token_ids += c["token_ids"]
        masks += c["sampling_mask"]
    assert len(token_ids) == 6
    check_masks(token_ids, masks, top_k=3)


def test_64_concurrent_streams(server: RemoteServer) -> None:
    results = concurrent_streams(server, [
        {"prompt": f"Request {i} says", "max_tokens": 4, "extra_body": {**MASK_ARGS, "ignore_eos": True}}
        for i in range(64)])
    assert len(results) == 64
    for token_ids, masks in results:
        assert len(token_ids) == 4
        check_masks(token_ids, masks)


LONG_PROMPT = "word " * 2100

INVALID_REQUESTS: list[tuple[str, Any]] = [
    ("/v1/completions", {"max_tokens": 4, "top_k": 5}),  # missing prompt
    ("/v1/completions", {"prompt": "", "top_k": 5}),
    ("/v1/completions", {"prompt": "hi", "top_k": 5, "temperature": -1}),
    ("/v1/completions", {"prompt": "hi", "top_k": 5, "top_p": 0}),
    ("/v1/completions", {"prompt": "hi", "top_k": 5, "top_p": 1.5}),
    ("/v1/completions", {"prompt": "hi", "top_k": -3}),
    ("/v1/completions", {"prompt": "hi", "top_k": 5, "min_p": 2}),
    ("/v1/completions", {"prompt": "hi", "top_k": 5, "max_tokens": 0}),
    ("/v1/completions", {"prompt": "hi", "top_k": 5, "max_tokens": "many"}),
    ("/v1/completions", {"prompt": "hi", "top_k": 5, "n": 0}),
    ("/v1/completions", {"prompt": "hi", "top_k": 5, "logprobs": 1000}),
    ("/v1/completions", {"prompt": "hi", "top_k": 5, "min_tokens": 9, "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi"}),  # mask rule: top_k must be > 0
    ("/v1/completions", {"prompt": "hi", "top_k": 5, "temperature": 0}),  # mask rule: temperature > 0
    ("/v1/completions", {"prompt": LONG_PROMPT, "top_k": 5}),  # longer than max_model_len
    ("/v1/completions", {"prompt": [10 ** 9], "top_k": 5}),  # token id out of vocabulary
    ("/v1/completions", {"prompt": "hi", "top_k": 5, "stop_token_ids": [-1]}),
    ("/v1/completions", "{not json"),
    ("/v1/completions", [1, 2, 3]),
    ("/v1/completions", {"prompt": "hi", "top_k": 5, "model": "no-such-model"}),  # 404
    ("/v1/chat/completions", {"top_k": 5}),  # missing messages
    ("/v1/chat/completions", {"messages": [], "top_k": 5}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}], "top_k": 5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_k": 5, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": "hello", "top_k": 5}),
    ("/inference/v1/generate", {"sampling_params": {"top_k": 5}}),  # missing token_ids
    ("/inference/v1/generate", {"token_ids": [], "sampling_params": {"top_k": 5}}),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"top_k": 5, "bogus": 1}}),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"top_k": 5, "temperature": "hot"}}),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"top_k": 5, "output_kind": 0}}),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"top_k": 0}}),
    ("/inference/v1/generate", {"token_ids": ["a"], "sampling_params": {"top_k": 5}}),
]


def test_invalid_requests_get_4xx_and_server_keeps_serving(server: RemoteServer) -> None:
    assert len(INVALID_REQUESTS) >= 20
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as http:
        for path, body in INVALID_REQUESTS:
            content = body if isinstance(body, str) else json.dumps(body)
            resp = http.post(path, content=content, headers={"Content-Type": "application/json"})
            expected = 404 if isinstance(body, dict) and body.get("model") == "no-such-model" else 400
            assert resp.status_code == expected, (path, body, resp.status_code, resp.text)
            error = resp.json()["error"]
            assert error["code"] == expected and isinstance(error["message"], str) and error["message"]
            assert {"type", "param"} <= set(error)
        # Auth: a missing or wrong key is 401.
        for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
            resp = http.post("/v1/completions", json={"prompt": "hi", "top_k": 5}, headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == 401
        resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "top_k": 5,
                                                  "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        check_masks(resp.json()["choices"][0]["token_ids"], resp.json()["choices"][0]["sampling_mask"])


# NOTE: the disconnect tests need a request still generating when the client goes away. The tiny model writes a few
# hundred tokens in well under a second on a fast machine, so they ask for most of the 2048-token context.
DISCONNECT_MAX_TOKENS = 1900


def _wait_for_metric(server: RemoteServer, name: str, predicate: Any, timeout_s: float = 30) -> float:
    deadline = time.monotonic() + timeout_s
    value = float("nan")
    while time.monotonic() < deadline:
        value = metric(httpx.get(f"{server.url}/metrics").text, name)
        if predicate(value):
            return value
        time.sleep(0.1)
    raise AssertionError(f"{name} stayed at {value}")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/inference/v1/generate"])
def test_disconnected_stream_is_aborted_and_frees_kv_blocks(server: RemoteServer, path: str) -> None:
    """A client that closes its stream mid-generation: the request is aborted (one abort counted) and its KV
    blocks freed, on each streaming endpoint."""
    before = _aborts(server)
    params: dict[str, Any] = {"max_tokens": DISCONNECT_MAX_TOKENS, "ignore_eos": True, "top_k": 5}
    if path == "/inference/v1/generate":
        body: dict[str, Any] = {"token_ids": [1, 450, 1472, 582, 2901], "sampling_params": params}
    elif path == "/v1/chat/completions":
        body = {**params, "model": server.model, "messages": [{"role": "user", "content": "Tell me a long story."}]}
    else:
        body = {**params, "prompt": "A long story:"}
    drop_stream(server, body, path=path,
                while_open=lambda: _wait_for_metric(server, "vllm:kv_cache_used_blocks", lambda v: v > 0))
    _check_one_abort_and_blocks_freed(server, before)
    assert metric(httpx.get(f"{server.url}/metrics").text, "vllm:kv_cache_usage_perc") == 0


def _aborts(server: RemoteServer) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(r'vllm:request_success_total{[^}]*finished_reason="abort"[^}]*} ([0-9.e+]+)', text)
    return float(match.group(1)) if match else 0.0


def _check_one_abort_and_blocks_freed(server: RemoteServer, aborts_before: float) -> None:
    _wait_for_metric(server, "vllm:kv_cache_used_blocks", lambda v: v == 0)
    _wait_for_metric(server, "vllm:num_requests_running", lambda v: v == 0)
    deadline = time.monotonic() + 30
    while _aborts(server) < aborts_before + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _aborts(server) == aborts_before + 1


def test_disconnected_non_streaming_request_is_aborted(server: RemoteServer) -> None:
    """A non-streaming client that closes its connection mid-generation gets its request aborted: KV blocks freed
    and one more abort counted."""
    before = _aborts(server)
    body = json.dumps({"prompt": "A very long story:", "max_tokens": DISCONNECT_MAX_TOKENS, "ignore_eos": True,
                       "top_k": 5}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {server.headers['Authorization'].split()[-1]}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body)
        assert _wait_for_metric(server, "vllm:kv_cache_used_blocks", lambda v: v > 0) > 0
    # The socket is closed while the engine is still generating (no response was read).
    _check_one_abort_and_blocks_freed(server, before)


def test_killing_engine_core_exits_server_nonzero(server: RemoteServer) -> None:
    pid = server.engine_core_pid()
    os.kill(pid, signal.SIGKILL)
    try:
        returncode = server.proc.wait(60)
    except Exception:
        server.proc.kill()
        raise
    assert returncode != 0
