"""The data-parallel client (DPLBAsyncMPClient) against two fake engine cores in child processes: each request
reaches exactly one engine (the least loaded, or the rank it names), aborts reach the engine that holds the
request, utility calls reach every engine and combine as documented (dp_client.py), the NCCL ranks are offset per
engine, weight updates are agreed (a dead engine during the drop is EngineDeadError; an update some engines applied
is WeightsOutOfStepError), and an engine that dies makes the client dead, naming its rank. The fakes answer with their own rank
(read from the config copy the launcher gave them), which is the reference for every routing check."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from types import SimpleNamespace
from typing import Any

import pytest

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, SchedulerStats
from vllm.v1.engine.core_client import EngineDeadError, make_async_client
from vllm.v1.engine.core_launch import device_env, engine_config, launch_engine_cores
from vllm.v1.engine.dp_client import (ENGINE_WIDE_RPC_METHODS, DPLBAsyncMPClient, check_data_parallel_rank,
                                      check_rpc_engine, parse_data_parallel_rank_header)
from vllm.v1.engine.weight_sync import WeightDrainError, WeightsOutOfStepError

TP = 2


class RankEchoEngineCore:
    """Answers each request once with its own data-parallel rank as the token; a request with max_tokens 1 then
    finishes, any other stays in the engine silently (so an idle loop waits instead of spinning) until aborted."""

    UTILITY_METHODS = frozenset({"collective_rpc", "reset_prefix_cache", "wake_up", "get_aborted",
                                 "init_broadcaster", "get_broadcaster", "refuse_on_rank_one", "abort_all_requests",
                                 "check_weight_update", "discard_weight_update", "update_weights", "get_calls",
                                 "check_weight_transfer_init", "init_weight_transfer_engine"})

    def __init__(self, vllm_config: Any) -> None:
        self.rank = vllm_config.parallel_config.data_parallel_rank
        self.num_gpu_blocks = 10 + self.rank
        self.pending: dict[str, EngineCoreRequest] = {}
        self.silent: dict[str, EngineCoreRequest] = {}
        self.aborted: list[str] = []
        self.broadcaster: int | None = None
        self.calls: list[str] = []  # the collective_rpc and weight-update calls this engine ran, in order

    def add_request(self, request: EngineCoreRequest) -> None:
        self.pending[request.request_id] = request

    def abort_requests(self, request_ids: list[str]) -> None:
        for req_id in request_ids:
            if self.pending.pop(req_id, None) is not None or self.silent.pop(req_id, None) is not None:
                self.aborted.append(req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self) -> EngineCoreOutputs:
        outputs = []
        for req_id, request in self.pending.items():
            done = request.sampling_params.max_tokens == 1
            outputs.append(EngineCoreOutput(req_id, [self.rank], finish_reason=FinishReason.LENGTH if done else None))
            if not done:
                self.silent[req_id] = request
        self.pending.clear()
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=SchedulerStats(num_running_reqs=len(self.silent)))

    def collective_rpc(self, method: str, timeout: float | None, args: tuple, kwargs: Any) -> list[str]:
        self.calls.append(f"rpc {method}")
        return [f"{method}@{self.rank}.{w}" for w in range(TP)]

    # The weight-update agreement (core.py's verdict: refusal text or None, whether every rank can drop it):
    # update_info {"refuse_on": [engine ranks], "receivable": bool} says what this fake answers.
    def check_weight_update(self, update_info: dict[str, Any]) -> tuple[str | None, bool]:
        self.calls.append("check")
        refuses = self.rank in update_info["refuse_on"]
        return (f"engine {self.rank} refuses" if refuses else None), update_info["receivable"]

    # update_info {"drop_fails": {rank: "dead" | "drain"}}: what engine rank's drop raises (as core.py's would);
    # {"update_refused_on": [ranks]}: those engines refuse at update_weights (changed by another caller since).
    def discard_weight_update(self, update_info: dict[str, Any]) -> None:
        self.calls.append("discard")
        fails = update_info.get("drop_fails", {}).get(self.rank)
        if fails == "dead":
            raise EngineDeadError(f"A tensor-parallel worker of engine {self.rank} failed")
        if fails == "drain":
            raise WeightDrainError(f"rank 0: RuntimeError: connection reset on engine {self.rank}")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append("update")
        if self.rank in update_info.get("update_refused_on", ()):
            raise ValueError(f"No weight update is in progress on engine {self.rank}")

    # Joining a trainer's group: TP workers of ranks rank_offset .. rank_offset + TP - 1 must fit in world_size.
    def check_weight_transfer_init(self, init_info: dict[str, Any]) -> str | None:
        self.calls.append(f"check init {init_info['rank_offset']}")
        if init_info["rank_offset"] + TP > init_info["world_size"]:
            return f"ranks from {init_info['rank_offset']} do not fit"
        return None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(f"init {init_info['rank_offset']}")

    def get_calls(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self.rank == 0

    def wake_up(self, tags: list[str] | None = None) -> bool:
        return self.rank == 1

    def get_aborted(self) -> list[str]:
        return list(self.aborted)

    def init_broadcaster(self, host: str, port: int, rank_offset: int, world_size: int, timeout: float) -> None:
        self.broadcaster = rank_offset

    def get_broadcaster(self) -> int | None:
        return self.broadcaster

    def refuse_on_rank_one(self) -> int:
        if self.rank == 1:
            raise ValueError("rank one refuses")
        return self.rank

    def abort_all_requests(self) -> int:
        count = len(self.pending) + len(self.silent)
        self.abort_requests([*self.pending, *self.silent])
        return count


def _config(dp: int = 2) -> Any:
    return SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=dp, data_parallel_rank=0,
                                                           tensor_parallel_size=TP),
                           device_config=SimpleNamespace(device="cpu"))


def _request(req_id: str, max_tokens: int = 2, rank: int | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(req_id, [1, 2], SamplingParams(max_tokens=max_tokens), None, 0.0,
                             data_parallel_rank=rank)


class Reader:
    """Reads a client's outputs in the background (utility results arrive among them)."""

    def __init__(self, client: DPLBAsyncMPClient) -> None:
        self.outputs: list[tuple[int, EngineCoreOutput]] = []
        self.task = asyncio.get_running_loop().create_task(self._run(client))

    async def _run(self, client: DPLBAsyncMPClient) -> None:
        while True:
            outs = await client.get_output_async()
            self.outputs += [(outs.engine_index, o) for o in outs.outputs]

    async def wait_for(self, req_ids: set[str]) -> dict[str, tuple[int, EngineCoreOutput]]:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            seen = {o.request_id: (e, o) for e, o in self.outputs if o.request_id in req_ids}
            if len(seen) == len(req_ids):
                return seen
            await asyncio.sleep(0.01)
        raise TimeoutError(f"no output for {req_ids - set(seen)}")


