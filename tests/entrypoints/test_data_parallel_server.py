"""`vllm serve --data-parallel-size 2` on CPU: two engine cores behind one API server (and behind two).

References: a fresh offline engine (one engine, the same checkpoint and settings) gives every seeded request's
tokens and masks, which each DP stream must equal whichever engine served it; the per-engine metrics
(`engine="i"`) count which engine served what; a worker-extension probe reports the rank each engine's config
carries. Checked: 64 concurrent streams with masks (aligned, equal to the reference, both engines used), the
X-data-parallel-rank header, pause / resume and a weight update from disk reaching both engines (outputs of each
equal a fresh engine on the new checkpoint), collective_rpc run by every engine and answered with engine 0's
workers' results (vLLM's shape; the header names one engine), and a rank that dies
taking the server down (in-flight streams end, non-zero exit) instead of hanging it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.entrypoints.conftest import MODEL, REPO_ROOT, RemoteServer, spawn_children, start_server, stop_server

sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "v1", "e2e"))
from rl_checkpoints import perturbed_weights, write_checkpoint  # noqa: E402

from vllm import LLM, SamplingParams  # noqa: E402

MAX_MODEL_LEN = 512
MAX_TOKENS = 6
SEEDED = {"temperature": 1.0, "top_k": 8, "top_p": 0.9, "max_tokens": MAX_TOKENS, "ignore_eos": True}
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "return_sampling_mask": False}
HEADER = "X-data-parallel-rank"


def _prompt(i: int) -> list[int]:
    return [5, 17, 42, 9, 300 + i, 12]


def engine_metric(text: str, name: str, engine: int) -> float:
    """The sum of `name`'s samples labelled engine="<engine>"."""
    total = 0.0
    for labels, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.e+-]+)$", text, re.MULTILINE):
        if f'engine="{engine}"' in labels:
            total += float(value)
    return total


