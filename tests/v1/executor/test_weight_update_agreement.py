"""A weight update over the nccl backend (gloo on CPU) at TP=2 is agreed by every rank before any rank enters
the trainer's broadcast (vllm/v1/engine/weight_sync.py, docs/rl.md).

The trainer is its own process, rank 0 of a group with world_size 1 + 2 ranks, sending what each round's
update_info announces and reporting each send as it completes. Checked, each engine call under a deadline so a
hang fails the test instead of hanging CI:
- an update naming a weight the model lacks is refused on every rank (VLLMValidationError), the trainer's send
  completes (every rank received its bytes and dropped them) and no weight changed;
- the same when rank 1 alone refuses (the case that left rank 0 and the trainer waiting in the broadcast);
- an update whose layout cannot be read (an unknown dtype) is refused at once, nothing received;
- a good update afterwards lands on both ranks: each rank's parameters equal its shard of the tensors sent,
  computed here from the sent tensors in float64 (a replicated norm weight whole; the row-parallel down_proj
  split along its input features), so the group stayed in step through the refusals."""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from rl_checkpoints import perturbed_weights  # noqa: E402
from rl_worker_ext import param_sum, refuse_update_check_on_rank1, restore_update_check  # noqa: E402

from vllm import LLM  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.utils import get_open_port  # noqa: E402

ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=4, max_model_len=128)
NORM = "model.norm.weight"
DOWN = "model.layers.1.mlp.down_proj.weight"
# NOTE: generous for two loaded cores; an update of the bundled model takes well under a second.
DEADLINE_S = 120.0


def _round_weights(which: str) -> dict[str, torch.Tensor]:
    if which == "unknown_name":
        return {"model.layers.0.mlp.no_such_proj.weight": torch.ones(4, 4)}
    return perturbed_weights(seed=3)


def _update_info(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    names = sorted(weights)
    return {"names": names, "dtype_names": [str(weights[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(weights[n].shape) for n in names], "packed": True, "packed_buffer_size_bytes": 1 << 16}


def _trainer(port: int, rounds: list[str], sent: Any) -> None:
    from vllm.distributed.weight_transfer import NCCLWeightTransferEngine
    group = NCCLWeightTransferEngine.trainer_init({"master_address": "127.0.0.1", "master_port": port,
                                                   "world_size": 3, "device": "cpu", "timeout_s": DEADLINE_S})
    for i, which in enumerate(rounds):
        weights = _round_weights(which)
        NCCLWeightTransferEngine.trainer_send_weights(iter(sorted(weights.items())), {
            "group": group, "packed": True, "packed_buffer_size_bytes": 1 << 16})
        sent.put(i)


def _within(call: Callable[..., Any], *args: Any) -> Any:
    """call(*args) in a thread; fails the test when it is still running after DEADLINE_S (a rank blocked)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call(*args)
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    if thread.is_alive():
        pytest.fail(f"{getattr(call, '__name__', call)} still blocked after {DEADLINE_S} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _shard_sums(weights: dict[str, torch.Tensor]) -> tuple[list[float], list[float]]:
    """What each of 2 ranks must hold: the norm whole, down_proj's input features split in two."""
    norm = float(weights[NORM].double().sum())
    down = weights[DOWN].double()
    half = down.shape[1] // 2
    return [norm, norm], [float(down[:, :half].sum()), float(down[:, half:].sum())]


def test_refused_updates_block_no_rank_and_a_good_one_lands_after() -> None:
    port = get_open_port()
    ctx = multiprocessing.get_context("spawn")
    sent = ctx.Queue()
    rounds = ["unknown_name", "new", "new"]
    trainer = ctx.Process(target=_trainer, args=(port, rounds, sent))
    trainer.start()
    llm = LLM(**ENGINE, tensor_parallel_size=2, weight_transfer_config={"backend": "nccl"})
    try:
        init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3}
        # 0. A group too small for rank 1: refused before rank 0 joins the rendezvous (it would wait there).
        with pytest.raises(VLLMValidationError, match=r"refused by 1 of 2 tensor-parallel ranks.*must be below "
                                                      r"init_info.world_size \(2\).*No worker joined"):
            _within(llm.init_weight_transfer_engine, {"init_info": {**init_info, "world_size": 2}})
        _within(llm.init_weight_transfer_engine, {"init_info": init_info})
        before = [llm.collective_rpc(param_sum, args=(name,)) for name in (NORM, DOWN)]
        _within(llm.start_weight_update)

        # 1. Every rank refuses alike (no such parameter); the trainer's send completes: its bytes were dropped.
        with pytest.raises(VLLMValidationError, match=r"(?s)no_such_proj.*matches no parameter.*dropped it"):
            _within(llm.update_weights, {"update_info": _update_info(_round_weights("unknown_name"))})
        assert sent.get(timeout=DEADLINE_S) == 0

        # 2. Rank 1 alone refuses: rank 0 must not enter the broadcast without it.
        llm.collective_rpc(refuse_update_check_on_rank1)
        try:
            with pytest.raises(VLLMValidationError,
                               match=r"refused by 1 of 2 tensor-parallel ranks.*rank 1: .*test: rank 1 refuses"):
                _within(llm.update_weights, {"update_info": _update_info(_round_weights("new"))})
        finally:
            llm.collective_rpc(restore_update_check)
        assert sent.get(timeout=DEADLINE_S) == 1
        assert [llm.collective_rpc(param_sum, args=(name,)) for name in (NORM, DOWN)] == before

        # 3. A layout no rank can read: refused at once, nothing received (the trainer sends nothing for it).
        bad = {**_update_info(_round_weights("unknown_name")), "dtype_names": ["no_such_dtype"]}
        with pytest.raises(VLLMValidationError, match=r"unknown dtype name 'no_such_dtype'.*Nothing of this update"):
            _within(llm.update_weights, {"update_info": bad})

        # 4. A good update lands on both ranks, each with its shard of the tensors sent.
        new = _round_weights("new")
        _within(llm.update_weights, {"update_info": _update_info(new)})
        assert sent.get(timeout=DEADLINE_S) == 2
        _within(llm.finish_weight_update, "v1")
        want_norm, want_down = _shard_sums(new)
        assert llm.collective_rpc(param_sum, args=(NORM,)) == want_norm
        assert llm.collective_rpc(param_sum, args=(DOWN,)) == want_down
        assert want_down != before[1]
    finally:
        llm.llm_engine.shutdown()
        trainer.join(30)
        if trainer.is_alive():
            trainer.kill()
    assert trainer.exitcode == 0