def _client() -> DPLBAsyncMPClient:
    client = make_async_client(_config())  # type: ignore[arg-type]
    assert isinstance(client, DPLBAsyncMPClient)
    return client


@pytest.fixture(autouse=True)
def _fork_fakes(monkeypatch: pytest.MonkeyPatch) -> None:
    """make_async_client starts the fakes (forked: the test module's class needs no import in the child)."""
    import vllm.v1.engine.core_client as core_client

    real = core_client.launch_engine_cores
    monkeypatch.setattr(core_client, "launch_engine_cores",
                        lambda config, n, factory=None, method="spawn": real(config, n, RankEchoEngineCore, "fork"))


def test_requests_spread_by_load_and_follow_their_rank() -> None:
    async def run() -> None:
        client = _client()
        reader = Reader(client)
        try:
            assert [i["engine_index"] for i in client.engines_ready_info] == [0, 1]
            assert [i["num_gpu_blocks"] for i in client.engines_ready_info] == [10, 11]
            # Eight requests that stay in flight: the in-flight counts alternate the engines, 4 and 4.
            for i in range(8):
                await client.add_request_async(_request(f"r{i}"))
            got = await reader.wait_for({f"r{i}" for i in range(8)})
            # The token is the rank the fake read from its own config; engine_index the rank its process stamped.
            assert all(e == o.new_token_ids[0] for e, o in got.values())
            assert sorted(e for e, _ in got.values()) == [0] * 4 + [1] * 4
            assert client.engine_inflight == [4, 4]
            # Named ranks go where they say, whatever the load.
            for i in range(3):
                await client.add_request_async(_request(f"pin{i}", rank=1))
            pinned = await reader.wait_for({f"pin{i}" for i in range(3)})
            assert {e for e, _ in pinned.values()} == {1} and client.engine_inflight == [4, 7]
            # The next unpinned requests go to the lighter engine 0 until the loads meet.
            for i in range(3):
                await client.add_request_async(_request(f"fill{i}"))
            assert {client.engine_index_of(f"fill{i}") for i in range(3)} == {0}
            with pytest.raises(VLLMValidationError, match="out of range"):
                await client.add_request_async(_request("bad", rank=2))
            assert "bad" not in client.reqs_in_flight

            # Aborts reach the engine holding each request, and only that one.
            await client.abort_requests_async(["r0", "r1", "pin0"])
            await asyncio.sleep(0.3)
            aborted = [await client.call_engine_async(e, "get_aborted", (), {}) for e in range(2)]
            assert sorted(aborted[0] + aborted[1]) == ["pin0", "r0", "r1"]
            assert all(got[r][0] == 0 for r in aborted[0] if r in got)
            assert all(pinned.get(r, got.get(r))[0] == 1 for r in aborted[1])
            assert client.engine_inflight == [sum(1 for e in client.reqs_in_flight.values() if e == 0),
                                              sum(1 for e in client.reqs_in_flight.values() if e == 1)]
            # A finished request leaves the books.
            await client.add_request_async(_request("short", max_tokens=1))
            await reader.wait_for({"short"})
            assert "short" not in client.reqs_in_flight
        finally:
            reader.task.cancel()
            client.shutdown()

    asyncio.run(run())


