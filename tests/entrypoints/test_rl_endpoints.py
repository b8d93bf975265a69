"""The admin endpoints of RL training loops against a real `vllm serve` (docs/rl.md), replaying the frameworks'
own HTTP calls with their bodies: prime-rl's orchestrator (pause keep -> /update_weights {"weight_dir"} ->
resume) and SkyRL's remote client (get_world_size with a `{}` body, init_weight_transfer_engine, pause, start /
update / finish, resume, reset_prefix_cache with a JSON body, collective_rpc). The reference for every output
after an update is a fresh offline engine on the new checkpoint (greedy and seeded sampling with masks)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.entrypoints.conftest import MODEL, REPO_ROOT, RemoteServer, free_port, start_server, stop_server

sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "v1", "e2e"))
from rl_checkpoints import perturbed_weights, prime_rl_broadcaster, write_checkpoint  # noqa: E402

from vllm import LLM, SamplingParams  # noqa: E402

PROMPT = [5, 17, 42, 9, 300, 12]
SEEDED = {"temperature": 1.0, "top_k": 40, "top_p": 0.9, "seed": 11, "max_tokens": 16, "ignore_eos": True}
GREEDY = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, "return_sampling_mask": False}
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from vllm.config.model import default_model_path
    root = tmp_path_factory.mktemp("rl-ckpt")
    return {"old": Path(default_model_path()), "new": write_checkpoint(root / "new", perturbed_weights(), shards=2)}


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Each checkpoint's greedy and seeded outputs from a fresh offline engine configured as the server."""
    out = {}
    for which, folder in checkpoints.items():
        llm = LLM(str(folder), device="cpu", max_model_len=MAX_MODEL_LEN, return_sampling_mask=True,
                  logprobs_mode="processed_logprobs")
        greedy = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(**GREEDY), use_tqdm=False)[0]
        seeded = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(**SEEDED), use_tqdm=False)[0]
        out[which] = {"greedy": greedy.outputs[0].token_ids, "seeded": seeded.outputs[0].token_ids,
                      "masks": seeded.outputs[0].sampling_mask.token_ids}
    assert out["old"]["greedy"] != out["new"]["greedy"]
    return out


def _serve(extra: list[str]) -> RemoteServer:
    env = {"VLLM_SERVER_DEV_MODE": "1",
           "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "tests", "v1", "e2e"),
                                          os.environ.get("PYTHONPATH", "")])}
    return start_server(["--return-sampling-mask", "--logprobs-mode", "processed_logprobs", "--max-model-len",
                         str(MAX_MODEL_LEN), "--max-num-seqs", "64", "--seed", "0",
                         "--worker-extension-cls", "rl_worker_ext.ProbeExtension", *extra], env)


@pytest.fixture(scope="module")
def disk_server() -> Iterator[RemoteServer]:
    srv = _serve(["--weight-transfer-config", '{"backend": "disk"}'])
    yield srv
    stop_server(srv)


def _generate(http: httpx.Client, params: dict[str, Any]) -> dict[str, Any]:
    """prime-rl's renderer call: POST /inference/v1/generate {model, token_ids, sampling_params}."""
    resp = http.post("/inference/v1/generate", json={"model": MODEL, "token_ids": PROMPT,
                                                     "sampling_params": {**params, "logprobs": 1}})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def _assert_serves(http: httpx.Client, expected: dict[str, Any]) -> None:
    assert _generate(http, GREEDY)["token_ids"] == expected["greedy"]
    seeded = _generate(http, SEEDED)
    assert seeded["token_ids"] == expected["seeded"] and seeded["sampling_mask"] == expected["masks"]


