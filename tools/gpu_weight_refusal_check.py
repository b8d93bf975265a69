"""Refused nccl weight updates on GPUs (docs/rl.md, "Refused updates"): the CPU test
(tests/v1/executor/test_weight_update_agreement.py) over real NCCL.

An engine of `--tp N` ranks on GPUs 0..N-1 and a trainer process on GPU N (so N + 1 GPUs: NCCL puts no two ranks
of a group on one GPU). Rounds, each engine call under a deadline:
1. an update naming a weight the model lacks: refused on every rank, the trainer's send returns (the workers
   received its bytes and dropped them);
2. (N > 1) the same update of a real weight with rank 1 alone refusing: refused, the send returns, no rank changed;
3. that update again, accepted: every rank's `model.norm.weight` (replicated) then equals the tensor sent, and
   generation runs (the captured CUDA graphs read the updated parameter in place).
Exits non-zero on any failure.

    python tools/gpu_weight_refusal_check.py --model /models/Qwen2.5-1.5B-Instruct --tp 2
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "v1", "e2e"))

DEADLINE_S = 300.0
NORM = "model.norm.weight"


def _rounds(hidden: int, dtype: torch.dtype, tp: int) -> list[dict[str, torch.Tensor]]:
    bad = {"model.layers.0.mlp.no_such_proj.weight": torch.ones(4, 4, dtype=dtype)}
    good = {NORM: torch.linspace(0.5, 1.5, hidden).to(dtype)}
    return [bad] + [good] * (2 if tp > 1 else 1)


def _info(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    names = sorted(weights)
    return {"names": names, "dtype_names": [str(weights[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(weights[n].shape) for n in names], "packed": True}


def _trainer(port: int, world_size: int, device: str, hidden: int, dtype: torch.dtype, tp: int, sent: Any) -> None:
    from vllm.distributed.weight_transfer import NCCLWeightTransferEngine
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    group = NCCLWeightTransferEngine.trainer_init({"master_address": "127.0.0.1", "master_port": port,
                                                   "world_size": world_size, "device": device,
                                                   "timeout_s": DEADLINE_S})
    for i, weights in enumerate(_rounds(hidden, dtype, tp)):
        on_gpu = {n: t.to(device) for n, t in weights.items()}
        NCCLWeightTransferEngine.trainer_send_weights(iter(sorted(on_gpu.items())), {"group": group, "packed": True})
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        sent.put(i)


def _within(what: str, call: Callable[..., Any], *args: Any) -> Any:
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
        raise SystemExit(f"FAIL: {what} still blocked after {DEADLINE_S} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _expect_refusal(what: str, call: Callable[..., Any], *args: Any, needle: str) -> None:
    from vllm.exceptions import VLLMValidationError
    try:
        _within(what, call, *args)
    except VLLMValidationError as e:
        if needle not in str(e) or "dropped it" not in str(e):
            raise SystemExit(f"FAIL: {what}: unexpected refusal text: {e}") from e
        print(f"ok: {what}: {str(e)[:160]}...")
        return
    raise SystemExit(f"FAIL: {what} was not refused")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the bundled tiny model)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a smoke run of this script over gloo (float32)")
    args = parser.parse_args()
    on_cuda = args.device == "cuda"
    if on_cuda and torch.cuda.device_count() < args.tp + 1:
        raise SystemExit(f"needs {args.tp + 1} GPUs (tp {args.tp} + the trainer), {torch.cuda.device_count()} seen")

    from rl_worker_ext import param_sum, refuse_update_check_on_rank1, restore_update_check

    from vllm import LLM, SamplingParams
    from vllm.config.model import default_model_path
    from vllm.utils import get_open_port

    model = args.model or default_model_path()
    llm = LLM(model, tensor_parallel_size=args.tp, dtype="bfloat16" if on_cuda else "float32", max_model_len=512,
              device=args.device, weight_transfer_config={"backend": "nccl"})
    norm = llm.collective_rpc("weight_info")[0][NORM]
    dtype, hidden = getattr(torch, norm["dtype"]), norm["shape"][0]

    def norm_sums() -> list[float]:
        return llm.collective_rpc(param_sum, args=(NORM,))
    rounds = _rounds(hidden, dtype, args.tp)
    port = get_open_port()
    ctx = multiprocessing.get_context("spawn")
    sent = ctx.Queue()
    trainer_device = f"cuda:{args.tp}" if on_cuda else "cpu"
    trainer = ctx.Process(target=_trainer, args=(port, args.tp + 1, trainer_device, hidden, dtype, args.tp, sent))
    trainer.start()

    def send_done(i: int) -> None:
        try:
            got = sent.get(timeout=DEADLINE_S)
        except queue.Empty:
            raise SystemExit(f"FAIL: the trainer's send of round {i} did not return") from None
        if got != i:
            raise SystemExit(f"FAIL: the trainer finished round {got}, expected {i}")
        print(f"ok: the trainer's send of round {i} returned")

    try:
        _within("init_weight_transfer_engine", llm.init_weight_transfer_engine,
                {"init_info": {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                               "world_size": args.tp + 1}})
        before = norm_sums()
        _within("start_weight_update", llm.start_weight_update)
        _expect_refusal("an unknown weight name", llm.update_weights, {"update_info": _info(rounds[0])},
                        needle="no_such_proj")
        send_done(0)
        if args.tp > 1:
            llm.collective_rpc(refuse_update_check_on_rank1)
            _expect_refusal("rank 1 alone refusing", llm.update_weights, {"update_info": _info(rounds[1])},
                            needle=f"refused by 1 of {args.tp} tensor-parallel ranks")
            llm.collective_rpc(restore_update_check)
            send_done(1)
            unchanged = norm_sums()
            if unchanged != before:
                raise SystemExit(f"FAIL: a refused update changed weights: {before} -> {unchanged}")
        _within("the good update", llm.update_weights, {"update_info": _info(rounds[-1])})
        send_done(len(rounds) - 1)
        _within("finish_weight_update", llm.finish_weight_update, "v1")
        want = float(rounds[-1][NORM].double().sum())
        after = norm_sums()
        if after != [want] * args.tp:
            raise SystemExit(f"FAIL: after the good update the ranks hold {after}, the trainer sent {want}")
        out = llm.generate([{"prompt_token_ids": [5, 17, 42, 9]}], SamplingParams(max_tokens=8, temperature=0),
                           use_tqdm=False)
        print(f"ok: every rank holds the sent {NORM}; generated {list(out[0].outputs[0].token_ids)}")
    finally:
        llm.llm_engine.shutdown()
        trainer.join(60)
        if trainer.is_alive():
            trainer.kill()
    if trainer.exitcode != 0:
        raise SystemExit(f"FAIL: the trainer exited with {trainer.exitcode}")
    print("PASS")


if __name__ == "__main__":
    main()