def test_utility_calls_reach_every_engine_and_combine() -> None:
    async def run() -> None:
        client = _client()
        reader = Reader(client)
        try:
            # vLLM's DP client: every engine runs it, the result is engine 0's workers' (one per TP rank).
            assert await client.call_utility_async("collective_rpc", "echo", None, (), None) == ["echo@0.0", "echo@0.1"]
            assert [await client.call_engine_async(e, "get_calls", (), {}) for e in range(2)] == [["rpc echo"]] * 2
            assert await client.call_utility_async("reset_prefix_cache", False, False) is False
            assert await client.call_utility_async("wake_up", None) is False
            for i in range(3):
                await client.add_request_async(_request(f"r{i}"))
            await reader.wait_for({"r0", "r1", "r2"})
            assert await client.call_utility_async("abort_all_requests") == 3
            # Each engine joins the trainer's group after the workers of the lower ranks.
            await client.call_utility_async("init_broadcaster", "h", 1, 5, 9, 1.0)
            assert [await client.call_engine_async(e, "get_broadcaster", (), {}) for e in range(2)] == [5, 5 + TP]
            # The same by keyword (prime-rl's /init_broadcaster sends its body's fields as keywords).
            await client.call_utility_async("init_broadcaster", host="h", port=1, rank_offset=7, world_size=9,
                                            timeout=1.0)
            assert [await client.call_engine_async(e, "get_broadcaster", (), {}) for e in range(2)] == [7, 7 + TP]
            with pytest.raises(ValueError, match="rank one refuses"):
                await client.call_utility_async("refuse_on_rank_one")
            with pytest.raises(ValueError, match="Unknown engine-core utility"):
                await client.call_utility_async("no_such_call")
        finally:
            reader.task.cancel()
            client.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize("refuse_on, receivable, want", [
    ([], True, [["check", "update"], ["check", "update"]]),
    ([1], True, [["check", "discard"], ["check", "discard"]]),       # every engine drops the trainer's bytes
    ([0, 1], True, [["check", "discard"], ["check", "discard"]]),
    ([1], False, [["check"], ["check"]]),                              # not every engine can receive: none tries
])
def test_update_weights_is_agreed_by_every_engine_first(refuse_on: list[int], receivable: bool,
                                                        want: list[list[str]]) -> None:
    """No engine receives an update (a collective with the trainer) unless every engine accepted it; a refusal by
    any engine is dropped by all of them when all can, and raised (weight_sync.py)."""
    async def run() -> None:
        client = _client()
        reader = Reader(client)
        try:
            info = {"refuse_on": refuse_on, "receivable": receivable}
            if not refuse_on:
                assert await client.call_utility_async("update_weights", info) is None
            else:
                refusal = "engine 1 refuses" if refuse_on == [1] else "engine 0 refuses"
                note = "dropped it" if receivable else "Nothing of this update was received"
                with pytest.raises(VLLMValidationError, match=rf"{refusal}.*{note}"):
                    await client.call_utility_async("update_weights", info)
            assert [await client.call_engine_async(e, "get_calls", (), {}) for e in range(2)] == want
        finally:
            reader.task.cancel()
            client.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize("drop_fails, want", [
    ({1: "dead"}, EngineDeadError),        # an engine dies during the drop: its death, not a refusal
    ({0: "drain", 1: "dead"}, EngineDeadError),
    ({1: "drain"}, VLLMValidationError),   # the drop failed: still the refusal, saying so
])
def test_a_failed_drop_on_some_engine(drop_fails: dict[int, str], want: type) -> None:
    async def run() -> None:
        client = _client()
        reader = Reader(client)
        try:
            info = {"refuse_on": [0], "receivable": True, "drop_fails": drop_fails}
            with pytest.raises(want) as caught:
                await client.call_utility_async("update_weights", info)
            if want is EngineDeadError:
                assert "engine 1 failed" in str(caught.value) and not isinstance(caught.value, ValueError)
            else:
                assert "engine 0 refuses" in str(caught.value)
                assert ("to drop it failed (engine 1: rank 0: RuntimeError: connection reset on engine 1); no "
                        "weight changed") in str(caught.value)
                assert isinstance(caught.value.__cause__, WeightDrainError)
            assert [await client.call_engine_async(e, "get_calls", (), {}) for e in range(2)] == \
                [["check", "discard"]] * 2
        finally:
            reader.task.cancel()
            client.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize("refused_on", [[1], [0], [0, 1]])
