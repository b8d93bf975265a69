"""A weight update over the nccl backend (gloo on CPU) with data_parallel_size=2 (AsyncLLM, two engine-core
processes) is agreed by both engines before either enters the trainer's broadcast (dp_client.py, weight_sync.py).

The trainer is its own process, rank 0 of a group of 1 + 2 workers (engine i's worker is rank 1 + i), sending
what each round announces and reporting each send as it completes. Engine 1 alone is made to refuse (a worker
hook sent to it by `collective_rpc(..., data_parallel_rank=1)`): the update is refused (VLLMValidationError
naming engine 1), the trainer's send completes (both engines received its bytes and dropped them), and neither
engine's weights changed; once engine 1 accepts again the next update lands on both, each parameter equal to the
tensor sent (float64 sums of the sent tensors are the reference). Every engine call runs under a deadline, so a
hang fails the test instead of hanging CI."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from rl_checkpoints import perturbed_weights  # noqa: E402
from rl_worker_ext import param_sum, refuse_update_check, restore_update_check  # noqa: E402

from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.utils import get_open_port  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402

NAMES = ("model.norm.weight", "model.layers.1.mlp.down_proj.weight")
DEADLINE_S = 120.0


def _update_info(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    names = sorted(weights)
    return {"names": names, "dtype_names": [str(weights[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(weights[n].shape) for n in names], "packed": False}


def _trainer(port: int, num_rounds: int, sent: Any) -> None:
    from vllm.distributed.weight_transfer import NCCLWeightTransferEngine
    group = NCCLWeightTransferEngine.trainer_init({"master_address": "127.0.0.1", "master_port": port,
                                                   "world_size": 3, "device": "cpu", "timeout_s": DEADLINE_S})
    for i in range(num_rounds):
        NCCLWeightTransferEngine.trainer_send_weights(iter(sorted(perturbed_weights(seed=3).items())),
                                                      {"group": group, "packed": False})
        sent.put(i)


def test_an_update_one_engine_refuses_blocks_neither_engine() -> None:
    port = get_open_port()
    ctx = multiprocessing.get_context("spawn")
    sent = ctx.Queue()
    trainer = ctx.Process(target=_trainer, args=(port, 2, sent))
    trainer.start()
    new = perturbed_weights(seed=3)

    async def sums(engine: AsyncLLM) -> list[list[float]]:
        return [[(await engine.collective_rpc(param_sum, args=(name,), data_parallel_rank=rank))[0]
                 for name in NAMES] for rank in (0, 1)]

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4, data_parallel_size=2,
            weight_transfer_config={"backend": "nccl"}))
        try:
            async with asyncio.timeout(DEADLINE_S):
                # Engine i's worker joins as rank 1 + i (the DP client offsets rank_offset per engine).
                await engine.init_weight_transfer_engine({"master_address": "127.0.0.1", "master_port": port,
                                                          "rank_offset": 1, "world_size": 3})
                before = await sums(engine)
                await engine.start_weight_update()
                await engine.collective_rpc(refuse_update_check, data_parallel_rank=1)
            with pytest.raises(VLLMValidationError, match=r"(?s)refused by 1 of 2 data-parallel engines.*engine 1: "
                                                          r".*this engine refuses.*dropped it"):
                async with asyncio.timeout(DEADLINE_S):
                    await engine.update_weights({"update_info": _update_info(new)})
            assert await asyncio.to_thread(sent.get, True, DEADLINE_S) == 0
            async with asyncio.timeout(DEADLINE_S):
                assert await sums(engine) == before
                await engine.collective_rpc(restore_update_check, data_parallel_rank=1)
                await engine.update_weights({"update_info": _update_info(new)})
                await engine.finish_weight_update("v1")
                want = [float(new[name].double().sum()) for name in NAMES]
                assert await sums(engine) == [want, want] and want != before[0]
            assert await asyncio.to_thread(sent.get, True, DEADLINE_S) == 1
        finally:
            engine.shutdown()

    try:
        asyncio.run(run())
    finally:
        trainer.join(30)
        if trainer.is_alive():
            trainer.kill()
    assert trainer.exitcode == 0
