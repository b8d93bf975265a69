"""Data parallel's checks, without engine processes: bad sizes are refused (config, EngineArgs, `vllm serve` exits
2), the offline engine refuses data_parallel_size > 1 by name, and the server's answers about its engine cores
(the app over a stand-in engine client): /health is 200 while every engine core lives and 503 (vLLM's status for
EngineDeadError) with the reason once one died; a bad X-data-parallel-rank header is a 400 before anything
reaches an engine."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from vllm import LLM
from vllm.config import ParallelConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
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


@pytest.mark.parametrize("size", [0, -1, True, "2", 1.5])
def test_bad_data_parallel_sizes_are_refused(size: Any) -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be"):
        ParallelConfig(data_parallel_size=size)
    with pytest.raises(ValueError, match="data_parallel_size must be"):
        EngineArgs(device="cpu", data_parallel_size=size).create_engine_config()


def test_rank_out_of_its_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"data_parallel_rank=2 is out of range \[0, 2\)"):
        ParallelConfig(data_parallel_size=2, data_parallel_rank=2)


def test_offline_engine_refuses_data_parallel_by_name() -> None:
    with pytest.raises(ValueError, match="data_parallel_size=2 is not supported by the offline engine"):
        LLM(device="cpu", data_parallel_size=2, max_model_len=64)


@pytest.mark.parametrize("flags", [["-dp", "0"], ["--data-parallel-size", "-2"]])
def test_serve_exits_2_on_a_bad_size(flags: list[str]) -> None:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--device", "cpu", *flags],
                            capture_output=True, text=True, timeout=120, env=env, cwd=repo)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "data_parallel_size must be >= 1" in result.stderr
