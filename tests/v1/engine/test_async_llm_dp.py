"""AsyncLLM with data_parallel_size=2 on the bundled model (two engine-core processes): generate's
data_parallel_rank picks the engine (its metrics count the tokens), a rank out of range is a
VLLMValidationError before anything is sent, collective_rpc answers with engine 0's workers' results (vLLM's
shape) and with engine 1's when data_parallel_rank=1 names it (refused for sleep / wake_up / weight updates),
the same seeded request gives the same tokens on either engine, and killing one engine makes a running generate,
new requests and check_health raise EngineDeadError instead of waiting."""

from __future__ import annotations

import asyncio
import os
import re
import signal

import pytest

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import EngineDeadError

PROMPT = {"prompt_token_ids": [5, 17, 42, 9]}


def _tokens(engine: AsyncLLM, rank: int) -> float:
    text = engine.stat_logger.render().decode()
    return sum(float(v) for labels, v in re.findall(r"^vllm:generation_tokens_total\{([^}]*)\} (\S+)$", text, re.M)
               if f'engine="{rank}"' in labels)


def _rank_of_worker(worker: object) -> list[int]:
    parallel = worker.parallel_config  # type: ignore[attr-defined]
    return [parallel.data_parallel_rank, parallel.data_parallel_size]


def test_async_llm_over_two_engine_cores() -> None:
    async def run() -> None:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(device="cpu", max_model_len=128, max_num_seqs=8,
                                                           data_parallel_size=2))
        try:
            params = SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=5, ignore_eos=True)
            outs = {}
            for rank in (1, 0):
                before = [_tokens(engine, r) for r in (0, 1)]
                final = [o async for o in engine.generate(PROMPT, params, f"r{rank}", data_parallel_rank=rank)][-1]
                outs[rank] = final.outputs[0].token_ids
                after = [_tokens(engine, r) for r in (0, 1)]
                assert after[rank] - before[rank] == 5 and after[1 - rank] == before[1 - rank]
            assert outs[0] == outs[1] and len(outs[0]) == 5  # one checkpoint, one seed: the same tokens
            with pytest.raises(VLLMValidationError, match=r"data_parallel_rank 2 is out of range \[0, 2\)"):
                await engine.add_request("bad", PROMPT, params, data_parallel_rank=2)
            assert "bad" not in engine.output_processor.request_states
            # vLLM's shape: engine 0's workers' results (every engine ran it); data_parallel_rank picks one engine.
            assert await engine.collective_rpc(_rank_of_worker) == [[0, 2]]
            assert await engine.collective_rpc(_rank_of_worker, data_parallel_rank=1) == [[1, 2]]
            with pytest.raises(VLLMValidationError, match=r"data_parallel_rank 2 is out of range"):
                await engine.collective_rpc(_rank_of_worker, data_parallel_rank=2)
            # Sleep mode and weight updates hold for every engine together: never sent to one engine alone.
            for method in ("sleep", "wake_up", "update_weights"):
                with pytest.raises(VLLMValidationError, match=rf"collective_rpc '{method}' cannot run on one"):
                    await engine.collective_rpc(method, data_parallel_rank=1)
            assert not await engine.is_sleeping()
            await engine.pause_generation(mode="keep")
            assert await engine.is_paused()
            await engine.resume_generation()
            assert not await engine.is_paused()

            long = SamplingParams(temperature=1.0, top_k=20, max_tokens=2000, ignore_eos=True)
            stream = engine.generate({"prompt_token_ids": [1, 2, 3]}, long, "long", data_parallel_rank=1)
            await stream.__anext__()
            os.kill(engine.engine_core.procs[1].pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="data-parallel rank 1"):
                async with asyncio.timeout(30):
                    async for _ in stream:
                        pass
            with pytest.raises(EngineDeadError):
                await engine.check_health()
            with pytest.raises(EngineDeadError):
                await engine.add_request("after", PROMPT, params, data_parallel_rank=0)
        finally:
            engine.shutdown()

    asyncio.run(run())