def test_an_update_some_engines_applied_is_engines_out_of_step(refused_on: list[int]) -> None:
    """Every engine accepted at the check, then some refused at the update (another caller changed them in
    between): engines that applied it and engines that did not -> WeightsOutOfStepError naming both, not the
    refusal's 'no weight changed'; every engine refusing -> the lowest rank's refusal."""
    async def run() -> None:
        client = _client()
        reader = Reader(client)
        try:
            info = {"refuse_on": [], "receivable": True, "update_refused_on": refused_on}
            if len(refused_on) == 2:
                with pytest.raises(ValueError, match="^No weight update is in progress on engine 0$"):
                    await client.call_utility_async("update_weights", info)
            else:
                applied, refused = 1 - refused_on[0], refused_on[0]
                with pytest.raises(WeightsOutOfStepError, match=rf"engines out of step: the weight update was "
                                   rf"applied by engine\(s\) {applied} but not by 1 of 2 engines \(engine "
                                   rf"{refused}: ValueError: No weight update is in progress on engine {refused}\)"):
                    await client.call_utility_async("update_weights", info)
            assert [await client.call_engine_async(e, "get_calls", (), {}) for e in range(2)] == \
                [["check", "update"]] * 2
        finally:
            reader.task.cancel()
            client.shutdown()

    asyncio.run(run())