def _error(resp: httpx.Response, status: int, needle: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert needle in error["message"] and error["code"] == status and error["type"]


def test_prime_rl_orchestrator_update_sequence(disk_server: RemoteServer, checkpoints: dict[str, Path],
                                               reference: dict[str, dict[str, Any]]) -> None:
    with httpx.Client(base_url=disk_server.url, timeout=120) as http:
        assert http.get("/health").status_code == 200
        assert any(m["id"] for m in http.get("/v1/models").json()["data"])
        _assert_serves(http, reference["old"])
        for which in ("new", "old", "new"):
            # prime-rl's admin_post: pause keep without clearing, update from the folder, resume in `finally`.
            resp = http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
            assert resp.status_code == 200 and resp.json() == {"status": "paused"}
            try:
                resp = http.post("/update_weights", json={"weight_dir": str(checkpoints[which])})
                assert resp.status_code == 200 and resp.json() == {"status": "ok"}
            finally:
                resp = http.post("/resume")
            assert resp.status_code == 200 and resp.json() == {"status": "resumed"}
            _assert_serves(http, reference[which])
        assert http.get("/liveness").json() == {"status": "ok"}
        _error(http.post("/update_weights", json={"weight_dir": None}), 400, "/init_broadcaster first")
        _assert_serves(http, reference["new"])
        # Back to the bundled weights for the tests after this one.
        assert http.post("/update_weights", json={"weight_dir": str(checkpoints["old"])}).status_code == 200


def test_prime_rl_nccl_broadcaster_sequence(disk_server: RemoteServer, reference: dict[str, dict[str, Any]]) -> None:
    """prime-rl's NCCL path: /init_broadcaster once, then per step pause keep -> /update_weights {"weight_dir":
    null} (the weights come from its broadcaster, here over gloo) -> resume; a refused broadcast changes nothing
    and keeps the group in step for the next one."""
    port = free_port()
    trainer = multiprocessing.get_context("spawn").Process(target=prime_rl_broadcaster,
                                                           args=(port, ["new", "bad", "old"]))
    trainer.start()
    try:
        with httpx.Client(base_url=disk_server.url, timeout=120) as http:
            resp = http.post("/init_broadcaster", json={"host": "127.0.0.1", "port": port, "rank_offset": 0,
                                                        "inference_world_size": 1, "timeout": 60,
                                                        "quantize_in_weight_transfer": False})
            assert resp.status_code == 200 and resp.json() == {"status": "ok"}, resp.text
            for which in ("new", "bad", "old"):
                assert http.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
                try:
                    resp = http.post("/update_weights", json={"weight_dir": None})
                finally:
                    assert http.post("/resume").status_code == 200
                if which == "bad":
                    _error(resp, 400, "no weight was changed")
                    _assert_serves(http, reference["new"])
                else:
                    assert resp.status_code == 200 and resp.json() == {"status": "ok"}, resp.text
                    _assert_serves(http, reference[which])
            _error(http.post("/init_broadcaster", json={"host": "127.0.0.1", "port": 1, "inference_world_size": 1,
                                                        "quantize_in_weight_transfer": True}), 400,
                   "quantize_in_weight_transfer")
            _error(http.post("/init_broadcaster", json={"host": "127.0.0.1", "port": 1, "inference_world_size": 1,
                                                        "colour": "red"}), 400, "colour")
    finally:
        trainer.join(60)
        if trainer.is_alive():
            trainer.kill()
    assert trainer.exitcode == 0


def test_skyrl_remote_client_sequence(disk_server: RemoteServer, checkpoints: dict[str, Path],
                                      reference: dict[str, dict[str, Any]]) -> None:
    with httpx.Client(base_url=disk_server.url, timeout=120) as http:
        # GET with a JSON `{}` body, as aiohttp sends it; no include_dp query.
        resp = http.request("GET", "/get_world_size", json={})
        assert resp.status_code == 200 and resp.json() == {"world_size": 1}
        resp = http.post("/init_weight_transfer_engine", json={"init_info": {}})
        assert resp.json() == {"message": "Weight transfer initialized"}
        assert http.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
        assert http.get("/is_paused").json() == {"is_paused": True}
        resp = http.post("/start_weight_update", json={"is_checkpoint_format": True})
        assert resp.json() == {"message": "Weight update started"}
        resp = http.post("/update_weights", json={"update_info": {"path": str(checkpoints["new"])}})
        assert resp.json() == {"message": "Weights updated"}
        resp = http.post("/finish_weight_update", json={"weight_version": "step-1"})
        assert resp.json() == {"message": "Weight update finished"}
        assert http.post("/resume").json() == {"status": "resumed"}
        resp = http.post("/reset_prefix_cache", json={"reset_running_requests": False})
        assert resp.status_code == 200 and resp.content == b""
        assert http.get("/weight_info").json() == {"weight_version": "step-1"}
        resp = http.post("/collective_rpc", json={"method": "probe_report"})
        assert resp.json() == {"results": [{"device": "cpu", "rank": 0, "local_rank": 0,
                                            "dtype": "torch.float32", "num_params": 14}]}
        assert http.post("/collective_rpc", json={"method": "probe_dist"}).json() == {"results": [[True, 0, 1]]}
        choice = _generate(http, SEEDED)
        assert choice["token_ids"] == reference["new"]["seeded"]
        assert choice["weight_versions"] == [{"weight_version": "step-1", "start": 0, "end": 16}]
        resp = http.post("/update_weight_version", json={"new_version": "step-1b"})
        assert resp.json() == {"success": True, "new_version": "step-1b"}
        assert http.get("/weight_info").json() == {"weight_version": "step-1b"}
        # Back to the bundled weights.
        http.post("/start_weight_update", json={})
        http.post("/update_weights", json={"update_info": {"path": str(checkpoints["old"])}})
        assert http.post("/finish_weight_update", json={"weight_version": "step-2"}).status_code == 200
        _assert_serves(http, reference["old"])


def test_bad_admin_calls_are_400_and_change_nothing(disk_server: RemoteServer, tmp_path: Path,
                                                    reference: dict[str, dict[str, Any]]) -> None:
    with httpx.Client(base_url=disk_server.url, timeout=120) as http:
        _error(http.post("/pause", params={"mode": "later"}), 400, "Unknown pause mode 'later'")
        _error(http.post("/pause", params={"clear_cache": "perhaps"}), 400, "clear_cache")
        _error(http.post("/resume"), 400, "not paused")
        _error(http.post("/update_weights", json={}), 400, "update_info")
        _error(http.post("/update_weights", content=b"{not json"), 400, "not valid JSON")
        _error(http.post("/update_weights", json={"update_info": {"path": "/x"}}), 400, "start_weight_update first")
        _error(http.post("/init_weight_transfer_engine", json={}), 400, "init_info")
        _error(http.post("/init_weight_transfer_engine", json={"init_info": {"port": 1}}), 400, "init_info")
        _error(http.post("/collective_rpc", json={}), 400, "method")
        _error(http.post("/collective_rpc", json={"method": "nope"}), 400, "no method 'nope'")
        _error(http.post("/collective_rpc", json={"method": "initialize_kv_cache", "args": [1]}), 400,
               "the engine's own step")
        _error(http.post("/collective_rpc", json={"method": "probe_sleep"}), 400, "bad arguments for 'probe_sleep'")
        named = http.get("/weight_info").json()
        _error(http.post("/update_weights", json={"weight_dir": "/nonexistent/dir", "weight_version": "x"}), 400,
               "/nonexistent/dir")
        assert http.get("/weight_info").json() == named  # a refused load names nothing
        _error(http.post("/update_weights", json={"weight_dir": "/x", "weight_version": 7}), 400, "weight_version")
        _error(http.post("/collective_rpc", json={"method": "probe_report", "timeout": -1}), 400, "timeout")
        _error(http.post("/sleep", params={"level": 1}), 400, "Sleep mode is off")
        assert http.post("/wake_up").status_code == 200  # awake: nothing to do
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        _error(http.post("/abort_requests", json={"request_ids": "all"}), 400, "request_ids")
        assert http.post("/start_weight_update").status_code == 200
        _error(http.post("/start_weight_update"), 400, "already in progress")
        empty = tmp_path / "empty"
        empty.mkdir()
        _error(http.post("/update_weights", json={"update_info": {"path": str(empty)}}), 400, "safetensors")
        _error(http.post("/update_weights", json={"update_info": {"path": "relative/dir"}}), 400, "relative/dir")
        assert http.post("/finish_weight_update", json={}).status_code == 200
        _error(http.post("/finish_weight_update", json={}), 400, "start_weight_update first")
        _assert_serves(http, reference["old"])


def test_collective_rpc_timeout_is_a_504_and_the_engine_goes_on(disk_server: RemoteServer) -> None:
    with httpx.Client(base_url=disk_server.url, timeout=120) as http:
        resp = http.post("/collective_rpc", json={"method": "probe_sleep", "args": [2.0], "timeout": 0.3})
        _error(resp, 504, "did not finish within 0.3 s")
        resp = http.post("/collective_rpc", json={"method": "probe_sleep", "kwargs": {"seconds": 0.1}})
        assert resp.json() == {"results": [0.1]}


def test_any_api_server_pauses_the_one_engine_core(checkpoints: dict[str, Path]) -> None:
    """--api-server-count 2: requests on both API servers stop at a keep-mode pause sent through either, go on
    after resume, and an abort-mode pause ends every request of both with finish_reason "abort"."""
    srv = _serve(["--api-server-count", "2"])
    try:
        async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            # NOTE: one connection per request, so the kernel spreads them over both API servers.
            def client() -> httpx.AsyncClient:
                return httpx.AsyncClient(base_url=srv.url, timeout=300,
                                         limits=httpx.Limits(max_keepalive_connections=0))

            async def one(index: int, max_tokens: int) -> dict[str, Any]:
                async with client() as http:
                    return await _stream(http, index, max_tokens)

            async with client() as admin:
                kept = [asyncio.create_task(one(i, 64)) for i in range(8)]
                await asyncio.sleep(1.0)
                for _ in range(3):  # the calls land on either API server
                    assert (await admin.post("/pause", params={"mode": "keep"})).status_code == 200
                    assert (await admin.get("/is_paused")).json() == {"is_paused": True}
                assert (await admin.post("/resume")).status_code == 200
                kept_results = await asyncio.gather(*kept)
                aborted = [asyncio.create_task(one(i, 400)) for i in range(8)]
                await asyncio.sleep(1.5)
                assert (await admin.post("/pause", params={"mode": "abort"})).status_code == 200
                aborted_results = await asyncio.gather(*aborted)
                assert (await admin.post("/resume")).status_code == 200
            return kept_results, aborted_results

        kept, aborted = asyncio.run(run())
        for result in kept:
            assert result["done"] == 1 and result["finish"] == "length" and len(result["token_ids"]) == 64
        for result in aborted:
            assert result["done"] == 1 and result["finish"] == "abort" and len(result["token_ids"]) < 400
    finally:
        stop_server(srv)


def test_admin_endpoints_are_mounted_only_in_dev_mode(server: RemoteServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for method, path in [("POST", "/pause"), ("POST", "/resume"), ("POST", "/update_weights"),
                             ("POST", "/collective_rpc"), ("GET", "/get_world_size"), ("GET", "/is_paused")]:
            assert http.request(method, path).status_code == 404, path


async def _stream(http: httpx.AsyncClient, index: int, max_tokens: int = 32) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": [7 + index, 11, 13 + index], "max_tokens": max_tokens, "temperature": 1.0,
            "top_k": 20, "seed": index, "ignore_eos": True, "stream": True, "return_token_ids": True}
    token_ids: list[int] = []
    masks: list[list[int]] = []
    spans: list[dict[str, Any]] = []
    finish, done = None, 0
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                token_ids += choice["token_ids"]
                masks += choice["sampling_mask"]
                spans += choice.get("weight_versions") or []
                finish = choice["finish_reason"] or finish
    return {"token_ids": token_ids, "masks": masks, "spans": spans, "finish": finish, "done": done}


NUM_STREAMS = 16


def test_updates_under_concurrent_streams_lose_and_duplicate_nothing(
        disk_server: RemoteServer, checkpoints: dict[str, Path]) -> None:
    # NOTE: 16 streams, not 64: a CPU step costs in proportion to its rows (the mask kernels run under the Triton
    # interpreter), and 16 streams still outlive the ten updates, which the last assertion checks.
    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=disk_server.url, timeout=300) as http:
            streams = [asyncio.create_task(_stream(http, i)) for i in range(NUM_STREAMS)]
            for update in range(10):
                await asyncio.sleep(0.2)
                resp = await http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
                assert resp.status_code == 200
                folder = checkpoints["new" if update % 2 == 0 else "old"]
                resp = await http.post("/update_weights", json={"weight_dir": str(folder),
                                                                "weight_version": f"u{update}"})
                assert resp.status_code == 200, resp.text
                assert (await http.post("/resume")).status_code == 200
            return await asyncio.gather(*streams)

    results = asyncio.run(run())
    assert len(results) == NUM_STREAMS
    for result in results:
        assert result["done"] == 1 and result["finish"] == "length"
        assert len(result["token_ids"]) == 32 and len(result["masks"]) == 32
        assert all(tid in mask for tid, mask in zip(result["token_ids"], result["masks"]))
        # The spans cover the tokens once each, in order (chunks of one span are joined here).
        covered = [t for span in result["spans"] for t in range(span["start"], span["end"])]
        if covered:
            assert covered == list(range(covered[0], 32))
    # Every update landed inside the streams: each one's version names tokens of some stream (the version an
    # earlier test left may name the first ones).
    assert {f"u{i}" for i in range(10)} <= {span["weight_version"] for r in results for span in r["spans"]}
    with httpx.Client(base_url=disk_server.url, timeout=60) as http:
        assert http.post("/update_weights", json={"weight_dir": str(checkpoints["old"])}).status_code == 200
