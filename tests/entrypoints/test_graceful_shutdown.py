"""SIGTERM with requests in flight, against a real `vllm serve --shutdown-timeout 2` (tiny model, CPU): a request
that finishes within the grace is served whole; the ones still running when it ends get an OpenAI error, a 503
JSON body when not streamed, an error event then `data: [DONE]` when streamed (never a plain-text 500 or a cut
stream); no new connection is accepted; the process exits 0 soon after the grace.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx

from tests.entrypoints.conftest import API_KEY, start_server

GRACE_S = 2.0
LONG = {"prompt": "hi", "max_tokens": 2000, "ignore_eos": True, "temperature": 1.0, "top_k": 5}


def test_sigterm_serves_within_the_grace_then_ends_the_rest_with_errors() -> None:
    srv = start_server(["--max-model-len", "2048", "--max-num-seqs", "8", "--api-key", API_KEY, "--seed", "0",
                        "--shutdown-timeout", str(GRACE_S)])
    results: dict[str, Any] = {}
    stream_lines: list[str] = []
    streaming = threading.Event()

    def stream() -> None:
        with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp:
                results["stream_status"] = resp.status_code
                for line in resp.iter_lines():
                    if line:
                        stream_lines.append(line)
                        streaming.set()

    def whole() -> None:
        with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=60) as http:
            results["whole"] = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], **{k: v for k, v in LONG.items() if k != "prompt"}})

    def short() -> None:
        with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=60) as http:
            results["short"] = http.post("/v1/completions", json={**LONG, "max_tokens": 4})

    try:
        threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for t in threads:
            t.start()
        assert streaming.wait(60)
        time.sleep(0.3)  # the non-streamed request is running too
        short_thread = threading.Thread(target=short)
        short_thread.start()
        time.sleep(0.1)
        signalled = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        short_thread.join(30)
        time.sleep(0.5)
        try:
            refused: Any = httpx.get(f"{srv.url}/health", timeout=5)
        except httpx.HTTPError as e:  # the listening socket is closed
            refused = e
        for t in threads:
            t.join(60)
        ended = time.monotonic()
        code = srv.proc.wait(30)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()

    assert code == 0
    # Served within the grace.
    assert results["short"].status_code == 200, results["short"].text
    assert results["short"].json()["usage"]["completion_tokens"] == 4
    # Not accepted after the signal: no connection, or a 503 OpenAI error on one still open.
    assert isinstance(refused, httpx.HTTPError) or refused.status_code == 503
    # The non-streamed request: a 503 with the OpenAI error body, once the grace was over.
    whole_resp = results["whole"]
    assert whole_resp.status_code == 503, whole_resp.text
    assert whole_resp.headers["content-type"].startswith("application/json")
    error = whole_resp.json()["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError" and "--shutdown-timeout" in \
        error["message"]
    # The stream: chunks, then an error event, then [DONE].
    assert results["stream_status"] == 200
    assert stream_lines[-1] == "data: [DONE]", stream_lines[-3:]
    last_event = json.loads(stream_lines[-2].removeprefix("data: "))
    assert last_event["error"]["code"] == 503 and last_event["error"]["type"] == "ServiceUnavailableError"
    chunks = [json.loads(line.removeprefix("data: ")) for line in stream_lines[:-2]]
    assert chunks and all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert GRACE_S - 0.5 <= ended - signalled <= GRACE_S + 10
