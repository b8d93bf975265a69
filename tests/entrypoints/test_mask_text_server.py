"""`vllm serve --return-sampling-mask` with VLLM_SAMPLING_MASK_TEXT=1 (the default: masks formatted as JSON text by
the engine and spliced into streamed chunks; with VLLM_SAMPLING_MASK_COPY_IDS=1 and =0, the ids copied to the
engine core's host memory too or not, the first with the mask lists built by the output thread) and =0 (the API
server formats the ids): the streamed masks equal
those of the same seeded request without streaming (built from the id arrays), and every token is inside its
mask; the same for streamed chat completions."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from tests.entrypoints.conftest import RemoteServer, start_server, stop_server


# The non-streamed completion of each server mode: the text modes' (masks sent and spliced as the engine's text)
# must equal the ids mode's (masks from the id arrays, formatted by pydantic) for the same seeded request.
_FULL: dict[str, dict] = {}


# Server modes: the engine's text with its ids copied to the host too (and the mask lists built by the output
# thread, VLLM_ENGINE_DEFER_MASK_LISTS=0; the default builds them when the step is sent), the text alone (the ids
# stay on the device), the ids alone (VLLM_SAMPLING_MASK_TEXT=0).
_MODES = {"text": {"VLLM_SAMPLING_MASK_TEXT": "1", "VLLM_SAMPLING_MASK_COPY_IDS": "1",
                   "VLLM_ENGINE_DEFER_MASK_LISTS": "0"},
          "text_only": {"VLLM_SAMPLING_MASK_TEXT": "1", "VLLM_SAMPLING_MASK_COPY_IDS": "0"},
          "ids": {"VLLM_SAMPLING_MASK_TEXT": "0"}}


@pytest.fixture(scope="module", params=list(_MODES))
def text_server(request: pytest.FixtureRequest) -> Iterator[RemoteServer]:
    srv = start_server(["--return-sampling-mask", "--logprobs-mode", "processed_logprobs", "--max-model-len", "256",
                        "--max-num-seqs", "8", "--seed", "0"], _MODES[request.param])
    srv.mode = request.param  # type: ignore[attr-defined]
    yield srv
    stop_server(srv)


def test_streamed_text_masks_equal_the_id_masks(text_server: RemoteServer) -> None:
    url = f"{text_server.url}/v1/completions"
    body = {"prompt": "def main(", "max_tokens": 12, "temperature": 1.0, "top_k": 40, "top_p": 0.9, "seed": 11,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 1}
    full = httpx.post(url, json=body, timeout=120).json()["choices"][0]
    _FULL[text_server.mode] = full  # type: ignore[attr-defined]
    first = next(iter(_FULL.values()))  # every later mode's whole response agrees with the first mode's
    assert full["token_ids"] == first["token_ids"] and full["sampling_mask"] == first["sampling_mask"]
    resp = httpx.post(url, json={**body, "stream": True}, timeout=120)
    assert resp.status_code == 200
    token_ids: list[int] = []
    masks: list[list[int]] = []
    for line in resp.text.split("\n\n"):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[len("data: "):])["choices"]:
            assert len(choice["token_ids"]) == len(choice["sampling_mask"])
            token_ids += choice["token_ids"]
            masks += choice["sampling_mask"]
    assert token_ids == full["token_ids"] and len(token_ids) == 12
    assert masks == full["sampling_mask"]
    for token_id, mask in zip(token_ids, masks):
        assert token_id in mask and mask == sorted(set(mask)) and len(mask) <= 40


def test_streamed_chat_masks_equal_the_id_masks(text_server: RemoteServer) -> None:
    url = f"{text_server.url}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 10, "temperature": 1.0, "top_k": 30,
            "top_p": 0.9, "seed": 5, "ignore_eos": True, "return_token_ids": True, "logprobs": True}
    full = httpx.post(url, json=body, timeout=120).json()["choices"][0]
    resp = httpx.post(url, json={**body, "stream": True}, timeout=120)
    assert resp.status_code == 200
    token_ids: list[int] = []
    masks: list[list[int]] = []
    contents: list[str] = []
    for line in resp.text.split("\n\n"):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        assert chunk["object"] == "chat.completion.chunk"
        for choice in chunk["choices"]:
            if choice["delta"].get("role") == "assistant":
                assert choice["sampling_mask"] is None
                continue
            assert len(choice["token_ids"]) == len(choice["sampling_mask"]) == len(choice["logprobs"]["content"])
            token_ids += choice["token_ids"]
            masks += choice["sampling_mask"]
            contents.append(choice["delta"]["content"])
    assert token_ids == full["token_ids"] and len(token_ids) == 10
    assert masks == full["sampling_mask"] and "".join(contents) == full["message"]["content"]
    for token_id, mask in zip(token_ids, masks):
        assert token_id in mask and mask == sorted(set(mask)) and len(mask) <= 30
