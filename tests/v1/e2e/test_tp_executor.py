"""Tensor parallelism's processes (vllm/v1/executor/, docs/parallelism.md "Processes") on CPU over gloo, against a
TP=1 engine as the reference: greedy tokens, seeded tokens and their sampling masks at TP=2 (sync scheduling) and
TP=4 (async scheduling, two steps in flight on every rank) equal TP=1's in float32; collective_rpc reaches every
rank in rank order (worker methods, a worker extension, a callable) with each rank's own rank, device and
process; sleep and wake-up reach every rank; weight updates under TP=2 (from disk, and over the nccl backend with
world_size = 1 + ranks, gloo on CPU, the trainer in its own process) give the outputs of a fresh TP=1 engine on
the checkpoint sent; a killed worker process ends in EngineDeadError, not a hang; DP=2 x TP=2 engines; "mp" at one
rank runs in process. Failures on one rank (docs/parallelism.md, "Collectives and failures"): an exception that
does not unpickle comes back as a RuntimeError naming the rank; a disk update one rank refuses changes no rank;
one that fails on one rank after the other loaded stops the engine (EngineDeadError, no output from mixed
weights); a warm-up failure on either rank, the other waiting in a collective, fails the start instead of
hanging. Unseeded random sampling keeps every rank's token history equal (the global random state is reseeded
alike on every rank).

Every rank holds its shard of the model (docs/parallelism.md, "Tensor parallel"), so equality with TP=1 checks the
sharded forward, the gathered logits and the per-rank weight loading together."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed
from rl_checkpoints import bundled_weights, perturbed_weights, write_checkpoint
from rl_worker_ext import (batch_token_ids, break_disk_load_on_rank1, dp_and_tp_rank, param_sum,
                           raise_two_arg_error_on_rank1, rank_and_double, refuse_disk_check_on_rank1,
                           restore_disk_check, unpicklable_result, worker_rank)

from vllm import LLM, SamplingParams
from vllm.utils import get_open_port
from vllm.v1.engine.core_client import EngineDeadError

PROMPTS = [{"prompt_token_ids": [5, 17, 42, 9, 300, 12]}, {"prompt_token_ids": list(range(40, 90))},
           {"prompt_token_ids": [7] * 3}]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, return_sampling_mask=False)
SEEDED = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=8, max_model_len=256, return_sampling_mask=True,
              logprobs_mode="processed_logprobs")
EXT = "rl_worker_ext.ProbeExtension"

Outputs = list[tuple[list[int], list[list[int]] | None]]


def _outputs(llm: LLM) -> Outputs:
    greedy = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    seeded = llm.generate(PROMPTS, SEEDED, use_tqdm=False)
    return ([(list(o.outputs[0].token_ids), None) for o in greedy]
            + [(list(o.outputs[0].token_ids), [list(m) for m in o.outputs[0].sampling_mask.token_ids])
               for o in seeded])


@pytest.fixture(scope="module")
def new_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "new", perturbed_weights(seed=3))


@pytest.fixture(scope="module")
def reference(new_checkpoint: Path) -> dict[str, Outputs]:
    """TP=1 engines (in this process) on the bundled checkpoint and on the new one."""
    old_llm = LLM(**ENGINE)
    # One rank: the worker is called in this process, and this process's torch.distributed is left alone.
    core = old_llm.llm_engine.engine_core.engine_core
    assert type(core.model_executor).__name__ == "UniProcExecutor" and not torch.distributed.is_initialized()
    old = _outputs(old_llm)
    old_llm.llm_engine.shutdown()
    new_llm = LLM(str(new_checkpoint), **ENGINE)
    new = _outputs(new_llm)
    new_llm.llm_engine.shutdown()
    assert [t for t, _ in old] != [t for t, _ in new]  # the update must be visible
    assert all(m for _, masks in old[len(PROMPTS):] for m in masks)  # the masks are not empty
    return {"old": old, "new": new}


@pytest.fixture(scope="module")
def tp2() -> Any:
    llm = LLM(**ENGINE, tensor_parallel_size=2, worker_extension_cls=EXT, weight_transfer_config={"backend": "nccl"},
              enable_sleep_mode=True)
    yield llm
    llm.llm_engine.shutdown()


def test_tp2_outputs_equal_tp1(tp2: LLM, reference: dict[str, Outputs]) -> None:
    assert tp2.llm_engine.vllm_config.parallel_config.distributed_executor_backend == "mp"
    assert _outputs(tp2) == reference["old"]


def test_collective_rpc_reaches_every_rank_in_order(tp2: LLM) -> None:
    reports = tp2.collective_rpc("probe_report")
    assert [(r["rank"], r["local_rank"], r["device"]) for r in reports] == [(0, 0, "cpu"), (1, 1, "cpu")]
    assert tp2.collective_rpc(rank_and_double, args=(5,)) == [(0, 10), (1, 10)]
    # Each rank is its own process in the world of the engine (the default group, as vLLM's workers have).
    assert tp2.collective_rpc("probe_dist") == [[True, 0, 2], [True, 1, 2]]
    pids = tp2.collective_rpc("probe_pid")
    assert len(set(pids)) == 2 and os.getpid() not in pids
    with pytest.raises(ValueError, match="no method 'nope'"):
        tp2.collective_rpc("nope")
    with pytest.raises(ValueError, match="engine's own step"):
        tp2.collective_rpc("execute_model", args=(None,))
    # A lambda cannot travel to the engine core process (sent by reference, as every callable across processes).
    with pytest.raises(ValueError, match="importable by name"):
        tp2.collective_rpc(lambda worker: worker.rank)
    # A result that cannot travel back is an error, not a hang.
    with pytest.raises(RuntimeError, match="pickle|picklable"):
        tp2.collective_rpc(unpicklable_result)
    # The engine still serves after refused calls: the ranks stayed in step.
    assert tp2.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_unpicklable_exception_of_one_rank(tp2: LLM) -> None:
    """Rank 1 raises an exception that pickles but does not unpickle: the call fails with a RuntimeError naming
    the rank and the original text, and the engine serves on."""
    with pytest.raises(RuntimeError, match=r"rank 1.*TwoArgError.*left-right"):
        tp2.collective_rpc(raise_two_arg_error_on_rank1)
    assert tp2.collective_rpc(worker_rank) == [0, 1]
    assert tp2.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_unseeded_sampling_keeps_ranks_in_step(tp2: LLM) -> None:
    """Random sampling without a seed draws from the global random state, which every rank must hold alike
    (worker.py reseeds it at start-up): each rank's input batch, prompt and sampled tokens, equals rank 0's."""
    engine = tp2.llm_engine
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, return_sampling_mask=False)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"unseeded-{i}", prompt, params)
    outputs: dict[str, list[int]] = {}
    for _ in range(12):
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
    batches = tp2.collective_rpc(batch_token_ids)
    assert len(batches) == 2 and set(batches[0]) == {f"unseeded-{i}" for i in range(len(PROMPTS))}
    assert batches[1] == batches[0]
    # The driver's batch holds what the requests were given (an independent read of the same tokens).
    for i, prompt in enumerate(PROMPTS):
        row = batches[0][f"unseeded-{i}"]
        ids = prompt["prompt_token_ids"]
        assert row[:len(ids)] == ids and row[len(ids):len(ids) + len(outputs[f"unseeded-{i}"])] == \
            outputs[f"unseeded-{i}"]
    while engine.has_unfinished_requests():
        engine.step()


def test_sleep_and_wake_reach_every_rank(tp2: LLM, reference: dict[str, Outputs]) -> None:
    # verl's collective_rpc("sleep") / ("wake_up"): one result per rank, as vLLM's workers answer.
    assert tp2.collective_rpc("sleep", kwargs={"level": 1}) == [None, None]
    assert tp2.collective_rpc("sleeping_tags") == [{"weights", "kv_cache"}] * 2
    assert tp2.collective_rpc("wake_up") == [None, None]
    tp2.sleep(level=1)
    assert tp2.collective_rpc("sleeping_tags") == [{"weights", "kv_cache"}] * 2
    tp2.wake_up(tags=["weights"])
    assert tp2.collective_rpc("sleeping_tags") == [{"kv_cache"}] * 2
    tp2.wake_up()
    assert tp2.collective_rpc("sleeping_tags") == [set(), set()]
    assert _outputs(tp2) == reference["old"]


def test_disk_update_refused_by_one_rank_changes_no_rank(tp2: LLM, reference: dict[str, Outputs],
                                                         new_checkpoint: Path) -> None:
    """Every rank checks a folder before any rank loads it: rank 1 alone refusing leaves every rank's weights
    as they were, and the engine serves the old outputs."""
    name = "model.layers.1.mlp.down_proj.weight"
    before = tp2.collective_rpc(param_sum, args=(name,))
    tp2.collective_rpc(refuse_disk_check_on_rank1)
    try:
        with pytest.raises(ValueError, match="unreadable on this node"):
            tp2.llm_engine.engine_core.call_utility("load_weights_from_disk", str(new_checkpoint), "refused")
    finally:
        tp2.collective_rpc(restore_disk_check)
    assert tp2.collective_rpc(param_sum, args=(name,)) == before
    assert tp2.get_weight_version() != "refused"
    assert _outputs(tp2) == reference["old"]


def test_disk_weight_update_reaches_every_rank(tp2: LLM, reference: dict[str, Outputs],
                                               new_checkpoint: Path) -> None:
    """prime-rl's /update_weights {"weight_dir"} path (a disk load whatever the backend)."""
    name = "model.layers.1.mlp.down_proj.weight"
    before = tp2.collective_rpc(param_sum, args=(name,))
    tp2.llm_engine.engine_core.call_utility("load_weights_from_disk", str(new_checkpoint), "step-1")
    after = tp2.collective_rpc(param_sum, args=(name,))
    assert len(after) == 2 and all(a != b for a, b in zip(after, before))
    assert tp2.get_weight_version() == "step-1"
    assert _outputs(tp2) == reference["new"]


