"""The server's answers about its engine cores, in process (the app over a stand-in engine client, no engine
processes): /health is 200 while every engine core lives and 503 (vLLM's status for EngineDeadError) with the
reason once one died; a bad X-data-parallel-rank header is a 400 before anything reaches an engine."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from vllm.config import VllmConfig
from vllm.entrypoints.openai.api_server import build_app
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import EngineDeadError
from vllm.v1.metrics.loggers import PrometheusStatLogger


@dataclass
class StandInClient:
    """What the app reads of AsyncLLM's engine-core client."""
    data_parallel_size: int = 2
    is_dead: bool = False
    dead_error: EngineDeadError | None = None


def _engine() -> AsyncLLM:
    engine = AsyncLLM.__new__(AsyncLLM)
    engine.vllm_config = VllmConfig()
    engine.model_config = engine.vllm_config.model_config
    engine.tokenizer = get_tokenizer(str(engine.model_config.tokenizer))
    engine.engine_core = StandInClient()  # type: ignore[assignment]
    engine.stat_logger = PrometheusStatLogger("m", [4, 4])
    return engine


def test_health_is_503_once_an_engine_core_died_and_a_bad_rank_header_is_400() -> None:
    engine = _engine()
    app = build_app(engine)

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            assert (await http.get("/health")).status_code == 200
            for value in ("2", "x"):
                resp = await http.post("/v1/completions", json={"model": "m", "prompt": [1, 2]},
                                       headers={"x-data-parallel-rank": value})
                assert resp.status_code == 400
                assert resp.json()["error"]["param"] == "X-data-parallel-rank"
            metrics = (await http.get("/metrics")).text
            assert 'vllm:num_gpu_blocks{engine="1",model_name="m"} 4.0' in metrics
            engine.engine_core.is_dead = True  # type: ignore[attr-defined]
            engine.engine_core.dead_error = EngineDeadError(  # type: ignore[attr-defined]
                "Engine core process died (exit code -9, data-parallel rank 1).")
            resp = await http.get("/health")
            assert resp.status_code == 503
            assert "data-parallel rank 1" in resp.json()["error"]["message"]

    asyncio.run(run())