def test_engine_wide_methods_cannot_name_one_engine() -> None:
    """sleep / wake_up and the weight-update methods with data_parallel_rank: refused, naming the method; without
    it, or another method with it, nothing is refused."""
    from vllm.v1.worker.worker import ENGINE_ONLY_METHODS
    for method in ("sleep", "wake_up", "update_weights", "start_weight_update", "load_weights_from_disk"):
        with pytest.raises(VLLMValidationError, match=rf"collective_rpc '{method}' cannot run on one data-parallel "
                                                      r"engine") as info:
            check_rpc_engine(method, 1)
        assert info.value.parameter == "data_parallel_rank"
        check_rpc_engine(method, None)
    check_rpc_engine("probe_parallel", 0)
    check_rpc_engine(len, 0)
    # Every weight method the workers keep for the engine is in the list.
    weight_methods = {m for m in ENGINE_ONLY_METHODS if "weight" in m or "broadcast" in m}
    assert weight_methods and weight_methods <= ENGINE_WIDE_RPC_METHODS


def test_joining_the_trainers_group_is_agreed_by_every_engine_first() -> None:
    """Engine i's workers take ranks after the lower engines'; a world_size too small for engine 1 is refused
    before engine 0 joins (it would wait in the rendezvous for workers that never come)."""
    async def run() -> None:
        client = _client()
        reader = Reader(client)
        try:
            async def calls() -> list[list[str]]:
                return [await client.call_engine_async(e, "get_calls", (), {}) for e in range(2)]

            with pytest.raises(VLLMValidationError, match=r"refused by 1 of 2 data-parallel engines.*engine 1: "
                                                          r"ranks from 3 do not fit.*No worker joined"):
                await client.call_utility_async("init_weight_transfer_engine", {"rank_offset": 1, "world_size": 3})
            assert await calls() == [["check init 1"], ["check init 3"]]
            await client.call_utility_async("init_weight_transfer_engine", {"rank_offset": 1, "world_size": 5})
            assert await calls() == [["check init 1", "init 1"], ["check init 3", "init 3"]]
        finally:
            reader.task.cancel()
            client.shutdown()

    asyncio.run(run())


def test_a_dead_rank_makes_the_client_dead() -> None:
    async def run() -> None:
        client = _client()
        try:
            os.kill(client.procs[1].pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="data-parallel rank 1"):
                await asyncio.wait_for(client.get_output_async(), 10)
            assert client.is_dead
            with pytest.raises(EngineDeadError):
                await client.add_request_async(_request("late"))
        finally:
            client.shutdown()

    asyncio.run(run())


def test_two_api_servers_reach_both_engines() -> None:
    """--api-server-count 2 with two engines: each client reaches both engines and gets only its own outputs."""
    async def run() -> None:
        procs, handles, tmp_dir = launch_engine_cores(_config(), 2, RankEchoEngineCore, "fork")
        clients = [DPLBAsyncMPClient(_config(), handle=h) for h in handles]
        readers = [Reader(c) for c in clients]
        try:
            assert [c.eng_start_index for c in clients] == [0, 1]
            for c, client in enumerate(clients):
                for i in range(4):
                    await client.add_request_async(_request(f"c{c}-{i}"))
            for c, reader in enumerate(readers):
                got = await reader.wait_for({f"c{c}-{i}" for i in range(4)})
                assert sorted(e for e, _ in got.values()) == [0, 0, 1, 1]
            await asyncio.sleep(0.2)
            assert all(o.request_id.startswith(f"c{c}-") for c, r in enumerate(readers) for _, o in r.outputs)
            assert await clients[1].call_utility_async("abort_all_requests") == 8
        finally:
            for reader in readers:
                reader.task.cancel()
            for client in clients:
                client.shutdown()
            for proc in procs:
                proc.kill()
                proc.join(5)
            import shutil
            shutil.rmtree(tmp_dir, ignore_errors=True)

    asyncio.run(run())


