"""Prefix caching through `vllm serve` (block_size 4, --enable-prompt-tokens-details, RL endpoints):
usage.prompt_tokens_details.cached_tokens on completions (plain and streamed), chat and generate; cache_salt on
each of them (vLLM's 400 for an empty or non-string salt); POST /reset_prefix_cache with vLLM's 409 while a
request holds blocks; the Prometheus counters.

Expected hits are worked out by hand: a repeated prompt of P tokens finds (P - 1) // 4 * 4 tokens cached (whole
blocks, never the last token).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from conftest import MODEL, RemoteServer, start_server, stop_server

PROMPT = list(range(40, 58))  # 18 tokens: 16 cached on a repeat


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    srv = start_server(["--block-size", "4", "--max-model-len", "128", "--enable-prompt-tokens-details",
                        "--enable-rl-endpoints"])
    yield srv
    stop_server(srv)


def _complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, **body}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _cached(response: dict[str, Any]) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_completions_report_cached_tokens_and_salts_isolate(server: RemoteServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/reset_prefix_cache").status_code == 200
        first = _complete(http)
        assert _cached(first) == 0 and first["usage"]["prompt_tokens"] == 18
        again = _complete(http)
        assert _cached(again) == 16 and again["choices"][0]["text"] == first["choices"][0]["text"]
        assert _cached(_complete(http, cache_salt="user-a")) == 0
        assert _cached(_complete(http, cache_salt="user-b")) == 0
        assert _cached(_complete(http, cache_salt="user-a")) == 16
        # Streamed: the final usage chunk carries it.
        with http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}}) as resp:
            usage = [line for line in resp.iter_lines() if '"usage":{' in line.replace(" ", "")]
        assert len(usage) == 1 and '"cached_tokens":16' in usage[0].replace(" ", "")
        for bad in ("", 5):
            resp = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "cache_salt": bad})
            assert resp.status_code == 400, resp.text
            assert "cache_salt" in resp.text


def test_chat_and_generate_take_a_salt(server: RemoteServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "cache_salt": "chat-salt",
                "messages": [{"role": "user", "content": "Tell me about block tables and paged attention."}]}
        first = http.post("/v1/chat/completions", json=body).json()
        second = http.post("/v1/chat/completions", json=body).json()
        n = first["usage"]["prompt_tokens"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 4 * 4
        other = http.post("/v1/chat/completions", json={**body, "cache_salt": "other"}).json()
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert http.post("/v1/chat/completions", json={**body, "cache_salt": ""}).status_code == 400
        gen = {"token_ids": list(range(60, 70)), "sampling_params": {"max_tokens": 2}, "cache_salt": "gen"}
        assert http.post("/inference/v1/generate", json=gen).json()["usage"]["prompt_tokens_details"] == \
            {"cached_tokens": 0}
        assert http.post("/inference/v1/generate", json=gen).json()["usage"]["prompt_tokens_details"] == \
            {"cached_tokens": 8}
        assert http.post("/inference/v1/generate", json={**gen, "cache_salt": ""}).status_code == 400


def test_reset_prefix_cache_is_409_while_blocks_are_held(server: RemoteServer) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        _complete(http)
        long = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": True}
        started, done = threading.Event(), threading.Event()
        texts: list[str] = []

        def stream() -> None:
            with httpx.Client(base_url=server.url, timeout=120) as h:
                with h.stream("POST", "/v1/completions", json=long) as resp:
                    for line in resp.iter_lines():
                        started.set()
                        texts.append(line)
            done.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        resp = http.post("/reset_prefix_cache")
        assert resp.status_code == 409 and "reset_running_requests" in resp.json()["error"]["message"]
        assert http.post("/reset_prefix_cache", params={"reset_running_requests": "true"}).status_code == 200
        assert done.wait(120)
        t.join()
        # The preempted stream went on to its end (recomputed, not cut).
        assert texts[-1] == "data: [DONE]" or texts[-2] == "data: [DONE]"
        assert http.post("/reset_prefix_cache").status_code == 200
        assert _cached(_complete(http)) == 0


def test_prometheus_counters(server: RemoteServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        def counters() -> dict[str, float]:
            text = http.get("/metrics").text
            return {k: float(v) for k, v in
                    re.findall(r"^vllm:prefix_cache_(queries|hits)_total\{[^}]*\} (\S+)$", text, re.MULTILINE)}

        before = counters()
        _complete(http, prompt=list(range(200, 210)))  # 10 tokens, new
        _complete(http, prompt=list(range(200, 210)))  # 8 cached
        after = counters()
        assert after["queries"] - before["queries"] == 20 and after["hits"] - before["hits"] == 8
