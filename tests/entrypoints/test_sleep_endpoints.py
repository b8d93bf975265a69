"""Sleep mode over HTTP and through AsyncLLM (docs/rl.md, "Sleep mode"), replaying the frameworks' own calls:
SkyRL's remote client (POST /sleep?level=, POST /wake_up with a repeated `tags` query parameter, GET
/is_sleeping), prime-rl's folder update between the two wakes of a level-2 sleep, and verl's AsyncLLM calls
(`await engine.sleep(level=1)`, `await engine.wake_up(tags=["kv_cache", "weights"])`, then
`reset_prefix_cache`; its hybrid engine's `collective_rpc("sleep", kwargs={"level": 2})`). References: the
server's own outputs before it slept and a fresh offline engine on the checkpoint loaded while asleep."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.entrypoints.conftest import MODEL, REPO_ROOT, RemoteServer, start_server, stop_server

sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "v1", "e2e"))
from rl_checkpoints import perturbed_weights, write_checkpoint  # noqa: E402

from vllm import LLM, SamplingParams  # noqa: E402

PROMPT = [5, 17, 42, 9, 300, 12]
SEEDED = {"temperature": 1.0, "top_k": 40, "top_p": 0.9, "seed": 11, "max_tokens": 16, "ignore_eos": True}
GREEDY = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, "return_sampling_mask": False}
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("sleep-ckpt") / "new", perturbed_weights(), shards=2)


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    srv = start_server(["--return-sampling-mask", "--logprobs-mode", "processed_logprobs", "--max-model-len",
                        str(MAX_MODEL_LEN), "--max-num-seqs", "16", "--seed", "0", "--enable-sleep-mode",
                        "--weight-transfer-config", '{"backend": "disk"}'], {"VLLM_SERVER_DEV_MODE": "1"})
    yield srv
    stop_server(srv)


def _generate(http: httpx.Client, params: dict[str, Any]) -> httpx.Response:
    return http.post("/inference/v1/generate", json={"model": MODEL, "token_ids": PROMPT,
                                                     "sampling_params": {**params, "logprobs": 1}})


def _serves(http: httpx.Client) -> dict[str, Any]:
    greedy, seeded = _generate(http, GREEDY), _generate(http, SEEDED)
    assert greedy.status_code == 200 and seeded.status_code == 200, (greedy.text, seeded.text)
    choice = seeded.json()["choices"][0]
    return {"greedy": greedy.json()["choices"][0]["token_ids"], "seeded": choice["token_ids"],
            "masks": choice["sampling_mask"]}


def _error(resp: httpx.Response, status: int, needle: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert needle in error["message"] and error["code"] == status and error["type"]


def _refused_while_asleep(http: httpx.Client) -> None:
    _error(_generate(http, GREEDY), 503, "asleep")
    _error(http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4}), 503, "asleep")
    resp = http.post("/v1/chat/completions", json={"model": MODEL, "stream": True, "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": "hi"}]})
    _error(resp, 503, "asleep")


def test_skyrl_remote_client_sleep_and_wake_one_tag_at_a_time(server: RemoteServer) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        before = _serves(http)
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        resp = http.post("/sleep", params={"level": "1"})
        assert resp.status_code == 200 and resp.content == b""
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        _refused_while_asleep(http)
        assert http.post("/sleep", params={"level": "1"}).status_code == 200  # twice: harmless
        assert http.post("/wake_up", params={"tags": ["weights"]}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        _refused_while_asleep(http)
        assert http.post("/wake_up", params={"tags": ["kv_cache"]}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert _serves(http) == before
        # Both tags in one call (repeated query parameter), and no tags at all.
        assert http.post("/sleep", params={"level": 1, "mode": "abort"}).status_code == 200
        assert http.post("/wake_up?tags=weights&tags=kv_cache").status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert http.post("/sleep").status_code == 200
        assert http.post("/wake_up").status_code == 200
        assert http.post("/wake_up").status_code == 200  # awake: harmless
        assert _serves(http) == before


def test_level_2_with_a_folder_update_between_the_wakes(server: RemoteServer, checkpoint: Path) -> None:
    expected_llm = LLM(str(checkpoint), device="cpu", max_model_len=MAX_MODEL_LEN, return_sampling_mask=True,
                       logprobs_mode="processed_logprobs")
    greedy = expected_llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(**GREEDY), use_tqdm=False)[0]
    seeded = expected_llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(**SEEDED), use_tqdm=False)[0]
    expected = {"greedy": greedy.outputs[0].token_ids, "seeded": seeded.outputs[0].token_ids,
                "masks": seeded.outputs[0].sampling_mask.token_ids}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        before = _serves(http)
        assert http.post("/sleep", params={"level": "2"}).status_code == 200
        _error(http.post("/update_weights", json={"weight_dir": str(checkpoint)}), 400, "weights are asleep")
        assert http.post("/wake_up", params={"tags": ["weights"]}).status_code == 200
        resp = http.post("/update_weights", json={"weight_dir": str(checkpoint), "weight_version": "step-1"})
        assert resp.status_code == 200 and resp.json() == {"status": "ok"}, resp.text
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert http.post("/wake_up", params={"tags": ["kv_cache"]}).status_code == 200
        assert _serves(http) == expected
        assert http.post("/update_weights", json={"weight_dir": MODEL}).status_code == 200
        assert _serves(http) == before


def test_a_request_running_at_sleep_ends_with_abort(server: RemoteServer) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        result: dict[str, Any] = {}

        def long_request() -> None:
            result["resp"] = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 480,
                                                                "ignore_eos": True, "return_sampling_mask": False})

        thread = threading.Thread(target=long_request)
        thread.start()
        _wait_running(http)
        assert http.post("/sleep", params={"level": 1}).status_code == 200
        thread.join(60)
        choice = result["resp"].json()["choices"][0]
        assert result["resp"].status_code == 200 and choice["finish_reason"] == "abort"
        assert http.post("/wake_up").status_code == 200


def _wait_running(http: httpx.Client) -> None:
    import time
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in http.get("/metrics").text.splitlines():
            if line.startswith("vllm:num_requests_running") and float(line.rsplit(" ", 1)[1]) >= 1:
                return
        time.sleep(0.05)
    raise AssertionError("the request never ran")


def test_bad_sleep_calls_are_400(server: RemoteServer) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        _error(http.post("/sleep", params={"level": "deep"}), 400, "level")
        _error(http.post("/sleep", params={"level": 5}), 400, "Sleep level must be one of")
        _error(http.post("/sleep", params={"mode": "later"}), 400, "Unknown sleep mode 'later'")
        _error(http.post("/wake_up", params={"tags": ["graphs"]}), 400, "Unknown wake_up tag")
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def test_verl_async_llm_calls() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.sleep_mode import EngineSleepingError

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def tokens(engine: AsyncLLM, request_id: str) -> list[int]:
        outs = [o async for o in engine.generate({"prompt_token_ids": PROMPT}, params, request_id)]
        return outs[-1].outputs[0].token_ids

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(max_model_len=128, max_num_seqs=4,
                                                           enable_sleep_mode=True))
        try:
            before = await tokens(engine, "a")
            await engine.reset_prefix_cache()
            await engine.sleep(level=1)
            assert await engine.is_sleeping()
            with pytest.raises(EngineSleepingError):
                await tokens(engine, "b")
            await engine.wake_up(tags=["kv_cache", "weights"])
            await engine.reset_prefix_cache()
            assert not await engine.is_sleeping()
            assert await tokens(engine, "c") == before
            # The hybrid engine's calls by worker method name.
            assert await engine.collective_rpc("sleep", kwargs={"level": 2}) == [None]
            assert engine.sleeping and await engine.is_sleeping()
            await engine.collective_rpc("wake_up", kwargs={"tags": ["weights"]})
            await engine.load_weights_from_disk(MODEL)
            await engine.collective_rpc("wake_up", kwargs={"tags": ["kv_cache"]})
            assert not await engine.is_sleeping()
            assert await tokens(engine, "d") == before
        finally:
            engine.shutdown()

    asyncio.run(run())
