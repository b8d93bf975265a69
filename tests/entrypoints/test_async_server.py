"""`vllm serve` with async scheduling (the two-deep batch queue and the output thread, which a GPU runs by default),
here on CPU (no copy streams, staging slots or graphs), with deferred mask lists (built by the engine core when it
sends a step's outputs). Seeded requests return
the synchronous offline engine's tokens and masks; concurrent sampled streams get one mask per token with the
token inside; a dropped stream is aborted and frees its KV blocks."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.entrypoints.conftest import (API_KEY, RemoteServer, concurrent_streams, drop_stream, start_server,
                                       stop_server)
from tests.entrypoints.test_openai_server import DISCONNECT_MAX_TOKENS, _wait_for_metric, check_masks
from vllm import LLM, SamplingParams

PROMPTS = ["The meaning of", "A list is", "import numpy as"]


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    srv = start_server(["--return-sampling-mask", "--logprobs-mode", "processed_logprobs", "--max-model-len", "2048",
                        "--max-num-seqs", "16", "--api-key", API_KEY, "--async-scheduling"])
    yield srv
    stop_server(srv)


def test_seeded_requests_match_the_synchronous_engine(server: RemoteServer) -> None:
    """One request at a time (so every step has the same batch as the reference's): tokens and masks equal an
    in-process engine's with synchronous steps."""
    llm = LLM(server.model, device="cpu", max_model_len=2048, async_scheduling=False, return_sampling_mask=True,
              logprobs_mode="processed_logprobs")
    params = [SamplingParams(temperature=1.0, top_k=5, seed=10 + i, max_tokens=12, ignore_eos=True)
              for i in range(len(PROMPTS))]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)
    for i, prompt in enumerate(PROMPTS):
        ref = llm.generate([prompt], params[i], use_tqdm=False)[0].outputs[0]
        resp = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=1.0,
                                         seed=10 + i, extra_body={"top_k": 5, "ignore_eos": True,
                                                                  "return_token_ids": True})
        got = resp.choices[0].model_dump()
        assert got["token_ids"] == list(ref.token_ids)
        assert got["sampling_mask"] == [list(m) for m in ref.sampling_mask.token_ids]


def test_concurrent_sampled_streams(server: RemoteServer) -> None:
    results = concurrent_streams(server, [  # more than --max-num-seqs
        {"prompt": f"Request {i} says", "max_tokens": 24, "temperature": 1.0,
         "extra_body": {"top_k": 5, "return_token_ids": True, "ignore_eos": True}} for i in range(24)])
    assert len(results) == 24
    for token_ids, masks in results:
        assert len(token_ids) == 24
        check_masks(token_ids, masks)
    assert _wait_for_metric(server, "vllm:kv_cache_used_blocks", lambda v: v == 0) == 0


def test_dropped_stream_is_aborted(server: RemoteServer) -> None:
    drop_stream(server, {"prompt": "A long story:", "max_tokens": DISCONNECT_MAX_TOKENS, "ignore_eos": True,
                         "top_k": 5})
    _wait_for_metric(server, "vllm:kv_cache_used_blocks", lambda v: v == 0)
    _wait_for_metric(server, "vllm:num_requests_running", lambda v: v == 0)
    text = httpx.get(f"{server.url}/metrics").text
    assert 'finished_reason="abort"' in text
    # The server still serves.
    resp = httpx.post(f"{server.url}/v1/completions", headers=server.headers,
                      json={"prompt": "hi", "max_tokens": 3, "top_k": 5, "return_token_ids": True})
    assert resp.status_code == 200 and len(resp.json()["choices"][0]["token_ids"]) == 3