def test_rank_checks() -> None:
    assert check_data_parallel_rank(None, 2) is None and check_data_parallel_rank(1, 2) == 1
    for bad in (-1, 2, True, "1"):
        with pytest.raises(VLLMValidationError, match="data_parallel_rank"):
            check_data_parallel_rank(bad, 2)
    assert parse_data_parallel_rank_header(None, 2) is None
    assert parse_data_parallel_rank_header(" 1", 2) == 1
    with pytest.raises(VLLMValidationError, match="X-data-parallel-rank header must be an integer"):
        parse_data_parallel_rank_header("one", 2)
    with pytest.raises(VLLMValidationError, match=r"X-data-parallel-rank 1 is out of range \[0, 1\)"):
        parse_data_parallel_rank_header("1", 1)


def test_each_engine_gets_its_rank_and_its_devices() -> None:
    config = _config(3)
    assert [engine_config(config, e).parallel_config.data_parallel_rank for e in range(3)] == [0, 1, 2]
    assert config.parallel_config.data_parallel_rank == 0  # the frontend's copy is untouched
    assert device_env(config) == [{}, {}, {}]  # CPU: nothing to pick
    config.device_config.device = "cuda"
    assert device_env(config, visible=["0", "1", "2", "3", "4", "5"]) == [
        {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}, {"CUDA_VISIBLE_DEVICES": "4,5"}]
    assert device_env(config, visible=["7", "3", "5", "1", "2", "6", "0"])[1] == {"CUDA_VISIBLE_DEVICES": "5,1"}
    with pytest.raises(ValueError, match="needs 6 GPUs; 4 are visible"):
        device_env(config, visible=["0", "1", "2", "3"])
    config.device_config.device = "cuda:1"
    with pytest.raises(ValueError, match="its own devices"):
        device_env(config, visible=["0", "1", "2", "3", "4", "5"])


@pytest.mark.parametrize("args, kwargs, want_args, want_kwargs", [
    # init_weight_transfer_engine(init_info): the dict's rank_offset, positional or keyword.
    (({"rank_offset": 1, "world_size": 5},), {}, ({"rank_offset": 1 + TP, "world_size": 5},), {}),
    ((), {"init_info": {"rank_offset": 1, "world_size": 5}}, (), {"init_info": {"rank_offset": 1 + TP,
                                                                              "world_size": 5}}),
])
def test_rank_offset_of_init_weight_transfer_engine(args: tuple, kwargs: dict, want_args: tuple,
                                                    want_kwargs: dict) -> None:
    client = SimpleNamespace(tensor_parallel_size=TP)
    assert DPLBAsyncMPClient._engine_args(client, "init_weight_transfer_engine", args, kwargs, 1) == \
        (want_args, want_kwargs)  # type: ignore[arg-type]
    # Engine 0 keeps the trainer's offset; the caller's dict is not changed in place.
    assert DPLBAsyncMPClient._engine_args(client, "init_weight_transfer_engine", args, kwargs, 0) == \
        (args, kwargs)  # type: ignore[arg-type]
    assert (args or (kwargs["init_info"],))[0]["rank_offset"] == 1


def test_rank_offset_of_init_broadcaster_mixed_arguments() -> None:
    client = SimpleNamespace(tensor_parallel_size=TP)
    got = DPLBAsyncMPClient._engine_args(client, "init_broadcaster", ("h", 1), {"rank_offset": 3,  # type: ignore
                                                                                "inference_world_size": 9}, 1)
    assert got == (("h", 1), {"rank_offset": 3 + TP, "inference_world_size": 9})