def _trainer(port: int, world_size: int, rounds: list[tuple[str, dict[str, Any]]]) -> None:
    """The trainer process: rank 0 of the weight group (world_size = 1 + the engine's ranks)."""
    from vllm.distributed.weight_transfer import NCCLWeightTransferEngine
    group = NCCLWeightTransferEngine.trainer_init({"master_address": "127.0.0.1", "master_port": port,
                                                   "world_size": world_size, "device": "cpu"})
    for which, args in rounds:
        weights = perturbed_weights(seed=3) if which == "new" else bundled_weights()
        NCCLWeightTransferEngine.trainer_send_weights(iter(sorted(weights.items())), {"group": group, **args})


def test_nccl_weight_update_reaches_every_rank(tp2: LLM, reference: dict[str, Outputs]) -> None:
    """vLLM's protocol with world_size = 1 + ranks: the trainer is rank 0, engine rank r is rank_offset + r."""
    port = get_open_port()
    packed = {"packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2}
    rounds = [("old", {"packed": False}), ("new", packed)]
    trainer = multiprocessing.get_context("spawn").Process(target=_trainer, args=(port, 3, rounds))
    trainer.start()
    try:
        tp2.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                                                       "rank_offset": 1, "world_size": 3}})
        for (which, args), version in zip(rounds, ("v2", "v3")):
            weights = perturbed_weights(seed=3) if which == "new" else bundled_weights()
            names = sorted(weights)
            tp2.start_weight_update()
            tp2.update_weights({"update_info": {
                "names": names, "dtype_names": [str(weights[n].dtype).removeprefix("torch.") for n in names],
                "shapes": [list(weights[n].shape) for n in names], **args}})
            tp2.finish_weight_update(version)
            assert _outputs(tp2) == reference[which]
    finally:
        trainer.join(60)
        if trainer.is_alive():
            trainer.kill()
    assert trainer.exitcode == 0


