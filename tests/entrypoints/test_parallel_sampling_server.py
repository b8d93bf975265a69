"""`n` through a real `vllm serve` process: /v1/completions (JSON and SSE), /v1/chat/completions and
/inference/v1/generate return n choices numbered by sample, each with its own sampling mask.

Reference: sample j of a seeded request equals the same request sent with n=1 and seed + j (vLLM's child-seed
rule); a stream's chunks, concatenated per choice index, equal the non-streamed choices.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, RemoteServer, drop_stream, start_server, stop_server

TOP_K = 8
SEED = 321


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    srv = start_server(["--return-sampling-mask", "--logprobs-mode", "processed_logprobs", "--max-model-len", "128",
                        "--max-num-seqs", "8", "--api-key", API_KEY])
    yield srv
    stop_server(srv)


def post(server: RemoteServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def sse_events(server: RemoteServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    resp = httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=120)
    assert resp.status_code == 200, resp.text
    events = [line[len("data: "):] for line in resp.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def check_masks(token_ids: list[int], masks: list[list[int]] | None) -> None:
    assert masks is not None and len(masks) == len(token_ids) > 0
    for token_id, mask in zip(token_ids, masks):
        assert token_id in mask and mask == sorted(set(mask))


def completion_body(n: int, seed: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": "The function", "max_tokens": 5, "temperature": 1.0, "top_k": TOP_K, "seed": seed,
            "ignore_eos": True, "return_token_ids": True, "n": n, **extra}


def test_completions_n3_json_and_stream(server: RemoteServer) -> None:
    body = completion_body(3, SEED)
    out = post(server, "/v1/completions", body)
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for j, c in enumerate(choices):
        check_masks(c["token_ids"], c["sampling_mask"])
        single = post(server, "/v1/completions", completion_body(1, SEED + j))["choices"][0]
        assert (c["token_ids"], c["text"], c["sampling_mask"]) == (single["token_ids"], single["text"],
                                                                  single["sampling_mask"])
    assert len({tuple(c["token_ids"]) for c in choices}) > 1
    usage = out["usage"]
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in choices) == 15
    assert usage["total_tokens"] == usage["prompt_tokens"] + 15 and usage["prompt_tokens"] > 0

    events = sse_events(server, "/v1/completions", {**body, "stream": True,
                                                    "stream_options": {"include_usage": True}})
    streamed: dict[int, dict[str, Any]] = {}
    for event in events[:-1]:
        [c] = event["choices"]
        acc = streamed.setdefault(c["index"], {"text": "", "token_ids": [], "mask": [], "finish": None})
        acc["text"] += c["text"]
        acc["token_ids"] += c["token_ids"]
        acc["mask"] += c["sampling_mask"]
        acc["finish"] = c["finish_reason"] or acc["finish"]
    assert sorted(streamed) == [0, 1, 2]
    for c in choices:
        acc = streamed[c["index"]]
        assert (acc["text"], acc["token_ids"], acc["mask"], acc["finish"]) == (
            c["text"], c["token_ids"], c["sampling_mask"], c["finish_reason"])
    assert events[-1]["usage"] == usage


def test_completions_n2_two_prompts_numbering(server: RemoteServer) -> None:
    out = post(server, "/v1/completions", {**completion_body(2, SEED), "prompt": ["The function", "A module is"]})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    single = post(server, "/v1/completions", {**completion_body(1, SEED + 1), "prompt": "A module is"})
    assert out["choices"][3]["token_ids"] == single["choices"][0]["token_ids"]


def test_chat_n2(server: RemoteServer) -> None:
    body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4, "temperature": 1.0,
            "top_k": TOP_K, "seed": SEED, "ignore_eos": True, "return_token_ids": True, "n": 2}
    out = post(server, "/v1/chat/completions", body)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for j, c in enumerate(out["choices"]):
        check_masks(c["token_ids"], c["sampling_mask"])
        single = post(server, "/v1/chat/completions", {**body, "n": 1, "seed": SEED + j})["choices"][0]
        assert (c["token_ids"], c["message"]["content"]) == (single["token_ids"], single["message"]["content"])
    assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in out["choices"])

    events = sse_events(server, "/v1/chat/completions", {**body, "stream": True})
    roles = [e["choices"][0]["index"] for e in events if e["choices"][0]["delta"].get("role") == "assistant"]
    assert roles == [0, 1]
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for event in events:
        for c in event["choices"]:
            streamed[c["index"]] += c["token_ids"] or []
    assert [streamed[0], streamed[1]] == [c["token_ids"] for c in out["choices"]]


def test_generate_n2(server: RemoteServer) -> None:
    params = {"temperature": 1.0, "top_k": TOP_K, "seed": SEED, "max_tokens": 4, "ignore_eos": True, "n": 2}
    out = post(server, "/inference/v1/generate", {"token_ids": [5, 17, 42, 9], "sampling_params": params})
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for j, c in enumerate(out["choices"]):
        check_masks(c["token_ids"], c["sampling_mask"])
        single = post(server, "/inference/v1/generate", {"token_ids": [5, 17, 42, 9],
                                                         "sampling_params": {**params, "n": 1, "seed": SEED + j}})
        assert c["token_ids"] == single["choices"][0]["token_ids"]
    assert out["usage"]["completion_tokens"] == 8
    events = sse_events(server, "/inference/v1/generate", {"token_ids": [5, 17, 42, 9], "sampling_params": params,
                                                           "stream": True})
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for event in events:
        for c in event["choices"]:
            streamed[c["index"]] += c["token_ids"]
    assert [streamed[0], streamed[1]] == [c["token_ids"] for c in out["choices"]]


def metric(server: RemoteServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


def wait_for_metric(server: RemoteServer, name: str, predicate: Callable[[float], bool]) -> float:
    deadline = time.monotonic() + 60
    value = float("nan")
    while time.monotonic() < deadline:
        value = metric(server, name)
        if predicate(value):
            return value
        time.sleep(0.1)
    raise AssertionError(f"{name} stayed at {value}")


def num_aborted(server: RemoteServer) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    # NOTE: any label order (the engine label is one of them), summed over the engines.
    found = re.findall(r'^vllm:request_success_total{[^}]*finished_reason="abort"[^}]*} ([0-9.e+-]+)$', text,
                       re.MULTILINE)
    return sum(float(v) for v in found)


def test_disconnected_n3_stream_aborts_every_child(server: RemoteServer) -> None:
    # NOTE: the longest output the server allows, and the connection is closed right after the first chunks:
    # the children must be aborted long before they could reach max_tokens.
    body = {**completion_body(3, SEED), "max_tokens": 120}
    aborted_before = num_aborted(server)
    drop_stream(server, body)
    wait_for_metric(server, "vllm:num_requests_running", lambda v: v == 0)
    wait_for_metric(server, "vllm:kv_cache_used_blocks", lambda v: v == 0)
    # NOTE: the children count as engine requests: all three end as aborts, none runs to max_tokens.
    assert num_aborted(server) - aborted_before == 3
