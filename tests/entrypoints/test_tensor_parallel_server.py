"""`vllm serve --tensor-parallel-size 2` on CPU (gloo): a streamed completion with sampling masks equals the same
seeded request in an in-process TP=1 engine, chunk by chunk aligned; /collective_rpc answers once per rank, in
rank order; /get_world_size says 2; a killed worker process ends the server (non-zero) instead of a hang."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import httpx
import pytest
from tests.entrypoints.conftest import RemoteServer, start_server, stop_server
from vllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def tp_server() -> Iterator[RemoteServer]:
    srv = start_server(["--tensor-parallel-size", "2", "--return-sampling-mask", "--logprobs-mode",
                        "processed_logprobs", "--max-model-len", "256", "--max-num-seqs", "8", "--seed", "0",
                        "--enable-rl-endpoints"])
    yield srv
    stop_server(srv)


def test_streamed_masks_equal_tp1(tp_server: RemoteServer) -> None:
    body = {"prompt": "def main(", "max_tokens": 12, "temperature": 1.0, "top_k": 40, "top_p": 0.9, "seed": 11,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    resp = httpx.post(f"{tp_server.url}/v1/completions", json=body, timeout=120)
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
    llm = LLM(tp_server.model, device="cpu", max_model_len=256, return_sampling_mask=True,
              logprobs_mode="processed_logprobs")
    want = llm.generate([body["prompt"]], SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=11,
                                                         max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert token_ids == list(want.token_ids) and len(token_ids) == 12
    assert masks == [list(m) for m in want.sampling_mask.token_ids]


def test_collective_rpc_and_world_size(tp_server: RemoteServer) -> None:
    with httpx.Client(base_url=tp_server.url, timeout=60) as http:
        resp = http.post("/collective_rpc", json={"method": "weight_info"})
        assert resp.status_code == 200, resp.text
        results = resp.json()["results"]
        assert len(results) == 2 and all("model.embed_tokens.weight" in r for r in results)
        assert http.get("/get_world_size").json() == {"world_size": 2}


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def test_killing_a_worker_exits_the_server_nonzero(tp_server: RemoteServer) -> None:
    """Last in the module: rank 1's process dies; the engine core ends, so the server does (as when the engine
    core itself dies), instead of serving requests that would wait for the lost rank."""
    core = tp_server.engine_core_pid()
    workers = []
    for pid in _children(core):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                workers.append(pid)
    assert len(workers) == 1  # rank 1; rank 0 is the engine core itself
    os.kill(workers[0], signal.SIGKILL)
    try:
        returncode = tp_server.proc.wait(60)
    except Exception:
        tp_server.proc.kill()
        raise
    assert returncode != 0