def test_load_failing_on_one_rank_stops_the_engine(new_checkpoint: Path) -> None:
    """Rank 1's load fails after rank 0 loaded (every check passed): the ranks' weights differ, so the update's
    call and every later request fail with EngineDeadError; no output is computed with mixed weights."""
    llm = LLM(**ENGINE, tensor_parallel_size=2)
    try:
        llm.collective_rpc(break_disk_load_on_rank1)
        with pytest.raises(EngineDeadError, match=r"failed on 1 of 2 tensor-parallel ranks.*disk went away"):
            llm.llm_engine.engine_core.call_utility("load_weights_from_disk", str(new_checkpoint), "mixed")
        assert isinstance(_generate_in_thread(llm, 60), EngineDeadError)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("rank", [0, 1])
def test_warm_up_failure_on_one_rank_fails_the_start(rank: int) -> None:
    """A start-up call (here the warm-up) fails on one rank while the other waits in a collective: the engine's
    start fails with that rank's error within a bound, instead of hanging."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"simulated warm-up failure on rank {rank}"):
        LLM(**ENGINE, tensor_parallel_size=2, worker_extension_cls=f"rl_worker_ext_startup_fail.FailOnRank{rank}")
    assert time.monotonic() - start < 120


@pytest.mark.parametrize("backend", ["mp", "uni"])
def test_one_rank_with_any_backend(backend: str, reference: dict[str, Outputs]) -> None:
    """vLLM accepts distributed_executor_backend="mp" (and "ray": test_ray_executor.py) at one rank: the worker
    runs in the engine core's process."""
    llm = LLM(**ENGINE, distributed_executor_backend=backend)
    try:
        assert type(llm.llm_engine.engine_core.engine_core.model_executor).__name__ == "UniProcExecutor"
        greedy = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [(list(o.outputs[0].token_ids), None) for o in greedy] == reference["old"][:len(PROMPTS)]
        assert llm.collective_rpc(worker_rank) == [0]
    finally:
        llm.llm_engine.shutdown()


