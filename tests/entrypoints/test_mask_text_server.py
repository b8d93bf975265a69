"""`vllm serve --return-sampling-mask`: masks formatted as JSON text on the device and spliced into the responses
(the engine core copies the text and counts, not the ids). A seeded request's masks, streamed and not, equal
those of the same request in an in-process engine (built from the id arrays), and every token is inside its
mask; the same for streamed chat completions against the whole chat response."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from tests.entrypoints.conftest import RemoteServer, start_server, stop_server
from vllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def text_server() -> Iterator[RemoteServer]:
    srv = start_server(["--return-sampling-mask", "--logprobs-mode", "processed_logprobs", "--max-model-len", "256",
                        "--max-num-seqs", "8", "--seed", "0"])
    yield srv
    stop_server(srv)


def _reference(model: str, prompt: str, params: SamplingParams) -> tuple[list[int], list[list[int]]]:
    """The tokens and masks (as id lists) of the same seeded request in an in-process engine."""
    llm = LLM(model, device="cpu", max_model_len=256, return_sampling_mask=True, logprobs_mode="processed_logprobs")
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [list(m) for m in out.sampling_mask.token_ids]


def test_streamed_text_masks_equal_the_id_masks(text_server: RemoteServer) -> None:
    url = f"{text_server.url}/v1/completions"
    body = {"prompt": "def main(", "max_tokens": 12, "temperature": 1.0, "top_k": 40, "top_p": 0.9, "seed": 11,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 1}
    full = httpx.post(url, json=body, timeout=120).json()["choices"][0]
    want_ids, want_masks = _reference(text_server.model, body["prompt"], SamplingParams(
        temperature=1.0, top_k=40, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True, logprobs=1))
    assert full["token_ids"] == want_ids and full["sampling_mask"] == want_masks
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