def _tokens(http: httpx.Client, engine: int) -> float:
    return engine_metric(http.get("/metrics").text, "vllm:generation_tokens_total", engine)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from vllm.config.model import default_model_path
    root = tmp_path_factory.mktemp("dp-ckpt")
    return {"old": Path(default_model_path()), "new": write_checkpoint(root / "new", perturbed_weights(), shards=1)}


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Per checkpoint, from one fresh offline engine: 64 seeded requests (tokens, masks) and one greedy one."""
    out: dict[str, dict[str, Any]] = {}
    for which, folder in checkpoints.items():
        llm = LLM(str(folder), device="cpu", max_model_len=MAX_MODEL_LEN, return_sampling_mask=True,
                  logprobs_mode="processed_logprobs")
        seeded = llm.generate([{"prompt_token_ids": _prompt(i)} for i in range(64)],
                              [SamplingParams(**SEEDED, seed=100 + i) for i in range(64)], use_tqdm=False)
        greedy = llm.generate([{"prompt_token_ids": _prompt(0)}], SamplingParams(**GREEDY), use_tqdm=False)[0]
        out[which] = {"seeded": [(o.outputs[0].token_ids, o.outputs[0].sampling_mask.token_ids) for o in seeded],
                      "greedy": greedy.outputs[0].token_ids}
        del llm
    assert out["old"]["greedy"] != out["new"]["greedy"]
    return out


def _serve(extra: list[str]) -> RemoteServer:
    env = {"VLLM_SERVER_DEV_MODE": "1",
           "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "tests", "v1", "e2e"),
                                          os.environ.get("PYTHONPATH", "")])}
    return start_server(["--data-parallel-size", "2", "--return-sampling-mask", "--logprobs-mode",
                         "processed_logprobs", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64",
                         "--seed", "0", "--weight-transfer-config", '{"backend": "disk"}',
                         "--worker-extension-cls", "rl_worker_ext.ProbeExtension", *extra], env)


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    srv = _serve([])
    yield srv
    stop_server(srv)


def _body(i: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": _prompt(i), **SEEDED, "seed": 100 + i, "return_token_ids": True, **extra}


def _complete(http: httpx.Client, i: int, rank: int | None = None) -> tuple[list[int], list[list[int]]]:
    headers = {HEADER: str(rank)} if rank is not None else {}
    resp = http.post("/v1/completions", json=_body(i), headers=headers)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["token_ids"], choice["sampling_mask"]


def _stream_all(url: str, indices: list[int]) -> list[tuple[list[int], list[list[int]]]]:
    """Every request streamed at once, each on its own connection; (token ids, masks) per request."""
    async def one(i: int) -> tuple[list[int], list[list[int]]]:
        token_ids: list[int] = []
        masks: list[list[int]] = []
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            async with http.stream("POST", "/v1/completions", json={**_body(i), "stream": True}) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        choice = json.loads(line[len("data: "):])["choices"][0]
                        token_ids += choice["token_ids"]
                        masks += choice["sampling_mask"]
        return token_ids, masks

    async def run() -> list[tuple[list[int], list[list[int]]]]:
        return list(await asyncio.gather(*(one(i) for i in indices)))

    return asyncio.run(run())


def test_two_engine_cores_each_with_its_rank(server: RemoteServer) -> None:
    assert len(spawn_children(server)) == 2
    with httpx.Client(base_url=server.url, timeout=120) as http:
        # vLLM's shape: every engine runs the call, the results are engine 0's workers'. X-data-parallel-rank
        # names one engine, which alone runs it: engine 1's count shows it ran the first call too.
        resp = http.post("/collective_rpc", json={"method": "probe_tick"})
        assert resp.status_code == 200 and resp.json() == {"results": [[0, 1]]}
        assert http.post("/collective_rpc", json={"method": "probe_tick"}, headers={HEADER: "1"}).json() == \
            {"results": [[1, 2]]}
        assert http.post("/collective_rpc", json={"method": "probe_tick"}, headers={HEADER: "0"}).json() == \
            {"results": [[0, 2]]}
        resp = http.post("/collective_rpc", json={"method": "probe_tick"}, headers={HEADER: "2"})
        assert resp.status_code == 400 and "X-data-parallel-rank 2 is out of range" in resp.text
        # One engine asleep would make the server answer 503 for all: sleep with the header is a 400.
        resp = http.post("/collective_rpc", json={"method": "sleep"}, headers={HEADER: "1"})
        assert resp.status_code == 400 and "collective_rpc 'sleep' cannot run on one data-parallel" in resp.text
        assert http.get("/health").status_code == 200
        assert http.get("/get_world_size").json() == {"world_size": 2}
        assert http.get("/get_world_size", params={"include_dp": "false"}).json() == {"world_size": 1}
        text = http.get("/metrics").text
        assert engine_metric(text, "vllm:num_gpu_blocks", 0) > 0 and engine_metric(text, "vllm:num_gpu_blocks", 1) > 0


def test_64_concurrent_streams_with_masks_use_both_engines(server: RemoteServer,
                                                          reference: dict[str, dict[str, Any]]) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        before = [_tokens(http, e) for e in (0, 1)]
        results = _stream_all(server.url, list(range(64)))
        after = [_tokens(http, e) for e in (0, 1)]
    for i, (token_ids, masks) in enumerate(results):
        assert len(token_ids) == MAX_TOKENS and len(masks) == len(token_ids)
        assert all(t in m for t, m in zip(token_ids, masks))
        assert (token_ids, masks) == reference["old"]["seeded"][i]
    served = [after[e] - before[e] for e in (0, 1)]
    assert sum(served) == 64 * MAX_TOKENS
    # Least load over 64 requests sent at once: both engines serve a fair share.
    assert min(served) >= 16 * MAX_TOKENS, served


def test_header_routes_to_that_engine(server: RemoteServer, reference: dict[str, dict[str, Any]]) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for rank in (1, 0):
            before = [_tokens(http, e) for e in (0, 1)]
            for i in range(4):
                assert _complete(http, i, rank) == reference["old"]["seeded"][i]
            after = [_tokens(http, e) for e in (0, 1)]
            assert after[rank] - before[rank] == 4 * MAX_TOKENS and after[1 - rank] == before[1 - rank]
        # Chat goes the same way.
        before = _tokens(http, 1)
        resp = http.post("/v1/chat/completions", headers={HEADER: "1"},
                         json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **GREEDY})
        assert resp.status_code == 200, resp.text
        assert _tokens(http, 1) - before == MAX_TOKENS
        for value, needle in (("2", "out of range [0, 2)"), ("-1", "out of range"), ("one", "must be an integer")):
            resp = http.post("/v1/completions", json=_body(0), headers={HEADER: value})
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert needle in error["message"] and error["param"] == "X-data-parallel-rank"


def test_pause_resume_and_weight_update_reach_both_engines(server: RemoteServer, checkpoints: dict[str, Path],
                                                           reference: dict[str, dict[str, Any]]) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        resp = http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        assert resp.status_code == 200 and http.get("/is_paused").json() == {"is_paused": True}
        # A request pinned to either engine waits while paused (each engine was paused)...
        for rank in (0, 1):
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json=_body(rank), headers={HEADER: str(rank)}, timeout=2.0)
        try:
            resp = http.post("/update_weights", json={"weight_dir": str(checkpoints["new"])})
            assert resp.status_code == 200 and resp.json() == {"status": "ok"}
        finally:
            assert http.post("/resume").status_code == 200
        assert http.get("/is_paused").json() == {"is_paused": False}
        # ... and every engine now serves the new checkpoint: each one's outputs equal a fresh engine's on it.
        for rank in (0, 1):
            for i in range(3):
                assert _complete(http, i, rank) == reference["new"]["seeded"][i]
            resp = http.post("/v1/completions", headers={HEADER: str(rank)},
                             json={"model": MODEL, "prompt": _prompt(0), **GREEDY, "return_token_ids": True})
            assert resp.json()["choices"][0]["token_ids"] == reference["new"]["greedy"]
        # SkyRL's four-step update back to the bundled weights, through every engine too.
        assert http.post("/start_weight_update", json={"is_checkpoint_format": True}).status_code == 200
        assert http.post("/update_weights", json={"update_info": {"path": str(checkpoints["old"])}}).status_code \
            == 200
        assert http.post("/finish_weight_update", json={"weight_version": "v-old"}).status_code == 200
        assert http.get("/weight_info").json() == {"weight_version": "v-old"}
        for rank in (0, 1):
            assert _complete(http, 5, rank) == reference["old"]["seeded"][5]
        assert http.post("/reset_prefix_cache").status_code == 200


def test_a_dead_rank_stops_the_server_without_hanging(server: RemoteServer) -> None:
    """Last in this module: it kills the module's server. A stream on the killed engine ends (an error event, or
    its connection closed by the shutdown) instead of waiting forever, and the server exits non-zero."""
    outcome: dict[str, Any] = {}

    def stream() -> None:
        try:
            with httpx.Client(base_url=server.url, timeout=120) as http:
                body = {**_body(0), "max_tokens": 400, "stream": True}
                with http.stream("POST", "/v1/completions", json=body, headers={HEADER: "1"}) as resp:
                    outcome["lines"] = [line for line in resp.iter_lines() if line]
        except httpx.HTTPError as e:
            outcome["error"] = e

    thread = threading.Thread(target=stream)
    thread.start()
    with httpx.Client(base_url=server.url, timeout=10) as http:
        deadline = time.monotonic() + 30
        while engine_metric(http.get("/metrics").text, "vllm:num_requests_running", 1) == 0:
            assert time.monotonic() < deadline, "the stream never started on engine 1"
            time.sleep(0.05)
    os.kill(spawn_children(server)[1], signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive(), "the stream hung after its engine died"
    lines = outcome.get("lines", [])
    assert not any('"finish_reason":"length"' in line.replace(" ", "") for line in lines)
    assert "error" in outcome or any("error" in line for line in lines), lines[-3:]
    assert server.proc.wait(60) != 0


@pytest.fixture(scope="module")
def group() -> Iterator[RemoteServer]:
    srv = _serve(["--api-server-count", "2"])
    yield srv
    stop_server(srv)


def test_two_api_servers_each_reach_both_engines(group: RemoteServer, reference: dict[str, dict[str, Any]]) -> None:
    """--api-server-count 2 with --data-parallel-size 2: two engine cores and two API servers, and whichever API
    server a connection lands on (one connection per request, spread by the kernel) reaches either engine."""
    assert len(spawn_children(group)) == 4

    async def run() -> list[tuple[list[int], list[list[int]]]]:
        async def one(i: int) -> tuple[list[int], list[list[int]]]:
            headers = {HEADER: str(i % 2)} if i % 3 else {}
            async with httpx.AsyncClient(base_url=group.url, timeout=300) as http:
                resp = await http.post("/v1/completions", json=_body(i), headers=headers)
                assert resp.status_code == 200, resp.text
                choice = resp.json()["choices"][0]
                return choice["token_ids"], choice["sampling_mask"]
        return list(await asyncio.gather(*(one(i) for i in range(24))))

    for i, result in enumerate(asyncio.run(run())):
        assert result == reference["old"]["seeded"][i]
    for _ in range(4):
        with httpx.Client(base_url=group.url, timeout=120) as http:
            assert http.post("/collective_rpc", json={"method": "probe_parallel"}).json() == {"results": [[0, 2]]}
            assert http.post("/collective_rpc", json={"method": "probe_parallel"}, headers={HEADER: "1"}).json() == \
                {"results": [[1, 2]]}
    group.proc.send_signal(signal.SIGTERM)
    assert group.proc.wait(60) == 0