def test_tp4_async_scheduling_outputs_equal_tp1(reference: dict[str, Outputs]) -> None:
    llm = LLM(**ENGINE, tensor_parallel_size=4, async_scheduling=True)
    try:
        assert _outputs(llm) == reference["old"]
        assert llm.collective_rpc(worker_rank) == [0, 1, 2, 3]
    finally:
        llm.llm_engine.shutdown()


def _generate_in_thread(llm: LLM, timeout_s: float) -> BaseException | None:
    """Run a generate call; its exception (None when it returned); fails the test when it hangs."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        except BaseException as e:  # noqa: BLE001
            box[0] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "generate hung after a worker died"
    return box[0]


@pytest.mark.parametrize("when", ["idle", "busy"])
def test_killed_worker_gives_engine_dead_error(when: str) -> None:
    llm = LLM(**ENGINE, tensor_parallel_size=2, worker_extension_cls=EXT)
    try:
        worker_pid = llm.collective_rpc("probe_pid")[1]
        if when == "busy":
            # Killed while steps run: the request in progress fails.
            engine = llm.llm_engine
            engine.add_request("r", PROMPTS[1], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True,
                                                                return_sampling_mask=False))
            engine.step()
            os.kill(worker_pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            with pytest.raises(EngineDeadError):
                while time.monotonic() < deadline:
                    engine.step()
        else:
            os.kill(worker_pid, signal.SIGKILL)
            error = _generate_in_thread(llm, 60)
            assert isinstance(error, EngineDeadError), error
        # Every later call fails the same way, at once.
        assert isinstance(_generate_in_thread(llm, 30), EngineDeadError)
    finally:
        llm.llm_engine.shutdown()


def test_worker_start_up_failure_fails_the_engine_start() -> None:
    """Rank 1 fails before it joins the group (its extension does not import there): the engine's start fails
    with an error, within a bound, instead of waiting for the rank."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="Engine core"):
        LLM(**ENGINE, tensor_parallel_size=2, worker_extension_cls="rl_worker_ext_rank0_only.Extension")
    assert time.monotonic() - start < 120


def test_data_parallel_engines_of_two_ranks_each(reference: dict[str, Outputs]) -> None:
    """DP=2 x TP=2 (AsyncLLM): each engine core has its own tensor-parallel world; collective_rpc runs on the four
    workers and answers with engine 0's two (vLLM's shape), engine 1's when data_parallel_rank=1 names it; a seeded
    request with masks on either engine equals TP=1's."""
    import asyncio

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**ENGINE, tensor_parallel_size=2, data_parallel_size=2))
        try:
            assert await engine.collective_rpc(dp_and_tp_rank) == [[0, 0], [0, 1]]
            assert await engine.collective_rpc(dp_and_tp_rank, data_parallel_rank=1) == [[1, 0], [1, 1]]
            want = reference["old"][len(PROMPTS)]  # the first prompt's seeded tokens and masks
            for rank in (0, 1):
                final = [o async for o in engine.generate(PROMPTS[0], SEEDED, f"r{rank}",
                                                          data_parallel_rank=rank)][-1].outputs[0]
                assert (list(final.token_ids), [list(m) for m in final.sampling_mask.token_ids]) == want
        finally:
            engine.shutdown()

    asyncio.run(run())
